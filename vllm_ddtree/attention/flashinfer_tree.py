"""GPU tree attention: vLLM's FlashInfer backend with a per-request custom mask on verify steps.

Deliberately thin: FlashInfer's kernels need CUDA, so only the metadata side is exercised here.
Everything it hands the kernel — page table and mask — comes from
:func:`vllm_ddtree.attention.tree_mask.flashinfer_paged_plan`, pure PyTorch, tested on the CPU
against an independent attention oracle; the builder itself is tested on the CPU with vLLM's real
FlashInfer backend and only FlashInfer's CUDA wrapper replaced (``tests/test_flashinfer_tree.py``).

What it replaces, and why (vLLM 0.32, v1/attention/backends/flashinfer.py):
- ``FlashInferMetadataBuilder.build`` (:1392): on a verify step (the model runner set tree masks
  for these layers through ``tree_mask.set_step_tree_masks``) the requests up to the last tree go
  through a paged prefill ``plan(..., custom_mask=...)`` of our own (the decode wrapper and the
  XQA/trtllm-gen kernels take no per-request tree mask) and the causal requests after it — the
  prefill chunks, which P15's batch order puts there — through vLLM's own causal prefill plan
  (``tree_mask.flashinfer_split_plan``). ``FlashInferImpl.forward`` runs a step's first
  ``num_decode_tokens`` queries on the metadata's ``decode`` wrapper and the rest on its ``prefill``
  wrapper, and a prefill wrapper's ``run()`` takes the decode call's arguments: the masked plan is
  handed over as the "decode" part, so no forward is replaced. Other steps, and the DFlash drafter's
  layers, keep the stock build.
- ``FlashInferMetadataBuilder.get_cudagraph_support`` (:1036): capped at single-token decode. A
  step whose trees all fill the budget is a uniform batch of 1 + budget tokens, which the stock
  backend would replay from a FULL CUDA graph captured without the mask; ``plan()`` with a custom
  mask cannot be captured either. A ddtree runner's uniform decode is one token per request (P21,
  ``vllm_patches.full_decode_graphs_for_undrafted_steps``), so vLLM's mode resolution keeps
  FULL_AND_PIECEWISE: steps without trees replay FULL decode graphs through the stock build, and
  tree steps (never uniform at that length) and the drafter run PIECEWISE, attention eagerly
  between the graphs (``tests/flashinfer_shim_check.py`` runs the resolution and the dispatch).
  Where the stock backend reports single-token support (its native decode: what vLLM 0.32 reports
  for this config), vLLM's DFlash chain resolves PIECEWISE for every step.
- Start-up (``prebuild_tree_kernels``, called after vLLM's warm-up by P14): one dummy verify step is
  planned and run, masked and causal, so FlashInfer's JIT builds of both kernels happen before serving.
- Opt-in, ``VLLM_DDTREE_XQA=1`` where vLLM's builder runs its spec decodes through FlashInfer's XQA
  (SM90/SM12x): the stock build is kept whole — tree requests are decodes at its reorder threshold of
  1 + verify width, XQA's ragged path, the causal plan for longer chunks — and only the packed mask of
  its decode rows is replaced by the trees' (:func:`vllm_ddtree.attention.tree_mask.xqa_spec_mask`,
  causal rows as vLLM packs them), always as XQA's ragged call at one query width (the decode bound),
  so FlashInfer builds one XQA kernel, not one per step's longest tree: no ``plan()``, no host read.
  Off by default until the GPU check's ``a.xqa`` has shown the kernel honours a tree mask (at a width
  above the longest request, as here); CUDA graphs stay capped as above.
"""

from __future__ import annotations

import os

import torch
from vllm.utils.gpu_sync_debug import gpu_sync_allowed
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.flashinfer import (
    FIDecode,
    FIPrefill,
    FlashInferBackend,
    FlashInferMetadata,
    FlashInferMetadataBuilder,
    FlashInferTrtllmAPIDecode,
)
from vllm.v1.attention.backends.utils import get_flashinfer_layout_string

from vllm_ddtree.attention.tree_mask import (
    TreeStepMasks,
    flashinfer_split_plan,
    flashinfer_tree_wrapper,
    plan_flashinfer_causal_step,
    plan_flashinfer_tree_step,
    prebuild_tree_kernels,
    step_tree_masks_for,
    xqa_spec_mask,
)

__all__ = ["TreeFlashInferBackend", "TreeFlashInferMetadataBuilder", "XQA_ENV"]

#: Set to 1 to verify trees through vLLM's XQA speculative decode where its builder uses XQA (see above).
XQA_ENV = "VLLM_DDTREE_XQA"


class TreeFlashInferMetadataBuilder(FlashInferMetadataBuilder):
    """FlashInfer's builder; verify steps get a custom-mask plan for their trees, a causal one for their
    prefill chunks."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        stock = super().get_cudagraph_support(vllm_config, kv_cache_spec)
        return min(stock, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, key=lambda s: s.value)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlashInferMetadata:
        cm = common_attn_metadata
        r = cm.num_reqs
        tree = step_tree_masks_for(self.layer_names, r)
        if tree is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        self._check_tree_support()
        if os.environ.get(XQA_ENV) == "1" and self.use_xqa and tree.has_tree_cpu is not None:
            md = self._build_xqa(common_prefix_len, cm, tree, fast_build)
            if md is not None:
                return md
        # plan() needs seq_lens on the host. The runner's host copy is exact here: ddtree never runs
        # with async scheduling, the one case where it is only an upper bound. (The stock builder
        # reads the device copy under gpu_sync_allowed when speculating; so do we without it.)
        if cm.seq_lens_cpu_upper_bound is not None:
            seq_lens_cpu = cm.seq_lens_cpu_upper_bound[:r]
        else:
            with gpu_sync_allowed():
                seq_lens_cpu = cm.seq_lens[:r].cpu()
        split = flashinfer_split_plan(cm.query_start_loc_cpu, seq_lens_cpu, cm.block_table_tensor[:r],
                                      self.page_size, cm.causal, tree)
        constants = self.tree_kernel_constants()
        constants.pop("kv_layout")
        tree_part = causal_part = None
        if split.tree is not None:
            wrapper = self._tree_wrapper()
            # FlashInfer's plan() packs the bool mask with segment_packbits, which copies the mask's
            # offsets from pageable memory and reads the packed length back (`.item()`): two waits for
            # the device, on work this step's input preparation has just queued. Allowed, as vLLM
            # allows its own builder's host reads (VLLM_GPU_SYNC_CHECK would report them).
            with gpu_sync_allowed():
                plan_flashinfer_tree_step(wrapper, split.tree, **constants)  # as the stock build passes them
            tree_part = FIDecode(wrapper=wrapper)
        if split.causal is not None:
            # the stock causal wrapper, planned as the stock build plans it (FlashInfer picks its kernel)
            wrapper = self._get_prefill_wrapper(causal=True)
            plan_flashinfer_causal_step(wrapper, split.causal, **self._causal_plan_options(), **constants)
            causal_part = FIPrefill(wrapper=wrapper)
        # The impl runs its "decode" wrapper on the first num_decode_tokens queries and its prefill
        # wrapper on the rest; any prefill wrapper's run() takes the decode call's arguments.
        return FlashInferMetadata(
            kv_cache_layout=self.kv_cache_layout,
            num_actual_tokens=cm.num_actual_tokens,
            slot_mapping=cm.slot_mapping,
            q_data_type_prefill=self.q_data_type_prefill,
            q_data_type_decode=self.q_data_type_prefill,  # the tree plan's query type
            num_decodes=split.num_tree_reqs,
            num_decode_tokens=split.num_tree_tokens,
            num_prefills=r - split.num_tree_reqs,
            num_prefill_tokens=cm.num_actual_tokens - split.num_tree_tokens,
            causal=True,  # the impl checks this against the prefill wrapper's plan
            prefill=causal_part,
            decode=tree_part,
        )

    def _build_xqa(self, common_prefix_len: int, cm: CommonAttentionMetadata, tree: TreeStepMasks,
                   fast_build: bool) -> FlashInferMetadata | None:
        """vLLM's own build of the step (its tree requests XQA decodes), with the decode rows' packed
        mask replaced by the trees'; None where a tree fell outside the decodes (then the custom-mask path)."""
        md = super().build(common_prefix_len, cm, fast_build)
        nd = md.num_decodes
        if bool(tree.has_tree_cpu[nd:].any()):
            return None
        decode = md.decode
        if not isinstance(decode, FlashInferTrtllmAPIDecode):
            return None
        if decode.mask is None:  # one query per request: every tree is its root alone, causal is exact
            return md
        # FlashInfer builds an XQA kernel per query width (q_len_per_req): vLLM passes the step's longest
        # decode, which for trees changes from step to step, each new width a JIT build while serving. So
        # always the ragged call at one width, the decode bound (1 + verify width), and a new mask tensor:
        # vLLM's cached uniform buffer stays causal for the steps it captures.
        width = max(self.reorder_batch_threshold, decode.q_len_per_req)
        causal = torch.ones(nd, dtype=torch.bool, device=cm.query_start_loc.device)
        sub = TreeStepMasks(tree.has_tree[:nd], tree.num_rows[:nd], tree.ancestors[:nd])
        decode.q_len_per_req = width
        decode.q_cu_seq_lens = cm.query_start_loc[: nd + 1]
        decode.mask = xqa_spec_mask(decode.q_cu_seq_lens, cm.seq_lens[:nd], causal, width, md.num_decode_tokens, sub)
        return md

    def _check_tree_support(self) -> None:
        """Refuse what FlashInfer's custom-mask prefill cannot run here, at start-up (`prebuild_tree_kernels`)
        and at any verify step, rather than with an error from inside FlashInfer or a wrong output.

        A sliding window is refused: FlashInfer places query row i of a request at position
        kv_len - qo_len + i, so a tree row at depth d < i + 1 would lose the window's first i + 1 - d
        context tokens, which the target alone attends."""
        if self.use_dcp or self.has_sinks or self.is_kvcache_nvfp4 or self.window_left >= 0:
            raise NotImplementedError(
                "speculative method 'ddtree' verifies draft trees with FlashInfer's custom-mask prefill, which "
                "vLLM's FlashInfer backend does not offer with decode context parallelism, attention sinks, "
                "sliding-window attention or an NVFP4 KV cache; turn those off or use another speculative method"
            )

    def tree_kernel_constants(self) -> dict:
        """This layer group's constants of `plan_flashinfer_tree_step` (as `build` passes them) and its
        cache layout: what selects FlashInfer's custom-mask kernel."""
        return dict(num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    page_size=self.page_size, sm_scale=self.sm_scale, window_left=self.window_left,
                    logits_soft_cap=self.logits_soft_cap, q_data_type=self.q_data_type_prefill,
                    kv_data_type=self.kv_cache_dtype, o_data_type=self.model_config.dtype,
                    kv_layout=get_flashinfer_layout_string(self.kv_cache_layout))

    def prebuild_tree_kernels(self) -> None:
        """FlashInfer's JIT build of this layer group's custom-mask kernel, and of the causal kernel its
        verify steps' prefill chunks run, at start-up instead of on the first verify step
        (`tree_mask.prebuild_tree_kernels`)."""
        self._check_tree_support()
        prebuild_tree_kernels(self._tree_wrapper(), device=self.device, causal_wrapper=self._get_prefill_wrapper(causal=True),
                              causal_options=self._causal_plan_options(), **self.tree_kernel_constants())

    def _causal_plan_options(self) -> dict:
        """The split-KV options vLLM's own build gives its causal prefill plan (flashinfer.py:1708)."""
        return dict(fixed_split_size=self.prefill_fixed_split_size, disable_split_kv=self.disable_split_kv)

    def _tree_wrapper(self):
        """A prefill wrapper of our own: the stock causal and DFlash (non-causal) ones stay planned."""
        wrapper = getattr(self, "_ddtree_wrapper", None)
        if wrapper is None:
            wrapper = flashinfer_tree_wrapper(self._get_workspace_buffer(),
                                              get_flashinfer_layout_string(self.kv_cache_layout))
            self._ddtree_wrapper = wrapper
        return wrapper


class TreeFlashInferBackend(FlashInferBackend):
    """vLLM's FlashInfer backend with the tree-aware builder (named FLASHINFER, as it is one)."""

    @staticmethod
    def get_builder_cls() -> type[TreeFlashInferMetadataBuilder]:
        return TreeFlashInferMetadataBuilder
