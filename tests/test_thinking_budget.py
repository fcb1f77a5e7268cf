"""`thinking_token_budget` over trees (vllm_ddtree.thinking) against vLLM's own holder without
speculation: the same forced tokens at the same positions, and no forced position inside the depth
a tree may be drafted to. Synthetic token streams over a small vocabulary in which the start and end
of thinking are frequent; the engine-level check is in test_vllm_ddtree.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.thinking import FORCED_LOGIT, ThinkingBudgets

START, END = [5], [6, 7, 8]  # one-token start of thinking, three-token end (forced one token a step)
VOCAB = 12


def _holder(start=START, end=END, num_spec_tokens=0):
    from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

    cfg = SimpleNamespace(reasoning_start_token_ids=start, reasoning_end_token_ids=end)
    return ThinkingBudgetStateHolder(cfg, 4, num_spec_tokens, torch.device("cpu"), False)


def _vllm_run(prompt, budget, length, next_token, start=START, end=END):
    """What vLLM's sampler does without speculation, token by token: `update_state` on the output so
    far, `apply_to_logits` on the request's row, then the next token, `next_token(position, forced)`.
    Returns the output and the token forced before each position (or None)."""
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    holder = _holder(start, end)
    output: list[int] = []
    holder.sync_batch(BatchUpdate(1, [], [(0, SimpleNamespace(thinking_token_budget=budget), prompt, output)], []))
    forced_at = []
    for at in range(length):
        holder.update_state([output], [[]])
        logits = holder.apply_to_logits(torch.zeros(1, VOCAB), False, [[]])
        forced_at.append(int(logits.argmax()) if logits.max() >= FORCED_LOGIT else None)
        output.append(next_token(at, forced_at[-1]))
    return output, forced_at


def _vllm_stream(prompt, budget, length, rng):
    """A stream vLLM would generate: the forced token where there is one, else a random one."""
    return _vllm_run(prompt, budget, length, lambda at, forced: _draw(rng) if forced is None else forced)


def _replay(prompt, budget, stream):
    """vLLM's holder on a given stream: the token it forces before each position (one past the end too)."""
    return _vllm_run(prompt, budget, len(stream) + 1, lambda at, forced: (stream + [0])[at])


def _draw(rng, start=START, end=END):
    r = rng.random()
    if r < 0.1:
        return start[0]
    if r < 0.14:
        return end[0]
    if r < 0.16 and len(end) > 1:
        return end[1]
    return rng.randrange(0, 5)


def _budgets(prompt, budget, start=START, end=END):
    request = SimpleNamespace(prompt_token_ids=prompt, output_token_ids=[],
                              sampling_params=SimpleNamespace(thinking_token_budget=budget))
    runner = SimpleNamespace(requests={"r": request}, input_batch=SimpleNamespace(req_ids=["r"], req_id_to_index={"r": 0}))
    budgets = ThinkingBudgets(_holder(start, end), runner)
    budgets.admit([SimpleNamespace(req_id="r", prompt_token_ids=prompt, sampling_params=request.sampling_params)], ())
    return budgets, request


# the second prompt thinks from its start on; budgets past the drafted depth take `safe_depth`'s count
CASES = [([1, 2], b) for b in (0, 1, 2, 4, 9, 20)] + [([1, 5, 2], b) for b in (0, 1, 3, 6, 20)]


@pytest.mark.parametrize("prompt, budget", CASES)
@pytest.mark.parametrize("step_tokens", [1, 4])
def test_forced_tokens_match_vllm_without_speculation(prompt, budget, step_tokens):
    """Fed the committed output a token at a time or several at once (a tree step commits several),
    ddtree's states force the same token at the same positions as vLLM's holder without drafts."""
    rng = random.Random(budget * 31 + len(prompt))
    for _ in range(4):
        output, forced_at = _vllm_stream(prompt, budget, 60, rng)
        assert any(t is not None for t in forced_at), "the stream never reached its budget: no check"
        budgets, request = _budgets(prompt, budget)
        ours = [None] * len(output)
        for at in range(0, len(output), step_tokens):
            request.output_token_ids = output[:at]
            ours[at] = budgets.forced_token("r")
        for at in range(0, len(output), step_tokens):
            assert ours[at] == forced_at[at], (at, output, forced_at)


@pytest.mark.parametrize("prompt, budget", CASES)
def test_no_path_within_the_safe_depth_reaches_a_forced_token(prompt, budget):
    """From any committed point, whatever tokens a tree path holds (starts and ends of thinking
    included), vLLM's holder forces nothing at the path's positions 1..safe_depth."""
    rng = random.Random(budget * 7 + len(prompt))
    for _ in range(6):
        output, forced_at = _vllm_stream(prompt, budget, 40, rng)
        for at in range(len(output)):
            budgets, request = _budgets(prompt, budget)
            request.output_token_ids = output[:at]
            depth = budgets.safe_depth("r", 15)
            assert (depth == -1) == (forced_at[at] is not None)
            # the same depth as running vLLM's machine forward over tokens that start and end nothing
            _, ahead = _replay(prompt, budget, output[:at] + [-1] * 15)
            first = next((d for d in range(1, 16) if ahead[at + d] is not None), 16)
            assert depth == (-1 if forced_at[at] is not None else min(first - 1, budget, 15)), (at, output)
            for _ in range(8):  # paths continuing the committed output
                path = [_draw(rng) for _ in range(depth)]
                stream, forced = _replay(prompt, budget, output[:at] + path)
                assert all(f is None for f in forced[at + 1: at + depth + 1]), (at, depth, stream, forced)


def test_without_the_budget_bound_a_path_that_starts_thinking_is_forced_inside_it():
    """Negative control for the bound that a start of thinking in a path adds: run forward on tokens
    that neither start nor end thinking alone, a request outside its thinking looks safe to any
    depth, but a path that starts thinking reaches its budget within the tree."""
    budgets, request = _budgets([1, 2], 2)
    request.output_token_ids = [1, 2, 3]
    assert budgets.safe_depth("r", 15) == 2  # the bound: the budget
    _, forced = _replay([1, 2], 2, [1, 2, 3] + START + [1, 2, 3, 4])
    assert forced[3 + 3] is not None  # a path's 4th position would be forced (> 2, < 15)


def test_cut_drafts_keeps_the_prefix_of_nodes_within_the_safe_depth():
    budgets, request = _budgets([1, 5, 2], 4)  # thinking from the prompt: 1 token thought, 3 left
    request.output_token_ids = [3]  # 2 thought: the token after next is the last one within budget
    depth = budgets.safe_depth("r", 15)
    assert 0 <= depth < 15
    proposed = SimpleNamespace(row_of={"r": 0}, depths=torch.tensor([[1, 1, 2, 2, 3, 3, 4]]))
    drafts = [[9, 9, 9, 9, 9, 9, 9]]
    assert budgets.cut_drafts(["r"], drafts, proposed) == 1
    assert drafts[0] == [9] * sum(1 for d in [1, 1, 2, 2, 3, 3, 4] if d <= depth)
    request.output_token_ids = [3, 3, 3, 3]  # over budget: the next token is forced, no drafts
    drafts = [[9, 9]]
    budgets.cut_drafts(["r"], drafts, proposed)
    assert drafts == [[]] and budgets.forced_rows(["r"]) == [(0, END[0])]
