"""`make demo`: DDTree on the toy pair (SmolLM2-135M-Instruct + our DFlash drafter), side by side.

Until the vLLM engine path lands (issue 4), the demo runs the reference decoder (transformers,
float32, batch 1): for a few HumanEval prompts it decodes with the target alone, DFlash's chain and
DDTree (fixed budget, n-gram scoring, adaptive budget), checks that every greedy output is
token-identical to the target's, and prints tau (tokens per target forward, bonus included),
tokens/s and the speedup against the target alone, measured in this run.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3, help="HumanEval prompts to decode")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=32, help="DDTree's fixed tree budget (draft nodes)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval
    from vllm_ddtree.reference import ReferenceDecoder, SpecConfig
    from vllm_ddtree.reference.pair import load_pair

    print("loading SmolLM2-135M-Instruct (prepared from PyPI's GGUF on first use) and the DFlash drafter ...")
    pair = load_pair()
    decoder = ReferenceDecoder(pair.target, pair.drafter, eos_token_ids=pair.eos_token_ids)
    print("calibrating the cost model for the adaptive budget ...")
    decoder.calibrate()
    methods = {
        "target alone": SpecConfig(method="ar"),
        "dflash chain": SpecConfig(method="dflash"),
        f"ddtree B={args.budget}": SpecConfig(method="ddtree", budget=args.budget),
        f"ddtree B={args.budget} +ngram": SpecConfig(method="ddtree", budget=args.budget, ngram_weight=0.2),
        "ddtree auto": SpecConfig(method="ddtree", budget=4 * args.budget, adaptive=True),
    }
    stats = {name: {"tokens": 0, "seconds": 0.0, "tau": []} for name in methods}
    identical = True
    for problem in load_humaneval(args.prompts):
        text = chat_prompt(pair.tokenizer, problem["prompt"])
        ids = pair.tokenizer(text, add_special_tokens=False)["input_ids"]
        reference = None
        for name, spec in methods.items():
            res = decoder.generate(ids, args.max_new_tokens, spec)
            s = stats[name]
            s["tokens"] += len(res.tokens)
            s["seconds"] += res.seconds
            s["tau"].append(res.tau if spec.method != "ar" else 1.0)
            if reference is None:
                reference = res.tokens
            elif res.tokens != reference:
                identical = False
                print(f"  !! {name} differs from the target alone on {problem['task_id']}")
            if name.startswith("ddtree B") and not name.endswith("ngram"):
                shown = pair.tokenizer.decode(res.tokens, skip_special_tokens=True)
                print(f"\n=== {problem['task_id']} ({name}, tau {res.tau:.2f}) ===\n{shown.strip()[:600]}")
    ar_tps = stats["target alone"]["tokens"] / stats["target alone"]["seconds"]
    print(f"\n{args.prompts} HumanEval prompts, up to {args.max_new_tokens} new tokens, float32, batch 1")
    print(f"{'method':<24}{'tau':>7}{'tok/s':>9}{'vs target':>11}")
    for name, s in stats.items():
        tps = s["tokens"] / s["seconds"]
        print(f"{name:<24}{statistics.mean(s['tau']):>7.2f}{tps:>9.1f}{tps / ar_tps:>10.2f}x")
    print("greedy outputs token-identical to the target alone:", "yes" if identical else "NO")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
