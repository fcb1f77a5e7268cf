"""ddtree inside vLLM's V1 model runner: the tree proposer and the verify step.

One engine step, as the runner executes it with vllm_ddtree's patches (vllm_patches P10–P12):

1. `DDTreeProposer.propose` (after the previous step's sampling): vLLM's own DFlash forward
   ([bonus, MASK x W] against the accepted path's hidden states), then — instead of the argmax per
   mask row — top-K per depth, `build_tree` (optional n-gram rescoring, optional batch-aware budget)
   and the flattened tree tokens per request, returned as a ragged list. The tree (parents, depths)
   is kept per request id.
2. `prepare_tree_step` (after `_prepare_inputs`, before attention metadata is built): the scheduled
   drafts of each request (a prefix of its tree if the scheduler truncated it) are compiled into a
   `TreeBatch`; the rows' RoPE positions become context + depth (their KV slots stay sequential);
   the ancestor masks go to the CPU tree attention through its channel.
3. `sample_tree_step` (in place of the rejection sampler): one target token per verify row —
   argmax, or one draw from the request's processed distribution — then `walk_tree`. The accepted
   rows' K/V are moved to consecutive slots (compaction), and the proposer is told an order of the
   step's tokens with each request's accepted path first: it applies it to the context (positions,
   hidden states) it is handed, so that vLLM's DFlash input preparation — which trims rejected rows
   as a suffix — feeds the drafter exactly the accepted path at consecutive positions. Output: [R, depth + 1] padded with -1, the rejection
   sampler's layout, so vLLM's bookkeeping and the scheduler's rollback hold unchanged.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vllm_ddtree.tree import (
    NO_PARENT,
    AutoBudget,
    CostModel,
    DraftTree,
    HostTrees,
    LookupCalibration,
    ModelShape,
    NGramModel,
    SpeculationGate,
    TreeBatch,
    add_branch,
    build_tree,
    compile_tree,
    get_profile,
    sample_tokens,
    topk_per_depth,
    to_device,
    tree_to_host,
    walk_tree,
)

from vllm.logger import init_logger
from vllm.utils.gpu_sync_debug import gpu_sync_allowed
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.compaction import accepted_path_moves, move_slots_
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
class TreeStep:
    """What the verify step of one batch needs after its forward."""

    batch: TreeBatch
    row_index: Tensor  # [R, N] flat token index of each verify row (0 where padding)
    slot_mapping: Tensor  # [T] KV slot of every scheduled token (sequential positions)
    sequential_positions: Tensor | None = None  # [T] positions before the tree's context + depth rewrite
    node_scores: Tensor | None = None  # [R, N - 1] prefix score of each node (automatic budget only)
    from_tree: Tensor | None = None  # [R] bool: the request's drafts are its proposed tree (not a fallback chain)
    step_size: tuple[float, float, float] | None = None  # (rows, attention pairs, context) if the step verified trees only


class UndraftedStep:
    """A step vLLM schedules with spec-decode metadata but no drafts in it (see prepare_tree_step)."""


UNDRAFTED = UndraftedStep()


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
    totals: Tensor | None = None  # [4]: request-steps with a tree, nodes verified, sum of tree depths, accepted
    _last_log: float = field(default_factory=time.monotonic)
    _logged: tuple = (0, 0, 0, 0)

    def record(self, nodes: Tensor, depths: Tensor, accepted: Tensor) -> None:
        dev = accepted.device
        step = torch.stack([(nodes > 0).sum().to(dev), nodes.sum().to(dev), depths.sum().to(dev),
                            accepted.sum()]).to(torch.float64)
        self.totals = step if self.totals is None else self.totals + step
        now = time.monotonic()
        if now - self._last_log >= self.interval:
            s0, n0, d0, a0 = self._logged
            with gpu_sync_allowed():  # deliberate: once per log interval, not per step
                steps, nodes_, depth, acc = self.totals.tolist()
            ds = max(steps - s0, 1)
            logger.info(
                "ddtree: %d tree verifications, mean tree %.1f nodes, mean depth %.2f, "
                "mean acceptance length %.2f (bonus included)",
                steps - s0, (nodes_ - n0) / ds, (depth - d0) / ds, 1 + (acc - a0) / ds,
            )
            self._last_log, self._logged = now, (steps, nodes_, depth, acc)

    def summary(self) -> dict:
        steps, nodes, depth, acc = self.totals.tolist() if self.totals is not None else (0, 0, 0, 0)
        s = max(steps, 1)
        return {"tree_verifications": int(steps), "mean_tree_nodes": nodes / s,
                "mean_tree_depth": depth / s, "mean_acceptance_length": 1 + acc / s}


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


class DDTreeProposer(DFlashProposer):
    """vLLM's DFlash proposer, drafting a tree from the mask rows' per-depth distributions."""

    # True: an undrafted step runs vLLM's own K = 0 pass (its discarded forward included) instead of
    # `_take_in_context`; kept so tests check that both leave the drafter the same context.
    vllm_k0_pass = False

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
        self.trees: dict[str, RequestTree] = {}
        self.stats = DDTreeStats()
        self._logits: Tensor | None = None
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
        self.ngram = None
        if options.ngram_weight > 0 or self.lookup > 0:  # the prompt-lookup branch reads its counts
            # On the drafter's device: the tree build scores candidates there (a GPU tree would not
            # mix with tables left on the host).
            self.ngram = NGramModel(target.get_vocab_size(), options.ngram_order, corpus=options.ngram_corpus,
                                    device=device)
        self._slots: dict[str, int] = {}
        self._seen: dict[str, int] = {}
        self.auto: AutoBudget | None = None
        self._last_propose: float | None = None
        self.pending_step: tuple[float, float, float] | None = None  # set by sample_tree_step: the step's size
        self.undrafted = False  # this propose drafted nothing: the next step decodes alone
        self.pending_ar_step: int | None = None  # set by prepare_tree_step: that step's requests, if decode only
        if options.tree_budget == "auto":
            shape = ModelShape.from_hf_config(target.hf_config.to_dict() | {"vocab_size": target.get_vocab_size()},
                                              str(target.dtype))
            # The profile's roofline is a starting point: the cost is refit to this engine's measured
            # step times, and the drafter's confidence to its measured acceptance, while it serves.
            cost = CostModel(shape, get_profile(options.device_profile))
            # With a lookup path, its nodes compete with the tree's for the step at their measured
            # acceptance (LookupCalibration), so the budget pays for the rows it adds.
            lookup = LookupCalibration(self.lookup) if self.lookup > 0 else None
            # min_tree_budget 0: the budget may also choose no tree (SpeculationGate), and the step then
            # takes vLLM's K = 0 path (the drafter only reads the new context).
            gate = SpeculationGate() if options.min_budget == 0 else None
            self.auto = AutoBudget(cost, max(options.min_budget, 1), options.max_budget, lookup=lookup,
                                   gate=gate).to(device)
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
        # Dynamic SD turned drafting off at this batch size, or the automatic budget chose no tree.
        self.undrafted = self._cap == 0 or (self.auto is not None and not self.auto.speculate(r))
        if self.undrafted:
            self._proposed = None  # no lookup proposals this step: none to score next step
            if self.vllm_k0_pass:
                super().propose(0, **kwargs)
            else:
                self._take_in_context(**kwargs)  # the drafter still takes in the context
            return [[] for _ in range(r)]
        super().propose(self.width, **kwargs)
        return self._tree_drafts(kwargs["common_attn_metadata"], step_tokens)

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

    @property
    def draft_vocab_size(self) -> int | None:
        """Target ids the drafter's logits span when they are the checkpoint's draft-vocabulary
        subset of the shared head (``draft_vocab``); None when drafts span the drafter's own head."""
        return None if self._vocab_ids is None else int(self._vocab_ids.numel())

    def budget_summary(self) -> dict:
        """The automatic budget's calibrated state (empty for a fixed budget)."""
        return {} if self.auto is None else self.auto.summary()

    def _time_step(self) -> None:
        """Cycle time of the last step (propose to propose: verify forward, walk, drafting, scheduling).

        Measured only after a step that verified trees and nothing else (no prefill in it), so the
        cost calibration sees steps whose size it knows; and after an undrafted step of one token per
        request, the speculation gate's baseline (the drafter's K = 0 context pass included).
        """
        now = time.perf_counter()
        if self.auto is not None and self._last_propose is not None:
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
        model = self.model
        # A tree of `build` nodes is at most `build` deep: the LM head (the drafter's largest matmul,
        # 49152 x H with a shared target head) only runs on the depths the tree can use. The block's
        # hidden states still come from all W mask rows (its attention is bidirectional).
        rows = hidden_states.shape[0]
        r = rows // self.width
        tree_cap = min(self._cap, self.options.max_budget)  # the rest of the cap is the lookup branch's
        self._build = min(self.options.tree_budget if self.auto is None else self.auto.build_width(r), tree_cap)
        self._depth = min(self.width, self._build, self.depth_cap.depth)
        hidden_states = hidden_states.view(r, self.width, -1)[:, : self._depth].reshape(r * self._depth, -1)
        d2t = getattr(model, "draft_id_to_target_id", None)
        if self._vocab_ids is not None and d2t is None:
            self._logits, self._draft_to_target = self._subset_logits(model, hidden_states)
        elif d2t is not None and hasattr(model, "logits_processor") and hasattr(model, "lm_head"):
            self._logits = model.logits_processor(model.lm_head, hidden_states)
            self._draft_to_target = torch.arange(d2t.shape[0], device=d2t.device) + d2t
        else:
            self._logits = model.compute_logits(hidden_states)
            self._draft_to_target = None
        return torch.zeros(rows, dtype=torch.int64, device=hidden_states.device), None  # vLLM views it [R, W]

    def load_model(self, target_model) -> None:
        """vLLM's DFlash load (the drafter then shares the target's head), then the draft-vocabulary
        rows of that head, gathered once so a bad setup fails at start-up (see ``_subset_logits``)."""
        super().load_model(target_model)
        if self._vocab_ids is not None and getattr(self.model, "draft_id_to_target_id", None) is None:
            self._gather_vocab_head(self.model.lm_head)

    def _gather_vocab_head(self, head) -> None:
        weight, ids, method = getattr(head, "weight", None), self._vocab_ids, getattr(head, "quant_method", None)
        if (weight is None or not weight.is_floating_point() or weight.shape[0] < int(ids[-1]) + 1
                or not hasattr(method, "apply")):
            raise ValueError(
                "speculative_config: draft_vocab=\"checkpoint\" needs the drafter's shared LM head "
                "unsharded and unquantized (tensor parallel size 1); set \"draft_vocab\": \"full\""
            )
        ids = ids.to(weight.device)
        sub = torch.nn.Module()  # the head's rows of the draft vocabulary, as a layer of its own
        sub.weight = torch.nn.Parameter(weight[ids].contiguous(), requires_grad=False)
        bias = getattr(head, "bias", None)
        sub.bias = None if bias is None else bias[ids].contiguous()
        # The head's own GEMM set-up for the new layer: on a CPU, vLLM swaps F.linear (5x slower
        # here for a few rows) for a prepacked oneDNN kernel; a GPU keeps its plain matmul.
        if hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(sub)
        self._vocab_head = (sub, method, ids)

    def _subset_logits(self, model, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        """Draft logits [rows, N] over the checkpoint's draft vocabulary, and its target ids [N].

        Replaces ``model.compute_logits`` (the shared target head, [rows, V]) for a drafter that
        ships ``draft_vocab.json``: the same logits on those ids (the head's rows, gathered at
        load into a layer with the head's own GEMM, then LogitsProcessor's soft cap and scale),
        a matmul over N rows instead of V.
        """
        if self._vocab_head is None:
            self._gather_vocab_head(model.lm_head)
        sub, method, ids = self._vocab_head
        logits = method.apply(sub, hidden_states.to(sub.weight.dtype), bias=sub.bias)
        lp = model.logits_processor
        if lp.soft_cap is not None:
            logits = torch.tanh(logits / lp.soft_cap) * lp.soft_cap
        if lp.scale != 1.0:
            logits = logits * lp.scale
        return logits, ids

    def _tree_drafts(self, cad, step_tokens: Tensor) -> list[list[int]]:
        runner = self.runner
        req_ids = list(runner.input_batch.req_ids)
        r = len(req_ids)
        logits = self._logits.view(r, self._depth, -1)  # [R, depth, V]: the depths a tree can reach
        build = self._build
        k = min(build, logits.shape[-1])
        top_logp, top_ids = topk_per_depth(logits, k)
        if self._draft_to_target is not None:
            top_ids = self._draft_to_target[top_ids]
        scorer = tail = slots = None
        if self.ngram is not None:
            # Deliberate (once per step, not per node): this step's sampled tokens come to the host
            # (vLLM's bookkeeping reads them right after), merging them into the n-gram tables is a
            # torch.unique, and the slots and context tails are small host lists.
            with gpu_sync_allowed():
                slots = self._observe(req_ids, step_tokens)
                tail = self.ngram.context_tail(slots)
                slots = to_device(torch.tensor(slots, dtype=torch.int64), self.ngram.device)
                if self.options.ngram_weight > 0:
                    scorer = self.ngram.scorer(slots)
        tree = build_tree(top_logp, top_ids, build, max_budget=build, scorer=scorer,
                          context_tail=tail if scorer is not None else None, lam=self.options.ngram_weight,
                          validate=False)
        branch = valid = None
        if self.lookup > 0:  # one more path per tree: the request's own text, continued
            branch, valid = self.ngram.continuation(slots, tail, self.lookup)
        if self.auto is not None:
            if valid is not None:
                self._observe_lookup(req_ids, step_tokens)
                self._proposed = (req_ids, branch, valid)
            plan = self.auto.choose_plan(tree.scores, cad.seq_lens[:r], valid)
            tree = tree.truncate(plan.budgets.clamp(max=build))
            if valid is not None:  # the lookup nodes the budget bought
                valid = valid & (torch.arange(self.lookup, device=valid.device)[None, :] < plan.extra[:, None])
        if branch is not None:  # within the scheduler's count
            tree = add_branch(tree, branch, valid, max_nodes=self._cap)
        host = self._store(req_ids, tree)
        if self.auto is not None:  # the next build follows the largest tree the drafter's ranking kept
            self.auto.grow(host.ranked)
        return [list(t) for t in host.tokens]  # the scheduler's own lists: our copy stays as proposed

    def _store(self, req_ids: list[str], tree: DraftTree) -> HostTrees:
        # The one host copy per step (two with the automatic budget's scores): the scheduler takes
        # draft tokens as Python lists.
        with gpu_sync_allowed():  # deliberate: vLLM's scheduler reads the drafts on the host next
            host = tree_to_host(tree, with_scores=self.auto is not None)
        self.depth_cap.observe(host.deepest)
        live = set(req_ids)
        self.trees = {rid: t for rid, t in self.trees.items() if rid in live}  # finished requests leave
        for i, rid in enumerate(req_ids):
            self.trees[rid] = RequestTree(host.tokens[i], host.parents[i], host.depths[i],
                                          host.scores[i] if host.scores is not None else None)
        return host

    def _observe_lookup(self, req_ids: list[str], step_tokens: Tensor) -> None:
        """Last step's lookup paths (all of them, verified or not) against what this step committed,
        for the automatic budget's LookupCalibration. Rows are matched by request id (the batch may
        have been reordered); a request new to the batch, or a row vLLM discards, proposed nothing."""
        if self._proposed is None:
            return
        before, proposed, valid = self._proposed
        row = {rid: i for i, rid in enumerate(before)}
        discard = self.runner.discard_request_mask.np[: len(req_ids)].tolist()
        none = len(before)  # an all-invalid row appended below
        rows = [none if discard[i] else row.get(rid, none) for i, rid in enumerate(req_ids)]
        index = to_device(torch.tensor(rows, dtype=torch.int64), valid.device)
        proposed = torch.cat([proposed, proposed.new_zeros(1, proposed.shape[1])])[index]
        valid = torch.cat([valid, valid.new_zeros(1, valid.shape[1])])[index]
        self.auto.observe_lookup(proposed, valid, step_tokens)

    def _observe(self, req_ids: list[str], step_tokens: Tensor) -> list[int]:
        """Feed each request's newly committed tokens to the online n-gram model; its slot per row.

        vLLM runs the DFlash proposer before its bookkeeping writes this step's sampled tokens to the
        host batch (gpu_model_runner.py:4396, "does not need to wait for bookkeeping"): the batch
        holds each request's tokens up to the last step, and this step's — its accepted path and
        bonus token, `step_tokens` [R, K] (-1 padded) — are added here, so that the n-gram context
        ends at the new tree's root. Rows vLLM discards (a prefill chunk that is not the last) add none.
        """
        batch = self.runner.input_batch
        r = len(req_ids)
        discard = self.runner.discard_request_mask.np[:r].tolist()
        sampled = step_tokens.tolist()
        live = set(req_ids)
        finished = [x for x in self._slots if x not in live]
        self.ngram.release_batch([self._slots.pop(rid) for rid in finished])
        for rid in finished:
            self._seen.pop(rid, None)
        free = sorted(set(range(len(self._slots) + len(req_ids))) - set(self._slots.values()))
        slots, new = [], []
        for i, rid in enumerate(req_ids):
            if rid not in self._slots:
                self._slots[rid] = free.pop(0)
                self._seen[rid] = 0
            n = int(batch.num_tokens_no_spec[i])
            step = [] if discard[i] else [t for t in sampled[i] if t >= 0]
            new.append(batch.token_ids_cpu[i, self._seen[rid] : n].tolist() + step)
            self._seen[rid] = n + len(step)  # the bookkeeping appends these to the batch next
            slots.append(self._slots[rid])
        self.ngram.observe_batch(slots, new)  # one table merge for the whole batch
        return slots


def prepare_tree_step(runner, spec_decode_metadata, total_tokens: int) -> TreeStep | UndraftedStep | None:
    """Positions = context + depth for the scheduled tree rows; tree masks to the attention backend.

    Reads only the runner's host buffers (no device-to-host copy): the step's token ids
    (`input_ids.cpu`), query starts and sequence lengths (`optimistic_seq_lens_cpu`) are exact on
    the host because ddtree never runs with async scheduling (vLLM then writes every sampled token
    to the host before the next step). The compiled tree goes to the device in one copy.
    Returns None without spec-decode metadata, UNDRAFTED for a step in which no request has drafts.
    """
    from vllm_ddtree.attention.tree_mask import TreeStepMasks, set_step_tree_masks

    if spec_decode_metadata is None:
        set_step_tree_masks(None)
        return None
    if runner.input_batch.prev_sampled_token_ids is not None:
        # Only async scheduling leaves sampled tokens on the device; config refuses it for ddtree.
        raise RuntimeError("speculative method 'ddtree' needs async scheduling off (--no-async-scheduling)")
    proposer: DDTreeProposer = runner.drafter
    req_ids = list(runner.input_batch.req_ids)
    r = len(req_ids)
    drafted = spec_decode_metadata.num_draft_tokens
    width = max(drafted)
    # No request has drafts (Dynamic SD's K = 0, or the budget chose no tree): vLLM's plain sampler
    # takes the step, as without speculation (vLLM's rejection sampler fails on a step without drafts
    # under top-k, `k.max()` of an empty tensor, vllm 0.32; our tree walk would only copy each root's
    # K/V onto itself). One token each and decode only is the speculation gate's baseline.
    if width == 0:
        if proposer.undrafted and total_tokens == r:
            proposer.pending_ar_step = r
        set_step_tree_masks(None)
        return UNDRAFTED
    calibrating = proposer.auto is not None
    qsl = runner.query_start_loc.cpu[: r + 1].long()
    drafted_t = torch.tensor(drafted, dtype=torch.int64)
    root_index = qsl[1:] - 1 - drafted_t  # the root is the first of the request's last 1 + n tokens
    step_ids = runner.input_ids.cpu  # host: each request's drafts follow its root
    # Rows as padded Python lists, one tensor each at the end (no per-request tensor creation).
    tok_rows, par_rows, dep_rows, score_rows, from_tree_rows = [], [], [], [], []
    for i, (rid, first) in enumerate(zip(req_ids, (root_index + 1).tolist())):
        n = drafted[i]
        drafts = step_ids[first : first + n].tolist()
        pad = width - n
        t = proposer.trees.get(rid)
        from_tree = n > 0 and t is not None and t.tokens[:n] == drafts  # the scheduler keeps a prefix: still a tree
        if from_tree:
            par_rows.append(t.parents[:n] + [NO_PARENT] * pad)
            dep_rows.append(t.depths[:n] + [0] * pad)
        else:
            # Drafts we did not propose (vLLM fills placeholders when the drafter was skipped):
            # verify them as a chain, which is just as lossless.
            par_rows.append(list(range(-1, n - 1)) + [NO_PARENT] * pad)
            dep_rows.append(list(range(1, n + 1)) + [0] * pad)
        tok_rows.append(drafts + [0] * pad)
        from_tree_rows.append(from_tree)
        if calibrating:
            score_rows.append((t.scores[:n] if from_tree else [-math.inf] * n) + [-math.inf] * pad)
    tok, par, dep = (torch.tensor(x, dtype=torch.int64) for x in (tok_rows, par_rows, dep_rows))
    from_tree = torch.tensor(from_tree_rows, dtype=torch.bool)
    node_scores = torch.tensor(score_rows, dtype=torch.float32) if calibrating else None
    valid = dep > 0
    zeros = torch.zeros(r, width)
    tree = DraftTree(tok, par, dep, zeros, zeros, valid, valid.sum(1), max(proposer.width, width))
    ctx = runner.optimistic_seq_lens_cpu[:r].long() - 1 - drafted_t
    roots = step_ids[root_index].long()
    batch = compile_tree(tree, roots, ctx)  # on the host: the scheduled drafts are host lists
    row_index = torch.where(batch.valid, root_index[:, None] + torch.arange(width + 1), 0)
    flat = row_index[batch.valid]
    dev = runner.positions.device
    sequential = runner.positions[:total_tokens].clone()  # the drafter's context positions (sample_tree_step)
    runner.positions[to_device(flat, dev)] = to_device(batch.positions[batch.valid], dev)
    # The step's size for the cost calibration, from host numbers (no device read later).
    rows = batch.num_rows.double()
    step_size = None
    if calibrating and width > 0 and int(rows.sum()) == total_tokens:  # trees, and nothing else
        c = ctx.double()
        step_size = (float(rows.sum()), float((rows * (c + rows)).sum()), float(c.sum()))
    # One copy to the device (queued, not waited for); everything after the forward (walk,
    # compaction, masks) runs there.
    batch = batch.to(dev)
    set_step_tree_masks(TreeStepMasks(has_tree=to_device(drafted_t > 0, dev), num_rows=batch.num_rows,
                                      ancestors=batch.ancestors))
    slot_mapping = runner.input_batch.block_table[0].slot_mapping.gpu[:total_tokens].clone()
    return TreeStep(batch=batch, row_index=to_device(row_index, dev), slot_mapping=slot_mapping,
                    node_scores=None if node_scores is None else to_device(node_scores, dev),
                    from_tree=to_device(from_tree, dev), sequential_positions=sequential, step_size=step_size)


def sample_tree_step(runner, step: TreeStep, logits: Tensor, spec_decode_metadata):
    """The tree walk in place of the rejection sampler, then KV compaction and drafter-input order."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from vllm_ddtree.attention.tree_mask import set_step_tree_masks

    set_step_tree_masks(None)  # the drafter's attention is built next: plain masks for it
    batch = step.batch
    r, n = batch.tokens.shape
    # logits rows are request-major, 1 + drafts per request (spec_decode_metadata.logits_indices)
    counts = torch.tensor(spec_decode_metadata.num_draft_tokens) + 1
    starts = to_device(torch.cumsum(counts, 0) - counts, batch.valid.device)
    rows = torch.where(batch.valid, starts[:, None] + torch.arange(n, device=starts.device), 0)
    rows = rows.to(logits.device)
    md = runner.input_batch.sampling_metadata
    penalized = not md.no_penalties
    constrained = _has_constraints(md)
    if md.all_greedy and not penalized and not constrained:
        row_tokens = logits.argmax(-1)[rows]  # argmax first: no [R, N, V] copy on the plain greedy path
    else:
        row_logits = logits[rows].float()  # [R, N, V]
        if penalized:
            row_logits = tree_penalties(row_logits, md, batch)
        if constrained:
            row_logits = tree_constraints(row_logits, md, batch)
        greedy = row_logits.argmax(-1)
        if md.all_greedy:
            row_tokens = greedy
        else:
            temp = md.temperature[:r].float().clamp(min=1e-5)
            scaled = row_logits / temp.view(r, 1, 1)
            flat = scaled.view(r * n, -1)
            k = md.top_k[:r].repeat_interleave(n) if md.top_k is not None else None
            p = md.top_p[:r].repeat_interleave(n) if md.top_p is not None else None
            flat = apply_top_k_top_p(flat, k, p)
            probs = torch.softmax(flat, -1).view(r, n, -1)
            noise = torch.empty_like(probs).exponential_()
            for i, gen in md.generators.items():  # per-request seeds
                if i < r:
                    noise[i].exponential_(generator=gen)
            sampled = sample_tokens(probs, noise)
            is_greedy = (md.temperature[:r] < 1e-5).view(r, 1)
            row_tokens = torch.where(is_greedy, greedy, sampled)
    walk = walk_tree(batch, torch.where(batch.valid, row_tokens, -1))
    depth = max(spec_decode_metadata.num_draft_tokens)
    out = walk.output_tokens[:, : depth + 1].to(torch.int32)

    # KV compaction in the target's caches (slot of row path[j] -> slot of row j), and the order
    # of the step's tokens with each request's accepted path first: vLLM's DFlash input prep trims
    # a rejected suffix. The proposer applies that order to the context it is handed (the runner's
    # own buffers stay as they are: they are the target's step state).
    moves = accepted_path_moves(batch, walk.path_rows, step.row_index, step.slot_mapping)
    _compact_target_caches(runner, moves.src_slots, moves.dst_slots)
    runner.drafter.context_order = moves.context_order
    # The drafter's context positions stay sequential: after the reorder the accepted path sits at
    # ctx, ctx + 1, ... (its depths), and the rejected rows after it, at positions no accepted row
    # has. With the tree's positions (ctx + depth) a rejected row would share an accepted row's
    # position, and vLLM's DFlash context store would overwrite that row's K/V with it.
    runner.drafter.context_positions = step.sequential_positions
    runner.drafter.step_tokens = out  # the n-gram model's new tokens (DDTreeProposer._observe)
    proposer = runner.drafter
    proposer.stats.record(batch.num_rows - 1, batch.depths.max(dim=1).values, walk.num_accepted)
    if proposer.auto is not None:
        _calibrate(proposer, step, walk.path_rows)
    logprobs = None
    if md.max_num_logprobs is not None:
        path_rows = rows.gather(1, walk.path_rows[:, : depth + 1].clamp(min=0).to(rows.device))
        logprobs = path_logprobs(runner.sampler, logits, path_rows, out, md.max_num_logprobs)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)


def _calibrate(proposer: DDTreeProposer, step: TreeStep, path_rows: Tensor) -> None:
    """Feed the automatic budget's calibrations: the step's measured acceptance and its size.

    Only nodes the drafter ranked count (finite score): a prompt-lookup branch's nodes are neither
    predicted nor counted as accepted, so the drafter's confidence is fitted to its own nodes.
    """
    batch = step.batch
    verified = batch.valid[:, 1:] & step.from_tree.view(-1, 1)
    scores = step.node_scores.to(path_rows.device)  # [R, N - 1]: node j is verify row j + 1
    pad = torch.full((scores.shape[0], 1), -math.inf, dtype=scores.dtype, device=scores.device)
    scores = torch.cat([scores, pad], dim=1)  # + a column the padding of path_rows reads
    nodes = path_rows[:, 1:]  # accepted rows after the root, -1 padded
    node_index = torch.where(nodes > 0, nodes - 1, scores.shape[1] - 1).clamp(max=scores.shape[1] - 1)
    # [R, N - 1]: the accepted nodes (padding lands in the extra column, dropped); infinite scores
    # (lookup nodes) are left out by the calibration itself.
    on_path = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, node_index, nodes > 0)
    accepted = on_path[:, :-1] & step.from_tree.to(path_rows.device).view(-1, 1)
    proposer.auto.observe_acceptance(step.node_scores, verified, accepted)
    if step.step_size is not None:  # the step verified trees only: its cost is known
        proposer.pending_step = step.step_size


def tree_penalties(row_logits: Tensor, md, batch: TreeBatch) -> Tensor:
    """Presence, frequency and repetition penalties for every verify row, as vLLM applies them.

    The tokens a row's distribution is penalised for are the request's output so far (its last
    token is the tree's root) plus the draft tokens on the row's path: the row's own token and its
    ancestors'. This is vLLM's rule for a chain (rejection_sampler._combine_outputs_with_spec_tokens)
    applied to each root-to-node path, built as one padded tensor, with vLLM's own penalty op.
    row_logits [R, N, V] float32 -> penalised [R, N, V].
    """
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.utils.torch_utils import make_tensor_with_pad

    r, n, v = row_logits.shape
    dev = row_logits.device
    outputs = make_tensor_with_pad(md.output_token_ids[:r], pad=v, device="cpu", dtype=torch.int64).to(dev)
    outputs = outputs.masked_fill(outputs < 0, v)  # async-scheduling placeholders
    on_path = (batch.ancestors & batch.valid.unsqueeze(1)).to(dev)  # [R, N, N]: row i's path includes row j
    on_path[:, :, 0] = False  # the root is already the last output token
    path_tokens = torch.where(on_path, batch.tokens.to(dev).unsqueeze(1), v)  # [R, N, N], pad v
    row_outputs = torch.cat([outputs.unsqueeze(1).expand(r, n, -1), path_tokens], 2).view(r * n, -1)

    def per_row(x: Tensor) -> Tensor:
        return x[:r].repeat_interleave(n, 0)

    flat = apply_penalties(row_logits.reshape(r * n, v), per_row(md.prompt_token_ids), row_outputs,
                           per_row(md.presence_penalties), per_row(md.frequency_penalties),
                           per_row(md.repetition_penalties))
    return flat.view(r, n, v)


def _min_tokens_state(md) -> dict:
    """vLLM's min_tokens processor state: req index -> (min_tokens, output ids, stop ids, structured)."""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    for proc in md.logitsprocs.non_argmax_invariant:
        if isinstance(proc, MinTokensLogitsProcessor):
            return proc.min_toks
    return {}


def _has_constraints(md) -> bool:
    return md.allowed_token_ids_mask is not None or bool(md.bad_words_token_ids) or bool(_min_tokens_state(md))


def tree_constraints(row_logits: Tensor, md, batch: TreeBatch) -> Tensor:
    """allowed_token_ids, bad_words and min_tokens for every verify row, as vLLM applies them to a chain.

    Replaces the constraint part of ``RejectionSampler.apply_logits_processors`` (rejection_sampler.py:307),
    which covers exactly these three (plus penalties, see :func:`tree_penalties`); logit_bias and
    min_p are refused for every speculative method by vLLM itself. Each row is treated as the
    next position after its root-to-node path: min_tokens masks the stop tokens while
    ``len(output) + depth < min_tokens``; a bad word's last token is masked where the output so far
    plus the row's path ends with the word's other tokens. row_logits [R, N, V] -> [R, N, V].
    """
    r, n, v = row_logits.shape
    dev = row_logits.device
    if md.allowed_token_ids_mask is not None:  # True = not allowed; the same for every row of a request
        row_logits = row_logits.masked_fill(md.allowed_token_ids_mask[:r].unsqueeze(1).to(dev), float("-inf"))
    for i, (min_toks, out_ids, stop_ids, _) in _min_tokens_state(md).items():
        if i >= r or not stop_ids:
            continue
        too_short = (len(out_ids) + batch.depths[i].to(dev)) < min_toks  # [N]
        stops = torch.tensor(sorted(stop_ids), device=dev)
        row_logits[i, :, stops] = row_logits[i, :, stops].masked_fill(too_short.unsqueeze(1), float("-inf"))
    if md.bad_words_token_ids:
        from vllm.v1.sample.ops.bad_words import apply_bad_words

        # Host-side, like vLLM's own (apply_bad_words_with_drafts): only requests that set bad_words pay.
        tokens, depths = batch.tokens.tolist(), batch.depths.tolist()
        on_path = (batch.ancestors & batch.valid.unsqueeze(1)).tolist()
        for i, words in md.bad_words_token_ids.items():
            if i >= r:
                continue
            pasts = []
            for j in range(int(batch.num_rows[i])):
                path = sorted((k for k in range(1, n) if on_path[i][j][k]), key=lambda k: depths[i][k])
                pasts.append(list(md.output_token_ids[i]) + [tokens[i][k] for k in path])
            apply_bad_words(row_logits[i], {j: words for j in range(len(pasts))}, pasts)
    return row_logits


def path_logprobs(sampler, logits: Tensor, path_rows: Tensor, out: Tensor, num_logprobs: int):
    """Logprobs of the emitted tokens, in the rejection sampler's layout (vLLM raw modes).

    path_rows [R, D + 1]: logits row of each emitted position (the accepted path, then the bonus);
    out [R, D + 1] emitted tokens, -1 past the end (those positions are dropped by vLLM's
    parse_output, like the rejection sampler's rejected ones).
    """
    raw = logits[path_rows.reshape(-1)].float()
    if sampler.logprobs_mode == "raw_logprobs":
        raw = sampler.compute_logprobs(raw)
    tokens = out.reshape(-1).to(torch.int64).clamp(min=0)
    return sampler.gather_logprobs(raw, num_logprobs, tokens)


def _compact_target_caches(runner, src_slots: Tensor, dst_slots: Tensor) -> None:
    """Apply the slot moves to every target attention layer (the drafter rewrites its own context)."""
    found = getattr(runner, "_ddtree_target_caches", None)
    if found is None:  # the layer caches are allocated once; look them up on the first step
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
        from vllm.platforms import current_platform

        drafter_layers = getattr(runner.drafter, "_draft_attn_layer_names", set())
        layers = get_layers_from_vllm_config(runner.vllm_config, Attention)
        caches = [layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
                  for name, layer in layers.items() if name not in drafter_layers]
        # P9 decides the backend the same way: ours on the CPU, vLLM's FlashInfer on a GPU.
        found = runner._ddtree_target_caches = (caches, "cpu" if current_platform.is_cpu() else "flashinfer")
    caches, layout = found
    move_slots_(caches, src_slots, dst_slots, layout)
