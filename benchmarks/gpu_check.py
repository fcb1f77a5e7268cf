"""The GPU check: our GPU path on one CUDA device, in one process, without vLLM.

Parts (each passed / failed / not run, with its numbers; the JSON is rewritten after every part; they
run in the order of `PARTS`):
  a.plan     FlashInfer tree-step inputs: `flashinfer_paged_plan` on mixed batches (trees of 1-128
             nodes, a causal prefill chunk, single-token decodes, trees across page boundaries, a tree
             that is the whole KV) against the tree core's own masks, FlashInfer's mask offsets, plan()'s
             signature, and a paged read of vLLM's FlashInfer cache layout against float32 SDPA. Any device.
             Also the split plan vLLM's builder makes (`flashinfer_split_plan`: requests up to the last
             tree masked, the prefill chunks after them causal).
  a.kernel   The same batches through FlashInfer's paged prefill with the custom mask, planned as vLLM's
             builder plans it (`plan_flashinfer_tree_step`), bf16 and fp16, Qwen3-8B heads, page 16,
             against float32 SDPA; the tolerance is the same kernel's error on a causal batch of the same
             data; and as the builder runs a step, split: the masked part, then the causal part on the
             kernel vLLM's own prefill uses (`backend="auto"`). Timing: custom-mask vs causal plan + run,
             and a prefill chunk beside trees in one masked plan vs split. CUDA only.
  b.pipeline The tree step's device work: top-k -> build (plain, n-gram scored, with the lookup branch)
             -> automatic budget -> compile -> walk -> compaction plan, against the heap builder, a host
             walk and host moves; on CUDA also equal to the same step run on the CPU. Eager step time.
  b.sync     That step under torch.cuda.set_sync_debug_mode("error") after one warm-up step, with the
             n-gram tables' per-step count of sampled tokens where the variant keeps them; on a
             failure, every host sync site (file:line) from one pass in "warn" mode. CUDA only.
  b.profile  One eager step under torch.profiler at the smallest and largest batch: dispatched ops, and on
             CUDA kernels and kernel time, per stage (top-k, build, lookup, budget, compile, walk,
             compaction); the step's kernels by device time; where the variant keeps n-gram tables,
             the same for counting a step's tokens into them (`observe`). Any device.
  b.seeded   A seeded request's tree rows: the row at depth d draws the noise vLLM's exponential race
             (`random_sample`: a row of noise from the request's generator per step) gives the target
             alone d steps later, float32 and float64; the generator's states after each draw. Any device.
  c.compaction `move_slots_` over 36 layers of a paged cache in vLLM's FlashInfer layout, one allocation
             as vLLM makes it (moved as one stack), against a per-slot reference, timed. Any device.
  d.verify_cost The verify forward of a Qwen3-8B-shaped transformers decoder (random bf16 weights) for
             batch x (1 + N) rows at context 1K, medians; `CostModel` fitted to it; the knee (first N
             whose step is 10% above the one-row step). On a CPU a tiny Qwen3 config in float32.
  b.topk     The drafter's candidates at Qwen3-8B's head: torch.topk against a top-k by slices of each
             row (and with --topk-flashinfer FlashInfer's radix top-k) on the same log-probs (same values;
             ids but for ties at the k-th place), and the head's whole logits against `head_topk`'s
             chunks of rows: time and peak device memory. Any device.
  b.graphs   The step captured in a CUDA graph per batch size, replayed on new inputs after the serving
             state moved on (calibrations updated, the cost model refit), equal to eager; eager vs
             replay time. Then the proposer's own captures (`StepGraphs` around
             `plan_trees_with_lookup`, what VLLM_DDTREE_STEP_GRAPHS=1 runs) the same way, with and
             without n-gram rescoring (its tables moved in place between capture and replay), and the
             verify side's (`schedule_rows`: the verify rows before the forward; `verify_trees`:
             walk, statistics, calibration) over steps that pad to one capture, smaller ones after
             larger. CUDA only; after the others, so a failed capture cannot disturb them.
  a.xqa      Tree verify through FlashInfer's XQA speculative decode, the kernel vLLM's FlashInfer backend
             runs for ragged speculative batches on SM90: the trees as its packed per-row mask
             (`xqa_spec_plan`), the a.kernel cases without prefill chunks and with trees of at most 73 rows
             (what a verify step hands XQA) against float32 SDPA, bf16 and fp16, within the same
             kernel's error on the causal mask, the mask changing every tree's output; one step captured in
             a CUDA graph with its plan in persistent buffers, replayed on the next step's trees, contexts
             and queries; XQA vs the custom-mask FA2 path, timed on the same steps. SM90/SM12x only; last.

    python benchmarks/gpu_check.py --device cuda --json-dir benchmarks/results/gpu   # <device>.json/.png
    python benchmarks/gpu_check.py --device cpu --quick --json /tmp/check.json       # what runs without CUDA
    python benchmarks/gpu_check.py --plot benchmarks/results/gpu/h100.json           # redraw a PNG
    python benchmarks/gpu_check.py --device cuda --only b.profile --update --json-dir benchmarks/results/gpu
                                                                   # rerun one part into the report

Imports nothing of vLLM. `--site DIR` appends a folder of carried packages (FlashInfer and what it
imports; `make gpu-wheels`) to the module path, after the machine's own packages.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import logging
import math
import os
import platform
import re
import shutil
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the project, uninstalled (the GPU machine has only the working tree)
sys.path.insert(1, str(REPO / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vllm_ddtree.attention.tree_mask import (  # noqa: E402
    FlashInferPagedPlan,
    TreeStepMasks,
    FlashInferSplitPlan,
    XQASpecPlan,
    flashinfer_paged_plan,
    flashinfer_split_plan,
    flashinfer_tree_wrapper,
    plan_flashinfer_causal_step,
    plan_flashinfer_tree_step,
    prebuild_tree_kernels,
    xqa_spec_plan,
)
from vllm_ddtree.compaction import accepted_path_moves, layer_stacks, move_slots_  # noqa: E402
from vllm_ddtree.sampling import SeededDraws, SeededRows, draw  # noqa: E402
from vllm_ddtree.tree.lookup import LOOKUP_WINDOW  # noqa: E402
from vllm_ddtree.tree import (  # noqa: E402
    CHAIN,
    AcceptanceCalibration,
    AutoBudget,
    CostModel,
    LookupCalibration,
    ModelShape,
    NGramModel,
    TokenHistory,
    StepGraphs,
    TreeBatch,
    add_branch,
    build_tree,
    build_tree_reference,
    compile_tree,
    dense_attention_mask,
    draft_trees,
    get_profile,
    head_topk,
    padded_rows,
    padded_width,
    plan_trees_with_lookup,
    schedule_rows,
    topk_per_depth,
    verify_trees,
    walk_tree,
)

# Qwen3-8B's attention (32 query heads, 8 KV heads, head dim 128) and vLLM's FlashInfer page size.
HQ, HKV, HD, PAGE = 32, 8, 128, 16
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN3_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)
TOPK_SEGMENT_CHOICES = (4, 16, 64)  # b.topk: slices per row of the "segmented" top-k
DEPTHS = 15  # a DFlash drafter of block 16 drafts 15 depths
BUILD = 64  # tree width built per request (the automatic budget's largest tree)
LOOKUP = 8  # prompt-lookup branch length
TOKEN_WIDTH = BUILD + LOOKUP + 1  # a captured step's new tokens per row, padded (the proposer's: max budget + 1)
NGRAM_WEIGHT = 0.2
REPO_FILES = ("vllm_ddtree", "benchmarks")


@dataclass
class Sizes:
    """What each part runs over, by device and --quick."""

    context_scale: float  # a.*: attention case contexts are multiplied by this
    timing_batches: tuple[int, ...]  # a.kernel timing
    timing_contexts: tuple[int, ...]
    vocab: int  # b.*: drafter vocabulary
    batches: tuple[int, ...]  # b.*, c: batch sizes
    reference_batch: int  # b.pipeline: largest batch checked against the host references
    layers: int  # c: layers of the paged cache
    cache_heads: tuple[int, int]  # c: (kv heads, head dim)
    model: dict  # d: transformers Qwen3 config
    model_dtype: torch.dtype
    verify_batches: tuple[int, ...]
    verify_rows: tuple[int, ...]  # N: draft rows after the root
    verify_context: int
    reps: int  # timed repetitions per point (median)


def sizes_for(device: str, quick: bool) -> Sizes:
    """The sizes of a full CUDA run, a quick one, and the CPU's (always small)."""
    if device == "cpu":
        return Sizes(0.1, (), (), 2048, (1, 4), 4, 36, (2, 16), QWEN3_TINY, torch.float32, (1, 4), (0, 4, 16, 64),
                     64, 3)
    if quick:
        return Sizes(0.25, (1, 8), (1024,), 151936, (1, 8), 8, 36, (HKV, HD), QWEN3_8B, torch.bfloat16, (1, 8),
                     (0, 16, 64, 256), 1024, 3)
    return Sizes(1.0, (1, 8, 32), (1024, 8192), 151936, (1, 8, 64, 256), 8, 36, (HKV, HD), QWEN3_8B, torch.bfloat16,
                 (1, 8, 32), (0, 4, 8, 16, 32, 64, 128, 256), 1024, 5)


class Deadline:
    """A wall-clock budget for the whole check: timing loops skip their remaining points past it."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0


def log(msg: str) -> None:
    """Progress, flushed (a person watches it scroll)."""
    print(msg, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def held_by(fn: Callable[[], object], device: torch.device) -> tuple[object, int | None, float]:
    """`fn()`, the device memory it leaves reserved (None off CUDA) and its milliseconds, the device
    drained: around a capture, the graph's private pool, which vLLM's memory profiling does not see
    (the proposer keeps up to `max_graphs` of them), and the capture's time."""
    sync(device)
    if device.type == "cuda":  # as torch.cuda.graph does on entering: what stays reserved after is the pool
        gc.collect()
        torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    ms = 1e3 * (time.perf_counter() - t0)
    return out, (torch.cuda.memory_reserved(device) - held if device.type == "cuda" else None), ms


def timed_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median wall milliseconds of `fn` after one warm-up call, the device drained around each call."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def where_in_repo(tb) -> str | None:
    """'file:line in function: code' of the innermost frame of this project in a traceback or stack."""
    frames = traceback.extract_tb(tb) if not isinstance(tb, list) else tb
    ours = [f for f in frames if any(f"{os.sep}{d}{os.sep}" in f.filename for d in REPO_FILES)]
    if not ours:
        return None
    f = ours[-1]
    rel = os.path.relpath(f.filename, REPO)
    return f"{rel}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def failure(exc: BaseException) -> dict:
    """What a failed step says: the exception, where in our code, and the last frames."""
    return {"error": f"{type(exc).__name__}: {str(exc).strip()[:600]}", "where": where_in_repo(exc.__traceback__),
            "traceback": traceback.format_exception(type(exc), exc, exc.__traceback__)[-4:]}


# ---------------------------------------------------------------------------------------------------
# a. FlashInfer tree attention
# ---------------------------------------------------------------------------------------------------


@dataclass
class Request:
    """One request of an attention case: `q` new tokens after `ctx` cached ones; a tree request's
    new tokens are its compiled tree's rows (root first)."""

    kind: str  # "tree", "prefill" or "decode"
    q: int
    ctx: int
    tree: TreeBatch | None = None


def small_tree(nodes: int, ctx: int, seed: int) -> TreeBatch:
    """A real draft tree of `nodes` nodes from the tree core (15 depths, 16 candidates each), compiled
    after `ctx` context tokens."""
    g = torch.Generator().manual_seed(seed)
    top_logp, top_ids = topk_per_depth(torch.randn(1, DEPTHS, 64, generator=g) * 3, 16)
    return compile_tree(build_tree(top_logp, top_ids, nodes), torch.tensor([1]), torch.tensor([ctx]))


def tree_request(nodes: int, ctx: int, seed: int) -> Request:
    tree = small_tree(nodes, ctx, seed)
    return Request("tree", int(tree.num_rows[0]), ctx, tree)


def attention_cases(scale: float) -> dict[str, list[Request]]:
    """Mixed verify batches; contexts times `scale` (at least the page-boundary cases stay)."""
    c = lambda n: max(1, int(n * scale))  # noqa: E731
    return {
        "mixed": [Request("prefill", 37, c(100)), Request("decode", 1, 15), Request("decode", 1, c(1000)),
                  tree_request(1, 13, 1), tree_request(7, c(250), 2), tree_request(64, c(1000) + 3, 3),
                  tree_request(128, c(4000), 4), tree_request(40, 0, 5)],
        "trees_across_pages": [tree_request(n, ctx, 10 + i) for i, (n, ctx) in
                               enumerate([(64, 15), (64, 16), (64, 17), (31, 1), (15, c(2000) + 9), (128, 8)])],
        "decodes_then_tree": [Request("decode", 1, c(300) + i) for i in range(4)] + [tree_request(15, 31, 20)],
        # as vLLM orders a step at ddtree's reorder threshold: decodes and trees, then prefill chunks
        "trees_then_prefill": [Request("decode", 1, c(500)), tree_request(15, c(300), 30), Request("decode", 1, 40),
                               tree_request(64, c(1000) + 5, 31), Request("decode", 1, c(700)),
                               Request("prefill", 300, c(2000)), Request("prefill", 200, 0)],
    }


def step_masks(reqs: list[Request]) -> TreeStepMasks:
    """The step's tree masks: [R] has_tree, [R] num_rows, [R, n, n] ancestors (padded)."""
    n = max([r.q for r in reqs if r.tree is not None], default=1)
    anc = torch.zeros(len(reqs), n, n, dtype=torch.bool)
    for i, r in enumerate(reqs):
        if r.tree is not None:
            anc[i, : r.q, : r.q] = r.tree.ancestors[0, : r.q, : r.q]
    has_tree = torch.tensor([r.tree is not None for r in reqs])
    return TreeStepMasks(has_tree=has_tree, num_rows=torch.tensor([r.q if r.tree is not None else 0 for r in reqs]),
                         ancestors=anc, has_tree_cpu=has_tree)


def oracle_mask(req: Request, tree_masks: bool = True) -> torch.Tensor:
    """[q, kv] bool: the tree core's mask for a tree request (`dense_attention_mask`), else causal."""
    kv = req.ctx + req.q
    if req.tree is not None and tree_masks:
        return dense_attention_mask(req.tree, kv)[0, : req.q]
    return torch.arange(kv)[None, :] <= req.ctx + torch.arange(req.q)[:, None]


@dataclass
class PagedStep:
    """A case's data: Q, the unpaged K/V, and the same K/V in a paged cache in vLLM's FlashInfer layout.

    q          [T, HQ, HD]            the step's queries (T = sum of q)
    keys/values [kv_r, HKV, HD] each  per request, float32 copies of what the cache holds
    cache      [P, HKV, PAGE, 2 * HD] a layer's logical view (K then V in the last dim); physically
                                      [P, PAGE, HKV, 2 * HD] (vLLM's default LBNHC layout, FlashInfer "NHD")
    block_table [R, max_pages + 2] int32, on the device; columns past a request's pages hold junk
    qsl [R + 1], seq_lens [R]  int64 host
    """

    reqs: list[Request]
    q: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cache: torch.Tensor
    block_table: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    masks: TreeStepMasks


def paged_step(reqs: list[Request], dtype: torch.dtype, device: torch.device, seed: int,
               with_oracle: bool = True) -> PagedStep:
    """Random Q/K/V in `dtype`, drawn on `device`, K/V written into shuffled pages (the page order and
    the junk block-table columns come from a host generator). Without `with_oracle` (timing) the
    unpaged float32 copies are not kept."""
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=device).manual_seed(seed)
    seq = torch.tensor([r.ctx + r.q for r in reqs])
    pages = [(int(kv) + PAGE - 1) // PAGE for kv in seq]
    pool = torch.randperm(sum(pages) + 7, generator=g)  # 7 spare pages stay garbage
    phys = torch.randn(len(pool), PAGE, HKV, 2 * HD, generator=gd, device=device).to(dtype)
    block_table = torch.full((len(reqs), max(pages) + 2), len(pool) + 1000, dtype=torch.int32)
    keys, values, start = [], [], 0
    for i, (kv, np_) in enumerate(zip(seq.tolist(), pages)):
        block_table[i, :np_] = pool[start : start + np_].int()
        start += np_
        kvals = torch.randn(kv, HKV, 2 * HD, generator=gd, device=device).to(dtype)
        pos = torch.arange(kv)
        phys[block_table[i, pos // PAGE].long().to(device), (pos % PAGE).to(device)] = kvals
        if with_oracle:
            keys.append(kvals[..., :HD].float())
            values.append(kvals[..., HD:].float())
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor([r.q for r in reqs]), 0)
    q = torch.randn(int(qsl[-1]), HQ, HD, generator=gd, device=device).to(dtype)
    cache = phys.permute(0, 2, 1, 3)  # the logical [P, HKV, PAGE, 2 * HD] view vLLM hands a layer
    return PagedStep(reqs, q, keys, values, cache, block_table.to(device), qsl, seq, step_masks(reqs))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 grouped-query attention: q [n, HQ, HD], k/v [kv, HKV, HD], mask [n, kv] -> [n, HQ, HD]."""
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None], attn_mask=mask.to(q.device), scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def oracle_attention(step: PagedStep, tree_masks: bool = True) -> torch.Tensor:
    """[T, HQ, HD] float32 over the unpaged K/V with the tree core's masks (causal ones if not `tree_masks`)."""
    outs = [sdpa(step.q[step.qsl[i] : step.qsl[i + 1]], step.keys[i], step.values[i],
                 oracle_mask(r, tree_masks), HD ** -0.5) for i, r in enumerate(step.reqs)]
    return torch.cat(outs)


def paged_read_like_flashinfer(step: PagedStep, plan: FlashInferPagedPlan, q: torch.Tensor | None = None) -> torch.Tensor:
    """FlashInfer's paged prefill with a custom mask (or a causal plan) as its plan()/run() document it,
    in float32 torch, for queries `q` (default: the step's): request r's KV is its pages in
    `paged_kv_indices` order, all full but the last (`paged_kv_last_page_len` tokens), read from the
    layer cache's logical view; its mask block starts at the cumulative q * kv that FlashInfer derives
    from those, row-major [q, kv]; a causal plan aligns the queries to the KV's end."""
    q = step.q if q is None else q
    qo, ind, last = plan.qo_indptr.long(), plan.paged_kv_indptr.long(), plan.paged_kv_last_page_len.long()
    kv_lens = (ind[1:] - ind[:-1] - 1) * PAGE + last
    offsets = torch.zeros_like(qo)
    offsets[1:] = torch.cumsum((qo[1:] - qo[:-1]) * kv_lens, 0)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for r in range(len(qo) - 1):
        pages = plan.paged_kv_indices[ind[r] : ind[r + 1]].long()
        kv, n = int(kv_lens[r]), int(qo[r + 1] - qo[r])
        tokens = step.cache[pages].transpose(1, 2).reshape(-1, HKV, 2 * HD)[:kv].float()  # [kv, HKV, 2 * HD]
        if plan.custom_mask is None:
            mask = torch.arange(kv, device=q.device)[None, :] <= kv - n + torch.arange(n, device=q.device)[:, None]
        else:
            mask = plan.custom_mask[offsets[r] : offsets[r + 1]].view(n, kv)
        out[qo[r] : qo[r + 1]] = sdpa(q[qo[r] : qo[r + 1]], tokens[..., :HD], tokens[..., HD:], mask, HD ** -0.5)
    return out


def step_plan(step: PagedStep, tree: bool = True) -> FlashInferPagedPlan:
    """The plan vLLM's builder makes for this step (causal for requests without a tree)."""
    dev = step.block_table.device
    masks = step.masks
    on_dev = TreeStepMasks(masks.has_tree.to(dev), masks.num_rows.to(dev), masks.ancestors.to(dev))
    return flashinfer_paged_plan(step.qsl, step.seq_lens, step.block_table, PAGE, True, on_dev if tree else None)


def step_split(step: PagedStep) -> FlashInferSplitPlan:
    """The split plan vLLM's builder makes for this step: masked up to the last tree, causal after."""
    dev = step.block_table.device
    masks = step.masks
    on_dev = TreeStepMasks(masks.has_tree.to(dev), masks.num_rows.to(dev), masks.ancestors.to(dev),
                           has_tree_cpu=masks.has_tree_cpu)
    return flashinfer_split_plan(step.qsl, step.seq_lens, step.block_table, PAGE, True, on_dev)


def split_read_like_flashinfer(step: PagedStep, split: FlashInferSplitPlan) -> torch.Tensor:
    """`paged_read_like_flashinfer` of the split's two plans, the causal one on the queries after the masked."""
    t = split.num_tree_tokens
    parts = []
    if split.tree is not None:
        parts.append(paged_read_like_flashinfer(step, split.tree, step.q[:t]))
    if split.causal is not None:
        parts.append(paged_read_like_flashinfer(step, split.causal, step.q[t:]))
    return torch.cat(parts)


def step_xqa_plan(step: PagedStep, tree: bool = True, num_tokens: int | None = None) -> XQASpecPlan:
    """The step as XQA's speculative decode takes it (every request a ragged draft), tree masks or causal.
    Block-table columns past a request's pages are zeroed (a valid page, as in vLLM's tables): XQA, unlike
    FlashInfer's prefill, is handed the whole table."""
    dev = step.block_table.device
    pages = (step.seq_lens + PAGE - 1) // PAGE
    cols = torch.arange(step.block_table.shape[1])
    table = torch.where((cols[None, :] < pages[:, None]).to(dev), step.block_table, 0)
    masks = step.masks
    on_dev = TreeStepMasks(masks.has_tree.to(dev), masks.num_rows.to(dev), masks.ancestors.to(dev))
    causal = torch.ones(len(step.reqs), dtype=torch.bool)
    # One query width for every step, as an engine would pass its verify width: XQA builds a kernel per width.
    max_q = max(TOKEN_WIDTH, *(r.q for r in step.reqs))
    return xqa_spec_plan(step.qsl, step.seq_lens, table, causal, max_q, on_dev if tree else None, num_tokens)


def xqa_cases(scale: float) -> dict[str, list[Request]]:
    """`attention_cases` as XQA would get them in a verify step: the prefill chunks left out (they take the
    causal prefill path) and every tree at most TOKEN_WIDTH rows, the most a verify step gives a request
    (the largest tree plus the lookup branch and the root); contexts as they were."""
    cases = {}
    for name, reqs in attention_cases(scale).items():
        kept = [tree_request(TOKEN_WIDTH - 1, r.ctx, 200 + i) if r.tree is not None and r.q > TOKEN_WIDTH else r
                for i, r in enumerate(reqs) if r.kind != "prefill"]
        cases[name] = kept
    return cases


def xqa_read_like(step: PagedStep, plan: XQASpecPlan, q: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """FlashInfer's XQA speculative decode as `flashinfer.xqa.xqa` documents it, in float32 torch: request
    r's queries are rows q_cu_seq_lens[r]..[r + 1]; its KV the first seq_lens[r] tokens of its pages in
    block_tables[r] order; a query row sees every position before the request's new tokens and new token
    j where bit j of its mask row is set (32-bit words, least-significant bit first, little-endian uint16
    halves). Written into `out` when given (in its dtype), as the kernel writes its output."""
    q = step.q if q is None else q
    cu, seq = plan.q_cu_seq_lens.long().cpu(), plan.seq_lens.long().cpu()
    halves = plan.mask.to(torch.int32) & 0xFFFF
    j = torch.arange(plan.mask.shape[1] * 16, device=halves.device)
    bits = ((halves[:, j // 16] >> (j % 16)) & 1).bool()  # [T, 32 W]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device) if out is None else out
    for r in range(len(seq)):
        kv, n = int(seq[r]), int(cu[r + 1] - cu[r])
        pages = plan.block_tables[r, : (kv + PAGE - 1) // PAGE].long()
        tokens = step.cache[pages].transpose(1, 2).reshape(-1, HKV, 2 * HD)[:kv].float()
        mask = torch.ones(n, kv, dtype=torch.bool, device=q.device)
        mask[:, kv - n :] = bits[cu[r] : cu[r + 1], :n]
        out[cu[r] : cu[r + 1]] = sdpa(q[cu[r] : cu[r + 1]], tokens[..., :HD], tokens[..., HD:], mask, HD ** -0.5)
    return out


def flashinfer_module():
    """flashinfer, or None where it is not importable (the reason is reported by the caller)."""
    try:
        import flashinfer

        return flashinfer
    except Exception:  # noqa: BLE001 - any import failure means: not available here
        return None


def plan_constants(dtype: torch.dtype) -> dict:
    return dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD, page_size=PAGE, sm_scale=HD ** -0.5,
                q_data_type=dtype, kv_data_type=dtype, o_data_type=dtype)


def part_a_plan(ctx: "Check") -> dict:
    """The plan inputs of every case on the check's device, read back against independent references."""
    fi = flashinfer_module()
    cases, bad = {}, []
    for name, reqs in attention_cases(ctx.sizes.context_scale).items():
        step = paged_step(reqs, torch.float32, ctx.device, seed=len(name))
        plan = step_plan(step)
        want_mask = torch.cat([oracle_mask(r).reshape(-1) for r in reqs])
        mask_ok = torch.equal(plan.custom_mask.cpu(), want_mask)
        kv = step.seq_lens
        want_offsets = [0, *torch.cumsum(torch.tensor([r.q for r in reqs]) * kv, 0).tolist()]
        rec = {"requests": len(reqs), "tree_nodes": [r.q - 1 for r in reqs if r.tree is not None],
               "kv_lens": kv.tolist(), "mask_elements": int(plan.custom_mask.numel()), "mask_equals_tree_core": mask_ok}
        if fi is not None:
            from flashinfer.prefill import _compute_page_mask_indptr

            got = _compute_page_mask_indptr(plan.qo_indptr, plan.paged_kv_indptr, plan.paged_kv_last_page_len, PAGE)
            rec["flashinfer_mask_offsets_match"] = got.tolist() == want_offsets
            recorder = PlanRecorder(inspect.signature(fi.BatchPrefillWithPagedKVCacheWrapper.plan))
            plan_flashinfer_tree_step(recorder, plan, **plan_constants(torch.bfloat16))
            rec["plan_signature_binds"] = recorder.bound
        got = paged_read_like_flashinfer(step, plan)
        want = oracle_attention(step)
        rec["paged_read_max_abs_err"] = float((got - want).abs().max())
        tree_rows = torch.cat([torch.arange(int(step.qsl[i]), int(step.qsl[i + 1])) for i, r in enumerate(reqs)
                               if r.tree is not None and r.q > 2])
        causal = oracle_attention(step, tree_masks=False)
        rec["tree_mask_effect"] = float((want[tree_rows] - causal[tree_rows]).abs().max())  # the masks matter
        split = step_split(step)
        last_tree = max(i for i, r in enumerate(reqs) if r.tree is not None)
        rec["split_masked_requests"] = split.num_tree_reqs
        rec["split_mask_elements"] = 0 if split.tree is None else int(split.tree.custom_mask.numel())
        split_ok = (split.num_tree_reqs == last_tree + 1 and rec["split_mask_elements"]
                    == sum(r.q * (r.ctx + r.q) for r in reqs[: last_tree + 1]))
        rec["split_read_max_abs_err"] = float((split_read_like_flashinfer(step, split) - want).abs().max())
        rec["xqa_read_max_abs_err"] = float((xqa_read_like(step, step_xqa_plan(step)) - want).abs().max())
        ok = (mask_ok and split_ok and rec["paged_read_max_abs_err"] < 1e-4 and rec["tree_mask_effect"] > 1e-2
              and rec["split_read_max_abs_err"] < 1e-4 and rec["xqa_read_max_abs_err"] < 1e-4
              and rec.get("flashinfer_mask_offsets_match", True) and rec.get("plan_signature_binds", True))
        if not ok:
            bad.append(name)
        cases[name] = rec
    out = {"passed": not bad, "cases": cases, "failed_cases": bad,
           "flashinfer_checked": fi is not None,
           "summary": f"{len(cases)} cases, {'all match' if not bad else 'FAILED ' + ', '.join(bad)}"
                      f"{'' if fi is not None else ' (flashinfer not importable: offsets/signature unchecked)'}"}
    return out


class PlanRecorder:
    """Stands where FlashInfer's wrapper stands: plan() is bound to the real signature and kept."""

    def __init__(self, signature: inspect.Signature) -> None:
        self.signature = signature
        self.bound = False

    def plan(self, **kwargs) -> None:
        self.signature.bind(self, **kwargs)  # TypeError on a keyword FlashInfer does not take
        self.bound = True


def run_flashinfer(step: PagedStep, plan: FlashInferPagedPlan, dtype: torch.dtype, workspace: torch.Tensor,
                   tree: bool = True) -> torch.Tensor:
    """One FlashInfer paged prefill as vLLM runs it: custom-mask plan through our helper (``backend="auto"``,
    which a custom mask resolves to FA2), or for the control a causal FA2 plan of the same page table;
    run() on vLLM's layer view split into K and V."""
    wrapper = flashinfer_tree_wrapper(workspace, "NHD", backend="auto" if tree else "fa2")
    if tree:
        plan_flashinfer_tree_step(wrapper, plan, **plan_constants(dtype))
    else:
        kw = plan.plan_kwargs()
        kw.update(custom_mask=None, causal=True)
        c = plan_constants(dtype)
        wrapper.plan(**kw, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=HD, page_size=PAGE, sm_scale=c["sm_scale"],
                     q_data_type=dtype, kv_data_type=dtype, o_data_type=dtype)
    kv = step.cache.permute(0, 2, 1, 3).split(HD, dim=-1)  # as vLLM's FlashInferImpl.forward: physical order, K/V
    return wrapper.run(step.q, kv, k_scale=1.0, v_scale=1.0)


def run_split_flashinfer(step: PagedStep, split: FlashInferSplitPlan, dtype: torch.dtype,
                         workspace: torch.Tensor) -> torch.Tensor:
    """A step as vLLM's builder and FlashInferImpl.forward run it split: the masked plan on the first
    `num_tree_tokens` queries, the causal plan (planned as vLLM plans its own prefill, `backend="auto"`:
    FlashInfer's own kernel choice) on the rest."""
    kv = step.cache.permute(0, 2, 1, 3).split(HD, dim=-1)
    t = split.num_tree_tokens
    out = torch.empty_like(step.q)
    if split.tree is not None:
        tree_w = flashinfer_tree_wrapper(workspace, "NHD")
        plan_flashinfer_tree_step(tree_w, split.tree, **plan_constants(dtype))
        tree_w.run(step.q[:t], kv, k_scale=1.0, v_scale=1.0, out=out[:t])
    if split.causal is not None:
        causal_w = flashinfer_tree_wrapper(workspace, "NHD")
        plan_flashinfer_causal_step(causal_w, split.causal, **plan_constants(dtype))
        causal_w.run(step.q[t:], kv, k_scale=1.0, v_scale=1.0, out=out[t:])
    return out


def part_a_kernel(ctx: "Check") -> dict:
    """FlashInfer's kernels against the float32 oracle, bf16 and fp16; then custom-mask vs causal timing."""
    fi = flashinfer_module()
    if fi is None:
        return {"passed": False, "error": "flashinfer is not importable (make gpu-wheels, then --site)"}
    missing = [t for t in ("nvcc", "ninja") if shutil.which(t) is None]
    if missing:
        return {"passed": False, "error": f"FlashInfer's JIT needs {' and '.join(missing)} on PATH"}
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device=ctx.device)
    results, bad = {"jit": build_kernels(ctx)}, []
    # Every kernel the cases use must have been built by the start-up prebuild: FlashInfer logs each
    # JIT build ("Building JIT module ..."); any during the cases is a kernel a verify step would build.
    builds: list[str] = []
    jit_log = logging.Handler()
    jit_log.emit = lambda record: builds.append(record.getMessage()) if "Building JIT module" in record.getMessage() else None
    logging.getLogger().addHandler(jit_log)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("flashinfer"):
            logging.getLogger(name).addHandler(jit_log)
    for dtype in (torch.bfloat16, torch.float16):
        dn = str(dtype).replace("torch.", "")
        t0 = time.perf_counter()
        for name, reqs in attention_cases(ctx.sizes.context_scale).items():
            log(f"  a.kernel {dn} {name}")
            step = paged_step(reqs, dtype, ctx.device, seed=len(name))
            got = run_flashinfer(step, step_plan(step), dtype, workspace).float()
            err = float((got - oracle_attention(step)).abs().max())
            control_out = run_flashinfer(step, step_plan(step, tree=False), dtype, workspace, tree=False).float()
            control = float((control_out - oracle_attention(step, tree_masks=False)).abs().max())
            tol = 2 * control + 1e-4
            split_err = float((run_split_flashinfer(step, step_split(step), dtype, workspace).float()
                               - oracle_attention(step)).abs().max())
            ok = err <= tol and math.isfinite(err) and split_err <= tol and math.isfinite(split_err)
            results[f"{dn}/{name}"] = {"max_abs_err": err, "split_max_abs_err": split_err,
                                       "causal_control_err": control, "tolerance": tol, "ok": ok}
            if not ok:
                bad.append(f"{dn}/{name}")
        results[f"{dn}/cases_seconds"] = round(time.perf_counter() - t0, 1)
    for name in [None, *[n for n in logging.root.manager.loggerDict if n.startswith("flashinfer")]]:
        logging.getLogger(name).removeHandler(jit_log)
    results["jit_builds_after_prebuild"] = sorted(set(builds))
    if builds:
        bad.append("prebuild_tree_kernels missed a kernel the cases built")
    timing = time_flashinfer(ctx, workspace)
    mixed_timing = time_mixed_step(ctx, workspace)
    n = sum(isinstance(v, dict) and "ok" in v for v in results.values())
    return {"passed": not bad, "cases": results, "failed_cases": bad, "timing": timing, "mixed_timing": mixed_timing,
            "flashinfer": fi.__version__,
            "summary": f"{n - len(bad)}/{n} cases within the causal control" + (f"; FAILED {', '.join(bad)}" if bad else "")
                       + f"; JIT {results['jit'].get('seconds')} s"}


def run_xqa(step: PagedStep, plan: XQASpecPlan, workspace: torch.Tensor, q: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """FlashInfer's XQA speculative decode as vLLM 0.32.0's FlashInfer backend calls it on SM90 (ragged
    queries, a packed per-row mask), on vLLM's layer view split into K and V; `q`/`out` default to the
    step's queries and a new tensor."""
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    kv = step.cache.permute(0, 2, 1, 3).split(HD, dim=-1)  # as FlashInferImpl.forward: physical order, K/V
    return xqa_batch_decode_with_kv_cache(query=step.q if q is None else q, kv_cache=tuple(kv),
                                          workspace_buffer=workspace, bmm1_scale=HD ** -0.5, bmm2_scale=1.0,
                                          kv_layout="NHD", out=out, **plan.run_kwargs(PAGE))


def restep(step: PagedStep, seed: int) -> PagedStep:
    """The next step of the same shape on the same cache: every request's context halved, new trees of the
    same sizes (other tokens, other shapes), new queries. What a CUDA graph replays on."""
    reqs = [tree_request(r.q - 1, r.ctx // 2, seed + i) if r.tree is not None else Request(r.kind, r.q, r.ctx // 2)
            for i, r in enumerate(step.reqs)]
    assert [r.q for r in reqs] == [r.q for r in step.reqs]
    seq = torch.tensor([r.ctx + r.q for r in reqs])
    gd = torch.Generator(device=step.q.device).manual_seed(seed)
    q = torch.randn(step.q.shape, generator=gd, device=step.q.device).to(step.q.dtype)
    return PagedStep(reqs, q, [k[:kv] for k, kv in zip(step.keys, seq.tolist())],
                     [v[:kv] for v, kv in zip(step.values, seq.tolist())], step.cache, step.block_table, step.qsl,
                     seq, step_masks(reqs))


def part_a_xqa(ctx: "Check") -> dict:
    """Tree verify through FlashInfer's XQA speculative decode (SM90/SM12x): the step's trees as its packed
    per-row mask (`xqa_spec_plan`, one query width: XQA builds a kernel per width), on `xqa_cases`
    against the float32 oracle, bf16 and fp16, the tolerance the same
    kernel's error with the causal mask; the mask must change the tree rows' output. Then one step
    captured in a CUDA graph with its plan in persistent buffers and replayed on the next step (other
    trees, contexts and queries copied in), against the oracle. Timing against the custom-mask FA2 path
    (mask build + plan + run)."""
    fi = flashinfer_module()
    if fi is None:
        return {"passed": False, "error": "flashinfer is not importable (make gpu-wheels, then --site)"}
    major, minor = torch.cuda.get_device_capability(ctx.device)
    if major not in (9, 12):
        return {"passed": None, "not_run": f"XQA speculative decode runs on SM90/SM12x, this GPU is SM{major}{minor}"}
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=ctx.device)  # zeroed: XQA's semaphores
    results, bad, jit = {}, [], {}
    for dtype in (torch.bfloat16, torch.float16):
        dn = str(dtype).replace("torch.", "")
        if dtype == torch.float16 and ctx.deadline.left() < 120:
            results[f"{dn}/skipped"] = "wall-clock budget"
            continue
        for name, reqs in xqa_cases(ctx.sizes.context_scale).items():
            log(f"  a.xqa {dn} {name}")
            t0 = time.perf_counter()
            step = paged_step(reqs, dtype, ctx.device, seed=len(name))
            rec: dict = {"max_q": max(r.q for r in reqs), "tokens": int(step.qsl[-1])}
            try:
                got = run_xqa(step, step_xqa_plan(step), workspace).float()
                causal_out = run_xqa(step, step_xqa_plan(step, tree=False), workspace).float()
                sync(ctx.device)
            except Exception as exc:  # noqa: BLE001 - a shape XQA refuses is this case's result
                rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
                results[f"{dn}/{name}"] = rec
                bad.append(f"{dn}/{name}")
                continue
            jit.setdefault(dn, round(time.perf_counter() - t0, 1))  # the first case includes the JIT build
            want = oracle_attention(step)
            rec["max_abs_err"] = float((got - want).abs().max())
            rec["causal_control_err"] = float((causal_out - oracle_attention(step, tree_masks=False)).abs().max())
            rec["tolerance"] = 2 * rec["causal_control_err"] + 1e-4
            tree_rows = torch.cat([torch.arange(int(step.qsl[i]), int(step.qsl[i + 1]))
                                   for i, r in enumerate(reqs) if r.tree is not None and r.q > 2])
            rec["tree_mask_effect"] = float((got[tree_rows] - causal_out[tree_rows]).abs().max())
            rec["ok"] = (math.isfinite(rec["max_abs_err"]) and rec["max_abs_err"] <= rec["tolerance"]
                         and rec["tree_mask_effect"] > 1e-2)
            results[f"{dn}/{name}"] = rec
            if not rec["ok"]:
                bad.append(f"{dn}/{name}")
    graph = xqa_graph(ctx, workspace)
    if not graph.get("ok"):
        bad.append("graph")
    timing = time_xqa(ctx, workspace)
    n = sum(isinstance(v, dict) and "ok" in v for v in results.values())
    return {"passed": not bad, "cases": results, "failed_cases": bad, "jit_first_case_seconds": jit, "graph": graph,
            "timing": timing, "flashinfer": fi.__version__,
            "summary": f"{n - len([b for b in bad if b != 'graph'])}/{n} cases within the causal control; graph "
                       f"replay {'equal to the oracle' if graph.get('ok') else 'FAILED'}"
                       + (f"; FAILED {', '.join(bad)}" if bad else "")}


def xqa_graph(ctx: "Check", workspace: torch.Tensor) -> dict:
    """One tree step's XQA call captured with its plan and queries in persistent buffers; the next step's
    plan and queries copied in and replayed, against its oracle and its eager run; eager vs replay time."""
    if ctx.deadline.left() < 30:
        return {"skipped": "wall-clock budget", "ok": False}
    try:
        step = paged_step(xqa_cases(ctx.sizes.context_scale)["trees_across_pages"], torch.bfloat16, ctx.device,
                          seed=7)
        plan = step_xqa_plan(step)
        buffers = XQASpecPlan(plan.q_cu_seq_lens.clone(), plan.seq_lens.clone(), plan.block_tables.clone(),
                              plan.mask.clone(), plan.max_q)
        q = step.q.clone()
        out = torch.empty_like(q)
        run_xqa(step, buffers, workspace, q=q, out=out)  # warm-up outside the capture
        sync(ctx.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_xqa(step, buffers, workspace, q=q, out=out)
        nxt = restep(step, seed=70)
        new = step_xqa_plan(nxt)
        for dst, src in ((buffers.q_cu_seq_lens, new.q_cu_seq_lens), (buffers.seq_lens, new.seq_lens),
                         (buffers.block_tables, new.block_tables), (buffers.mask, new.mask), (q, nxt.q)):
            dst.copy_(src)
        graph.replay()
        sync(ctx.device)
        want = oracle_attention(nxt)
        eager = run_xqa(nxt, new, workspace).float()
        rec = {"replay_max_abs_err": float((out.float() - want).abs().max()),
               "eager_max_abs_err": float((eager - want).abs().max()),
               "replay_vs_eager_max_abs_diff": float((out.float() - eager).abs().max()),
               "stale_would_differ": float((out.float() - oracle_attention(step)[: out.shape[0]]).abs().max())}
        rec["ok"] = (math.isfinite(rec["replay_max_abs_err"])
                     and rec["replay_max_abs_err"] <= 2 * rec["eager_max_abs_err"] + 1e-4)
        rec["eager_ms"] = timed_ms(lambda: run_xqa(nxt, step_xqa_plan(nxt), workspace), ctx.device, ctx.sizes.reps)
        rec["replay_ms"] = timed_ms(graph.replay, ctx.device, ctx.sizes.reps)
        log(f"  a.xqa graph: replay err {rec['replay_max_abs_err']:.2e} (eager {rec['eager_max_abs_err']:.2e}); "
            f"eager plan + run {rec['eager_ms']:.3f} ms, replay {rec['replay_ms']:.3f} ms")
        return rec
    except Exception as exc:  # noqa: BLE001 - a failed capture is this sub-check's result
        return {"ok": False, **failure(exc)}


def time_xqa(ctx: "Check", workspace: torch.Tensor) -> list[dict]:
    """bf16, every request a tree of 1 + 64 rows: XQA (plan inputs `xqa_spec_plan`, run) against the
    custom-mask FA2 path vLLM's builder takes today (mask build `flashinfer_paged_plan`, plan(), run()),
    on the same step; the host syncs of the XQA plan."""
    rows = []
    fa2_workspace = torch.empty(128 << 20, dtype=torch.uint8, device=ctx.device)  # not XQA's: its semaphores stay 0
    for b in ctx.sizes.timing_batches:
        for c in ctx.sizes.timing_contexts:
            if ctx.deadline.left() < 30:
                rows.append({"batch": b, "context": c, "skipped": "wall-clock budget"})
                continue
            step = paged_step([tree_request(64, c, 100 + i) for i in range(b)], torch.bfloat16, ctx.device, seed=b,
                              with_oracle=False)
            dt = torch.bfloat16
            xplan = step_xqa_plan(step)
            plan = step_plan(step)
            tree_w = flashinfer_tree_wrapper(fa2_workspace, "NHD")
            kv = step.cache.permute(0, 2, 1, 3).split(HD, dim=-1)
            row = {"batch": b, "context": c, "rows": 65,
                   "xqa_plan_ms": timed_ms(lambda: step_xqa_plan(step), ctx.device, ctx.sizes.reps),
                   "xqa_run_ms": timed_ms(lambda: run_xqa(step, xplan, workspace), ctx.device,
                                          ctx.sizes.reps),
                   "fa2_mask_build_ms": timed_ms(lambda: step_plan(step), ctx.device, ctx.sizes.reps),
                   "fa2_plan_ms": timed_ms(lambda: plan_flashinfer_tree_step(tree_w, plan, **plan_constants(dt)),
                                           ctx.device, ctx.sizes.reps)}
            row["fa2_run_ms"] = timed_ms(lambda: tree_w.run(step.q, kv, k_scale=1.0, v_scale=1.0), ctx.device,
                                         ctx.sizes.reps)
            row["xqa_plan_syncs"] = sum(site["count"] for site in sync_sites(lambda: step_xqa_plan(step)))
            rows.append(row)
            log(f"  a.xqa timing batch {b} ctx {c}: XQA plan {row['xqa_plan_ms']:.3f} + run {row['xqa_run_ms']:.3f} ms"
                f" ({row['xqa_plan_syncs']} host syncs); FA2 mask {row['fa2_mask_build_ms']:.3f} + plan "
                f"{row['fa2_plan_ms']:.3f} + run {row['fa2_run_ms']:.3f} ms")
    return rows


def build_kernels(ctx: "Check") -> dict:
    """FlashInfer's JIT build of the bf16 and fp16 prefill modules, both at once (one thread each, a
    one-request plan + run): the build is nvcc in subprocesses, and two modules share the cores better
    than one after the other. Anything that fails here is built again, one at a time, by the cases."""
    import threading

    errors: dict[str, str] = {}

    def build(dtype: torch.dtype) -> None:
        try:  # the engine's own start-up build (P14), with this check's head shape
            ws = torch.empty(64 << 20, dtype=torch.uint8, device=ctx.device)
            prebuild_tree_kernels(flashinfer_tree_wrapper(ws, "NHD"), kv_layout="NHD", device=ctx.device,
                                  causal_wrapper=flashinfer_tree_wrapper(ws, "NHD"), **plan_constants(dtype))
            torch.cuda.synchronize(ctx.device)
        except Exception as exc:  # noqa: BLE001 - reported; the cases retry
            errors[str(dtype)] = f"{type(exc).__name__}: {str(exc)[:300]}"

    t0 = time.perf_counter()
    log(f"  a.kernel: FlashInfer JIT build by prebuild_tree_kernels, bf16 and fp16 at once "
        f"(MAX_JOBS={os.environ.get('MAX_JOBS')})")
    threads = [threading.Thread(target=build, args=(dt,)) for dt in (torch.bfloat16, torch.float16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = round(time.perf_counter() - t0, 1)
    log(f"  a.kernel: JIT done in {seconds} s{'; errors: ' + str(errors) if errors else ''}")
    return {"seconds": seconds, "errors": errors}


def time_flashinfer(ctx: "Check", workspace: torch.Tensor) -> list[dict]:
    """Custom-mask vs causal, bf16: mask build (`flashinfer_paged_plan`), plan() and run() at tree shapes
    (every request a tree of 1 + 64 rows); and the host syncs of the mask build and of each plan."""
    rows = []
    for b in ctx.sizes.timing_batches:
        for c in ctx.sizes.timing_contexts:
            if ctx.deadline.left() < 60:
                rows.append({"batch": b, "context": c, "skipped": "wall-clock budget"})
                continue
            reqs = [tree_request(64, c, 100 + i) for i in range(b)]
            step = paged_step(reqs, torch.bfloat16, ctx.device, seed=b, with_oracle=False)
            dt = torch.bfloat16
            plan = step_plan(step)
            tree_w = flashinfer_tree_wrapper(workspace, "NHD")
            causal_w = flashinfer_tree_wrapper(workspace, "NHD", backend="fa2")
            kw = plan.plan_kwargs()
            kw.update(custom_mask=None, causal=True)
            kv = step.cache.permute(0, 2, 1, 3).split(HD, dim=-1)
            build_ms = timed_ms(lambda: step_plan(step), ctx.device, ctx.sizes.reps)
            tree_plan_ms = timed_ms(lambda: plan_flashinfer_tree_step(tree_w, plan, **plan_constants(dt)),
                                    ctx.device, ctx.sizes.reps)
            tree_run_ms = timed_ms(lambda: tree_w.run(step.q, kv, k_scale=1.0, v_scale=1.0), ctx.device,
                                   ctx.sizes.reps)
            causal_plan_ms = timed_ms(lambda: causal_w.plan(**kw, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=HD,
                                                            page_size=PAGE, sm_scale=HD ** -0.5, q_data_type=dt,
                                                            kv_data_type=dt, o_data_type=dt),
                                      ctx.device, ctx.sizes.reps)
            causal_run_ms = timed_ms(lambda: causal_w.run(step.q, kv, k_scale=1.0, v_scale=1.0), ctx.device,
                                     ctx.sizes.reps)
            rows.append({"batch": b, "context": c, "rows": 65, "mask_build_ms": build_ms, "tree_plan_ms": tree_plan_ms,
                         "tree_run_ms": tree_run_ms, "causal_plan_ms": causal_plan_ms, "causal_run_ms": causal_run_ms})
            # The host's waits for the device in each (sync debug mode "warn": where, how often); the
            # builder allows the plan's (gpu_sync_allowed), each one stalls the host behind queued work.
            for key, fn in (("mask_build", lambda: step_plan(step)),
                            ("tree_plan", lambda: plan_flashinfer_tree_step(tree_w, plan, **plan_constants(dt))),
                            ("causal_plan", lambda: causal_w.plan(**kw, num_qo_heads=HQ, num_kv_heads=HKV,
                                                                  head_dim_qk=HD, page_size=PAGE, sm_scale=HD ** -0.5,
                                                                  q_data_type=dt, kv_data_type=dt, o_data_type=dt))):
                sites = sync_sites(fn)
                rows[-1][f"{key}_syncs"] = sum(site["count"] for site in sites)
                rows[-1][f"{key}_sync_sites"] = sites
            log(f"  a.kernel timing batch {b} ctx {c}: tree plan+run {tree_plan_ms + tree_run_ms:.3f} ms, "
                f"causal {causal_plan_ms + causal_run_ms:.3f} ms, mask build {build_ms:.3f} ms; host syncs: "
                f"mask {rows[-1]['mask_build_syncs']}, tree plan {rows[-1]['tree_plan_syncs']}, "
                f"causal plan {rows[-1]['causal_plan_syncs']}")
    return rows


def time_mixed_step(ctx: "Check", workspace: torch.Tensor) -> list[dict]:
    """A prefill chunk beside trees, bf16: the whole step in one masked plan against the split plan
    (masked trees, causal chunk), each timed end to end: plan inputs, plan() and run()."""
    rows = []
    chunk, chunk_ctx = 2048, 8192
    for b in ctx.sizes.timing_batches:
        c = max(ctx.sizes.timing_contexts)
        if ctx.deadline.left() < 60:
            rows.append({"batch": b, "context": c, "skipped": "wall-clock budget"})
            continue
        reqs = [tree_request(64, c, 200 + i) for i in range(b)] + [Request("prefill", chunk, chunk_ctx)]
        step = paged_step(reqs, torch.bfloat16, ctx.device, seed=b, with_oracle=False)
        dt = torch.bfloat16
        kv = step.cache.permute(0, 2, 1, 3).split(HD, dim=-1)
        whole_w, tree_w, causal_w = (flashinfer_tree_wrapper(workspace, "NHD") for _ in range(3))
        out = torch.empty_like(step.q)

        def whole() -> None:
            plan_flashinfer_tree_step(whole_w, step_plan(step), **plan_constants(dt))
            whole_w.run(step.q, kv, k_scale=1.0, v_scale=1.0, out=out)

        def split() -> None:
            sp = step_split(step)
            t = sp.num_tree_tokens
            plan_flashinfer_tree_step(tree_w, sp.tree, **plan_constants(dt))
            plan_flashinfer_causal_step(causal_w, sp.causal, **plan_constants(dt))
            tree_w.run(step.q[:t], kv, k_scale=1.0, v_scale=1.0, out=out[:t])
            causal_w.run(step.q[t:], kv, k_scale=1.0, v_scale=1.0, out=out[t:])

        whole_ms = timed_ms(whole, ctx.device, ctx.sizes.reps)
        split_ms = timed_ms(split, ctx.device, ctx.sizes.reps)
        mask_whole = int(step_plan(step).custom_mask.numel())
        mask_split = int(step_split(step).tree.custom_mask.numel())
        rows.append({"trees": b, "tree_rows": 65, "context": c, "chunk": chunk, "chunk_context": chunk_ctx,
                     "one_masked_plan_ms": whole_ms, "split_ms": split_ms, "mask_elements_one_plan": mask_whole,
                     "mask_elements_split": mask_split})
        log(f"  a.kernel mixed step, {b} trees + a {chunk}-token chunk after {chunk_ctx}: one masked plan "
            f"{whole_ms:.3f} ms, split {split_ms:.3f} ms (mask {mask_whole} -> {mask_split} elements)")
    return rows


# ---------------------------------------------------------------------------------------------------
# b. The tree pipeline
# ---------------------------------------------------------------------------------------------------


@dataclass
class StepInputs:
    """One tree step's inputs (static shapes, so a CUDA graph can be replayed on new values).

    logits [R, DEPTHS, V] drafter logits (bf16 on a GPU, float32 on a CPU); ctx_lens [R] int64 context
    before each root; roots [R] int64; slots [R] int64 n-gram slots; tail [R, 2] int64 last committed
    tokens; coin [R, M] bool and noise [R, M] int64 the stand-in target's choices per verify row
    (M = 1 + BUILD + LOOKUP); slot_mapping [R * M] int64 physical KV slot of each row.
    """

    logits: torch.Tensor
    ctx_lens: torch.Tensor
    roots: torch.Tensor
    slots: torch.Tensor
    tail: torch.Tensor
    coin: torch.Tensor
    noise: torch.Tensor
    slot_mapping: torch.Tensor

    def to(self, device: torch.device) -> "StepInputs":
        return StepInputs(*(t.to(device) for t in vars(self).values()))

    def copy_(self, other: "StepInputs") -> None:
        for k, t in vars(self).items():
            t.copy_(getattr(other, k))


@dataclass
class StepState:
    """What persists between steps: the n-gram tables, the lookup's token history and the automatic budget."""

    ngram: NGramModel
    history: TokenHistory
    auto: AutoBudget


TOP_TOKENS = 80  # tokens per depth with distinct logits (more than BUILD): no ties where top-k looks


def step_inputs(r: int, vocab: int, ngram_tail: torch.Tensor, seed: int, dtype: torch.dtype,
                device: torch.device) -> StepInputs:
    """Random inputs, drawn on `device`. At every depth 80 random tokens get distinct logits 20 - rank / 8
    (the first 0-3 higher: drafters of varied confidence) over a N(0, 1) rest; all of them exact in bf16,
    so top-k ranks them alike on any device."""
    g = torch.Generator(device=device).manual_seed(seed)
    m = 1 + BUILD + LOOKUP
    logits = torch.randn(r, DEPTHS, vocab, generator=g, device=device)
    top = torch.rand(r, DEPTHS, vocab, generator=g, device=device).topk(TOP_TOKENS, dim=-1).indices
    rank = torch.arange(TOP_TOKENS, device=device, dtype=torch.float32)
    lead = torch.randint(0, 4, (r, DEPTHS, 1), generator=g, device=device).float()
    logits.scatter_(2, top, 20 - rank / 8 + torch.where(rank == 0, lead, 0.0))
    rand = lambda *shape: torch.randint(vocab, shape, generator=g, device=device)  # noqa: E731
    return StepInputs(logits.to(dtype), torch.randint(100, 1000, (r,), generator=g, device=device), rand(r),
                      torch.arange(r, device=device), ngram_tail.to(device),
                      torch.rand(r, m, generator=g, device=device) < 0.8, rand(r, m),
                      torch.randperm(r * m + 64, generator=g, device=device)[: r * m] + 7)


def step_state(r: int, vocab: int, device: torch.device, seed: int,
               fixed_shape: bool = False) -> tuple[StepState, torch.Tensor]:
    """Fresh n-gram tables (`fixed_shape`: of one capacity, changed in place, as a captured step reads
    them) and token history (each request's own random text, with repeats) and a calibrated automatic
    budget (its exploration fed the published-figure H100 roofline's step times), on `device`; and the
    requests' context tails [R, 2] (host)."""
    g = torch.Generator().manual_seed(seed)
    ngram = NGramModel(vocab, 3, device=device, fixed_shape=fixed_shape)
    texts = []
    for _ in range(r):
        phrase = torch.randint(min(vocab, 64), (12,), generator=g)
        texts.append(torch.cat([phrase, torch.randint(vocab, (20,), generator=g), phrase, phrase[:5]]))
    ngram.observe_batch(list(range(r)), texts)
    # The engine's window (LOOKUP_WINDOW tokens, where max_model_len is longer) on a GPU; a short one
    # elsewhere, where the check's CPU runs stand in for its logic only.
    history = TokenHistory(LOOKUP_WINDOW if device.type == "cuda" else 256, 2, slots=r, device=device)
    history.observe_step(list(range(r)), torch.stack(texts).to(device))
    shape = ModelShape.from_hf_config(QWEN3_8B, "bfloat16")
    # The check's largest step stands for an engine's max_num_batched_tokens (the residual's buffer).
    cost = CostModel(shape, get_profile("h100"), max_step_rows=r * (1 + BUILD + LOOKUP))
    auto = AutoBudget(cost, 1, BUILD, lookup=LookupCalibration(LOOKUP)).to(device)
    ctx = 500.0 * r
    while auto.exploring:
        b = auto.calibration.explore_budget(r)
        tokens = r * (1 + b)
        auto.observe_step(tokens, tokens * (500 + 1 + b), ctx, float(auto.cost.step_seconds(r * b, ctx, r)))
    return StepState(ngram, history, auto), ngram.context_tail(list(range(r))).cpu()


def stand_in_target(batch: TreeBatch, coin: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[R, N] a target's token per verify row: where `coin`, the token of its first or (odd `noise`) last
    child, else `noise` (the check's stand-in for the target model: paths of varied length are accepted,
    through rows that are not in depth order, so the compaction moves K/V)."""
    r, n = batch.tokens.shape
    rows = torch.arange(n, device=batch.tokens.device).expand(r, n)
    parent = torch.where(batch.valid & (batch.parents >= 0), batch.parents, n)
    first = torch.full((r, n + 1), n, dtype=torch.int64, device=rows.device).scatter_reduce_(1, parent, rows, "amin")
    last = torch.full((r, n + 1), -1, dtype=torch.int64, device=rows.device).scatter_reduce_(1, parent, rows, "amax")
    child = torch.where(noise[:, :n] % 2 == 1, last[:, :n], first[:, :n])
    child_tok = batch.tokens.gather(1, child.clamp(0, n - 1))
    return torch.where(coin[:, :n] & (first[:, :n] < n), child_tok, noise[:, :n])


#: The step's stages as `b.profile` reports them, in step order (each a `torch.profiler.record_function` range).
STAGES = ("topk", "build", "lookup", "budget", "compile", "walk", "compaction")


def stage(name: str) -> torch.profiler.record_function:
    """A profiler range around one stage of the tree step (no device work, nothing when no profiler runs)."""
    return torch.profiler.record_function(f"ddtree.{name}")


def tree_step(x: StepInputs, st: StepState, variant: str,
              topk: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The step's device work, called as the vLLM proposer and runner call it: top-k, build (n-gram
    scored for "ngram"; with the lookup branch for "lookup"), automatic budget, truncate, compile,
    walk, compaction plan. Returns every result tensor by name. `topk` ([R, DEPTHS, BUILD] log-probs
    and ids) replaces the top-k's output: the host run of a GPU step starts from the GPU's."""
    r = x.logits.shape[0]
    with stage("topk"):
        top_logp, top_ids = topk if topk is not None else topk_per_depth(x.logits, BUILD)
    with stage("build"):
        scorer = st.ngram.scorer(x.slots) if variant == "ngram" else None
        built = build_tree(top_logp, top_ids, BUILD, max_budget=BUILD, scorer=scorer,
                           context_tail=x.tail if scorer is not None else None, lam=NGRAM_WEIGHT, validate=False)
    branch = valid = None
    if variant == "lookup":
        with stage("lookup"):
            branch, valid = st.history.continuation(x.slots, LOOKUP)
    with stage("budget"):
        plan = st.auto.choose_plan(built.scores, x.ctx_lens, valid)
        tree = built.truncate(plan.budgets.clamp(max=BUILD))
        extra = plan.extra if plan.extra is not None else torch.zeros_like(plan.budgets)
    if valid is not None:
        with stage("lookup"):
            valid = valid & (torch.arange(LOOKUP, device=valid.device)[None, :] < plan.extra[:, None])
            tree = add_branch(tree, branch, valid, max_nodes=BUILD + LOOKUP)
    with stage("compile"):
        batch = compile_tree(tree, x.roots, x.ctx_lens)
    n = batch.max_rows
    with stage("walk"):
        walk = walk_tree(batch, torch.where(batch.valid, stand_in_target(batch, x.coin, x.noise), -1))
    with stage("compaction"):
        row_index = torch.where(batch.valid, torch.arange(r, device=x.roots.device)[:, None] * n
                                + torch.arange(n, device=x.roots.device), 0)
        moves = accepted_path_moves(batch, walk, row_index, x.slot_mapping[: r * n])
    return {"top_logp": top_logp, "top_ids": top_ids, "built_tokens": built.tokens, "built_parents": built.parents, "budgets": plan.budgets,
            "extra": extra, "tokens": batch.tokens,
            "parents": batch.parents, "valid": batch.valid, "row_tokens": walk.output_tokens,
            "num_emitted": walk.num_emitted, "path_rows": walk.path_rows, "src_slots": moves.src_slots,
            "dst_slots": moves.dst_slots, "context_order": moves.context_order, "row_index": row_index}


VARIANTS = ("plain", "ngram", "lookup")
STEP_GRAPHS = "StepGraphs"  # b.graphs' rows of the proposer's own captured step (`step_graphs_run`)
STEP_GRAPHS_NGRAM = "StepGraphs+ngram"  # the same step rescored with n-gram tables of fixed shape


def host_walk(parents: list[int], tokens: list[int], valid: list[bool], target: list[int]) -> list[int]:
    """The accepted rows of one request, walked in plain Python: from the root, the child whose token
    is the target's token at the current row."""
    path, cur = [0], 0
    while True:
        kids = [i for i, p in enumerate(parents) if valid[i] and p == cur and tokens[i] == target[cur]]
        if not kids:
            return path
        cur = kids[0]
        path.append(cur)


def reference_mismatches(x: StepInputs, out: dict[str, torch.Tensor], variant: str, vocab: int) -> list[str]:
    """Host references for one step (all on the CPU): the heap builder (Algorithm 1), a Python walk,
    and the moves read off the walk by hand. Returns what differs."""
    bad = []
    state, _ = step_state(x.logits.shape[0], vocab, torch.device("cpu"), seed=7)
    top_logp, top_ids = out["top_logp"], out["top_ids"]
    scorer = state.ngram.scorer(x.slots) if variant == "ngram" else None
    ref = build_tree_reference(top_logp, top_ids, BUILD, max_budget=BUILD, scorer=scorer,
                               context_tail=x.tail if scorer is not None else None, lam=NGRAM_WEIGHT)
    if not (torch.equal(ref.tokens, out["built_tokens"]) and torch.equal(ref.parents, out["built_parents"])):
        bad.append("build_tree != build_tree_reference")
    r, n = out["tokens"].shape
    target = out["row_tokens"]
    for i in range(r):
        par, tok, val = out["parents"][i].tolist(), out["tokens"][i].tolist(), out["valid"][i].tolist()
        # the target token of each visited row: the walk emits them in path order
        path = [p for p in out["path_rows"][i].tolist() if p >= 0]
        emitted = [t for t in target[i].tolist() if t >= 0]
        row_target = {row: emitted[j] for j, row in enumerate(path)}
        walked = host_walk(par, tok, val, [row_target.get(row, -2) for row in range(n)])
        if walked != path:
            bad.append(f"walk of request {i}: {path} != host {walked}")
            break
        ctx_rows = out["row_index"][i]
        slots = x.slot_mapping
        for d in range(1, len(path)):
            src, dst = int(slots[ctx_rows[path[d]]]), int(slots[ctx_rows[d]])
            if (int(out["src_slots"][i * (out["src_slots"].numel() // r) + d - 1]) != src
                    or int(out["dst_slots"][i * (out["dst_slots"].numel() // r) + d - 1]) != dst):
                bad.append(f"moves of request {i} at depth {d}")
                break
    return bad


def outputs_differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the outputs that are not exactly equal (compared on the host)."""
    return [k for k in a if not torch.equal(a[k].cpu(), b[k].cpu())]


def part_b_pipeline(ctx: "Check") -> dict:
    """Every variant at every batch size: the device run against the host references (small batches)
    and a second run; on CUDA also against the same step on the CPU from the GPU's top-k (whose own
    result is compared with the CPU's top-k). Eager step time."""
    rows, bad = [], []
    vocab, dt = ctx.sizes.vocab, (torch.bfloat16 if ctx.device.type == "cuda" else torch.float32)
    cpu = torch.device("cpu")
    for r in ctx.sizes.batches:
        if ctx.deadline.left() < 45:
            rows += [{"batch": r, "variant": v, "skipped": "wall-clock budget"} for v in VARIANTS]
            continue
        tail = step_state(r, vocab, cpu, seed=7)[1]
        x = step_inputs(r, vocab, tail, seed=r, dtype=dt, device=ctx.device)
        x_host = x.to(cpu)
        host_topk = topk_per_depth(x_host.logits, BUILD) if ctx.device.type == "cuda" else None
        for variant in VARIANTS:
            state = step_state(r, vocab, ctx.device, seed=7)[0]
            out = tree_step(x, state, variant)
            host_out = {k: v.cpu() for k, v in out.items()}
            rec = {"batch": r, "variant": variant, "mean_budget": float(out["budgets"].float().mean()),
                   "mean_emitted": float(out["num_emitted"].float().mean())}
            problems = []
            if host_topk is not None:
                rec["topk_ids_equal"] = torch.equal(host_topk[1], host_out["top_ids"])
                rec["topk_logp_max_diff"] = float((host_topk[0] - host_out["top_logp"]).abs().max())
                if not rec["topk_ids_equal"] or rec["topk_logp_max_diff"] > 1e-4:
                    problems.append(f"top-k differs from the CPU's (max log-prob diff {rec['topk_logp_max_diff']:.2e})")
                host_state = step_state(r, vocab, cpu, seed=7)[0]
                ref = tree_step(x_host, host_state, variant, topk=(host_out["top_logp"], host_out["top_ids"]))
                problems += [f"{k} differs from the CPU run" for k in outputs_differ(out, ref)]
            if r <= ctx.sizes.reference_batch:
                problems += reference_mismatches(x_host, host_out, variant, vocab)
            again = tree_step(x, step_state(r, vocab, ctx.device, seed=7)[0], variant)
            problems += [f"{k} differs between two runs" for k in outputs_differ(out, again)]
            rec["eager_ms"] = timed_ms(lambda: tree_step(x, state, variant), ctx.device, ctx.sizes.reps)
            rec["problems"] = problems
            if problems:
                bad.append(f"{variant}@{r}")
            rows.append(rec)
            log(f"  b.pipeline batch {r} {variant}: {rec['eager_ms']:.2f} ms eager, budget {rec['mean_budget']:.1f}, "
                f"emitted {rec['mean_emitted']:.2f}{' PROBLEMS: ' + '; '.join(problems) if problems else ''}")
    return {"passed": not bad, "steps": rows, "failed": bad,
            "summary": f"{len(rows)} steps, " + ("all equal to the references" if not bad else "FAILED " + ", ".join(bad))}


def sync_sites(fn: Callable[[], object]) -> list[dict]:
    """Every host sync `fn` makes, from one pass in the sync debug mode "warn": where in our code, how often."""
    sites: dict[str, dict] = {}

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001 - warnings' signature
        where = where_in_repo(traceback.extract_stack()[:-1]) or f"{filename}:{lineno}"
        # origin: the line that synchronised (in a library, where `where` is our call into it)
        site = sites.setdefault(where, {"where": where, "origin": f"{filename}:{lineno}", "count": 0,
                                        "message": str(message)[:200]})
        site["count"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return list(sites.values())


def part_b_sync(ctx: "Check") -> dict:
    """Each variant at batch 8 (after one warm-up step) under the sync debug mode "error"."""
    rows, bad = [], []
    for variant in VARIANTS:
        r = min(8, max(ctx.sizes.batches))
        state, tail = step_state(r, ctx.sizes.vocab, ctx.device, seed=7)
        x = step_inputs(r, ctx.sizes.vocab, tail, seed=r, dtype=torch.bfloat16, device=ctx.device)
        tree_step(x, state, variant)  # warm-up: one-time host work (cached index tables) happens here
        torch.cuda.synchronize()
        rec = {"batch": r, "variant": variant}
        torch.cuda.set_sync_debug_mode("error")
        try:
            tree_step(x, state, variant)
            if variant != "plain":  # the engine's step also counts its tokens into the n-gram tables
                observe_tokens(x, state)
            torch.cuda.synchronize()
            rec["syncs"] = 0
        except Exception as exc:  # noqa: BLE001 - the failure is the result
            rec.update(failure(exc))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        if "error" in rec:
            rec["sync_sites"] = sync_sites(lambda: (tree_step(x, state, variant), observe_tokens(x, state)))
            bad.append(variant)
            log(f"  b.sync {variant}: FAILED at {rec['where']}; {len(rec['sync_sites'])} sync sites")
        else:
            log(f"  b.sync {variant}: no host sync")
        rows.append(rec)
    return {"passed": not bad, "variants": rows, "failed": bad,
            "summary": "no host sync" if not bad else f"syncs in {', '.join(bad)}: first at {rows[VARIANTS.index(bad[0])]['where']}"}


def observe_tokens(x: StepInputs, st: StepState) -> None:
    """What the engine does with a step's sampled tokens: [R, 16] tokens on the device (a prefix of
    each row, -1 after it) counted into the n-gram tables (a rescoring engine's; every order: 2n
    merges a count) and written into the lookup's token history, twice, a finished request's slot
    released between (the second count also cuts the tables' padding once their lengths are back)."""
    r = x.roots.shape[0]
    tokens = torch.where(torch.arange(16, device=x.roots.device) < (x.noise[:, :1] % 17), x.noise[:, :16], -1)
    for model in (st.ngram, st.history):
        model.observe_step(list(range(r)), tokens)
    st.ngram.release_batch([0])
    st.history.release([0])
    for model in (st.ngram, st.history):
        model.observe_step(list(range(r)), tokens)


def profile_counts(event, inside_op: bool = False) -> tuple[int, int, float]:
    """(dispatched ops, device kernels, kernel microseconds) under one profiler event: an op is an
    ``aten::`` event with no ``aten::`` ancestor (what our code dispatched, not an op's internals); a
    kernel is any device activity (kernel, memcpy, memset) the profiler linked to a CPU event."""
    is_op = event.name.startswith("aten::")
    ops = int(is_op and not inside_op)
    # Not kernels: the profiler's GPU copy of a stage range (linked to the range's CPU event), and the
    # device time the profiler may also record for an op under the op's own name, beside its kernels
    # (likely what an H100 run counted twice: about 1.8 ms at batch 256, the size of top-k's copies).
    mine = [k for k in event.kernels if not k.name.startswith(("ddtree.", "aten::"))]
    kernels, us = len(mine), float(sum(k.duration for k in mine))
    for child in event.cpu_children:
        o, k, t = profile_counts(child, inside_op or is_op)
        ops, kernels, us = ops + o, kernels + k, us + t
    return ops, kernels, us


def profile_step(fn: Callable[[], object], device: torch.device) -> dict:
    """One eager step under torch.profiler: ops, kernels and kernel time per stage (`STAGES`), what ran
    outside every stage, and on CUDA the step's kernels by total device time."""
    from torch.autograd import DeviceType

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        sync(device)
    events = prof.events()
    per_stage = {name: {"ops": 0, "kernels": 0, "kernel_us": 0.0} for name in STAGES}
    outside = {"ops": 0, "kernels": 0, "kernel_us": 0.0}
    for ev in events:
        if ev.cpu_parent is not None or ev.device_type != DeviceType.CPU:
            continue
        target = per_stage.get(ev.name.removeprefix("ddtree.")) if ev.name.startswith("ddtree.") else outside
        if target is None:
            continue
        o, k, t = profile_counts(ev)
        target["ops"] += o
        target["kernels"] += k
        target["kernel_us"] += t
    # Device activity, without the profiler's own GPU-timeline copies of our stage ranges.
    device_events = [ev for ev in events if ev.device_type != DeviceType.CPU and not ev.name.startswith("ddtree.")]
    by_name: dict[str, list[float]] = {}
    for ev in device_events:
        by_name.setdefault(ev.name[:90], []).append(ev.time_range.elapsed_us())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:10]
    out = {"stages": {k: {**v, "kernel_us": round(v["kernel_us"], 1)} for k, v in per_stage.items()},
           "outside_stages": {**outside, "kernel_us": round(outside["kernel_us"], 1)},
           "ops": sum(v["ops"] for v in per_stage.values()) + outside["ops"],
           "kernels": len(device_events),
           "kernel_ms": round(sum(ev.time_range.elapsed_us() for ev in device_events) / 1000, 3),
           "top_kernels": [{"name": name, "count": len(ts), "us": round(sum(ts), 1)} for name, ts in top]}
    if device_events:
        out["kernels_attributed"] = sum(v["kernels"] for v in per_stage.values()) + outside["kernels"]
    return out


def part_b_profile(ctx: "Check") -> dict:
    """Each variant at the smallest and largest batch: one eager step under the profiler (after two
    warm-up steps). Passes when every dispatched op falls inside a stage, so the stage table is the whole
    step. On CUDA the kernel time per stage is the floor a CUDA-graph replay of that stage cannot beat."""
    rows, bad = [], []
    for r in sorted({min(ctx.sizes.batches), max(ctx.sizes.batches)}):
        for variant in VARIANTS:
            if ctx.deadline.left() < 30:
                rows.append({"batch": r, "variant": variant, "skipped": "wall-clock budget"})
                continue
            dt = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
            state, tail = step_state(r, ctx.sizes.vocab, ctx.device, seed=7)
            x = step_inputs(r, ctx.sizes.vocab, tail, seed=r, dtype=dt, device=ctx.device)
            for _ in range(2):
                tree_step(x, state, variant)
            sync(ctx.device)
            rec = {"batch": r, "variant": variant, **profile_step(lambda: tree_step(x, state, variant), ctx.device)}
            if variant != "plain":  # the tables' count of the step's tokens, before the next step's tree work
                seen = profile_step(lambda: observe_tokens(x, state), ctx.device)
                rec["observe"] = {k: seen[k] for k in ("ops", "kernels", "kernel_ms")}
            rows.append(rec)
            if rec["outside_stages"]["ops"]:
                bad.append(f"{variant}@{r}")
            per = ", ".join(f"{k} {v['ops']}" + (f"/{v['kernel_us'] / 1000:.2f} ms" if rec["kernels"] else "")
                            for k, v in rec["stages"].items() if v["ops"])
            seen = (f"; counting the step's tokens (twice, a release between): {rec['observe']['ops']} ops, "
                    f"{rec['observe']['kernel_ms']:.2f} ms of kernels") if "observe" in rec else ""
            log(f"  b.profile batch {r} {variant}: {rec['ops']} ops, {rec['kernels']} kernels, "
                f"{rec['kernel_ms']:.2f} ms of kernels; {per}{seen}")
    return {"passed": not bad, "profiles": rows, "failed": bad,
            "summary": (f"{len(rows)} steps profiled, every op inside a stage" if not bad
                        else f"ops outside every stage in {', '.join(bad)}")}


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Device memory `fn` allocates at its peak beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    sync(device)
    gc.collect()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def boundary_mismatches(ids: torch.Tensor, ref_ids: torch.Tensor, kth: torch.Tensor, next_value: torch.Tensor) -> int:
    """Rows whose chosen id sets differ, leaving out rows with a tie at the k-th place (either set is right)."""
    differ = (ids.sort(-1).values != ref_ids.sort(-1).values).any(-1)
    return int((differ & (kth != next_value)).sum())


def segmented_topk(scores: torch.Tensor, k: int, segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk within `segments` slices of each row [n, V], then over their k-bests (a row's top k
    lie among its slices' top k's): many short rows instead of a few long ones, for `b.topk`."""
    n, vocab = scores.shape
    width = vocab // segments  # [n, segments * width] viewed as [n, segments, width]: no copy
    if width < k:
        return torch.topk(scores, k, dim=-1)
    cut = segments * width
    part_v, part_i = torch.topk(scores[:, :cut].view(n, segments, width), k, dim=-1, sorted=False)
    part_i = part_i + torch.arange(0, cut, width, device=scores.device).view(1, segments, 1)
    values, ids = part_v.view(n, -1), part_i.view(n, -1)
    if cut < vocab:  # the last vocab % segments columns, whole
        tail_v, tail_i = torch.topk(scores[:, cut:], min(k, vocab - cut), dim=-1, sorted=False)
        values, ids = torch.cat([values, tail_v], -1), torch.cat([ids, tail_i + cut], -1)
    top_v, pick = torch.topk(values, k, dim=-1)
    return top_v, ids.gather(-1, pick)


def flashinfer_topk():
    """FlashInfer's radix top-k (vLLM's own for a vocabulary-wide top-k on CUDA), or None."""
    fi = flashinfer_module()
    fn = getattr(fi, "top_k", None)
    return None if fn is None else (lambda x, k: fn(x, k, sorted=True, deterministic=True))


def part_b_topk(ctx: "Check") -> dict:
    """The drafter's candidates at Qwen3-8B's head (H 4096, V 151936, random bf16 weights), 15 depths per
    request, top-64: (1) ways to take the top-k of the same float32 log-probs, against torch.topk (what
    `topk_per_depth` runs): the same values, and the same ids but for ties at the 64th place; slices
    of each row first (`segmented_topk`), and with --topk-flashinfer FlashInfer's radix top-k; (2) the
    whole head's logits then `topk_per_depth`, against `head_topk` (what the proposer runs: the head and
    the top-k on chunks of rows): time, and the device memory each holds at its peak. On a CPU a small
    vocabulary, without FlashInfer."""
    dev, vocab = ctx.device, ctx.sizes.vocab
    hidden_size = 4096 if dev.type == "cuda" else 64
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    weight = torch.randn(vocab, hidden_size, device=dev, dtype=dt, generator=g) * (3.0 / hidden_size ** 0.5)
    head = lambda h: h @ weight.T  # noqa: E731
    # FlashInfer's top-k is a JIT build of its own: over 6 minutes on a 16-core H200 host (not done
    # when the run was stopped), so it runs only on request.
    fi_topk = flashinfer_topk() if ctx.topk_flashinfer and dev.type == "cuda" else None
    select = {"torch": lambda x: torch.topk(x, BUILD, dim=-1)} | {
        f"segmented/{n}": (lambda x, n=n: segmented_topk(x, BUILD, n)) for n in TOPK_SEGMENT_CHOICES} | (
        {"flashinfer": lambda x: fi_topk(x, BUILD)} if fi_topk is not None else {})
    rows, bad, jit_s = [], [], None
    for r in ctx.sizes.batches:
        if ctx.deadline.left() < 30:
            rows.append({"batch": r, "skipped": "wall-clock budget"})
            continue
        n = r * DEPTHS
        hidden = torch.randn(n, hidden_size, device=dev, dtype=dt, generator=g)
        logp = torch.log_softmax(head(hidden), -1, dtype=torch.float32)
        ref_v, ref_i = torch.topk(logp, BUILD + 1, dim=-1)  # the 65th value: ties at the 64th place
        kth, nxt = ref_v[:, BUILD - 1], ref_v[:, BUILD]
        rec = {"batch": r, "rows": n, "vocab": vocab, "k": BUILD, "select_ms": {}, "select_mismatches": {}}
        for b, fn in select.items():
            if b == "flashinfer" and jit_s is None:
                t0 = time.perf_counter()
                fn(logp)
                sync(dev)
                jit_s = round(time.perf_counter() - t0, 1)
            v, i = fn(logp)
            rec["select_ms"][b] = timed_ms(lambda: fn(logp), dev, ctx.sizes.reps)
            bad_rows = boundary_mismatches(i, ref_i[:, :BUILD], kth, nxt)
            values_equal = torch.equal(v, ref_v[:, :BUILD])
            rec["select_mismatches"][b] = bad_rows + (0 if values_equal else n)
            if bad_rows or not values_equal:
                bad.append(f"{b}@{r}")
        logp = ref_v = ref_i = None  # free them before the memory measurements
        whole = lambda: topk_per_depth(head(hidden).view(r, DEPTHS, vocab), BUILD)  # noqa: E731
        chunked = lambda: head_topk(hidden, head, vocab, BUILD)  # noqa: E731
        rec["whole_ms"], rec["whole_peak_bytes"] = timed_ms(whole, dev, ctx.sizes.reps), peak_bytes(whole, dev)
        rec["chunked_ms"], rec["chunked_peak_bytes"] = timed_ms(chunked, dev, ctx.sizes.reps), peak_bytes(chunked, dev)
        v, i = chunked()
        w_v, w_i = whole()
        # chunks of rows may round the head's GEMM differently: compare ids off near-ties, values loosely
        near = (kth - nxt).abs() > 1e-2
        differ = (i.sort(-1).values != w_i.view(n, -1).sort(-1).values).any(-1) & near
        rec["chunked_mismatches"] = int(differ.sum())
        rec["chunked_max_abs_diff"] = float((v - w_v.view(n, -1)).abs().max())
        if differ.any() or rec["chunked_max_abs_diff"] > 5e-2:
            bad.append(f"chunked@{r}")
        rows.append(rec)
        mem = "" if rec["whole_peak_bytes"] is None else (
            f"; peak {rec['whole_peak_bytes'] / 2**20:.0f} MiB whole, {rec['chunked_peak_bytes'] / 2**20:.0f} MiB chunked")
        log(f"  b.topk batch {r} ({n} rows): top-k " + ", ".join(f"{b} {t:.3f} ms" for b, t in rec["select_ms"].items())
            + f"; head and top-k: whole {rec['whole_ms']:.3f} ms, chunked {rec['chunked_ms']:.3f} ms" + mem)
    return {"passed": not bad, "batches": rows, "failed": bad, "selections": list(select),
            "flashinfer_first_call_s": jit_s,
            "summary": (f"{len(select)} top-k selections agree; the chunked head equals the whole" if not bad
                        else f"differ: {', '.join(bad)}")}


def state_tensors(st: StepState) -> list[torch.Tensor]:
    """The step's mutable device state (the automatic budget's rate, the token history), to restore
    between two runs."""
    return [*st.auto.planned_tokens.values(), *st.auto.planned_seconds.values(), st.history.tokens,
            st.history.lengths, st.auto.lookup.hits, st.auto.lookup.at_risk]


def advance_state(st: StepState, r: int, seed: int) -> None:
    """What serving does to the state between two steps: a measured acceptance, the lookup paths'
    outcome, step times enough for the cost model to refit, and committed tokens in the token history.
    A captured step reads all of it where it lies, so a replay after this must still equal the eager
    step."""
    g = torch.Generator().manual_seed(seed)
    dev = st.auto.acceptance.betas.device
    # each request's text goes on with a few tokens it held before (its lookup path moves)
    st.history.observe_step(list(range(r)), torch.randint(0, 64, (r, 3), generator=g).to(dev))
    scores = (-torch.rand(r, BUILD, generator=g).cumsum(1)).to(dev)
    accepted = (torch.rand(r, BUILD, generator=g) < 0.3).to(dev)
    st.auto.observe_acceptance(scores, torch.ones_like(accepted), accepted)
    proposed = torch.randint(0, 64, (r, LOOKUP), generator=g).to(dev)
    committed = torch.where((torch.rand(r, 2, generator=g) < 0.5).to(dev), proposed[:, :2], -1)
    st.auto.observe_lookup(proposed, torch.ones_like(proposed, dtype=torch.bool), committed)
    ctx = 500.0 * r
    for _ in range(st.auto.calibration.refit_every):
        b = int(torch.randint(1, BUILD + 1, (), generator=g))
        tokens = r * (1 + b)
        seconds = float(st.auto.cost.step_seconds(r * b, ctx, r)) * (1.5 + float(torch.rand((), generator=g)))
        st.auto.observe_step(tokens, tokens * (501 + b), ctx, seconds)


def step_graphs_run(r: int, vocab: int, device: torch.device, backend: str, reps: int, ngram: bool = False) -> dict:
    """The proposer's own captured step: `draft_trees` with `StepGraphs(backend)` around the step's
    tokens appended to the token history, the lookup calibration's update and `plan_trees_with_lookup`
    (lookup path, build, automatic budget) as `DDTreeProposer` calls it, its batch padded to the top
    of its size class (`padded_rows`: 1 / 15 / 127 / 511 rows at batch 1 / 8 / 64 / 256), its depths
    to all DEPTHS and its new tokens to TOKEN_WIDTH columns. The class's first plan runs eagerly, then
    the key's first call, then its capture, on one request more than the replay (where the class
    holds one), all DEPTHS and LOOKUP new tokens: the replay, on new inputs of `r` requests, two
    depths fewer and two new tokens, reads an earlier step's values past them in its buffers (the
    history it appends to is compared too). The state moves on between them (`advance_state`) and the replay
    must equal the eager step on the same padded shape; the unpadded eager step (the proposer's
    without graphs) is compared too. With `ngram`, the step rescores with n-gram tables of fixed
    shape (what the proposer captures), which count a step's committed tokens in place, outside the
    step, before the capture and again before the replay: the replay reads the moved tables. Returns
    the comparisons, the captures' counters and on request (`reps` > 0) eager and replay times. On a
    CPU the "trace" backend runs the same logic."""
    capture_requests = min(r + 1, padded_rows(r))  # the capture's requests: the same size class as r
    state, tail = step_state(capture_requests, vocab, device, seed=7, fixed_shape=ngram)
    graphs = StepGraphs(backend)

    def key() -> tuple:
        # the proposer's key holds the budget's capture state and the tables' generation: a replaced
        # buffer would be a new key (run eagerly, no replay), which this check counts as a failure
        return ("plan_trees_with_lookup", BUILD, (state.ngram.generation if ngram else ()),
                state.auto.capture_state(r, device))

    def count_tokens(seed: int, rows: int) -> None:
        # a step's committed tokens (1-4 per row, some from the row's own text) into the tables, as the
        # proposer's `_observe` counts them before its step
        g = torch.Generator().manual_seed(seed)
        tokens = torch.where(torch.arange(4) < torch.randint(1, 5, (rows, 1), generator=g),
                             torch.randint(0, 64, (rows, 4), generator=g), -1)
        state.ngram.observe_step(list(range(rows)), tokens.to(device))

    def inputs(seed: int, rows: int, depths: int) -> tuple:
        x = step_inputs(rows, vocab, tail[:rows], seed=seed,
                        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
        return (*topk_per_depth(x.logits[:, :depths], BUILD), x.ctx_lens, x.slots)

    def observed(seed: int, rows: int, columns: int) -> tuple:
        # last step's lookup paths (a random valid prefix each) and the tokens this step committed
        g = torch.Generator().manual_seed(seed)
        proposed = torch.randint(0, 64, (rows, LOOKUP), generator=g)
        valid = torch.arange(LOOKUP) < torch.randint(0, LOOKUP + 1, (rows, 1), generator=g)
        committed = torch.where(torch.rand(rows, columns, generator=g) < 0.6, proposed[:, :columns], -1)
        return proposed.to(device), valid.to(device), committed.to(device)

    def step(top_logp, top_ids, context_lens, slots, rows, observed=None, new_tokens=None):
        if new_tokens is not None:  # the step's tokens into the history, the lookup calibration fed, as the proposer's
            state.history.append(slots, new_tokens)
            state.auto.observe_lookup(*observed, new_tokens)
        scorer = tail = None
        if ngram:  # as the proposer's step: the scores of this step's slots (a padded row's, -1: inert)
            scorer, tail = state.ngram.scorer(slots), state.ngram.context_tail(slots)
        return plan_trees_with_lookup(top_logp, top_ids, BUILD, context_lens, state.auto, state.history, slots, LOOKUP,
                                      BUILD + LOOKUP, padded=rows is not None, scorer=scorer, context_tail=tail,
                                      lam=NGRAM_WEIGHT if ngram else 0.0, rows=rows)

    def named(out) -> dict[str, torch.Tensor]:
        tree, plan, branch, valid = out
        return ({f"tree.{k}": getattr(tree, k).clone() for k in ("tokens", "parents", "depths", "valid", "scores")}
                | {f"plan.{k}": getattr(plan, k).clone() for k in ("budgets", "extra", "expected_tokens", "step_seconds")}
                | {"lookup.tokens": branch.clone(), "lookup.valid": valid.clone(),
                   "lookup.calibration": torch.stack([state.auto.lookup.hits, state.auto.lookup.at_risk]).clone(),
                   "history.tokens": state.history.tokens.clone(), "history.lengths": state.history.lengths.clone()})

    def drafted(x: tuple, seen: tuple | None = None, graphs: StepGraphs | None = None):
        # (seen: last step's lookup paths, their valid masks, and this step's tokens)
        return draft_trees(step, *x, DEPTHS, graphs, key() if graphs is not None else (),
                           None if seen is None else seen[:2], None if seen is None else seen[2], TOKEN_WIDTH)

    first, first_observed = inputs(r, capture_requests, DEPTHS), observed(1, capture_requests, LOOKUP)
    draft_trees(step, *first, DEPTHS)  # the batch size's first plan seeds its rate: the proposer runs it eagerly
    assert state.auto.capture_state(r, device) is not None
    for _ in range(graphs.capture_after - 1):  # eager
        drafted(first, first_observed, graphs)
    if ngram:
        count_tokens(5, capture_requests)
    # The capture: its time, and the memory its graph keeps
    _, pool_bytes, capture_ms = held_by(lambda: drafted(first, first_observed, graphs), device)
    advance_state(state, capture_requests, seed=3000 + r)
    if ngram:  # the tables move on in place (a new generation would be a new key: no replay, a failure)
        count_tokens(6, r)
    x, x_observed = inputs(4000 + r, r, DEPTHS - 2), observed(2, r, 2)  # fewer committed columns, too
    saved = [t.clone() for t in state_tensors(state)]
    replayed = named(drafted(x, x_observed, graphs))
    for t, v in zip(state_tensors(state), saved):
        t.copy_(v)
    # the same padded shape, run eagerly (a StepGraphs that never captures pads its inputs with zeros)
    eager = named(drafted(x, x_observed, StepGraphs(backend, capture_after=1 << 30)))
    # The padding's rows change no real request's tree or plan (on the CPU bit for bit; here the sums
    # over longer arrays run on this device's kernels).
    for t, v in zip(state_tensors(state), saved):
        t.copy_(v)
    unpadded = named(drafted(x, x_observed))
    rec = {"differs": outputs_differ(replayed, eager),
           "padding_differs": outputs_differ(unpadded, eager),
           "graphs": {"captures": graphs.captures, "replays": graphs.replays, "failed": graphs.failed},
           "capture_requests": capture_requests}
    rec["replay_equals_eager"] = not rec["differs"] and graphs.failed is None and graphs.replays >= 1
    rec["padding_kept_plans"] = not rec["padding_differs"]
    rec["capture_ms"], rec["pool_bytes"] = round(capture_ms, 2), pool_bytes
    if reps:  # what the proposer runs either way: eager on the batch as it is, or padded and replayed
        rec["eager_ms"] = timed_ms(lambda: drafted(x, x_observed), device, reps)
        rec["replay_ms"] = timed_ms(lambda: drafted(x, x_observed, graphs), device, reps)
    return rec


VERIFY_GRAPHS = "verify_trees"  # b.graphs' rows of the verify side's captured step (`verify_graphs_run`)


def verify_step_inputs(r: int, budget: int, device: torch.device, seed: int) -> tuple[TreeBatch, torch.Tensor, torch.Tensor]:
    """A verify step of `r` trees of up to `budget` nodes: its TreeBatch, the target's token per row (a
    child's token 70 % of the time where the row has children: paths are accepted) and each row's
    node score ([R, N], -inf for the root and for a fifth of the nodes: not the drafter's ranking)."""
    g = torch.Generator().manual_seed(seed)
    top_logp, top_ids = topk_per_depth(torch.randn(r, 6, 32, generator=g) * 2, 8)
    tree = build_tree(top_logp, top_ids, torch.randint(budget // 2, budget + 1, (r,), generator=g), max_budget=budget)
    batch = compile_tree(tree, torch.randint(0, 32, (r,), generator=g), torch.randint(0, 900, (r,), generator=g))
    n = batch.tokens.shape[1]
    child = torch.full((r, n), -1).scatter_(1, batch.parents.clamp(min=0), torch.where(batch.valid, batch.tokens, -1))
    row_tokens = torch.where((child >= 0) & (torch.rand(r, n, generator=g) < 0.7), child,
                             torch.randint(0, 32, (r, n), generator=g))
    scores = F.pad(torch.where(torch.rand(r, n - 1, generator=g) < 0.2, -math.inf, tree.scores), (1, 0),
                   value=-math.inf)
    batch = TreeBatch(*(getattr(batch, f).to(device) for f in ("tokens", "parents", "depths", "positions", "valid",
                                                              "num_rows", "context_lens", "ancestors")), batch.max_depth)
    return batch, row_tokens.to(device), scores.to(device)


def verify_graphs_run(r: int, device: torch.device, backend: str, reps: int) -> dict:
    """The verify side's captured step: `verify_trees` (walk, statistics, the drafter's acceptance
    calibration, the KV moves from each row's slot) with `StepGraphs(backend)`, as `sample_tree_step`
    calls it. Five steps whose batches (the size class of `r`) and verify widths (33-64 rows) pad to
    one capture: eager, capture, then replays, some smaller than a step before, so the capture's
    buffers hold an earlier step's values past the batch. Each is compared with the eager
    `verify_trees` on a calibration of its own: walk, sums, committed count and KV moves equal; the
    calibrations' largest difference reported (sums over padded arrays may round differently). On
    request (`reps` > 0) eager and replay times."""
    top = padded_rows(r)
    steps = ((top, 63), (r, 39), (top, 63), (r, 33), ((r + top) // 2, 49))
    graphs = StepGraphs(backend)
    captured, eager = AcceptanceCalibration().to(device), AcceptanceCalibration().to(device)
    differs, calibration_gap, pool_bytes = [], 0.0, None
    for i, (rows, budget) in enumerate(steps):
        batch, row_tokens, scores = verify_step_inputs(rows, budget, device, seed=5000 + 7 * r + i)
        n = batch.tokens.shape[1]  # each row's KV slot: distinct, as a step's are
        row_slots = (torch.randperm(rows * n, generator=torch.Generator().manual_seed(i)).view(rows, n) + 64).to(device)
        got, held, _ = held_by(lambda: verify_trees(batch, row_tokens, scores, captured, graphs,
                                                    row_slots=row_slots), device)
        pool_bytes = held if i == graphs.capture_after - 1 else pool_bytes  # the capture's call
        want = verify_trees(batch, row_tokens, scores, eager, row_slots=row_slots)
        for name in ("output_tokens", "num_emitted", "path_rows", "accepted_rows"):
            if not torch.equal(getattr(got.walk, name), getattr(want.walk, name)):
                differs.append(f"step {i}: walk.{name}")
        for name in ("src_slots", "dst_slots", "path_first"):
            if not torch.equal(getattr(got.moves, name), getattr(want.moves, name)):
                differs.append(f"step {i}: moves.{name}")
        for name in ("sums", "committed"):
            if not torch.equal(getattr(got, name), getattr(want, name)):
                differs.append(f"step {i}: {name}")
        for a, b in ((captured._ema, eager._ema), (captured._bin_sums, eager._bin_sums)):
            calibration_gap = max(calibration_gap, float(((a - b).abs() / b.abs().clamp(min=1e-6)).max()))
    width = padded_width(steps[0][1] + 1)
    rec = {"differs": differs, "calibration_max_rel_gap": calibration_gap, "padded": [top, width], "pool_bytes": pool_bytes,
           "graphs": {"captures": graphs.captures, "replays": graphs.replays, "eager_calls": graphs.eager_calls,
                      "failed": graphs.failed}}
    rec["replay_equals_eager"] = not differs and graphs.failed is None and graphs.replays == len(steps) - 2
    if reps:
        rec["eager_ms"] = timed_ms(lambda: verify_trees(batch, row_tokens, scores, eager, row_slots=row_slots), device, reps)
        rec["replay_ms"] = timed_ms(lambda: verify_trees(batch, row_tokens, scores, captured, graphs,
                                                         row_slots=row_slots), device, reps)
    return rec


SCHEDULE_GRAPHS = "schedule_rows"  # b.graphs' rows of the verify rows cut before the forward (`schedule_graphs_run`)


def schedule_step_inputs(r: int, budget: int, device: torch.device, seed: int, max_budget: int = 40,
                         buffer: int = 4096) -> tuple:
    """A verify step as `prepare_tree_step` hands it to `schedule_rows`: `r` proposed trees of up to
    `budget` nodes (padded to `max_budget`), packed on the device as `tree_to_host` leaves them, and a step whose requests
    (shuffled against the proposer's rows) keep a random prefix of their tree, or (one in five) a
    chain of drafts the proposer did not make. Returns (block, nodes, table [6, R] host, the step's
    token ids in a buffer of `buffer` tokens, n, deepest)."""
    g = torch.Generator().manual_seed(seed)
    top_logp, top_ids = topk_per_depth(torch.randn(r, 6, 32, generator=g) * 2, 8)
    tree = build_tree(top_logp, top_ids, torch.randint(budget // 2, budget + 1, (r,), generator=g),
                      max_budget=max_budget)
    block = torch.cat([tree.tokens.double(), tree.parents, tree.depths, tree.scores], dim=1)
    order = torch.randperm(r, generator=g)
    chain = torch.rand(r, generator=g) < 0.2
    kept = torch.where(chain, torch.randint(0, budget + 2, (r,), generator=g),
                       (torch.rand(r, generator=g) * (tree.num_nodes[order] + 1)).long().clamp(max=tree.num_nodes[order]))
    ids, table, deepest = [], [], 0
    for i in range(r):  # (the check's inputs, made once per step on the host; not the product's path)
        d, p = int(kept[i]), int(order[i])
        drafts = torch.randint(0, 32, (d,), generator=g).tolist() if chain[i] else tree.tokens[p, :d].tolist()
        deepest = max(deepest, d if chain[i] else int(tree.depths[p, :d].max()) if d else 0)
        table.append([p, d, 0 if not chain[i] and d > 0 else CHAIN, len(ids), int(torch.randint(0, 900, (1,), generator=g)),
                      len(ids)])
        ids += [int(torch.randint(0, 32, (1,), generator=g)), *drafts]
    if len(ids) > buffer:
        raise ValueError(f"a step of {len(ids)} tokens does not fit a buffer of {buffer}")
    step_ids = torch.tensor(ids + [0] * (buffer - len(ids)), dtype=torch.int32)
    n = 1 + int(kept.max())
    return block.to(device), tree.max_nodes, torch.tensor(table).T.contiguous(), step_ids.to(device), n, deepest


def schedule_graphs_run(r: int, device: torch.device, backend: str, reps: int) -> dict:
    """The verify rows cut before the forward: `schedule_rows` with `StepGraphs(backend)`, as
    `prepare_tree_step` calls it. Five steps whose batches (the size class of `r`) and widths pad to
    one capture, the later ones smaller than an earlier one; each compared with the eager rows (no
    graphs): the trees, positions, ancestor masks, row and logits indices and node scores equal. On
    request (`reps` > 0) eager and replay times."""
    top = padded_rows(r)
    steps = ((top, 40), (r, 30), (top, 40), (r, 33), ((r + top) // 2, 36))
    graphs = StepGraphs(backend)
    differs, widths, pool_bytes = [], set(), None
    for i, (rows, budget) in enumerate(steps):
        # (one input buffer for every step, as the runner's: room for the largest step's tokens)
        block, nodes, table, step_ids, n, deepest = schedule_step_inputs(rows, budget, device, seed=6000 + 7 * r + i,
                                                                         buffer=top * (40 + 3))
        n = max(n, 33)  # (one padded width, 64, for every step)
        widths.add(padded_width(n))
        got, held, _ = held_by(lambda: schedule_rows(block, nodes, table, step_ids, n, deepest, True, graphs), device)
        pool_bytes = held if i == graphs.capture_after - 1 else pool_bytes  # the capture's call
        want = schedule_rows(block, nodes, table, step_ids, n, deepest, True)
        for name in ("tokens", "parents", "depths", "positions", "valid", "num_rows", "context_lens", "ancestors"):
            if not torch.equal(getattr(got.batch, name), getattr(want.batch, name)):
                differs.append(f"step {i}: batch.{name}")
        for name in ("row_index", "logit_rows", "write_index", "node_scores"):
            if not torch.equal(getattr(got, name), getattr(want, name)):
                differs.append(f"step {i}: {name}")
    rec = {"differs": differs, "padded": [top, sorted(widths)], "pool_bytes": pool_bytes,
           "graphs": {"captures": graphs.captures, "replays": graphs.replays, "eager_calls": graphs.eager_calls,
                      "failed": graphs.failed}}
    rec["replay_equals_eager"] = not differs and graphs.failed is None and graphs.replays == len(steps) - 2
    if reps:
        rec["eager_ms"] = timed_ms(lambda: schedule_rows(block, nodes, table, step_ids, n, deepest, True), device, reps)
        rec["replay_ms"] = timed_ms(lambda: schedule_rows(block, nodes, table, step_ids, n, deepest, True, graphs),
                                    device, reps)
    return rec


def held_mib(rec: dict) -> str:
    return "pool not measured" if rec.get("pool_bytes") is None else f"{rec['pool_bytes'] / 2**20:.1f} MiB held"


def capture_rows(ctx: "Check", variant: str, run: Callable[[int], dict], detail: Callable[[dict], str],
                 rows: list[dict], bad: list[str]) -> None:
    """b.graphs' rows of one of the product's own capture paths, one per batch size: `run(batch)` gives
    the record (`replay_equals_eager`, `differs`, `graphs`, `eager_ms`, `replay_ms`), `detail(record)`
    what its log line adds. A failure is recorded (in `bad` too) and the next batch goes on."""
    for r in ctx.sizes.batches:
        rec = {"batch": r, "variant": variant}
        rows.append(rec)
        if ctx.deadline.left() < 20:
            rec["skipped"] = "wall-clock budget"
            continue
        try:
            rec.update(run(r))
            if not rec["replay_equals_eager"]:
                bad.append(f"{variant}@{r}")
            log(f"  b.graphs batch {r} {variant}: replay {rec['replay_ms']:.3f} ms vs eager {rec['eager_ms']:.3f} ms; "
                f"{detail(rec)}"
                f"{'' if rec['replay_equals_eager'] else ', DIFFERS: ' + str(rec['differs']) + ' ' + str(rec['graphs'])}")
        except Exception as exc:  # noqa: BLE001 - a failed capture is the result; go on
            rec.update(failure(exc))
            bad.append(f"{variant}@{r}")
            log(f"  b.graphs batch {r} {variant}: FAILED {rec['error'][:120]} at {rec['where']}")


def part_b_graphs(ctx: "Check") -> dict:
    """Capture the step per batch size and variant, move the serving state on (`advance_state`),
    replay on new inputs, compare with eager, time both."""
    rows, bad = [], []
    for r in ctx.sizes.batches:
        for variant in VARIANTS:
            if ctx.deadline.left() < 20:
                rows.append({"batch": r, "variant": variant, "skipped": "wall-clock budget"})
                continue
            rec = {"batch": r, "variant": variant}
            rows.append(rec)
            try:
                state, tail = step_state(r, ctx.sizes.vocab, ctx.device, seed=7)
                x = step_inputs(r, ctx.sizes.vocab, tail, seed=r, dtype=torch.bfloat16, device=ctx.device)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        tree_step(x, state, variant)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                inside: list[BaseException] = []  # the op that broke the capture: leaving the capture
                try:  # raises only "operation failed due to a previous error during capture"
                    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                        try:
                            static_out = tree_step(x, state, variant)
                        except BaseException as exc:
                            inside.append(exc)
                            raise
                except BaseException as exc:
                    raise (inside[0] if inside else exc) from None
                captured_state = state.auto.capture_state(r, ctx.device)
                x.copy_(step_inputs(r, ctx.sizes.vocab, tail, seed=1000 + r, dtype=torch.bfloat16, device=ctx.device))
                advance_state(state, r, seed=2000 + r)
                rec["state_moved"] = True
                # What the proposer would capture again (a buffer the capture reads was replaced).
                rec["capture_state_kept"] = state.auto.capture_state(r, ctx.device) == captured_state
                saved = [t.clone() for t in state_tensors(state)]
                graph.replay()
                torch.cuda.synchronize()
                replayed = {k: v.clone() for k, v in static_out.items()}
                for t, s in zip(state_tensors(state), saved):
                    t.copy_(s)
                eager = tree_step(x, state, variant)
                differ = outputs_differ(replayed, eager) + ([] if rec["capture_state_kept"] else ["capture_state"])
                rec["replay_equals_eager"] = not differ
                rec["differs"] = differ
                rec["eager_ms"] = timed_ms(lambda: tree_step(x, state, variant), ctx.device, ctx.sizes.reps)
                rec["replay_ms"] = timed_ms(graph.replay, ctx.device, ctx.sizes.reps)
                if differ:
                    bad.append(f"{variant}@{r}")
                log(f"  b.graphs batch {r} {variant}: replay {rec['replay_ms']:.3f} ms vs eager {rec['eager_ms']:.3f} ms"
                    f"{'' if not differ else ', DIFFERS: ' + ', '.join(differ)}")
            except Exception as exc:  # noqa: BLE001 - a failed capture is the result; go on
                rec.update(failure(exc))
                bad.append(f"{variant}@{r}")
                log(f"  b.graphs batch {r} {variant}: FAILED {rec['error'][:120]} at {rec['where']}")
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001
                    pass
    # the proposer's own captures (VLLM_DDTREE_STEP_GRAPHS=1), then the verify side's (the same switch);
    # the padding's effect on a plan is reported, not failed: a plan that rounds differently moves a
    # budget, never an output
    capture_rows(ctx, STEP_GRAPHS, lambda r: step_graphs_run(r, ctx.sizes.vocab, ctx.device, "cuda", ctx.sizes.reps),
                 lambda rec: (f"capture {rec['capture_ms']:.1f} ms, {rec['pool_bytes'] / 2**20:.1f} MiB held"
                              + ("" if rec["padding_kept_plans"] else f", padding changed {rec['padding_differs']}")),
                 rows, bad)
    capture_rows(ctx, STEP_GRAPHS_NGRAM,
                 lambda r: step_graphs_run(r, ctx.sizes.vocab, ctx.device, "cuda", ctx.sizes.reps, ngram=True),
                 lambda rec: f"capture {rec['capture_ms']:.1f} ms, {rec['pool_bytes'] / 2**20:.1f} MiB held", rows, bad)
    capture_rows(ctx, VERIFY_GRAPHS, lambda r: verify_graphs_run(r, ctx.device, "cuda", ctx.sizes.reps),
                 lambda rec: f"calibration gap {rec['calibration_max_rel_gap']:.1e}, {held_mib(rec)}", rows, bad)
    capture_rows(ctx, SCHEDULE_GRAPHS, lambda r: schedule_graphs_run(r, ctx.device, "cuda", ctx.sizes.reps),
                 lambda rec: f"padded to {rec['padded']}, {held_mib(rec)}", rows, bad)
    return {"passed": not bad, "captures": rows, "failed": bad,
            "summary": "every capture replays equal to eager" if not bad else f"FAILED {', '.join(bad)}"}


# ---------------------------------------------------------------------------------------------------
# c. KV compaction
# ---------------------------------------------------------------------------------------------------


def part_c_compaction(ctx: "Check") -> dict:
    """The moves of a walked step applied by `move_slots_` to every layer of a FlashInfer-layout cache."""
    heads, hd = ctx.sizes.cache_heads
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    rows, bad = [], []
    for r in ctx.sizes.batches[:3]:
        if ctx.deadline.left() < 30:
            rows.append({"batch": r, "skipped": "wall-clock budget"})
            continue
        state, tail = step_state(r, ctx.sizes.vocab, ctx.device, seed=7)
        x = step_inputs(r, ctx.sizes.vocab, tail, seed=r, dtype=dtype, device=ctx.device)
        out = tree_step(x, state, "lookup")  # the longest accepted paths: the most K/V moves
        src, dst = out["src_slots"], out["dst_slots"]
        pages = (int(x.slot_mapping.max()) + 1 + PAGE - 1) // PAGE + 4
        g = torch.Generator(device=ctx.device).manual_seed(r)
        # Each layer physically [pages, PAGE, heads, 2 * hd] (LBNHC), all of them views of one buffer as
        # vLLM 0.32.0 allocates them (so `move_slots_` moves them as one stack); it gets vLLM's logical view.
        phys = list(torch.randn(ctx.sizes.layers, pages, PAGE, heads, 2 * hd, generator=g, device=ctx.device)
                    .to(dtype).unbind(0))
        before = [p.clone() for p in phys]
        move_slots_([p.permute(0, 2, 1, 3) for p in phys], src, dst, "flashinfer")
        s, d = src.cpu().tolist(), dst.cpu().tolist()
        ok = True
        for p, old in zip(phys, before):
            want = old.view(pages * PAGE, heads, 2 * hd).clone()
            flat_old = old.view(pages * PAGE, heads, 2 * hd)
            for a, b in zip(s, d):  # the reference: one slot at a time, from the state before any move
                want[b] = flat_old[a]
            ok &= torch.equal(p.view(pages * PAGE, heads, 2 * hd), want)
        moved = sum(a != b for a, b in zip(s, d))
        ms = timed_ms(lambda: move_slots_([p.permute(0, 2, 1, 3) for p in phys], src, dst, "flashinfer"), ctx.device,
                      ctx.sizes.reps)
        rows.append({"batch": r, "layers": ctx.sizes.layers, "stacks": len(layer_stacks([p.permute(0, 2, 1, 3) for p in phys])),
                     "moves": len(s), "real_moves": moved, "equal": ok,
                     "ms": ms, "bytes_moved": moved * ctx.sizes.layers * heads * 2 * hd * phys[0].element_size()})
        if not ok or not moved:  # a step without a real move would check nothing
            bad.append(r)
        log(f"  c.compaction batch {r}: {len(s)} moves ({moved} real) x {ctx.sizes.layers} layers, "
            f"{'equal' if ok else 'DIFFERENT'}, {ms:.3f} ms")
    return {"passed": not bad, "batches": rows,
            "summary": "equal to the per-slot reference" if not bad else f"FAILED at batch {bad}"}


def race_as_vllm(probs: torch.Tensor, gen: torch.Generator, fp64: bool) -> int:
    """One request's token as vLLM's `random_sample` draws it on a GPU (and in its native sampler):
    a [B, V] noise tensor whose seeded request's row (here row 1 of 2) takes `exponential_` from
    the request's generator, then argmax(probs / noise) (`sample_with_exponential_noise`)."""
    q = torch.empty((2, probs.shape[-1]), dtype=torch.float64 if fp64 else probs.dtype, device=probs.device)
    q[1].exponential_(generator=gen)
    scores = probs.div(q[1]) if q.dtype == probs.dtype else q[1].reciprocal().mul_(probs)
    return int(scores.argmax())


def part_b_seeded(ctx: "Check") -> dict:
    """A seeded request's tree rows draw, at depth d, what vLLM's race draws for the target alone d
    steps later (`sampling.draw`); the generator's state after each draw is kept for `settle`."""
    dev, vocab = ctx.device, ctx.sizes.vocab
    depths = [0, 1, 1, 2, 2, 2, 3, 4, 4, 5]  # one seeded request's rows: siblings share depths
    cases, bad = [], []
    for fp64 in (False, True):
        g = torch.Generator(device=dev).manual_seed(3)
        logits = torch.randn(3 + len(depths), vocab, generator=g, device=dev) * 2  # an unseeded request's 3 rows first
        probs = torch.softmax(logits, -1)
        mine = torch.Generator(device=dev).manual_seed(1234)
        seeds = SeededDraws.before_sampling({1: mine})
        rows = SeededRows(len(depths), mine, torch.tensor(depths, device=dev), max(depths) + 1, seeds.states[1])
        got = draw(logits.clone(), {3: rows}, fp64_noise=fp64, cpu_op=False)[3:].tolist()
        alone = torch.Generator(device=dev).manual_seed(1234)
        states = [alone.get_state()]
        for _ in range(len(depths)):  # the target alone's steps: one draw each
            race_as_vllm(probs[3], alone, fp64)
            states.append(alone.get_state())

        def drawn_at(step: int, row: int) -> int:
            at = torch.Generator(device=dev)
            at.set_state(states[step])
            return race_as_vllm(probs[3 + row], at, fp64)

        want = [drawn_at(d, j) for j, d in enumerate(depths)]
        per_row = [drawn_at(j, j) for j in range(len(depths))]  # one draw per row: what the check must tell apart
        drawn = max(depths) + 2  # the state before the step and after each of its draws
        states_equal = len(seeds.states[1]) == drawn and all(torch.equal(a, b) for a, b in zip(seeds.states[1], states))
        seeds.settle([[], [0, 0, 0]])
        settled = torch.equal(mine.get_state(), states[3])
        case = {"noise": "float64" if fp64 else "float32", "rows": len(depths), "draws": max(depths) + 1,
                "equal": got == want, "states_equal": states_equal, "settled": settled,
                "one_draw_per_row_differs": per_row != want}
        cases.append(case)
        if not all(v for k, v in case.items() if k not in ("noise", "rows", "draws")):
            bad.append(case["noise"])
        log(f"  b.seeded {case['noise']}: rows {'equal' if case['equal'] else 'DIFFERENT'} to the target alone's "
            f"draws, states {'equal' if states_equal else 'DIFFERENT'}")
    return {"passed": not bad, "cases": cases,
            "summary": "the target alone's draws per depth" if not bad else f"FAILED with {bad} noise"}


# ---------------------------------------------------------------------------------------------------
# d. The verify-cost curve
# ---------------------------------------------------------------------------------------------------


def device_slug(device: torch.device) -> str:
    """'h100', 'h200', 'a100', ... from the device name ('cpu' for a CPU)."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    m = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", name)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def verify_model(ctx: "Check"):
    """A transformers Qwen3 decoder of the configured shape with random weights, built on the device."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**ctx.sizes.model)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(ctx.sizes.model_dtype)
    try:
        with torch.device(ctx.device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model.eval(), config


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm: normalised in float32, cast back, then scaled."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class StaticVerify:
    """The verify forward of a transformers Qwen3 model's own weights as plain tensor ops over a
    preallocated KV cache: batch x rows new tokens after `context` cached ones, the rows attending to
    the context and causally to each other (a chain; a tree mask of the same rows costs SDPA the same).

    Every shape and buffer is fixed at construction, so on CUDA the forward is captured in a CUDA graph
    and replayed: what vLLM's compiled, graphed model costs, which the eager transformers forward (one
    kernel launch at a time from Python, ~50 ms for Qwen3-8B whatever the rows) does not show.
    The cache is the model's own prefill of the context, so the logits equal transformers' (checked).
    """

    def __init__(self, model, cache, ids: torch.Tensor, context: int) -> None:
        cfg = model.config
        self.model, self.eps = model, cfg.rms_norm_eps
        self.batch, self.rows = ids.shape
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.ids, self.context = ids, context
        layers = cache.layers if hasattr(cache, "layers") else None
        keys = [lyr.keys for lyr in layers] if layers is not None else list(cache.key_cache)
        values = [lyr.values for lyr in layers] if layers is not None else list(cache.value_cache)
        total = context + self.rows
        self.k = [torch.cat([k[:, :, :context], k.new_zeros(*k.shape[:2], self.rows, k.shape[-1])], 2) for k in keys]
        self.v = [torch.cat([v[:, :, :context], v.new_zeros(*v.shape[:2], self.rows, v.shape[-1])], 2) for v in values]
        pos = torch.arange(context, total, device=ids.device).expand(self.batch, -1)
        x = model.model.embed_tokens(ids)
        cos, sin = model.model.rotary_emb(x, pos)  # [B, rows, hd]
        self.cos, self.sin = cos.unsqueeze(2), sin.unsqueeze(2)
        groups = self.heads // self.kv_heads
        causal = torch.ones(self.rows, total, dtype=torch.bool, device=ids.device).tril(context)
        self.mask = causal.repeat(groups, 1)  # [groups * rows, total]: q heads grouped under their KV head

    def forward(self) -> torch.Tensor:
        """Logits [B, rows, V]; writes the rows' K/V into the cache's tail (the same slots every call)."""
        B, R, H, G, D = self.batch, self.rows, self.heads, self.kv_heads, self.head_dim
        m = self.model.model
        x = m.embed_tokens(self.ids)
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            h = rms_norm(x, layer.input_layernorm.weight, self.eps)
            q = rms_norm(F.linear(h, a.q_proj.weight).view(B, R, H, D), a.q_norm.weight, self.eps)
            k = rms_norm(F.linear(h, a.k_proj.weight).view(B, R, G, D), a.k_norm.weight, self.eps)
            v = F.linear(h, a.v_proj.weight).view(B, R, G, D)
            q = q * self.cos + rotate_half(q) * self.sin
            k = k * self.cos + rotate_half(k) * self.sin
            self.k[i][:, :, self.context:] = k.transpose(1, 2)
            self.v[i][:, :, self.context:] = v.transpose(1, 2)
            # [B, G, H/G * R, D]: each KV head's query heads stacked along the rows, so plain SDPA reads
            # the cache once per KV head (no repeated K/V, no enable_gqa)
            qg = q.view(B, R, G, H // G, D).permute(0, 2, 3, 1, 4).reshape(B, G, H // G * R, D)
            o = F.scaled_dot_product_attention(qg, self.k[i], self.v[i], attn_mask=self.mask, scale=D ** -0.5)
            o = o.view(B, G, H // G, R, D).permute(0, 3, 1, 2, 4).reshape(B, R, H * D)
            x = x + F.linear(o, a.o_proj.weight)
            h = rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
            mlp = layer.mlp
            x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                             mlp.down_proj.weight)
        return F.linear(rms_norm(x, m.norm.weight, self.eps), self.model.lm_head.weight)


def graphed(fn: Callable[[], torch.Tensor], device: torch.device) -> Callable[[], object]:
    """On CUDA: `fn` captured in a CUDA graph (after warm-up on a side stream), returned as its replay.
    Elsewhere `fn` itself."""
    if device.type != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def part_d_verify_cost(ctx: "Check") -> dict:
    """Forward time of batch x (1 + N) new rows after a cached context, eager transformers and the same
    weights' static forward (CUDA-graph replay on CUDA); CostModel fitted to the latter; knees."""
    t0 = time.perf_counter()
    model, config = verify_model(ctx)
    build_s = time.perf_counter() - t0
    s, v = ctx.sizes, ctx.sizes.model["vocab_size"]
    points, skipped, checks = [], [], []
    with torch.inference_mode():
        for b in s.verify_batches:
            if ctx.deadline.left() < 20:
                skipped += [(b, n) for n in s.verify_rows]
                continue
            ids = torch.randint(v, (b, s.verify_context), device=ctx.device)
            cache = model(ids, use_cache=True, logits_to_keep=1).past_key_values
            for n in s.verify_rows:
                if ctx.deadline.left() < 10:
                    skipped.append((b, n))
                    continue
                new = torch.randint(v, (b, 1 + n), device=ctx.device)
                static = StaticVerify(model, cache, new, s.verify_context)

                def forward(model=model, cache=cache, new=new, n=n):  # rows appended to the cache, cropped off again
                    logits = model(new, past_key_values=cache, use_cache=True).logits
                    cache.crop(-(1 + n))
                    return logits

                if n == s.verify_rows[min(1, len(s.verify_rows) - 1)]:  # once per batch, with draft rows
                    ref, got = forward().float(), static.forward().float()
                    checks.append({"batch": b, "n": n, "max_abs_diff": float((ref - got).abs().max()),
                                   "max_abs_logit": float(ref.abs().max())})
                eager_ms = timed_ms(forward, ctx.device, s.reps)
                ms = timed_ms(graphed(static.forward, ctx.device), ctx.device, s.reps)
                del static
                points.append({"batch": b, "rows": 1 + n, "n": n, "ms": ms, "eager_ms": eager_ms})
                log(f"  d.verify_cost batch {b} x (1 + {n}) rows: {ms:.2f} ms "
                    f"{'graph replay' if ctx.device.type == 'cuda' else 'static'}, {eager_ms:.2f} ms eager transformers")
            del cache
    del model
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    fit = fit_cost(points, config, ctx) if len(points) >= 2 else None
    knees = knee_rows(points)
    # float32 (the CPU part): the static forward is transformers' computation, up to summation order
    tol = 1e-3 if s.model_dtype == torch.float32 else None
    same = all(c["max_abs_diff"] <= tol * max(1.0, c["max_abs_logit"]) for c in checks) if tol else True
    ok = (len(points) >= 2 and fit is not None and all(math.isfinite(p["ms"]) and p["ms"] > 0 for p in points)
          and bool(checks) and same)
    return {"passed": ok, "model": {k: ctx.sizes.model[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")},
            "dtype": str(s.model_dtype).replace("torch.", ""), "context": s.verify_context, "model_build_s": build_s,
            "timed": "CUDA-graph replay of the static forward" if ctx.device.type == "cuda" else "static forward, eager",
            "static_vs_transformers": checks, "points": points, "skipped": skipped, "fitted": fit, "knee_n": knees,
            "summary": f"{len(points)} points; knee N (step 10% over one row) by batch: {knees}"
                       + (f"; fit slope {fit['slope']:.2f} x roofline + {fit['intercept_ms']:.2f} ms" if fit else "")
                       + ("" if same else "; the static forward's logits differ from transformers'")}


def cost_inputs(points: list[dict], context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step totals of each point: tokens B (1 + N), attention pairs B (1 + N)(ctx + 1 + N), context B ctx."""
    b = torch.tensor([p["batch"] for p in points], dtype=torch.float64)
    rows = torch.tensor([p["rows"] for p in points], dtype=torch.float64)
    return b * rows, b * rows * (context + rows), b * context


def fit_cost(points: list[dict], config, ctx: "Check") -> dict:
    """`CostModel.fit` (intercept + slope x roofline + per-token term past a knee) on the measured curve,
    for the device's published-figure profile; the fit's and the unfitted roofline's predictions."""
    slug = device_slug(ctx.device)
    profile = get_profile(slug if slug in ("h100", "h200", "cpu") else "h100")
    shape = ModelShape.from_hf_config(config, str(ctx.sizes.model_dtype).replace("torch.", ""))
    tokens, pairs, context = cost_inputs(points, ctx.sizes.verify_context)
    seconds = torch.tensor([p["ms"] / 1e3 for p in points], dtype=torch.float64)
    cost = CostModel(shape, profile)
    published = [1e3 * float(x) for x in cost.verify_seconds(tokens, pairs, context)]
    cost.fit(tokens, pairs, context, seconds, per_token=True)
    fitted = [1e3 * float(x) for x in cost.verify_seconds(tokens, pairs, context)]
    for p, f, r in zip(points, fitted, published):
        p["fitted_ms"], p["roofline_ms"] = f, r
    return {"profile": profile.name, "peak_flops": profile.peak_flops, "bandwidth": profile.bandwidth,
            "slope": cost.slope, "intercept_ms": 1e3 * cost.intercept, "per_token_ms": 1e3 * cost.per_token,
            "knee_tokens": cost.knee,
            "max_rel_err": max(abs(f - p["ms"]) / p["ms"] for p, f in zip(points, fitted))}


def knee_rows(points: list[dict]) -> dict[str, int | None]:
    """Per batch, the first N whose step is 10% above the one-row (N = 0) step (None: never, or no N = 0)."""
    knees = {}
    for b in sorted({p["batch"] for p in points}):
        curve = sorted((p["n"], p["ms"]) for p in points if p["batch"] == b)
        base = dict(curve).get(0)
        knees[str(b)] = next((n for n, ms in curve if base and ms > 1.1 * base), None)
    return knees


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------


@dataclass
class Check:
    """One check run: device, sizes, deadline, and the report written after every part."""

    device: torch.device
    sizes: Sizes
    deadline: Deadline
    outputs: list[Path]
    report: dict = field(default_factory=dict)
    topk_flashinfer: bool = False  # b.topk: also FlashInfer's top-k (its own JIT build)

    def write(self, plot: bool = False) -> None:
        """The JSON (and with `plot` the PNG) to every output path; an interrupted run keeps what it has."""
        from plotting import save_results

        for path in self.outputs:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_results(self.report, str(path), plot=(lambda png: plot_report(self.report, png)) if plot else None)


#: In this order: FlashInfer's JIT build (minutes) comes after the parts whose time is known, so a run cut
#: short keeps them; the CUDA-graph captures come last, so a failed capture cannot disturb another part.
PARTS: list[tuple[str, Callable[[Check], dict], bool]] = [
    ("a.plan", part_a_plan, False),
    ("b.pipeline", part_b_pipeline, False),
    ("b.sync", part_b_sync, True),
    ("b.profile", part_b_profile, False),
    ("b.seeded", part_b_seeded, False),
    ("c.compaction", part_c_compaction, False),
    ("d.verify_cost", part_d_verify_cost, False),
    ("b.topk", part_b_topk, False),
    ("a.kernel", part_a_kernel, True),
    ("b.graphs", part_b_graphs, True),
    ("a.xqa", part_a_xqa, True),
]


def versions() -> dict:
    fi = flashinfer_module()
    try:
        import transformers

        tv = transformers.__version__
    except Exception:  # noqa: BLE001
        tv = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "flashinfer": getattr(fi, "__version__", None),
            "transformers": tv, "python": platform.python_version()}


def run_check(check: Check, only: list[str] | None, update: dict | None = None) -> None:
    """Run the parts in order, each caught on its own; the report is written after each. With `update`
    (an earlier report of the same device and versions), the parts run replace its parts of the same
    name, the others are kept, and `rerun` lists what was replaced."""
    dev = check.device
    check.report.update({"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
                         or "cpu", "device_slug": device_slug(dev), "device_type": dev.type, **versions(),
                         "quick": check.sizes.context_scale < 1.0, "parts": []})
    if update is not None:
        same = ("device", "device_type", "torch", "cuda", "flashinfer", "quick")
        differ = [k for k in same if update.get(k) != check.report.get(k)]
        if differ:
            sys.exit(f"--update: the earlier report differs in {', '.join(differ)}; run the whole check instead")
        ran = [name for name, _, _ in PARTS if not only or name in only]
        check.report = {**update, "parts": [p for p in update["parts"] if p["name"] not in ran],
                        "rerun": sorted(set(update.get("rerun", [])) | set(ran))}
    for name, fn, needs_cuda in PARTS:
        if only and name not in only:
            continue
        rec = {"name": name}
        if needs_cuda and dev.type != "cuda":
            rec.update(passed=None, not_run=f"needs CUDA (this run's device is {dev.type})")
            log(f"[{name}] not run: needs CUDA")
        else:
            log(f"[{name}] running ({check.deadline.left():.0f} s of the budget left)")
            t0 = time.perf_counter()
            try:
                rec.update(fn(check))
            except Exception as exc:  # noqa: BLE001 - one part's crash is its result; the others still run
                rec.update(passed=False, **failure(exc))
                log(f"[{name}] CRASHED: {rec['error'][:300]} at {rec['where']}")
            rec["seconds"] = round(time.perf_counter() - t0, 2)
            log(f"[{name}] {'passed' if rec['passed'] else 'FAILED'} in {rec['seconds']} s: {rec.get('summary', '')}")
        check.report["parts"].append(rec)
        order = [n for n, _, _ in PARTS]
        check.report["parts"].sort(key=lambda p: order.index(p["name"]) if p["name"] in order else len(order))
        check.write()


def print_table(report: dict) -> None:
    log(f"\nGPU check on {report['device']} (torch {report['torch']}, CUDA {report['cuda']}, "
        f"FlashInfer {report['flashinfer']})")
    log(f"{'part':<15} {'result':<8} {'s':>6}  summary")
    for p in report["parts"]:
        status = "not run" if p["passed"] is None else "passed" if p["passed"] else "FAILED"
        text = p.get("not_run") or p.get("summary") or p.get("error", "")
        log(f"{p['name']:<15} {status:<8} {p.get('seconds', 0):>6}  {text}")


def plot_report(report: dict, png: str) -> None:
    """Five panels: verify-cost curve (d), tree step eager vs replayed (b), compaction time (c),
    FlashInfer custom-mask vs causal time (a), one eager step's kernel time (or ops) by stage (b)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = {p["name"]: p for p in report["parts"]}
    fig, axes = plt.subplots(1, 5, figsize=(27, 4.5))
    ax = axes[0]
    d = parts.get("d.verify_cost", {})
    for b in sorted({p["batch"] for p in d.get("points", [])}):
        pts = sorted((p["n"], p["ms"], p.get("fitted_ms")) for p in d["points"] if p["batch"] == b)
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"batch {b} measured")[0]
        if pts[0][2] is not None:
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=line.get_color(), label=f"batch {b} fitted")
        eager = sorted((p["n"], p["eager_ms"]) for p in d["points"] if p["batch"] == b and "eager_ms" in p)
        if eager:
            ax.plot(*zip(*eager), ":", color=line.get_color(), alpha=0.6, label=f"batch {b} eager transformers")
    ax.set(xscale="symlog", yscale="log", xlabel="draft rows N (step verifies 1 + N per request)",
           ylabel="verify forward ms", title=f"d. verify cost ({d.get('timed', '')}), context {d.get('context')}")
    ax.legend(fontsize=7)
    ax = axes[1]
    g = parts.get("b.graphs", {}).get("captures", [])
    e = parts.get("b.pipeline", {}).get("steps", [])
    for variant, style in zip(VARIANTS, ("o", "s", "^")):
        pts = sorted((s["batch"], s["eager_ms"]) for s in e if s.get("variant") == variant and "eager_ms" in s)
        if pts:
            ax.plot(*zip(*pts), style + "-", label=f"{variant} eager")
        pts = sorted((s["batch"], s["replay_ms"]) for s in g if s.get("variant") == variant and "replay_ms" in s)
        if pts:
            ax.plot(*zip(*pts), style + ":", label=f"{variant} graph replay")
    for variant, name, marker in ((STEP_GRAPHS, "plan_trees", "D"), (STEP_GRAPHS_NGRAM, "plan_trees + n-gram", "P"),
                                  (VERIFY_GRAPHS, "verify_trees", "v"), (SCHEDULE_GRAPHS, "schedule_rows", "x")):
        for key, line in (("eager_ms", "-"), ("replay_ms", ":")):
            pts = sorted((s["batch"], s[key]) for s in g if s.get("variant") == variant and key in s)
            if pts:
                ax.plot(*zip(*pts), marker + line, label=f"{name} {'eager' if key == 'eager_ms' else 'StepGraphs replay'}")
    ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tree step ms", title="b. tree pipeline")
    ax.legend(fontsize=7)
    ax = axes[2]
    c = [r for r in parts.get("c.compaction", {}).get("batches", []) if "ms" in r]
    ax.bar([str(r["batch"]) for r in c], [r["ms"] for r in c])
    ax.set(xlabel="batch", ylabel="ms", title=f"c. KV compaction, {c[0]['layers'] if c else '-'} layers")
    ax = axes[3]
    t = [r for r in parts.get("a.kernel", {}).get("timing", []) if "tree_run_ms" in r]
    labels = [f"b{r['batch']} ctx{r['context']}" for r in t]
    x = range(len(t))
    xqa = {(r["batch"], r["context"]): r for r in parts.get("a.xqa", {}).get("timing", []) if "xqa_run_ms" in r}
    ax.bar([i - 0.27 for i in x], [r["tree_plan_ms"] + r["tree_run_ms"] for r in t], 0.27, label="custom mask (FA2)")
    ax.bar(list(x), [r["causal_plan_ms"] + r["causal_run_ms"] for r in t], 0.27, label="causal")
    if xqa:
        ax.bar([i + 0.27 for i in x], [xqa[k]["xqa_plan_ms"] + xqa[k]["xqa_run_ms"] if k in xqa else 0
                                       for k in ((r["batch"], r["context"]) for r in t)], 0.27, label="tree mask (XQA)")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set(ylabel="plan + run ms", title="a. FlashInfer, 1 + 64 rows per request")
    if t:
        ax.legend(fontsize=7)
    ax = axes[4]
    profiles = [p for p in parts.get("b.profile", {}).get("profiles", []) if "stages" in p]
    key = "kernel_us" if any(p["kernels"] for p in profiles) else "ops"  # a CPU run has ops, no kernels
    bottom = [0.0] * len(profiles)
    for name in STAGES:
        heights = [p["stages"][name][key] / (1000 if key == "kernel_us" else 1) for p in profiles]
        if any(heights):
            ax.bar(range(len(profiles)), heights, 0.6, bottom=bottom, label=name)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(profiles)), [f"b{p['batch']} {p['variant']}" for p in profiles], fontsize=7, rotation=30)
    ax.set(ylabel="kernel ms" if key == "kernel_us" else "dispatched ops", title="b. one eager step by stage")
    if profiles:
        ax.legend(fontsize=7)
    for ax, name in zip(axes, ("d.verify_cost", "b.pipeline", "c.compaction", "a.kernel", "b.profile")):
        if not parts.get(name, {}).get("passed") and parts.get(name, {}).get("not_run"):
            ax.text(0.5, 0.5, "not run", ha="center", transform=ax.transAxes)
    fig.suptitle(f"GPU check: {report['device']}, torch {report['torch']}, CUDA {report['cuda']}, "
                 f"FlashInfer {report['flashinfer']}")
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    try:  # a 64-colour palette keeps the committed image small
        from plotting import compact_png

        compact_png(png, colors=64)
    except ImportError:  # (no Pillow)
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="fewer cases, batch sizes and timing points")
    ap.add_argument("--json", action="append", default=[], help="write the report here (repeatable)")
    ap.add_argument("--json-dir", action="append", default=[], help="write <device>.json and .png into this folder")
    ap.add_argument("--site", action="append", default=[], help="carried packages' folder, appended to the path")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget: later timing points are skipped")
    ap.add_argument("--only", action="append", help="run only these parts (e.g. b.sync)")
    ap.add_argument("--topk-flashinfer", action="store_true",
                    help="b.topk: also time FlashInfer's top-k (its JIT build took over 6 minutes on an H200 host)")
    ap.add_argument("--update", action="store_true",
                    help="with --only: replace those parts in the existing report (the first output that exists)")
    ap.add_argument("--plot", help="only redraw the PNG of this report JSON")
    args = ap.parse_args()
    for site in args.site:
        sys.path.append(str(Path(site).resolve()))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(Path(site).resolve())]))
    if args.plot:
        plot_report(json.loads(Path(args.plot).read_text()), args.plot.rsplit(".", 1)[0] + ".png")
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda, but torch sees no CUDA device (use --device cpu for the CPU part)")
    device = torch.device(args.device)
    if device.type == "cpu":  # nothing here needs threads; one keeps the timings steady beside other work
        torch.set_num_threads(1)
    slug = device_slug(device)
    outputs = [Path(p) for p in args.json] + [Path(d) / f"{slug}.json" for d in args.json_dir]
    check = Check(device, sizes_for(args.device, args.quick), Deadline(args.budget_s), outputs,
                  topk_flashinfer=args.topk_flashinfer)
    update = None
    if args.update:
        earlier = next((p for p in outputs if p.is_file()), None)
        if not args.only or earlier is None:
            sys.exit("--update needs --only and an existing report among the outputs")
        update = json.loads(earlier.read_text())
    t0 = time.perf_counter()
    run_check(check, args.only, update)
    if update is None:
        check.report["total_seconds"] = round(time.perf_counter() - t0, 1)
    try:
        check.write(plot=True)
    except ImportError as exc:  # no matplotlib: the JSON is written; redraw later with --plot
        check.write()
        log(f"no PNG ({exc}); redraw with: python benchmarks/gpu_check.py --plot <json>")
    print_table(check.report)


if __name__ == "__main__":
    main()
