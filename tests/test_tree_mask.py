"""The attention masks a GPU kernel would be handed for a verify step, checked on the CPU.

A mixed step (a causal prefill chunk, a plain decode row, a non-causal request and trees of
different sizes, one wider than 32 rows) goes through every layout in
vllm_ddtree.attention.tree_mask; each is compared with masks built independently: the tree core's
`dense_attention_mask` for tree rows, plain causal / full masks for the others.
"""

import torch

from vllm_ddtree.attention.tree_mask import (
    TreeStepMasks,
    build_attention_mask,
    flashinfer_custom_mask,
    xqa_spec_mask,
    xqa_spec_plan,
)
from vllm_ddtree.tree import build_tree, compile_tree, dense_attention_mask, topk_per_depth


def _tree(num_nodes: int, ctx: int, seed: int):
    lp, ids = topk_per_depth(torch.randn(1, 8, 12, generator=torch.Generator().manual_seed(seed)) * 2, 6)
    return compile_tree(build_tree(lp, ids, num_nodes), torch.tensor([1]), torch.tensor([ctx]))


def _step():
    """Requests: 0 prefill chunk (5 after 7, causal), 1 decode (1 after 20), 2 drafter block (4 after
    9, non-causal), 3 tree of 1 + 40 rows after 11, 4 tree of 1 + 7 rows after 3."""
    trees = [_tree(40, 11, 1), _tree(7, 3, 2)]
    rows = [int(t.num_rows[0]) for t in trees]
    query_lens = torch.tensor([5, 1, 4, *rows])
    ctx = torch.tensor([7, 20, 9, 11, 3])
    n = max(rows)
    anc = torch.zeros(5, n, n, dtype=torch.bool)
    for t, tree in enumerate(trees):
        anc[3 + t, : tree.max_rows, : tree.max_rows] = tree.ancestors[0]
    masks = TreeStepMasks(has_tree=torch.tensor([False, False, False, True, True]),
                          num_rows=torch.tensor([0, 0, 0, *rows]), ancestors=anc)
    causal = torch.tensor([True, True, False, True, True])
    return trees, query_lens, ctx + query_lens, causal, masks


def _expected(rr, trees, query_lens, seq_lens, causal):
    q, kv = int(query_lens[rr]), int(seq_lens[rr])
    if rr >= 3:
        return dense_attention_mask(trees[rr - 3], kv)[0, :q]
    if causal[rr]:
        return torch.arange(kv)[None, :] <= kv - q + torch.arange(q)[:, None]
    return torch.ones(q, kv, dtype=torch.bool)


def test_dense_and_flashinfer_masks_match_independent_masks():
    trees, query_lens, seq_lens, causal, masks = _step()
    assert query_lens.tolist()[3:] == [41, 8]  # the packed layout needs two words for the first tree
    dense = build_attention_mask(query_lens, seq_lens, causal, int(query_lens.max()), int(seq_lens.max()), masks)
    fi = flashinfer_custom_mask(query_lens, seq_lens, causal, masks)
    assert fi.custom_mask.dtype == torch.bool and fi.custom_mask.numel() == int((query_lens * seq_lens).sum())
    assert fi.qo_indptr.tolist() == [0, *torch.cumsum(query_lens, 0).tolist()]
    assert torch.equal(fi.kv_lens, seq_lens)
    for rr in range(len(query_lens)):
        q, kv = int(query_lens[rr]), int(seq_lens[rr])
        want = _expected(rr, trees, query_lens, seq_lens, causal)
        assert torch.equal(dense[rr, :q, :kv], want), rr
        assert not dense[rr, :q, kv:].any()  # nothing past the request's KV
        block = fi.custom_mask[fi.mask_indptr[rr] : fi.mask_indptr[rr + 1]].view(q, kv)  # row-major
        assert torch.equal(block, want), rr


def test_flashinfer_mask_gives_the_same_attention_as_the_dense_mask():
    # What FlashInfer computes with the flat mask (ragged, per request) equals SDPA with the dense one.
    trees, query_lens, seq_lens, causal, masks = _step()
    g = torch.Generator().manual_seed(0)
    max_q, max_kv = int(query_lens.max()), int(seq_lens.max())
    q = torch.randn(len(query_lens), 2, max_q, 8, generator=g)
    k = torch.randn(len(query_lens), 2, max_kv, 8, generator=g)
    v = torch.randn(len(query_lens), 2, max_kv, 8, generator=g)
    dense = build_attention_mask(query_lens, seq_lens, causal, max_q, max_kv, masks)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None])
    fi = flashinfer_custom_mask(query_lens, seq_lens, causal, masks)
    for rr in range(len(query_lens)):
        ql, kv = int(query_lens[rr]), int(seq_lens[rr])
        m = fi.custom_mask[fi.mask_indptr[rr] : fi.mask_indptr[rr + 1]].view(ql, kv)
        got = torch.nn.functional.scaled_dot_product_attention(q[rr : rr + 1, :, :ql], k[rr : rr + 1, :, :kv],
                                                               v[rr : rr + 1, :, :kv], attn_mask=m)
        torch.testing.assert_close(got[0], ref[rr, :, :ql], atol=1e-5, rtol=1e-5)


def _unpack_u16(packed: torch.Tensor) -> torch.Tensor:
    """[T, 2W] uint16 -> [T, 32W] bool, bit j of the little-endian 32-bit words."""
    halves = packed.to(torch.int32) & 0xFFFF
    j = torch.arange(packed.shape[1] * 16)
    return ((halves[:, j // 16] >> (j % 16)) & 1).bool()


def test_xqa_spec_mask_holds_each_rows_new_tokens_bit_by_bit():
    trees, query_lens, seq_lens, causal, masks = _step()
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(query_lens, 0)])
    max_q, total = int(query_lens.max()), int(query_lens.sum())
    packed = xqa_spec_mask(qsl, seq_lens, causal, max_q, total + 3, masks)  # 3 rows of graph padding
    words = (max_q + 31) // 32
    assert packed.dtype == torch.uint16 and packed.shape == (total + 3, 2 * words)
    bits = _unpack_u16(packed)
    want = torch.zeros(total + 3, words * 32, dtype=torch.bool)
    rows = lambda r: slice(int(qsl[r]), int(qsl[r + 1]))  # noqa: E731
    want[rows(0), :5] = torch.ones(5, 5, dtype=torch.bool).tril()  # the causal prefill chunk
    want[rows(1), 0] = True  # a single-token decode sees itself
    want[rows(2), :4] = True  # the drafter's non-causal block
    for r, tree in zip((3, 4), trees):
        n = int(tree.num_rows[0])
        want[rows(r), :n] = tree.ancestors[0, :n, :n]  # the tree core's ancestors
    assert torch.equal(bits, want)
    assert bits[int(qsl[3]) : int(qsl[5]), 0].all()  # every tree row sees its root
    # Without tree masks the same rows are causal: the trees' bits are what the masks changed.
    plain = _unpack_u16(xqa_spec_mask(qsl, seq_lens, causal, max_q, total, None))
    assert not torch.equal(plain[rows(3)], want[rows(3)]) and torch.equal(plain[rows(0)], want[rows(0)])


def test_xqa_spec_plan_is_built_without_a_host_read():
    # On the meta device any read of a value raises: the plan of a given size is capturable.
    trees, query_lens, seq_lens, causal, masks = _step()
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(query_lens, 0)])
    meta = lambda t: torch.empty_like(t, device="meta")  # noqa: E731
    tree = TreeStepMasks(meta(masks.has_tree), meta(masks.num_rows), meta(masks.ancestors))
    plan = xqa_spec_plan(meta(qsl), meta(seq_lens), torch.empty(5, 9, dtype=torch.int32, device="meta"),
                         meta(causal), 48, tree, num_tokens=64)
    assert plan.mask.shape == (64, 4) and plan.q_cu_seq_lens.shape == (6,) and plan.max_q == 48
    assert plan.run_kwargs(16)["max_seq_len"] == 9 * 16
