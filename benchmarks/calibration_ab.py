"""The automatic budget as served against one part of its calibration switched off, side by side
(a measurement, not a test).

    python benchmarks/calibration_ab.py [--compare reliability|residual|gate] [--temperature T] [--prompts 8]
        [--max-new-tokens 128] [--rounds 2] [--json PATH] [--plot PNG]

Reference decoder, HumanEval prompts, float32, batch 1, n-gram weight 0.2, with and without an
8-token prompt-lookup path. For each: the fixed budgets 8 and 16, the automatic budget as served
("bins" / "table"), and the same controller without one part:
- `--compare reliability` (default): one confidence exponent only ("one-exponent":
  `AcceptanceCalibration(prior=1e12)`, so every bin's factor stays 1, the calibration before `23f7417`);
- `--compare residual`: the step cost's smooth fit only ("smooth": `CostCalibration(residual=False)`,
  no per-size residual table, the cost model before `5c9a5b7`);
- `--compare gate`: the controller that may also choose no tree ("gated": min_budget 0, a
  `SpeculationGate`) against the one that always drafts ("always-drafts": min_budget 1).
One process, every method back to back on each prompt, `--rounds` passes over the prompts; medians
over rounds of tokens/s, tau and mean verified nodes. At T = 0 greedy outputs must all equal AR's
(counted); at T > 0 prompt i samples with seed i in every method.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from tqdm import tqdm

from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval
from vllm_ddtree.reference import ReferenceDecoder, SamplingConfig, SpecConfig
from vllm_ddtree.reference.pair import load_pair
from vllm_ddtree.tree import AcceptanceCalibration

VARIANTS = {"reliability": ("bins", "one-exponent"), "residual": ("table", "smooth"), "gate": ("gated", "always-drafts")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", choices=sorted(VARIANTS), default="reliability",
                    help="which part of the calibration the second controller goes without")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ngram-weight", type=float, default=0.2)
    ap.add_argument("--max-budget", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    pair = load_pair()
    # Two decoders on the same models: each keeps its own automatic-budget controllers.
    served = ReferenceDecoder(pair.target, pair.drafter, eos_token_ids=pair.eos_token_ids)
    without = ReferenceDecoder(pair.target, pair.drafter, eos_token_ids=pair.eos_token_ids)
    label_on, label_off = VARIANTS[args.compare]
    prompts = [pair.tokenizer(chat_prompt(pair.tokenizer, p["prompt"]), add_special_tokens=False)["input_ids"]
               for p in load_humaneval(args.prompts)]
    grid = [("ar", None, served, SpecConfig(method="ar"))]
    for lookup in (0, 8):
        name = "ddtree+ngram" + ("+lookup" if lookup else "")
        kw = dict(method="ddtree", ngram_weight=args.ngram_weight, prompt_lookup_tokens=lookup)
        grid += [(name, b, served, SpecConfig(budget=b, **kw)) for b in (8, 16)]
        auto = SpecConfig(budget=args.max_budget, adaptive=True, **kw)
        auto_on = SpecConfig(budget=args.max_budget, adaptive=True, min_budget=0, **kw) if args.compare == "gate" else auto
        grid += [(f"{name}-auto {label_on}", None, served, auto_on), (f"{name}-auto {label_off}", None, without, auto)]
        if args.compare == "reliability":
            without.auto_budget(auto).acceptance = AcceptanceCalibration(prior=1e12)
        elif args.compare == "residual":
            without.auto_budget(auto).calibration.residual = False

    per_round = {(n, b): [] for n, b, _, _ in grid}  # (tokens/s, tau, nodes) per round
    mismatches = 0
    for r in range(args.rounds):
        tot = {(n, b): [0, 0.0, 0, 0] for n, b, _, _ in grid}  # tokens, seconds, steps, nodes
        for i, ids in enumerate(tqdm(prompts, desc=f"round {r + 1}/{args.rounds}")):
            ar_tokens = None
            for name, budget, dec, spec in grid:
                res = dec.generate(ids, args.max_new_tokens, spec, SamplingConfig(temperature=args.temperature, seed=i))
                ar_tokens = ar_tokens or res.tokens
                mismatches += args.temperature == 0 and res.tokens != ar_tokens
                t = tot[(name, budget)]
                t[0] += len(res.tokens)
                t[1] += res.seconds
                t[2] += len(res.accept_lengths)
                t[3] += sum(res.budgets)
        for key, (tokens, secs, steps, nodes) in tot.items():
            per_round[key].append((tokens / secs, tokens / steps, nodes / steps))

    rows = []
    controllers = {(n, b): dec.auto_budget(spec).summary() for n, b, dec, spec in grid if spec.adaptive}
    print(f"\n{args.prompts} prompts x {args.max_new_tokens} tokens, T = {args.temperature:g}, {args.rounds} rounds; "
          f"greedy outputs differing from AR: {mismatches if args.temperature == 0 else '-'}")
    print(f"{'method':<36}{'B':>4}{'tau':>7}{'nodes':>7}{'tok/s':>8}  rounds")
    for (name, budget), runs in per_round.items():
        tps, tau, nodes = (statistics.median(x[i] for x in runs) for i in range(3))
        rows.append(dict(method=name, budget=budget, temperature=args.temperature, tau=tau, mean_verified_nodes=nodes,
                         tokens_per_s=tps, runs_tokens_per_s=[x[0] for x in runs],
                         mismatches_vs_ar=mismatches if args.temperature == 0 else None)
                    | ({"controller": controllers[(name, budget)]} if (name, budget) in controllers else {}))
        gate = controllers.get((name, budget), {})
        gated = (f"  gate: {gate['gate_undrafted_steps']} of {gate['gate_undrafted_steps'] + gate['gate_drafted_steps']}"
                 f" steps undrafted, advantage {gate['gate_advantage']}" if "gate_advantage" in gate else "")
        print(f"{name:<36}{budget or '-':>4}{tau:>7.2f}{nodes:>7.1f}{tps:>8.1f}  {[round(x[0], 1) for x in runs]}{gated}")
    from plotting import save_results

    save_results(rows, args.json, args.plot, lambda png: plot_bars(rows, png))


def plot_bars(rows: list[dict], path: str) -> None:
    """tokens/s and mean verified nodes per method, one bar each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plotting import save_png

    labels = [r["method"] + (f" B={r['budget']}" if r["budget"] else "") for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.5), sharey=True)
    for ax, key, title in zip(axes, ("tokens_per_s", "mean_verified_nodes"), ("tokens/s (median)", "verified nodes")):
        colors = ["tab:green" if lab.endswith(("bins", "table", "gated"))
                  else "tab:gray" if lab.endswith(("one-exponent", "smooth", "always-drafts"))
                  else "tab:blue" for lab in labels]
        ax.barh(range(len(rows)), [r[key] for r in rows], color=colors)
        ax.set_title(title)
    axes[0].set_yticks(range(len(rows)), labels)
    axes[0].invert_yaxis()
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
