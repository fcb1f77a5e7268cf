"""`thinking_token_budget` over draft trees: vLLM's end-of-thinking forcing, decided per token.

With a reasoning config (`--reasoning-parser`, or `reasoning_config`'s start and end strings), vLLM
ends a request's thinking once it has thought `thinking_token_budget` tokens: its samplers give the
next end-of-thinking token a logit of 1e9 (`ThinkingBudgetStateHolder`, a per-request state machine
over the request's prompt and output). Without speculation that machine runs once per generated
token, on the output so far; whether token L is forced is a function of the first L tokens.

In a ddtree engine `ThinkingBudgets` stands in for vLLM's holder (the input batch's
`thinking_budget_state_holder`, which vLLM's samplers call) and keeps one state per budgeted
request, run by vLLM's own state machine exactly as without speculation: fed each committed output
length once, in order. From it, per step:

- `forced_token`: the token the next sampled position must be (an end-of-thinking token), or None.
  vLLM's samplers force it through `apply_to_logits`; the tree sampler through `forced_rows`.
- `safe_depth`: how many positions past the next one no path of a tree can reach a forced token. A
  budgeted request's drafts are cut to the nodes no deeper than that (a prefix of its tree), and to
  none where the next position itself is forced, so no verify row of a tree is ever forced and every
  forced token is sampled at a request's root row, as the target alone samples it.

The bound: a request not thinking is forced on no tokens that start nothing, and one thinking on
none while its count from its start of thinking stays short of the budget (with `COUNT_MARGIN`);
nearer, vLLM's machine is run forward on a copy of the state over tokens that neither start nor end
thinking, up to its first forced position. An end of thinking in a path only ends the thinking
(nothing forced), and a start of thinking in a path cannot reach the budget within
`thinking_token_budget` further tokens. So requests far from their budget (the usual case) draft
whole trees, and the last few tokens of a budget and the forced end are decoded one a step.

Only budgeted requests are visited (a Python loop over them, as vLLM's holder loops), each step; a
request without a budget costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

NEUTRAL = -1  # a token id that is neither a start nor an end of thinking (never a real id)
FORCED_LOGIT = 1e9  # vLLM's (ThinkingBudgetStateHolder._apply_forcing_to_logits)
COUNT_MARGIN = 2  # tokens short of the budget at which `safe_depth` runs the machine forward


@dataclass
class _Budgeted:
    """One budgeted request: vLLM's state dict and the output lengths it has been run on."""

    state: dict[str, Any]
    fed: int = -1  # the last output length the machine was run on (-1: none yet)
    forced: int | None = None  # the forced token at output length `fed`, if any


@dataclass
class ThinkingBudgets:
    """vLLM's thinking-budget state machine, per request id, fed committed outputs token by token.

    `machine` is a `vllm.v1.sample.thinking_budget_state.ThinkingBudgetStateHolder` made without
    speculative tokens (its `_init_state_entry` and `_update_think_state` run the states);
    `runner` is vLLM's model runner: its `requests` (prompt, output, parameters of each request) and
    its input batch (the step's request order). Only requests with a budget have a state (`admit`,
    with each step's new requests).
    """

    machine: Any
    runner: Any
    budgeted: dict[str, _Budgeted] = field(default_factory=dict)

    @classmethod
    def for_runner(cls, runner) -> "ThinkingBudgets | None":
        """Ours for `runner` when its vLLM config has a reasoning config (else vLLM has no holder)."""
        reasoning = runner.vllm_config.reasoning_config
        if reasoning is None:
            return None
        from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

        machine = ThinkingBudgetStateHolder(reasoning, 1, 0, runner.device, False)
        return cls(machine, runner)

    # -- the request states ----------------------------------------------------------------------

    def admit(self, new_requests, finished_req_ids) -> None:
        """A step's new requests (vLLM's `NewRequestData`) with a budget get a state; finished ones
        lose theirs. A request resumed after preemption keeps the state it had."""
        for req_id in finished_req_ids:
            self.budgeted.pop(req_id, None)
        for new in new_requests:
            params = new.sampling_params
            budget = None if params is None else params.thinking_token_budget
            if budget is not None and new.req_id not in self.budgeted:
                self.budgeted[new.req_id] = _Budgeted(self.machine._init_state_entry(new.prompt_token_ids, budget))

    def _fed(self, req_id: str) -> _Budgeted:
        """Request `req_id`'s state run on every output length up to its committed output's, in
        order, as vLLM's sampler runs it once per generated token."""
        entry = self.budgeted[req_id]
        output = self.runner.requests[req_id].output_token_ids
        for length in range(entry.fed + 1, len(output) + 1):
            entry.forced = self._step(entry.state, output[:length])
        entry.fed = max(entry.fed, len(output))
        return entry

    def _step(self, state: dict, output: list[int]) -> int | None:
        """One call of vLLM's `update_state` and `apply_to_logits` for one request without speculative
        tokens: the state moved on to `output`, and the token it forces next (or None)."""
        state["output_tok_ids"] = output
        state["spec_token_ids"] = []
        state["in_spec_mode"] = False
        state["force_index"] = []
        self.machine._update_think_state(state)
        if not state.get("in_end", False):
            return None
        if state["end_count"] > 0:
            state["bonus_token_forced"] = False
        ends = self.machine.think_end_token_ids
        if state["bonus_token_forced"] or not state.get("force_index") or state["end_count"] >= len(ends):
            return None
        return ends[state["end_count"]]

    # -- what a step asks ----------------------------------------------------------------------------

    def forced_token(self, req_id: str) -> int | None:
        """The token budgeted request `req_id` must sample next (its output so far committed), or None."""
        return self._fed(req_id).forced

    def safe_depth(self, req_id: str, depth: int) -> int:
        """The deepest draft depth (at most `depth`) whose verify rows are forced on no path of budgeted
        request `req_id`; -1 when its next token itself is forced."""
        entry = self._fed(req_id)
        if entry.forced is not None:
            return -1
        state = entry.state
        budget = int(state["thinking_token_budget"])
        if budget < 0:  # the machine's "never": no end-of-thinking tokens to force
            return depth
        # A start of thinking inside a path: the budget's tokens after it come first.
        depth = min(depth, budget)
        if state["start_thinking"] == -1 and not state.get("in_end", False):
            return depth  # not thinking: tokens that start none force none (the machine returns early)
        if not state.get("in_end", False):
            # Thinking: the machine forces once the tokens counted from its start of thinking reach the
            # budget; a count at least its own (from the prompt: the whole start string counted) bounds
            # the positions no path can reach a forced token by, with a margin for its countdown.
            prompt, length = state.get("prompt_tok_ids") or [], len(self.runner.requests[req_id].output_token_ids)
            start = state["start_thinking"]
            counted = (length + len(prompt) - start - 1 if state.get("continue_thinking", False)
                       else length - start - len(self.machine.think_start_token_ids))
            if budget - counted - 1 - COUNT_MARGIN >= depth:
                return depth
        # Near the budget, or forcing the end: vLLM's machine, run forward on a copy of the state over
        # tokens that neither start nor end thinking, up to its first forced position.
        state = dict(state)  # the machine reassigns keys, never mutates the lists it was given
        output = list(self.runner.requests[req_id].output_token_ids)
        for d in range(1, depth + 1):
            output.append(NEUTRAL)
            if self._step(state, list(output)) is not None:
                return d - 1
        return depth

    def _in_batch(self, req_ids: list[str]):
        """(index in `req_ids`, request id) of each budgeted request among them."""
        index = self.runner.input_batch.req_id_to_index
        for req_id in self.budgeted:
            i = index.get(req_id)
            if i is not None and i < len(req_ids) and req_ids[i] == req_id:
                yield i, req_id
            elif req_id in req_ids:
                yield req_ids.index(req_id), req_id

    def cut_drafts(self, req_ids: list[str], drafts: list[list[int]], proposed) -> int:
        """Cut each budgeted request's drafts (in place) to its leading nodes no deeper than its safe
        depth. `proposed` (`ProposedTrees`, or None) holds each tree's node depths in draft order on
        the host; drafts without a tree are a chain. Returns how many requests were cut."""
        cut = 0
        for i, req_id in list(self._in_batch(req_ids)):
            n = len(drafts[i])
            if not n:
                continue
            row = None if proposed is None else proposed.row_of.get(req_id)
            depths = list(range(1, n + 1)) if row is None else proposed.depths[row, :n].tolist()
            limit = self.safe_depth(req_id, max(depths))
            keep = next((j for j, d in enumerate(depths) if d > limit), n)
            if keep < n:
                drafts[i] = drafts[i][:keep]
                cut += 1
        return cut

    def forced_rows(self, req_ids: list[str]) -> list[tuple[int, int]]:
        """(index in `req_ids`, forced token) of each request whose next token is forced."""
        out = []
        for i, req_id in self._in_batch(req_ids):
            token = self.forced_token(req_id)
            if token is not None:
                out.append((i, token))
        return sorted(out)

    def install(self, input_batch) -> None:
        """Stand in for vLLM's holder in `input_batch` (and its current sampling metadata), so that
        vLLM's samplers, on steps without drafts, force through `apply_to_logits`."""
        if input_batch.thinking_budget_state_holder is not self:
            input_batch.thinking_budget_state_holder = self
            input_batch.sampling_metadata.thinking_budget_state_holder = self

    # -- vLLM's holder interface (its samplers call these; ddtree's steps without drafts use them) --

    def has_tracked_requests(self) -> bool:
        """Whether a live request has a thinking budget (vLLM then calls `apply_to_logits`)."""
        return bool(self.budgeted)

    def sync_batch(self, batch_update) -> None:
        """vLLM's batch changes: nothing to do, the states are kept by request id."""

    def update_state(self, output_token_ids, spec_token_ids, repeat_indices=None) -> None:
        """vLLM's per-step refresh: the states follow the requests' committed outputs on demand."""

    def apply_to_logits(self, logits: Tensor, predict_bonus_token: bool, spec_token_ids) -> Tensor:
        """vLLM's sampler on a step without drafts (one logits row per request, in batch order): the
        forced tokens get vLLM's logit, after its penalties and constraints, as there."""
        return force_rows(logits, self.forced_rows(self.runner.input_batch.req_ids))


def force_rows(logits: Tensor, forced: list[tuple[int, int]]) -> Tensor:
    """Give each (row, token) of `forced` vLLM's forcing logit in `logits` [rows, V] (in place)."""
    if not forced:
        return logits
    index = torch.tensor(forced, dtype=torch.int64).T.to(logits.device, non_blocking=True)
    logits.index_put_((index[0], index[1]), logits.new_full((len(forced),), FORCED_LOGIT))
    return logits
