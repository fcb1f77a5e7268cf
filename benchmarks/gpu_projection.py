"""A PROJECTION, on paper, of ddtree's decode throughput for Qwen3-8B on one GPU: nothing here ran on a GPU.

Per step of R requests (context 1K each), projected tokens per second = R x tau / step seconds, with
- tau (accepted tokens per step, bonus included) by tree budget B from an acceptance curve: ours, from
  the committed HumanEval replay (`benchmarks/results/budget_replay_164x256.json`, T = 0, the toy
  SmolLM2 drafter: far weaker than a Qwen3-8B DFlash drafter), and, with `--published-tau FILE`
  ({"source": ..., "tau": {"<B>": tau}}), DDTree's published per-budget tau for Qwen3-8B;
- the verify forward of R x (1 + B) rows from `CostModel`: fitted to the verify-cost curve a GPU check
  measured (part d of the newest `benchmarks/results/gpu/*.json`), or, until one exists, the
  published-figure roofline of the device (989 TFLOP/s, 3.35 TB/s for an H100; slope 1, no overhead);
- the drafter's pass over R x 16 rows: the same cost model for a 5-layer DFlash drafter of Qwen3-8B's
  width (its per-layer terms scaled by 5 / 36 of the target's; not measured);
- the tree step's own device work: part b's measured time at the nearest measured batch size, eager
  (as the engine runs it) and, where the capture worked, replayed from a CUDA graph (the "auto,
  graphed step" rows); 0 until a GPU check measured it (said in the output).

Methods: no speculation (R rows), the DFlash chain (R x 16 rows, the replay's chain tau), fixed budgets,
and the automatic budget's choice here: the budget whose projected rate is highest for the batch (what
the controller's cost model maximises; the controller itself also spreads nodes across requests).

    python benchmarks/gpu_projection.py [--device h100] [--json benchmarks/results/gpu_projection.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "benchmarks"))

import torch  # noqa: E402

from plotting import compact_png, plot_vs_budget, save_results  # noqa: E402
from vllm_ddtree.tree import CostModel, ModelShape, get_profile  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)
DRAFTER_LAYERS = 5  # z-lab's Qwen3-8B DFlash drafter (block 16)
BLOCK = 16
CONTEXT = 1024
BATCHES = (1, 8, 32, 64)
REPLAY = REPO / "benchmarks" / "results" / "budget_replay_164x256.json"
GPU_RESULTS = REPO / "benchmarks" / "results" / "gpu"


def newest_gpu_check(device: str) -> dict | None:
    """The newest GPU check report for `device` whose verify-cost part was fitted (None: none yet)."""
    found = []
    for path in sorted(GPU_RESULTS.glob("*.json")):
        report = json.loads(path.read_text())
        parts = {p["name"]: p for p in report.get("parts", [])}
        d = parts.get("d.verify_cost", {})
        if report.get("device_slug") == device and d.get("fitted") and d.get("passed"):
            found.append((path.stat().st_mtime, path, report))
    return max(found, key=lambda f: f[0])[2] | {"_path": str(max(found, key=lambda f: f[0])[1].relative_to(REPO))} if found else None


def cost_models(device: str, report: dict | None) -> tuple[CostModel, CostModel, str]:
    """(target verify, drafter) cost models and a sentence saying where their numbers come from."""
    target = ModelShape.from_hf_config(QWEN3_8B, "bfloat16")
    drafter = ModelShape.from_hf_config(QWEN3_8B | {"num_hidden_layers": DRAFTER_LAYERS}, "bfloat16")
    profile = get_profile(device)
    if report is None:
        source = (f"published-figure roofline of the {device.upper()} ({profile.peak_flops / 1e12:.0f} TFLOP/s, "
                  f"{profile.bandwidth / 1e12:.2f} TB/s; no overhead): no GPU check has measured it yet")
        return CostModel(target, profile), CostModel(drafter, profile), source
    fit = {p["name"]: p for p in report["parts"]}["d.verify_cost"]["fitted"]
    profile = get_profile(fit["profile"])  # the fit's slope is relative to the roofline it was fitted against
    coef = dict(slope=fit["slope"], intercept=fit["intercept_ms"] / 1e3, per_token=fit["per_token_ms"] / 1e3,
                knee=fit["knee_tokens"])
    share = DRAFTER_LAYERS / QWEN3_8B["num_hidden_layers"]
    drafter_coef = dict(coef, intercept=coef["intercept"] * share, per_token=coef["per_token"] * share)
    source = (f"CostModel fitted to the verify-cost curve measured on {report['device']} "
              f"({report['_path']}, torch {report['torch']}, CUDA {report['cuda']})")
    return CostModel(target, profile, **coef), CostModel(drafter, profile, **drafter_coef), source


def pipeline_ms(report: dict | None) -> tuple[dict[str, dict[int, float]], str]:
    """Measured tree-step milliseconds by batch size: {"eager": ..., "graphed": ...} ("graphed" only
    where the capture worked). The engine runs the step eagerly; the replay is what a captured step
    would cost."""
    if report is None:
        return {"eager": {}}, "tree step's device work not measured on a GPU yet: counted as 0"
    parts = {p["name"]: p for p in report["parts"]}
    # The check times the eager step twice (b.pipeline early, b.graphs last); host-bound, the two medians
    # have differed by up to 2x in one run. The engine's host does more besides: take the larger.
    eager: dict[int, float] = {}
    for step in parts.get("b.pipeline", {}).get("steps", []) + parts.get("b.graphs", {}).get("captures", []):
        if "eager_ms" in step and step.get("variant") == "plain":
            eager[step["batch"]] = max(eager.get(step["batch"], 0.0), step["eager_ms"])
    replayed = {c["batch"]: c["replay_ms"] for c in parts.get("b.graphs", {}).get("captures", [])
                if c.get("variant") == "plain" and "replay_ms" in c and c.get("replay_equals_eager")}
    kinds = {"eager": eager} | ({"graphed": replayed} if replayed else {})
    return kinds, (f"tree step's device work measured on {report['device']} (plain trees): eager, as the "
                   "engine runs it (the larger of the check's two eager medians)"
                   + (", and replayed from a CUDA graph (the 'graphed step' rows)" if replayed else ""))


def nearest(table: dict[int, float], batch: int) -> float:
    """The value at the measured batch size nearest to `batch` in log scale (0 with no table)."""
    if not table:
        return 0.0
    return table[min(table, key=lambda b: abs(math.log(b) - math.log(batch)))]


def verify_s(cost: CostModel, r: int, rows: int) -> float:
    """Seconds of one forward over r requests x `rows` new rows after CONTEXT cached tokens each."""
    s = r * rows
    return float(cost.verify_seconds(torch.tensor(float(s)), torch.tensor(float(s * (CONTEXT + rows))),
                                     torch.tensor(float(r * CONTEXT))))


def acceptance_curves(published: Path | None) -> dict[str, dict]:
    """{name: {"source", "chain_tau", "tau": {B: tau}}}: ours from the replay, and the published one if given."""
    rows = json.loads(REPLAY.read_text())
    ours = {"source": f"{REPLAY.relative_to(REPO)} (HumanEval, 164 prompts x 256 tokens, T = 0, toy SmolLM2 "
                      "drafter; n-gram weight 0)",
            "chain_tau": next(r["tau"] for r in rows if r["method"] == "dflash" and r["ngram_weight"] == 0),
            "tau": {r["budget"]: r["tau"] for r in rows
                    if r["method"] == "fixed" and r["ngram_weight"] == 0 and r["temperature"] == 0}}
    curves = {"ours": ours}
    if published is not None:
        data = json.loads(published.read_text())
        curves["published"] = {"source": data["source"], "chain_tau": data.get("chain_tau"),
                               "tau": {int(b): float(t) for b, t in data["tau"].items()}}
    return curves


def shown_budget(b: int) -> bool:
    """Budgets written out and drawn (the pick is made over every budget of the curve)."""
    return b <= 16 or b % 8 == 0


def project(curve: dict, target: CostModel, drafter: CostModel, tree_ms: dict[int, float]) -> list[dict]:
    """Projected rows for one acceptance curve at every batch size."""
    out = []
    for r in BATCHES:
        none_s = verify_s(target, r, 1)
        draft_s = verify_s(drafter, r, BLOCK)
        base = {"batch": r, "curve": curve["name"]}
        none_rate = r / none_s
        rows = [dict(base, method="none", budget=None, tau=1.0, step_ms=1e3 * none_s, tokens_per_s=none_rate)]
        if curve.get("chain_tau"):
            chain_s = verify_s(target, r, BLOCK) + draft_s
            rows.append(dict(base, method="chain", budget=None, tau=curve["chain_tau"], step_ms=1e3 * chain_s,
                             tokens_per_s=r * curve["chain_tau"] / chain_s))
        for kind, table in tree_ms.items():  # fixed budgets with the eager step; "auto": the best budget
            tree_s = nearest(table, r) / 1e3
            fixed = []
            for b, tau in sorted(curve["tau"].items()):
                step = verify_s(target, r, 1 + b) + draft_s + tree_s
                fixed.append(dict(base, method="fixed", budget=b, tau=tau, step_ms=1e3 * step,
                                  tokens_per_s=r * tau / step))
            best = max(fixed, key=lambda x: x["tokens_per_s"])
            if kind == "eager":
                rows += [x for x in fixed if shown_budget(x["budget"]) or x is best]
            rows.append(dict(best, method="auto" if kind == "eager" else f"auto, {kind} step"))
        chain = next((x["tokens_per_s"] for x in rows if x["method"] == "chain"), None)
        for x in rows:
            x["speedup_vs_none"] = x["tokens_per_s"] / none_rate
            x["vs_chain"] = x["tokens_per_s"] / chain if chain else None
            for k in ("tau", "step_ms", "tokens_per_s", "speedup_vs_none", "vs_chain"):
                x[k] = None if x[k] is None else float(f"{x[k]:.4g}")
        out += rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="h100", choices=("h100", "h200"))
    ap.add_argument("--published-tau", type=Path, help="DDTree's per-budget tau for Qwen3-8B: JSON {source, tau}")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "gpu_projection.json"))
    args = ap.parse_args()
    report = newest_gpu_check(args.device)
    target, drafter, cost_source = cost_models(args.device, report)
    tree_ms, tree_source = pipeline_ms(report)
    curves = acceptance_curves(args.published_tau)
    rows = []
    for name, curve in curves.items():
        rows += project(curve | {"name": name}, target, drafter, tree_ms)
    picks = {f"{c}@{r['batch']}" + r["method"][4:]: r["budget"] for r in rows if r["method"].startswith("auto")
             for c in [r["curve"]]}
    result = {"kind": "PROJECTION: computed from a cost model and replayed acceptance, not measured end to end",
              "device": args.device, "context": CONTEXT, "cost_source": cost_source,
              "drafter": f"{DRAFTER_LAYERS}-layer DFlash drafter of Qwen3-8B's width over {BLOCK} rows: modelled",
              "tree_step_source": tree_source, "acceptance": {k: v["source"] for k, v in curves.items()},
              "published_tau": "given" if "published" in curves else
              "not given (--published-tau): only our acceptance curve is projected",
              "auto_budget_pick": picks, "rows": rows}
    for r in rows:
        if r["method"] in ("none", "chain") or r["method"].startswith("auto"):
            print(f"PROJECTION {r['curve']:<9} batch {r['batch']:>3} {r['method']:<6} B={str(r['budget']):>4} "
                  f"tau {r['tau']:.2f}  {r['step_ms']:7.2f} ms  {r['tokens_per_s']:8.0f} tok/s  "
                  f"x{r['speedup_vs_none']:.2f} none" + (f"  x{r['vs_chain']:.2f} chain" if r["vs_chain"] else ""))
    print(f"cost: {cost_source}\ntree step: {tree_source}")

    def plot(png: str) -> None:
        shown = [dict(r, method=f"{r['method']}" if r["curve"] == "ours" else f"{r['method']} ({r['curve']})")
                 for r in rows if not r["method"].startswith("auto")]
        series = [("fixed", "o-", "fixed budget (ours)"), ("fixed (published)", "s-", "fixed budget (published tau)")]
        plot_vs_budget(shown, "batch", list(BATCHES), "PROJECTION, batch {} (not measured)", series,
                       [("none", "black"), ("chain", "tab:red"), ("chain (published)", "tab:purple")],
                       [("tokens_per_s", "projected tokens/s"), ("speedup_vs_none", "x no speculation")], png)
        compact_png(png, colors=64)  # fewer colours than plot_vs_budget's: a fifth of the RGBA bytes

    save_results(result, args.json, plot=plot)


if __name__ == "__main__":
    main()
