"""vLLM general plugin entry point (``vllm.general_plugins: ddtree``).

vLLM calls :func:`register` in every process it starts (``EngineArgs.__post_init__``, the engine
core, each worker) before any config is built, so the patches are in place wherever a
``SpeculativeConfig(method="ddtree", ...)`` is validated or unpickled.

vLLM calls general plugins without a guard: an exception here would stop every vLLM start, with
or without ddtree. So :func:`register` never raises: on a vLLM the patches do not fit it logs one
warning and leaves vLLM's code untouched, and every other speculative method (and none) works as usual.
Where that vLLM has a public registry of custom speculative methods (0.34's
``register_speculative_method``), ``ddtree`` is registered there as a method whose set-up refuses with
the same reason, so ``{"method": "ddtree"}`` fails with what to install rather than "Unknown
speculative method".
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
        try:
            _register_refusal(str(e))
        except Exception:  # noqa: BLE001 — an API that changed again: vLLM's own error stays
            pass


def _register_refusal(reason: str) -> None:
    """Register ``ddtree`` in vLLM's custom speculative-method registry, where it has one, as a method
    whose set-up raises ``ValueError(reason)``: the user's config is refused with the reason."""
    try:
        from vllm.v1.worker.gpu.spec_decode import speculator_config
    except ImportError:  # vLLM 0.32 / 0.33: no registry; vLLM's own error lists the methods it has
        return

    class DDTreeUnavailable(speculator_config.SpeculatorConfig):
        """``method: ddtree`` on a vLLM the plugin does not patch."""

        speculator_class = "vllm_ddtree.plugin.DDTreeUnavailable"  # never built: set-up refuses first

        @classmethod
        def default_model(cls, spec) -> None:
            raise ValueError(reason)

        @classmethod
        def configure(cls, spec) -> None:
            raise ValueError(reason)

    speculator_config.register_speculative_method("ddtree", DDTreeUnavailable)
