"""The per-step tree work runs on the tensors' device with no host synchronisation.

No GPU here, so the proof uses PyTorch's "meta" device: meta tensors have shapes but no values, so
any read of a value on the host (`.item()`, `.tolist()`, `int(t)`, indexing with a 0-d tensor,
boolean-mask indexing, `nonzero`) raises, and so does mixing a meta tensor with one created on the
CPU by a missing `device=`. Whatever passes here keeps a GPU step free of syncs and device
mismatches. (Building the n-gram tables merges with `torch.unique`, a documented sync once per
step; the tables are built on the CPU and moved.)
"""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.tree import (
    HostTokens,
    AcceptanceCalibration,
    AutoBudget,
    LookupCalibration,
    CostModel,
    ModelShape,
    NGramCounts,
    NGramModel,
    TokenHistory,
    allocate_batch,
    compaction_plan,
    compile_tree,
    get_profile,
    greedy_tokens,
    sample_tokens,
    topk_per_depth,
    walk_tree,
)
from vllm_ddtree.compaction import accepted_path_moves
from vllm_ddtree.tree import add_branch, build_tree

META = torch.device("meta")
R, DEPTH, VOCAB, WIDTH = 3, 6, 50, 8


def on_meta(model: NGramModel) -> NGramModel:
    t = model.online
    model.online = NGramCounts(t.order, t.vocab_size, META, *[[x.to(META) for x in xs] for xs in
                               (t.ngram_keys, t.ngram_counts, t.context_keys, t.context_counts)],
                               fixed_shape=t.fixed_shape)
    model.device, model.tails = META, model.tails.to(META)
    return model


def cost_model() -> CostModel:
    return CostModel(ModelShape(30, 576, 9, 3, 64, 1536, VOCAB, 4), get_profile("cpu"), per_token=0.002, intercept=0.05)


@pytest.mark.parametrize("fixed_shape", [False, True])  # (True: the tables a captured step reads)
def test_a_whole_tree_step_runs_on_the_device_without_a_host_sync(fixed_shape):
    logits = torch.randn(R, DEPTH, VOCAB, device=META)
    top_logp, top_ids = topk_per_depth(logits, WIDTH)
    ngram = NGramModel(VOCAB, 3, fixed_shape=fixed_shape)
    ngram.observe_batch([0, 1, 2], [torch.randint(0, VOCAB, (30,)) for _ in range(R)])
    ngram = on_meta(ngram)
    ctx = torch.full((R,), 100, device=META)
    for scorer, tail in [(None, None), (ngram.scorer([0, 1, 2]), ngram.context_tail([0, 1, 2]))]:
        tree = build_tree(top_logp, top_ids, WIDTH, max_budget=WIDTH, scorer=scorer, context_tail=tail, lam=0.2,
                          validate=False)
        assert tree.tokens.device == META
    # The step's sampled tokens into the tables (a prompt held by the host beside them), a finished
    # request released, and again: the padding's lengths never come back from meta, so no cut either.
    sampled = torch.randint(0, VOCAB, (R, 4), device=META)
    ngram.observe_step([0, 1, 2], sampled, HostTokens.from_lists([None, ([], [5, 6, 7]), None]))
    ngram.release_batch([1])
    ngram.observe_step([0, 1, 2], sampled)
    assert ngram.online.ngram_keys[2].device == ngram.tails.device == META
    # The prompt-lookup branch: each request's text on the device, its continuation and its merge into
    # the trees.
    history = TokenHistory(16, 2, slots=R, device=META)
    history.observe_step([0, 1, 2], sampled, HostTokens.from_lists([None, ([], [5, 6, 7]), None]))
    history.release([1])
    slots = history.observe_step([0, 1, 2], sampled)
    assert history.tokens.device == history.lengths.device == META
    tokens, valid = history.continuation(slots, 5)
    branched = add_branch(tree, tokens, valid, WIDTH + 5)
    assert branched.tokens.device == META and branched.max_nodes == WIDTH + 5

    # The automatic budget, after it has seen acceptances (its exponent is then read from a tensor).
    first_node = (torch.arange(tree.valid.shape[1], device=META) == 0).expand_as(tree.valid)  # each accepted 1 node
    auto = AutoBudget(cost_model(), 1, WIDTH)
    auto.acceptance = AcceptanceCalibration(betas=torch.logspace(-0.6, 0.9, 31, device=META))
    auto.calibration.explored = [(0, 0, 0, 0)] * (len(auto.calibration.budgets) * auto.calibration.repeats)  # calibrated: choose by the cost model
    for _ in range(2):
        budgets = auto.choose(tree.scores, ctx.float())
        auto.observe_acceptance(tree.scores, tree.valid, first_node)
    plan = allocate_batch(tree.scores, ctx.float(), cost_model(), 1, WIDTH, rate=torch.tensor(20.0, device=META))
    assert budgets.device == plan.budgets.device == META
    # With the lookup path priced in: calibrations moved to the device, no host tensor in the updates.
    priced = AutoBudget(cost_model(), 1, WIDTH, lookup=LookupCalibration(5)).to(META)
    priced.calibration.explored = [(0, 0, 0, 0)] * (len(priced.calibration.budgets) * priced.calibration.repeats)
    for _ in range(2):
        plan = priced.choose_plan(tree.scores, ctx.float(), valid)
        priced.observe_lookup(tokens, valid, torch.zeros(R, 3, dtype=torch.int64, device=META))
        priced.observe_acceptance(tree.scores, tree.valid, first_node)
    assert plan.budgets.device == plan.extra.device == priced.lookup.hits.device == META

    kept = tree.truncate(budgets)
    batch = compile_tree(kept, torch.zeros(R, dtype=torch.int64, device=META), ctx)
    target_logits = torch.randn(R, WIDTH + 1, VOCAB, device=META)
    for row_tokens in (greedy_tokens(target_logits),
                       sample_tokens(torch.softmax(target_logits, -1), torch.empty_like(target_logits).exponential_())):
        walk = walk_tree(batch, row_tokens)
        moves = compaction_plan(batch, walk.path_rows)
        assert walk.output_tokens.device == moves.src.device == walk.accepted_rows.device == META


def test_a_host_read_does_fail_on_the_meta_device():
    # The premise of the test above: a value read on the host raises.
    t = torch.zeros(3, device=META)
    with pytest.raises((RuntimeError, NotImplementedError)):
        t[t.argmin()]
    with pytest.raises((RuntimeError, NotImplementedError)):
        t.tolist()


def test_the_walk_s_accepted_rows_are_its_path_s_rows_each_at_its_depth():
    """`accepted_rows` (what compaction and the calibration read) holds exactly the rows of
    `path_rows`, and each such row's index on the path is its depth."""
    longer = 0
    for seed in range(6):
        batch, walk, _, _ = _walked_step(torch.device("cpu"), seed)
        for r in range(batch.batch_size):
            path = [p for p in walk.path_rows[r].tolist() if p >= 0]
            want = [-1] * batch.max_rows
            for index, row in enumerate(path):
                want[row] = index
            assert torch.where(walk.accepted_rows[r], batch.depths[r], -1).tolist() == want
            longer += len(path) > 1
    assert longer  # the cases accept nodes, not only roots


def _walked_step(device, seed=0):
    """Two requests' trees, walked, in a step whose token layout also holds a 5-token prefill."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, DEPTH, VOCAB, generator=g).to(device)
    top_logp, top_ids = topk_per_depth(logits, WIDTH)
    tree = build_tree(top_logp, top_ids, torch.tensor([WIDTH, 3]).to(device), max_budget=WIDTH, validate=False)
    batch = compile_tree(tree, torch.tensor([7, 9]).to(device), torch.tensor([40, 12]).to(device))
    # The target picks a random child of each row (so paths skip rows and must be reordered).
    target = torch.full((2, WIDTH + 1), VOCAB - 1)
    for r in range(2):
        children: dict[int, list[int]] = {}
        for i, p in enumerate(batch.parents[r].tolist()[: int(batch.num_rows[r])]):
            if p >= 0:
                children.setdefault(p, []).append(i)
        for p, kids in children.items():
            target[r, p] = batch.tokens[r, kids[int(torch.randint(len(kids), (1,), generator=g))]]
    target = target.to(device)
    walk = walk_tree(batch, target)
    starts = torch.tensor([5, 5 + WIDTH + 1]).to(device)  # request 0's rows follow the prefill's 5 tokens
    row_index = torch.where(batch.valid, starts[:, None] + torch.arange(WIDTH + 1, device=device), 0)
    total = 5 + (WIDTH + 1) + 4
    slot_mapping = (torch.randperm(total, generator=g) + 100).to(device)
    return batch, walk, row_index, slot_mapping


def test_accepted_path_moves_match_the_plain_host_computation():
    reordered = 0
    for seed in range(6):
        batch, walk, row_index, slots = _walked_step(torch.device("cpu"), seed)
        moves = accepted_path_moves(batch, walk, row_index, slots)
        # The same with host-side boolean indexing (what the engine did before).
        plan = compaction_plan(batch, walk.path_rows)
        root = batch.context_lens.view(-1, 1)
        assert torch.equal(moves.src_slots, slots[row_index.gather(1, (plan.src - root).clamp(min=0)).reshape(-1)])
        assert torch.equal(moves.dst_slots, slots[row_index.gather(1, (plan.dst - root).clamp(min=0)).reshape(-1)])
        expected = list(range(slots.shape[0]))
        for r in range(2):
            path = [p for p in walk.path_rows[r].tolist() if p >= 0]
            rows = path + [i for i in range(int(batch.num_rows[r])) if i not in path]
            for i, row in enumerate(rows):
                expected[int(row_index[r, i])] = int(row_index[r, row])
        assert moves.context_order.tolist() == expected
        reordered += int(any(rows[i] != i for r in range(2) for i in range(len(rows))))
    assert reordered  # the cases include paths that are not a prefix of the rows


def test_accepted_path_moves_run_on_the_device_without_a_host_sync():
    batch, walk, row_index, slots = _walked_step(torch.device("cpu"))
    to = lambda x: x.to(META)  # noqa: E731
    meta_batch = batch.to(META)  # compiled on the host, as the engine does, then moved
    assert all(v.device == META for v in vars(meta_batch).values() if isinstance(v, torch.Tensor))
    meta_walk = walk_tree(meta_batch, torch.zeros(meta_batch.tokens.shape, dtype=torch.int64, device=META))
    assert meta_walk.path_rows.device == META
    moves = accepted_path_moves(meta_batch, meta_walk, to(row_index), to(slots))
    assert moves.context_order.device == META and moves.context_order.shape == slots.shape
