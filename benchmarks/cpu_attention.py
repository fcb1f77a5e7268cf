"""Time one layer of the CPU tree attention backend (cache update + forward) on a verify step.

    python benchmarks/cpu_attention.py [--batches 1,8] [--context 300] [--rows 5] [--repeats 500]

A measurement, not a test. SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64),
one thread, KV cache block size 128: each request verifies `--rows` tree rows (the root and a chain
of rows - 1 nodes) after `--context` cached tokens, over shuffled physical blocks. The metadata is
built once per step by the backend's own builder (as for all 30 layers of a step in the engine);
the time reported is per layer: `do_kv_cache_update` + `forward`, median of 5 rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_ddtree.attention.cpu_tree import TreeAttentionImpl, TreeAttentionMetadataBuilder
from vllm_ddtree.attention.tree_mask import TreeStepMasks, set_step_tree_masks

HEADS, KV_HEADS, HD, BS = 9, 3, 64, 128


def layer_time(batch: int, context: int, rows: int, repeats: int) -> float:
    """Median seconds per layer (update + forward) over 5 rounds of `repeats` calls."""
    g = torch.Generator().manual_seed(0)
    seq = context + rows
    per_req = -(-seq // BS)
    num_blocks = batch * per_req + 1
    table = (torch.randperm(num_blocks - 1, generator=g)[: batch * per_req] + 1).view(batch, per_req)
    kv_cache = torch.randn(num_blocks, KV_HEADS, BS, 2 * HD, generator=g)
    pos = torch.arange(context, seq)
    slots = (table.gather(1, (pos // BS).expand(batch, rows)) * BS + pos % BS).reshape(-1)
    qsl = torch.arange(batch + 1) * rows
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.full((batch,), seq), num_reqs=batch,
        num_actual_tokens=batch * rows, max_query_len=rows, max_seq_len=seq,
        block_table_tensor=table.int(), slot_mapping=slots, causal=True,
    )
    chain = torch.tril(torch.ones(rows, rows, dtype=torch.bool))  # row i sees rows 0..i (a chain tree)
    masks = TreeStepMasks(torch.ones(batch, dtype=torch.bool), torch.full((batch,), rows), chain.expand(batch, rows, rows))
    spec = SimpleNamespace(block_size=BS, num_kv_heads=KV_HEADS, dtype=torch.float32, head_size=HD)
    builder = TreeAttentionMetadataBuilder(spec, ["model.layers.0.attn"], None, "cpu")
    set_step_tree_masks(masks)
    try:
        md = builder.build(0, cm)
    finally:
        set_step_tree_masks(None)
    impl = TreeAttentionImpl(HEADS, HD, HD**-0.5, KV_HEADS, None, None, "auto")
    q = torch.randn(batch * rows, HEADS, HD, generator=g)
    k, v = torch.randn(batch * rows, KV_HEADS, HD, generator=g), torch.randn(batch * rows, KV_HEADS, HD, generator=g)
    out = torch.empty(batch * rows, HEADS * HD)

    def layer() -> None:
        impl.do_kv_cache_update(None, k, v, kv_cache, slots)
        impl.forward(None, q, k, v, kv_cache, md, out)

    for _ in range(20):
        layer()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            layer()
        rounds.append((time.perf_counter() - t0) / repeats)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=500)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for batch in (int(b) for b in args.batches.split(",")):
        secs = layer_time(batch, args.context, args.rows, args.repeats)
        print(f"batch {batch}: {secs * 1e6:.0f} us per layer (update + forward), {args.rows} rows after {args.context} tokens")


if __name__ == "__main__":
    main()
