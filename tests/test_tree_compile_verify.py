"""Compile (positions, masks, FlashInfer layout, compaction) and the lossless verification walk."""


import pytest
import torch
from scipy.stats import chisquare

from vllm_ddtree.tree import (
    apply_compaction_,
    build_tree,
    compaction_plan,
    compile_tree,
    dense_attention_mask,
    flashinfer_tree_mask,
    greedy_tokens,
    sample_tokens,
    topk_per_depth,
    walk_tree,
)


def make_batch(seed=0, r=3, depth=4, vocab=6, budget=12, ctx=(5, 0, 9)):
    g = torch.Generator().manual_seed(seed)
    lp, ids = topk_per_depth(torch.randn(r, depth, vocab, generator=g) * 2, vocab)
    tree = build_tree(lp, ids, torch.tensor([budget, 1, budget // 2]), max_budget=budget)
    roots = torch.randint(0, vocab, (r,), generator=g)
    return tree, compile_tree(tree, roots, torch.tensor(ctx))


def ancestors_naive(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out | {0}


def test_positions_mask_and_rows():
    tree, batch = make_batch()
    for r in range(batch.batch_size):
        n = int(batch.num_rows[r])
        assert n == int(tree.num_nodes[r]) + 1
        assert torch.equal(batch.positions[r], batch.context_lens[r] + batch.depths[r])
        par = batch.parents[r].tolist()
        for i in range(n):
            expect = ancestors_naive(par, i)
            got = set(batch.ancestors[r, i].nonzero().flatten().tolist())
            assert got == expect, (r, i)
            if i:
                assert int(batch.depths[r, i]) == int(batch.depths[r, par[i]]) + 1
        for i in range(n, batch.max_rows):  # padding rows: non-empty and never seen by real rows
            assert batch.ancestors[r, i, i] and not batch.ancestors[r, :n, i].any()


@pytest.mark.parametrize("seed", range(6))
def test_both_ancestor_masks_are_every_row_s_ancestors(seed):
    """The GPU's (reachability squared) and the CPU's (parents chased) give the same, right mask."""
    from vllm_ddtree.tree.compile import ancestors_by_chasing, ancestors_by_squaring

    tree, batch = make_batch(seed, depth=2 + seed, budget=4 + 6 * seed)
    depth = batch.max_depth
    squared, chased = ancestors_by_squaring(batch.parents, depth), ancestors_by_chasing(batch.parents, depth)
    for mask in (squared, chased):
        for r in range(batch.batch_size):
            par = batch.parents[r].tolist()
            for i in range(int(batch.num_rows[r])):
                assert set(mask[r, i].nonzero().flatten().tolist()) == ancestors_naive(par, i), (r, i)
    assert torch.equal(squared, chased)  # padding rows too: themselves and the root


@pytest.mark.parametrize("length", [1, 15, 16, 17, 64, 100, 200])
def test_the_squared_mask_keeps_long_chains_whole(length):
    """A chain as long as a lookup path or longer: the squarings' path counts grow past float32's
    exact integers and, unclamped, past its range (2^256 at 8 squarings), yet every ancestor stays
    seen and no other row."""
    from vllm_ddtree.tree.compile import ancestors_by_chasing, ancestors_by_squaring

    parents = torch.arange(-1, length, dtype=torch.int64)[None, :]  # row 0 the root, row k the child of k - 1
    parents = torch.cat([parents, torch.full((1, 3), -1)], dim=1)  # and three padding rows
    squared = ancestors_by_squaring(parents, length)
    assert torch.equal(squared, ancestors_by_chasing(parents, length))
    assert torch.equal(squared[0, : length + 1, : length + 1], torch.ones(length + 1, length + 1, dtype=torch.bool).tril())


def test_flashinfer_layout_matches_dense_mask():
    _, batch = make_batch()
    fi = flashinfer_tree_mask(batch)
    for r in range(batch.batch_size):
        q, c = int(batch.num_rows[r]), int(batch.context_lens[r])
        assert int(fi.kv_lens[r]) == c + q
        assert int(fi.qo_indptr[r + 1] - fi.qo_indptr[r]) == q
        block = fi.custom_mask[fi.mask_indptr[r] : fi.mask_indptr[r + 1]].view(q, c + q)
        dense = dense_attention_mask(batch, c + q)[r, :q]
        assert torch.equal(block, dense)
        assert block[:, :c].all()
    assert int(fi.mask_indptr[-1]) == fi.custom_mask.numel()


class ToyTarget:
    """A target LM whose next-token distribution depends on the last two tokens (a random table)."""

    def __init__(self, vocab, seed=0, sharp=1.0):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.logits = torch.randn(vocab + 1, vocab + 1, vocab, generator=g) * sharp  # index vocab = "none"

    def row_logits(self, batch, before_root):
        """Logits of every verify row given its path; before_root [R] is the token before the root."""
        prev = torch.where(batch.parents >= 0, batch.tokens.gather(1, batch.parents.clamp(min=0)), 0)
        prev[:, 0] = before_root
        return self.logits[prev, batch.tokens]

    def greedy_chain(self, prev, cur, n):
        out = []
        for _ in range(n):
            nxt = int(self.logits[prev, cur].argmax())
            out.append(nxt)
            prev, cur = cur, nxt
        return out


@pytest.mark.parametrize("seed", range(5))
def test_greedy_walk_is_the_target_argmax_chain(seed):
    vocab = 5
    target = ToyTarget(vocab, seed, sharp=3.0)
    tree, batch = make_batch(seed, vocab=vocab, budget=40)
    before = torch.tensor([1, 2, 3])
    walk = walk_tree(batch, greedy_tokens(target.row_logits(batch, before)))
    for r in range(batch.batch_size):
        k = int(walk.num_emitted[r])
        chain = target.greedy_chain(int(before[r]), int(batch.tokens[r, 0]), k)
        assert walk.output_tokens[r, :k].tolist() == chain
        assert (walk.output_tokens[r, k:] == -1).all()
        rows = walk.path_rows[r, :k].tolist()
        assert [int(batch.tokens[r, i]) for i in rows[1:]] == chain[: k - 1]  # accepted nodes = chain


def walk_naive(tokens, parents, num_rows, row_tokens):
    """Step down from the root while a child carries the target's token at its parent (lists)."""
    path, cur = [0], 0
    while True:
        nxt = [i for i in range(1, num_rows) if parents[i] == cur and tokens[i] == row_tokens[cur]]
        if not nxt:
            return path
        cur = nxt[0]
        path.append(cur)


@pytest.mark.parametrize("seed", range(20))
def test_walk_follows_the_matching_path_row_by_row(seed):
    """The walk finds the accepted path for all rows at once; a depth-by-depth walk of lists agrees,
    on trees of every shape the build makes (budget 1 to 40 nodes, requests of different sizes), with target
    tokens that mostly follow the tree (deep paths) or not at all."""
    g = torch.Generator().manual_seed(seed)
    vocab = 3 + seed % 4
    tree, batch = make_batch(seed, vocab=vocab, depth=2 + seed % 6, budget=2 + 2 * seed)
    follow = torch.randint(0, vocab, batch.tokens.shape, generator=g)
    for r in range(batch.batch_size):  # row tokens = a random child's token, where the row has children
        for i in range(int(batch.num_rows[r])):
            kids = [j for j in range(int(batch.num_rows[r])) if int(batch.parents[r, j]) == i]
            if kids and seed % 3:
                follow[r, i] = batch.tokens[r, kids[int(torch.randint(0, len(kids), (1,), generator=g))]]
    walk = walk_tree(batch, follow)
    # as wide as a sampler's caller lays it out (the step's most rows): the same walk, -1 past it
    wide = walk_tree(batch, follow, width=int(batch.num_rows.max()) + 3)
    assert wide.path_rows.shape[1] == wide.output_tokens.shape[1] == int(batch.num_rows.max()) + 3
    for r in range(batch.batch_size):
        path = walk_naive(batch.tokens[r].tolist(), batch.parents[r].tolist(), int(batch.num_rows[r]), follow[r].tolist())
        k = len(path)
        for w in (walk, wide):
            assert w.path_rows[r, :k].tolist() == path and (w.path_rows[r, k:] == -1).all()
            assert w.output_tokens[r, :k].tolist() == [int(follow[r, i]) for i in path]
            assert (w.output_tokens[r, k:] == -1).all() and int(w.num_emitted[r]) == k


def test_greedy_walk_accepts_a_long_path_when_the_draft_is_right():
    vocab = 4
    target = ToyTarget(vocab, 7, sharp=5.0)
    before, root = 0, 1
    chain = target.greedy_chain(before, root, 4)
    logp = torch.full((1, 4, vocab), -5.0)
    for d, t in enumerate(chain):
        logp[0, d, t] = -0.01  # the drafter is right at every depth
    lp, ids = topk_per_depth(logp, vocab)
    batch = compile_tree(build_tree(lp, ids, 8), torch.tensor([root]), torch.tensor([3]))
    walk = walk_tree(batch, greedy_tokens(target.row_logits(batch, torch.tensor([before]))))
    assert int(walk.num_emitted[0]) == 5  # 4 accepted + bonus
    assert walk.output_tokens[0, :4].tolist() == chain


def decode_first_tokens(target, num, n_tokens, seed, lossy=False):
    """Speculative sampling with random drafts, many independent sequences at once; first tokens."""
    vocab = target.vocab
    g = torch.Generator().manual_seed(seed)
    prev = torch.full((num,), vocab)  # "none"
    root = torch.zeros(num, dtype=torch.int64)
    out = [[] for _ in range(num)]
    while min(len(o) for o in out) < n_tokens:
        lp, ids = topk_per_depth(torch.randn(num, 3, vocab, generator=g) * 2, vocab)
        batch = compile_tree(build_tree(lp, ids, 6, validate=False), root, torch.full((num,), 4))
        logits = target.row_logits(batch, prev)
        if lossy:  # BASTION's reference: match drafts by argmax even when sampling (not lossless)
            tokens = greedy_tokens(logits)
            tokens[:, 0] = sample_tokens(torch.softmax(logits[:, :1], -1), generator=g)[:, 0]
        else:
            tokens = sample_tokens(torch.softmax(logits, -1), generator=g)
        walk = walk_tree(batch, tokens)
        for r in range(num):
            k = int(walk.num_emitted[r])
            emitted = walk.output_tokens[r, :k].tolist()
            seq = [int(prev[r]), int(root[r])] + emitted
            out[r].extend(emitted)
            prev[r], root[r] = seq[-2], seq[-1]
    return [tuple(o[:n_tokens]) for o in out]


def exact_joint(target, n_tokens):
    """Exact distribution of the first n tokens after (none, 0) under plain sampling."""
    probs = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for seq, p in probs.items():
            full = (target.vocab, 0) + seq
            dist = torch.softmax(target.logits[full[-2], full[-1]], -1)
            for t in range(target.vocab):
                nxt[seq + (t,)] = p * float(dist[t])
        probs = nxt
    return probs


def chi_square_p(samples, probs):
    keys = sorted(probs)
    counts = [sum(1 for s in samples if s == k) for k in keys]
    total = sum(probs.values())  # float32 softmax: renormalise so the sums agree exactly
    expected = [probs[k] / total * len(samples) for k in keys]
    return chisquare(counts, expected).pvalue


ALPHA = 1e-3  # fixed seeds: deterministic outcome; alpha states the test's false-alarm rate


def test_sampling_walk_preserves_the_target_distribution():
    target = ToyTarget(3, seed=11, sharp=1.5)
    samples = decode_first_tokens(target, 3000, 3, seed=5)
    assert chi_square_p(samples, exact_joint(target, 3)) > ALPHA


def test_chi_square_detects_a_lossy_walk():
    # The same test must reject argmax matching at T > 0, or it has no power.
    target = ToyTarget(3, seed=11, sharp=1.5)
    samples = decode_first_tokens(target, 3000, 3, seed=5, lossy=True)
    assert chi_square_p(samples, exact_joint(target, 3)) < ALPHA


def test_compaction_makes_the_accepted_path_contiguous():
    vocab = 5
    target = ToyTarget(vocab, 3, sharp=4.0)
    tree, batch = make_batch(3, vocab=vocab, budget=40, ctx=(2, 7, 4))
    walk = walk_tree(batch, greedy_tokens(target.row_logits(batch, torch.tensor([0, 1, 2]))))
    plan = compaction_plan(batch, walk.path_rows)
    # A flat cache of 3 requests x 64 slots whose entry value = (request, row stored there).
    slots_per_req = 64
    cache = torch.full((3 * slots_per_req, 2), -1)
    for r in range(3):
        c = int(batch.context_lens[r])
        for i in range(int(batch.num_rows[r])):
            cache[r * slots_per_req + c + i] = torch.tensor([r, i])
    base = (torch.arange(3) * slots_per_req)[:, None]
    apply_compaction_(cache, base + plan.src, base + plan.dst)
    for r in range(3):
        c = int(batch.context_lens[r])
        for j, row in enumerate(walk.path_rows[r].tolist()):
            if row < 0:
                break
            assert cache[r * slots_per_req + c + j].tolist() == [r, row]
    assert (plan.src >= plan.dst).all()


def test_walk_rejects_wrong_shapes():
    _, batch = make_batch()
    with pytest.raises(ValueError, match="one token per verify row"):
        walk_tree(batch, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="cannot hold a path of depth"):
        walk_tree(batch, torch.zeros_like(batch.tokens), width=batch.max_depth)
    with pytest.raises(ValueError, match="context_lens"):
        compile_tree(build_tree(*topk_per_depth(torch.randn(2, 2, 3), 3), 2), torch.zeros(3), torch.zeros(2))
