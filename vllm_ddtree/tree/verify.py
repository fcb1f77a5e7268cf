"""Lossless verification: walk the tree with the target's own token at every row.

For every verify row the target gives the distribution of the next token after that row's path.
Take one token per row — the argmax (greedy) or one draw from the target's processed distribution
(sampling) — and walk from the root: while the row's token equals one of its children's tokens,
accept that child and continue from it. The walk emits the target's token of every row it visits,
so the first mismatch's token is the bonus. Each emitted token is a target sample given exactly
its ancestors, so the output has the target's distribution (DDTree §4.4); drafter probabilities
are never needed. All of it is gathers and scatters over [R, N] on the device; no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import constants
from .acceptance import AcceptanceCalibration
from .compile import TreeBatch, path_row_moves

PAD_TOKEN = -1


@dataclass
class WalkResult:
    """Result of walking a TreeBatch.

    output_tokens [R, L+1] int64  emitted tokens (accepted path's target tokens, bonus last), -1 pad
                                  (the [batch, max_spec_len + 1] layout vLLM's samplers return)
    num_emitted   [R]      int64  accepted nodes + 1
    path_rows     [R, L+1] int64  verify rows visited: 0 (root), then accepted nodes' rows; -1 pad
    accepted_rows [R, N]   bool   the verify rows on the accepted path, the root included (a row's
                                  index on the path is its depth)
    """

    output_tokens: Tensor
    num_emitted: Tensor
    path_rows: Tensor
    accepted_rows: Tensor

    @property
    def num_accepted(self) -> Tensor:
        """Accepted draft nodes per request (emitted tokens minus the bonus)."""
        return self.num_emitted - 1


def greedy_tokens(logits: Tensor) -> Tensor:
    """[R, N, V] target logits -> [R, N] argmax token per verify row."""
    return logits.argmax(dim=-1)


def sample_tokens(probs: Tensor, exponential_noise: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
    """[R, N, V] target probabilities (after temperature/top-k/top-p) -> [R, N], one draw per row.

    Uses the exponential race argmax(p / E), E ~ Exp(1), which is an exact categorical draw with no
    host synchronisation (the trick vLLM's samplers use). Pass `exponential_noise` to control the
    randomness per request (e.g. per-request seeds).
    """
    if exponential_noise is None:
        exponential_noise = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    if exponential_noise.shape != probs.shape:
        raise ValueError(f"noise shape {tuple(exponential_noise.shape)} must equal probs shape {tuple(probs.shape)}")
    return (probs.float() / exponential_noise).argmax(dim=-1)


def walk_tree(batch: TreeBatch, row_tokens: Tensor, width: int | None = None) -> WalkResult:
    """Accept the longest path whose tokens the target produces; see the module docstring.

    row_tokens [R, N]: the target's token for every verify row (`greedy_tokens` or `sample_tokens`).
    width: columns of `output_tokens` and `path_rows` (at least max_depth + 1, the default), -1
    padded: the layout a sampler's caller wants, with no pad of its own.
    """
    r, n = batch.tokens.shape
    if row_tokens.shape != (r, n):
        raise ValueError(f"row_tokens must be [{r}, {n}] (one token per verify row), got {tuple(row_tokens.shape)}")
    steps = batch.max_depth + 1 if width is None else width
    if steps < batch.max_depth + 1:
        raise ValueError(f"walk_tree width {width} cannot hold a path of depth {batch.max_depth} (its root included)")
    return _walk(batch.tokens, batch.parents, batch.depths, batch.valid, batch.ancestors, row_tokens, steps)


def _walk(tokens: Tensor, parents: Tensor, depths: Tensor, valid: Tensor, ancestors: Tensor, row_tokens: Tensor,
          steps: int) -> WalkResult:
    """`walk_tree` on a TreeBatch's fields ([R, N], ancestors [R, N, N]), `steps` columns wide."""
    r, n = tokens.shape
    device = tokens.device
    row_tokens = row_tokens.long()
    # A node matches when its token is the target's token at its parent. Siblings carry distinct
    # tokens, so the rows whose whole path matches form one path from the root: the accepted one.
    # Found for every row at once through the ancestor mask (a fixed number of ops, whatever the
    # depth), instead of stepping down the tree one depth at a time.
    # (The root's and the padding's matches do not matter: the root is on every path, and a padding
    # row is no valid row's ancestor.)
    matches = tokens == row_tokens.gather(1, parents.clamp(min=0))
    ok = matches | (parents < 0)  # the root (parent -1) is on every path
    # [R, N], the root included: every ancestor (the row itself included) matches (on bools,
    # ok >= ancestor is "ok or not an ancestor")
    accepted = valid & (ok[:, None, :] >= ancestors).all(dim=2)
    # path[r, d] = the accepted row at depth d: one scatter (the others land in a spare column).
    path = constants.filled((r, steps + 1), -1, torch.int64, device).scatter(
        1, torch.where(accepted, depths.clamp(max=steps - 1), steps), constants.arange_rows(r, n, device))
    path = path[:, :steps]
    out = torch.where(path >= 0, row_tokens.gather(1, path.clamp(min=0)), PAD_TOKEN)
    return WalkResult(output_tokens=out, num_emitted=accepted.sum(dim=1), path_rows=path, accepted_rows=accepted)


@dataclass
class PathSlotMoves:
    """Where a walked step's accepted path moves in the KV cache, and its rows' order.

    src_slots, dst_slots [R, L]  physical KV slot of row path[j + 1] -> that of row j + 1 (past the
                                 accepted path: the root's slot onto itself, a no-op)
    path_first           [R, N]  each request's verify rows, its accepted path first in path
                                 order, then its other rows in row order (valid ones first)
    """

    src_slots: Tensor
    dst_slots: Tensor
    path_first: Tensor


def path_slot_moves(path_rows: Tensor, accepted_rows: Tensor, depths: Tensor, row_slots: Tensor) -> PathSlotMoves:
    """The KV moves that make each accepted path contiguous, as physical slots, and the rows' order
    with the path first. path_rows [R, L + 1], accepted_rows [R, N] (`WalkResult`); depths [R, N];
    row_slots [R, N]: each verify row's physical KV slot. A fixed number of ops, no host read."""
    n = accepted_rows.shape[1]
    src_rows, dst_rows = path_row_moves(path_rows)
    # keys: a path row's index on the path (its depth, < n), then n + row for the others; valid rows
    # come first in a TreeBatch, so they precede the padding (keys are distinct: any sort will do)
    order = torch.where(accepted_rows, depths, constants.arange(2 * n, accepted_rows.device, start=n)).argsort(dim=1)
    return PathSlotMoves(row_slots.gather(1, src_rows), row_slots.gather(1, dst_rows), order)


@dataclass
class VerifiedStep:
    """What one verify step's device function (`verify_step`) returns.

    walk       the step's `WalkResult`
    sums       [4] float64  over the step's requests: requests with a tree, verify rows (roots
                            included), deepest node depths, emitted tokens (`DDTreeStats`)
    committed  []  float64  tokens the step commits: accepted nodes and one bonus per request
                            (`sums[3]`)
    moves      the accepted paths' KV moves and row order (`path_slot_moves`; given row slots)
    """

    walk: WalkResult
    sums: Tensor
    committed: Tensor
    moves: PathSlotMoves | None = None


def verify_step(tokens: Tensor, parents: Tensor, depths: Tensor, valid: Tensor, ancestors: Tensor,
                row_tokens: Tensor, width: int, node_scores: Tensor | None = None,
                acceptance: AcceptanceCalibration | None = None, row_slots: Tensor | None = None) -> VerifiedStep:
    """The verify side's device function: `walk_tree`, the step's statistics, the drafter's
    acceptance calibration fed (`AcceptanceCalibration.update_state`; its host count is the caller's),
    and, given each row's KV slot (row_slots [R, N]), the accepted paths' KV moves (`path_slot_moves`).

    Fields as `compile_tree` makes them ([R, N], ancestors [R, N, N]; a padding row has depth 0 and
    is no valid row's ancestor); row_tokens [R, N] the target's token per row; width: the walk's
    columns (>= the deepest node + 1); node_scores [R, N] each row's node's prefix score (-inf: the
    root, or not the drafter's ranking: neither predicted nor counted). Reads nothing back to the
    host: a capture of it (`step.verify_trees`) replays it.
    """
    walk = _walk(tokens, parents, depths, valid, ancestors, row_tokens, width)
    rows = valid.sum(dim=1)
    sums = torch.stack([rows > 1, rows, depths.amax(dim=1), walk.num_emitted]).sum(dim=1, dtype=torch.float64)
    if acceptance is not None and node_scores is not None:
        acceptance.update_state(node_scores, valid, walk.accepted_rows)
    moves = None if row_slots is None else path_slot_moves(walk.path_rows, walk.accepted_rows, depths, row_slots)
    return VerifiedStep(walk=walk, sums=sums, committed=sums[3], moves=moves)
