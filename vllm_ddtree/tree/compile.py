"""Turn draft trees into what a verify forward needs: tokens, positions, masks, KV moves.

Row layout per request (the "verify rows"): row 0 is the root (the token committed last, not yet
in the KV cache), rows 1..B are the tree's nodes in best-first order. Row i+1 is node i. All rows
are written to consecutive KV slots context_len + i; attention follows the tree, positions follow
depth, and after the walk the accepted rows' K/V are moved to consecutive slots (compaction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import constants
from .build import NO_PARENT, DraftTree
from .transfer import to_device


@dataclass
class TreeBatch:
    """A batch of compiled trees, padded to 1 + B rows.

    tokens      [R, N] int64  row 0 the root token, then the tree's nodes
    parents     [R, N] int64  parent row, -1 for the root (and for padding rows)
    depths      [R, N] int64  0 for the root
    positions   [R, N] int64  context_len + depth (RoPE positions of the rows)
    valid       [R, N] bool   row exists; valid rows are exactly the first num_rows
    num_rows    [R]    int64  1 + number of nodes
    context_lens [R]   int64  tokens already in the KV cache before the root
    ancestors   [R, N, N] bool  ancestors[r, i, j]: row i may attend to row j (j is i or an ancestor).
                Padding rows see only the root and themselves, so no softmax row is empty.
    max_depth   int          deepest possible node (the drafter's depth count L)
    """

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    positions: Tensor
    valid: Tensor
    num_rows: Tensor
    context_lens: Tensor
    ancestors: Tensor
    max_depth: int

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_rows(self) -> int:
        return self.tokens.shape[1]

    def to(self, device: torch.device | str) -> "TreeBatch":
        """The same batch on `device` (`to_device` per field; the batch itself when already there)."""
        if self.tokens.device == torch.device(device):
            return self
        move = lambda t: to_device(t, device)  # noqa: E731
        return TreeBatch(move(self.tokens), move(self.parents), move(self.depths), move(self.positions),
                         move(self.valid), move(self.num_rows), move(self.context_lens), move(self.ancestors),
                         self.max_depth)


def compile_tree(tree: DraftTree, root_tokens: Tensor, context_lens: Tensor) -> TreeBatch:
    """Verify rows for `tree`: root first, positions = context + depth, ancestor-only mask.

    root_tokens [R]: the last committed token of each request; context_lens [R]: tokens before it
    in the KV cache (so the root's position is context_lens[r]). On device, no host synchronisation.
    """
    r, b = tree.tokens.shape
    if root_tokens.shape != (r,) or context_lens.shape != (r,):
        raise ValueError(
            f"root_tokens and context_lens must be [{r}], got {tuple(root_tokens.shape)} and {tuple(context_lens.shape)}"
        )
    device = tree.tokens.device
    ones = torch.ones(r, 1, dtype=torch.bool, device=device)
    tokens = torch.cat([root_tokens.long().view(r, 1), tree.tokens], dim=1)
    node_parents = torch.where(tree.valid, tree.parents + 1, NO_PARENT)  # node parent -1 (root) -> row 0
    parents = torch.cat([torch.full((r, 1), NO_PARENT, dtype=torch.int64, device=device), node_parents], dim=1)
    depths = torch.cat([torch.zeros(r, 1, dtype=torch.int64, device=device), tree.depths], dim=1)
    valid = torch.cat([ones, tree.valid], dim=1)
    positions = context_lens.long().view(r, 1) + depths
    return TreeBatch(
        tokens=tokens,
        parents=parents,
        depths=depths,
        positions=positions,
        valid=valid,
        num_rows=tree.num_nodes + 1,
        context_lens=context_lens.long(),
        ancestors=ancestor_mask(parents, tree.max_depth),
        max_depth=tree.max_depth,
    )


#: The rows of `scheduled_rows`' request table [6, R] int64, made on the host from the scheduler's
#: numbers (one copy to the device): each request's row in the proposed block; the drafts the
#: scheduler kept; the last verify row that is not its tree's (0 where the drafts are a prefix of the
#: tree: the root only; `CHAIN` where they are verified as a chain: every row); its root's index in
#: the step's tokens; its context length (tokens in the KV cache before the root); and its first row
#: of the target's logits.
SCHEDULE_FIELDS = ("tree_row", "drafted", "chain_rows", "root_index", "context_len", "logit_start")
CHAIN = 1 << 30  # `chain_rows` of a request whose drafts are not a prefix of its proposed tree


@dataclass
class ScheduledRows:
    """A verify step's rows for the drafts the scheduler kept, on the device (`scheduled_rows`).

    batch        the compiled trees [R, N]
    row_index    [R, N] int64    each verify row's index in the step's tokens (0 where padding)
    logit_rows   [R, N] int64    each verify row's row of the target's logits (0 where padding)
    write_index  [R, N] int64    where each row's position goes: its own index; padding its root's,
                                 with the root's position (a padding row's depth is 0)
    node_scores  [R, N] float32  each row's node's prefix score; -inf for the root, a chain's rows
                                 and padding (None without scores)
    """

    batch: TreeBatch
    row_index: Tensor
    logit_rows: Tensor
    write_index: Tensor
    node_scores: Tensor | None


def scheduled_rows(proposed: Tensor, nodes: int, table: Tensor, step_ids: Tensor, n: int, max_depth: int,
                   with_scores: bool) -> ScheduledRows:
    """The verify rows of the drafts the scheduler kept, from the proposer's trees on the device.

    The scheduler keeps a prefix of each proposed tree (or all of it): a prefix of a best-first
    tree is a tree, so its rows are the proposed rows cut to the kept count. Drafts that are not a
    prefix of the request's tree (drafts vLLM filled in itself) are verified as a chain, which is
    just as lossless. The host only decides which (it compares the token lists the scheduler
    returned): tokens, parents, depths and the ancestor masks are made here.

    proposed [Rp, P] float64: the proposer's trees as `tree_to_host` packs them, `nodes` columns
             each of tokens, parents, depths, then (with_scores) prefix scores
    table    [6, R] int64: `SCHEDULE_FIELDS` per request of the step
    step_ids [T'] the step's token ids (the runner's whole input buffer): each root, then its drafts
    n        verify rows per request (1 + the most drafts); max_depth: at least the deepest row
    No host read, shapes from the host integers alone: it can be captured per (n, shapes).
    """
    dev = step_ids.device
    tree_row, drafted, chain_rows, root, ctx, logit_start = table.unbind(0)
    # the same fields as [R, 1] columns, against the rows' [R, N] (one view for all of them)
    _, drafted_col, chain_col, root_col, ctx_col, logit_col = table.unsqueeze(2).unbind(0)
    r, fields = table.shape[1], 2 + with_scores  # parents, depths(, scores): the tokens come from step_ids
    if proposed.shape[0] == 0 or proposed.shape[1] < (1 + fields) * nodes:  # no tree, or no scores: chains only
        proposed = F.pad(proposed, (0, max((1 + fields) * nodes - proposed.shape[1], 0), 0, proposed.shape[0] == 0),
                         value=-math.inf)
    # [R, fields, N]: row k holds node k - 1's fields (row 0, the root, and rows past the nodes are
    # never read: a chain's rows and padding take their values from `chain` and `valid`)
    mine = proposed[:, nodes : (1 + fields) * nodes][tree_row].view(r, fields, nodes)[:, :, : n - 1]
    node_parents, node_depths, *node_score = F.pad(mine, (1, n - 1 - mine.shape[2])).unbind(1)
    k = constants.arange_rows(r, n, dev)  # [R, N] row index (row 0 the root)
    valid = k <= drafted_col
    chain = k <= chain_col  # the root, and every row of a chain
    row_index = torch.where(valid, root_col + k, 0)
    tokens = torch.where(valid, step_ids[row_index], 0).long()
    # (a node's parent NO_PARENT is the root, row 0: node parents + 1)
    parents = torch.where(valid, torch.where(chain, k - 1, node_parents.long() + 1), NO_PARENT)
    depths = torch.where(valid, torch.where(chain, k, node_depths.long()), 0)
    batch = TreeBatch(tokens=tokens, parents=parents, depths=depths, positions=ctx_col + depths, valid=valid,
                      num_rows=drafted + 1, context_lens=ctx, ancestors=ancestor_mask(parents, max_depth),
                      max_depth=max_depth)
    node_scores = torch.where(valid > chain, node_score[0].float(), -math.inf) if with_scores else None  # tree nodes
    return ScheduledRows(batch=batch, row_index=row_index, logit_rows=torch.where(valid, logit_col + k, 0),
                         write_index=torch.where(valid, row_index, root_col), node_scores=node_scores)


def ancestor_mask(parents: Tensor, max_depth: int) -> Tensor:
    """[R, N] parent rows (-1 = none) -> [R, N, N] bool: row i sees itself, its ancestors and row 0.

    Two exact ways, chosen by device: on a GPU, where each op is a kernel launch, the reachability of
    "self or parent" squared ceil(log2(max_depth)) times (a few batched matmuls, whatever the depth);
    elsewhere, where the ops are cheap and the matmuls' O(R N^3) work is not, parents chased once per
    depth (`benchmarks/step_overhead.py` counts the ops; on 2 vCPUs the chase is 5-10x faster).
    """
    if parents.device.type == "cuda":
        return ancestors_by_squaring(parents, max_depth)
    return ancestors_by_chasing(parents, max_depth)


#: `ancestors_by_squaring` squares at least this many times (paths up to 2^4 = 16 rows long, the
#: drafter's 15 depths and a lookup path of up to 16 tokens): a step's op count then does not follow
#: its trees' depth below that, and each extra square is one small batched matmul on a GPU.
MIN_SQUARINGS = 4


def ancestors_by_squaring(parents: Tensor, max_depth: int) -> Tensor:
    """`ancestor_mask` in a fixed handful of ops: [R, N, N] reachability squared log2(depth) times
    (`MIN_SQUARINGS` at least)."""
    r, n = parents.shape
    # [R, N, N]: "self or parent", where a row without a parent (the root, padding) takes row 0 as
    # its parent: the root is then everyone's ancestor, as the mask wants (padding rows non-empty).
    step = torch.zeros(r, n, n, dtype=torch.float32, device=parents.device)
    reach = step.scatter_(2, parents.clamp(min=0).unsqueeze(2), 1.0) + constants.eye(n, parents.device)
    # After k squarings an entry counts the weighted ways to reach (each row of "self or parent"
    # sums to 2): below 2^(2^k), finite in float32 up to k = 6, and no clamping needed there: zero
    # stays exactly zero and a reachable pair positive. From k = 7 on each square is clamped to 1,
    # so that no infinity reaches the next one (where infinity times zero would make a NaN).
    squarings = max(math.ceil(math.log2(max(max_depth, 1))), MIN_SQUARINGS)  # paths <= 2, 4, 8, ...
    for _ in range(min(squarings, 6)):
        reach = torch.bmm(reach, reach)
    for _ in range(squarings - 6):
        reach = torch.bmm(reach, reach).clamp_(max=1.0)
    return reach > 0


def ancestors_by_chasing(parents: Tensor, max_depth: int) -> Tensor:
    """`ancestor_mask` with O(R N) work per depth: parent pointers chased max_depth times, one scatter."""
    r, n = parents.shape
    device = parents.device
    rows = torch.arange(n, device=device).expand(r, n)
    chain = [rows]
    cur = rows
    for _ in range(max_depth):
        nxt = parents.gather(1, cur.clamp(min=0))
        cur = torch.where((cur >= 0) & (nxt >= 0), nxt, -1)
        chain.append(torch.where(cur >= 0, cur, rows))  # past the root: repeat self (already set)
    chain.append(torch.zeros_like(rows))  # the root is everyone's ancestor (keeps padding rows non-empty)
    mask = torch.zeros(r, n, n, dtype=torch.bool, device=device)
    mask.scatter_(2, torch.stack(chain, dim=2), True)
    return mask


@dataclass
class FlashInferTreeMask:
    """The custom mask `BatchPrefillWithPagedKVCacheWrapper.plan(custom_mask=...)` takes.

    custom_mask  [sum_r qo_len_r * kv_len_r] bool, per request row-major [qo_len, kv_len]
    mask_indptr  [R + 1] int64  start of each request's block in custom_mask
    qo_indptr    [R + 1] int64  query rows per request (cumulative), qo_len = num_rows
    kv_lens      [R]     int64  context_len + qo_len: the full KV length each request attends over
    Prefix (context) columns are True; the tree part is the ancestor mask. Pass the bool mask, not
    `packed_custom_mask` (docs/design.md §10.3: its indptr is element-based and misreads later requests).
    """

    custom_mask: Tensor
    mask_indptr: Tensor
    qo_indptr: Tensor
    kv_lens: Tensor


def flashinfer_tree_mask(batch: TreeBatch) -> FlashInferTreeMask:
    """Flatten a TreeBatch's masks in FlashInfer's custom-mask layout.

    Sizes depend on values (context lengths), so this reads them on the host: it belongs to the
    attention metadata build, which FlashInfer's `plan()` already runs on the host once per step.
    """
    num_rows = batch.num_rows.cpu()
    ctx = batch.context_lens.cpu()
    blocks = []
    for r in range(batch.batch_size):
        q, c = int(num_rows[r]), int(ctx[r])
        tree_part = batch.ancestors[r, :q, :q]
        prefix = torch.ones(q, c, dtype=torch.bool, device=tree_part.device)
        blocks.append(torch.cat([prefix, tree_part], dim=1).reshape(-1))
    sizes = num_rows * (ctx + num_rows)
    zero = torch.zeros(1, dtype=torch.int64)
    return FlashInferTreeMask(
        custom_mask=torch.cat(blocks),
        mask_indptr=torch.cat([zero, torch.cumsum(sizes, 0)]),
        qo_indptr=torch.cat([zero, torch.cumsum(num_rows, 0)]),
        kv_lens=ctx + num_rows,
    )


def dense_attention_mask(batch: TreeBatch, kv_len: int) -> Tensor:
    """[R, N, kv_len] bool for SDPA over a padded KV of `kv_len` positions (context then rows).

    Row i of request r sees positions < context_len[r] and the rows of its ancestors (stored at
    context_len[r] + j). Used by the CPU backend and the reference decoder.
    """
    r, n = batch.tokens.shape
    device = batch.tokens.device
    cols = torch.arange(kv_len, device=device)
    ctx = batch.context_lens.view(r, 1, 1)
    prefix = cols.view(1, 1, kv_len) < ctx
    rel = cols.view(1, 1, kv_len) - ctx  # row index a KV column holds, if in the tree part
    in_tree = (rel >= 0) & (rel < n)
    tree_part = batch.ancestors.gather(2, rel.clamp(0, n - 1).expand(r, n, kv_len))
    return prefix | (in_tree & tree_part)


@dataclass
class KVCompaction:
    """Logical KV positions to move after a walk: position src -> dst, gather all, then scatter.

    src, dst [R, L]: for accepted depth j (1..k): src = ctx + row(j), dst = ctx + j. Entries past
    the accepted length are no-ops that copy the root's position onto itself (never a destination),
    so shapes are static and no mask is needed. Sources are never before destinations.
    """

    src: Tensor
    dst: Tensor


def path_row_moves(path_rows: Tensor) -> tuple[Tensor, Tensor]:
    """The moves that make the accepted path contiguous, as verify rows (the root is row 0):
    path_rows [R, L+1] from `walk_tree` (-1 pad) -> src, dst [R, L]: for accepted depth j, row
    path[j] -> row j; past the accepted length row 0 -> row 0 (a no-op)."""
    rows = path_rows[:, 1:]
    depth = constants.arange(rows.shape[1] + 1, rows.device, start=1)
    return rows.clamp(min=0), torch.where(rows >= 0, depth, 0)


def compaction_plan(batch: TreeBatch, path_rows: Tensor) -> KVCompaction:
    """KV moves that make the accepted path contiguous. path_rows [R, L+1] from `walk_tree` (-1 pad)."""
    ctx = batch.context_lens.view(batch.batch_size, 1)  # the root's position
    src, dst = path_row_moves(path_rows)
    return KVCompaction(src=ctx + src, dst=ctx + dst)


def apply_compaction_(cache: Tensor, src_slots: Tensor, dst_slots: Tensor) -> None:
    """Move entries of a flat-slot cache [num_slots, ...] in place: cache[dst] = cache[src] (gather first)."""
    src = src_slots.reshape(-1)
    dst = dst_slots.reshape(-1)
    moved = cache.index_select(0, src)
    cache.index_copy_(0, dst, moved)
