"""ddtree's drafting side inside vLLM's V1 model runner: the tree proposer (vllm_patches P10).

`DDTreeProposer.propose` runs after the previous step's sampling: vLLM's own DFlash forward
([bonus, MASK x W] against the accepted path's hidden states), then — instead of the argmax per mask
row — top-K per depth, the step's device function `plan_trees` (the build with optional n-gram
rescoring, the automatic budget, the lookup path) and the flattened tree tokens per request,
returned as a ragged list (the scheduler's draft lists). The trees stay with the proposer for the
verify step (`vllm_ddtree.verify`).
"""

from __future__ import annotations

import copy
import itertools
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vllm_ddtree.tree import (
    AutoBudget,
    CostModel,
    DraftTree,
    HostTokens,
    HostTrees,
    LookupCalibration,
    ModelShape,
    NGramModel,
    TokenHistory,
    SpeculationGate,
    StepGraphs,
    capture_width,
    draft_trees,
    get_profile,
    plan_trees,
    plan_trees_with_lookup,
    head_topk,
    to_device,
    tree_to_host,
)

from vllm.logger import init_logger
from vllm.utils.gpu_sync_debug import gpu_sync_allowed
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.config import VOCAB_SUBSET_NEEDS_PLAIN_HEAD
from vllm_ddtree.tree import constants
from vllm_ddtree.tree.lookup import LOOKUP_WINDOW
from vllm_ddtree.drafter.io import load_draft_vocab

logger = init_logger("vllm.ddtree")  # under "vllm" so vLLM's log configuration applies


@dataclass
class RequestTree:
    """The tree proposed for one request: flattened best-first, parent before child."""

    tokens: list[int]
    parents: list[int]  # -1: child of the root
    depths: list[int]
    scores: list[float] | None = None  # prefix scores (automatic budget only: its calibration)


@dataclass
class ProposedTrees:
    """The last propose's trees, padded to B nodes, for the verify step: on the host and on the device.

    `prepare_tree_step` looks a scheduled request up by id (`row_of`), checks on the host that the
    scheduler kept a prefix of its tree (the host tensors are those of the one host copy the step
    makes, `tree_to_host`, so reading them costs nothing), and cuts its rows from `on_device` to the
    scheduler's count there (`tree.scheduled_rows`): no per-request Python, no rebuild from lists.
    """

    row_of: dict[str, int]  # request id -> row
    tokens: Tensor  # [R, B] int64, 0 past a request's nodes
    parents: Tensor  # [R, B] int64, -1 for children of the root and past the nodes
    depths: Tensor  # [R, B] int64, 0 past the nodes
    scores: Tensor | None  # [R, B] float32 prefix scores (automatic budget only), -inf past the nodes
    # float64 [R, >= 3B] on the drafter's device: B columns each of tokens, parents, depths, then
    # scores where `scores` is not None (`HostTrees.on_device`)
    on_device: Tensor | None = None

    @property
    def nodes(self) -> int:
        """B, the columns of each field."""
        return self.tokens.shape[1]

    def device_block(self, device: torch.device) -> Tensor:
        """`on_device`, or the host fields packed as it is (trees made from lists) on `device`."""
        if self.on_device is not None:
            return self.on_device
        fields = [self.tokens, self.parents, self.depths] + ([] if self.scores is None else [self.scores])
        return to_device(torch.cat([f.double() for f in fields], dim=1), device)

    @classmethod
    def from_requests(cls, trees: dict[str, RequestTree]) -> "ProposedTrees":
        """The padded form of per-request trees (tests, and any caller holding lists)."""
        width = max((len(t.tokens) for t in trees.values()), default=0)
        with_scores = all(t.scores is not None for t in trees.values()) and bool(trees)

        def pad(rows: list[list], fill) -> list[list]:
            return [row + [fill] * (width - len(row)) for row in rows]

        ts = list(trees.values())
        return cls(
            row_of={rid: i for i, rid in enumerate(trees)},
            tokens=torch.tensor(pad([t.tokens for t in ts], 0), dtype=torch.int64).view(len(ts), width),
            parents=torch.tensor(pad([t.parents for t in ts], -1), dtype=torch.int64).view(len(ts), width),
            depths=torch.tensor(pad([t.depths for t in ts], 0), dtype=torch.int64).view(len(ts), width),
            scores=(torch.tensor(pad([t.scores for t in ts], -float("inf")), dtype=torch.float32).view(len(ts), width)
                    if with_scores else None),
        )


NO_TREES = ProposedTrees({}, *(torch.zeros(0, 0, dtype=torch.int64) for _ in range(3)), None)

# The proposer's per-request count of tokens taken in (`_seen`) when the request's last step was
# taken in on the device: the n-gram tables and the token history hold everything the host batch
# will hold at its next step. _NOT_MET: a request of the batch with no count yet (not taken in).
_COUNTED_ON_DEVICE = -1
_NOT_MET = -2

#: Weight dtypes of an LM head whose rows the draft vocabulary can gather (`_gather_vocab_head`).
PLAIN_HEAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class DepthCap:
    """How many depths the next step drafts: twice the deepest node of this step's trees (at least
    `floor`, at most the drafter's width `width`).

    The drafter's LM head (a 49152 x H matmul per depth for SmolLM2) and each build iteration cost
    per depth, and a tree of B nodes may in principle reach depth B — but its realised depth is what
    the drafter's confidence allows (mean 1.3 / 1.6 / 2.2 for the toy drafter at B = 4 / 8 / 32,
    `benchmarks/results/vllm_e2e_depth_cap.json`, which also has tau with the cap). A cap never
    changes the output (verification decides every token); it can only hide a node deeper than the
    cap for one step: a tree that reaches the cap doubles it for the next step.
    """

    width: int
    floor: int = 2
    depth: int = field(init=False)  # the full width until the first trees

    def __post_init__(self) -> None:
        self.depth = self.width

    def observe(self, deepest: int) -> None:
        """The deepest kept node of this step's trees (a host int)."""
        self.depth = min(self.width, max(self.floor, 2 * deepest))


@dataclass
class DDTreeStats:
    """Verify-step statistics: what the budget controller chose and what was accepted.

    Accumulated as tensors on the step's device (no host sync per step); logged every `interval`
    seconds through vLLM's logger (like its own stat logger) and readable at the end of a run
    (`summary()`), e.g. by benchmarks.
    """

    interval: float = 10.0
    totals: Tensor | None = None  # [4]: request-steps with a tree, verify rows, sum of tree depths, emitted tokens
    gate: SpeculationGate | None = None  # the automatic budget's gate: its drafted/undrafted steps join the log
    request_steps: int = 0  # request-steps verified, with a tree or not (a host count: the root rows and bonus tokens in `totals`)
    _last_log: float = field(default_factory=time.monotonic)
    _logged: tuple = (0, 0, 0, 0)
    _gate_logged: tuple = (0, 0)

    def record(self, sums: Tensor, requests: int) -> None:
        """sums [4]: the step's requests with a tree, verify rows (roots included), deepest node depths
        and emitted tokens (`tree.VerifiedStep.sums`); requests: the step's requests (a host count:
        each emits its accepted nodes and one bonus, and has one root row)."""
        self.totals = sums.clone() if self.totals is None else self.totals + sums
        self.request_steps += requests
        now = time.monotonic()
        if now - self._last_log >= self.interval:
            s0, n0, d0, a0 = self._logged
            with gpu_sync_allowed():  # deliberate: once per log interval, not per step
                steps, nodes_, depth, acc = self._read()
            ds = max(steps - s0, 1)
            gated = ""
            if self.gate is not None:  # how many decode steps the gate let draft, since the last line
                g0, u0 = self._gate_logged
                drafted, undrafted = self.gate.drafted - g0, self.gate.undrafted - u0
                gated = f"; speculation gate: {drafted} of {drafted + undrafted} steps drafted"
                self._gate_logged = (self.gate.drafted, self.gate.undrafted)
            logger.info(
                "ddtree: %d tree verifications, mean tree %.1f nodes, mean depth %.2f, "
                "mean acceptance length %.2f (bonus included)%s",
                steps - s0, (nodes_ - n0) / ds, (depth - d0) / ds, 1 + (acc - a0) / ds, gated,
            )
            self._last_log, self._logged = now, (steps, nodes_, depth, acc)

    def _read(self) -> tuple[float, float, float, float]:
        """The totals on the host: request-steps with a tree, nodes verified, depths, accepted."""
        if self.totals is None:
            return 0, 0, 0, 0
        steps, rows, depth, emitted = self.totals.tolist()
        return steps, rows - self.request_steps, depth, emitted - self.request_steps

    def summary(self) -> dict:
        steps, nodes, depth, acc = self._read()
        s = max(steps, 1)
        return {"tree_verifications": int(steps), "mean_tree_nodes": nodes / s,
                "mean_tree_depth": depth / s, "mean_acceptance_length": 1 + acc / s}


def has_full_decode_graphs(runner) -> bool:
    """Whether vLLM's dispatcher holds FULL graphs for uniform decodes (P21: a ddtree runner's undrafted
    steps, one token per request, replay them). Never on a CPU, where vLLM captures no graphs."""
    from vllm.config import CUDAGraphMode

    dispatcher = getattr(runner, "cudagraph_dispatcher", None)
    keys = getattr(dispatcher, "cudagraph_keys", {}).get(CUDAGraphMode.FULL, ())
    return any(key.uniform for key in keys)


def _present_as_dflash(vllm_config, width: int):
    """A shallow copy of the config whose speculative config reads as vLLM's DFlash with W tokens.

    DFlashProposer asserts method == "dflash" and sizes its buffers from num_speculative_tokens;
    ddtree's num_speculative_tokens is the verify width (tree budget), the drafter's is W.
    """
    spec = copy.copy(vllm_config.speculative_config)
    object.__setattr__(spec, "method", "dflash")
    object.__setattr__(spec, "num_speculative_tokens", width)
    cfg = copy.copy(vllm_config)
    object.__setattr__(cfg, "speculative_config", spec)
    return cfg


def step_graphs_from_env(device: torch.device) -> StepGraphs | None:
    """`VLLM_DDTREE_STEP_GRAPHS`: unset or "1" captures the tree step (`plan_trees`) and the verify
    side's walk (`verify_trees`) in CUDA graphs on a CUDA device (nothing elsewhere); "0": eager;
    "trace" uses `make_fx` traces instead (a CPU check of the same path). On by default: eagerly the
    step's few hundred small ops keep the GPU waiting on the host (on an H200, 3.4-8.4 ms per step
    eager against 0.7-1.2 ms replayed for the tree step, beside a 10 ms Qwen3-8B verify forward), and
    a capture that fails turns them off (eager, with a warning)."""
    value = os.environ.get("VLLM_DDTREE_STEP_GRAPHS", "1").strip().lower()
    if value == "0":
        return None
    if value == "1":
        return StepGraphs("cuda") if torch.device(device).type == "cuda" else None
    if value == "trace":
        return StepGraphs("trace")
    raise ValueError(f"VLLM_DDTREE_STEP_GRAPHS must be 0, 1 (the default) or trace, got {value!r}")


class DDTreeProposer(DFlashProposer):
    """vLLM's DFlash proposer, drafting a tree from the mask rows' per-depth distributions."""

    # True: an undrafted step runs vLLM's own K = 0 pass (its discarded forward included) instead of
    # `_take_in_context`; kept so tests check that both leave the drafter the same context.
    vllm_k0_pass = False
    step_graphs: StepGraphs | None = None  # the tree step's captures (VLLM_DDTREE_STEP_GRAPHS)
    verify_graphs: StepGraphs | None = None  # the walk's captures (the same switch)

    def __init__(self, vllm_config, device: torch.device, runner=None) -> None:
        options = vllm_config.speculative_config.ddtree
        self.options = options
        self.width = options.drafter_width
        super().__init__(vllm_config, device, runner)  # presented as DFlash by vllm_patches P10
        self.ddtree_vllm_config = vllm_config
        self.runner = runner  # the base proposer does not keep it: we read the batch order from it
        self.max_budget = options.verify_width
        self._cap = self.max_budget  # nodes per request this step: the scheduler's count (propose)
        self.lookup = options.prompt_lookup_tokens  # length of the prompt-lookup branch (0: none)
        # Depths the drafter's LM head and the tree build cover next step (DepthCap): the trees'
        # realised depth, doubled, instead of every depth a tree of `build` nodes could reach.
        self.depth_cap = DepthCap(self.width)
        self.proposed: ProposedTrees = NO_TREES  # the last propose's trees (prepare_tree_step reads them)
        self.stats = DDTreeStats()
        self._draft_hidden: Tensor | None = None  # [R * depth, H]: this step's mask rows, for the head
        self._draft_head = None  # [n, H] -> [n, V] logits
        self._draft_vocab = 0
        self._draft_to_target: Tensor | None = None
        # The drafter checkpoint's draft-vocabulary subset of the shared target head (draft_vocab):
        # its rows are gathered once, in load_model (the model loads after __init__).
        self._vocab_ids = (load_draft_vocab(vllm_config.speculative_config.model, vllm_config.model_config.get_vocab_size())
                           if options.draft_vocab == "checkpoint" else None)
        self._vocab_head: tuple | None = None  # (layer with the subset rows, the head's quant method, ids [N])
        self.context_order: Tensor | None = None  # set by sample_tree_step for the next propose
        self.context_positions: Tensor | None = None  # likewise: the step's sequential positions
        self.step_tokens: Tensor | None = None  # likewise: [R, L + 1] the step's accepted tokens and bonus
        target = vllm_config.model_config
        self.step_graphs = step_graphs_from_env(device)
        self.verify_graphs = step_graphs_from_env(device)  # the walk's (`sample_tree_step`), on the same switch
        self.ngram = None
        if options.ngram_weight > 0:
            # On the drafter's device: the tree build scores candidates there (a GPU tree would not
            # mix with tables left on the host). With captured steps, tables of fixed shape changed in
            # place, which a capture reads (`NGramCounts.fixed_shape`).
            self.ngram = NGramModel(target.get_vocab_size(), options.ngram_order, corpus=options.ngram_corpus,
                                    device=device, fixed_shape=self.step_graphs is not None)
        self.history = None
        if self.lookup > 0:  # the prompt-lookup branch: each request's last tokens, and where they recur
            # Made here, sized for the scheduler's requests, so that vLLM's memory profiling sees it.
            self.history = TokenHistory(min(target.max_model_len, LOOKUP_WINDOW), options.ngram_order - 1,
                                        slots=vllm_config.scheduler_config.max_num_seqs, device=device)
        self._slots: dict[str, int] = {}
        # request id -> how many of its tokens the n-gram tables and the token history have taken in
        # (_COUNTED_ON_DEVICE: all the host batch will hold at the next step, whose bookkeeping
        # appends exactly the tokens taken in on the device)
        self._seen: dict[str, int] = {}
        self.auto: AutoBudget | None = None
        self.live_timing = True  # step times feed the budget (off under tensor parallelism: calibrate_at_startup)
        self._last_propose: float | None = None
        self.pending_step: tuple[float, float, float] | None = None  # set by sample_tree_step: the step's size
        self.undrafted = False  # this propose drafted nothing: the next step decodes alone
        self.pending_ar_step: int | None = None  # set by prepare_tree_step: that step's requests, if decode only
        self.admission_undrafted_steps = 0  # steps left undrafted while a prompt waited (`_prompt_waits`)
        self.capacity_undrafted_steps = 0  # steps left undrafted: their query rows did not fit (`_drafter_fits`)
        if options.tree_budget == "auto":
            shape = ModelShape.from_hf_config(target.hf_config.to_dict() | {"vocab_size": target.get_vocab_size()},
                                              str(target.dtype))
            # The profile's roofline is a starting point: the cost is refit to this engine's measured
            # step times, and the drafter's confidence to its measured acceptance, while it serves.
            # Sized for the scheduler's largest step, the residual's device buffer is never replaced
            # (a replacement would make every captured step be captured again).
            cost = CostModel(shape, get_profile(options.device_profile),
                             max_step_rows=vllm_config.scheduler_config.max_num_batched_tokens)
            # With a lookup path, its nodes compete with the tree's for the step at their measured
            # acceptance (LookupCalibration), so the budget pays for the rows it adds.
            lookup = LookupCalibration(self.lookup) if self.lookup > 0 else None
            # min_tree_budget 0: the budget may also choose no tree (SpeculationGate), and the step then
            # takes vLLM's K = 0 path (the drafter only reads the new context).
            gate = SpeculationGate() if options.min_budget == 0 else None
            self.auto = AutoBudget(cost, max(options.min_budget, 1), options.max_budget, lookup=lookup,
                                   gate=gate).to(device)
            self.stats.gate = gate
        self._proposed: tuple[list[str], Tensor, Tensor] | None = None  # last step's lookup paths (auto)

    # vLLM calls propose(num_speculative_tokens=<scheduler's count>, ...): the drafter's width is W,
    # the count caps the tree (the verify width, or a Dynamic SD schedule's K at this batch size).
    def propose(self, num_speculative_tokens, **kwargs):
        self._time_step()
        self._cap = min(int(num_speculative_tokens), self.max_budget)
        order, positions = self.context_order, self.context_positions
        self.context_order = self.context_positions = None
        # This step's sampled tokens: a tree step's accepted path and bonus (sample_tree_step), else
        # the one token vLLM's sampler drew (the DFlash input's next token).
        step_tokens = self.step_tokens if self.step_tokens is not None else kwargs["next_token_ids"].view(-1, 1)
        self.step_tokens = None
        if order is not None:  # after a tree step: each request's accepted path first (sample_tree_step)
            n = order.shape[0]
            for key in ("target_hidden_states", "target_token_ids"):
                x = kwargs[key]
                kwargs[key] = torch.cat([x[order.to(x.device)], x[n:]]) if x.shape[0] > n else x[order.to(x.device)]
            x = kwargs["target_positions"]
            positions = positions.to(x.device, x.dtype)
            kwargs["target_positions"] = torch.cat([positions, x[n:]]) if x.shape[0] > n else positions
        r = kwargs["common_attn_metadata"].batch_size()
        # Dynamic SD turned drafting off at this batch size, or the automatic budget chose no tree:
        # while a prompt waits for the step's tokens (`_prompt_waits`), or by its gate.
        fits = self._drafter_fits(r)
        self.capacity_undrafted_steps += not fits
        waits = fits and self.auto is not None and self._prompt_waits(r)
        self.admission_undrafted_steps += waits
        self.undrafted = (self._cap == 0 or not fits or waits
                          or (self.auto is not None and not self.auto.speculate(r)))
        if self.undrafted:
            self._proposed = None  # no lookup proposals this step: none to score next step
            if self.ngram is not None or self.history is not None:
                self._catch_up()  # this step's tokens are read from the host batch at the next drafted one
            if self.vllm_k0_pass and fits:
                super().propose(0, **kwargs)
            else:
                self._take_in_context(**kwargs)  # the drafter still takes in the context
                if self.vllm_config.parallel_config.data_parallel_size > 1:
                    # Data-parallel ranks of an MoE target pair every drafter forward's batch padding
                    # (an all-reduce, `coordinate_batch_across_dp`); each rank decides drafting on its
                    # own, so one that does not draft runs a dummy forward in its place, as vLLM's runner
                    # does when its ranks disagree on drafting (gpu_model_runner.py:4423). Dense
                    # targets' ranks are independent engines (data_parallel_size 1 in each).
                    self.dummy_run(num_tokens=1)
            return [[] for _ in range(r)]
        super().propose(self.width, **kwargs)
        return self._tree_drafts(kwargs["common_attn_metadata"], step_tokens)

    def _drafter_fits(self, r: int) -> bool:
        """Whether the drafter's forward holds this step's query rows: 1 + W per request (the bonus
        token and W mask queries) within ``max_num_batched_tokens``, the size vLLM gives the
        drafter's forward (its buffers, attention metadata and memory profile).

        vLLM's DFlash reserves W input slots per scheduled request so that every step fits; at 256
        step tokens that kept at most 16 requests running, with or without a tree to gain. ddtree
        reserves none (vllm_patches P5): a step with more requests runs as without speculation, and
        the drafter only takes in its context. Logged once, with the setting that changes it.
        That context pass (`_take_in_context`, K = 0) writes one query row per request, which DFlash's
        buffers hold at any batch (vLLM requires max_num_batched_tokens >= max_num_seqs).
        """
        if r * (1 + self.width) <= self.max_num_tokens:
            return True
        if not self.capacity_undrafted_steps:
            logger.info("ddtree: steps of more than %d requests run without drafts: the drafter's %d query rows "
                        "per request must fit max_num_batched_tokens (%d); raise it to draft at larger batches",
                        self.max_num_tokens // (1 + self.width), 1 + self.width, self.max_num_tokens)
        return False

    def _prompt_waits(self, r: int) -> bool:
        """Whether a prompt of this step is prefilled in chunks and has more to come (vLLM discards
        that row's sampled token: `discard_request_mask`, a host array).

        Then the scheduler's token budget (max_num_batched_tokens) ran out before the prompt did, and
        the next step's drafts would be paid in that prompt's tokens and those of the requests queued
        behind it: vLLM schedules the running requests' drafts first and admits waiting ones with
        what is left. The automatic budget drafts only with tokens no prompt is waiting for; the
        step runs as without speculation. Every rank of a tensor-parallel group sees the same mask.
        Measured at a small step budget in design.md §7 ("Prompts waiting for the step's tokens").
        """
        return bool(self.runner.discard_request_mask.np[:r].any())

    def _take_in_context(self, **kwargs) -> None:
        """vLLM's K = 0 pass without its forward (replaces ``LLMBaseProposer.propose(0, ...)``).

        With no draft requested vLLM still runs the drafter's forward on each request's next token
        and discards the result (llm_base_proposer.py:617, "No draft tokens requested"). The next
        draft needs only what DFlash writes before that forward: the context K/V of this step's
        target hidden states. Same inputs (``set_inputs_first_pass``: positions and drafter slots),
        same write (``precompute_and_store_context_kv``), no attention metadata, no forward.
        """
        self.num_speculative_tokens = 0
        self._last_draft_probs = None
        hidden = self.model.combine_hidden_states(kwargs["target_hidden_states"])
        self.set_inputs_first_pass(
            target_token_ids=kwargs["target_token_ids"], next_token_ids=kwargs["next_token_ids"],
            target_positions=kwargs["target_positions"], target_hidden_states=hidden,
            token_indices_to_sample=kwargs.get("token_indices_to_sample"), cad=kwargs["common_attn_metadata"],
            num_rejected_tokens_gpu=kwargs.get("num_rejected_tokens_gpu"))
        n = hidden.shape[0]
        self.model.precompute_and_store_context_kv(hidden, self._context_positions_buffer[:n],
                                                   self._context_slot_mapping_buffer[:n])

    def calibrate_at_startup(self, runner, repeats: int = 2, max_tokens: int = 256) -> dict | None:
        """Time the step sizes the automatic budget chooses from, before serving (vLLM profiles memory
        and captures graphs at the same point, with the same dummy forwards).

        `runner._dummy_run(n)` is vLLM's own dummy step (the target's forward of n tokens spread over
        min(n, max_num_seqs) requests, and the drafter's): n = 1, 2, 4, ... are the undrafted steps of
        n requests (the speculation gate's baseline, `SpeculationGate.ar_prior`), and all sizes up to
        `max_tokens` feed the cost fit in place of exploring sizes on live requests
        (`CostCalibration.seed`). Each size: one warm-up, then the median of `repeats`. Where vLLM
        captured FULL decode graphs (P21: the steps without trees replay them), the undrafted steps
        are timed again as those steps run, as uniform decodes (`_dummy_run(n, uniform_decode=True)`),
        for the gate's baseline; the cost fit keeps the piecewise timings, as tree steps run. Returns
        what was measured (None without the automatic budget).
        """
        if self.auto is None:
            return None
        sched = self.ddtree_vllm_config.scheduler_config
        max_seqs = sched.max_num_seqs
        top = min(max_tokens, sched.max_num_batched_tokens, max_seqs * (1 + self.max_budget))
        sizes = sorted({2 ** i for i in range(top.bit_length()) if 2 ** i <= top} | {top})
        sync = (torch.cuda.synchronize if self.device.type == "cuda" else lambda: None)

        def median_seconds(step) -> float:
            seconds = []
            for i in range(repeats + 1):
                sync()
                t0 = time.perf_counter()
                step()
                sync()
                if i:  # the first is a warm-up
                    seconds.append(time.perf_counter() - t0)
            return statistics.median(seconds)

        timed = {n: median_seconds(lambda: runner._dummy_run(n)) for n in sizes}
        undrafted = {n: sec for n, sec in timed.items() if n <= max_seqs}
        full_decode = has_full_decode_graphs(runner)
        if full_decode:
            undrafted = {n: median_seconds(lambda: runner._dummy_run(n, uniform_decode=True)) for n in undrafted}
        tp = _tensor_parallel_group()
        if tp is not None:
            # Every rank must choose the same trees (the scheduler takes rank 0's drafts, and each
            # rank masks its own heads with its own trees): rank 0's timings for all, and no timing
            # of live steps afterwards, which would differ per rank. Acceptance calibrations see the
            # same tokens on every rank and keep learning.
            timed, undrafted = tp.broadcast_object((timed, undrafted), src=0)
            self.live_timing = False
        points = []
        for n, sec in timed.items():
            reqs = min(n, max_seqs)
            q = n / reqs  # the dummy step's query tokens per request (no context before them)
            points.append((float(n), reqs * q * (q + 1) / 2, 0.0, sec))
        self.auto.calibration.seed(points)
        if self.auto.gate is not None:
            self.auto.gate.ar_prior = undrafted
        logger.info("ddtree: timed steps of %s tokens at start-up: %s ms; the automatic budget starts calibrated",
                    "/".join(map(str, timed)), "/".join(f"{1e3 * s:.1f}" for s in timed.values()))
        if full_decode:
            logger.info("ddtree: undrafted steps of %s requests replay FULL decode graphs: %s ms",
                        "/".join(map(str, undrafted)), "/".join(f"{1e3 * s:.1f}" for s in undrafted.values()))
        return {"step_ms": {n: 1e3 * s for n, s in timed.items()},
                "undrafted_step_ms": {n: 1e3 * s for n, s in undrafted.items()}}

    @property
    def draft_vocab_size(self) -> int | None:
        """Target ids the drafter's logits span when they are the checkpoint's draft-vocabulary
        subset of the shared head (``draft_vocab``); None when drafts span the drafter's own head."""
        return None if self._vocab_ids is None else int(self._vocab_ids.numel())

    def budget_summary(self) -> dict:
        """Steps left undrafted because their query rows did not fit the drafter (`_drafter_fits`),
        and the automatic budget's calibrated state (absent for a fixed budget)."""
        summary = {"capacity_undrafted_steps": self.capacity_undrafted_steps}
        return summary if self.auto is None else summary | self.auto.summary() | {
            "admission_undrafted_steps": self.admission_undrafted_steps}

    def _time_step(self) -> None:
        """Cycle time of the last step (propose to propose: verify forward, walk, drafting, scheduling).

        Measured only after a step that verified trees and nothing else (no prefill in it), so the
        cost calibration sees steps whose size it knows; and after an undrafted step of one token per
        request, the speculation gate's baseline (the drafter's K = 0 context pass included).
        """
        now = time.perf_counter()
        if self.auto is not None and self._last_propose is not None and self.live_timing:
            if self.pending_step is not None:
                self.auto.observe_step(*self.pending_step, now - self._last_propose)
            elif self.pending_ar_step is not None:  # an undrafted decode step: the gate's baseline
                self.auto.observe_ar_step(self.pending_ar_step, now - self._last_propose)
        self.pending_step = self.pending_ar_step = None
        self._last_propose = now

    def _sample_draft_tokens(self, hidden_states: Tensor, sampling_metadata):
        """Keep the mask rows' logits for the tree (parallel drafting: hidden_states [R * W, H]).

        With a reduced draft vocabulary, vLLM's compute_logits scatters into the full target
        vocabulary (-inf elsewhere); the tree only needs the top-K, so take the draft-vocabulary
        logits and map the chosen ids through d2t instead (smaller top-k, no scatter).
        """
        # A tree of `build` nodes is at most `build` deep: the LM head (the drafter's largest matmul,
        # 49152 x H with a shared target head) only runs on the depths the tree can use. The block's
        # hidden states still come from all W mask rows (its attention is bidirectional).
        rows = hidden_states.shape[0]
        r = rows // self.width
        tree_cap = min(self._cap, self.options.max_budget)  # the rest of the cap is the lookup branch's
        self._build = min(self.options.tree_budget if self.auto is None else self.auto.build_width(r), tree_cap)
        if self.step_graphs is not None:  # captured steps: a few widths, each captured once
            self._build = capture_width(self._build, tree_cap)
        self._depth = min(self.width, self._build, self.depth_cap.depth)
        hidden_states = hidden_states.view(r, self.width, -1)[:, : self._depth].reshape(r * self._depth, -1)
        # The head itself runs in `_tree_drafts`, on chunks of rows each followed by its top-k
        # (`head_topk`): the whole [rows, V] logits never exist at once.
        self._draft_hidden = hidden_states
        self._select_draft_head()
        return torch.zeros(rows, dtype=torch.int64, device=hidden_states.device), None  # vLLM views it [R, W]

    def _select_draft_head(self) -> None:
        """The drafter's LM head for `head_topk`: its function ([n, H] -> [n, vocab] logits), vocabulary
        size, and the map of its ids to the target's (None: the same ids)."""
        model = self.model
        d2t = getattr(model, "draft_id_to_target_id", None)
        if self._vocab_ids is not None and d2t is None:
            if self._vocab_head is None:
                self._gather_vocab_head(model.lm_head)
            self._draft_head = lambda h: self._subset_logits(model, h)
            self._draft_to_target = self._vocab_head[2]  # the draft vocabulary's target ids, on the device
            self._draft_vocab = self._draft_to_target.numel()
        elif d2t is not None and hasattr(model, "logits_processor") and hasattr(model, "lm_head"):
            self._draft_head = lambda h: model.logits_processor(model.lm_head, h)
            self._draft_vocab = d2t.shape[0]
            self._draft_to_target = torch.arange(d2t.shape[0], device=d2t.device) + d2t
        else:
            self._draft_head = model.compute_logits
            self._draft_vocab = _head_vocab(model, self.vllm_config)
            self._draft_to_target = None

    def largest_draft_head_step(self) -> tuple[int, int]:
        """(rows, k) of the largest LM-head top-k a drafting step runs: the depths the largest tree can
        reach (at most W) for each of the most requests whose 1 + W query rows fit the drafter's
        forward (`_drafter_fits`), and that tree's top-k (`_sample_draft_tokens`, `_tree_drafts`)."""
        self._select_draft_head()
        requests = min(self.vllm_config.scheduler_config.max_num_seqs, self.max_num_tokens // (1 + self.width))
        build = self.options.max_budget
        return requests * min(self.width, build), min(build, self._draft_vocab)

    def profile_draft_head(self) -> tuple[int, int]:
        """Run the largest LM-head top-k (:meth:`largest_draft_head_step`) on random hidden states, so
        that vLLM's memory profiling sees its chunked logits (`head_topk`). Returns (rows, k)."""
        rows, k = self.largest_draft_head_step()
        if rows:
            hidden = torch.rand(rows, self.hidden_size, dtype=self.dtype, device=self.device)
            head_topk(hidden, self._draft_head, self._draft_vocab, k)
        return rows, k

    def load_model(self, target_model) -> None:
        """vLLM's DFlash load (the drafter then shares the target's head), then the draft-vocabulary
        rows of that head, gathered once so a bad setup fails at start-up (see ``_subset_logits``)."""
        super().load_model(target_model)
        self._embed_without_lora()
        if self._vocab_ids is not None and getattr(self.model, "draft_id_to_target_id", None) is None:
            self._gather_vocab_head(self.model.lm_head)

    def _embed_without_lora(self) -> None:
        """The drafter embeds its tokens with the target's base embedding layer, never its LoRA wrapper.

        vLLM's load shares the target's ``embed_tokens`` with the drafter (``_maybe_share_embeddings``).
        With ``--enable-lora`` that layer is vLLM's LoRA wrapper, whose forward adds each token's adapter
        through the mapping of the target's step: sized and ordered for the target's tokens, not the
        drafter's block (an index error in the first drafting step). Drafts need no adapter (the target
        verifies them with its own), so the drafter takes the wrapper's base layer.
        """
        from vllm.lora.layers import BaseLayerWithLoRA

        inner = getattr(self.model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if isinstance(embed, BaseLayerWithLoRA):
            inner.embed_tokens = embed.base_layer

    def _gather_vocab_head(self, head) -> None:
        """The draft vocabulary's rows of the shared LM head, gathered once into a layer of their own.

        Under tensor parallelism vLLM shards that head by vocabulary (`ParallelLMHead`: rank r holds
        the ids `shard_indices.org_vocab_start_index` .. `org_vocab_end_index`): each rank gathers the
        draft ids it holds, and `_subset_logits` adds the ranks' logits, each in its own columns and
        zero elsewhere, in one all-reduce, so every rank gets the same [rows, N] logits.
        """
        weight, ids, method = getattr(head, "weight", None), self._vocab_ids, getattr(head, "quant_method", None)
        group = _tensor_parallel_group()
        shard = getattr(head, "shard_indices", None)
        start, end = ((shard.org_vocab_start_index, shard.org_vocab_end_index) if group is not None and shard is not None
                      else (0, None if weight is None else weight.shape[0]))
        # plain rows only: an FP8 weight is floating point too, but its rows mean nothing without its scales
        if (weight is None or weight.dtype not in PLAIN_HEAD_DTYPES or not hasattr(method, "apply")
                or (group is not None and shard is None) or (group is None and end < int(ids[-1]) + 1)):
            raise ValueError(VOCAB_SUBSET_NEEDS_PLAIN_HEAD)
        ids = ids.to(weight.device)
        mine = ((ids >= start) & (ids < end)).nonzero().flatten()  # [n]: positions of this rank's ids
        local = ids[mine] - start
        sub = torch.nn.Module()  # the head's rows of the draft vocabulary, as a layer of its own
        sub.weight = torch.nn.Parameter(weight[local].contiguous(), requires_grad=False)
        bias = getattr(head, "bias", None)
        sub.bias = None if bias is None else bias[local].contiguous()
        # The head's own GEMM set-up for the new layer: on a CPU, vLLM swaps F.linear (5x slower
        # here for a few rows) for a prepacked oneDNN kernel; a GPU keeps its plain matmul.
        if local.numel() and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(sub)
        self._vocab_head = (sub, method, ids, None if group is None else (mine, group))

    def _subset_logits(self, model, hidden_states: Tensor) -> Tensor:
        """Draft logits [rows, N] over the checkpoint's draft vocabulary (target ids: ``_vocab_head[2]``).

        Replaces ``model.compute_logits`` (the shared target head, [rows, V]) for a drafter that
        ships ``draft_vocab.json``: the same logits on those ids (the head's rows, gathered at
        load into a layer with the head's own GEMM, then LogitsProcessor's soft cap and scale),
        a matmul over N rows instead of V. Under tensor parallelism each rank computes its own ids'
        columns and one all-reduce of [rows, N] assembles them (vLLM's head all-gathers [rows, V]).
        """
        if self._vocab_head is None:
            self._gather_vocab_head(model.lm_head)
        sub, method, ids, sharded = self._vocab_head
        h = hidden_states.to(sub.weight.dtype)
        if sharded is None:
            logits = method.apply(sub, h, bias=sub.bias)
        else:  # this rank's columns, zero elsewhere: the sum over ranks is every column exactly once
            mine, group = sharded
            logits = h.new_zeros(h.shape[0], ids.numel())
            if mine.numel():
                logits[:, mine] = method.apply(sub, h, bias=sub.bias)
            logits = group.all_reduce(logits)
        lp = model.logits_processor
        if lp.soft_cap is not None:
            logits = torch.tanh(logits / lp.soft_cap) * lp.soft_cap
        if lp.scale != 1.0:
            logits = logits * lp.scale
        return logits

    def _tree_drafts(self, cad, step_tokens: Tensor) -> list[list[int]]:
        runner = self.runner
        req_ids = list(runner.input_batch.req_ids)
        r = len(req_ids)
        build = self._build
        k = min(build, self._draft_vocab)
        # [R * depth, H] -> top-k of [R * depth, V]: the depths a tree can reach
        top_logp, top_ids = head_topk(self._draft_hidden, self._draft_head, self._draft_vocab, k)
        top_logp, top_ids = top_logp.view(r, self._depth, k), top_ids.view(r, self._depth, k)
        self._draft_hidden = None
        if self._draft_to_target is not None:
            top_ids = self._draft_to_target[top_ids]
        slots = new_tokens = None
        if self.ngram is not None or self.history is not None:  # this step's tokens in, on the device
            slots, new_tokens = self._observe(req_ids, step_tokens)
        observed = None  # last step's lookup paths, scored against this step's tokens in the step function
        if self.history is not None and self.auto is not None:
            observed = self._lookup_outcome(req_ids)  # (before this step's replay overwrites them)

        # the token history's new tokens, lookup calibration, build, budget, lookup path within the
        # scheduler's count: the step's device function
        def step(top_logp, top_ids, context_lens, slots, rows, observed, new_tokens):
            if new_tokens is not None:
                self.history.append(slots, new_tokens)
            if observed is not None:
                self.auto.observe_lookup(*observed, new_tokens)
            # the n-gram scores of this step's requests (a padded row's slot, -1, scores the last one's:
            # its candidates are -inf, so it keeps no node either way)
            scorer = tail = None
            if self.ngram is not None:
                scorer, tail = self.ngram.scorer(slots), self.ngram.context_tail(slots)
            if self.history is None:
                return *plan_trees(top_logp, top_ids, build, context_lens, self.auto, None, None, self._cap,
                                   scorer=scorer, context_tail=tail, lam=self.options.ngram_weight, rows=rows), None, None
            # one more path per tree: the request's own text, continued
            return plan_trees_with_lookup(top_logp, top_ids, build, context_lens, self.auto, self.history, slots,
                                          self.lookup, self._cap, padded=rows is not None, scorer=scorer,
                                          context_tail=tail, lam=self.options.ngram_weight, rows=rows)

        context_lens = cad.seq_lens[:r] if self.auto is not None else None
        state = self._capture_state(r, top_logp.device)
        # captured: one shape per (size class, width), whatever the batch and the depth cap drafted
        new_tokens = new_tokens if self.history is not None else None  # (the n-gram tables took theirs)
        tree, plan, branch, valid = draft_trees(step, top_logp, top_ids, context_lens, slots, min(self.width, build),
                                                None if state is None else self.step_graphs, (build, self._cap, state),
                                                observed, new_tokens, self.max_budget + 1)
        if self.history is not None and self.auto is not None:  # scored next step (`_lookup_outcome`)
            self._proposed = (req_ids, branch, valid)
        host = self._store(req_ids, tree)
        if self.auto is not None:
            self.auto.record_plan(plan, r)
            self.auto.grow(host.ranked)  # the next build follows the largest tree the drafter's ranking kept
        return host.tokens  # the scheduler takes these lists; what we keep of the trees is `self.proposed`

    def _capture_state(self, r: int, device: torch.device) -> tuple | None:
        """What keys this step's captured `plan_trees` (`step_graphs`) beside its shapes, or None to
        run it eagerly: without graphs, or while the automatic budget cannot be captured
        (`AutoBudget.capture_state`). The token history's and the n-gram tables' generations: their
        buffers, made anew when they grow."""
        if self.step_graphs is None:
            return None
        history = () if self.history is None else (self.history.generation,)
        ngram = () if self.ngram is None else self.ngram.generation
        budget = () if self.auto is None else self.auto.capture_state(r, device)
        return None if budget is None else history + ngram + budget

    def _store(self, req_ids: list[str], tree: DraftTree) -> HostTrees:
        # The one host copy per step: vLLM's scheduler takes draft tokens as Python lists.
        with gpu_sync_allowed():  # deliberate: vLLM's scheduler reads the drafts on the host next
            host = tree_to_host(tree, with_scores=self.auto is not None)
        self.depth_cap.observe(host.deepest)
        self.proposed = ProposedTrees(dict(zip(req_ids, range(len(req_ids)))), *host.padded, host.on_device)
        return host

    def _lookup_outcome(self, req_ids: list[str]) -> tuple[Tensor, Tensor] | None:
        """Last step's lookup paths (all of them, verified or not) per row of this batch: (paths, valid
        [R, L]) for the automatic budget's LookupCalibration, which scores them against this step's
        tokens (None before any). Rows are matched by request id (the batch may have been reordered);
        a request new to the batch, or a row vLLM discards, proposed nothing."""
        if self._proposed is None:
            return None
        before, proposed, valid = self._proposed
        r, none = len(req_ids), len(before)  # none: an all-invalid row appended below
        row = dict(zip(before, range(none)))
        discard = torch.as_tensor(self.runner.discard_request_mask.np[:r], dtype=torch.bool)
        rows = torch.tensor(list(map(row.get, req_ids, itertools.repeat(none, r))), dtype=torch.int64)
        index = to_device(torch.where(discard, none, rows), valid.device)
        # (the appended rows: kept constants, no fill of their own each step)
        length, dev = proposed.shape[1], proposed.device
        proposed = torch.cat([proposed, constants.filled((1, length), 0, proposed.dtype, dev)])[index]
        valid = torch.cat([valid, constants.filled((1, length), False, torch.bool, dev)])[index]
        return proposed, valid

    def _catch_up(self) -> None:
        """At an undrafted step (no `_observe`): a request whose last observed step's tokens were
        counted on the device has, in the host batch now, exactly those tokens appended; pin its count
        to the batch's, so that the next drafted step reads this step's tokens, with their history,
        from the host batch. Tensor ops over the batch's rows, no Python per request."""
        batch = self.runner.input_batch
        req_ids = list(batch.req_ids)
        r = len(req_ids)
        seen = torch.tensor(list(map(self._seen.get, req_ids, itertools.repeat(_NOT_MET, r))), dtype=torch.int64)
        held = torch.as_tensor(batch.num_tokens_no_spec[:r], dtype=torch.int64)
        pinned = torch.where(seen == _COUNTED_ON_DEVICE, held, seen).tolist()
        self._seen.update(itertools.compress(zip(req_ids, pinned), (seen != _NOT_MET).tolist()))

    def _observe(self, req_ids: list[str], step_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Feed each request's newly committed tokens to the online n-gram model, and the tokens the
        host holds to the lookup's token history; (its slot per row, a device tensor [R], and the
        step's new tokens [R, K], -1 padded, which the step function appends to the history). No host
        read: the step's tokens stay on the device.

        vLLM runs the DFlash proposer before its bookkeeping writes this step's sampled tokens to the
        host batch (gpu_model_runner.py:4396, "does not need to wait for bookkeeping"): the batch
        holds each request's tokens up to the last step, and this step's — its accepted path and
        bonus token, `step_tokens` [R, K] (-1 padded) — are added here on the device, so that the
        n-gram context ends at the new tree's root. Rows vLLM discards (a prefill chunk that is not
        the last) add none. Tokens the host holds that the tables have not seen (a prompt, a prefill
        chunk) go in the same merge, with their history, read from the host batch's token buffer by
        tensor ops over all rows (`HostTokens`); the ids' bookkeeping (slots, counts seen) is dict
        lookups mapped in C and tensor ops: no Python runs per request of the batch (only once per
        finished request, dropping its entries).
        """
        batch = self.runner.input_batch
        r = len(req_ids)
        discard = torch.as_tensor(self.runner.discard_request_mask.np[:r], dtype=torch.bool)
        finished = list(itertools.filterfalse(set(req_ids).__contains__, self._slots))
        released = list(map(self._slots.pop, finished))
        if self.ngram is not None:
            self.ngram.release_batch(released)
        if self.history is not None:
            self.history.release(released)
        for rid in finished:  # (once per request's life, not per step)
            self._seen.pop(rid, None)
        arrivals = list(itertools.filterfalse(self._slots.__contains__, req_ids))
        free = sorted(set(range(len(self._slots) + len(req_ids))) - set(self._slots.values()))
        self._slots.update(zip(arrivals, free))
        self._seen.update(dict.fromkeys(arrivals, 0))
        n = torch.as_tensor(batch.num_tokens_no_spec[:r], dtype=torch.int64)  # [R] tokens the batch holds
        # _COUNTED_ON_DEVICE: the tables have seen everything the batch holds (last step's tokens,
        # counted on the device then, are the ones the bookkeeping has appended since)
        seen = torch.tensor(list(map(self._seen.__getitem__, req_ids)), dtype=torch.int64)
        start = torch.where(seen == _COUNTED_ON_DEVICE, n, seen)
        # None in the steady state, where every row's tokens came through the device last step
        host = HostTokens(torch.as_tensor(batch.token_ids_cpu[:r]), start, n) if bool((start < n).any()) else None
        # a discarded row's sampled token is not kept: the batch's count stands
        self._seen.update(zip(req_ids, torch.where(discard, n, _COUNTED_ON_DEVICE).tolist()))
        slots = list(map(self._slots.__getitem__, req_ids))
        discarded = to_device(discard.view(r, 1), step_tokens.device)
        tokens = torch.where(discarded, -1, step_tokens if step_tokens.shape[0] == r else step_tokens[:r])
        if self.ngram is not None:
            slots_on_device = self.ngram.observe_step(slots, tokens, host)
        if self.history is not None:  # the step function appends `tokens` (`TokenHistory.append`)
            slots_on_device = self.history.observe_host(slots, host)
        return slots_on_device, tokens


def _head_vocab(model, vllm_config) -> int:
    """How many logits the drafter's `compute_logits` gives per row: its LogitsProcessor keeps the
    original vocabulary (padding columns cut), else the drafter's configured vocabulary."""
    processor = getattr(model, "logits_processor", None)
    vocab = getattr(processor, "org_vocab_size", None)
    if vocab is None:
        vocab = vllm_config.speculative_config.draft_model_config.get_vocab_size()
    return int(vocab)


def _tensor_parallel_group():
    """vLLM's tensor-parallel group when it has more than one rank, else None."""
    from vllm.distributed.parallel_state import get_tp_group

    try:
        group = get_tp_group()
    except AssertionError:  # not initialised (no distributed environment)
        return None
    return group if group.world_size > 1 else None
