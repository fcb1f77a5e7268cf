"""The tree builder: optimality against brute force, identical implementations, prefix-closure."""

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm_ddtree.tree.build as build_mod
from vllm_ddtree.tree import NGramModel, add_branch, build_tree, build_tree_reference, head_topk, topk_per_depth
from vllm_ddtree.tree.build import NO_PARENT, tree_to_host


def brute_force(top_logp, top_ids, budget, scorer=None, tail=None, lam=0.0, row=0):
    """All prefixes of one request, scored in float32 like the builders, ordered by the documented key."""
    _, depth, k = top_logp.shape
    nodes = []  # (neg_score, depth, nested_key, path, q)

    def expand(path, score, q, key, hist, d):
        if d == depth:
            return
        tok = top_logp[row, d]
        if scorer is not None:
            h = torch.tensor(hist).view(1, 1, -1)
            rho = scorer.log_rho(h, top_ids[row, d].view(1, 1, k), torch.tensor([row])).view(k)
            tok = tok + torch.tensor(lam, dtype=torch.float32) * rho
        child = score + tok
        for j in range(k):
            s = float(child[j])
            if not math.isfinite(s):
                continue
            t = int(top_ids[row, d, j])
            ck = (-s, key, j)
            p = path + (t,)
            nodes.append((-s, d + 1, ck, p))
            expand(p, child[j], None, ck, (hist + [t])[len(hist) and 1 :] if scorer else [], d + 1)

    expand((), torch.zeros((), dtype=torch.float32), None, (), tail[row].tolist() if tail is not None else [], 0)
    nodes.sort(key=lambda x: (x[0], x[1], x[2]))
    return [p for _, _, _, p in nodes[:budget]]


def tree_paths(tree, row):
    paths = []
    for i in range(int(tree.num_nodes[row])):
        p = int(tree.parents[row, i])
        paths.append((paths[p] if p != NO_PARENT else ()) + (int(tree.tokens[row, i]),))
    return paths


# the best-score selections `build_tree` picks by device: packed keys (CPU), a stable sort (GPU)
SELECTIONS = (build_mod._top_scores_by_keys, build_mod._top_scores_by_sort)


def marginals(seed, r, depth, vocab, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(r, depth, vocab, generator=g) * 2
    if ties:  # coarse logits: many exactly equal scores, to exercise tie-breaking
        logits = logits.round()
    return topk_per_depth(logits, vocab)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    depth=st.integers(1, 4),
    vocab=st.integers(1, 5),
    budget=st.integers(1, 40),
    ties=st.booleans(),
)
def test_builders_equal_brute_force(seed, depth, vocab, budget, ties):
    lp, ids = marginals(seed, 2, depth, vocab, ties)
    ref = build_tree_reference(lp, ids, budget)
    for selection in SELECTIONS:  # the CPU's best-score selection, then the GPU's
        with mock.patch.object(build_mod, "_top_scores", selection):
            fast = build_tree(lp, ids, budget)
        for name in ("tokens", "parents", "depths", "valid", "num_nodes"):
            assert torch.equal(getattr(fast, name), getattr(ref, name)), (selection.__name__, name)
    for row in range(2):
        assert tree_paths(fast, row) == brute_force(lp, ids, budget, row=row)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    depth=st.integers(1, 4),
    vocab=st.integers(2, 5),
    budget=st.integers(1, 30),
    lam=st.sampled_from([0.0, 0.2, 1.0, 3.0]),
    ties=st.booleans(),
)
def test_builders_equal_brute_force_with_ngram_scores(seed, depth, vocab, budget, lam, ties):
    lp, ids = marginals(seed, 2, depth, vocab, ties)
    g = torch.Generator().manual_seed(seed + 1)
    model = NGramModel(vocab, order=3)
    for slot in (3, 7):
        model.observe(slot, torch.randint(0, vocab, (12,), generator=g))
    scorer = model.scorer([3, 7])
    tail = model.context_tail([3, 7])
    ref = build_tree_reference(lp, ids, budget, scorer=scorer, context_tail=tail, lam=lam)
    for selection in SELECTIONS:
        with mock.patch.object(build_mod, "_top_scores", selection):
            fast = build_tree(lp, ids, budget, scorer=scorer, context_tail=tail, lam=lam)
        for name in ("tokens", "parents", "depths", "valid"):
            assert torch.equal(getattr(fast, name), getattr(ref, name)), (selection.__name__, name)
    for row in range(2):
        assert tree_paths(fast, row) == brute_force(lp, ids, budget, scorer, tail, lam, row=row)


def test_ngram_rescoring_changes_the_tree_towards_the_context():
    # Drafter slightly prefers token 1 after the root; the request has repeated "0 2" many times.
    lp = torch.log(torch.tensor([[[0.3, 0.4, 0.3], [0.34, 0.33, 0.33]]]))
    ids = torch.arange(3).expand(1, 2, 3).contiguous()
    lp, order = lp.sort(dim=-1, descending=True)
    ids = ids.gather(-1, order)
    model = NGramModel(3, order=3)
    model.observe(0, [0, 2] * 10 + [0])  # after "... 2 0" comes 2
    scorer, tail = model.scorer([0]), model.context_tail([0])
    plain = build_tree(lp, ids, 1)
    rescored = build_tree(lp, ids, 1, scorer=scorer, context_tail=tail, lam=1.0)
    assert int(plain.tokens[0, 0]) == 1
    assert int(rescored.tokens[0, 0]) == 2


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_tree_is_prefix_closed_best_first_and_nested(budget):
    lp, ids = marginals(0, 4, 6, 50)
    tree = build_tree(lp, ids, budget)
    for row in range(4):
        n = int(tree.num_nodes[row])
        assert n == min(budget, 50 + 50**2 * 6)
        assert tree.valid[row, :n].all() and not tree.valid[row, n:].any()
        for i in range(n):
            p = int(tree.parents[row, i])
            assert p < i  # parent before child
            assert int(tree.depths[row, i]) == (1 if p == NO_PARENT else int(tree.depths[row, p]) + 1)
        s = tree.scores[row, :n]
        assert (s[1:] <= s[:-1]).all()  # best-first
    smaller = build_tree(lp, ids, max(1, budget // 2))
    m = smaller.max_nodes
    assert torch.equal(smaller.tokens, tree.tokens[:, :m]) and torch.equal(smaller.parents, tree.parents[:, :m])


def test_per_request_budgets_and_static_width():
    lp, ids = marginals(1, 3, 5, 20)
    budgets = torch.tensor([1, 9, 30])
    tree = build_tree(lp, ids, budgets, max_budget=32)
    assert tree.max_nodes == 32
    assert tree.num_nodes.tolist() == [1, 9, 30]
    full = build_tree(lp, ids, 32)
    for row, b in enumerate(budgets.tolist()):
        assert torch.equal(tree.tokens[row, :b], full.tokens[row, :b])


def test_tree_to_host_lists_each_request_s_kept_nodes():
    # What the proposer hands the scheduler and keeps for verification, and the depth the next
    # step drafts to: a swapped column (parents for depths, say) would change no output, so only
    # this test catches it. Peaked marginals make deep trees, whose parent indices, depths and
    # tokens all differ.
    lp, ids = marginals(5, 3, 6, 30)
    tree = build_tree(lp * 4, ids, 12).truncate(torch.tensor([12, 3, 0]))
    host = tree_to_host(tree, with_scores=True)
    assert [len(t) for t in host.tokens] == [12, 3, 0]
    for r in range(3):
        n = int(tree.num_nodes[r])
        assert host.tokens[r] == tree.tokens[r, :n].tolist()
        assert host.parents[r] == tree.parents[r, :n].tolist()
        assert host.depths[r] == tree.depths[r, :n].tolist()
        assert host.scores[r] == tree.scores[r, :n].tolist()
    assert host.deepest == int(tree.depths[tree.valid].max()) > 1
    assert host.ranked == 12  # the largest tree the drafter ranked (the automatic budget grows from it)
    assert tree_to_host(tree).scores is None
    assert tree_to_host(tree.truncate(0)).deepest == 0  # no request kept a node
    # A branch's nodes are verified but the drafter did not rank them: the drafted depth ignores them.
    branch = add_branch(tree.truncate(1), torch.full((3, 9), 7), torch.ones(3, 9, dtype=torch.bool), 40)
    host = tree_to_host(branch)
    assert (host.deepest, host.ranked) == (1, 1) and max(map(max, host.depths)) >= 8


def branch_on_host(tree, tokens: list[int], max_nodes: int) -> tuple[list, list, list]:
    """add_branch for one request in plain Python: follow the path down the tree, append the rest."""
    n = int(tree.num_nodes[0])
    tok, par, dep = tree.tokens[0, :n].tolist(), tree.parents[0, :n].tolist(), tree.depths[0, :n].tolist()
    node, d = NO_PARENT, 0
    while d < len(tokens):
        kids = [i for i in range(len(tok)) if par[i] == node and tok[i] == tokens[d]]
        if not kids:
            break
        node, d = kids[0], d + 1
    while d < len(tokens) and len(tok) < max_nodes:
        tok.append(tokens[d])
        par.append(node)
        dep.append(d + 1)
        node, d = len(tok) - 1, d + 1
    return tok, par, dep


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(1, 12), length=st.integers(0, 6), extra=st.integers(0, 8))
def test_add_branch_shares_the_tree_s_prefix_and_appends_the_rest(seed, budget, length, extra):
    g = torch.Generator().manual_seed(seed)
    lp, ids = topk_per_depth(torch.randn(4, 6, 5, generator=g) * 2, 3)
    tree = build_tree(lp, ids, budget, max_budget=budget)
    # Paths drawn from the same 5 tokens often run along the tree for a while, then leave it.
    tokens = torch.randint(0, 5, (4, 6), generator=g)
    valid = torch.arange(6)[None, :] < torch.tensor([length, 0, 6, 3])[:, None]
    out = add_branch(tree, tokens, valid, budget + extra)
    for r in range(4):
        n = int(out.num_nodes[r])
        sub = tree.truncate(torch.tensor([int(tree.num_nodes[r])] * 4))
        one = type(tree)(*(x[r : r + 1] if torch.is_tensor(x) else x for x in vars(sub).values()))
        want = branch_on_host(one, tokens[r][valid[r]].tolist(), budget + extra)
        assert (out.tokens[r, :n].tolist(), out.parents[r, :n].tolist(), out.depths[r, :n].tolist()) == want
        assert out.valid[r, :n].all() and not out.valid[r, n:].any()
        assert (out.tokens[r, n:] == 0).all() and (out.parents[r, n:] == -1).all() and (out.depths[r, n:] == 0).all()
        assert torch.equal(out.scores[r, : int(tree.num_nodes[r])], tree.scores[r, : int(tree.num_nodes[r])])
        assert torch.isneginf(out.scores[r, int(tree.num_nodes[r]) : n]).all()  # appended: not ranked


def test_fewer_prefixes_than_budget_pads():
    lp, ids = marginals(2, 1, 2, 2)  # only 2 + 4 prefixes exist
    tree = build_tree(lp, ids, 10)
    assert tree.max_nodes == 10 and int(tree.num_nodes[0]) == 6
    ref = build_tree_reference(lp, ids, 10)
    assert torch.equal(tree.tokens, ref.tokens)


def test_zero_probability_tokens_never_enter_the_tree():
    lp = torch.log(torch.tensor([[[1.0, 0.0, 0.0]]]))
    ids = torch.tensor([[[0, 1, 2]]])
    tree = build_tree(lp, ids, 3)
    assert int(tree.num_nodes[0]) == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(budgets=0), "budget must be >= 1"),
        (dict(budgets=torch.tensor([1, 2, 3])), r"budgets must have shape \[2\]"),
        (dict(lam=-0.1, scorer="ngram"), "lambda must be >= 0"),
        (dict(nan=True), "NaN"),
        (dict(all_neg_inf=True), "all candidates are -inf"),
        (dict(logits=True), "log-probabilities"),
        (dict(ids_shape=True), "must equal top_logp shape"),
        (dict(scorer="ngram", no_tail=True), "context_tail"),
    ],
)
def test_bad_input_raises_clear_errors(kwargs, match):
    lp, ids = marginals(3, 2, 3, 4)
    budgets = kwargs.get("budgets", 4)
    if kwargs.get("nan"):
        lp[0, 1, 2] = float("nan")
    if kwargs.get("all_neg_inf"):
        lp[1, 2, :] = -math.inf
    if kwargs.get("logits"):
        lp = lp + 5
    if kwargs.get("ids_shape"):
        ids = ids[:, :2]
    scorer = tail = None
    if kwargs.get("scorer"):
        model = NGramModel(4)
        scorer = model.scorer([0, 1])
        tail = None if kwargs.get("no_tail") else model.context_tail([0, 1])
    for fn in (build_tree, build_tree_reference):
        with pytest.raises(ValueError, match=match):
            fn(lp, ids, budgets, scorer=scorer, context_tail=tail, lam=kwargs.get("lam", 0.2))


def test_topk_rejects_bad_k_and_empty_vocab():
    with pytest.raises(ValueError, match="top-k"):
        topk_per_depth(torch.zeros(1, 2, 5), 6)
    with pytest.raises(ValueError, match="empty vocabulary"):
        topk_per_depth(torch.zeros(1, 2, 0), 1)


def test_best_score_selection_by_sort_and_by_keys_agree(monkeypatch):
    # The GPU's stable sort and the CPU's packed keys: the same indices, ties (+0.0 and -0.0
    # included) in index order, -inf last.
    import vllm_ddtree.tree.build as build_mod
    from vllm_ddtree.tree.build import _top_scores_by_keys, _top_scores_by_sort

    g = torch.Generator().manual_seed(0)
    scores = (torch.randint(-4, 4, (16, 300), generator=g) / 2).float()  # many ties
    scores[:, ::7] = -math.inf
    scores[0, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0])
    scores[1] = -math.inf
    for k in (1, 17, 300):
        (sort_values, by_sort), (key_values, by_keys) = _top_scores_by_sort(scores, k), _top_scores_by_keys(scores, k)
        assert torch.equal(by_sort, by_keys) and torch.equal(sort_values, key_values), k
        assert torch.equal(key_values, scores.gather(1, by_keys))
    stable = torch.sort(scores, dim=1, descending=True, stable=True).indices
    assert torch.equal(_top_scores_by_keys(scores, 300)[1], stable)
    # The whole build with either selection (equal-probability candidates: ties across parents and depths).
    logits = torch.randint(0, 3, (3, 6, 40), generator=g).float()
    top = topk_per_depth(logits, 8)
    by_keys = build_tree(*top, 20)
    monkeypatch.setattr(build_mod, "_top_scores", _top_scores_by_sort)
    by_sort = build_tree(*top, 20)
    for name in ("tokens", "parents", "depths", "valid"):
        assert torch.equal(getattr(by_sort, name), getattr(by_keys, name)), name


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_per_depth_in_chunks_of_rows_is_the_same_as_at_once(temperature):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 7, 300, generator=g) * 3
    logits[1, 2, :40] = logits[1, 2, 40]  # equal logits: ties within a row
    whole = topk_per_depth(logits, 16, temperature)
    for rows in (1, 4, 34, 35):  # a chunk of one row, uneven chunks, one chunk short of all 35 rows
        chunked = topk_per_depth(logits, 16, temperature, chunk_bytes=rows * 4 * 300)
        assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1]), rows


def _peak_bytes(fn) -> int:
    """The peak of the torch CPU memory held while `fn` runs (torch.profiler's memory timeline)."""
    import numpy as np
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return int(np.asarray(sizes).sum(1).max())


def test_topk_per_depth_holds_one_chunk_of_log_probs_at_a_time():
    # 64 requests x 15 depths x V = 4096: 15.7 MB of float32 log-probs at once; in chunks of 1 MiB.
    logits = torch.randn(64, 15, 4096, generator=torch.Generator().manual_seed(0))
    logits_bytes = logits.numel() * 4
    chunk = 1 << 20
    at_once = _peak_bytes(lambda: topk_per_depth(logits, 32, chunk_bytes=logits_bytes)) - logits_bytes
    chunked = _peak_bytes(lambda: topk_per_depth(logits, 32, chunk_bytes=chunk)) - logits_bytes
    out_bytes = 64 * 15 * 32 * (4 + 8)  # the top-k values and ids
    assert at_once >= logits_bytes  # the negative control: every row's log-probs at once
    assert chunked <= chunk + 2 * out_bytes, (chunked, at_once)  # a chunk, the chunks' results and their concatenation


def test_head_topk_runs_the_head_in_chunks_and_holds_one_chunks_logits_at_a_time():
    # The drafter's head on 64 x 15 rows (H 32, V 4096): its whole logits are 15.7 MB of float32 at once.
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(64 * 15, 32, generator=g), torch.randn(4096, 32, generator=g)
    calls: list[int] = []

    def head(h):
        calls.append(h.shape[0])
        return h @ weight.T

    logits_bytes, chunk = 64 * 15 * 4096 * 4, 1 << 20
    whole = topk_per_depth((hidden @ weight.T).view(64, 15, 4096), 32)
    lp, ids = head_topk(hidden, head, 4096, 32, chunk_bytes=chunk)
    assert calls == [64] * 15  # 1 MiB of float32 log-probs: 64 rows of 4096 per head call
    # the rows' GEMM in chunks may round differently; the chosen ids and order are the same here
    assert torch.equal(ids, whole[1].view(-1, 32)) and torch.allclose(lp, whole[0].view(-1, 32), atol=1e-4)
    at_once = _peak_bytes(lambda: head_topk(hidden, head, 4096, 32, chunk_bytes=logits_bytes))
    chunked = _peak_bytes(lambda: head_topk(hidden, head, 4096, 32, chunk_bytes=chunk))
    out_bytes = 64 * 15 * 32 * (4 + 8)
    assert at_once >= 2 * logits_bytes  # the negative control: every row's logits and log-probs at once
    # a chunk's logits and log-probs, the results, and room for the top-k's own scratch: a tenth of at once
    assert chunked <= 3 * chunk + 2 * out_bytes, (chunked, at_once)
    with pytest.raises(ValueError, match="expected 4000"):
        head_topk(hidden, head, 4000, 32)
