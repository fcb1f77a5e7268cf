"""GPU tree attention: vLLM's FlashInfer backend with a per-request custom mask on verify steps.

Deliberately thin: FlashInfer's kernels need CUDA, so only the metadata side is exercised here.
Everything it hands the kernel — page table and mask — comes from
:func:`vllm_ddtree.attention.tree_mask.flashinfer_paged_plan`, pure PyTorch, tested on the CPU
against an independent attention oracle; the builder itself is tested on the CPU with vLLM's real
FlashInfer backend and only FlashInfer's CUDA wrapper replaced (``tests/test_flashinfer_tree.py``).

What it replaces, and why (vLLM 0.32, v1/attention/backends/flashinfer.py):
- ``FlashInferMetadataBuilder.build`` (:1392): on a verify step (the model runner set tree masks
  for these layers through ``tree_mask.set_step_tree_masks``) every request of the step — trees,
  prefill chunks and plain decodes alike — goes through one paged prefill ``plan(...,
  custom_mask=...)`` (the decode wrapper and the XQA/trtllm-gen kernels take no per-request tree
  mask). Other steps, and the DFlash drafter's layers, keep the stock build.
- ``FlashInferMetadataBuilder.get_cudagraph_support`` (:1036): capped at single-token decode. A
  step whose trees all fill the budget is a uniform batch of 1 + budget tokens, which the stock
  backend would replay from a FULL CUDA graph captured without the mask; ``plan()`` with a custom
  mask cannot be captured either. vLLM's mode resolution then turns FULL_AND_PIECEWISE into
  PIECEWISE for the whole engine, the drafter included (a uniform decode of 1 + verify width tokens
  with single-token support; ``tests/flashinfer_shim_check.py`` runs it): attention runs eagerly
  between piecewise graphs on every step. Where the stock backend itself reports single-token support
  (its native decode: what vLLM 0.32 reports for this config), vLLM's DFlash chain resolves the same.
- Start-up (``prebuild_tree_kernels``, called after vLLM's warm-up by P14): one dummy verify step is
  planned and run, so FlashInfer's JIT build of the custom-mask kernel happens before serving.
"""

from __future__ import annotations

from vllm.utils.gpu_sync_debug import gpu_sync_allowed
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.flashinfer import (
    FIPrefill,
    FlashInferBackend,
    FlashInferMetadata,
    FlashInferMetadataBuilder,
)
from vllm.v1.attention.backends.utils import get_flashinfer_layout_string

from vllm_ddtree.attention.tree_mask import (
    flashinfer_paged_plan,
    flashinfer_tree_wrapper,
    plan_flashinfer_tree_step,
    prebuild_tree_kernels,
    step_tree_masks_for,
)

__all__ = ["TreeFlashInferBackend", "TreeFlashInferMetadataBuilder"]


class TreeFlashInferMetadataBuilder(FlashInferMetadataBuilder):
    """FlashInfer's builder; verify steps get one custom-mask prefill plan for the whole batch."""

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
        if self.use_dcp or self.has_sinks or self.is_kvcache_nvfp4:
            raise NotImplementedError(
                "speculative method 'ddtree' verifies draft trees with FlashInfer's custom-mask prefill, which "
                "vLLM's FlashInfer backend does not offer with decode context parallelism, attention sinks or an "
                "NVFP4 KV cache; turn those off or use another speculative method"
            )
        # plan() needs seq_lens on the host. The runner's host copy is exact here: ddtree never runs
        # with async scheduling, the one case where it is only an upper bound. (The stock builder
        # reads the device copy under gpu_sync_allowed when speculating; so do we without it.)
        if cm.seq_lens_cpu_upper_bound is not None:
            seq_lens_cpu = cm.seq_lens_cpu_upper_bound[:r]
        else:
            with gpu_sync_allowed():
                seq_lens_cpu = cm.seq_lens[:r].cpu()
        plan = flashinfer_paged_plan(cm.query_start_loc_cpu, seq_lens_cpu, cm.block_table_tensor[:r],
                                     self.page_size, cm.causal, tree)
        wrapper = self._tree_wrapper()
        plan_flashinfer_tree_step(  # the layer group's constants as the stock build passes them
            wrapper, plan, num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, page_size=self.page_size, sm_scale=self.sm_scale,
            window_left=self.window_left, logits_soft_cap=self.logits_soft_cap,
            q_data_type=self.q_data_type_prefill, kv_data_type=self.kv_cache_dtype,
            o_data_type=self.model_config.dtype,
        )
        return FlashInferMetadata(
            kv_cache_layout=self.kv_cache_layout,
            num_actual_tokens=cm.num_actual_tokens,
            slot_mapping=cm.slot_mapping,
            q_data_type_prefill=self.q_data_type_prefill,
            q_data_type_decode=self.q_data_type_decode,
            num_decodes=0,
            num_decode_tokens=0,
            num_prefills=r,
            num_prefill_tokens=cm.num_actual_tokens,
            causal=False,  # the impl checks this against the wrapper's plan (custom mask: causal=False)
            prefill=FIPrefill(wrapper=wrapper),
            decode=None,
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
        """FlashInfer's JIT build of this layer group's custom-mask kernel, at start-up instead of on
        the first verify step (`tree_mask.prebuild_tree_kernels`)."""
        prebuild_tree_kernels(self._tree_wrapper(), device=self.device, **self.tree_kernel_constants())

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
