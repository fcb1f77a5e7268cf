"""Time draft-tree build + compile on the machine it runs on (a measurement, not a test).

    python benchmarks/tree_build.py [--quick] --json PATH

For B in {16, 64, 256, 512, 1024} x batch in {1, 8, 32}, L = 15 depths, vocab 151936 (Qwen3):
the vocabulary top-k (K = B) is timed on its own ("topk"), then the tree work — `build_tree` +
`compile_tree` — for the batched implementation ("batched") and the reference heap ("reference").
With n-gram rescoring (λ = 0.2, order 3, each request's online table holding 512 tokens), for
B <= 64 only (a rescored build expands every frontier node's K candidates: B^2 per depth): the same
build ("ngram"), and one step's table update for the whole batch, two new tokens per request
("observe", once per batch, budget null). Median of repeats. Prints a table and writes a JSON list
of {"impl", "budget", "batch", "ms"}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from vllm_ddtree.tree import NGramModel, build_tree, build_tree_reference, compile_tree, topk_per_depth

DEPTH, VOCAB = 15, 151936
NGRAM_MAX_BUDGET = 64


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (caches, allocator)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, reference heap only up to B=256")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the engine's worker owns one core)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (5 if args.quick else 21)
    budgets = [16, 64, 256, 512, 1024]
    batches = [1, 8, 32]
    results = []
    g = torch.Generator().manual_seed(0)
    configs = [(r, b) for r in batches for b in budgets]
    for r, b in tqdm(configs, desc="tree build"):
        logits = torch.randn(r, DEPTH, VOCAB, generator=g) * 3
        k = min(b, VOCAB)
        results.append(dict(impl="topk", budget=b, batch=r, ms=median_ms(lambda: topk_per_depth(logits, k), max(3, repeats // 4))))
        lp, ids = topk_per_depth(logits, k)
        roots = torch.zeros(r, dtype=torch.int64)
        ctx = torch.full((r,), 512)

        def batched():
            compile_tree(build_tree(lp, ids, b, validate=False), roots, ctx)

        def reference():
            compile_tree(build_tree_reference(lp, ids, b), roots, ctx)

        results.append(dict(impl="batched", budget=b, batch=r, ms=median_ms(batched, repeats)))
        if b <= NGRAM_MAX_BUDGET:
            ngram, slots = NGramModel(VOCAB, 3), list(range(r))
            ngram.observe_batch(slots, [torch.randint(0, 4000, (512,), generator=g) for _ in slots])

            def with_ngram():
                tree = build_tree(lp, ids, b, scorer=ngram.scorer(slots), context_tail=ngram.context_tail(slots),
                                  lam=0.2, validate=False)
                compile_tree(tree, roots, ctx)

            results.append(dict(impl="ngram", budget=b, batch=r, ms=median_ms(with_ngram, repeats)))
            if b == budgets[0]:
                new = [torch.randint(0, 4000, (2,), generator=g) for _ in slots]
                results.append(dict(impl="observe", budget=None, batch=r,
                                    ms=median_ms(lambda: ngram.observe_batch(slots, new), repeats)))
        if not args.quick or b <= 256:
            results.append(dict(impl="reference", budget=b, batch=r, ms=median_ms(reference, 1 if b * r > 2048 else 3)))

    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads; L={DEPTH}, vocab={VOCAB}; median ms")
    print(f"{'batch':>5} {'B':>5} {'topk':>9} {'batched':>9} {'reference':>10} {'ngram':>9}")
    for r in batches:
        for b in budgets:
            row = {x["impl"]: x["ms"] for x in results if x["batch"] == r and x["budget"] == b}
            ref = f"{row['reference']:10.1f}" if "reference" in row else f"{'-':>10}"
            ng = f"{row['ngram']:9.2f}" if "ngram" in row else f"{'-':>9}"
            print(f"{r:>5} {b:>5} {row['topk']:9.2f} {row['batched']:9.2f} {ref} {ng}")
    for x in results:
        if x["impl"] == "observe":
            print(f"n-gram table update, batch {x['batch']}: {x['ms']:.2f} ms")
    from plotting import save_results

    save_results(results, args.json)


if __name__ == "__main__":
    main()
