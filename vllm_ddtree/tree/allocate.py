"""Budget choice for one step: per-node acceptance gains along the best-first order, and the batch
allocation that maximises the step's estimated tokens per second (or tokens minus rate x cost).

Expected accepted length of the best N-node tree: A(N) = 1 + sum of the first N nodes' prefix
probabilities under the drafter (the root/bonus token always counts 1). Along the best-first order
the gains are non-increasing, so A is concave; with PRESTO rescoring the order can put a less
probable prefix first, so gains are made non-increasing with a running minimum (a lower bound that
keeps A concave and the batch merge prefix-consistent).

Batch-aware allocation: one step verifies every request's tree together, so the cost depends on the
*total* number of tree tokens. `allocate_batch` merges all requests' (non-increasing) gains in one
best-first order and picks the total that maximises the batch's estimated tokens per second; for
separable concave gains and a cost of the total this is optimal, hence never worse than letting each
request choose alone. Maximised exactly with a cumulative sum and an argmax on device (no host
round trip, no first-descent heuristic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import constants
from .cost import CostModel

def node_gains(draft_logp: Tensor) -> Tensor:
    """Per-node acceptance gains [R, B] along the best-first order, made non-increasing; 0 if invalid
    (an invalid node's log-probability is -inf; every other is finite and at most 0)."""
    return torch.cummin(draft_logp.float().exp(), dim=1).values


@dataclass
class BudgetPlan:
    """Budgets for one step and the estimate that chose them.

    budgets            [R] int64   draft nodes per request
    expected_tokens    []  float   sum over requests of A_r(budget_r), bonus tokens included
    step_seconds       []  float   predicted cycle time of the step
    tokens_per_second  []  float   expected_tokens / step_seconds
    extra              [R] int64   nodes taken from each request's extra path (`extra_gains`; else None)
    """

    budgets: Tensor
    expected_tokens: Tensor
    step_seconds: Tensor
    tokens_per_second: Tensor
    extra: Tensor | None = None


def check_budget_bounds(min_budget: int, max_budget: int, width: int) -> None:
    if min_budget < 1:
        raise ValueError(f"min_budget must be >= 1, got {min_budget}")
    if max_budget < min_budget:
        raise ValueError(f"max_budget ({max_budget}) must be >= min_budget ({min_budget})")
    if width < max_budget:
        raise ValueError(f"the tree has {width} node slots but max_budget is {max_budget}; build it at max_budget")


def batch_estimate(draft_logp: Tensor, budgets: Tensor, context_lens: Tensor, cost: CostModel,
                   extra_gains: Tensor | None = None, extra: Tensor | None = None) -> BudgetPlan:
    """The batch's estimated throughput for a given allocation (the objective `allocate_batch` maximises).

    extra_gains [R, L] / extra [R]: an extra path's node gains and how many of them each request takes.
    """
    gains = node_gains(draft_logp)
    take = constants.arange(gains.shape[1], gains.device) < budgets[:, None]
    expected = (gains * take).sum() + gains.shape[0]
    nodes = budgets.sum()
    if extra_gains is not None:
        g = path_gains(extra_gains)
        expected = expected + (g * (constants.arange(g.shape[1], g.device) < extra[:, None])).sum()
        nodes = nodes + extra.sum()
    secs = cost.step_seconds(nodes, context_lens.sum(), context_lens.numel())
    return BudgetPlan(budgets, expected, secs, expected / secs, extra)


def path_gains(gains: Tensor) -> Tensor:
    """An extra path's per-node gains [R, L] made non-increasing along it (a node needs its parent)."""
    return torch.cummin(gains.float().clamp(min=0), dim=1).values


def choose_budgets(
    draft_logp: Tensor, context_lens: Tensor, cost: CostModel, min_budget: int = 1, max_budget: int | None = None
) -> BudgetPlan:
    """Per-request BASTION: each request maximises A(N) / C(N) with its own batch-1 cost.

    draft_logp [R, B]: `DraftTree.draft_logp` (best-first). Returns the argmax of each request's own
    estimate over N in [min_budget, max_budget]; the plan's totals are evaluated as one batch step.
    """
    r, width = draft_logp.shape
    max_budget = max_budget or width
    check_budget_bounds(min_budget, max_budget, width)
    gains = node_gains(draft_logp)[:, :max_budget]
    n = torch.arange(1, max_budget + 1, device=gains.device, dtype=torch.float32)
    accepted = 1.0 + torch.cumsum(gains, dim=1)  # [R, N]
    speed = accepted / cost.step_seconds(n[None, :], context_lens.float()[:, None], 1)
    speed[:, : min_budget - 1] = -math.inf
    budgets = speed.argmax(dim=1) + 1
    return batch_estimate(draft_logp, budgets, context_lens, cost)


def allocate_batch(
    draft_logp: Tensor, context_lens: Tensor, cost: CostModel, min_budget: int = 1, max_budget: int | None = None,
    rate: Tensor | float | None = None, extra_gains: Tensor | None = None, rows: Tensor | None = None,
) -> BudgetPlan:
    """Batch-aware BASTION: one best-first over all requests' nodes against the batch step cost.

    Every request gets at least `min_budget` nodes; the remaining node slots (up to `max_budget`
    each) are merged across requests by gain, and the total that maximises the batch's expected
    tokens per second is kept. Runs on device: a sort, a cumulative sum, an argmax.

    `rate` (tokens/s, a [] tensor or float): maximise expected tokens - rate * step seconds instead.
    Decoding runs many steps, and its throughput is sum(A) / sum(C), not the mean of A / C: that
    ratio of sums is maximised by buying each node whose gain exceeds `rate` times its cost, with
    `rate` the throughput achieved (Dinkelbach). One step's own A / C as the bar instead buys too
    little on confident steps and too much on unsure ones. With `rate` equal to this step's best
    A / C both objectives choose the same plan.

    `extra_gains` [R, L]: the predicted acceptance of each node of one more path per request that the
    drafter did not rank (a prompt-lookup continuation, `tree.add_branch`), 0 where there is none.
    Its nodes join the same best-first merge, priced by the same step cost, none forced; the plan's
    `extra` says how many of each request's path to verify.

    `rows` ([] int): the requests of a batch padded with rows past them (a captured step's shape)
    whose log-probs are -inf, context 0 and extra gains 0. Their nodes gain nothing and sort after
    every real node (ties keep row order), so the plan of the real rows is the unpadded batch's.
    """
    r, width = draft_logp.shape
    max_budget = max_budget or width
    check_budget_bounds(min_budget, max_budget, width)
    gains = node_gains(draft_logp)[:, :max_budget]
    forced = gains[:, :min_budget].sum()
    optional = gains[:, min_budget:]  # [R, W]
    if extra_gains is not None:
        optional = torch.cat([optional, path_gains(extra_gains).to(optional.device)], dim=1)  # [R, W + L]
    w = optional.shape[1]
    flat = optional.reshape(-1)
    # Stable sort: equal gains keep (request, position) order, so each request's picks stay a prefix.
    ranked, order = torch.sort(flat, descending=True, stable=True)
    cum = torch.nn.functional.pad(torch.cumsum(ranked, dim=0), (1, 0))  # [R*W + 1]: 0, then the running sums
    extra = constants.arange(r * w + 1, flat.device)  # optional nodes bought
    n = r if rows is None else rows  # the requests the step verifies (padding is not verified)
    total_nodes = extra + (float(r * min_budget) if rows is None else rows * min_budget)
    expected = n + forced + cum
    secs = cost.step_seconds(total_nodes, context_lens.sum(), n)
    if isinstance(rate, Tensor):
        rate = rate.to(secs.device)
    score = expected / secs if rate is None else expected - rate * secs
    best = score.argmax(dim=0, keepdim=True)  # [1]: index_select below, not expected[best] (a 0-dim index is read on the host)
    chosen = constants.arange(r * w, flat.device) < best
    picked = constants.filled((r * w,), False, torch.bool, flat.device).scatter(0, order, chosen).view(r, w)
    tree_w = max_budget - min_budget
    budgets = min_budget + picked[:, :tree_w].sum(dim=1)
    # The plan's estimate is the curves' point at `best` (what `batch_estimate` of these budgets
    # gives, up to float summation order): no second pass through the gains and the cost model.
    tokens, seconds = expected.index_select(0, best)[0], secs.index_select(0, best)[0]
    return BudgetPlan(budgets, tokens, seconds, tokens / seconds,
                      None if extra_gains is None else picked[:, tree_w:].sum(dim=1))
