"""The GPU attention shim against vLLM's real FlashInfer backend, on the CPU (run by
tests/test_flashinfer_tree.py in a subprocess with `.venv/flashinfer` on PYTHONPATH).

A real `TreeFlashInferMetadataBuilder` is built from a real ddtree engine config (bf16 SmolLM2 with
the project's drafter) and a real vLLM `Attention` layer whose impl is FlashInfer's, then asked for
the metadata of a verify step. The only stand-in is FlashInfer's prefill wrapper — its plan() and
run() launch CUDA kernels — replaced by one that binds the call to the real plan()'s signature and
keeps the arguments. Prints "shim ok" when every check passed.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
import flashinfer
from flashinfer.prefill import _compute_page_mask_indptr
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.flashinfer import FlashInferBackend, FlashInferImpl, FlashInferMetadataBuilder
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_ddtree.attention.flashinfer_tree import TreeFlashInferBackend, TreeFlashInferMetadataBuilder
from vllm_ddtree.attention.tree_mask import (
    TreeStepMasks,
    flashinfer_paged_plan,
    set_step_tree_masks,
    xqa_spec_mask,
    xqa_spec_plan,
)
from vllm_ddtree.models.target import prepare_target
from vllm_ddtree.reference.pair import drafter_dir
from vllm_ddtree.tree import build_tree, compile_tree, dense_attention_mask, topk_per_depth
from vllm_ddtree.vllm_patches import gpu_tree_attention_backend

PLAN = inspect.signature(flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan)
RUN = inspect.signature(flashinfer.BatchPrefillWithPagedKVCacheWrapper.run)


class PlanRecorder:
    """FlashInfer's prefill wrapper minus the kernels: plan() and run() bind to the real signatures."""

    def __init__(self) -> None:
        self.planned: dict | None = None
        self.ran: tuple | None = None

    def plan(self, **kwargs) -> None:
        PLAN.bind(self, **kwargs)  # TypeError on a keyword FlashInfer does not take, or a missing one
        self.planned = kwargs
        # the attributes FlashInferImpl.forward asserts against its own (set by FlashInfer's plan())
        self._causal, self._sm_scale = kwargs["causal"], kwargs["sm_scale"]
        self._window_left, self._logits_soft_cap = kwargs.get("window_left", -1), kwargs.get("logits_soft_cap") or 0.0

    def run(self, *args, **kwargs):
        RUN.bind(self, *args, **kwargs)
        self.ran = args


def main() -> None:
    assert issubclass(TreeFlashInferBackend, FlashInferBackend)
    assert TreeFlashInferBackend.get_name() == "FLASHINFER"
    assert TreeFlashInferBackend.get_builder_cls() is TreeFlashInferMetadataBuilder
    assert issubclass(TreeFlashInferMetadataBuilder, FlashInferMetadataBuilder)
    assert gpu_tree_attention_backend(None) == AttentionBackendEnum.FLASHINFER
    check_toolkit_warning()

    cfg = EngineArgs(model=str(prepare_target()), dtype="bfloat16", max_model_len=512,
                     speculative_config={"method": "ddtree", "model": str(drafter_dir()), "tree_budget": 8}
                     ).create_engine_config()
    cfg.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves before building metadata
    with set_current_vllm_config(cfg):  # as in the engine, where layers and builders are made and used
        check_verify_step(cfg)
        check_mixed_step_forward(cfg)
        check_reorder_threshold(cfg)
        check_start_up_build(cfg)
        check_cudagraph_modes(cfg)
    check_xqa_layout()
    with set_current_vllm_config(cfg):
        check_xqa_verify_step(cfg)
    print("shim ok", flashinfer.__version__)


def check_toolkit_warning() -> None:
    """Without a CUDA toolkit where FlashInfer looks, choosing ddtree's attention (while the model is
    built, before its weights load) warns once that the kernel build after loading will fail."""
    import logging
    import os
    import tempfile

    import vllm_ddtree.vllm_patches as patches

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    saved = {k: os.environ.get(k) for k in ("CUDA_HOME", "CUDA_PATH", "PATH")}
    logger = logging.getLogger("vllm.ddtree")
    handler = Keep()
    logger.addHandler(handler)
    try:
        with tempfile.TemporaryDirectory() as empty:
            os.environ.pop("CUDA_HOME", None)
            os.environ.pop("CUDA_PATH", None)
            os.environ["CUDA_HOME"] = empty  # a toolkit without nvcc, wherever this check runs
            patches._toolkit_warned = False
            for _ in range(3):  # once per process, not once per layer
                assert patches.gpu_tree_attention_backend(None) == AttentionBackendEnum.FLASHINFER
            toolkit = os.path.join(empty, "cuda")
            os.makedirs(os.path.join(toolkit, "bin"))
            open(os.path.join(toolkit, "bin", "nvcc"), "w").close()
            os.environ["CUDA_HOME"] = toolkit  # a toolkit with nvcc: nothing is said
            patches._toolkit_warned = False
            patches.gpu_tree_attention_backend(None)
    finally:
        logger.removeHandler(handler)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    warned = [m for m in said if "tree-attention kernel" in m]
    assert len(warned) == 1, said  # once over three calls, and not with a toolkit
    assert f"no bin/nvcc under {empty}" in warned[0] and "install the CUDA toolkit" in warned[0], warned


def check_verify_step(cfg) -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    name = "model.layers.0.self_attn.attn"
    layer = Attention(num_heads=9, head_size=64, scale=0.125, num_kv_heads=3, prefix=name,
                      attn_backend=TreeFlashInferBackend)
    assert isinstance(layer.impl, FlashInferImpl)
    builder = TreeFlashInferMetadataBuilder(spec, [name], cfg, torch.device("cpu"))
    support = TreeFlashInferMetadataBuilder.get_cudagraph_support(cfg, spec)
    assert support.value <= AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE.value, support

    # A verify step: 0 a prefill chunk (5 after 6), 1 a tree of 1 + 7 rows after 13, 2 a decode (1 after 8).
    lp, ids = topk_per_depth(torch.randn(1, 8, 12, generator=torch.Generator().manual_seed(0)) * 2, 6)
    tree = compile_tree(build_tree(lp, ids, 7), torch.tensor([5]), torch.tensor([13]))
    rows = int(tree.num_rows[0])
    query_lens, seq_lens = torch.tensor([5, rows, 1]), torch.tensor([11, 13 + rows, 9])
    qsl = torch.zeros(4, dtype=torch.int32)
    qsl[1:] = torch.cumsum(query_lens, 0)
    block_table = torch.tensor([[7, 0, 0, 0], [3, 9, 0, 0], [12, 0, 0, 0]], dtype=torch.int32)
    anc = torch.zeros(3, rows, rows, dtype=torch.bool)
    anc[1] = tree.ancestors[0, :rows, :rows]
    masks = TreeStepMasks(has_tree=torch.tensor([False, True, False]), num_rows=torch.tensor([0, rows, 0]),
                          ancestors=anc, has_tree_cpu=torch.tensor([False, True, False]))
    t = int(qsl[-1])
    # The device copy of seq_lens is on "meta": the builder must use the runner's host copy (a read
    # of the device copy, a GPU sync, would raise here).
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens.int().to("meta"),
                                 num_reqs=3, num_actual_tokens=t, max_query_len=int(query_lens.max()),
                                 max_seq_len=int(seq_lens.max()), block_table_tensor=block_table,
                                 slot_mapping=torch.arange(t), causal=True, seq_lens_cpu_upper_bound=seq_lens.int())
    recorder, causal_recorder = PlanRecorder(), PlanRecorder()
    builder._ddtree_wrapper, builder._prefill_wrapper = recorder, causal_recorder
    set_step_tree_masks(masks)
    try:
        md = builder.build(0, cm)
    finally:
        set_step_tree_masks(None)

    # The chunk before the tree shares its masked plan (the "decode" part the impl runs first); the
    # decode after the last tree gets vLLM's causal plan.
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills, md.num_prefill_tokens) == (2, 5 + rows, 1, 1)
    assert md.causal is True and md.decode.wrapper is recorder and md.prefill.wrapper is causal_recorder
    assert causal_recorder.planned["causal"] is True and causal_recorder.planned["custom_mask"] is None
    got = recorder.planned
    assert got["causal"] is False and got["page_size"] == 16 and got["head_dim_qk"] == 64
    assert (got["num_qo_heads"], got["num_kv_heads"], got["sm_scale"]) == (9, 3, 0.125)
    assert got["q_data_type"] == torch.bfloat16 and got["kv_data_type"] == torch.bfloat16
    assert got["paged_kv_indices"].tolist() == [7, 3, 9]  # each request's pages, in order
    assert got["paged_kv_last_page_len"].tolist() == [11, 13 + rows - 16]
    want = flashinfer_paged_plan(qsl[:3], seq_lens[:2], block_table[:2], 16, True, masks)
    assert torch.equal(got["custom_mask"], want.custom_mask)
    # FlashInfer finds each request's mask block from the page table; it must land on ours.
    offsets = _compute_page_mask_indptr(got["qo_indptr"], got["paged_kv_indptr"], got["paged_kv_last_page_len"], 16)
    assert offsets.tolist() == [0, *torch.cumsum(query_lens[:2] * seq_lens[:2], 0).tolist()]
    assert int(offsets[-1]) == got["custom_mask"].numel()
    back = causal_recorder.planned
    assert back["paged_kv_indices"].tolist() == [12] and back["qo_indptr"].tolist() == [0, 1]
    assert back["paged_kv_indptr"].tolist() == [0, 1] and back["paged_kv_last_page_len"].tolist() == [9]
    assert back["fixed_split_size"] == builder.prefill_fixed_split_size
    assert back["disable_split_kv"] == builder.disable_split_kv
    # Without the host copy of the tree rows the step is one masked plan, as before the split.
    set_step_tree_masks(TreeStepMasks(masks.has_tree, masks.num_rows, masks.ancestors))
    try:
        md = builder.build(0, cm)
    finally:
        set_step_tree_masks(None)
    assert (md.num_decodes, md.num_prefills, md.prefill) == (3, 0, None)
    assert recorder.planned["custom_mask"].numel() == int((query_lens * seq_lens).sum())


class AttendingRecorder(PlanRecorder, flashinfer.BatchPrefillWithPagedKVCacheWrapper):
    """A recorder (of FlashInfer's wrapper class, whose __init__ it skips: it allocates on CUDA, and the
    impl checks the class) whose run() computes what FlashInfer's paged prefill computes from the recorded
    plan, in float32 torch, as its plan()/run() document it: request r's KV is its pages in
    ``paged_kv_indices`` order (all full but the last), its mask the custom mask's block at FlashInfer's
    own offsets, or causal aligned to the KV's end; the result is written to ``out``."""

    def run(self, *args, **kwargs):
        super().run(*args, **kwargs)
        q, (k_cache, v_cache) = args[0], args[1]  # NHD: [pages, page, kv heads, head dim]
        p = self.planned
        qo, ind, last = p["qo_indptr"].long(), p["paged_kv_indptr"].long(), p["paged_kv_last_page_len"].long()
        page = p["page_size"]
        kv_lens = (ind[1:] - ind[:-1] - 1) * page + last
        mask = p["custom_mask"]
        if mask is not None:
            offsets = _compute_page_mask_indptr(p["qo_indptr"], p["paged_kv_indptr"], p["paged_kv_last_page_len"], page)
        out = kwargs["out"]
        for r in range(len(qo) - 1):
            pages = p["paged_kv_indices"][ind[r] : ind[r + 1]].long()
            kv, n = int(kv_lens[r]), int(qo[r + 1] - qo[r])
            k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv].float()
            v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv].float()
            if mask is not None:
                m = mask[int(offsets[r]) : int(offsets[r + 1])].view(n, kv)
            else:
                assert p["causal"]
                m = torch.arange(kv)[None, :] <= kv - n + torch.arange(n)[:, None]
            out[qo[r] : qo[r + 1]] = attend(q[qo[r] : qo[r + 1]].float(), k, v, m, p["sm_scale"]).to(out.dtype)


def attend(q, k, v, mask, scale):
    """q [n, HQ, D], k/v [kv, HKV, D] float32, mask [n, kv] -> [n, HQ, D] (grouped-query attention)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
        enable_gqa=True)
    return out[0].transpose(0, 1)


def check_mixed_step_forward(cfg) -> None:
    """A verify step in the order vLLM's reorder gives it at ddtree's threshold (decodes and trees, then
    a prefill chunk that continues a prompt, then a prompt's first chunk), through vLLM's real
    FlashInferImpl.forward: the tree requests' queries go through the custom-mask plan, the chunks
    through vLLM's causal plan, and every query's output is its oracle attention. The mask has no
    element for a chunk."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    name = "model.layers.0.self_attn.attn"  # the layer check_verify_step made
    builder = TreeFlashInferMetadataBuilder(spec, [name], cfg, torch.device("cpu"))
    impl = cfg.compilation_config.static_forward_context[name].impl
    width = cfg.speculative_config.num_speculative_tokens
    g = torch.Generator().manual_seed(3)
    lp, ids = topk_per_depth(torch.randn(1, 8, 12, generator=g) * 2, 6)
    tree = compile_tree(build_tree(lp, ids, width), torch.tensor([5]), torch.tensor([21]))
    rows = int(tree.num_rows[0])
    assert rows == 1 + width
    # 0 decode (1 after 30), 1 tree (after 21), 2 decode (1 after 16), 3 chunk (40 after 20), 4 first chunk (30)
    query_lens = torch.tensor([1, rows, 1, 40, 30])
    ctx = torch.tensor([30, 21, 16, 20, 0])
    seq_lens = ctx + query_lens
    r, t = len(query_lens), int(query_lens.sum())
    qsl, block_table, phys, kv_cache = paged_layer(query_lens, seq_lens, g)
    anc = torch.zeros(r, rows, rows, dtype=torch.bool)
    anc[1] = tree.ancestors[0]
    has_tree = torch.tensor([False, True, False, False, False])
    masks = TreeStepMasks(has_tree=has_tree, num_rows=torch.where(has_tree, rows, 0), ancestors=anc,
                          has_tree_cpu=has_tree)
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens.int().to("meta"),
                                 num_reqs=r, num_actual_tokens=t, max_query_len=int(query_lens.max()),
                                 max_seq_len=int(seq_lens.max()), block_table_tensor=block_table,
                                 slot_mapping=torch.arange(t), causal=True, seq_lens_cpu_upper_bound=seq_lens.int())
    builder._ddtree_wrapper, builder._prefill_wrapper = AttendingRecorder(), AttendingRecorder()
    set_step_tree_masks(masks)
    try:
        md = builder.build(0, cm)
    finally:
        set_step_tree_masks(None)
    assert (md.num_decodes, md.num_decode_tokens) == (2, 1 + rows)
    assert builder._ddtree_wrapper.planned["custom_mask"].numel() == int((query_lens * seq_lens)[:2].sum())
    assert builder._prefill_wrapper.planned["causal"] is True
    q = torch.randn(t, 9, 64, generator=g).to(torch.bfloat16)
    out = torch.full((t, 9, 64), float("nan"), dtype=torch.bfloat16)
    impl.forward(cfg.compilation_config.static_forward_context[name], q, None, None, kv_cache, md, out)
    # The oracle: each request's K/V read by position through its block table, the tree core's mask.
    tree_mask = dense_attention_mask(tree, int(seq_lens[1]))[0]
    for i in range(r):
        kv = int(seq_lens[i])
        pos = torch.arange(kv)
        tokens = phys[block_table[i, pos // 16].long(), pos % 16].float()  # [kv, HKV, 2 * D]
        n = int(query_lens[i])
        causal = pos[None, :] <= kv - n + torch.arange(n)[:, None]
        mask = tree_mask if i == 1 else causal
        want = attend(q[qsl[i] : qsl[i + 1]].float(), tokens[..., :64], tokens[..., 64:], mask, 0.125)
        err = float((out[qsl[i] : qsl[i + 1]].float() - want).abs().max())
        assert err < 2e-2, (i, err)
        if i == 1:  # the tree mask matters for these rows
            control = attend(q[qsl[i] : qsl[i + 1]].float(), tokens[..., :64], tokens[..., 64:], causal, 0.125)
            assert float((control - want).abs().max()) > 0.1


def paged_layer(query_lens: torch.Tensor, seq_lens: torch.Tensor, g: torch.Generator):
    """A step's query offsets [R + 1] int32, block table [R, pages + 1] int32 (shuffled pages), and one bf16
    layer cache of page 16, 3 KV heads, head dim 64: physical [P, page, HKV, 2 * D] and the layer's
    logical view [P, HKV, page, 2 * D] (LBNHC)."""
    r = len(query_lens)
    qsl = torch.zeros(r + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(query_lens, 0)
    pages = [(int(x) + 15) // 16 for x in seq_lens]
    pool = torch.randperm(sum(pages) + 3, generator=g)
    block_table = torch.zeros(r, max(pages) + 1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages):
        block_table[i, :n] = pool[start : start + n].int()
        start += n
    phys = torch.randn(len(pool), 16, 3, 128, generator=g).to(torch.bfloat16)
    return qsl, block_table, phys, phys.permute(0, 2, 1, 3)


def check_reorder_threshold(cfg) -> None:
    """P15 on vLLM's own GPUModelRunner.calculate_reorder_batch_threshold, over the engine's builders:
    FlashInfer's native decode asks for 1; ddtree orders every request of at most 1 + verify width
    queries before longer ones."""

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    name = "model.layers.0.self_attn.attn"
    builder = TreeFlashInferMetadataBuilder(spec, [name], cfg, torch.device("cpu"))
    groups = [SimpleNamespace(get_metadata_builder=lambda: builder)]
    runner = SimpleNamespace(vllm_config=cfg, _attn_group_iterator=lambda: iter(groups))
    GPUModelRunner.calculate_reorder_batch_threshold(runner)
    assert builder.reorder_batch_threshold == 1
    assert runner.reorder_batch_threshold == 1 + cfg.speculative_config.num_speculative_tokens


def check_start_up_build(cfg) -> None:
    """P14's prebuild: one tree step planned with the builder's constants and run (masked, and causal on
    vLLM's own prefill wrapper), for every distinct kernel of the engine's layer groups, once each."""

    from vllm_ddtree.vllm_patches import cuda_toolkit_missing, prebuild_tree_attention

    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    name = "model.layers.0.self_attn.attn"  # the layer check_verify_step made
    builders = [TreeFlashInferMetadataBuilder(spec, [name], cfg, torch.device("cpu")) for _ in range(2)]
    for b in builders:
        b._ddtree_wrapper, b._prefill_wrapper = PlanRecorder(), PlanRecorder()
    stock = FlashInferMetadataBuilder(spec, [name], cfg, torch.device("cpu"))
    groups = [SimpleNamespace(metadata_builders=[b]) for b in (*builders, stock)]
    runner = SimpleNamespace(_attn_group_iterator=lambda: iter(groups))
    assert prebuild_tree_attention(runner) == 1  # two groups, one kernel: the same constants
    assert builders[1]._ddtree_wrapper.planned is None  # built once, not once per group
    causal = builders[0]._prefill_wrapper.planned  # the kernel of verify steps' prefill chunks, as vLLM plans it
    assert causal["causal"] is True and causal["custom_mask"] is None and builders[0]._prefill_wrapper.ran is not None
    assert causal["fixed_split_size"] == builders[0].prefill_fixed_split_size
    got = builders[0]._ddtree_wrapper.planned
    assert got["causal"] is False and got["custom_mask"].tolist() == [True, True, False, True, True, True]
    assert (got["num_qo_heads"], got["num_kv_heads"], got["head_dim_qk"], got["page_size"]) == (9, 3, 64, 16)
    assert got["q_data_type"] == torch.bfloat16 and got["paged_kv_last_page_len"].tolist() == [3]
    q, (k, v) = builders[0]._ddtree_wrapper.ran
    assert q.shape == (2, 9, 64) and q.dtype == torch.bfloat16
    assert k.shape == v.shape and k.shape in ((1, 16, 3, 64), (1, 3, 16, 64))
    # What the custom-mask prefill cannot run is refused at start-up, by name, as at a verify step
    # (not with an error from inside FlashInfer's sink or DCP wrappers).
    # A sliding window too: FlashInfer places a request's query row i at kv_len - qo_len + i, which for
    # a tree row deeper in the rows than in the tree would cut the window's first context tokens.
    for feature, value in (("has_sinks", True), ("window_left", 127)):
        refused = TreeFlashInferMetadataBuilder(spec, [name], cfg, torch.device("cpu"))
        setattr(refused, feature, value)
        try:
            refused.prebuild_tree_kernels()
        except NotImplementedError as e:
            assert "attention sinks, sliding-window attention" in str(e), e
        else:
            raise AssertionError(f"a builder with {feature}={value} prebuilt a tree kernel")
    # ... but only where trees are verified: the drafter's own layers are neither built nor refused
    drafter_group = SimpleNamespace(metadata_builders=[refused])
    drafter_runner = SimpleNamespace(_attn_group_iterator=lambda: iter([drafter_group]),
                                     drafter=SimpleNamespace(_draft_attn_layer_names={name}))
    assert prebuild_tree_attention(drafter_runner) == 0
    # A machine where FlashInfer cannot build the kernel (its error without nvcc): the engine stops at
    # start-up with what ddtree needs and FlashInfer's message, not at the first verify step.
    nvcc = "Could not find nvcc and default cuda_home='/usr/local/cuda' doesn't exist"

    class NoCompiler(PlanRecorder):
        def plan(self, **kwargs) -> None:
            raise RuntimeError(nvcc)

    failing = TreeFlashInferMetadataBuilder(spec, [name], cfg, torch.device("cpu"))
    failing._ddtree_wrapper, failing._prefill_wrapper = NoCompiler(), PlanRecorder()
    failing_runner = SimpleNamespace(_attn_group_iterator=lambda: iter([SimpleNamespace(metadata_builders=[failing])]))
    try:
        prebuild_tree_attention(failing_runner)
    except RuntimeError as e:
        said = str(e)
        assert "'ddtree'" in said and "nvcc on PATH or under CUDA_HOME" in said and nvcc in said, said
        assert "torch.bfloat16, head dim 64" in said and isinstance(e.__cause__, RuntimeError), said
        missing = cuda_toolkit_missing()  # the advice follows the toolkit found where the check runs
        assert (f"here it finds none ({missing}): install it" if missing else "FlashInfer's message says") in said
    else:
        raise AssertionError("a kernel FlashInfer could not build was not reported")


def check_cudagraph_modes(cfg) -> None:
    """vLLM's own resolution of CUDA-graph modes (CompilationConfig.resolve_cudagraph_mode_and_sizes, as
    GPUModelRunner._check_and_update_cudagraph_mode calls it) for a GPU engine asking for vLLM's default
    FULL_AND_PIECEWISE: with ddtree every step, the drafter's included, runs PIECEWISE graphs."""
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    tree = TreeFlashInferMetadataBuilder.get_cudagraph_support(cfg, spec)
    stock = FlashInferMetadataBuilder.get_cudagraph_support(cfg, spec)
    assert tree == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, tree

    def resolve(support, uniform_decode_query_len: int) -> CUDAGraphMode:
        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                               splitting_ops=list(CompilationConfig._attention_ops))
        return cc.resolve_cudagraph_mode_and_sizes(support, "FLASHINFER", uniform_decode_query_len)

    # ddtree's uniform decode is a full tree: 1 + verify width tokens per request
    width = cfg.speculative_config.num_speculative_tokens
    assert width == cfg.speculative_config.ddtree.verify_width > 1
    assert resolve(tree, 1 + width) == CUDAGraphMode.PIECEWISE
    # what downgrades it is a multi-token uniform decode with single-token support: the same support
    # keeps FULL decode graphs without speculation
    assert resolve(tree, 1) == CUDAGraphMode.FULL_AND_PIECEWISE
    assert resolve(stock, 1) == CUDAGraphMode.FULL_AND_PIECEWISE
    # Where the stock backend reports single-token support (FlashInfer's native decode: no TRT-LLM or
    # XQA decode kernel on the device, as here), vLLM's own chain of the same width is downgraded the
    # same way; where its XQA / trtllm-gen decode runs (UNIFORM_BATCH), the chain keeps FULL decode graphs.
    if stock == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE:
        assert resolve(stock, 1 + width) == CUDAGraphMode.PIECEWISE
    else:
        assert resolve(stock, 1 + width) == CUDAGraphMode.FULL_AND_PIECEWISE
    check_runner_cudagraph_dispatch(cfg, spec)


def check_runner_cudagraph_dispatch(cfg, spec) -> None:
    """P21 through the runner's own code: `GPUModelRunner._check_and_update_cudagraph_mode` (unbound, on
    the fields it reads) resolves the modes and fills vLLM's `CudagraphDispatcher`, which then dispatches
    steps as the runner's `_determine_batch_execution_and_padding` asks it. With P21 a step without
    trees (one token per request) replays a FULL decode graph and a tree step runs PIECEWISE; without
    it (vLLM's 1 + verify width) every step runs PIECEWISE."""
    import copy

    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ddtree.proposer import has_full_decode_graphs
    from vllm_ddtree.vllm_patches import full_decode_graphs_for_undrafted_steps

    width = cfg.speculative_config.num_speculative_tokens
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]

    def gpu_runner(p21: bool) -> SimpleNamespace:
        gpu = copy.copy(cfg)  # a GPU engine's compilation: vLLM's default mode and capture sizes
        gpu.compilation_config = CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
            splitting_ops=list(CompilationConfig._attention_ops), cudagraph_capture_sizes=list(sizes),
            max_cudagraph_capture_size=sizes[-1])
        runner = SimpleNamespace(vllm_config=gpu, compilation_config=gpu.compilation_config,
                                 uniform_decode_query_len=1 + width, cudagraph_dispatcher=CudagraphDispatcher(gpu),
                                 kv_cache_config=None, max_num_reqs=gpu.scheduler_config.max_num_seqs,
                                 speculative_config=None)  # (the drafter's keys: PIECEWISE either way)
        assert runner.cudagraph_dispatcher.uniform_decode_query_len == 1 + width  # vLLM's own, as in the runner
        if p21:
            full_decode_graphs_for_undrafted_steps(runner)
        GPUModelRunner._check_and_update_cudagraph_mode(runner, [{TreeFlashInferBackend}],
                                                        [SimpleNamespace(kv_cache_spec=spec)])
        return runner

    def dispatch(runner, query_lens: list[int]) -> tuple[CUDAGraphMode, int]:
        n, r = sum(query_lens), len(query_lens)
        uniform = GPUModelRunner._is_uniform_decode(max(query_lens), runner.uniform_decode_query_len, n, r)
        mode, desc = runner.cudagraph_dispatcher.dispatch(n, uniform_decode=uniform)
        return mode, desc.num_tokens

    undrafted, trees, full_trees = [1] * 5, [9, 4, 1, 6], [1 + width] * 3
    p21 = gpu_runner(True)
    assert p21.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert p21.compilation_config.cudagraph_capture_sizes == sizes  # not rounded to multiples of 1 + width
    assert has_full_decode_graphs(p21)
    assert dispatch(p21, undrafted) == (CUDAGraphMode.FULL, 8)  # padded to the next captured size
    seqs = p21.max_num_reqs  # FULL decode graphs up to one token for each of max_num_seqs requests
    assert dispatch(p21, [1] * (seqs - 1)) == (CUDAGraphMode.FULL, min(x for x in sizes if x >= seqs - 1))
    assert dispatch(p21, trees) == (CUDAGraphMode.PIECEWISE, 32)
    # a step whose trees all fill the width: a uniform batch to vLLM's chain, never a FULL graph here
    assert dispatch(p21, full_trees) == (CUDAGraphMode.PIECEWISE, min(x for x in sizes if x >= sum(full_trees)))
    stock = gpu_runner(False)  # the negative control: vLLM's length
    assert stock.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert not has_full_decode_graphs(stock)
    assert dispatch(stock, undrafted) == (CUDAGraphMode.PIECEWISE, 8)
    assert dispatch(stock, trees) == (CUDAGraphMode.PIECEWISE, 32)



def check_xqa_layout() -> None:
    """`xqa_spec_mask` without trees is vLLM's own XQA draft mask (what its FlashInfer backend packs for
    a chain's ragged or uniform speculative decode), bit for bit; the plan's keywords bind to FlashInfer's
    `xqa_batch_decode_with_kv_cache`."""
    from flashinfer.decode import xqa_batch_decode_with_kv_cache
    from vllm.v1.attention.backends.flashinfer import _make_xqa_draft_block_mask, _make_xqa_ragged_draft_block_mask

    for q_lens in ([3, 1, 7, 2], [33, 5], [65, 1, 64], [4, 4, 4]):
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
        seq_lens = torch.tensor(q_lens) + torch.arange(len(q_lens)) * 37  # any context before the new tokens
        for causal in (True, False):
            flags = torch.full((len(q_lens),), causal)
            ours = xqa_spec_mask(qsl, seq_lens, flags, max(q_lens), sum(q_lens))
            theirs = _make_xqa_ragged_draft_block_mask(q_lens, max(q_lens), causal, torch.device("cpu"))
            assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), (q_lens, causal)
            if len(set(q_lens)) == 1:
                uniform = _make_xqa_draft_block_mask(q_lens[0], causal, torch.device("cpu"))
                assert torch.equal(ours.view(torch.int16), uniform.repeat(len(q_lens), 1).view(torch.int16))
    plan = xqa_spec_plan(qsl, seq_lens, torch.zeros(3, 5, dtype=torch.int32), torch.ones(3, dtype=torch.bool), 4)
    inspect.signature(xqa_batch_decode_with_kv_cache).bind(
        query=None, kv_cache=None, workspace_buffer=None, bmm1_scale=1.0, bmm2_scale=1.0, kv_layout="NHD",
        **plan.run_kwargs(16))


def check_xqa_verify_step(cfg) -> None:
    """VLLM_DDTREE_XQA=1 where vLLM's builder decodes through XQA (forced here: no SM90): vLLM's own build of
    an all-decode verify step (two trees between single-token decodes: XQA's ragged path), its decode mask
    replaced by the trees', through vLLM's real FlashInferImpl.forward with the XQA call answered by a
    reader of XQA's documented contract; every query's output is its oracle attention. Without the
    variable the same step takes the custom-mask plan."""
    import os

    import vllm.v1.attention.backends.flashinfer as fi_backend
    from vllm.v1.attention.backends.flashinfer import FlashInferDecodeKernel, FlashInferTrtllmAPIDecode

    from vllm_ddtree.attention.flashinfer_tree import XQA_ENV

    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    name = "model.layers.0.self_attn.attn"
    builder = TreeFlashInferMetadataBuilder(spec, [name], cfg, torch.device("cpu"))
    width = cfg.speculative_config.num_speculative_tokens
    # What vLLM's builder sets on SM90 with XQA decode (no such GPU here).
    builder.use_xqa = builder.use_trtllm_decode_attention = True
    builder.flashinfer_trtllm_api_decode_kernel = FlashInferDecodeKernel.XQA
    builder.reorder_batch_threshold = 1 + width
    impl = cfg.compilation_config.static_forward_context[name].impl
    g = torch.Generator().manual_seed(5)
    trees = []
    for nodes, ctx in ((width - 3, 21), (5, 40)):
        lp, ids = topk_per_depth(torch.randn(1, 8, 12, generator=g) * 2, 6)
        trees.append(compile_tree(build_tree(lp, ids, nodes), torch.tensor([5]), torch.tensor([ctx])))
    rows = [int(t.num_rows[0]) for t in trees]
    # 0 decode (1 after 30), 1 tree (after 21), 2 decode (1 after 16), 3 tree (after 40)
    query_lens = torch.tensor([1, rows[0], 1, rows[1]])
    seq_lens = torch.tensor([30, 21, 16, 40]) + query_lens
    r, t = len(query_lens), int(query_lens.sum())
    qsl, block_table, phys, kv_cache = paged_layer(query_lens, seq_lens, g)
    n = max(rows)
    anc = torch.zeros(r, n, n, dtype=torch.bool)
    anc[1, : rows[0], : rows[0]] = trees[0].ancestors[0]
    anc[3, : rows[1], : rows[1]] = trees[1].ancestors[0]
    has_tree = torch.tensor([False, True, False, True])
    masks = TreeStepMasks(has_tree=has_tree, num_rows=torch.where(has_tree, query_lens, 0), ancestors=anc,
                          has_tree_cpu=has_tree)
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens.int(),
                                 num_reqs=r, num_actual_tokens=t, max_query_len=int(query_lens.max()),
                                 max_seq_len=int(seq_lens.max()), block_table_tensor=block_table,
                                 slot_mapping=torch.arange(t), causal=True, seq_lens_cpu_upper_bound=seq_lens.int())
    calls = []

    def xqa_reference(query, kv_cache, workspace_buffer, block_tables, seq_lens, out, q_len_per_req, mask,
                      q_cu_seq_lens, bmm1_scale, **_):
        """XQA's documented contract (flashinfer.xqa.xqa): request b's queries at q_cu_seq_lens[b]..[b + 1], its
        KV the first seq_lens[b] tokens of its pages; a row sees the context before the request's new tokens
        and new token j where bit j of its mask row (2 * ceil(q_len_per_req / 32) uint16 halves) is set."""
        calls.append(mask)
        k_cache, v_cache = kv_cache
        halves = mask.to(torch.int32) & 0xFFFF
        j = torch.arange(mask.shape[-1] * 16)
        bits = ((halves[..., j // 16] >> (j % 16)) & 1).bool()
        for b in range(len(seq_lens)):
            kv, lo, hi = int(seq_lens[b]), int(q_cu_seq_lens[b]), int(q_cu_seq_lens[b + 1])
            pos = torch.arange(kv)
            k = k_cache[block_tables[b, pos // 16].long(), pos % 16].float()
            v = v_cache[block_tables[b, pos // 16].long(), pos % 16].float()
            m = torch.ones(hi - lo, kv, dtype=torch.bool)
            m[:, kv - (hi - lo) :] = bits[lo:hi, : hi - lo]
            out[lo:hi] = attend(query[lo:hi].float(), k, v, m, bmm1_scale).to(out.dtype)
        return out

    os.environ[XQA_ENV] = "1"
    real = fi_backend.flashinfer_xqa_batch_decode_with_kv_cache
    fi_backend.flashinfer_xqa_batch_decode_with_kv_cache = xqa_reference
    workspace = fi_backend.trtllm_workspace_buffer
    fi_backend.trtllm_workspace_buffer = torch.zeros(16, dtype=torch.uint8)  # vLLM allocates it on CUDA
    set_step_tree_masks(masks)
    try:
        md = builder.build(0, cm)
        assert isinstance(md.decode, FlashInferTrtllmAPIDecode) and md.decode.kernel == FlashInferDecodeKernel.XQA
        assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (r, t, 0)
        # One query width whatever the trees (FlashInfer builds an XQA kernel per width): the decode bound.
        assert md.decode.q_cu_seq_lens.tolist() == qsl.tolist() and md.decode.q_len_per_req == 1 + width > max(rows)
        assert torch.equal(md.decode.mask, xqa_spec_mask(qsl, seq_lens, torch.ones(r, dtype=torch.bool), 1 + width, t,
                                                          masks))
        q = torch.randn(t, 9, 64, generator=g).to(torch.bfloat16)
        out = torch.full((t, 9, 64), float("nan"), dtype=torch.bfloat16)
        impl.forward(cfg.compilation_config.static_forward_context[name], q, None, None, kv_cache, md, out)
        assert len(calls) == 1 and calls[0] is md.decode.mask  # vLLM's impl handed XQA the trees' mask
        # Two trees of one size are a uniform batch to vLLM (its cached per-shape mask, no offsets): still
        # the ragged call at the one width, with the trees' mask.
        two = torch.tensor([0, rows[1], 2 * rows[1]], dtype=torch.int32)
        same = TreeStepMasks(torch.tensor([True, True]), torch.tensor([rows[1]] * 2), anc[[3, 3]],
                             has_tree_cpu=torch.tensor([True, True]))
        cm2 = CommonAttentionMetadata(query_start_loc=two, query_start_loc_cpu=two, seq_lens=seq_lens[[3, 3]].int(),
                                      num_reqs=2, num_actual_tokens=2 * rows[1], max_query_len=rows[1],
                                      max_seq_len=int(seq_lens[3]), block_table_tensor=block_table[[3, 3]],
                                      slot_mapping=torch.arange(2 * rows[1]), causal=True,
                                      seq_lens_cpu_upper_bound=seq_lens[[3, 3]].int())
        assert FlashInferMetadataBuilder.build(builder, 0, cm2).decode.q_cu_seq_lens is None  # vLLM's: uniform
        set_step_tree_masks(same)
        uniform = builder.build(0, cm2).decode
        assert uniform.q_len_per_req == 1 + width and uniform.q_cu_seq_lens.tolist() == two.tolist()
        assert torch.equal(uniform.mask, xqa_spec_mask(two, seq_lens[[3, 3]], torch.ones(2, dtype=torch.bool),
                                                       1 + width, 2 * rows[1], same))
        set_step_tree_masks(masks)
        del os.environ[XQA_ENV]
        builder._ddtree_wrapper, builder._prefill_wrapper = PlanRecorder(), PlanRecorder()
        plain = builder.build(0, cm)  # without the variable: the custom-mask plan, as before
        assert builder._ddtree_wrapper.planned["custom_mask"] is not None and not isinstance(
            plain.decode, FlashInferTrtllmAPIDecode)
    finally:
        os.environ.pop(XQA_ENV, None)
        fi_backend.flashinfer_xqa_batch_decode_with_kv_cache = real
        fi_backend.trtllm_workspace_buffer = workspace
        set_step_tree_masks(None)
    for i in range(r):
        kv = int(seq_lens[i])
        pos = torch.arange(kv)
        tokens = phys[block_table[i, pos // 16].long(), pos % 16].float()
        nq = int(query_lens[i])
        causal = pos[None, :] <= kv - nq + torch.arange(nq)[:, None]
        mask = dense_attention_mask(trees[(i - 1) // 2], kv)[0] if i in (1, 3) else causal
        want = attend(q[qsl[i] : qsl[i + 1]].float(), tokens[..., :64], tokens[..., 64:], mask, 0.125)
        err = float((out[qsl[i] : qsl[i + 1]].float() - want).abs().max())
        assert err < 2e-2, (i, err)
        if i in (1, 3):  # the tree mask matters for these rows
            control = attend(q[qsl[i] : qsl[i + 1]].float(), tokens[..., :64], tokens[..., 64:], causal, 0.125)
            assert float((control - want).abs().max()) > 0.1


if __name__ == "__main__":
    main()

