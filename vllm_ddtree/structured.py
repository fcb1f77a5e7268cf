"""Structured outputs with draft trees: one grammar mask per tree row, from that row's own path.

vLLM's grammar manager (`StructuredOutputManager.grammar_bitmask`) fills one token bitmask per
scheduled row of a request: for a draft chain, row i after the grammar has taken the chain's first i
tokens. A tree's rows are not one chain. Row 0 (the root) predicts the token after the committed
text; the row of node j predicts the token after the path root -> node j, so its mask is the
grammar's state after exactly that path. With each row masked so, the target's masked prediction at
every row is the one it would make alone after that path, and the walk accepts a node only where the
masked prediction at its parent's row equals it: greedy output stays token-identical to the target
alone with the same grammar, and each sampled row draws from the target's distribution under the
mask the target alone would have there.

A node whose token the grammar rejects after its parent's path can never be accepted (its parent's
row masks it out); its row, and its descendants', get the mask of the row where the grammar stopped,
as vLLM does for a chain's rows after a rejected draft. The tree keeps its rows (the runner verifies
a prefix of the tree the scheduler kept, so rows cannot be dropped from its middle); vLLM's
chain-prefix validation of drafts (`StructuredOutputManager.validate_tokens`) would cut a tree at
its first node not on one chain, so ddtree keeps trees whole there.

Reasoning models: where the grammar starts after an end-of-reasoning token, each row's bounds are
vLLM's for the chain that is its path (`_get_constraint_bounds`), so a row is masked exactly when the
chain through it would mask that row.

The tree's parents reach vLLM's scheduler with its drafts (`DraftTokenIds.ddtree_parents`, set by
the runner's `take_draft_token_ids`) and are kept on each request beside its `spec_token_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: The attribute of vLLM's `Request` that holds the parents of its `spec_token_ids` (a tree's nodes).
REQUEST_PARENTS = "ddtree_parents"
#: The attribute of vLLM's `DraftTokenIds` that carries the step's trees' parents to the scheduler.
DRAFT_PARENTS = "ddtree_parents"


@dataclass(frozen=True)
class TreeParents:
    """The parents of a step's draft trees, as the runner hands them to the scheduler.

    row_of: request id -> row of `parents`; parents: host int64 [R, B], each node's parent node
    (-1: the root), best-first so a parent comes before its children, -1 past a request's nodes.
    """

    row_of: dict[str, int]
    parents: torch.Tensor

    def of(self, req_id: str, num_nodes: int) -> list[int] | None:
        """The first `num_nodes` nodes' parents of `req_id`'s tree (None: no tree for it)."""
        row = self.row_of.get(req_id)
        if row is None or num_nodes > self.parents.shape[1]:
            return None
        return self.parents[row, :num_nodes].tolist()


def tree_paths(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """Each node's tokens from the root's first child to the node itself.

    tokens, parents: [N]; parents[j] is -1 (a child of the root) or an earlier node (< j), which every
    prefix of a best-first tree satisfies. Raises ValueError otherwise: a mask made from a wrong path
    would accept what the target alone would not."""
    if len(parents) < len(tokens):
        raise ValueError(f"a tree of {len(tokens)} draft tokens came with {len(parents)} parents")
    paths: list[list[int]] = []
    for j, token in enumerate(tokens):
        p = parents[j]
        if not -1 <= p < j:
            raise ValueError(f"draft node {j} has parent {p}: a tree's parents come before their children")
        paths.append((paths[p] if p >= 0 else []) + [token])
    return paths


def fill_tree_rows(manager: Any, request: Any, tokens: Sequence[int], parents: Sequence[int], first_row: int) -> int:
    """Fill `manager`'s bitmask rows first_row .. first_row + len(tokens) for one request's tree:
    the root's row, then one row per node in `tokens`' order. Returns the next free row.

    manager: vLLM's `StructuredOutputManager` (its `_grammar_bitmask`, `_fill_bitmasks` and
    `_get_constraint_bounds`); request: vLLM's `Request`. The grammar is left in the state it was in
    (every token taken for a row is rolled back)."""
    grammar = request.structured_output_request.grammar
    request_id = request.request_id
    for row, path in enumerate([[]] + tree_paths(tokens, parents), start=first_row):
        grammar_start, constraint_start = manager._get_constraint_bounds(request, path)
        taken, stop = 0, len(path)  # stop: the path position whose row this one is (its own, or a rejection's)
        for i in range(grammar_start, len(path)):
            # checked first: a backend's accept_tokens logs an error for a token it rejects, and a
            # drafted node the grammar rejects is expected here, not an error
            if grammar.is_terminated() or not grammar.validate_tokens([path[i]]):
                stop = i
                break
            grammar.accept_tokens(request_id, [path[i]])
            taken += 1
        manager._fill_bitmasks(((grammar, row, stop >= constraint_start),))
        if taken:
            grammar.rollback(taken)
    return first_row + 1 + len(tokens)


def tree_grammar_bitmask(manager: Any, requests: dict[str, Any], structured_output_request_ids: list[str],
                         scheduled_spec_decode_tokens: dict[str, list[int]]):
    """`StructuredOutputManager.grammar_bitmask` for a ddtree engine: rows in the same layout (each
    structured request in `structured_output_request_ids`' order, 1 + its scheduled drafts rows), each
    row masked by the grammar's state after that row's path in its request's tree (`fill_tree_rows`).
    Returns the int32 numpy bitmask [rows, vocab / 32], or None without structured requests."""
    if not structured_output_request_ids:
        return None
    from vllm.v1.structured_output.utils import strip_speculative_padding

    if manager._grammar_bitmask is None:  # as vLLM sizes it: every request's verify width + 1 rows
        max_seqs = manager.vllm_config.scheduler_config.max_num_seqs
        manager._grammar_bitmask = manager.backend.allocate_token_bitmask(
            max_seqs * (1 + manager.vllm_config.num_speculative_tokens))
    row = 0
    for req_id in structured_output_request_ids:
        request = requests[req_id]
        tokens = strip_speculative_padding(scheduled_spec_decode_tokens.get(req_id, []))
        parents = getattr(request, REQUEST_PARENTS, None) if tokens else []
        if parents is None:
            raise RuntimeError(f"request {req_id} has {len(tokens)} draft tokens scheduled but no tree parents")
        row = fill_tree_rows(manager, request, tokens, parents, row)
    return manager._grammar_bitmask[:row].numpy()
