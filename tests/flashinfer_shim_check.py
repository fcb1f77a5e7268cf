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
from vllm_ddtree.attention.tree_mask import TreeStepMasks, flashinfer_paged_plan, set_step_tree_masks
from vllm_ddtree.models.target import prepare_target
from vllm_ddtree.reference.pair import drafter_dir
from vllm_ddtree.tree import build_tree, compile_tree, topk_per_depth
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

    def run(self, *args, **kwargs):
        RUN.bind(self, *args, **kwargs)
        self.ran = args


def main() -> None:
    assert issubclass(TreeFlashInferBackend, FlashInferBackend)
    assert TreeFlashInferBackend.get_name() == "FLASHINFER"
    assert TreeFlashInferBackend.get_builder_cls() is TreeFlashInferMetadataBuilder
    assert issubclass(TreeFlashInferMetadataBuilder, FlashInferMetadataBuilder)
    assert gpu_tree_attention_backend(None) == AttentionBackendEnum.FLASHINFER

    cfg = EngineArgs(model=str(prepare_target()), dtype="bfloat16", max_model_len=512,
                     speculative_config={"method": "ddtree", "model": str(drafter_dir()), "tree_budget": 8}
                     ).create_engine_config()
    cfg.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves before building metadata
    with set_current_vllm_config(cfg):  # as in the engine, where layers and builders are made and used
        check_verify_step(cfg)
        check_start_up_build(cfg)
        check_cudagraph_modes(cfg)
    print("shim ok", flashinfer.__version__)


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
                          ancestors=anc)
    t = int(qsl[-1])
    # The device copy of seq_lens is on "meta": the builder must use the runner's host copy (a read
    # of the device copy, a GPU sync, would raise here).
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens.int().to("meta"),
                                 num_reqs=3, num_actual_tokens=t, max_query_len=int(query_lens.max()),
                                 max_seq_len=int(seq_lens.max()), block_table_tensor=block_table,
                                 slot_mapping=torch.arange(t), causal=True, seq_lens_cpu_upper_bound=seq_lens.int())
    recorder = PlanRecorder()
    builder._ddtree_wrapper = recorder
    set_step_tree_masks(masks)
    try:
        md = builder.build(0, cm)
    finally:
        set_step_tree_masks(None)

    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills, md.num_prefill_tokens) == (0, 0, 3, t)
    assert md.causal is False and md.decode is None and md.prefill.wrapper is recorder
    got = recorder.planned
    assert got["causal"] is False and got["page_size"] == 16 and got["head_dim_qk"] == 64
    assert (got["num_qo_heads"], got["num_kv_heads"], got["sm_scale"]) == (9, 3, 0.125)
    assert got["q_data_type"] == torch.bfloat16 and got["kv_data_type"] == torch.bfloat16
    assert got["paged_kv_indices"].tolist() == [7, 3, 9, 12]  # each request's pages, in order
    assert got["paged_kv_last_page_len"].tolist() == [11, 13 + rows - 16, 9]
    want = flashinfer_paged_plan(qsl, seq_lens, block_table, 16, True, masks)
    assert torch.equal(got["custom_mask"], want.custom_mask)
    # FlashInfer finds each request's mask block from the page table; it must land on ours.
    offsets = _compute_page_mask_indptr(got["qo_indptr"], got["paged_kv_indptr"], got["paged_kv_last_page_len"], 16)
    assert offsets.tolist() == [0, *torch.cumsum(query_lens * seq_lens, 0).tolist()]
    assert int(offsets[-1]) == got["custom_mask"].numel()


def check_start_up_build(cfg) -> None:
    """P14's prebuild: one tree step planned with the builder's constants and run, for every distinct
    kernel of the engine's layer groups, once each."""
    from types import SimpleNamespace

    from vllm_ddtree.vllm_patches import prebuild_tree_attention

    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    name = "model.layers.0.self_attn.attn"  # the layer check_verify_step made
    builders = [TreeFlashInferMetadataBuilder(spec, [name], cfg, torch.device("cpu")) for _ in range(2)]
    for b in builders:
        b._ddtree_wrapper = PlanRecorder()
    stock = FlashInferMetadataBuilder(spec, [name], cfg, torch.device("cpu"))
    groups = [SimpleNamespace(metadata_builders=[b]) for b in (*builders, stock)]
    runner = SimpleNamespace(_attn_group_iterator=lambda: iter(groups))
    assert prebuild_tree_attention(runner) == 1  # two groups, one kernel: the same constants
    assert builders[1]._ddtree_wrapper.planned is None  # built once, not once per group
    got = builders[0]._ddtree_wrapper.planned
    assert got["causal"] is False and got["custom_mask"].tolist() == [True, True, False, True, True, True]
    assert (got["num_qo_heads"], got["num_kv_heads"], got["head_dim_qk"], got["page_size"]) == (9, 3, 64, 16)
    assert got["q_data_type"] == torch.bfloat16 and got["paged_kv_last_page_len"].tolist() == [3]
    q, (k, v) = builders[0]._ddtree_wrapper.ran
    assert q.shape == (2, 9, 64) and q.dtype == torch.bfloat16
    assert k.shape == v.shape and k.shape in ((1, 16, 3, 64), (1, 3, 16, 64))


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


if __name__ == "__main__":
    main()
