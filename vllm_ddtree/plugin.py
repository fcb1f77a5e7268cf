"""vLLM general plugin entry point (``vllm.general_plugins: ddtree``).

vLLM calls :func:`register` in every process it starts (``EngineArgs.__post_init__``, the engine
core, each worker) before any config is built, so the patches are in place wherever a
``SpeculativeConfig(method="ddtree", ...)`` is validated or unpickled.

vLLM calls general plugins without a guard: an exception here would stop every vLLM start, with
or without ddtree. So :func:`register` never raises: on a vLLM the patches do not fit it logs one
warning and leaves vLLM untouched, and every other speculative method (and none) works as usual.
"""

from __future__ import annotations


def register() -> None:
    """Apply vllm-ddtree's patches to vLLM where they fit it (idempotent; never raises).

    On a vLLM whose patched code differs from 0.32.0's (see :mod:`vllm_ddtree.compat`), or if a
    patch fails, vLLM is left as it was and a warning says why; ``method: ddtree`` is then
    unavailable in that process.
    """
    import logging

    try:
        from vllm_ddtree import vllm_patches

        vllm_patches.apply()
    except Exception as e:  # noqa: BLE001 — whatever happened, vLLM must still start
        logger = logging.getLogger("vllm.ddtree")
        logger.warning("vllm-ddtree is disabled in this process and vLLM runs unpatched: %s", e)
