"""Model preparation: the target (SmolLM2-135M-Instruct) rebuilt from a PyPI-shipped GGUF."""
