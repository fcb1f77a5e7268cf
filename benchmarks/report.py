"""Write docs/benchmarks.md from the committed result files, so that no figure in it is typed by hand.

    python benchmarks/report.py            # (re)write docs/benchmarks.md
    python benchmarks/report.py --check    # exit 1 if docs/benchmarks.md differs from what it would write

Every ``*.json`` under ``benchmarks/results/`` (subfolders included, e.g. ``gpu/``) becomes a table.
What a file measured and how it was produced (title, engine, device, model, drafter, date, command)
comes from ``benchmarks/results/studies.json``, or from the file itself when it is an object with a
``meta`` block (``{"meta": {"title": ..., "device": ..., "command": ...}, "rows": [...]}``); a file
known to neither is still listed, under "Other results", with the fields it has. Settings that the
rows carry (prompts, batch sizes, budgets, temperature, repeats) are read from the rows. A PNG next
to a JSON is linked. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
STUDIES = RESULTS / "studies.json"
OUT = ROOT / "docs" / "benchmarks.md"


# ---- formatting --------------------------------------------------------------------------------

def fmt(v, digits: int = 2) -> str:
    """A cell: floats with `digits` decimals (one at 100 and above), None as '–'."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.1f}" if abs(v) >= 100 and digits > 1 else f"{v:.{digits}f}"
    if isinstance(v, (list, tuple)):
        return " / ".join(fmt(x, digits) for x in v)
    return str(v).replace("|", "\\|")


def table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in r) + " |" for r in rows]
    return out


def ratio(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def percent(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def unique(values) -> list:
    seen = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


# ---- one renderer per kind of result file ------------------------------------------------------

def _label(study: dict, method: str) -> str:
    return study.get("labels", {}).get(method, method)


def render_vllm_e2e(study: dict, rows: list[dict]) -> list[str]:
    """Method (and budget) per line, one group of columns per batch size: τ, tok/s, vs none, nodes."""
    batches = unique(r["batch"] for r in rows)
    keys = unique((r["method"], r.get("budget")) for r in rows)
    by = {(r["method"], r.get("budget"), r["batch"]): r for r in rows}
    gated = any("gated" in r["method"] for r in rows)
    # Where greedy outputs differ (another dtype than float32): how far they agree, against the target
    # alone at the same batch and at the smallest one.
    agree = any(r.get("identical_to_ar") is False for r in rows)
    first = min(batches)
    header = ["method", "B"]
    for b in batches:
        header += [f"batch {b}: τ", "tok/s", "vs none", "nodes"] + (["undrafted"] if gated else [])
        header += ["agrees with none", f"with none at batch {first}"] if agree else []
    width = 4 + gated + 2 * agree
    body = []
    for m, budget in keys:
        line = [_label(study, m), fmt(budget)]
        for b in batches:
            r = by.get((m, budget, b))
            if r is None:
                line += ["–"] * width
                continue
            dd = r.get("ddtree") or {}
            line += [fmt(r["tau"]), fmt(r["tokens_per_s"], 1), ratio(r.get("speedup_vs_ar")),
                     fmt(dd.get("mean_tree_nodes"), 1)]
            if gated:
                done = dd.get("gate_drafted_steps", 0) + dd.get("gate_undrafted_steps", 0)
                share = dd["gate_undrafted_steps"] / done if done else None
                line.append("–" if share is None else f"{100 * share:.0f}%")
            if agree:
                line += [percent(r.get("agreement_vs_ar")), percent(r.get("agreement_vs_ar_smallest_batch"))]
        body.append(line)
    notes = ["", "Agreement: the mean share of the target alone's greedy tokens an output repeats before its "
             "first difference."] if agree else []
    return table(header, body) + notes


def render_acceptance(study: dict, rows: list[dict]) -> list[str]:
    has_step = any("step_ms_median" in r for r in rows)
    header = ["method", "B", "T", "τ", "tok/s", "vs AR", "nodes"] + (["step ms"] if has_step else []) + ["outputs ≠ AR"]
    body = []
    for r in rows:
        line = [r["method"], fmt(r.get("budget")), fmt(r["temperature"], 0), fmt(r["tau"]), fmt(r["tokens_per_s"], 1),
                ratio(r.get("speedup_vs_ar")), fmt(r.get("mean_verified_nodes"), 1)]
        if has_step:
            line.append(fmt(r.get("step_ms_median"), 1))
        line.append(fmt(r.get("mismatches_vs_ar")))
        body.append(line)
    return table(header, body)


def render_ab(study: dict, rows: list[dict]) -> list[str]:
    header = ["method", "B", "T", "τ", "nodes", "tok/s (median)", "tok/s per round", "outputs ≠ AR"]
    body = [[r["method"], fmt(r.get("budget")), fmt(r["temperature"], 0), fmt(r["tau"]),
             fmt(r.get("mean_verified_nodes"), 1), fmt(r["tokens_per_s"], 1), fmt(r.get("runs_tokens_per_s"), 1),
             fmt(r.get("mismatches_vs_ar"))] for r in rows]
    return table(header, body)


def render_budget_replay(study: dict, rows: list[dict]) -> list[str]:
    """τ of fixed budgets at powers of two per n-gram weight, then every rule's τ and modelled tok/s."""
    weights = unique(r["ngram_weight"] for r in rows if r["method"] == "fixed")
    budgets = sorted({r["budget"] for r in rows if r["method"] == "fixed"})
    shown = [b for b in budgets if b & (b - 1) == 0]
    out = ["Fixed budgets, exact τ:", ""]
    body = []
    for w in weights:
        fixed = {r["budget"]: r for r in rows if r["method"] == "fixed" and r["ngram_weight"] == w}
        body.append([f"DDTree, n-gram weight {fmt(w, 1)}"] + [fmt(fixed[b]["tau"]) for b in shown if b in fixed])
    out += table(["method"] + [f"τ at B = {b}" for b in shown], body)
    out += ["", "Rules (tok/s modelled; 'best fixed' is the fixed budget with the highest modelled tok/s):", ""]
    body = []
    for r in rows:
        if r["method"] in ("ar", "dflash"):
            body.append([r["method"], "–", fmt(r["tau"]), fmt(r.get("mean_nodes"), 1), fmt(r["tokens_per_s"], 1),
                         ratio(r.get("speedup_vs_ar")), "–"])
    for w in weights:
        fixed = [r for r in rows if r["method"] == "fixed" and r["ngram_weight"] == w]
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        body.append([f"best fixed (B = {best['budget']})", fmt(w, 1), fmt(best["tau"]), fmt(best.get("mean_nodes"), 1),
                     fmt(best["tokens_per_s"], 1), ratio(best.get("speedup_vs_ar")), ratio(1.0)])
        for r in rows:
            if r["method"] not in ("ar", "dflash", "fixed") and r["ngram_weight"] == w:
                body.append([r["method"], fmt(w, 1), fmt(r["tau"]), fmt(r.get("mean_nodes"), 1),
                             fmt(r["tokens_per_s"], 1), ratio(r.get("speedup_vs_ar")),
                             "–" if r.get("vs_best_fixed") is None else f"{r['vs_best_fixed']:.3f}×"])
    out += table(["rule", "n-gram weight", "τ", "nodes", "tok/s", "vs AR", "vs best fixed"], body)
    return out


def render_step_profile(study: dict, rows: list[dict]) -> list[str]:
    cols = [("cycle_ms", "cycle"), ("execute_model_ms", "execute_model"), ("target_attention_ms", "target attention"),
            ("sample_tokens_ms", "sample_tokens"), ("propose_ms", "propose"), ("drafter_forward_ms", "drafter forward"),
            ("drafter_context_ms", "drafter context pass"), ("tree_ms", "tree")]
    cols = [(k, h) for k, h in cols if any(k in r for r in rows)]
    header = ["engine", "batch", "steps", "tok/s"] + [f"{h} (ms)" for _, h in cols]
    body = [[r["engine"], fmt(r["batch"]), fmt(r.get("steps")), fmt(r.get("tokens_per_s"), 1)] +
            [fmt(r.get(k), 1) for k, _ in cols] for r in rows]
    return table(header, body)


def render_undrafted(study: dict, rows: list[dict]) -> list[str]:
    cols = [(k, k.removesuffix("_ms").replace("_", " ") + " (ms)") for k in
            unique(k for r in rows for k in r if k.endswith("_ms"))]
    ops = any("ddtree_ops_per_step" in r for r in rows)  # ddtree's ops on an undrafted step, where counted
    header = ["engine", "tok/s"] + [h for _, h in cols] + (["ddtree ops (views)"] if ops else [])
    body = [[r["engine"], fmt(r.get("tokens_per_s"), 1)] + [fmt(r.get(k), 1) for k, _ in cols]
            + ([f"{fmt(r['ddtree_ops_per_step'])} ({fmt(r['ddtree_views_per_step'])})" if "ddtree_ops_per_step" in r
                else "–"] if ops else []) for r in rows]
    return table(header, body)


def render_verify_rows(study: dict, rows: list[dict]) -> list[str]:
    passes = unique(r["pass"] for r in rows)
    by = {(r["rows"], r["pass"]): r for r in rows}
    header = ["rows", "context"] + [f"pass {p + 1} (ms)" for p in passes]
    body = []
    for n in unique(r["rows"] for r in rows):
        ctx = next(r["context"] for r in rows if r["rows"] == n)
        body.append([fmt(n), fmt(ctx)] + [fmt(by[(n, p)]["ms"], 1) if (n, p) in by else "–" for p in passes])
    return table(header, body)


def render_tree_build(study: dict, rows: list[dict]) -> list[str]:
    budgets = sorted({r["budget"] for r in rows if r.get("budget") is not None})
    keys = unique((r["impl"], r["batch"]) for r in rows)
    by = {(r["impl"], r["batch"], r.get("budget")): r["ms"] for r in rows}
    has_none = any(r.get("budget") is None for r in rows)
    header = ["step", "batch"] + [f"B = {b} (ms)" for b in budgets] + (["no budget (ms)"] if has_none else [])
    body = []
    for impl, batch in keys:
        line = [impl, fmt(batch)] + [fmt(by.get((impl, batch, b)), 2) for b in budgets]
        if has_none:
            line.append(fmt(by.get((impl, batch, None)), 2))
        body.append(line)
    return table(header, body)


def render_draft_vocab(study: dict, rows: list[dict]) -> list[str]:
    header = ["draft ids", "coverage of output tokens", "head matmul (ms)", "F.linear (ms)", "rows", "threads"]
    body = [["full" if r["size"] is None else fmt(r["size"]), f"{100 * r['coverage']:.2f}%", fmt(r["head_ms"], 3),
             fmt(r["flinear_ms"], 3), fmt(r["rows"]), fmt(r["threads"])] for r in rows]
    out = table(header, body)
    first = rows[0]
    out += ["", f"Over {first['output_tokens']} greedy output tokens of {first['prompts']} prompts."]
    return out


def render_chain_by_position(study: dict, rows: list[dict]) -> list[str]:
    windows = unique(tuple(r["window"]) for r in rows)
    keys = unique((r["drafter"], r["outputs"]) for r in rows)
    by = {(r["drafter"], r["outputs"], tuple(r["window"])): r for r in rows}
    header = ["drafter", "outputs"] + [f"positions {a}–{b}: τ" for a, b in windows]
    body = [[d, o] + [fmt(by[(d, o, w)]["tau"]) if (d, o, w) in by else "–" for w in windows] for d, o in keys]
    return table(header, body)


def render_loop_share(study: dict, data: dict) -> list[str]:
    sets = [k for k, v in data.items() if isinstance(v, dict)]
    fields = unique(f for s in sets for f in data[s])
    header = ["set"] + fields
    body = [[s] + [(f"{100 * data[s][f]:.1f}%" if "share" in f else fmt(data[s].get(f))) for f in fields] for s in sets]
    out = table(header, body)
    params = [f"{k} = {fmt(v)}" for k, v in data.items() if not isinstance(v, (dict, list))]
    return out + ["", "Parameters: " + ", ".join(params) + "."]


def render_flat(study: dict, data) -> list[str]:
    """Any JSON: a list of flat records as a table, an object as key / value lines (one level deep)."""
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        cols = unique(k for r in data for k, v in r.items() if not isinstance(v, (dict, list)) or
                      (isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v)))
        return table(cols, [[fmt(r.get(c)) for c in cols] for r in data])
    if isinstance(data, dict):
        body = []
        for k, v in data.items():
            if k == "meta":
                continue
            if isinstance(v, dict):
                body += [[f"{k}: {k2}", fmt(v2)] for k2, v2 in v.items() if not isinstance(v2, (dict, list))]
            elif not isinstance(v, list) or all(not isinstance(x, (dict, list)) for x in v):
                body.append([k, fmt(v)])
        return table(["quantity", "value"], body)
    return ["(empty)"]


def render_gpu_projection(study: dict, data: dict) -> list[str]:
    """The projection's non-fixed rows and a few fixed budgets per batch size, with its sources."""
    shown = {4, 8, 16, 32, 64, 128}
    rows = [r for r in data["rows"] if r["method"] != "fixed" or r["budget"] in shown]
    body = [[fmt(r["batch"]), r["method"] + (" (picked)" if r["method"] == "auto" else ""), fmt(r["budget"]),
             fmt(r["tau"]), fmt(r["step_ms"]), fmt(r["tokens_per_s"]), f"{r['speedup_vs_none']:.2f}×",
             f"{r['vs_chain']:.2f}×"] for r in rows]
    out = ["**A projection, not a measurement.** " + data["kind"], ""]
    out += [f"- {k.replace('_', ' ')}: {fmt(data[k])}" for k in ("cost_source", "tree_step_source", "drafter",
                                                                     "published_tau") if k in data]
    out += [f"- acceptance ({k}): {v}" for k, v in data.get("acceptance", {}).items()]
    return out + [""] + table(["batch", "method", "B", "τ", "step ms", "tokens/s", "vs none", "vs chain"], body)


def render_gpu_check(study: dict, data: dict) -> list[str]:
    """One line per part of a GPU check report: passed, failed or not run, with its own summary."""
    head = [f"- {k}: {fmt(data.get(k))}" for k in ("device", "torch", "cuda", "flashinfer", "total_seconds")
            if k in data]
    body = []
    for part in data.get("parts", []):
        state = f"not run: {part['not_run']}" if part.get("not_run") else "passed" if part.get("passed") else "FAILED"
        body.append([part.get("name", "?"), state, fmt(part.get("seconds")), str(part.get("summary", ""))])
    out = head + [""] + table(["part", "result", "s", "summary"], body)
    parts = {p.get("name"): p for p in data.get("parts", [])}
    graphs = {(c["batch"], c["variant"]): c for c in parts.get("b.graphs", {}).get("captures", []) if "replay_ms" in c}
    profiles = {(p["batch"], p["variant"]): p for p in parts.get("b.profile", {}).get("profiles", []) if "ops" in p}
    if graphs or profiles:
        ms = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
        observed = any("observe" in p for p in profiles.values())  # reports that profile the tables' count
        rows = []
        for key in sorted(set(graphs) | set(profiles)):
            g, p = graphs.get(key, {}), profiles.get(key, {})
            stages = p.get("stages", {})
            top = sorted(((v["kernel_us"], k) for k, v in stages.items() if v.get("ops")), reverse=True)[:2]
            rows.append([fmt(key[0]), key[1], fmt(p.get("ops")), fmt(p.get("kernels")), ms(p.get("kernel_ms")),
                         ", ".join(f"{k} {us / 1000:.2f}" for us, k in top) or "–", ms(g.get("replay_ms")),
                         ms(g.get("eager_ms"))])
            if observed:
                o = p.get("observe")
                rows[-1].append("–" if o is None else f"{o['ops']} / {ms(o['kernel_ms'])}")
        out += ["", "The tree step (b.profile: one eager step under the profiler; b.graphs: medians):", ""]
        out += table(["batch", "variant", "ops", "kernels", "kernel ms", "largest stages (kernel ms)", "replayed ms",
                      "eager ms"] + (["n-gram count of a step (ops / kernel ms)"] if observed else []),
                     rows)
    # the proposer's captured step, without and (reports since it was added) with n-gram rescoring
    own = [c for c in parts.get("b.graphs", {}).get("captures", [])
           if c["variant"] in ("StepGraphs", "StepGraphs+ngram") and "capture_ms" in c]
    if own:
        mib = lambda v: "–" if v is None else f"{v / 2**20:.0f}"  # noqa: E731
        out += ["", "The proposer's own captures (b.graphs, StepGraphs; a batch is padded to the top of its size class):", ""]
        out += table(["batch", "n-gram rescoring", "capture ms", "GPU memory kept (MiB)", "replayed ms", "eager ms",
                      "padded plan = unpadded"],
                     [[fmt(c["batch"]), "yes" if c["variant"].endswith("+ngram") else "no", fmt(c["capture_ms"]),
                       mib(c.get("pool_bytes")), fmt(c.get("replay_ms")), fmt(c.get("eager_ms")),
                       {True: "yes", False: "no", None: "–"}[c.get("padding_kept_plans")]]
                      for c in sorted(own, key=lambda c: (c["variant"], c["batch"]))])
    topk = [b for b in parts.get("b.topk", {}).get("batches", []) if "whole_ms" in b]
    if topk:
        names = parts["b.topk"]["selections"]
        mib = lambda v: "–" if v is None else f"{v / 2**20:.0f}"  # noqa: E731
        out += ["", "The drafter's candidates (b.topk: top-64 of 15 depths per request; ms are medians):", ""]
        out += table(["batch", "rows", *[f"top-k {n} ms" for n in names], "head + top-k, whole ms", "chunked ms",
                      "peak MiB, whole", "chunked"],
                     [[fmt(b["batch"]), fmt(b["rows"]), *[fmt(b["select_ms"][n]) for n in names], fmt(b["whole_ms"]),
                       fmt(b["chunked_ms"]), mib(b["whole_peak_bytes"]), mib(b["chunked_peak_bytes"])] for b in topk])
    return out


def render_serve_load(study: dict, data: dict) -> list[str]:
    """benchmarks/serve_load.py: the two servers side by side on the mixed workload, then tokens/s per stream count."""
    servers = data["servers"]
    names = list(servers)
    wl = data["meta"]["workload"]
    ms = lambda v: "–" if v is None else f"{1000 * v:.0f}"  # noqa: E731
    lines = [("requests", "requests", fmt), ("completed", "completed", fmt), ("cancelled (stream closed)", "cancelled", fmt),
             ("refused (4xx)", "client_errors", fmt), ("too-long prompts refused", "too_long_refused", fmt),
             ("server errors (5xx)", "server_errors", fmt), ("lost", "lost", fmt),
             ("greedy outputs ≠ base", "greedy_mismatches", None), ("running / waiting after", None, None),
             ("KV cache usage after", "kv_usage_after", fmt), ("prefix-cache hits (tokens)", "prefix_cache_hits",
                                                               lambda v: fmt(int(v))),
             ("preemptions", "preemptions", lambda v: fmt(int(v))), ("output tokens/s", "tokens_per_s", lambda v: fmt(v, 1)),
             ("TTFT p50 / p99 (s)", ("ttft_p50_s", "ttft_p99_s"), fmt), ("ITL p50 / p99 (ms)", ("itl_p50_s", "itl_p99_s"), ms),
             ("requests running, mean / max", ("running_mean", "running_max"), lambda v: fmt(v, 1)),
             ("requests waiting, mean / max", ("waiting_mean", "waiting_max"), lambda v: fmt(v, 1)),
             ("mean acceptance length", "mean_acceptance_length", fmt)]
    body = []
    for label, key, f in lines:
        row = [label]
        for n in names:
            s = servers[n]
            if key == "greedy_mismatches":
                row.append("reference" if n == "base" else
                           f"{fmt(s[key])} of {fmt(s['greedy_compared'])}" if "greedy_compared" in s else fmt(s[key]))
            elif key is None:
                row.append(f"{fmt(int(s['running_after']))} / {fmt(int(s['waiting_after']))}")
            elif isinstance(key, tuple):
                row.append(" / ".join("–" if s.get(k) is None else f(s[k]) for k in key))
            else:
                row.append("–" if s.get(key) is None else f(s[key]))
        body.append(row)
    out = [f"Mixed workload: {wl['requests']} requests at {wl['streams']} streams "
           f"({', '.join(f'{v} {k}' for k, v in wl['kinds'].items())}; {wl['chat']} chat; {wl['greedy']} greedy; "
           f"{wl['with_stop']} with stop strings; {wl['cancel_planned']} to be closed mid-stream; max_tokens "
           f"{wl['max_tokens_range'][0]}–{wl['max_tokens_range'][1]}; a request counts as lost after "
           f"{fmt(int(wl['request_timeout_s']))} s).", ""]
    out += table(["", *names], body)
    bw = data["meta"].get("by_streams_workload", {})
    repeats = bw.get("repeats", 1)
    rounds = (f"; {repeats} rounds each, base then ddtree: medians, each round's ratio in parentheses"
              if repeats > 1 else "")
    out += ["", f"Greedy completions per stream count ({bw.get('prompts', '')}, max_tokens {bw.get('max_tokens', '–')}"
            f"{rounds}):", ""]

    def ratios(r: dict) -> str:
        runs = r.get("throughput_ratio_runs") or []
        return ratio(r["throughput_ratio"]) + (f" ({', '.join(f'{x:.2f}' for x in runs)})" if len(runs) > 1 else "")

    out += table(["streams", "requests", "base tok/s", "ddtree tok/s", "ddtree vs base", "greedy outputs ≠ base"],
                 [[fmt(r["streams"]), fmt(r["requests"]), fmt(r["tokens_per_s_base"], 1),
                   fmt(r["tokens_per_s_ddtree"], 1), ratios(r), fmt(r["greedy_mismatches"])]
                  for r in data["by_streams"]])
    failed = [k for k, v in data.get("checks", {}).items() if not v]
    args = data["meta"].get("server_args", {})
    out += ["", "Checks: " + ("all passed" if not failed else "failed: " + ", ".join(failed)) + "."]
    if args.get("ddtree"):
        out += ["", "Server (ddtree; the base server the same without `--speculative-config`): `" +
                " ".join(f"'{a}'" if "{" in a else a for a in args["ddtree"]) + "`" +
                (f"; {args['note']}." if args.get("note") else ".")]
    return out


def render_step_overhead(study: dict, rows: list[dict]) -> list[str]:
    """benchmarks/step_overhead.py: per configuration, each measured revision's counts side by side."""
    codes = unique(r["code"] for r in rows)
    by = {}
    for r in rows:
        engine = r["engine"] + (", steady" if r.get("step") == "steady" else "")  # (rows before steps: first ones)
        by.setdefault((engine, r["batch"], str(r["budget"]), r["ngram"], r["lookup"]), {})[r["code"]] = r
    arrow = " → ".join(codes)
    views = any(r.get("device_views") is not None for r in rows)  # recorded by later runs
    lines = any(r.get("python_lines") is not None for r in rows)
    outside = any(r.get("outside_ops_ms") is not None for r in rows)  # recorded by later runs
    header = ["engine", "batch", "budget", "n-gram", "lookup", f"device ops ({arrow})",
              *([f"of them views ({arrow})"] if views else []), f"host reads ({arrow})",
              *([f"Python lines ({arrow})"] if lines else []), f"glue ms ({arrow})",
              *([f"host ms outside the ops ({arrow})", f"host ops ms ({arrow})"] if outside else [])]
    body = []
    for (engine, batch, budget, ngram, lookup), per in by.items():
        def col(key: str, digits: int = 0) -> str:
            return " → ".join("-" if per.get(c, {}).get(key) is None else fmt(per[c][key], digits) for c in codes)
        body.append([engine, batch, budget, "on" if ngram else "off", lookup, col("device_ops"),
                     *([col("device_views")] if views else []), col("host_copies", 1),
                     *([col("python_lines")] if lines else []), col("glue_ms", 1),
                     *([col("outside_ops_ms", 1), col("host_ops_ms", 1)] if outside else [])])
    return table(header, body)


RENDER = {
    "serve_load": render_serve_load, "step_overhead": render_step_overhead,
    "vllm_e2e": render_vllm_e2e, "acceptance": render_acceptance, "ab": render_ab,
    "budget_replay": render_budget_replay, "step_profile": render_step_profile, "undrafted": render_undrafted,
    "verify_rows": render_verify_rows, "tree_build": render_tree_build, "draft_vocab": render_draft_vocab,
    "chain_by_position": render_chain_by_position, "loop_share": render_loop_share, "flat": render_flat,
    "gpu_projection": render_gpu_projection, "gpu_check": render_gpu_check,
}


# ---- settings read from the rows ---------------------------------------------------------------

def row_settings(data) -> list[str]:
    rows = data if isinstance(data, list) else data.get("rows", []) if isinstance(data, dict) else []
    rows = [r for r in rows if isinstance(r, dict)]
    out = []
    for key, name in (("prompts", "prompts"), ("batch", "batch sizes"), ("temperature", "temperatures"),
                      ("ngram_weight", "n-gram weights")):
        vals = unique(r[key] for r in rows if r.get(key) is not None)
        if vals:
            out.append(f"{name} {fmt(vals, 1) if key in ('temperature', 'ngram_weight') else fmt(vals)}")
    runs = unique(len(r["runs_tokens_per_s"]) for r in rows if isinstance(r.get("runs_tokens_per_s"), list))
    if runs:
        out.append("one run per row" if runs == [1] else f"tok/s: median of {fmt(runs)} runs per row")
    same = [r.get("identical_to_ar", r.get("mismatches_vs_ar")) for r in rows if "identical_to_ar" in r or "mismatches_vs_ar" in r]
    checked = [s for s in same if s is not None]
    if checked:
        ok = all(s is True or (not isinstance(s, bool) and s == 0) for s in checked)  # False == 0 in Python
        out.append("greedy outputs identical to no speculation in every row" if ok else
                   "some greedy outputs differ from no speculation (see the table)")
    return out


# ---- the document ------------------------------------------------------------------------------

def load_results() -> "OrderedDict[str, object]":
    files = OrderedDict()
    for path in sorted(RESULTS.rglob("*.json")):
        if path == STUDIES:
            continue
        files[path.relative_to(RESULTS).as_posix()] = json.loads(path.read_text())
    return files


def link(rel: str) -> str:
    """A link from docs/ to a file under benchmarks/results/."""
    return f"[`{rel}`](../benchmarks/results/{rel})"


def describe(study: dict, registry: dict) -> list[str]:
    def pick(table_name: str, key: str) -> str | None:
        v = study.get(key)
        return registry.get(table_name, {}).get(v, v) if v is not None else None

    lines = [study["measures"], ""] if study.get("measures") else []
    facts = [("Engine", pick("engines", "engine")), ("Device", pick("devices", "device")),
             ("Model", pick("models", "model") or registry.get("models", {}).get("toy")),
             ("Drafter", pick("drafters", "drafter")), ("Date", study.get("date"))]
    lines += [f"- {k}: {v}" for k, v in facts if v]
    return lines


def study_section(study: dict, results: dict, registry: dict, level: str = "###") -> list[str]:
    out = [f"{level} {study['title']}", ""]
    out += describe(study, registry)
    cmds = study.get("commands") or ([study["command"]] if study.get("command") else [])
    if len(study["files"]) == 1 and row_settings(results[study["files"][0]]):
        out.append("- Settings read from the rows: " + "; ".join(row_settings(results[study["files"][0]])))
    out.append("- Files: " + ", ".join(link(f) for f in study["files"]))
    pngs = [f[:-5] + ".png" for f in study["files"] if (RESULTS / (f[:-5] + ".png")).is_file()]
    if pngs:
        out.append("- Plots: " + ", ".join(f"[`{p}`](../benchmarks/results/{p})" for p in pngs))
    if cmds:
        out += ["", "```bash"] + cmds + ["```"]
    render = RENDER.get(study.get("kind", "flat"), render_flat)
    for name in study["files"]:
        data = results[name]
        whole = study.get("kind") in ("flat", "gpu_projection", "gpu_check")  # these read the file's other keys too
        rows = data["rows"] if isinstance(data, dict) and "rows" in data and not whole else data
        if len(study["files"]) > 1:
            settings = row_settings(data)
            out += ["", f"`{name}`" + (" (" + "; ".join(settings) + ")" if settings else "") + ":"]
        out += [""] + render(study, rows)
    return out + [""]


def generate() -> str:
    registry = json.loads(STUDIES.read_text())
    results = load_results()
    studies = [dict(s) for s in registry["studies"] if all(f in results for f in s["files"])]
    covered = {f for s in studies for f in s["files"]}
    # GPU check reports (benchmarks/gpu_check.py: device, versions and "parts") describe themselves.
    for name, data in results.items():
        if name not in covered and isinstance(data, dict) and isinstance(data.get("parts"), list):
            studies.append({"id": name, "group": "gpu", "files": [name], "kind": "gpu_check",
                            "title": f"GPU check on {data.get('device_name') or data.get('device', name)}",
                            "measures": "benchmarks/gpu_check.py: FlashInfer tree attention, the tree pipeline "
                                        "(host syncs, CUDA graphs), KV compaction and a Qwen3-8B-shaped verify-cost "
                                        "curve, without vLLM (docs/gpu-check.md).",
                            "model": "Qwen3-8B's shapes, random weights", "commands": ["make gpu-check"]})
            covered.add(name)
    # Files that describe themselves: {"meta": {...}, "rows": [...]}.
    for name, data in results.items():
        if name in covered or not (isinstance(data, dict) and isinstance(data.get("meta"), dict)):
            continue
        meta = data["meta"]
        studies.append({"id": name, "group": meta.get("group", name.split("/")[0] if "/" in name else "other"),
                        "files": [name], "kind": meta.get("kind", "flat"), "title": meta.get("title", name),
                        "measures": meta.get("what") or meta.get("measures"), "engine": meta.get("engine"),
                        "device": meta.get("device"), "model": meta.get("model"), "drafter": meta.get("drafter"),
                        "date": meta.get("date"), "commands": meta.get("commands") or
                        ([meta["command"]] if meta.get("command") else [])})
        covered.add(name)
    missing = [s["id"] for s in registry["studies"] if not all(f in results for f in s["files"])]
    groups = OrderedDict((g, t) for g, t in registry.get("groups", []))
    for s in studies:
        groups.setdefault(s["group"], s["group"].upper() if s["group"] == "gpu" else s["group"])

    out = ["# Benchmarks", "",
           "<!-- Generated by `python benchmarks/report.py` from benchmarks/results/; do not edit by hand. -->", "",
           "Every table below is read from a committed result file under `benchmarks/results/`; what each",
           "run was and the command that produced it come from the file or from `benchmarks/results/studies.json`.",
           "Regenerate with `python benchmarks/report.py`; `python benchmarks/report.py --check` (run by the",
           "test suite) fails when this page and the result files disagree.", "",
           "Terms: τ is tokens per target forward (the bonus token included); B is the fixed tree budget",
           "(draft nodes verified per request and step); nodes is the mean number of draft nodes verified;",
           "'vs none' / 'vs AR' is tokens/s relative to the target alone in the same run. Timings on a shared",
           "virtual machine move between runs: compare rows within one table, not across tables.", ""]
    out += ["## Contents", ""]
    for g, title in groups.items():
        members = [s for s in studies if s["group"] == g]
        if members:
            out.append(f"- {title}: " + "; ".join(s["title"] for s in members))
    out.append("")
    for g, title in groups.items():
        members = [s for s in studies if s["group"] == g]
        if not members:
            continue
        out += [f"## {title}", ""]
        for s in members:
            out += study_section(s, results, registry)
    others = [n for n in results if n not in covered]
    if others:
        out += ["## Other results", "", "Result files with no description yet (neither a `meta` block nor an entry in",
                "`benchmarks/results/studies.json`):", ""]
        for name in others:
            out += [f"### {name}", "", "- File: " + link(name), ""] + render_flat({}, results[name]) + [""]
    if missing:
        out += ["## Described but absent", "", "Entries of `studies.json` whose files are missing: " +
                ", ".join(f"`{m}`" for m in missing) + ".", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is not what would be written")
    ap.add_argument("--output", default=str(OUT))
    args = ap.parse_args(argv)
    text = generate()
    path = Path(args.output)
    if args.check:
        current = path.read_text() if path.is_file() else ""
        if current != text:
            print(f"{os.path.relpath(path)} is out of date: run `python benchmarks/report.py`", file=sys.stderr)
            return 1
        print(f"{os.path.relpath(path)} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
