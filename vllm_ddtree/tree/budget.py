"""The automatic tree budget (BASTION) while decoding: the controller that ties the pieces together.

Each step it asks the speculation gate whether to draft at all (`gate.py`), how wide to build,
and which budget per request to verify: `allocate.py` maximises A(N) - rate * C(N) over the batch,
A the expected accepted length from the drafter's calibrated prefix probabilities (`acceptance.py`),
C the calibrated cycle cost (`cost.py`), rate the throughput its plans reach (over many steps that,
not each step's own A / C, maximises tokens per second). After the step it feeds the measured
acceptance and step time back to the calibrations.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .acceptance import AcceptanceCalibration, LookupCalibration
from .allocate import BudgetPlan, check_budget_bounds, allocate_batch, batch_estimate
from .cost import CostCalibration, CostModel
from .gate import SpeculationGate


@dataclass
class AutoBudget:
    """The automatic tree budget while decoding: a cost model and a drafter confidence, both fitted
    to what the decoder measures. One object per decoder; the vLLM proposer and the reference decoder
    drive it the same way each step:

        if not auto.speculate(num_requests):               # with a gate: no drafting this step
            ... one target step ...; auto.observe_ar_step(num_requests, seconds)
        width = auto.build_width(num_requests)             # build the tree this wide (host int)
        budgets = auto.choose(tree.scores, ctx_lens)       # [R] nodes per request (truncate the tree)
        auto.grow(largest)                                 # host int: the largest tree kept
        ... verify, walk ...
        auto.observe_acceptance(scores, verified, accepted)           # on device, no sync
        auto.observe_step(tokens, attn_pairs, context_total, seconds) # the step's measured cycle time

    While the cost is uncalibrated, `choose` returns the exploration sizes in turn (every step stays
    lossless; only its size is forced), each kept from a tree built at least `min_width` wide, as in
    operation: a 1-node step built 1 wide skips most of the drafter's LM head and would teach the fit
    a cost no operating step has. After that, trees are built only twice as wide as the largest one
    kept last step (at least `min_width`): the drafter's LM head runs on min(depth, width) positions,
    and candidate selection and n-gram scoring cost grow with the width, while the controller can
    still double each step.

    A node's predicted acceptance is exp(beta * its tree score) times its score bin's reliability
    (`AcceptanceCalibration`): the score the tree was built by
    (`DraftTree.scores`: the drafter's prefix log-probability, plus the weighted n-gram term when
    rescoring), so the gains follow the tree's own best-first order. With rescoring, the drafter's
    log-probability alone undervalues the nodes the n-gram promoted and, through the running minimum
    of `node_gains`, every node after them: the budget then came out too small (exact replay,
    30 HumanEval prompts: 0.961x the best fixed budget's modelled tokens/s with it, 0.980x with scores).

    Each step buys the nodes worth more than the throughput the controller's own plans have reached
    (`rate_at`: EMA of planned tokens over EMA of planned seconds, per batch size class; see
    `allocate_batch`), not the nodes that maximise that one step's tokens per second.
    """

    cost: CostModel
    min_budget: int
    max_budget: int
    calibration: CostCalibration | None = None
    acceptance: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    build_cap: int = 0
    min_width: int = 8  # never build a tree narrower than this (the drafter's depths scale with it)
    rate_alpha: float = 0.05
    planned_tokens: dict = field(default_factory=dict)  # size class -> [] EMA of the chosen plans' expected tokens
    planned_seconds: dict = field(default_factory=dict)  # size class -> [] EMA of their predicted step seconds
    lookup: LookupCalibration | None = None  # with a prompt-lookup path: its nodes' measured acceptance
    gate: SpeculationGate | None = None  # lets the budget choose no tree at all (min_tree_budget 0)

    def __post_init__(self) -> None:
        check_budget_bounds(self.min_budget, self.max_budget, self.max_budget)
        if not 0 < self.rate_alpha <= 1:
            raise ValueError(f"rate_alpha must be in (0, 1], got {self.rate_alpha}")
        if self.calibration is None:
            self.calibration = CostCalibration.for_range(self.cost, self.min_budget, self.max_budget)
        self.build_cap = self.build_cap or self.max_budget

    def to(self, device: torch.device | str) -> "AutoBudget":
        """The calibrations' state on `device` (in place; returns self): their updates read the step's
        device tensors, so state left on the host would make every update a device-to-host copy.
        The cost model's numbers get their tensors there too (`CostModel.coefficients`)."""
        self.cost.coefficients(device)
        self.acceptance.to(device)
        if self.lookup is not None:
            self.lookup.to(device)
        return self

    @property
    def exploring(self) -> bool:
        return not self.calibration.calibrated

    def speculate(self, num_requests: int = 1) -> bool:
        """Whether this step drafts (host bool): always while the cost is being explored or without
        a gate, else the gate's choice (`SpeculationGate`)."""
        return self.gate is None or self.exploring or self.gate.speculate(num_requests)

    def observe_ar_step(self, num_requests: int, seconds: float) -> None:
        """The measured cycle time of a step the gate kept from drafting (decode only, no prefill)."""
        if self.gate is not None:
            self.gate.observe_ar_step(num_requests, seconds)

    def build_width(self, num_requests: int = 1) -> int:
        """Node slots to build this step (for `num_requests` requests): an exploration size, or the
        cap from the last choice."""
        explore = self.calibration.explore_budget(num_requests)
        return self._width_for(explore) if explore is not None else self.build_cap

    def _width_for(self, kept: int) -> int:
        """The width built for a tree of `kept` nodes: at least `min_width`, at most `max_budget`."""
        return min(self.max_budget, max(self.min_budget, self.min_width, kept))

    def choose(self, scores: Tensor, context_lens: Tensor) -> Tensor:
        """[R] budgets for a tree built at `build_width()` (scores [R, width]: `DraftTree.scores`).

        While exploring: the exploration size, on a tree built as wide as any tree is (`min_width`),
        so the measured step costs what a step of that size costs in operation."""
        return self.choose_plan(scores, context_lens).budgets

    def choose_plan(self, scores: Tensor, context_lens: Tensor, lookup_valid: Tensor | None = None) -> BudgetPlan:
        """`choose`, as a plan; with `lookup_valid` [R, L] (each request's proposed lookup path, needs
        `lookup`) the lookup nodes compete with the tree's for the step, and `plan.extra` [R] says how
        many of each path to verify (all of it while exploring). `plan` and then `record_plan`."""
        plan = self.plan(scores, context_lens, lookup_valid)
        self.record_plan(plan, scores.shape[0])
        return plan

    def record_plan(self, plan: BudgetPlan, num_requests: int) -> None:
        """The host's part of a choice, after `plan`: the gate queues the plan's expected tokens (not
        while exploring: those sizes are forced, not chosen)."""
        if self.gate is not None and not self.exploring:
            self.gate.observe_plan(plan, num_requests)

    def plan(self, scores: Tensor, context_lens: Tensor, lookup_valid: Tensor | None = None,
             rows: Tensor | None = None) -> BudgetPlan:
        """The device's part of `choose_plan`: the plan, and the batch size class's rate moved on.

        Once the cost is calibrated and the class has its first plan, every number it reads from
        the state is a tensor updated in place (the cost model's `coefficients`, the drafter's
        confidence exponent, the lookup path's acceptance, the class's rate), so a capture of it (a
        CUDA graph per batch size) replays what it computes eagerly while the state moves on.

        `rows` ([] int): the real requests of a batch padded past them (`allocate_batch`), padded
        within their size class (`step.padded_rows`), so the class, its rate and capture state are
        the real batch's."""
        if lookup_valid is not None and self.lookup is None:
            raise ValueError("choose_plan got a lookup path but the AutoBudget has no LookupCalibration")
        logp = self.acceptance.rescale(scores)
        extra_gains = None if lookup_valid is None else self.lookup.gains(lookup_valid)
        if self.exploring:  # forced sizes, the whole lookup path; the plan is the estimate of that
            r = scores.shape[0]
            kept = min(self.calibration.explore_budget(r), scores.shape[1])
            budgets = torch.full((r,), kept, dtype=torch.int64, device=scores.device)
            extra = None if lookup_valid is None else lookup_valid.sum(dim=1).to(scores.device)
            return batch_estimate(logp, budgets, context_lens.float(), self.cost, extra_gains, extra)
        width = scores.shape[1]
        r = scores.shape[0]
        c = SpeculationGate.size_class(r)
        plan = allocate_batch(logp, context_lens.float(), self.cost, min(self.min_budget, width), width,
                              self.rate_at(r), extra_gains=extra_gains, rows=rows)
        if c not in self.planned_tokens:  # the class's first plan (a step's own best ratio) seeds its rate
            self.planned_tokens[c], self.planned_seconds[c] = plan.expected_tokens.clone(), plan.step_seconds.clone()
        else:
            a = self.rate_alpha
            self.planned_tokens[c].mul_(1 - a).add_(plan.expected_tokens, alpha=a)
            self.planned_seconds[c].mul_(1 - a).add_(plan.step_seconds, alpha=a)
        return plan

    def capture_state(self, num_requests: int, device: torch.device | str) -> tuple | None:
        """What a capture of `plan` for `num_requests` requests depends on beyond its inputs' shapes:
        None while `plan` must run eagerly (the cost is being explored: forced sizes; or the batch
        size class has no rate yet: its first plan seeds it), else the generation of the tensors it
        reads that are ever replaced (the cost model's residual buffer, when a table outgrows it).
        A capture is valid while this stays the same."""
        if self.exploring or SpeculationGate.size_class(num_requests) not in self.planned_tokens:
            return None
        return (self.cost.coefficients(device).generation,)

    def rate_at(self, num_requests: int) -> Tensor | None:
        """[] tokens per second the chosen plans are expected to reach at `num_requests`' size class
        (`SpeculationGate.size_class`; None before its first plan). Per class: a batch of 32 reaches
        several times a lone request's tokens per second, and a node is worth buying when it gains
        more than the rate of its own batch size times what it costs; one rate for all sizes left a
        lone request after a loaded phase buying trees by the loaded server's bar."""
        c = SpeculationGate.size_class(num_requests)
        if c not in self.planned_tokens:
            return None
        return self.planned_tokens[c] / self.planned_seconds[c]

    def grow(self, largest: int) -> None:
        """Next step's width from the largest tree kept this step (a host int the caller already has)."""
        self.build_cap = self._width_for(2 * largest)

    def observe_acceptance(self, scores: Tensor, verified: Tensor, accepted: Tensor) -> None:
        """scores/verified/accepted [R, N]: the step's node scores (as given to `choose`), which nodes
        were verified, which of them are on the accepted path (`AcceptanceCalibration.update`)."""
        self.acceptance.update(scores, verified, accepted)

    def observe_lookup(self, proposed: Tensor, valid: Tensor, committed: Tensor) -> None:
        """Last step's lookup paths [R, L] against the tokens it committed [R, K] (`LookupCalibration`)."""
        self.lookup.update(proposed, valid, committed)

    def observe_step(self, tokens: float, attn_pairs: float, context_total: float, seconds: float,
                     fit: bool = True) -> None:
        """One measured cycle: total verified rows, sum of rows * (context + rows), context, seconds.

        fit=False: the time reaches the gate only, not the cost fit (a step whose drafter also caught
        up on the context of undrafted steps: its size is not all it paid for)."""
        if fit:
            self.calibration.add(tokens, attn_pairs, context_total, seconds)
        if self.gate is not None:
            self.gate.observe_drafted_step(seconds)

    def summary(self) -> dict:
        """The calibrated state, for logs and benchmark tables."""
        c = self.cost
        explored = self.calibration.explored_medians()
        return {"cost_calibrated": self.calibration.calibrated, "cost_intercept_ms": 1e3 * c.intercept,
                "cost_per_token_ms": 1e3 * c.per_token, "cost_knee_tokens": c.knee,
                "cost_residual_ms": {} if c.residual is None else {
                    int(i): round(1e3 * float(v), 1) for i, v in enumerate(c.residual.cpu()) if abs(float(v)) >= 5e-5},
                "cost_roofline_slope": c.slope,
                "drafter_confidence_exponent": float(self.acceptance.beta),
                "acceptance_reliability": [round(float(f), 2) for f in self.acceptance.reliability],
                "planned_tokens_per_s": {1 << (c - 1): round(float(t / self.planned_seconds[c]), 1)
                                         for c, t in sorted(self.planned_tokens.items())},
                # what the fit was given for each explored size, and what it predicts there
                "explored_step_ms": {int(p[0]): round(1e3 * p[3], 1) for p in explored},
                "predicted_step_ms": {int(p[0]): round(1e3 * float(c.correction * c.verify_seconds(
                    torch.tensor(p[0]), torch.tensor(p[1]), torch.tensor(p[2]))), 1) for p in explored},
                "lookup_acceptance": None if self.lookup is None else [round(float(q), 3) for q in self.lookup.acceptance],
                **({} if self.gate is None else {
                    # by size class, keyed by its smallest request count
                    "gate_advantage": {1 << (c - 1): round(a, 3) for c, a in sorted(self.gate.advantage.items())},
                    "gate_drafted_steps": self.gate.drafted,
                    "gate_undrafted_steps": self.gate.undrafted,
                    "gate_undrafted_step_ms": {r: round(1e3 * statistics.median(v), 1)
                                               for r, v in sorted(self.gate.ar_seconds.items())}})}
