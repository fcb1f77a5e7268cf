"""Paged KV compaction: after a walk, the accepted path's K/V sit at consecutive positions."""

import torch

from vllm_ddtree.compaction import compact_paged_kv_, positions_to_slots
from vllm_ddtree.tree import build_tree, compaction_plan, compile_tree, topk_per_depth, walk_tree

BS, HEADS, HD = 4, 2, 3


def test_compaction_moves_accepted_rows_in_every_layer():
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
        kv = cache.view(r * blocks_per_req, HEADS, 2, BS, HD)
        for req in range(r):
            pos = torch.arange(int(ctx[req]) + batch.max_rows)
            slots = positions_to_slots(table[req : req + 1], pos[None], BS)[0]
            # value encodes (layer, request, position, K or V)
            for kvi in range(2):
                kv[slots // BS, :, kvi, slots % BS] = (layer * 1000 + req * 100 + pos + 0.5 * kvi)[:, None, None].float()
        caches.append(cache)
    compact_paged_kv_(caches, table, plan, BS)
    for layer, cache in enumerate(caches):
        kv = cache.view(r * blocks_per_req, HEADS, 2, BS, HD)
        for req in range(r):
            c = int(ctx[req])
            for depth, row in enumerate(walk.path_rows[req].tolist()):
                if row < 0:
                    break
                slot = positions_to_slots(table[req : req + 1], torch.tensor([[c + depth]]), BS)[0, 0]
                for kvi in range(2):
                    expect = layer * 1000 + req * 100 + c + row + 0.5 * kvi
                    assert torch.all(kv[slot // BS, :, kvi, slot % BS] == expect)
