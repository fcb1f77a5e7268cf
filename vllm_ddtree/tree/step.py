"""The device part of one drafting step, from the drafter's top-k to the trees the step verifies.

    tree, plan = plan_trees(top_logp, top_ids, build, context_lens, auto, branch, valid, max_nodes)

One function of tensors whose shapes follow the host integers it is given (`build`, `max_nodes`, the
batch): it reads nothing back to the host, and with the automatic budget calibrated every number it
reads from the budget's state is a tensor updated in place (`AutoBudget.plan`). So it can be traced
or captured (a CUDA graph per batch size and build width) and replayed while serving moves the
state on. `plan_trees_with_lookup` finds the prompt-lookup path inside the same function: the token
history it reads is a fixed buffer written in place. The n-gram tables' work (counting the step's
tokens, rescoring) comes before it: their sizes follow the text seen so far. The proposer runs it
through `draft_trees`, which replays it from a capture per (size class, width):

    tree, plan, branch, valid = draft_trees(step, top_logp, top_ids, context_lens, slots, depth, graphs, key,
                                            observed, new_tokens, token_width)

The verify side's device parts have their functions too, captured the same way:

    scheduled = schedule_rows(proposed, nodes, table, step_ids, n, deepest, with_scores, graphs)  # before the forward
    verified = verify_trees(batch, row_tokens, node_scores, acceptance, graphs)   # walk, sums, calibration
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import Tensor

from . import constants
from .allocate import BudgetPlan
from .budget import AutoBudget
from .build import DraftTree, PrefixScorer, add_branch, build_tree
from .lookup import TokenHistory
from .acceptance import AcceptanceCalibration
from .compile import ScheduledRows, TreeBatch, scheduled_rows
from .graphs import StepGraphs
from .transfer import to_device, to_host
from .verify import PathSlotMoves, VerifiedStep, WalkResult, verify_step, walk_tree


def plan_trees(
    top_logp: Tensor,
    top_ids: Tensor,
    build: int,
    context_lens: Tensor,
    auto: AutoBudget | None = None,
    branch: Tensor | None = None,
    valid: Tensor | None = None,
    max_nodes: int | None = None,
    *,
    scorer: PrefixScorer | None = None,
    context_tail: Tensor | None = None,
    lam: float = 0.0,
    rows: Tensor | None = None,
) -> tuple[DraftTree, BudgetPlan | None]:
    """Each request's tree for this step: built `build` nodes wide, cut to the automatic budget's
    choice (if `auto`), with its lookup path added (if `branch`) as far as the budget bought it.

    top_logp/top_ids [R, D, K]: the drafter's top-k per depth; context_lens [R]: tokens before each
    root; branch/valid [R, L]: the lookup path and its valid prefix; max_nodes: node slots per request
    the scheduler takes (the path is cut there). Returns the trees (padded to at most `max_nodes`
    columns) and the budget's plan (None without `auto`). The host keeps its part of the plan:
    `auto.record_plan(plan, R)`. `rows` ([] int): the real requests of a batch padded past them
    (`draft_trees`); the padding's trees are empty and the plan is the real batch's.
    """
    tree = build_tree(top_logp, top_ids, build, max_budget=build, scorer=scorer,
                      context_tail=context_tail if scorer is not None else None, lam=lam, validate=False)
    plan = None
    if auto is not None:
        plan = auto.plan(tree.scores, context_lens, valid, rows=rows)
        tree = tree.truncate(plan.budgets)  # (at most the tree's width: what the plan was offered)
        if valid is not None:  # the lookup nodes the budget bought
            valid = valid & (constants.arange(valid.shape[1], valid.device) < plan.extra[:, None])
    if branch is not None:
        tree = add_branch(tree, branch, valid, max_nodes=max_nodes if max_nodes is not None else build + branch.shape[1])
    return tree, plan


def plan_trees_with_lookup(
    top_logp: Tensor,
    top_ids: Tensor,
    build: int,
    context_lens: Tensor | None,
    auto: AutoBudget | None,
    history: TokenHistory,
    slots: Tensor,
    length: int,
    max_nodes: int | None = None,
    *,
    padded: bool = False,
    scorer: PrefixScorer | None = None,
    context_tail: Tensor | None = None,
    lam: float = 0.0,
    rows: Tensor | None = None,
) -> tuple[DraftTree, BudgetPlan | None, Tensor, Tensor]:
    """`plan_trees` with each request's lookup path found first, in the same function: a capture of
    the step holds the lookup too (`history` is read where it lies, so its in-place writes reach
    every replay).

    slots [R]: each request's slot in `history` (`padded`: -1 for a row padded past the batch, which
    proposes nothing); length: the path's tokens. Returns the trees, the plan, and the lookup path
    the budget was offered (tokens, valid [R, length]: `TokenHistory.continuation`), all of it.
    """
    if padded:
        branch, valid = history.continuation(slots.clamp(min=0), length)
        valid = valid & (slots >= 0)[:, None]
    else:
        branch, valid = history.continuation(slots, length)
    tree, plan = plan_trees(top_logp, top_ids, build, context_lens, auto, branch, valid, max_nodes, scorer=scorer,
                            context_tail=context_tail, lam=lam, rows=rows)
    return tree, plan, branch, valid


def capture_width(build: int, cap: int) -> int:
    """The build width a captured step uses for `build`: the next power of two, at most `cap`.

    A capture is made per shape, and the automatic budget's width moves by small steps (twice the
    largest tree kept), so the step's shape keeps changing (measured in design.md §18). Widths
    rounded up take a few values, so a capture is replayed instead of made again. A wider build only
    offers the budget more candidates: the tree it keeps at a given size is the same (best first)."""
    return min(cap, 1 << max(build - 1, 0).bit_length())


def draft_trees(step: Callable[..., tuple], top_logp: Tensor, top_ids: Tensor, context_lens: Tensor | None,
                slots: Tensor | None, depth: int, graphs: StepGraphs | None = None, key: tuple = (),
                observed: tuple[Tensor, Tensor] | None = None, new_tokens: Tensor | None = None,
                token_width: int = 0) -> tuple[DraftTree, BudgetPlan | None, Tensor | None, Tensor | None]:
    """`step` (`plan_trees` or `plan_trees_with_lookup` as the proposer closes over them) on a drafting
    step's top-k: (trees, plan, lookup path, its valid mask), cut to the batch's R requests.

    step(top_logp, top_ids, context_lens, slots, rows, observed, new_tokens): `rows` None for the
    batch as it is, else ([] int) the real requests of a padded batch, whose rows past them have
    log-probs -inf (no tree), context 0, slot -1 (no lookup path) and no new token. top_logp/top_ids
    [R, D, K], context_lens/slots [R] (each may be None). `new_tokens` (optional) [R, T]: the tokens
    this step committed per row, -1 after each row's last, which the step appends to the token
    history first (`TokenHistory.append`) and scores against `observed`, last step's lookup paths
    and their valid masks [R, L] per row of this batch (`AutoBudget.observe_lookup`), in the same
    function.

    With `graphs` (the proposer's `step_graphs`) it is replayed from a capture per `key` and shape:
    the batch padded to its size class (`padded_rows`), the drafted depths D to `depth` and the new
    tokens' columns T to `token_width`, so a server's steps take a few shapes whatever its batch, its
    depth cap and its accepted lengths. The inputs fill the leading block of their buffers
    (`StepGraphs`), past which an earlier replay's values lie: the captured step makes them the
    padding above through (R, D, T), the one input passed whole (a kept constant per value).
    `build_tree` never keeps a -inf candidate where a finite one is left, and sets every field of a
    node it does not keep to the same padding, so the real rows' trees are the unpadded batch's, bit
    for bit; the plan counts the real requests only (`rows`)."""
    if graphs is None:
        return step(top_logp, top_ids, context_lens, slots, None, observed, new_tokens)
    r, drafted, k = top_logp.shape
    if drafted > depth:
        raise ValueError(f"cannot pad {drafted} depths to {depth}")
    committed = 0 if new_tokens is None else new_tokens.shape[1]
    if committed > token_width:
        raise ValueError(f"cannot pad {committed} new tokens per row to {token_width}")
    total, device = padded_rows(r), top_logp.device
    proposed, proposed_valid = (None, None) if observed is None else observed
    length = 0 if proposed is None else proposed.shape[1]
    # the one input passed whole: R, D and the new tokens' columns T
    counts = constants.device_ints((r, drafted, committed), device)

    def padded_draft_step(top_logp, top_ids, context_lens, slots, proposed, proposed_valid, new_tokens, counts):
        live = constants.arange(total, device) < counts[0]  # [total]: the batch's rows
        drafted = (live[:, None] & (constants.arange(depth, device) < counts[1]))[:, :, None]  # [total, depth, 1]
        top_logp, top_ids = torch.where(drafted, top_logp, -math.inf), torch.where(drafted, top_ids, 0)
        context_lens = None if context_lens is None else torch.where(live, context_lens, 0)
        slots = None if slots is None else torch.where(live, slots, -1)
        if new_tokens is not None:
            new = live[:, None] & (constants.arange(token_width, device) < counts[2])
            new_tokens = torch.where(new, new_tokens, -1)
        observed = None if proposed is None else (proposed, proposed_valid & live[:, None])
        return step(top_logp, top_ids, context_lens, slots, counts[0], observed, new_tokens)

    inputs = (top_logp, top_ids, context_lens, slots, proposed, proposed_valid, new_tokens)
    scores, paths = (total, depth, k), (total, length)
    shapes = (scores, scores, *(None if x is None else (total,) for x in (context_lens, slots)),
              *(None if x is None else paths for x in (proposed, proposed_valid)),
              None if new_tokens is None else (total, token_width), None)
    dtypes = tuple(None if x is None else x.dtype for x in inputs)
    tree, plan, branch, valid = graphs((*key, shapes, dtypes), padded_draft_step, *inputs, counts, shapes=shapes)
    tree, plan = first_rows(tree, plan, r)
    return tree, plan, None if branch is None else branch[:r], None if valid is None else valid[:r]


def padded_rows(num_requests: int) -> int:
    """The batch size a captured step of `num_requests` requests is padded to: the largest of its size
    class (1, 2-3, 4-7, 8-15, ...; `SpeculationGate.size_class`), so the automatic budget's rate and
    capture state stay the class's, and a class is one capture per width."""
    return (1 << max(num_requests, 1).bit_length()) - 1


def first_rows(tree: DraftTree, plan: BudgetPlan | None, r: int) -> tuple[DraftTree, BudgetPlan | None]:
    """`plan_trees`' outputs for a padded batch, cut to its first `r` rows (views: a captured step's
    outputs are overwritten by its next replay, and the caller reads them before then)."""
    per_row = {f.name: getattr(tree, f.name)[:r] for f in dataclasses.fields(tree)
               if isinstance(getattr(tree, f.name), Tensor) and getattr(tree, f.name).dim() > 0}
    tree = dataclasses.replace(tree, **per_row)
    if plan is not None:
        plan = dataclasses.replace(plan, budgets=plan.budgets[:r], extra=None if plan.extra is None else plan.extra[:r])
    return tree, plan


def padded_width(n: int) -> int:
    """The verify width (rows per request, the root included) a captured verify step of `n` is padded
    to: the next power of two, so the automatic budget's changing tree sizes take a few shapes."""
    return 1 << max(n - 1, 0).bit_length()


def first_verified(verified: VerifiedStep, r: int, n: int) -> VerifiedStep:
    """`verify_step`'s outputs for a padded batch cut to its first `r` requests and `n` columns (views:
    a captured step's outputs are overwritten by its next replay, and the caller reads them before
    then). The sums and the committed count cover the real requests already (padding has no rows and
    emits nothing); so do the KV moves cut to the batch (a padding row's moves, made of an earlier
    replay's slots, are never applied)."""
    walk, moves = verified.walk, verified.moves
    walk = WalkResult(output_tokens=walk.output_tokens[:r, :n], num_emitted=walk.num_emitted[:r],
                      path_rows=walk.path_rows[:r, :n], accepted_rows=walk.accepted_rows[:r, :n])
    if moves is not None:
        moves = PathSlotMoves(moves.src_slots[:r, : n - 1], moves.dst_slots[:r, : n - 1], moves.path_first[:r, :n])
    return dataclasses.replace(verified, walk=walk, moves=moves)


def verify_trees(batch: TreeBatch, row_tokens: Tensor, node_scores: Tensor | None = None,
                 acceptance: AcceptanceCalibration | None = None, graphs: StepGraphs | None = None,
                 checked_replays: int = 0, host_read: Callable[[], ContextManager] = contextlib.nullcontext,
                 row_slots: Tensor | None = None) -> VerifiedStep:
    """`verify_step` on a verify step's trees: the walk, the statistics' sums, the drafter's
    acceptance calibration fed (its host count, `updates`, is the caller's), and given row_slots
    [R, N] (each verify row's KV slot) the accepted paths' KV moves and row order.

    With `graphs` (the proposer's `verify_graphs`) it is replayed from a capture per (size class,
    padded width): the batch padded to its size class (`padded_rows`) and the verify width to the
    next power of two (`padded_width`), so a server's steps take a few shapes; only `valid` is padded
    here, whole, the other inputs fill the leading block of their buffers (`StepGraphs`) and are read
    through it; the outputs are cut back to the batch's [R, N] (`first_verified`).

    The walk decides the output, so a capture's first `checked_replays` replays are compared with
    the eager walk (one host read each, under `host_read()`, e.g. vLLM's `gpu_sync_allowed`): one that
    differs is not used (this step's walk and sums are the eager ones; the calibration keeps what the
    replay fed it) and `graphs` turn off (`StepGraphs.turn_off`).

    row_tokens [R, N]: the target's token per verify row; node_scores [R, N]: each row's node's prefix
    score, -inf for the root and where it is not the drafter's ranking (a lookup path, a fallback
    chain: neither predicted nor counted), fed to `acceptance` when both are given.
    """
    scores = node_scores if acceptance is not None else None
    acceptance = acceptance if scores is not None else None
    r, n = batch.tokens.shape
    if graphs is None or graphs.failed is not None:  # (turned off: eager, unpadded)
        return verify_step(batch.tokens, batch.parents, batch.depths, batch.valid, batch.ancestors, row_tokens, n,
                           scores, acceptance, row_slots)
    rows, width = padded_rows(r), padded_width(n)
    valid = F.pad(batch.valid, (0, width - n, 0, rows - r))  # whole: the rest of every buffer is read through it
    block = (rows, width)
    shapes = (block, block, block, None, (rows, width, width), block, None if scores is None else block,
              None if row_slots is None else block)

    def padded_verify_step(tokens, parents, depths, valid, ancestors, row_tokens, scores, row_slots):
        # past the batch, an earlier replay's values: made the padding `compile_tree` makes (depth 0, no
        # ancestor) through `valid`; the walk reads the rest of them through it
        depths, ancestors = torch.where(valid, depths, 0), ancestors & valid[:, None, :]
        return verify_step(tokens, parents, depths, valid, ancestors, row_tokens, width, scores, acceptance, row_slots)

    key = ("verify", rows, width, scores is not None, row_slots is not None)
    verified = first_verified(graphs(key, padded_verify_step, batch.tokens, batch.parents, batch.depths, valid,
                                     batch.ancestors, row_tokens, scores, row_slots, shapes=shapes), r, n)
    if 0 < graphs.replays_of(key) <= checked_replays:
        eager, walk = walk_tree(batch, row_tokens, width=n), verified.walk
        differs = ((eager.output_tokens != walk.output_tokens).any() | (eager.path_rows != walk.path_rows).any()
                   | (eager.accepted_rows != walk.accepted_rows).any() | (eager.num_emitted != walk.num_emitted).any())
        with host_read():
            if bool(to_host(differs)):
                graphs.turn_off(f"a replayed verify step differed from the eager walk (key {key})")
                return verify_step(batch.tokens, batch.parents, batch.depths, batch.valid, batch.ancestors,
                                   row_tokens, n, row_slots=row_slots)
    return verified


#: The [R, N] int64 fields a captured `scheduled_rows` hands out stacked (one cut for all of them).
_SCHEDULED_INTS = ("tokens", "parents", "depths", "positions", "row_index", "logit_rows", "write_index")


def _packed_schedule(rows: ScheduledRows) -> tuple:
    """`scheduled_rows`' outputs as a capture hands them out: the int64 [R, N] fields stacked."""
    b = rows.batch
    ints = torch.stack([b.tokens, b.parents, b.depths, b.positions, rows.row_index, rows.logit_rows, rows.write_index])
    return ints, b.valid, b.num_rows, b.context_lens, b.ancestors, rows.node_scores


def first_scheduled(packed: tuple, r: int, n: int, max_depth: int) -> ScheduledRows:
    """A captured `scheduled_rows`' outputs (`_packed_schedule`) for a padded batch and width, cut to
    `r` requests and `n` rows each (views, read before the key's next replay), with the step's own
    deepest row as `max_depth`."""
    ints, valid, num_rows, context_lens, ancestors, node_scores = packed
    f = dict(zip(_SCHEDULED_INTS, ints[:, :r, :n].unbind(0)))
    batch = TreeBatch(tokens=f["tokens"], parents=f["parents"], depths=f["depths"], positions=f["positions"],
                      valid=valid[:r, :n], num_rows=num_rows[:r], context_lens=context_lens[:r],
                      ancestors=ancestors[:r, :n, :n], max_depth=max_depth)
    return ScheduledRows(batch=batch, row_index=f["row_index"], logit_rows=f["logit_rows"], write_index=f["write_index"],
                         node_scores=None if node_scores is None else node_scores[:r, :n])


def schedule_rows(proposed: Tensor, nodes: int, table: Tensor, step_ids: Tensor, n: int, deepest: int,
                  with_scores: bool, graphs: StepGraphs | None = None, checked_replays: int = 0,
                  host_read: Callable[[], ContextManager] = contextlib.nullcontext) -> ScheduledRows:
    """`compile.scheduled_rows` for a verify step: the host-made request table [6, R] (host tensor)
    goes to the step's device in one copy, and the rows are cut there from the proposer's trees.

    With `graphs` (the proposer's `verify_graphs`) it is replayed from a capture per (size class,
    padded width, block shape): the table padded on the host to the size class (padding requests keep
    no drafts), the rows to the next power of two with the ancestor masks' depth bound at the padded
    width, the proposed block to its own size class (rows past it are never gathered); the outputs are
    cut back to the batch's [R, n] (`first_scheduled`: the int64 fields come stacked, one cut for
    all). The rows decide the forward's attention, so a
    capture's first `checked_replays` replays are compared with the eager rows (one host read each,
    under `host_read()`): one that differs is not used and `graphs` turn off.
    """
    dev = step_ids.device
    r = table.shape[1]
    if graphs is None or graphs.failed is not None:  # (turned off: eager, unpadded)
        return scheduled_rows(proposed, nodes, to_device(table, dev), step_ids, n, deepest, with_scores)
    rows, width = padded_rows(r), padded_width(n)
    padded_table = to_device(F.pad(table, (0, rows - r)), dev)
    block = (padded_rows(proposed.shape[0]), proposed.shape[1])

    def padded_schedule(proposed, table, step_ids):
        return _packed_schedule(scheduled_rows(proposed, nodes, table, step_ids, width, width - 1, with_scores))

    key = ("schedule", rows, width, block, nodes, with_scores, tuple(step_ids.shape))
    scheduled = first_scheduled(graphs(key, padded_schedule, proposed, padded_table, step_ids,
                                       shapes=(block, None, None)), r, n, deepest)
    if 0 < graphs.replays_of(key) <= checked_replays:
        eager = scheduled_rows(proposed, nodes, padded_table[:, :r], step_ids, n, deepest, with_scores)
        pairs = [(getattr(eager.batch, f), getattr(scheduled.batch, f)) for f in
                 ("tokens", "parents", "depths", "positions", "valid", "num_rows", "context_lens", "ancestors")]
        pairs += [(getattr(eager, f), getattr(scheduled, f)) for f in ("row_index", "logit_rows", "write_index")]
        differs = torch.stack([(a != b).any() for a, b in pairs])
        if with_scores:
            differs = torch.cat([differs, (eager.node_scores != scheduled.node_scores).any().view(1)])
        with host_read():
            if bool(to_host(differs.any())):
                graphs.turn_off(f"a replayed verify schedule differed from the eager one (key {key})")
                return eager
    return scheduled

