"""What the GPU tree attention hands FlashInfer for a verify step, checked on the CPU.

No GPU here, so FlashInfer's kernel cannot run. What can break is checked instead:
- the page table and custom mask of `flashinfer_paged_plan`, read the way FlashInfer's paged prefill
  reads them (its documented contract, in plain torch below: pages from ``paged_kv_indices``, KV
  length from the last-page length, each request's mask block at FlashInfer's own mask offsets),
  give the same attention as an oracle over the unpaged K/V with the tree core's own masks;
- the plan is built without a host read (meta device);
- the GPU shim's builder, built from a real ddtree engine config with vLLM's real FlashInfer backend
  and the real ``flashinfer-python`` package (Python only, kept out of the venv's site-packages;
  `make install` puts it in ``.venv/flashinfer``), plans a mixed verify step with the page table
  and mask above, every keyword bound to ``plan()``'s real signature;
- KV compaction moves whole slots in FlashInfer's cache layout.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vllm_ddtree.attention.tree_mask import (
    FlashInferPagedPlan,
    TreeStepMasks,
    flashinfer_paged_plan,
    flashinfer_split_plan,
)
from vllm_ddtree.compaction import move_slots_
from vllm_ddtree.tree import build_tree, compile_tree, dense_attention_mask, topk_per_depth

PAGE = 4
HQ, HKV, HD = 4, 2, 8
FLASHINFER_DIR = Path(sys.prefix) / "flashinfer"


def _tree(num_nodes: int, ctx: int, seed: int):
    lp, ids = topk_per_depth(torch.randn(1, 8, 12, generator=torch.Generator().manual_seed(seed)) * 2, 6)
    return compile_tree(build_tree(lp, ids, num_nodes), torch.tensor([7]), torch.tensor([ctx]))


def _step():
    """Requests: 0 prefill chunk (5 after 6, causal), 1 decode (1 after 8: a full last page),
    2 tree of 1 + 40 rows after 13, 3 tree of 1 + 3 rows after 0 (the tree is the whole KV)."""
    trees = [_tree(40, 13, 1), _tree(3, 0, 2)]
    rows = [int(t.num_rows[0]) for t in trees]
    query_lens = torch.tensor([5, 1, *rows])
    ctx = torch.tensor([6, 8, 13, 0])
    n = max(rows)
    anc = torch.zeros(4, n, n, dtype=torch.bool)
    for t, tree in enumerate(trees):
        anc[2 + t, : tree.max_rows, : tree.max_rows] = tree.ancestors[0]
    masks = TreeStepMasks(has_tree=torch.tensor([False, False, True, True]),
                          num_rows=torch.tensor([0, 0, *rows]), ancestors=anc)
    return trees, query_lens, ctx + query_lens, masks


def _expected_mask(rr, trees, q, kv):
    if rr >= 2:
        return dense_attention_mask(trees[rr - 2], kv)[0, :q]
    return torch.arange(kv)[None, :] <= kv - q + torch.arange(q)[:, None]  # causal


def _attend(q, k, v, mask, scale):
    """q [n, HQ, HD], k/v [kv, HKV, HD], mask [n, kv] -> [n, HQ, HD] (grouped-query attention)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_prefill_like_flashinfer(q, k_cache, v_cache, plan: FlashInferPagedPlan, page_size: int, scale: float):
    """FlashInfer's paged prefill with a custom mask (or a causal plan), as its plan()/run() document it, for HND caches
    [pages, HKV, page_size, HD]: request r's KV is its pages in ``paged_kv_indices`` order, all full
    but the last (``paged_kv_last_page_len`` tokens); its mask block starts at FlashInfer's own
    offset (``_compute_page_mask_indptr``: cumulative q * kv from those two), row-major [q, kv]."""
    out = torch.empty(int(plan.qo_indptr[-1]), *q.shape[1:])
    qo, ind, last = plan.qo_indptr.long(), plan.paged_kv_indptr.long(), plan.paged_kv_last_page_len.long()
    kv_lens = (ind[1:] - ind[:-1] - 1) * page_size + last
    mask_indptr = torch.zeros_like(qo)
    mask_indptr[1:] = torch.cumsum((qo[1:] - qo[:-1]) * kv_lens, 0)
    assert plan.custom_mask is None or int(mask_indptr[-1]) == plan.custom_mask.numel()
    for r in range(len(qo) - 1):
        pages = plan.paged_kv_indices[ind[r] : ind[r + 1]].long()
        kv = int(kv_lens[r])
        k = k_cache[pages].transpose(1, 2).reshape(-1, HKV, HD)[:kv]
        v = v_cache[pages].transpose(1, 2).reshape(-1, HKV, HD)[:kv]
        n = int(qo[r + 1] - qo[r])
        if plan.custom_mask is None:  # a causal plan (FlashInfer aligns the queries to the KV's end)
            mask = torch.arange(kv)[None, :] <= kv - n + torch.arange(n)[:, None]
        else:
            mask = plan.custom_mask[mask_indptr[r] : mask_indptr[r + 1]].view(n, kv)
        out[qo[r] : qo[r + 1]] = _attend(q[qo[r] : qo[r + 1]], k, v, mask, scale)
    return out


def _paged_step(seed=0):
    """The step's K/V written into a shuffled HND page pool, with the block table that finds them."""
    trees, query_lens, seq_lens, masks = _step()
    g = torch.Generator().manual_seed(seed)
    r = len(query_lens)
    keys = [torch.randn(int(kv), HKV, HD, generator=g) for kv in seq_lens]
    values = [torch.randn(int(kv), HKV, HD, generator=g) for kv in seq_lens]
    pages_per_req = [(int(kv) + PAGE - 1) // PAGE for kv in seq_lens]
    pool = torch.randperm(sum(pages_per_req) + 5, generator=g)  # spare pages stay random garbage
    k_cache = torch.randn(len(pool), HKV, PAGE, HD, generator=g)
    v_cache = torch.randn(len(pool), HKV, PAGE, HD, generator=g)
    block_table = torch.full((r, max(pages_per_req) + 2), 10_000)  # columns past a request's pages: junk
    start = 0
    for rr, np_ in enumerate(pages_per_req):
        block_table[rr, :np_] = pool[start : start + np_]
        start += np_
        for p in range(int(seq_lens[rr])):
            page, off = block_table[rr, p // PAGE], p % PAGE
            k_cache[page, :, off], v_cache[page, :, off] = keys[rr][p], values[rr][p]
    qsl = torch.zeros(r + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(query_lens, 0)
    q = torch.randn(int(qsl[-1]), HQ, HD, generator=g)
    return trees, query_lens, seq_lens, masks, keys, values, k_cache, v_cache, block_table, qsl, q


def test_paged_plan_read_like_flashinfer_gives_the_oracles_tree_attention():
    trees, query_lens, seq_lens, masks, keys, values, k_cache, v_cache, block_table, qsl, q = _paged_step()
    causal = torch.tensor([True, True, True, True])
    plan = flashinfer_paged_plan(qsl, seq_lens, block_table, PAGE, causal, masks)
    assert plan.paged_kv_last_page_len.tolist() == [3, 1, 2, 4]  # kv 11, 9, 54, 4 with pages of 4
    assert plan.kv_lens.tolist() == seq_lens.tolist()
    assert all(t.dtype == torch.int32 for t in (plan.qo_indptr, plan.paged_kv_indptr, plan.paged_kv_indices))
    scale = HD ** -0.5
    got = paged_prefill_like_flashinfer(q, k_cache, v_cache, plan, PAGE, scale)
    for rr in range(len(query_lens)):
        n, kv = int(query_lens[rr]), int(seq_lens[rr])
        want = _attend(q[qsl[rr] : qsl[rr + 1]], keys[rr], values[rr], _expected_mask(rr, trees, n, kv), scale)
        torch.testing.assert_close(got[qsl[rr] : qsl[rr + 1]], want, atol=1e-5, rtol=1e-5)


def test_paged_plan_changes_the_output_where_the_tree_mask_matters():
    # Guard against an oracle that would pass anything: a causal plan over the same tree rows differs.
    trees, query_lens, seq_lens, masks, keys, values, k_cache, v_cache, block_table, qsl, q = _paged_step()
    plan = flashinfer_paged_plan(qsl, seq_lens, block_table, PAGE, True, None)
    got = paged_prefill_like_flashinfer(q, k_cache, v_cache, plan, PAGE, 1.0)
    rr = 2
    n, kv = int(query_lens[rr]), int(seq_lens[rr])
    want = _attend(q[qsl[rr] : qsl[rr + 1]], keys[rr], values[rr], _expected_mask(rr, trees, n, kv), 1.0)
    assert not torch.allclose(got[qsl[rr] : qsl[rr + 1]], want, atol=1e-3)


def test_paged_plan_needs_no_host_read():
    # Host lengths in, device (meta) block table and tree masks: any device read would raise.
    _, query_lens, seq_lens, masks, *_ , block_table, qsl, _ = _paged_step()
    meta = torch.device("meta")
    on_meta = TreeStepMasks(masks.has_tree.to(meta), masks.num_rows.to(meta), masks.ancestors.to(meta))
    plan = flashinfer_paged_plan(qsl, seq_lens, block_table.to(meta), PAGE, True, on_meta)
    assert plan.custom_mask.device == meta and plan.custom_mask.numel() == int((query_lens * seq_lens).sum())
    assert plan.paged_kv_indices.device == meta and plan.paged_kv_indices.numel() == int(plan.paged_kv_indptr[-1])


def _reordered(order: list[int]):
    """The paged step with its requests in `order` (as vLLM's batch reorder may put them)."""
    trees, query_lens, seq_lens, masks, keys, values, k_cache, v_cache, block_table, qsl, q = _paged_step()
    idx = torch.tensor(order)
    q = torch.cat([q[qsl[i] : qsl[i + 1]] for i in order])
    query_lens, seq_lens = query_lens[idx], seq_lens[idx]
    qsl = torch.zeros(len(order) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(query_lens, 0)
    masks = TreeStepMasks(masks.has_tree[idx], masks.num_rows[idx], masks.ancestors[idx],
                          has_tree_cpu=masks.has_tree[idx])
    expected = [_expected_mask(i, trees, int(query_lens[j]), int(seq_lens[j])) for j, i in enumerate(order)]
    return query_lens, seq_lens, masks, [keys[i] for i in order], [values[i] for i in order], k_cache, v_cache, \
        block_table[idx], qsl, q, expected


def test_split_plan_gives_prefill_chunks_the_causal_plan_and_the_same_attention():
    # decode, tree, tree, then the prefill chunk: the masked plan ends at the last tree
    query_lens, seq_lens, masks, keys, values, k_cache, v_cache, block_table, qsl, q, expected = _reordered([1, 2, 3, 0])
    split = flashinfer_split_plan(qsl, seq_lens, block_table, PAGE, True, masks)
    assert (split.num_tree_reqs, split.num_tree_tokens) == (3, int(qsl[3]))
    assert split.tree.custom_mask.numel() == int((query_lens * seq_lens)[:3].sum())  # none for the chunk
    assert split.causal.custom_mask is None and split.causal.plan_kwargs()["causal"] is True
    assert split.causal.qo_indptr.tolist() == [0, 5] and split.causal.paged_kv_indptr.tolist() == [0, 3]
    scale = HD ** -0.5
    got = torch.cat([paged_prefill_like_flashinfer(q[: split.num_tree_tokens], k_cache, v_cache, split.tree, PAGE, scale),
                     paged_prefill_like_flashinfer(q[split.num_tree_tokens :], k_cache, v_cache, split.causal, PAGE, scale)])
    for rr in range(len(query_lens)):
        want = _attend(q[qsl[rr] : qsl[rr + 1]], keys[rr], values[rr], expected[rr], scale)
        torch.testing.assert_close(got[qsl[rr] : qsl[rr + 1]], want, atol=1e-5, rtol=1e-5)


def test_split_plan_is_one_masked_plan_when_it_cannot_split():
    query_lens, seq_lens, masks, *_, block_table, qsl, _, _ = _reordered([1, 2, 3, 0])
    whole = int((query_lens * seq_lens).sum())
    # no host copy of the tree rows (reading the device copy would be a sync)
    plain = TreeStepMasks(masks.has_tree, masks.num_rows, masks.ancestors)
    split = flashinfer_split_plan(qsl, seq_lens, block_table, PAGE, True, plain)
    assert split.causal is None and split.num_tree_reqs == 4 and split.tree.custom_mask.numel() == whole
    # a request after the last tree that is not causal (the DFlash drafter's block) keeps the mask
    flags = torch.tensor([True, True, True, False])
    split = flashinfer_split_plan(qsl, seq_lens, block_table, PAGE, flags, masks)
    assert split.causal is None and split.tree.custom_mask.numel() == whole
    # the last request a tree: nothing after it
    _, seq2, masks2, *_, bt2, qsl2, _, _ = _reordered([0, 1, 2, 3])
    split = flashinfer_split_plan(qsl2, seq2, bt2, PAGE, True, masks2)
    assert split.causal is None and split.num_tree_reqs == 4


def test_split_plan_needs_no_host_read():
    query_lens, seq_lens, masks, *_, block_table, qsl, _, _ = _reordered([1, 2, 3, 0])
    meta = torch.device("meta")
    on_meta = TreeStepMasks(masks.has_tree.to(meta), masks.num_rows.to(meta), masks.ancestors.to(meta),
                            has_tree_cpu=masks.has_tree_cpu)
    split = flashinfer_split_plan(qsl, seq_lens, block_table.to(meta), PAGE, True, on_meta)
    assert split.tree.custom_mask.device == meta and split.tree.custom_mask.numel() == int((query_lens * seq_lens)[:3].sum())
    assert split.causal.paged_kv_indices.device == meta and split.causal.paged_kv_indices.numel() == 3


def test_compaction_moves_whole_slots_in_flashinfers_cache_layout():
    g = torch.Generator().manual_seed(3)
    blocks, bs = 5, 4
    caches = [torch.randn(blocks, HKV, bs, 2 * HD, generator=g) for _ in range(2)]
    before = [c.clone() for c in caches]
    # 9 is read before 17 overwrites it (gather first); 6 -> 6 is a no-op entry, as plans carry.
    src, dst = torch.tensor([9, 17, 6]), torch.tensor([5, 9, 6])
    move_slots_(caches, src, dst, "flashinfer")
    for cache, old in zip(caches, before):
        # vLLM's FlashInfer do_kv_cache_update reads the layer cache as (K, V) [blocks, bs, heads, hd].
        k_new, v_new = cache.transpose(1, 2).split(HD, dim=-1)
        k_old, v_old = old.transpose(1, 2).split(HD, dim=-1)
        flat = lambda t: t.reshape(blocks * bs, HKV, HD)  # noqa: E731
        for s, d in zip(src.tolist(), dst.tolist()):
            assert torch.equal(flat(k_new)[d], flat(k_old)[s]) and torch.equal(flat(v_new)[d], flat(v_old)[s])
        untouched = torch.ones(blocks * bs, dtype=torch.bool)
        untouched[dst] = False
        assert torch.equal(flat(k_new)[untouched], flat(k_old)[untouched])
    with pytest.raises(ValueError, match="expected one of"):
        move_slots_(caches, src, dst, "NHD")


def test_cuda_toolkit_missing_looks_where_flashinfer_looks(tmp_path, monkeypatch):
    # FlashInfer takes the toolkit from CUDA_HOME / CUDA_PATH, else the nvcc on PATH, else /usr/local/cuda
    import vllm_ddtree.vllm_patches as patches
    from vllm_ddtree.vllm_patches import cuda_toolkit_missing

    toolkit, empty = tmp_path / "cuda", tmp_path / "empty"
    (toolkit / "bin").mkdir(parents=True)
    empty.mkdir()
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    assert cuda_toolkit_missing() is None
    monkeypatch.setenv("CUDA_HOME", str(empty))
    assert cuda_toolkit_missing() == f"no bin/nvcc under {empty}"  # FlashInfer uses CUDA_HOME as set
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    assert cuda_toolkit_missing() is None
    monkeypatch.delenv("CUDA_PATH")
    monkeypatch.setenv("PATH", str(toolkit / "bin"))
    assert cuda_toolkit_missing() is None
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(patches, "FLASHINFER_DEFAULT_CUDA_HOME", str(toolkit))
    assert cuda_toolkit_missing() is None  # the last place FlashInfer looks
    monkeypatch.setattr(patches, "FLASHINFER_DEFAULT_CUDA_HOME", str(empty))
    assert importlib.util.find_spec("flashinfer_jit_cache") is None  # (its prebuilt kernels would do)
    assert cuda_toolkit_missing() == f"no CUDA_HOME or CUDA_PATH, no nvcc on PATH, none in {empty}"


def test_gpu_attention_choice_refuses_what_cannot_take_a_tree_mask():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_ddtree.vllm_patches import gpu_tree_attention_backend

    with pytest.raises(ValueError, match="FLASH_ATTN takes no per-request tree mask.*FLASHINFER"):
        gpu_tree_attention_backend(AttentionBackendEnum.FLASH_ATTN)
    # This venv has no flashinfer on its path (it lives in .venv/flashinfer for the test below).
    with pytest.raises(ImportError, match=r"pip install vllm-ddtree\[gpu\]"):
        gpu_tree_attention_backend(None)


def test_gpu_shim_builds_a_verify_step_with_vllms_flashinfer_backend():
    # tests/flashinfer_shim_check.py: a real builder from a real ddtree config plans a mixed verify
    # step; only FlashInfer's CUDA wrapper is replaced (by one bound to its real plan() signature).
    assert (FLASHINFER_DIR / "flashinfer").is_dir(), f"{FLASHINFER_DIR} is missing: run `make install`"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FLASHINFER_DIR), os.environ.get("PYTHONPATH", "")]))
    script = Path(__file__).with_name("flashinfer_shim_check.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shim ok" in done.stdout


def test_mask_built_in_chunks_is_the_same_mask():
    # Small chunks split requests (a 41-row tree block spans many) and cross request boundaries.
    from vllm_ddtree.attention.tree_mask import flashinfer_custom_mask

    _, query_lens, seq_lens, masks = _step()
    causal = torch.ones(len(query_lens), dtype=torch.bool)
    whole = flashinfer_custom_mask(query_lens, seq_lens, causal, masks)
    for chunk in (1, 7, 64, 1000):
        part = flashinfer_custom_mask(query_lens, seq_lens, causal, masks, total=int((query_lens * seq_lens).sum()),
                                      chunk=chunk)
        assert torch.equal(part.custom_mask, whole.custom_mask), chunk
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        flashinfer_custom_mask(query_lens, seq_lens, causal, masks, chunk=0)
