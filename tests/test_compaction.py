"""Paged KV compaction: after a walk, the accepted path's K/V sit at consecutive positions."""

import pytest
import torch

from vllm_ddtree.compaction import compact_paged_kv_, positions_to_slots
from vllm_ddtree.tree import build_tree, compaction_plan, compile_tree, topk_per_depth, walk_tree

HEADS = 2


def pack(k: torch.Tensor, v: torch.Tensor, layout: str) -> torch.Tensor:
    """A layer cache [blocks, heads, block_size, 2 * head_dim] in `layout` holding K and V, each given
    as [blocks, heads, block_size, head_dim]: per (block, head) K then V, token-major ("rows"), K
    transposed ("cpu_attn", CPU_ATTN's vec ISAs), or both packed as CPU_ATTN's AMX tiles load them
    ("cpu_attn_amx": K [t // 16, d // 2, t % 16, d % 2], V [d // 16, t // 2, d % 16, t % 2])."""
    nb, h, bs, hd = k.shape
    if layout == "cpu_attn":
        k = k.transpose(2, 3)
    elif layout == "cpu_attn_amx":
        k = k.view(nb, h, bs // 16, 16, hd // 2, 2).permute(0, 1, 2, 4, 3, 5)
        v = v.view(nb, h, bs // 2, 2, hd // 16, 16).permute(0, 1, 4, 2, 5, 3)
    return torch.stack([k.reshape(nb, h, bs * hd), v.reshape(nb, h, bs * hd)], dim=2).view(nb, h, bs, 2 * hd)


def unpack(cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack`: K and V [blocks, heads, block_size, head_dim] of a layer cache."""
    nb, h, bs, two_hd = cache.shape
    hd = two_hd // 2
    k, v = cache.view(nb, h, 2, bs * hd).unbind(2)
    if layout == "cpu_attn":
        return k.view(nb, h, hd, bs).transpose(2, 3), v.view(nb, h, bs, hd)
    if layout == "cpu_attn_amx":
        k = k.view(nb, h, bs // 16, hd // 2, 16, 2).permute(0, 1, 2, 4, 3, 5)
        v = v.view(nb, h, hd // 16, bs // 2, 16, 2).permute(0, 1, 3, 5, 2, 4)
        return k.reshape(nb, h, bs, hd), v.reshape(nb, h, bs, hd)
    return k.view(nb, h, bs, hd), v.view(nb, h, bs, hd)


@pytest.mark.parametrize("layout, BS, HD", [("rows", 4, 3), ("cpu_attn", 4, 3), ("cpu_attn", 16, 32),
                                            ("cpu_attn_amx", 32, 32), ("cpu_attn_amx", 16, 48)])
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
        kv = [torch.zeros(r * blocks_per_req, HEADS, BS, HD) for _ in range(2)]
        for req in range(r):
            pos = torch.arange(int(ctx[req]) + batch.max_rows)
            slots = positions_to_slots(table[req : req + 1], pos[None], BS)[0]
            for kvi, view in enumerate(kv):
                view[slots // BS, :, slots % BS] = value(layer, req, pos, kvi, HD)
        caches.append(pack(*kv, layout))
    compact_paged_kv_(caches, table, plan, BS, layout)
    for layer, cache in enumerate(caches):
        for req in range(r):
            c = int(ctx[req])
            for depth, row in enumerate(walk.path_rows[req].tolist()):
                if row < 0:
                    break
                slot = positions_to_slots(table[req : req + 1], torch.tensor([[c + depth]]), BS)[0, 0]
                for kvi, view in enumerate(unpack(cache, layout)):
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


def _vllm_layer_views(num_layers: int, blocks: int, heads: int, bs: int, two_hd: int, interleaved: bool) -> list:
    """Layer caches as vLLM 0.32.0's `allocate_kv_cache` makes them: views of one buffer, a fixed
    stride apart (layer-major, or each block holding every layer's page in turn)."""
    page = heads * bs * two_hd
    buf = torch.randn(num_layers * blocks * page, generator=torch.Generator().manual_seed(num_layers))
    layer_step, block_step = (page, num_layers * page) if interleaved else (blocks * page, page)
    return [buf.as_strided((blocks, heads, bs, two_hd), (block_step, bs * two_hd, two_hd, 1), layer * layer_step)
            for layer in range(num_layers)]


@pytest.mark.parametrize("layout, interleaved", [("flashinfer", True), ("flashinfer", False), ("rows", False),
                                                 ("cpu_attn", False)])
def test_layers_of_one_allocation_move_as_one_stack(layout, interleaved, monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_ddtree import compaction

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    src, dst = torch.tensor([9, 17, 6, 30]), torch.tensor([5, 9, 6, 31])  # 9 read before 17 overwrites it
    ops = {}
    for num_layers in (2, 7):
        caches = _vllm_layer_views(num_layers, 8, 2, 4, 6, interleaved)
        assert len(compaction.layer_stacks(caches)) == 1
        # the reference: each layer as an allocation of its own, moved on its own
        before = [c.clone() for c in caches]
        alone = [c.clone() for c in caches]
        for c in alone:
            compaction.move_slots_([c], src, dst, layout)
        with Count() as count:
            compaction.move_slots_(caches, src, dst, layout)
        ops[num_layers] = count.ops
        assert all(torch.equal(c, a) for c, a in zip(caches, alone))
        assert not any(torch.equal(c, b) for c, b in zip(caches, before))  # every layer moved
        # the moves as [requests, depths], a column cut of a wider block (as the verify step hands them)
        wide = caches_2d = _vllm_layer_views(num_layers, 8, 2, 4, 6, interleaved)
        cut = lambda x: torch.cat([x.view(2, 2), torch.zeros(2, 3, dtype=x.dtype)], dim=1)[:, :2]  # noqa: E731
        compaction.move_slots_(caches_2d, cut(src), cut(dst), layout)
        assert all(torch.equal(c, a) for c, a in zip(wide, alone))
    assert ops[2] == ops[7], ops  # the layers cost no op each
    # chunked (a gather bound below one stack's moves): the same caches, a few more ops
    monkeypatch.setattr(compaction, "MOVE_CHUNK_BYTES", 2 * 4 * 2 * 6 * 4)  # two layers' moves per gather
    caches = _vllm_layer_views(7, 8, 2, 4, 6, interleaved)
    alone = [c.clone() for c in caches]
    for c in alone:
        compaction.move_slots_([c], src, dst, layout)
    compaction.move_slots_(caches, src, dst, layout)
    assert all(torch.equal(c, a) for c, a in zip(caches, alone))


def test_layer_stacks_split_where_the_layers_do_not_line_up():
    from vllm_ddtree.compaction import layer_stacks

    caches = _vllm_layer_views(6, 4, 1, 4, 2, interleaved=False)
    # a drafter layer between target layers 2 and 3: the stride breaks there
    stacks = layer_stacks(caches[:3] + caches[4:])
    assert [s.shape[0] for s in stacks] == [3, 2]
    assert [s.shape[0] for s in layer_stacks([torch.zeros(4, 1, 4, 2) for _ in range(3)])] == [1, 1, 1]
    for stack, layers in zip(stacks, (caches[:3], caches[4:])):
        assert all(torch.equal(stack[i], c) and stack[i].data_ptr() == c.data_ptr() for i, c in enumerate(layers))
