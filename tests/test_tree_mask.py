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
    pack_tree_spec_mask,
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


def test_packed_spec_mask_holds_each_rows_ancestors_bit_by_bit():
    trees, query_lens, _, _, masks = _step()
    max_q = int(query_lens.max())
    packed = pack_tree_spec_mask(masks, max_q)
    words = (max_q + 31) // 32
    assert packed.dtype == torch.uint16 and packed.shape == (49, 2 * words)
    halves = packed.to(torch.int32) & 0xFFFF
    j = torch.arange(words * 32)
    bits = ((halves[:, j // 16] >> (j % 16)) & 1).bool()  # bit j of the little-endian 32-bit words
    start = 0
    for tree in trees:
        n = int(tree.num_rows[0])
        want = torch.zeros(n, words * 32, dtype=torch.bool)
        want[:, :n] = tree.ancestors[0, :n, :n]
        assert torch.equal(bits[start : start + n], want)
        assert bits[start : start + n, 0].all()  # every row sees the root
        start += n
