"""Optimal draft-tree construction from per-depth drafter marginals (DDTree, Algorithm 1).

A DFlash drafter gives, for each depth d = 1..L after the root, a distribution q_d over the vocabulary.
Under the drafter's factorised model the expected accepted length of a prefix-closed tree is the sum
of its nodes' prefix probabilities, so the best tree of B nodes is the set of the B highest-scoring
prefixes. With prefix-aligned rescoring (PRESTO) the score of a token is

    s_d(t | path) = log q_d(t) + lambda_d * log rho(t | last n-1 tokens of the path)

and a prefix scores the sum of its tokens' scores. Every token score is <= 0, so a child never
outscores its parent and the top-B set stays prefix-closed.

Two implementations return identical trees:
- `build_tree_reference`: the readable best-first heap of Algorithm 1 (one request at a time, host).
- `build_tree`: batched depth-wise exact expansion on any device, no host synchronisation.
  The depth-d members of the global top-B are children of depth-(d-1) members and rank within the
  top B of the children of the kept depth-(d-1) set; so keeping the best B per depth and then the
  best B overall is exact, with static shapes.

Candidates: each depth's candidate tokens are the drafter's top-K at that depth (`topk_per_depth`);
the tree is exact over prefixes built from those candidates (K >= B makes it exact over all prefixes
when there is no rescoring, since only the top-B tokens of a depth can appear in a top-B tree).

Order and ties (identical in both implementations): nodes are returned best-first, i.e. sorted by
    (-score, depth, within-depth key)   with   within-depth key(x) = (-score(x), key(parent(x)), k(x))
where k is the token's candidate rank at its depth. Best-first order is parent-before-child, and the
first N nodes of a tree of budget B are exactly the tree of budget N.

Parent convention: `parents[r, i] == -1` means node i hangs off the root (the token committed last);
otherwise it is the index of the parent node in the same row.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from . import constants
from .transfer import to_device, to_host

NO_PARENT = -1


class PrefixScorer(Protocol):
    """A prefix-conditioned token model rho used to rescore draft tokens (see `ngram.py`)."""

    order: int  # n: rho conditions on the n-1 previous tokens

    def log_rho(self, history: Tensor, tokens: Tensor, rows: Tensor | None = None) -> Tensor:
        """history [R', F, n-1] (oldest first, -1 = no token), tokens [R', F, K] -> log rho [R', F, K], <= 0.

        rows [R']: which of the batch's requests these are (default: all R, in order).
        """
        ...


@dataclass
class DraftTree:
    """A batch of draft trees, nodes best-first (parent before child), padded to the largest budget.

    tokens      [R, B] int64  token id of each node (0 where not valid)
    parents     [R, B] int64  index of the parent node, NO_PARENT (-1) for children of the root
    depths      [R, B] int64  1..L (the root, depth 0, is not a node)
    scores      [R, B] float  cumulative tree score (drafter log-prob + weighted n-gram term)
    draft_logp  [R, B] float  cumulative drafter log-probability of the prefix (no rescoring); without
                              rescoring the same tensor as `scores` (an op on both is made once)
    valid       [R, B] bool   node exists (within the request's budget and of finite score)
    num_nodes   [R]    int64  number of valid nodes; valid nodes are exactly the first num_nodes
    Padding (a node that is not valid): token 0, parent NO_PARENT, depth 0, scores -inf; so a valid
    node is one of depth >= 1 (what `tree_to_host` counts).
    """

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    scores: Tensor
    draft_logp: Tensor
    valid: Tensor
    num_nodes: Tensor
    max_depth: int

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.tokens.shape[1]

    def truncate(self, budgets: Tensor | int) -> "DraftTree":
        """The best-`budgets[r]` subtree of each request (a prefix of the best-first order)."""
        budgets = _budget_tensor(budgets, self.batch_size, self.tokens.device)
        keep = self.valid & (constants.arange(self.max_nodes, self.tokens.device) < budgets[:, None])
        return DraftTree(
            tokens=torch.where(keep, self.tokens, 0),
            parents=torch.where(keep, self.parents, NO_PARENT),
            depths=torch.where(keep, self.depths, 0),
            scores=(scores := torch.where(keep, self.scores, -math.inf)),
            draft_logp=scores if self.draft_logp is self.scores else torch.where(keep, self.draft_logp, -math.inf),
            valid=keep,
            num_nodes=keep.sum(dim=1),
            max_depth=self.max_depth,
        )


def add_branch(tree: DraftTree, tokens: Tensor, valid: Tensor, max_nodes: int) -> DraftTree:
    """The trees with one more root-to-leaf path each (e.g. a prompt-lookup continuation).

    tokens/valid [R, L]: the path's tokens from depth 1 (valid a prefix per request). The part of
    the path the tree already has is shared; the rest is appended after the tree's nodes (parent
    before child), at most `max_nodes` nodes per request in all, so the path is cut at the end.
    Appended nodes score -inf (the drafter did not rank them: calibrations and truncation see them
    as the last). Batched on the device, log2(L) passes over [R, B], no host synchronisation.
    Returns a tree padded to min(B + L, max_nodes) columns (B if the tree is already wider).
    """
    r, b = tree.tokens.shape
    length = tokens.shape[1]
    dev = tree.tokens.device
    width = max(min(b + length, max_nodes), b)
    tokens, valid = tokens.to(dev).long(), valid.to(dev)
    # The part of the path the tree has: a node is on it when it and each of its ancestors hold the
    # path's token at their depth. Ancestors by pointer doubling over [R, B + 1] (column B is the
    # root, its own parent): ceil(log2 L) passes, not one per path depth (siblings hold distinct
    # tokens, so the nodes on the path form one chain).
    # [R, 1 + max(L, depth)]: the path's token at each depth, -1 (no token) at depth 0, where the
    # path is not valid and past its end; a node holds the path's token when it matches its depth's
    path_at = torch.nn.functional.pad(torch.where(valid, tokens, -1), (1, max(tree.max_depth - length, 0)), value=-1)
    holds = path_at.gather(1, tree.depths) == tree.tokens  # (padding: depth 0)
    ok = torch.cat([holds, constants.filled((r, 1), True, torch.bool, dev)], dim=1)
    # parents, the root's children's (-1) made the root column B
    up = torch.cat([tree.parents.remainder(b + 1), constants.filled((r, 1), b, torch.int64, dev)], dim=1)
    for _ in range(math.ceil(math.log2(length)) - 1 if length > 1 else 0):
        ok = ok & ok.gather(1, up)
        up = up.gather(1, up)
    if length > 1:  # the last pass (its ancestors' ancestors would not be read)
        ok = ok & ok.gather(1, up)
    shared, node = torch.where(ok[:, :b], tree.depths, 0).max(dim=1, keepdim=True)  # [R, 1] path depths the
    node = torch.where(shared > 0, node, NO_PARENT)                                  # tree has; its deepest node
    # New nodes: path depths shared+1.. (while valid), at slots num_nodes.., each the previous one's
    # child: path depth j + 1 goes to slot num_nodes + j - shared, new when that is num_nodes or past.
    num_nodes = tree.num_nodes[:, None]
    slot = (num_nodes - shared) + constants.arange(length, dev)  # [R, L]
    new = valid & (slot >= num_nodes) & (slot < min(width, max_nodes))
    parent = torch.where(slot == num_nodes, node, slot - 1)
    # The integer fields as one [3, R, B] block, written at once: a new node's values go to its slot,
    # the others' to a spare last column that is cut off. Padding is 0 in all three; a node is valid
    # where its depth is >= 1, and a padding node's parent is made NO_PARENT after (DraftTree).
    out = torch.nn.functional.pad(torch.stack([tree.tokens, tree.parents, tree.depths]), (0, width + 1 - b))
    added = torch.stack([tokens, parent, constants.arange_rows(r, length + 1, dev, start=1)])
    out.scatter_(2, torch.where(new, slot, width).expand(3, r, length), added)
    tokens_out, parents_out, depths_out = out[:, :, :width].unbind(0)
    valid_out = depths_out > 0
    # Appended nodes score -inf, as padding does: the scores only widen.
    pad = (0, width - b)
    return DraftTree(
        tokens=tokens_out,
        parents=torch.where(valid_out, parents_out, NO_PARENT),
        depths=depths_out,
        scores=(scores := torch.nn.functional.pad(tree.scores, pad, value=-math.inf)),
        draft_logp=(scores if tree.draft_logp is tree.scores
                    else torch.nn.functional.pad(tree.draft_logp, pad, value=-math.inf)),
        valid=valid_out,
        num_nodes=valid_out.sum(dim=1),
        max_depth=max(tree.max_depth, length),
    )


@dataclass
class HostTrees:
    """A `DraftTree` batch on the host: each request's kept nodes as Python lists, best-first.

    What a scheduler that takes draft tokens as lists needs (vLLM's does), plus the deepest kept
    node of the batch (the next step's drafted depth follows it). Only the tokens are made lists
    at once (the scheduler's); the other fields' lists are made when read, from `padded`.
    """

    tokens: list[list[int]]
    deepest: int  # the largest depth of any kept node the drafter ranked (finite score; 0 if none)
    ranked: int  # the most nodes the drafter ranked in one request's tree (an `add_branch` path not counted)
    padded: tuple[Tensor, Tensor, Tensor, Tensor | None]  # host [R, B] tokens, parents, depths, scores (padding: 0, -1, 0, -inf)
    # the block copied, still on the device: float64 [R, >= 3B], B columns each of tokens, parents,
    # depths, then (copied with scores) scores; what the verify step cuts its rows from
    # (`compile.scheduled_rows`)
    on_device: Tensor | None = None

    def _kept(self, block: Tensor) -> list[list]:
        return [row[: len(t)] for row, t in zip(block.tolist(), self.tokens)]

    @property
    def parents(self) -> list[list[int]]:
        """Each request's kept nodes' parents (-1: the root)."""
        return self._kept(self.padded[1])

    @property
    def depths(self) -> list[list[int]]:
        """Each request's kept nodes' depths (1: a child of the root)."""
        return self._kept(self.padded[2])

    @property
    def scores(self) -> list[list[float]] | None:
        """Each request's kept nodes' scores (None unless copied `with_scores`)."""
        return None if self.padded[3] is None else self._kept(self.padded[3])


def tree_to_host(tree: DraftTree, with_scores: bool = False) -> HostTrees:
    """One device-to-host copy of the kept nodes (scores included), not one `.tolist()` per field.

    The fields are packed into one float64 block (token ids, rows and depths are exact in float64,
    and so are float32 scores), copied with `to_host`, and split on the host: the tokens into the
    scheduler's lists, the rest into padded host tensors. A row's kept nodes are its first ones
    (best first; an `add_branch` path right after them), so its count is its nodes of depth >= 1.
    """
    w = tree.max_nodes
    # The drafter-ranked nodes (an `add_branch` path scores -inf; a node that is not valid too, and
    # scores are never +inf): from the scores on the host when they are copied anyway, else their
    # depths and count made on the device.
    if with_scores:
        extra = [tree.scores]
    else:
        is_ranked = tree.scores > -math.inf
        extra = [torch.where(is_ranked, tree.depths, 0), is_ranked.sum(dim=1, keepdim=True)]
    # one cast: `cat` promotes the other fields to the first one's float64
    block = torch.cat([tree.tokens.double(), tree.parents, tree.depths, *extra], dim=1)
    packed = to_host(block)
    depths = packed[:, 2 * w : 3 * w].long()
    valid = depths > 0
    counts = valid.sum(dim=1).tolist()
    tokens = list(map(list.__getitem__, packed[:, :w].long().tolist(), map(slice, counts)))  # each row[:count], in C
    if with_scores:
        scores = packed[:, 3 * w :].float()
        is_ranked = scores > -math.inf
        ranked, ranked_counts = torch.where(is_ranked, depths, 0), is_ranked.sum(dim=1)
    else:
        ranked, ranked_counts = packed[:, 3 * w : 4 * w], packed[:, 4 * w]
    deepest = int(ranked.max()) if w and packed.shape[0] else 0
    most = int(ranked_counts.max()) if packed.shape[0] else 0
    padded = (torch.where(valid, packed[:, :w].long(), 0), torch.where(valid, packed[:, w : 2 * w].long(), NO_PARENT),
              torch.where(valid, depths, 0), torch.where(valid, scores, -math.inf) if with_scores else None)
    return HostTrees(tokens, deepest, most, padded, block)


#: At most this many bytes of float32 log-probabilities `topk_per_depth` holds at once. vLLM's memory
#: profile runs the largest head top-k (vllm_patches P20), and the KV cache gives up what it holds: at
#: Qwen3's vocabulary a row (one request's depth) is 0.6 MB of log-probs, 2.3 GB for 256 requests x 15
#: depths; in chunks of 512 MiB, 883 rows (rows are independent: the result is the same).
TOPK_CHUNK_BYTES = 512 << 20


def topk_per_depth(logits: Tensor, k: int, temperature: float = 1.0,
                   chunk_bytes: int = TOPK_CHUNK_BYTES) -> tuple[Tensor, Tensor]:
    """Drafter logits [R, L, V] -> (log-probs [R, L, k] sorted descending, token ids [R, L, k]).

    The candidates of each depth for `build_tree`. Runs on the logits' device, on at most
    `chunk_bytes` of float32 log-probabilities at a time: chunks of whole rows, each two ops (one
    chunk, and no concatenation, up to `chunk_bytes` / (4 V) rows).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [requests, depths, vocab], got shape {tuple(logits.shape)}")
    r, depth, vocab = logits.shape
    top_logp, top_ids = head_topk(logits.reshape(r * depth, vocab), None, vocab, k, temperature, chunk_bytes)
    return top_logp.view(r, depth, -1), top_ids.view(r, depth, -1)


def head_topk(hidden: Tensor, head: Callable[[Tensor], Tensor] | None, vocab: int, k: int,
              temperature: float = 1.0, chunk_bytes: int = TOPK_CHUNK_BYTES) -> tuple[Tensor, Tensor]:
    """Drafter hidden states [rows, H] -> its LM head -> (log-probs [rows, k] sorted descending, ids [rows, k]).

    `head` maps [n, H] to logits [n, vocab] (rows are independent); None means `hidden` already is
    the logits. The head runs on chunks of rows, each followed by its top-k, so neither the logits
    nor their float32 log-probabilities exist for more than `chunk_bytes` / (4 vocab) rows at once:
    a drafter sharing Qwen3's head would otherwise hold [256 x 15, 151936] logits (1.2 GB in bf16) at
    256 requests, memory the KV cache would give up (vLLM's profile runs the largest one, P20).
    """
    if vocab <= 0:
        raise ValueError("logits have an empty vocabulary dimension")
    if not 1 <= k <= vocab:
        raise ValueError(f"top-k must be in [1, vocab={vocab}], got {k}")
    if temperature <= 0:
        raise ValueError(f"drafter temperature must be > 0, got {temperature}")
    rows_per_chunk = max(1, chunk_bytes // (4 * vocab))

    def top(rows: Tensor) -> tuple[Tensor, Tensor]:
        logits = rows if head is None else head(rows)
        if logits.shape[-1] != vocab:
            raise ValueError(f"the drafter's head gave {logits.shape[-1]} logits per row, expected {vocab}")
        return _top_logp(logits, k, temperature)

    if hidden.shape[0] <= rows_per_chunk:
        return top(hidden)
    parts = [top(rows) for rows in hidden.split(rows_per_chunk)]
    return torch.cat([lp for lp, _ in parts]), torch.cat([ids for _, ids in parts])


def _top_logp(logits: Tensor, k: int, temperature: float) -> tuple[Tensor, Tensor]:
    x = logits if temperature == 1.0 else logits.float() / temperature  # a division is a full float copy
    logp = torch.log_softmax(x, dim=-1, dtype=torch.float32)  # the cast happens inside the kernel: no float copy
    return torch.topk(logp, k, dim=-1, sorted=True)


def _budget_tensor(budgets: Tensor | int, num_requests: int, device: torch.device) -> Tensor:
    if isinstance(budgets, int):
        return constants.filled((num_requests,), budgets, torch.int64, device)
    budgets = torch.as_tensor(budgets, device=device).to(torch.int64)
    if budgets.shape != (num_requests,):
        raise ValueError(f"budgets must have shape [{num_requests}], got {tuple(budgets.shape)}")
    return budgets


def _lambda_tensor(lam: float | Tensor, num_requests: int, depth: int, device: torch.device) -> Tensor:
    if isinstance(lam, (int, float)):
        if lam < 0 or math.isnan(lam):
            raise ValueError(f"n-gram weight lambda must be >= 0, got {lam}")
        return torch.full((num_requests, depth), float(lam), device=device)
    lam = torch.as_tensor(lam, device=device, dtype=torch.float32)
    if lam.dim() == 1 and lam.shape[0] == depth:
        lam = lam[None, :].expand(num_requests, depth)
    if lam.shape != (num_requests, depth):
        raise ValueError(f"lambda must be a float, [depths] or [requests, depths]; got {tuple(lam.shape)}")
    return lam


def check_draft_inputs(
    top_logp: Tensor,
    top_ids: Tensor,
    budgets: Tensor | int,
    context_tail: Tensor | None = None,
    scorer: PrefixScorer | None = None,
    lam: float | Tensor = 0.0,
    check_values: bool = True,
) -> None:
    """Raise ValueError naming what to change if the builder's inputs are malformed.

    Shape checks are free; `check_values` also inspects values (NaN, all -inf rows, budget < 1,
    lambda < 0), which needs a device-to-host copy: the engine's hot path skips it because its
    inputs come from log_softmax of the drafter.
    """
    if top_logp.dim() != 3:
        raise ValueError(f"top_logp must be [requests, depths, k], got shape {tuple(top_logp.shape)}")
    if top_ids.shape != top_logp.shape:
        raise ValueError(f"top_ids shape {tuple(top_ids.shape)} must equal top_logp shape {tuple(top_logp.shape)}")
    if top_logp.shape[1] == 0 or top_logp.shape[2] == 0:
        raise ValueError(f"need at least one depth and one candidate per depth, got shape {tuple(top_logp.shape)}")
    if top_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"top_ids must be an integer tensor, got {top_ids.dtype}")
    r = top_logp.shape[0]
    b = _budget_tensor(budgets, r, top_logp.device)
    if scorer is not None:
        if context_tail is None:
            raise ValueError("a prefix scorer needs context_tail: the last n-1 committed tokens (root last)")
        if context_tail.shape != (r, scorer.order - 1):
            raise ValueError(
                f"context_tail must be [requests={r}, n-1={scorer.order - 1}], got {tuple(context_tail.shape)}"
            )
    lam_t = _lambda_tensor(lam, r, top_logp.shape[1], top_logp.device)
    if not check_values:
        return
    if bool((b < 1).any()):
        raise ValueError(f"every tree budget must be >= 1, got {b.tolist()}")
    if bool(torch.isnan(top_logp).any()):
        raise ValueError("drafter log-probabilities contain NaN; check the drafter's logits")
    if bool((top_logp > 1e-4).any()):
        raise ValueError("top_logp must be log-probabilities (<= 0); pass log_softmax output, not logits")
    dead = torch.isneginf(top_logp).all(dim=-1)
    if bool(dead.any()):
        rows = dead.nonzero().tolist()
        raise ValueError(f"all candidates are -inf at (request, depth) {rows[:4]}; the drafter gave no usable token")
    if bool((lam_t < 0).any()) or bool(torch.isnan(lam_t).any()):
        raise ValueError("n-gram weight lambda must be >= 0 everywhere")


def build_tree(
    top_logp: Tensor,
    top_ids: Tensor,
    budgets: Tensor | int,
    *,
    max_budget: int | None = None,
    scorer: PrefixScorer | None = None,
    context_tail: Tensor | None = None,
    lam: float | Tensor = 0.0,
    validate: bool = True,
) -> DraftTree:
    """Best `budgets[r]` prefixes per request, batched and on device (no host synchronisation).

    top_logp, top_ids: [R, L, K] from `topk_per_depth` (log-probs sorted descending per depth).
    budgets: int or [R]; `max_budget` (static, defaults to the int budget or K*L-bounded max) fixes
      the padded width B so shapes do not depend on values; pass it in the engine to avoid a sync.
    scorer, context_tail [R, n-1], lam (float, [L] or [R, L]): optional prefix-aligned rescoring.
    validate: check inputs (see `check_draft_inputs`; value checks synchronise).
    """
    check_draft_inputs(top_logp, top_ids, budgets, context_tail, scorer, lam, check_values=validate)
    device = top_logp.device
    r, depth, k = top_logp.shape
    budgets_t = _budget_tensor(budgets, r, device)
    if max_budget is None:
        max_budget = budgets if isinstance(budgets, int) else int(budgets_t.max())
    b = max_budget
    lam_t = _lambda_tensor(lam, r, depth, device) if scorer is not None else None
    top_logp = top_logp.float()
    top_ids = top_ids.long()

    # Each depth's kept nodes, concatenated in depth order: score [R, T], q [R, T] (None: the score),
    # code [R, T] = parent within the previous depth * depth * k + column of the [R, depth * k]
    # candidates; sizes: the kept count per depth (T in all).
    if scorer is None:
        all_score, all_q, all_code, sizes = _expand_unscored(top_logp, b)
    else:
        all_score, all_q, all_code, sizes = _expand_rescored(top_logp, top_ids, b, scorer, context_tail, lam_t)
    all_q = all_score if all_q is None else all_q

    # Global best-first selection over all depths (concatenated in depth order; the stable sort
    # resolves equal scores by depth, then by within-depth order).
    # Parents index the previous depth's frontier: the concatenation's offset of that depth makes
    # them indices into the concatenation (depth 0's parent is the root, index 0: offset -1 = none).
    parent_offset, depth_of = _depth_layout(sizes, device)
    total = all_score.shape[1]
    width = min(b, total)
    scores, sel = _top_scores(all_score, width)
    all_parent = all_code // (depth * k) + parent_offset
    all_col = all_code % (depth * k)

    final_pos = constants.filled((r, total), NO_PARENT, torch.int64, device).scatter(
        1, sel, constants.arange_rows(r, width, device))
    sel_parent = all_parent.gather(1, sel)
    parents = torch.where(sel_parent >= 0, final_pos.gather(1, sel_parent.clamp(min=0)), NO_PARENT)
    valid = scores > -math.inf  # (log-probability sums: finite or -inf, never +inf; NaN is not valid)
    if not (isinstance(budgets, int) and budgets >= width):  # one budget for all that keeps every column: no cut
        valid = valid & (constants.arange(width, device) < budgets_t[:, None])
    tree = DraftTree(
        tokens=torch.where(valid, top_ids.reshape(r, depth * k).gather(1, all_col.gather(1, sel)), 0),
        parents=torch.where(valid, parents, NO_PARENT),
        depths=torch.where(valid, depth_of.take(sel), 0),
        scores=(kept := torch.where(valid, scores, -math.inf)),
        draft_logp=kept if scorer is None else torch.where(valid, all_q.gather(1, sel), -math.inf),
        valid=valid,
        num_nodes=valid.sum(dim=1),
        max_depth=depth,
    )
    if width < b:  # fewer candidate prefixes than the budget: pad to the static width
        tree = _pad_tree(tree, b)
    return tree


def _expand_unscored(top_logp: Tensor, b: int) -> tuple[Tensor, None, Tensor, tuple[int, ...]]:
    """`build_tree`'s per-depth expansion without rescoring: each depth's best (up to) b children of
    the previous depth's kept nodes, concatenated (see `build_tree`).

    Frontier scores and candidate log-probs are both sorted, so child (f, k) is preceded (ties
    included) by the (f+1)(k+1) - 1 children (f' <= f, k' <= k): only the "staircase" (f+1)(k+1) <= b
    can reach the top b (~b ln b candidates instead of F * K). The frontier sizes, and so every
    staircase, are known on the host (`_unscored_plan`): the candidates' log-probs of all depths are
    gathered at once, and a depth costs three ops (the parent's score, the sum, a sort); the kept
    columns and their codes are picked after the loop, for all depths at once. The last depth is
    not sorted: all its candidates go to `build_tree`'s selection, which sorts them with the rest
    (those past its best b lose there, as here; equal scores keep the candidates' order both ways).
    """
    r, depth, k = top_logp.shape
    plan = _unscored_plan(k, b, depth, top_logp.device)
    flat_logp = top_logp.reshape(r, depth * k)
    cand_logp = flat_logp.index_select(1, plan.columns).split(plan.counts, dim=1)
    # depth 1: the root's children are the candidates in rank order, already sorted
    values, ranks = [cand_logp[0]], [constants.arange_rows(r, plan.counts[0], top_logp.device)]
    for d in range(1, depth - 1):
        cand = values[-1].index_select(1, plan.parents[d]) + cand_logp[d]
        # sorted past the kept count where that is cheaper (the GPU's sort): the next depth's
        # staircase reads only its first columns, and the kept ones are picked below
        score, rank = _top_scores(cand, plan.kept[d], cut=False)
        values.append(score)
        ranks.append(rank)
    if depth > 1:  # the last depth, unsorted (plan.kept: all of it)
        values.append(values[-1].index_select(1, plan.parents[-1]) + cand_logp[-1])
        ranks.append(constants.arange_rows(r, plan.counts[-1], top_logp.device))
    # the kept columns of every depth's sorted candidates, and their codes
    pick, code_offset = _kept_columns(plan, tuple(v.shape[1] for v in values), top_logp.device)
    all_score = torch.cat(values, dim=1).index_select(1, pick)
    all_code = plan.codes.take(torch.cat(ranks, dim=1).index_select(1, pick) + code_offset)
    return all_score, None, all_code, plan.kept


@dataclass(frozen=True, eq=False)  # hashed by identity: made once per shape (`_unscored_plan`)
class _UnscoredPlan:
    """Host-known shapes of `_expand_unscored` for (k, b, depth): per depth its staircase (parents
    [n_d] within the previous depth's kept nodes), candidate count n_d and kept count min(b, n_d)
    (the last depth: n_d, left to the selection);
    the candidates' columns of the [R, depth * k] log-probs, all depths concatenated [sum n_d], and
    their codes [sum n_d]."""

    parents: tuple[Tensor, ...]
    counts: tuple[int, ...]
    kept: tuple[int, ...]
    columns: Tensor
    codes: Tensor


@functools.cache  # never evicted: a captured step reads these by address (tree/constants.py); one per shape
def _unscored_plan(k: int, b: int, depth: int, device: torch.device) -> _UnscoredPlan:
    parents, columns, codes, counts, kept = [], [], [], [], []
    f = 1  # depth 1's frontier: the root
    for d in range(depth):
        pf, col, code = _staircase(f, k, b, d, depth, device)
        parents.append(pf)
        columns.append(col)
        codes.append(code)
        counts.append(pf.numel())
        kept.append(min(b, pf.numel()) if d < depth - 1 else pf.numel())
        f = kept[-1]
    return _UnscoredPlan(tuple(parents), tuple(counts), tuple(kept), torch.cat(columns), torch.cat(codes))


@functools.cache  # never evicted: a captured step reads these by address (tree/constants.py); one per shape
def _kept_columns(plan: _UnscoredPlan, widths: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """For depths sorted to `widths` columns each and concatenated: [T] the columns of each depth's
    first kept (plan.kept) ones, and [T] the offset of that depth's codes in plan.codes."""
    pick, offset = [], []
    start = code_start = 0
    for width, keep, count in zip(widths, plan.kept, plan.counts):
        pick.append(torch.arange(start, start + keep))
        offset.append(torch.full((keep,), code_start, dtype=torch.int64))
        start += width
        code_start += count
    return to_device(torch.cat(pick), device), to_device(torch.cat(offset), device)


def _expand_rescored(top_logp: Tensor, top_ids: Tensor, b: int, scorer: PrefixScorer, context_tail: Tensor,
                     lam_t: Tensor) -> tuple[Tensor, Tensor, Tensor, tuple[int, ...]]:
    """`build_tree`'s per-depth expansion with rescoring: rescored children are no longer sorted per
    parent, so each depth expands the full F x K block (see `build_tree`)."""
    r, depth, k = top_logp.shape
    device = top_logp.device
    hist_len = scorer.order - 1
    # The kept frontier at the previous depth; depth 0 is the root alone.
    front_score = torch.zeros(r, 1, device=device)
    front_q = torch.zeros(r, 1, device=device)
    front_hist = context_tail.long()[:, None, :]  # [R, F, n-1]
    per_depth = []  # (score, q, code), each [R, F_d]
    for d in range(depth):
        f = front_score.shape[1]
        tok_score = top_logp[:, d, None, :].expand(r, f, k)
        cand_tokens = top_ids[:, d, None, :].expand(r, f, k)
        rho = scorer.log_rho(front_hist, cand_tokens)
        tok_score = tok_score + lam_t[:, d, None, None] * rho
        cand_score = (front_score[:, :, None] + tok_score).reshape(r, f * k)
        cand_q = (front_q[:, :, None] + top_logp[:, d, None, :]).reshape(r, f * k)
        pf, col, code = _staircase(f, k, f * k, d, depth, device)  # all pairs, in (parent, rank) order
        keep = min(b, cand_score.shape[1])
        # Equal scores keep (parent order, candidate rank) order -> the documented tie-breaking.
        score, order = _top_scores(cand_score, keep)
        kept = code.take(order)
        q = cand_q.gather(1, order)
        per_depth.append((score, q, kept))
        front_score, front_q = score, q
        if hist_len > 0:
            token = top_ids.reshape(r, depth * k).gather(1, kept % (depth * k))
            parent = kept // (depth * k)
            parent_hist = front_hist.gather(1, parent[:, :, None].expand(r, keep, hist_len))
            front_hist = torch.cat([parent_hist[:, :, 1:], token[:, :, None]], dim=2)
    return (torch.cat([s for s, _, _ in per_depth], dim=1), torch.cat([q for _, q, _ in per_depth], dim=1),
            torch.cat([c for _, _, c in per_depth], dim=1), tuple(s.shape[1] for s, _, _ in per_depth))


def _top_scores(scores: Tensor, k: int, cut: bool = True) -> tuple[Tensor, Tensor]:
    """The k best scores per row, best first, and their indices; equal scores in index order.
    `cut` False: at least k columns (all of them where that saves the ops of cutting).

    Two exact ways, chosen by device (as `compile.ancestor_mask`): on a GPU, where each op is a
    kernel launch, a stable descending sort (`_top_scores_by_sort`: one op, its values come with it);
    elsewhere packed keys and `topk` (`_top_scores_by_keys`), ~5x faster than the sort on a CPU.
    """
    if scores.device.type == "cuda":
        return _top_scores_by_sort(scores, k, cut)
    return _top_scores_by_keys(scores, k, cut)


def _top_scores_by_sort(scores: Tensor, k: int, cut: bool = True) -> tuple[Tensor, Tensor]:
    """`_top_scores` as a stable descending sort of the rows, cut to k (unless `cut` is False)."""
    values, indices = torch.sort(scores, dim=1, descending=True, stable=True)
    if not cut or k >= scores.shape[1]:
        return values, indices
    return values[:, :k], indices[:, :k]


def _top_scores_by_keys(scores: Tensor, k: int, cut: bool = True) -> tuple[Tensor, Tensor]:
    """`_top_scores` as one `topk` over unique keys: the float32 score is mapped to an order-preserving
    integer and packed with the (reversed) index into one int64, so `topk` has no ties to break
    arbitrarily. NaN never reaches here (inputs are validated).
    """
    bits = scores.float().contiguous().view(torch.int32).long()
    mag = bits & 0x7FFFFFFF
    key = torch.where(bits < 0, -mag, mag)  # -0.0 and +0.0 share key 0, as they compare equal
    idx = torch.arange(scores.shape[1], device=scores.device)
    packed = key * (1 << 32) + ((1 << 32) - 1 - idx)
    indices = torch.topk(packed, k, dim=1, sorted=True).indices
    return scores.gather(1, indices), indices


class _LazyChildren:
    """The children of one node when they are already in score order: computed on demand."""

    def __init__(self, score: np.float32, q: np.float32, logp: np.ndarray, n: int) -> None:
        self.score, self.q, self.logp, self.n = score, q, logp, n

    def __len__(self) -> int:
        return self.n if np.isfinite(self.score) else 0

    def __getitem__(self, j: int) -> tuple:
        return self.score + self.logp[j], self.q + self.logp[j], j


@functools.cache  # never evicted: a captured step reads these by address (tree/constants.py); one per shape
def _depth_layout(sizes: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """For frontiers of `sizes` nodes per depth, concatenated: [total] the offset of each node's
    parent depth in the concatenation (-1 at depth 1, whose parent is the root) and [total] its
    depth (1-based). Host-known shapes, made once per layout."""
    offsets = [-1] + [sum(sizes[:d]) for d in range(len(sizes) - 1)]
    # made on the device by fills: a host-to-device copy from pageable memory would wait for the device
    parent_offset = torch.cat([torch.full((n,), o, dtype=torch.int64, device=device) for n, o in zip(sizes, offsets)])
    depth_of = torch.cat([torch.full((n,), d + 1, dtype=torch.int64, device=device) for d, n in enumerate(sizes)])
    return parent_offset, depth_of


@functools.cache  # never evicted: a captured step reads these by address (tree/constants.py); one per shape
def _staircase(f: int, k: int, b: int, d: int, depth: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(parent, rank) pairs with (parent+1)(rank+1) <= b, parent < f, rank < k, in (parent, rank) order,
    at depth d of `depth`: [n] parent, [n] column d * k + rank of the [R, depth * k] candidates, and
    [n] their packed code parent * depth * k + column."""
    pf, pk = [], []
    for i in range(f):
        n = min(k, b // (i + 1))
        if n == 0:
            break
        pf.append(torch.full((n,), i, dtype=torch.int64))
        pk.append(torch.arange(n, dtype=torch.int64))
    parent, col = torch.cat(pf), torch.cat(pk) + d * k
    return to_device(parent, device), to_device(col, device), to_device(parent * (depth * k) + col, device)


def _pad_tree(tree: DraftTree, width: int) -> DraftTree:
    extra = width - tree.max_nodes

    def pad(x: Tensor, value: float | int | bool) -> Tensor:
        return torch.cat([x, constants.filled((x.shape[0], extra), value, x.dtype, x.device)], dim=1)

    return DraftTree(
        tokens=pad(tree.tokens, 0),
        parents=pad(tree.parents, NO_PARENT),
        depths=pad(tree.depths, 0),
        scores=(scores := pad(tree.scores, -math.inf)),
        draft_logp=scores if tree.draft_logp is tree.scores else pad(tree.draft_logp, -math.inf),
        valid=pad(tree.valid, False),
        num_nodes=tree.num_nodes,
        max_depth=tree.max_depth,
    )


def build_tree_reference(
    top_logp: Tensor,
    top_ids: Tensor,
    budgets: Tensor | int,
    *,
    max_budget: int | None = None,
    scorer: PrefixScorer | None = None,
    context_tail: Tensor | None = None,
    lam: float | Tensor = 0.0,
) -> DraftTree:
    """DDTree Algorithm 1 as a best-first heap, one request at a time; same result as `build_tree`.

    Popping a prefix pushes its next sibling (its parent's next child in score order) and its
    first child. Children of a node are sorted by (score desc, candidate rank), which is the
    candidate rank itself when there is no rescoring.
    """
    check_draft_inputs(top_logp, top_ids, budgets, context_tail, scorer, lam, check_values=True)
    r, depth, k = top_logp.shape
    device = top_logp.device
    budgets_t = _budget_tensor(budgets, r, device)
    b = max_budget if max_budget is not None else int(budgets_t.max())
    lam_t = _lambda_tensor(lam, r, depth, device) if scorer is not None else None
    top_logp = top_logp.float().cpu()
    top_ids = top_ids.long().cpu()
    hist_len = scorer.order - 1 if scorer is not None else 0

    out = {name: [] for name in ("tokens", "parents", "depths", "scores", "q")}
    for row in range(r):
        budget = int(budgets_t[row])
        logp_row, ids_row = top_logp[row].numpy(), top_ids[row].numpy()
        finite = np.isfinite(logp_row).sum(axis=1)  # sorted descending: finite entries come first

        def children(score: np.float32, q: np.float32, d: int, hist: list[int]) -> Sequence[tuple]:
            """Children of a node at depth d (0 = root), best first, as (score, q, rank)."""
            if d >= depth:
                return []
            if scorer is None:  # already in score order: candidate log-probs are sorted
                return _LazyChildren(score, q, logp_row[d], int(finite[d]))
            h = torch.tensor(hist, dtype=torch.int64, device=device).view(1, 1, hist_len)
            rows = torch.tensor([row], device=device)
            rho = scorer.log_rho(h, torch.from_numpy(ids_row[d]).to(device).view(1, 1, k), rows)
            rho = rho.view(k).float().cpu().numpy()
            tok_score = logp_row[d] + lam_t[row, d].cpu().numpy() * rho  # same op order as build_tree
            child_score = score + tok_score
            child_q = q + logp_row[d]
            kids = sorted((j for j in range(k) if np.isfinite(child_score[j])), key=lambda j: (-child_score[j], j))
            return [(child_score[j], child_q[j], j) for j in kids]

        root_hist = context_tail[row].tolist() if scorer is not None else []
        zero = np.float32(0.0)
        # Heap entries: (-score, depth, within-depth key, node payload). The payload holds the
        # sibling list it came from and its position there, so popping it can push the next sibling.
        heap: list = []
        tokens, parents, depths, scores, qs = [], [], [], [], []

        def push(siblings: list, pos: int, parent_idx: int, parent_key: tuple, d: int, parent_hist: list[int]):
            if pos >= len(siblings):
                return
            s, q, rank = siblings[pos]
            key = (-float(s), parent_key, rank)
            heapq.heappush(heap, (-float(s), d, key, (siblings, pos, parent_idx, parent_key, parent_hist, s, q, rank)))

        push(children(zero, zero, 0, root_hist), 0, NO_PARENT, (), 1, root_hist)
        while heap and len(tokens) < min(budget, b):
            _, d, key, (siblings, pos, parent_idx, parent_key, parent_hist, s, q, rank) = heapq.heappop(heap)
            token = int(ids_row[d - 1, rank])
            idx = len(tokens)
            tokens.append(token)
            parents.append(parent_idx)
            depths.append(d)
            scores.append(float(s))
            qs.append(float(q))
            push(siblings, pos + 1, parent_idx, parent_key, d, parent_hist)
            hist = (parent_hist + [token])[-hist_len:] if hist_len else []
            push(children(s, q, d, hist), 0, idx, key, d + 1, hist)
        pad = b - len(tokens)
        out["tokens"].append(tokens + [0] * pad)
        out["parents"].append(parents + [NO_PARENT] * pad)
        out["depths"].append(depths + [0] * pad)
        out["scores"].append(scores + [-math.inf] * pad)
        out["q"].append(qs + [-math.inf] * pad)

    tokens = torch.tensor(out["tokens"], dtype=torch.int64, device=device).view(r, b)
    depths = torch.tensor(out["depths"], dtype=torch.int64, device=device).view(r, b)
    return DraftTree(
        tokens=tokens,
        parents=torch.tensor(out["parents"], dtype=torch.int64, device=device).view(r, b),
        depths=depths,
        scores=torch.tensor(out["scores"], dtype=torch.float32, device=device).view(r, b),
        draft_logp=torch.tensor(out["q"], dtype=torch.float32, device=device).view(r, b),
        valid=depths > 0,
        num_nodes=(depths > 0).sum(dim=1),
        max_depth=depth,
    )
