"""Time the target's verify forward by row count on the machine it runs on (a measurement, not a test).

    python benchmarks/verify_rows.py [--context 200] [--rows 1,2,3,4,5,6,8,12,16,33,65] [--repeats 9] --json PATH

The reference decoder's `_target_forward` on the toy target (float32, 2 threads): `--rows` rows with
a tree-style boolean mask after `--context` cached tokens, the cache cropped back after each call.
Median of `--repeats` calls per row count, two passes. Shows the step cost's shape that the
automatic budget's cost model has to learn (`CostModel.residual`). Writes a JSON list of
{"rows", "context", "pass", "ms"} and a PNG.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_ddtree.reference import ReferenceDecoder
from vllm_ddtree.reference.pair import load_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,33,65")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pair = load_pair()
    dec = ReferenceDecoder(pair.target)
    ctx = args.context
    g = torch.Generator().manual_seed(0)
    rows_out = []
    with torch.inference_mode():
        ids = torch.randint(0, pair.target.config.vocab_size, (1, ctx), generator=g)
        _, _, cache = dec._target_forward(ids, torch.arange(ctx)[None], None, None)

        def once(n: int) -> float:
            tokens = torch.randint(0, pair.target.config.vocab_size, (1, n), generator=g)
            mask = torch.ones(1, n, ctx + n, dtype=torch.bool)
            mask[0, :, ctx:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            t0 = time.perf_counter()
            dec._target_forward(tokens, (ctx + torch.arange(n))[None], cache, mask)
            seconds = time.perf_counter() - t0
            cache.crop(-n)
            return seconds

        for p in range(2):
            for n in (int(r) for r in args.rows.split(",")):
                ms = 1e3 * statistics.median(once(n) for _ in range(args.repeats))
                rows_out.append({"rows": n, "context": ctx, "pass": p, "ms": ms})
    by_rows: dict[int, list[float]] = {}
    for r in rows_out:
        by_rows.setdefault(r["rows"], []).append(r["ms"])
    print(f"verify forward, {ctx} tokens of context, {args.threads} threads (ms per pass)")
    for n, ms in by_rows.items():
        print(f"{n:>4} rows  " + "  ".join(f"{m:6.1f}" for m in ms))
    from plotting import save_results

    save_results(rows_out, args.json, args.plot, lambda png: plot(by_rows, ctx, png))


def plot(by_rows: dict[int, list[float]], ctx: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plotting import save_png

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = list(by_rows)
    for p in range(len(next(iter(by_rows.values())))):
        ax.plot(rows, [by_rows[n][p] for n in rows], "o-", label=f"pass {p + 1}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("verify rows")
    ax.set_ylabel("ms per forward")
    ax.set_title(f"toy target verify, {ctx} tokens of context")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
