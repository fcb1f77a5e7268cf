"""KV compaction in vLLM's paged caches after a tree walk (target and drafter alike).

A verify step writes tree row i of request r at logical position ctx_r + i. After the walk the
accepted path's rows must sit at ctx_r + depth so that the next step (and the scheduler's rollback
of num_computed_tokens to ctx_r + accepted + 1) sees exactly the committed text. The moves come
from `vllm_ddtree.tree.compaction_plan` as logical positions; here they become physical slots
through the block table and are applied to every layer's cache: gather all sources, then scatter
(a source is never before its destination, and no-op entries copy the root onto itself).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_ddtree.tree import KVCompaction


def positions_to_slots(block_table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Logical positions [R, L] -> physical slots (block * block_size + offset) via block_table [R, B]."""
    blocks = block_table.long().gather(1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


def compact_paged_kv_(kv_caches: list[Tensor], block_table: Tensor, plan: KVCompaction, block_size: int) -> None:
    """Apply `plan` to every layer cache [blocks, kv_heads, block_size, 2 * head_dim] (CPU layout).

    Per (block, head) the storage reads as [2 * block_size, head_dim]: K rows, then V rows — the
    layout `vllm_ddtree.attention.cpu_tree` reads and writes. No host synchronisation.
    """
    src = positions_to_slots(block_table, plan.src, block_size).reshape(-1)
    dst = positions_to_slots(block_table, plan.dst, block_size).reshape(-1)
    move_slots_(kv_caches, src, dst)


def move_slots_(kv_caches: list[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    """cache[dst] = cache[src] for physical slots in every layer cache (CPU layout), gather first."""
    for cache in kv_caches:
        nb, h, bs, two_hd = cache.shape
        kv = cache.view(nb, h, 2, bs, two_hd // 2)  # [blocks, heads, K|V, offset, hd]
        sb, so = torch.div(src_slots, bs, rounding_mode="floor"), src_slots % bs
        db, do = torch.div(dst_slots, bs, rounding_mode="floor"), dst_slots % bs
        moved = kv[sb, :, :, so]  # [moves, heads, 2, hd]  (gather first)
        kv[db, :, :, do] = moved
