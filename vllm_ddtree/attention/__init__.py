"""Attention backends of vllm-ddtree: the CPU tree-mask backend (`cpu_tree`), the GPU shim over vLLM's
FlashInfer backend (`flashinfer_tree`, needs CUDA and flashinfer-python), and the masks both use (`tree_mask`)."""
