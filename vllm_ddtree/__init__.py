"""vllm-ddtree: DDTree speculative decoding (block-diffusion draft trees) for vLLM."""

__version__ = "0.1.0.dev0"
