"""Attention backends of vllm-ddtree (the CPU tree-mask backend; the GPU FlashInfer path comes later)."""
