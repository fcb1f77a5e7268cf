"""The drafting step's device part can be captured once and replayed (a CUDA graph, on a GPU).

A CUDA graph records kernels with their arguments: a Python number the step reads is frozen at its
capture value, and a tensor is read through the address it had then. State that changes between
steps (the cost model's refits, the drafter's confidence exponent, the lookup path's acceptance, the
budget's rate) must therefore live in tensors that are updated in place. `make_fx` traces the same
way (numbers become constants, tensors are held by reference), so on a CPU a trace replayed after
the state has moved on must still equal the eager step: what a captured graph would compute.
"""

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from vllm_ddtree.tree import (
    AcceptanceCalibration,
    AutoBudget,
    CostModel,
    HostReads,
    LookupCalibration,
    ModelShape,
    StepGraphs,
    TokenHistory,
    build_tree,
    CHAIN,
    capture_width,
    compile_tree,
    draft_trees,
    first_rows,
    get_profile,
    padded_rows,
    padded_width,
    schedule_rows,
    plan_trees_with_lookup,
    topk_per_depth,
    verify_step,
    verify_trees,
    walk_tree,
)
from vllm_ddtree.tree.step import plan_trees

QWEN3_8B = dict(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=12288, vocab_size=151936)
R, DEPTH, VOCAB, BUILD, LOOKUP = 4, 6, 40, 16, 5


def calibrated_budget(seed: int) -> AutoBudget:
    """An automatic budget past its exploration, its state on the (CPU) device."""
    cost = CostModel(ModelShape.from_hf_config(QWEN3_8B, "bfloat16"), get_profile("h100"))
    auto = AutoBudget(cost, 1, BUILD, lookup=LookupCalibration(LOOKUP)).to("cpu")
    g = torch.Generator().manual_seed(seed)
    while auto.exploring:
        b = auto.calibration.explore_budget(R)
        tokens = R * (1 + b)
        seconds = float(cost.step_seconds(R * b, 500.0 * R, R)) * (1 + 0.3 * float(torch.rand((), generator=g)))
        auto.observe_step(tokens, tokens * (501 + b), 500.0 * R, seconds)
    return auto


def step_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, DEPTH, VOCAB, generator=g) * torch.linspace(0.5, 4.0, R).view(R, 1, 1)
    top_logp, top_ids = topk_per_depth(logits, BUILD)
    ctx = torch.randint(100, 2000, (R,), generator=g)
    branch = torch.randint(0, VOCAB, (R, LOOKUP), generator=g)
    valid = torch.arange(LOOKUP) < torch.randint(0, LOOKUP + 1, (R, 1), generator=g)
    return top_logp, top_ids, ctx, branch, valid


def pad_rows(total: int, *xs: torch.Tensor | None, fills=(-math.inf, 0, 0, 0, False)) -> tuple:
    """`plan_trees`' inputs (top_logp, top_ids, context_lens, branch, valid) padded to `total` rows as
    `draft_trees` makes the padding: log-probs -inf (no tree), token 0, context 0, no lookup path."""
    return tuple(None if x is None else torch.cat([x, x.new_full((total - x.shape[0], *x.shape[1:]), fill)])
                 for x, fill in zip(xs, fills))


def move_state_on(auto: AutoBudget, seed: int) -> None:
    """What serving does between two steps: measured acceptances, lookup outcomes and step times
    (enough of them for the cost model to refit)."""
    g = torch.Generator().manual_seed(seed)
    top_logp, top_ids, _, branch, valid = step_inputs(seed)
    scores = build_tree(top_logp, top_ids, BUILD, max_budget=BUILD).scores
    verified = torch.isfinite(scores)
    accepted = verified & (torch.rand(scores.shape, generator=g) < 0.2)
    auto.observe_acceptance(scores, verified, accepted)
    auto.observe_lookup(branch, valid, torch.where(torch.rand(R, 3, generator=g) < 0.5, branch[:, :3], -1))
    for _ in range(auto.calibration.refit_every):
        b = int(torch.randint(1, BUILD + 1, (), generator=g))
        tokens = R * (1 + b)
        seconds = 0.004 + 0.0005 * b * float(torch.rand((), generator=g))
        auto.observe_step(tokens, tokens * (501 + b), 500.0 * R, seconds)


def test_a_traced_step_replays_the_eager_step_after_the_state_moves_on():
    auto = calibrated_budget(0)

    def step(top_logp, top_ids, ctx, branch, valid):
        tree, plan = plan_trees(top_logp, top_ids, BUILD, ctx, auto, branch, valid, max_nodes=BUILD + LOOKUP)
        return (tree.tokens, tree.parents, tree.depths, tree.valid, tree.scores, plan.budgets, plan.extra,
                plan.expected_tokens, plan.step_seconds)

    step(*step_inputs(1))  # warm-up: constants made once per shape, the batch's rate seeded
    traced = make_fx(step)(*step_inputs(2))
    for seed in range(3, 8):
        move_state_on(auto, 100 + seed)
        x = step_inputs(seed)
        rate = [t.clone() for t in (*auto.planned_tokens.values(), *auto.planned_seconds.values())]
        replayed = traced(*x)
        for t, saved in zip((*auto.planned_tokens.values(), *auto.planned_seconds.values()), rate):
            t.copy_(saved)  # the step moves the rate on: both runs start from the same one
        eager = step(*x)
        for name, a, b in zip(("tokens", "parents", "depths", "valid", "scores", "budgets", "extra",
                               "expected_tokens", "step_seconds"), replayed, eager):
            torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name} after state update {seed}: {m}")


def rate_tensors(auto: AutoBudget) -> list[torch.Tensor]:
    return [*auto.planned_tokens.values(), *auto.planned_seconds.values()]


def test_step_graphs_capture_a_key_when_due_and_replay_it_equal_to_eager():
    """The proposer's path: `StepGraphs` runs a key eagerly, captures it on its second call (that call's
    outputs come from the capture, as a call's), then replays it; another shape is another key."""
    auto = calibrated_budget(0)
    graphs = StepGraphs("trace")

    def step(top_logp, top_ids, ctx, branch, valid):
        return plan_trees(top_logp, top_ids, BUILD, ctx, auto, branch, valid, max_nodes=BUILD + LOOKUP)

    def key_of(x):
        return (BUILD, tuple(t.shape for t in x), auto.capture_state(R, "cpu"))

    for seed in range(6):
        x = step_inputs(seed)
        saved = [t.clone() for t in rate_tensors(auto)]
        key = key_of(x)  # as the proposer: eager while the budget cannot be captured
        tree, plan = step(*x) if key[-1] is None else graphs(key, step, *x)
        moved = [t.clone() for t in rate_tensors(auto)]
        for t, s in zip(rate_tensors(auto), saved):
            t.copy_(s)
        eager_tree, eager_plan = step(*x)
        for t, m in zip(rate_tensors(auto), moved):  # one call moved the rate as one eager step does
            torch.testing.assert_close(t, m)
        for name in ("tokens", "parents", "depths", "valid", "scores", "num_nodes"):
            torch.testing.assert_close(getattr(tree, name), getattr(eager_tree, name), msg=f"{name}, call {seed}")
        assert tree.max_depth == eager_tree.max_depth
        for name in ("budgets", "extra", "expected_tokens", "step_seconds", "tokens_per_second"):
            torch.testing.assert_close(getattr(plan, name), getattr(eager_plan, name), msg=f"{name}, call {seed}")
        move_state_on(auto, 200 + seed)
    assert (graphs.eager_calls, graphs.captures, graphs.replays) == (1, 1, 3)
    # a batch of another size: a key of its own, eager first
    fewer = tuple(t[: R - 1] for t in step_inputs(9))
    graphs(key_of(fewer), step, *fewer)
    assert (graphs.eager_calls, graphs.captures) == (2, 1) and len(graphs.graphs) == 1


def test_step_graphs_keep_the_latest_keys_and_fall_back_to_eager_when_a_capture_fails(caplog):
    graphs = StepGraphs("trace", capture_after=1, max_graphs=2)
    x = torch.arange(4.0)
    for k in range(3):
        assert torch.equal(graphs(k, lambda t, k=k: t * k, x), x * k)
    assert list(graphs.graphs) == [1, 2]  # the least recently used key dropped
    assert torch.equal(graphs(1, lambda t: t * 1, x + 1), x + 1) and graphs.replays == 1  # new inputs, replayed

    calls = []

    def fails_once(t):  # as an op a capture does not allow: the capture fails, the eager call works
        calls.append(t)
        if len(calls) == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return t * 7

    with caplog.at_level("WARNING"):
        assert torch.equal(graphs(7, fails_once, x), x * 7) and len(calls) == 2
    assert graphs.failed and "capturing the tree step" in caplog.text and not graphs.graphs
    assert torch.equal(graphs(1, lambda t: t * 5, x), x * 5) and graphs.captures == 3  # eager from now on


def test_the_budget_is_captured_only_when_calibrated_and_its_class_has_a_rate():
    cost = CostModel(ModelShape.from_hf_config(QWEN3_8B, "bfloat16"), get_profile("h100"))
    auto = AutoBudget(cost, 1, BUILD)
    assert auto.exploring and auto.capture_state(R, "cpu") is None  # forced exploration sizes
    auto = calibrated_budget(0)
    assert auto.capture_state(R, "cpu") is None  # no plan yet at this size: the first one seeds the rate
    top_logp, top_ids, ctx, branch, valid = step_inputs(0)
    plan_trees(top_logp, top_ids, BUILD, ctx, auto, branch, valid)
    state = auto.capture_state(R, "cpu")
    assert state is not None and auto.capture_state(1, "cpu") is None  # another size class
    # A residual table longer than the coefficients' buffer replaces it: the state a capture holds changes.
    coefficients = auto.cost.coefficients("cpu")
    auto.cost.residual = torch.full((coefficients.residual.numel() + 5,), 1e-4)
    assert auto.capture_state(R, "cpu") != state
    n = auto.cost.residual.numel()  # the new buffer holds the table, then zeros
    assert torch.all(coefficients.residual[:n] == torch.tensor(1e-4)) and not coefficients.residual[n:].any()


def test_a_cost_model_sized_for_its_largest_step_never_replaces_the_buffer_a_capture_reads():
    """`max_step_rows` (the proposer passes the scheduler's max_num_batched_tokens): the residual's
    buffer covers every step size from the start, so tables up to that size are written in place."""
    shape = ModelShape.from_hf_config(QWEN3_8B, "bfloat16")
    cost = CostModel(shape, get_profile("h100"), max_step_rows=5000)
    coefficients = cost.coefficients("cpu")
    buffer = coefficients.residual
    assert buffer.numel() == 5002  # sizes 0..5000, then the zero a larger size reads
    cost.residual = torch.full((5001,), 2e-4)  # a table measured up to a 5000-row step
    assert coefficients.residual is buffer and coefficients.generation == 0
    assert torch.all(buffer[:5001] == torch.tensor(2e-4)) and buffer[5001] == 0
    torch.testing.assert_close(cost.verify_seconds(torch.tensor(5000.0), torch.tensor(0.0), torch.tensor(0.0)),
                               CostModel(shape, get_profile("h100")).verify_seconds(
                                   torch.tensor(5000.0), torch.tensor(0.0), torch.tensor(0.0)) + 2e-4)
    cost.residual = torch.full((5002,), 2e-4)  # past what the model was sized for: replaced, as before
    assert coefficients.residual is not buffer and coefficients.generation == 1
    with pytest.raises(ValueError, match="max_step_rows must be >= 0"):
        CostModel(shape, get_profile("h100"), max_step_rows=-1)


def test_depths_padded_for_a_capture_build_the_same_trees():
    """The proposer pads the drafter's depths to one count per width before a captured step: every
    field of the trees is the same bit for bit, with ties, -inf log-probs among the real candidates
    (fewer finite tokens than K), and budgets below and at the width."""
    g = torch.Generator().manual_seed(5)
    for depth, k, width in ((2, 8, 8), (3, 16, 16), (6, 8, 8), (1, 4, 4)):
        logits = torch.randn(R, depth, VOCAB, generator=g).round(decimals=1)  # ties
        logits[0, :, 6:] = -math.inf  # request 0: six finite tokens per depth, fewer than K at K = 8, 16
        top_logp, top_ids = topk_per_depth(logits, k)
        padded = (torch.nn.functional.pad(top_logp, (0, 0, 0, 5), value=-math.inf),
                  torch.nn.functional.pad(top_ids, (0, 0, 0, 5)))  # as `draft_trees` makes the padding
        for budgets in (width, torch.tensor([1, 3, width, width - 1])):
            plain = build_tree(top_logp, top_ids, budgets, max_budget=width, validate=False)
            wide = build_tree(*padded, budgets, max_budget=width, validate=False)  # as plan_trees builds
            for name in ("tokens", "parents", "depths", "scores", "draft_logp", "valid", "num_nodes"):
                assert torch.equal(getattr(plain, name), getattr(wide, name)), (name, depth, k)
    assert [capture_width(b, 64) for b in (1, 2, 3, 8, 9, 16, 17, 33, 64)] == [1, 2, 4, 8, 16, 16, 32, 64, 64]
    assert capture_width(33, 40) == 40  # never past the scheduler's cap


def test_a_batch_padded_to_its_size_class_plans_the_same_trees_and_moves_the_same_rate():
    """The proposer pads a captured step's batch to the top of its size class (rows of -inf log-probs,
    context 0, no lookup path): the real rows' trees and the plan are the unpadded batch's, and the
    class's rate moves as it would; the plan's totals count the real requests only."""
    assert [padded_rows(n) for n in (1, 2, 3, 4, 5, 7, 8, 9, 255, 256)] == [1, 3, 3, 7, 7, 7, 15, 15, 255, 511]
    for seed, r in ((0, R), (1, 2), (2, 1)):  # padded to 7, 3 and 1 rows
        auto_plain, auto_padded = calibrated_budget(seed), calibrated_budget(seed)
        top_logp, top_ids, ctx, branch, valid = (x[:r] for x in step_inputs(seed))
        for step in range(3):  # the first plan seeds the class's rate, the next ones move it
            plain_tree, plain_plan = plan_trees(top_logp, top_ids, BUILD, ctx, auto_plain, branch, valid,
                                                max_nodes=BUILD + LOOKUP)
            padded = pad_rows(padded_rows(r), top_logp, top_ids, ctx, branch, valid)
            assert padded[0].shape[0] == padded_rows(r) and not padded[4][r:].any() and (padded[2][r:] == 0).all()
            out = plan_trees(
                padded[0], padded[1], BUILD, padded[2], auto_padded, padded[3], padded[4], max_nodes=BUILD + LOOKUP,
                rows=torch.count_nonzero(padded[2]))
            tree, plan = first_rows(*out, r)
            for name in ("tokens", "parents", "depths", "valid", "scores", "num_nodes"):
                assert torch.equal(getattr(tree, name), getattr(plain_tree, name)), (name, r, step)
            for name in ("budgets", "extra", "expected_tokens", "step_seconds", "tokens_per_second"):
                assert torch.equal(getattr(plan, name), getattr(plain_plan, name)), (name, r, step)
            assert not out[0].valid[r:].any()  # the padding has no tree
            for a, b in zip(rate_tensors(auto_padded), rate_tensors(auto_plain)):
                assert torch.equal(a, b)
            top_logp = top_logp.roll(1, dims=0)  # other trees, same batch
    # Counting the padding as requests would plan another step (the negative control).
    auto = calibrated_budget(0)
    top_logp, top_ids, ctx, branch, valid = step_inputs(0)
    plan_trees(top_logp, top_ids, BUILD, ctx, auto, branch, valid, max_nodes=BUILD + LOOKUP)  # seeds the rate
    plain = plan_trees(top_logp, top_ids, BUILD, ctx, auto, branch, valid, max_nodes=BUILD + LOOKUP)[1]
    padded = pad_rows(R + 40, top_logp, top_ids, ctx, branch, valid)
    counted = plan_trees(*padded[:2], BUILD, padded[2], auto, *padded[3:], max_nodes=BUILD + LOOKUP)[1]
    assert not torch.equal(counted.step_seconds, plain.step_seconds)


def history_with_repeats(seed: int, r: int) -> TokenHistory:
    """Each request's text with a phrase it repeats: its lookup path is found (and for slot 0 too)."""
    g = torch.Generator().manual_seed(seed)
    history = TokenHistory(64, 2, slots=r)
    phrases = torch.randint(0, VOCAB, (r, 6), generator=g)
    history.observe_step(list(range(r)), torch.cat([phrases, torch.randint(0, VOCAB, (r, 9), generator=g),
                                                    phrases[:, :3]], dim=1))
    return history


def test_the_lookup_found_inside_the_step_keeps_a_padded_batch_s_plans():
    """`plan_trees_with_lookup` (the captured step, lookup included): the path it finds is the
    history's, and a batch padded with slot -1 plans the unpadded batch's trees; the padding proposes
    nothing. Negative control: padding that took a real slot (0) would offer its lookup path to the
    budget, which buys it and counts its gains in the plan."""
    for seed, r in ((0, R), (1, 2)):
        history = history_with_repeats(seed, r)
        slots = torch.arange(r)
        top_logp, top_ids, ctx, _, _ = (x[:r] for x in step_inputs(seed))
        auto_plain, auto_padded, auto_taken = calibrated_budget(seed), calibrated_budget(seed), calibrated_budget(seed)
        branch, valid = history.continuation(slots, LOOKUP)
        assert valid.any(dim=1).all()  # every request repeats its phrase
        plain = plan_trees_with_lookup(top_logp, top_ids, BUILD, ctx, auto_plain, history, slots, LOOKUP, BUILD + LOOKUP)
        assert torch.equal(plain[2], branch) and torch.equal(plain[3], valid)
        assert torch.equal(plain[0].tokens, plan_trees(top_logp, top_ids, BUILD, ctx, calibrated_budget(seed), branch,
                                                       valid, BUILD + LOOKUP)[0].tokens)
        total = padded_rows(r) + 8
        inputs = pad_rows(total, top_logp, top_ids, ctx, None, None)[:3]
        for auto, pad in ((auto_padded, torch.cat([slots, slots.new_full((total - r,), -1)])),
                          (auto_taken, torch.cat([slots, slots.new_zeros(total - r)]))):
            out = plan_trees_with_lookup(inputs[0], inputs[1], BUILD, inputs[2], auto, history, pad, LOOKUP,
                                         BUILD + LOOKUP, padded=True, rows=torch.count_nonzero(inputs[2]))
            if auto is auto_padded:
                assert not out[3][r:].any()  # the padding proposes nothing
                tree, plan = first_rows(*out[:2], r)
                assert torch.equal(tree.tokens, plain[0].tokens) and torch.equal(plan.budgets, plain[1].budgets)
                assert torch.equal(plan.extra, plain[1].extra) and torch.equal(out[2][:r], branch)
            else:
                assert out[1].extra[r:].sum() > 0 and not torch.equal(out[1].expected_tokens, plain[1].expected_tokens)


#: (requests, drafted depths) of successive drafting steps: after the first two (eager, then captured)
#: the size class 4-7 replays one capture padded to 7 rows and DEPTH depths, most steps smaller than
#: one before, so its buffers hold an earlier step's values past the batch; then a batch of class 2-3.
DRAFT_STEPS = ((7, 6), (5, 4), (7, 6), (4, 3), (6, 6), (5, 2), (4, 5), (2, 6), (3, 4))


def draft_step(auto: AutoBudget, history: TokenHistory):
    """The proposer's step function: the step's new tokens appended to the token history, the lookup
    calibration fed, then build, automatic budget and lookup path (`plan_trees_with_lookup`)."""
    def step(top_logp, top_ids, context_lens, slots, rows, observed=None, new_tokens=None):
        if new_tokens is not None:
            history.append(slots, new_tokens)
        if observed is not None:
            auto.observe_lookup(*observed, new_tokens)
        return plan_trees_with_lookup(top_logp, top_ids, BUILD, context_lens, auto, history, slots, LOOKUP,
                                      BUILD + LOOKUP, padded=rows is not None, rows=rows)
    return step


def draft_inputs(seed: int, r: int, depth: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(r, depth, VOCAB, generator=g) * torch.linspace(0.5, 4.0, r).view(r, 1, 1)
    return (*topk_per_depth(logits, BUILD), torch.randint(100, 2000, (r,), generator=g), torch.arange(r))


def lookup_outcome(seed: int, r: int) -> tuple:
    """Last step's lookup paths [r, LOOKUP] (a random valid prefix each) and this step's committed tokens,
    1-4 columns (-1 padded): the path's first tokens up to a random depth, then another token."""
    g = torch.Generator().manual_seed(1000 + seed)
    proposed = torch.randint(0, VOCAB, (r, LOOKUP), generator=g)
    valid = torch.arange(LOOKUP) < torch.randint(0, LOOKUP + 1, (r, 1), generator=g)
    columns = 1 + seed % 4
    committed = torch.where(torch.arange(columns) < torch.randint(0, columns + 1, (r, 1), generator=g),
                            proposed[:, :columns], (proposed[:, :columns] + 1) % VOCAB)
    return proposed, valid, torch.where(torch.arange(columns) < torch.randint(1, columns + 1, (r, 1), generator=g),
                                        committed, -1)


#: Columns a captured step pads each row's new tokens to (`draft_trees`' token_width).
TOKEN_WIDTH = 6


def test_the_drafting_step_replayed_from_a_padded_capture_plans_as_eager():
    """`draft_trees` with `StepGraphs` (what the proposer runs where it captures): the token history
    it appends to, the lookup calibration it feeds, trees, plan, lookup path and the size class's rate
    equal the unpadded eager step's bit for bit on every step, though a replay's buffers hold an
    earlier step's values past the batch, past its drafted depths and past its new tokens. The
    padding rows write slot 0, which row 0 of every batch writes too."""
    histories = {"captured": history_with_repeats(0, 8), "eager": history_with_repeats(0, 8)}
    graphs = StepGraphs("trace")
    captured, eager = calibrated_budget(0), calibrated_budget(0)
    for auto, history in ((captured, histories["captured"]), (eager, histories["eager"])):
        # each class's first plan seeds its rate (the proposer runs it eagerly)
        for r in (7, 2):
            draft_trees(draft_step(auto, history), *draft_inputs(99, r, DEPTH), DEPTH)
    for seed, (r, depth) in enumerate(DRAFT_STEPS):
        x, (proposed, valid, new_tokens) = draft_inputs(seed, r, depth), lookup_outcome(seed, r)
        got = draft_trees(draft_step(captured, histories["captured"]), *x, DEPTH, graphs, ("test",), (proposed, valid),
                          new_tokens, TOKEN_WIDTH)
        want = draft_trees(draft_step(eager, histories["eager"]), *x, DEPTH, observed=(proposed, valid),
                           new_tokens=new_tokens)
        assert torch.equal(captured.lookup._state, eager.lookup._state), seed
        for name in ("tokens", "lengths"):
            assert torch.equal(getattr(histories["captured"], name), getattr(histories["eager"], name)), (name, seed)
        for name in ("tokens", "parents", "depths", "valid", "scores", "num_nodes"):
            assert torch.equal(getattr(got[0], name), getattr(want[0], name)), (name, seed)
        for name in ("budgets", "extra", "expected_tokens", "step_seconds"):
            assert torch.equal(getattr(got[1], name), getattr(want[1], name)), (name, seed)
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3]), seed
        assert got[0].tokens.shape[0] == r and want[0].valid.any(dim=1).all()  # every request has a tree
        for a, b in zip(rate_tensors(captured), rate_tensors(eager)):
            assert torch.equal(a, b), seed
    assert (graphs.eager_calls, graphs.captures, graphs.replays) == (2, 2, 5)
    assert not torch.equal(eager.lookup._state, calibrated_budget(0).lookup._state)  # it was fed
    fresh = history_with_repeats(0, 8)  # every step's new tokens were appended, each request's own
    grown = histories["eager"].lengths - fresh.lengths
    assert grown.sum() > 0 and torch.equal(grown, sum(
        torch.zeros(8, dtype=torch.int64).index_add_(0, torch.arange(r), (lookup_outcome(seed, r)[2] >= 0).sum(dim=1))
        for seed, (r, _) in enumerate(DRAFT_STEPS)))
    with pytest.raises(ValueError, match="cannot pad 6 depths to 5"):
        draft_trees(draft_step(eager, histories["eager"]), *draft_inputs(0, 4, 6), 5, graphs)
    with pytest.raises(ValueError, match="cannot pad 4 new tokens per row to 3"):
        draft_trees(draft_step(eager, histories["eager"]), *draft_inputs(0, 4, 5), 5, graphs, new_tokens=torch.zeros(4, 4),
                    token_width=3)


def test_a_drafting_capture_that_reads_its_buffers_whole_plans_an_earlier_step_s_rows():
    """The negative control of the test above: the inputs in their buffers' leading blocks without the
    mask `draft_trees` makes from (R, D, T) leave an earlier, larger step's rows, depths and new
    tokens in the capture's buffers: the replays plan trees that are not the step's, feed the lookup
    calibration outcomes that are not the step's, and append tokens to the history that are not."""
    histories = [history_with_repeats(0, 8), history_with_repeats(0, 8)]
    graphs = StepGraphs("trace")
    captured, eager = calibrated_budget(0), calibrated_budget(0)
    for auto, history in zip((captured, eager), histories):
        draft_trees(draft_step(auto, history), *draft_inputs(99, 7, DEPTH), DEPTH)
    wrong = 0
    for seed, (r, depth) in enumerate(DRAFT_STEPS[:7]):
        top_logp, top_ids, ctx, slots = draft_inputs(seed, r, depth)
        proposed, valid, new_tokens = lookup_outcome(seed, r)
        step = draft_step(captured, histories[0])
        shapes = ((7, DEPTH, BUILD), (7, DEPTH, BUILD), (7,), (7,), None, (7, LOOKUP), (7, LOOKUP), (7, TOKEN_WIDTH))
        tree, plan, _, _ = graphs(("unmasked",), lambda *x: step(*x[:5], x[5:7], x[7]), top_logp, top_ids, ctx, slots,
                                  torch.tensor(r), proposed, valid, new_tokens, shapes=shapes)
        want = draft_trees(draft_step(eager, histories[1]), top_logp, top_ids, ctx, slots, DEPTH,
                           observed=(proposed, valid), new_tokens=new_tokens)
        wrong += not (torch.equal(tree.tokens[:r], want[0].tokens) and torch.equal(plan.budgets[:r], want[1].budgets))
    assert wrong > 0
    assert not torch.equal(captured.lookup._state, eager.lookup._state)
    assert not torch.equal(histories[0].lengths, histories[1].lengths)


def test_the_switch_names_its_values_and_captures_on_cuda_by_default(monkeypatch):
    proposer = pytest.importorskip("vllm_ddtree.proposer")
    for value, expect in (("0", None), ("1", None), ("trace", "trace")):  # "1" on a CPU: eager
        monkeypatch.setenv("VLLM_DDTREE_STEP_GRAPHS", value)
        graphs = proposer.step_graphs_from_env(torch.device("cpu"))
        assert (graphs.backend if graphs is not None else None) == expect, value
    monkeypatch.delenv("VLLM_DDTREE_STEP_GRAPHS")  # unset: "1", captured on a CUDA device, eager elsewhere
    assert proposer.step_graphs_from_env(torch.device("cpu")) is None
    # (a CUDA device is only named, never touched: the switch reads the device type)
    for value in (None, "1"):
        if value is not None:
            monkeypatch.setenv("VLLM_DDTREE_STEP_GRAPHS", value)
        assert proposer.step_graphs_from_env(torch.device("cuda")).backend == "cuda", value
    monkeypatch.setenv("VLLM_DDTREE_STEP_GRAPHS", "0")
    assert proposer.step_graphs_from_env(torch.device("cuda")) is None
    for value in ("yes", ""):
        monkeypatch.setenv("VLLM_DDTREE_STEP_GRAPHS", value)
        with pytest.raises(ValueError, match="VLLM_DDTREE_STEP_GRAPHS must be 0, 1 .the default. or trace"):
            proposer.step_graphs_from_env(torch.device("cpu"))


def verify_inputs(seed: int, r: int, budget: int):
    """A verify step of `r` trees at most `budget` nodes wide: its TreeBatch, the target's token per row
    (a child's token 70 % of the time where the row has children, so paths are accepted), and each
    row's node score, some -inf (nodes the drafter did not rank: neither predicted nor counted; the
    root)."""
    g = torch.Generator().manual_seed(seed)
    top_logp, top_ids = topk_per_depth(torch.randn(r, 5, 8, generator=g) * 2, 8)
    tree = build_tree(top_logp, top_ids, torch.randint(1, budget + 1, (r,), generator=g), max_budget=budget)
    batch = compile_tree(tree, torch.randint(0, 8, (r,), generator=g), torch.randint(0, 900, (r,), generator=g))
    n = batch.tokens.shape[1]
    child = torch.full((r, n), -1).scatter_(1, batch.parents.clamp(min=0), torch.where(batch.valid, batch.tokens, -1))
    follow = (child >= 0) & (torch.rand(r, n, generator=g) < 0.7)
    row_tokens = torch.where(follow, child, torch.randint(0, 8, (r, n), generator=g))
    scores = torch.where(torch.rand(r, n - 1, generator=g) < 0.2, -math.inf, tree.scores)
    scores = torch.nn.functional.pad(scores, (1, 0), value=-math.inf)  # [R, N]: the root has no score
    return batch, row_tokens, scores


#: (requests, width) of successive verify steps: after the first two (eager, then captured) the
#: size class 4-7 and padded width 16 replay one capture, most of them smaller than a step before,
#: so their buffers hold an earlier step's values past the batch; then a batch of another class.
VERIFY_STEPS = ((7, 15), (5, 9), (7, 15), (4, 10), (6, 12), (5, 9), (4, 8), (2, 6))


def test_the_verify_step_replayed_from_a_padded_capture_walks_and_calibrates_as_eager():
    """`verify_trees` with `StepGraphs` (what sample_tree_step runs where the proposer captures): the
    walk, the statistics' sums, the committed count, the acceptance calibration and the KV moves
    equal the eager step's on every step, though a replay's buffers hold an earlier step's values past
    the batch; the moves are those read off the walk by hand."""
    graphs = StepGraphs("trace")
    captured, eager = AcceptanceCalibration(), AcceptanceCalibration()
    for seed, (r, budget) in enumerate(VERIFY_STEPS):
        batch, row_tokens, scores = verify_inputs(seed, r, budget)
        n = batch.tokens.shape[1]
        row_slots = torch.randperm(r * n, generator=torch.Generator().manual_seed(seed)).view(r, n) + 1000
        got = verify_trees(batch, row_tokens, scores, captured, graphs, row_slots=row_slots)
        want = verify_trees(batch, row_tokens, scores, eager, row_slots=row_slots)
        plain = walk_tree(batch, row_tokens, width=n)
        for name in ("output_tokens", "num_emitted", "path_rows", "accepted_rows"):
            assert torch.equal(getattr(got.walk, name), getattr(want.walk, name)), (name, seed)
            assert torch.equal(getattr(want.walk, name), getattr(plain, name)), (name, seed)
        for name in ("src_slots", "dst_slots", "path_first"):
            assert torch.equal(getattr(got.moves, name), getattr(want.moves, name)), (name, seed)
        for i in range(r):  # row path[j] moves to row j; past the path the root's slot onto itself
            path = [p for p in plain.path_rows[i].tolist() if p >= 0]
            src = [row_slots[i, path[j] if j < len(path) else 0] for j in range(1, n)]
            dst = [row_slots[i, j if j < len(path) else 0] for j in range(1, n)]
            assert want.moves.src_slots[i].tolist() == src and want.moves.dst_slots[i].tolist() == dst, (seed, i)
            rest = [j for j in range(n) if j not in path and batch.valid[i, j]]
            assert want.moves.path_first[i].tolist()[: len(path) + len(rest)] == path + rest, (seed, i)
        assert torch.equal(got.sums, want.sums) and torch.equal(got.committed, want.committed), seed
        assert int(got.committed) == int(plain.num_emitted.sum()) > r  # some nodes accepted
        assert got.sums.tolist() == [float((batch.num_rows > 1).sum()), float(batch.num_rows.sum()),
                                     float(batch.depths.max(dim=1).values.sum()), float(plain.num_emitted.sum())]
        torch.testing.assert_close(captured._ema, eager._ema)
        torch.testing.assert_close(captured._bin_sums, eager._bin_sums)
        assert torch.equal(captured.beta, eager.beta), seed
    assert (graphs.eager_calls, graphs.captures, graphs.replays) == (2, 1, 5)
    assert eager.bin_accepted.sum() > 0


def test_a_verify_capture_whose_mask_keeps_an_earlier_step_s_rows_walks_wrong_paths():
    """The negative control of the test above: `valid` given like the other inputs (its leading block
    only) leaves an earlier, larger step's rows valid in the capture's buffers, and the replays
    accept rows that are not the step's."""
    graphs = StepGraphs("trace")
    wrong = 0
    for seed, (r, budget) in enumerate(VERIFY_STEPS[:6]):
        batch, row_tokens, _ = verify_inputs(seed, r, budget)
        rows, width = padded_rows(r), padded_width(batch.tokens.shape[1])
        block = (rows, width)

        def step(tokens, parents, depths, valid, ancestors, row_tokens):
            return verify_step(tokens, parents, depths, valid, ancestors, row_tokens, width)

        got = graphs(("verify", rows, width), step, batch.tokens, batch.parents, batch.depths, batch.valid,
                     batch.ancestors, row_tokens, shapes=(block, block, block, block, (rows, width, width), block))
        want = walk_tree(batch, row_tokens, width=width)
        wrong += not torch.equal(got.committed, want.num_emitted.sum())
    assert wrong > 0


def test_step_graphs_copy_a_smaller_input_into_its_buffer_s_leading_block():
    graphs = StepGraphs("trace")
    calls = []

    def total(x, mask):
        calls.append(tuple(x.shape))
        return (x * mask).sum(dim=1)

    for n, seed in ((3, 0), (4, 1), (2, 2)):
        x = torch.arange(2 * n, dtype=torch.float32).view(2, n) + seed
        mask = torch.arange(4) < n  # whole: masks what an earlier call left in x's buffer
        assert torch.equal(graphs("k", total, x, mask, shapes=((2, 4), None)), x.sum(dim=1))
    assert calls == [(2, 4), (2, 4)]  # eager and capture on the buffer's shape; the third call replayed
    with pytest.raises(ValueError, match=r"an input of shape \(2, 5\) does not fit a buffer of shape \(2, 4\)"):
        graphs("k", total, torch.zeros(2, 5), mask, shapes=((2, 4), None))
    with pytest.raises(ValueError, match="shapes has 1 entries for 2 inputs"):
        graphs("k", total, x, mask, shapes=((2, 4),))
    assert [padded_width(n) for n in (1, 2, 3, 9, 16, 17, 65)] == [1, 2, 4, 16, 16, 32, 128]


class CorruptReplays(StepGraphs):
    """StepGraphs whose replays return a wrong walk (as a capture that went wrong on a device would)."""

    def __call__(self, key, fn, *inputs, shapes=None):
        out = super().__call__(key, fn, *inputs, shapes=shapes)
        if self.replays_of(key):
            out.walk.output_tokens.add_(1)
        return out


def test_the_first_replays_of_a_verify_capture_are_checked_against_the_eager_walk():
    """`verify_trees(checked_replays=k)` compares a capture's first k replays with the eager walk (one
    counted host read each, none after): a replay that differs is not used, the step's walk is the
    eager one, and the graphs turn off. The control: correct replays pass the check and stay on."""
    steps = [verify_inputs(seed, r, budget) for seed, (r, budget) in enumerate(VERIFY_STEPS[:6])]
    for graphs, corrupt in ((StepGraphs("trace"), False), (CorruptReplays("trace"), True)):
        acceptance = AcceptanceCalibration()
        reads = []
        for batch, row_tokens, scores in steps:
            HostReads.reset()
            got = verify_trees(batch, row_tokens, scores, acceptance, graphs, checked_replays=2)
            reads.append(HostReads.reset())
            want = walk_tree(batch, row_tokens, width=batch.tokens.shape[1])
            assert torch.equal(got.walk.output_tokens, want.output_tokens)
            assert torch.equal(got.committed, want.num_emitted.sum().double())
        if corrupt:  # the first replay was caught: eager from then on
            assert reads == [0, 0, 1, 0, 0, 0] and graphs.failed and "differed from the eager walk" in graphs.failed
            assert graphs.replays == 1 and graphs.eager_calls == 1  # (off: not called again)
        else:  # eager, capture, two checked replays, then trusted
            assert reads == [0, 0, 1, 1, 0, 0] and graphs.failed is None and graphs.replays == 4


def schedule_inputs(seed: int, proposed_rows: int, r: int, nodes: int, with_scores: bool = True):
    """The proposer's trees (packed as `tree_to_host` leaves them on the device) and a step that
    schedules some of them: request i keeps a prefix of tree `tree_row[i]`, or (from_tree 0) drafts
    the proposer did not make (a chain). Returns the inputs of `schedule_rows` and, per request, the
    expected (tokens, parents, depths, scores) of its verify rows, root first."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda hi: int(torch.randint(0, max(hi, 1), (1,), generator=g))  # noqa: E731
    trees = []
    block = torch.zeros(proposed_rows, 4 * nodes, dtype=torch.float64)
    for p in range(proposed_rows):
        count = rand(nodes + 1)
        parents = [rand(j + 1) - 1 for j in range(count)]  # parent before child
        depths = []
        for q in parents:
            depths.append(1 if q < 0 else depths[q] + 1)
        tokens = [rand(1000) for _ in range(count)]
        scores = sorted((-float(torch.rand(1, generator=g)) * 4 for _ in range(count)), reverse=True)
        trees.append((tokens, parents, depths, scores))
        fill = lambda xs, v: xs + [v] * (nodes - count)  # noqa: E731
        block[p] = torch.tensor(fill(tokens, 0) + fill(parents, -1) + fill(depths, 0) + fill(scores, -math.inf),
                                dtype=torch.float64)
    if not with_scores:
        block = block[:, : 3 * nodes]
    table, ids, expected, ctx = [], [], [], 0
    for i in range(r):
        row = rand(proposed_rows)
        tokens, parents, depths, scores = trees[row] if proposed_rows else ([], [], [], [])
        from_tree = bool(tokens) and rand(4) > 0
        if from_tree:
            d = 1 + rand(len(tokens))
            rows = ([-1] + [q + 1 for q in parents[:d]], [0] + depths[:d], [-math.inf] + scores[:d])
            drafts = tokens[:d]
        else:
            d = rand(nodes + 3)  # a chain may be longer than any tree (or empty: a plain decode)
            drafts = [rand(1000) for _ in range(d)]
            rows = (list(range(-1, d)), list(range(d + 1)), [-math.inf] * (d + 1))
        root = rand(1000)
        context = 3 + rand(40)
        table.append([row if proposed_rows else 0, d, 0 if from_tree else CHAIN, len(ids), context, len(ids)])
        expected.append(([root, *drafts], *rows, context))
        ids += [root, *drafts]
    step_ids = torch.tensor(ids + [7] * (256 - len(ids)), dtype=torch.int32)  # the runner's whole input buffer
    n = 1 + max(len(e[0]) - 1 for e in expected)
    return block, torch.tensor(table, dtype=torch.int64).T.contiguous(), step_ids, n, expected


# (proposed trees, requests, nodes): mostly one size class, so later steps replay earlier captures
SCHEDULE_STEPS = [(5, 4, 6)] * 3 + [(7, 6, 6), (6, 5, 6), (4, 7, 6), (5, 5, 6), (0, 2, 6), (9, 11, 6), (6, 4, 6), (7, 7, 6)]


def expected_rows(expected, n: int):
    """The scheduled rows by hand (per request, from lists), compiled by `compile_tree`."""
    r = len(expected)
    pad = lambda xs, v, width=n - 1: xs + [v] * (width - len(xs))  # noqa: E731
    tokens = torch.tensor([pad(e[0][1:], 0) for e in expected], dtype=torch.int64).view(r, n - 1)
    parents = torch.tensor([pad([q - 1 for q in e[1][1:]], -1) for e in expected], dtype=torch.int64).view(r, n - 1)
    depths = torch.tensor([pad(e[2][1:], 0) for e in expected], dtype=torch.int64).view(r, n - 1)
    num = torch.tensor([len(e[0]) - 1 for e in expected])
    valid = torch.arange(n - 1) < num[:, None]
    from vllm_ddtree.tree import DraftTree

    zeros = torch.zeros(r, n - 1)
    tree = DraftTree(tokens, parents, depths, zeros, zeros, valid, num, int(depths.max()) if depths.numel() else 0)
    batch = compile_tree(tree, torch.tensor([e[0][0] for e in expected]), torch.tensor([e[4] for e in expected]))
    scores = torch.tensor([pad(e[3], -math.inf, n) for e in expected], dtype=torch.float32).view(r, n)
    return batch, scores


def test_the_scheduled_rows_are_the_proposed_trees_cut_to_the_scheduler_s_counts():
    """`schedule_rows` (eager, and replayed from padded captures on later steps of other sizes)
    equals the rows made by hand from lists: each request's kept prefix of its tree, a chain where
    the drafts are not the proposer's (`CHAIN`), the root first; positions context + depth, the ancestor
    masks `compile_tree` makes, and each row's place in the step's tokens and logits."""
    graphs = StepGraphs("trace")
    for seed, (proposed_rows, r, nodes) in enumerate(SCHEDULE_STEPS):
        block, table, step_ids, n, expected = schedule_inputs(seed, proposed_rows, r, nodes)
        want, want_scores = expected_rows(expected, n)
        deepest = int(want.depths.max())
        for g in (None, graphs):
            got = schedule_rows(block, nodes, table, step_ids, n, deepest, True, g)
            b = got.batch
            for name in ("tokens", "parents", "depths", "positions", "valid", "num_rows", "context_lens", "ancestors"):
                assert torch.equal(getattr(b, name), getattr(want, name)), (name, seed, g)
            assert b.max_depth == deepest
            assert torch.equal(got.node_scores, torch.where(want.valid, want_scores, -math.inf)), seed
            starts = torch.tensor([sum(len(e[0]) for e in expected[:i]) for i in range(r)])
            index = torch.where(want.valid, starts[:, None] + torch.arange(n), 0)
            assert torch.equal(got.row_index, index) and torch.equal(got.logit_rows, index), seed
            assert torch.equal(got.write_index, torch.where(want.valid, index, starts[:, None])), seed
            assert torch.equal(step_ids[got.row_index].long() * want.valid, want.tokens * want.valid)
    assert graphs.replays >= 3 and graphs.captures >= 2 and graphs.failed is None


def test_a_schedule_capture_reading_its_request_table_s_leading_block_makes_wrong_rows():
    """The negative control of the test above: the request table given like the proposed block (its
    leading block only, not padded on the host) leaves an earlier, larger step's requests in the
    capture's buffer, and its padding rows keep their drafts."""
    from vllm_ddtree.tree.compile import scheduled_rows

    graphs, wrong = StepGraphs("trace"), 0
    for seed, (proposed_rows, r, nodes) in enumerate([(9, 7, 6), (9, 6, 6), (9, 5, 6), (9, 4, 6)] * 3):
        block, table, step_ids, n, expected = schedule_inputs(seed, proposed_rows, r, nodes)
        rows, width = padded_rows(r), padded_width(n)

        def step(block, table, step_ids):
            return scheduled_rows(block, nodes, table, step_ids, width, width - 1, True)

        got = graphs(("schedule", rows, width), step, block, table, step_ids,
                     shapes=((padded_rows(proposed_rows), 4 * nodes), (6, rows), None))
        wrong += bool((got.batch.num_rows[r:] > 1).any())  # a padding request with drafts
    assert wrong > 0


class CorruptSchedules(StepGraphs):
    """StepGraphs whose replays return wrong positions (as a capture that went wrong on a device would)."""

    def __call__(self, key, fn, *inputs, shapes=None):
        out = super().__call__(key, fn, *inputs, shapes=shapes)
        if self.replays_of(key):
            out[0][3].add_(1)  # the stacked int fields' positions (`tree.step._packed_schedule`)
        return out


def test_the_first_replays_of_a_schedule_capture_are_checked_against_the_eager_rows():
    """`schedule_rows(checked_replays=k)` compares a capture's first k replays with the eager rows (one
    counted host read each): a replay that differs is not used and the graphs turn off; correct
    replays pass and stay on."""
    steps = [schedule_inputs(seed, 5, 4, 6) for seed in (0, 1, 3, 4, 5, 8)]  # one key: 8 rows each
    for graphs, corrupt in ((StepGraphs("trace"), False), (CorruptSchedules("trace"), True)):
        reads = []
        for block, table, step_ids, n, expected in steps:
            want, _ = expected_rows(expected, n)
            HostReads.reset()
            got = schedule_rows(block, 6, table, step_ids, n, int(want.depths.max()), True, graphs, checked_replays=2)
            reads.append(HostReads.reset())
            assert torch.equal(got.batch.positions, want.positions)
        if corrupt:
            assert reads == [0, 0, 1, 0, 0, 0] and "differed from the eager one" in graphs.failed
        else:
            assert reads[:4] == [0, 0, 1, 1] and reads[4:] == [0, 0] and graphs.failed is None
