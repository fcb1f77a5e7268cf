"""vLLM general plugin entry point (``vllm.general_plugins: ddtree``).

vLLM calls :func:`register` in every process it starts (``EngineArgs.__post_init__``, the engine
core, each worker) before any config is built, so the patches are in place wherever a
``SpeculativeConfig(method="ddtree", ...)`` is validated or unpickled.
"""

from __future__ import annotations


def register() -> None:
    """Apply vllm-ddtree's patches to vLLM (idempotent).

    Raises :class:`vllm_ddtree.vllm_patches.UnsupportedVLLMVersion` on a vLLM version the patches
    were not written for: failing at start-up is better than patching code we have not read.
    """
    from vllm_ddtree import vllm_patches

    vllm_patches.apply()
