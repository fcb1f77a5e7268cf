"""Paged KV compaction: after a walk, the accepted path's K/V sit at consecutive positions."""

import pytest
import torch

from vllm_ddtree.compaction import compact_paged_kv_, positions_to_slots
from vllm_ddtree.tree import build_tree, compaction_plan, compile_tree, topk_per_depth, walk_tree

HEADS = 2


def kv_views(cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a layer cache as [blocks, heads, block_size, head_dim] views (K through a
    transpose for "cpu_attn", vLLM CPU_ATTN's storage)."""
    nb, h, bs, two_hd = cache.shape
    kv = cache.view(nb, h, 2, bs, two_hd // 2)
    if layout == "rows":
        return kv[:, :, 0], kv[:, :, 1]
    return cache.view(nb, h, 2, two_hd // 2, bs)[:, :, 0].transpose(2, 3), kv[:, :, 1]


@pytest.mark.parametrize("layout, BS, HD", [("rows", 4, 3), ("cpu_attn", 4, 3), ("cpu_attn", 16, 32)])
def test_compaction_moves_accepted_rows_in_every_layer(layout, BS, HD):
    g = torch.Generator().manual_seed(0)
    r = 3
    lp, ids = topk_per_depth(torch.randn(r, 4, 5, generator=g) * 2, 5)
    ctx = torch.tensor([2, 9, 5])
    batch = compile_tree(build_tree(lp, ids, 12), torch.tensor([0, 1, 2]), ctx)
    # target tokens that follow a deep path: accept whatever child exists, walking the tree
    walk = walk_tree(batch, torch.randint(0, 5, batch.tokens.shape, generator=g))
    for _ in range(50):  # find row tokens that accept at least 2 nodes somewhere
        if int(walk.num_emitted.max()) >= 3:
            break
        walk = walk_tree(batch, torch.randint(0, 5, batch.tokens.shape, generator=g))
    assert int(walk.num_emitted.max()) >= 3
    plan = compaction_plan(batch, walk.path_rows)
    blocks_per_req = 8
    table = torch.randperm(r * blocks_per_req, generator=g).view(r, blocks_per_req)
    caches = []
    for layer in range(2):
        cache = torch.zeros(r * blocks_per_req, HEADS, BS, 2 * HD)
        for req in range(r):
            pos = torch.arange(int(ctx[req]) + batch.max_rows)
            slots = positions_to_slots(table[req : req + 1], pos[None], BS)[0]
            for kvi, view in enumerate(kv_views(cache, layout)):
                view[slots // BS, :, slots % BS] = value(layer, req, pos, kvi, HD)
        caches.append(cache)
    compact_paged_kv_(caches, table, plan, BS, layout)
    for layer, cache in enumerate(caches):
        for req in range(r):
            c = int(ctx[req])
            for depth, row in enumerate(walk.path_rows[req].tolist()):
                if row < 0:
                    break
                slot = positions_to_slots(table[req : req + 1], torch.tensor([[c + depth]]), BS)[0, 0]
                for kvi, view in enumerate(kv_views(cache, layout)):
                    expect = value(layer, req, torch.tensor([c + row]), kvi, HD)[0]
                    assert torch.equal(view[slot // BS, :, slot % BS], expect)


def value(layer: int, req: int, pos: torch.Tensor, kvi: int, hd: int) -> torch.Tensor:
    """[len(pos), heads, hd]: a distinct value per (layer, request, position, K or V, head, dim)."""
    head = torch.arange(HEADS).view(1, -1, 1)
    d = torch.arange(hd).view(1, 1, -1)
    return (((((layer * 4 + req) * 128 + pos.view(-1, 1, 1)) * 2 + kvi) * HEADS + head) * hd + d).float()


def test_unknown_layout_is_refused():
    from vllm_ddtree.compaction import move_slots_

    with pytest.raises(ValueError, match="unknown KV cache layout 'cpu'"):
        move_slots_([torch.zeros(2, 1, 4, 2)], torch.tensor([0]), torch.tensor([1]), "cpu")
