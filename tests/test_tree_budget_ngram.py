"""Budget controller (BASTION, batch-aware) and the online/corpus n-gram model (PRESTO)."""

import math

import pytest
import torch

from vllm_ddtree.tree.ngram import _pack, _wrap
from vllm_ddtree.tree import (
    HostTokens,
    AcceptanceCalibration,
    AutoBudget,
    BudgetPlan,
    CostCalibration,
    CostModel,
    LookupCalibration,
    ModelShape,
    NGramCounts,
    NGramModel,
    SpeculationGate,
    allocate_batch,
    batch_estimate,
    build_corpus_ngram,
    build_tree,
    choose_budgets,
    entropy_adaptive_lambda,
    get_profile,
    node_gains,
    roofline_seconds,
    topk_per_depth,
)

QWEN3_8B = dict(
    num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, intermediate_size=12288, vocab_size=151936,
)


def cost_model(device="h100", t_draft=2e-3):
    return CostModel(ModelShape.from_hf_config(QWEN3_8B, "bfloat16"), get_profile(device), t_draft=t_draft)


def draft_logp(seed, r, confidence, budget=256, depth=15, vocab=64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(r, depth, vocab, generator=g) * torch.as_tensor(confidence).view(-1, 1, 1)
    lp, ids = topk_per_depth(logits, vocab)
    return build_tree(lp, ids, budget).draft_logp


def test_roofline_matches_bastion_formulas_at_batch_one():
    shape = ModelShape.from_hf_config(QWEN3_8B, "bfloat16")
    prof = get_profile("h100")
    s, c = 65, 1000
    L, h, V, hq, hkv, hf, nq = 36, 4096, 151936, 4096, 1024, 12288, 32
    flops = L * (4 * s * h * hq + 4 * s * h * hkv + 4 * s * (c + s) * hq + 6 * s * h * hf) + 2 * s * h * V
    bytes_ = 2 * (2 * V * h + s * (h + V) + L * (2 * h * (hq + hkv) + 3 * h * hf + 2 * hkv * (c + 2 * s)
                  + 4 * s * (h + hq + hf) + 2 * nq * s * (c + s)))
    expect = max(flops / prof.peak_flops, bytes_ / prof.bandwidth)
    assert roofline_seconds(shape, prof, s, s * (c + s), c) == pytest.approx(expect)
    # An 8B model at batch 1 is memory bound on an H100: ~16 GB of weights / 3.35 TB/s ~ 5 ms.
    assert 4e-3 < expect < 7e-3


def test_chosen_budget_is_the_argmax_of_its_own_estimate():
    cost = cost_model()
    logp = draft_logp(0, 4, torch.tensor([0.5, 2.0, 4.0, 8.0]))
    ctx = torch.tensor([100, 2000, 500, 30000])
    plan = choose_budgets(logp, ctx, cost, min_budget=2, max_budget=200)
    gains = node_gains(logp)
    for r in range(4):
        speed = {n: (1 + float(gains[r, :n].sum())) / float(cost.step_seconds(n, int(ctx[r]), 1)) for n in range(2, 201)}
        best_n = max(speed, key=speed.get)
        chosen = int(plan.budgets[r])
        # the argmax up to float32 rounding: where the curve is flat, neighbours differ by less than
        # the estimate's rounding (1e-8 relative at the top of row 0's curve)
        assert speed[chosen] >= speed[best_n] * (1 - 1e-6), (chosen, best_n)
        assert abs(chosen - best_n) <= 2 or speed[chosen] == speed[best_n], (chosen, best_n)


def test_confident_drafter_gets_a_bigger_tree():
    cost = cost_model()
    logp = draft_logp(1, 2, torch.tensor([0.3, 6.0]))
    plan = choose_budgets(logp, torch.tensor([500, 500]), cost, max_budget=256)
    assert plan.budgets[1] > plan.budgets[0]


@pytest.mark.parametrize("seed", range(4))
def test_batch_allocation_never_worse_than_per_request(seed):
    cost = cost_model("h100")
    g = torch.Generator().manual_seed(seed)
    r = 8
    logp = draft_logp(seed, r, torch.rand(r, generator=g) * 6)
    ctx = torch.randint(50, 4000, (r,), generator=g)
    per_req = choose_budgets(logp, ctx, cost, max_budget=256)
    joint = allocate_batch(logp, ctx, cost, max_budget=256)
    assert float(joint.tokens_per_second) >= float(per_req.tokens_per_second) * (1 - 1e-6)
    # allocate_batch's plan is evaluated with the same objective
    again = batch_estimate(logp, joint.budgets, ctx, cost)
    assert float(again.tokens_per_second) == pytest.approx(float(joint.tokens_per_second), rel=1e-5)


def test_batch_allocation_strictly_better_on_a_skewed_batch():
    # One request's drafter is confident, seven are guessing. Alone, each guesser still buys a
    # large tree (at batch 1 the verify is memory bound, extra rows are nearly free); together the
    # step turns compute bound and those rows cost real time, better spent on the confident request.
    cost = cost_model("h100")
    conf = torch.tensor([8.0] + [0.2] * 31)
    logp = draft_logp(5, 32, conf)
    ctx = torch.full((32,), 1000)
    per_req = choose_budgets(logp, ctx, cost, max_budget=256)
    joint = allocate_batch(logp, ctx, cost, max_budget=256)
    assert float(joint.tokens_per_second) > 1.05 * float(per_req.tokens_per_second)
    assert joint.budgets.sum() < per_req.budgets.sum()


def test_calibration_and_ema():
    cost = cost_model("cpu")
    s = torch.tensor([2.0, 9.0, 17.0, 33.0, 65.0])
    ctx = torch.full_like(s, 300.0)
    raw = roofline_seconds(cost.shape, cost.profile, s, s * (ctx + s), ctx)
    measured = 3.0 * raw + 0.01
    cost.fit(s, s * (ctx + s), ctx, measured)
    assert cost.slope == pytest.approx(3.0, rel=1e-4) and cost.intercept == pytest.approx(0.01, rel=1e-3)
    before = cost.correction
    for _ in range(50):
        cost.observe(predicted=1.0, measured=2.0)
    assert before == 1.0 and cost.correction > 1.9


def test_budget_bad_input():
    cost = cost_model()
    logp = draft_logp(0, 2, torch.tensor([1.0, 1.0]), budget=16)
    with pytest.raises(ValueError, match="min_budget must be >= 1"):
        allocate_batch(logp, torch.tensor([1, 1]), cost, min_budget=0)
    with pytest.raises(ValueError, match="max_budget"):
        choose_budgets(logp, torch.tensor([1, 1]), cost, min_budget=4, max_budget=2)
    with pytest.raises(ValueError, match="node slots"):
        choose_budgets(logp, torch.tensor([1, 1]), cost, max_budget=64)
    with pytest.raises(ValueError, match="unknown device profile"):
        get_profile("tpu")
    with pytest.raises(ValueError, match="slope"):
        CostModel(cost.shape, cost.profile, slope=0.0)


def test_ngram_backoff_floor_and_release(orders_search):
    model = NGramModel(10, order=3, floor=1e-3)
    model.observe(0, [1, 2, 3, 1, 2, 3])
    model.observe(1, [5, 5])
    hist = torch.tensor([[[1, 2]], [[1, 2]]])
    toks = torch.tensor([[[3, 4]], [[3, 5]]])
    rho = model.log_rho(torch.tensor([0, 1]), hist, toks).exp()
    assert rho[0, 0, 0] == pytest.approx(1.0)  # "1 2" was always followed by 3
    assert rho[0, 0, 1] == pytest.approx(1e-3)  # never seen: the floor
    assert rho[1, 0, 0] == pytest.approx(1e-3)  # slot 1 never saw 3: slots don't leak
    assert rho[1, 0, 1] == pytest.approx(0.4 * 0.4 * 1.0)  # backs off twice to the unigram of 5
    assert model.context_tail([0, 1, 2]).tolist() == [[2, 3], [5, 5], [-1, -1]]
    model.release(0)
    rho = model.log_rho(torch.tensor([0]), hist[:1], toks[:1]).exp()
    assert torch.allclose(rho, torch.full_like(rho, 1e-3))


@pytest.fixture(params=["per order", "stacked"])
def orders_search(request, monkeypatch):
    """Both ways the n-gram orders are looked up: per order (CPU) and in one stacked search (GPU)."""
    import vllm_ddtree.tree.ngram as ngram_mod

    monkeypatch.setattr(ngram_mod, "_search_orders_at_once", lambda device: request.param == "stacked")
    return request.param


def test_ngram_scores_follow_the_tables_after_each_change(orders_search):
    # The orders' tables are stacked for one search and kept until the tables change.
    model = NGramModel(10, order=3, floor=1e-3)
    hist, toks = torch.tensor([[[1, 2]]]), torch.tensor([[[3, 4]]])
    model.observe(0, [1, 2, 3])
    before = model.log_rho(torch.tensor([0]), hist, toks).exp()
    assert before[0, 0].tolist() == pytest.approx([1.0, 1e-3])
    model.observe(0, [1, 2, 4])  # "1 2" now followed by 3 once and 4 once
    after = model.log_rho(torch.tensor([0]), hist, toks).exp()
    assert after[0, 0].tolist() == pytest.approx([0.5, 0.5])
    model.release(0)
    assert model.log_rho(torch.tensor([0]), hist, toks).exp()[0, 0].tolist() == pytest.approx([1e-3, 1e-3])


def test_ngram_scores_equal_a_plain_python_backoff_over_a_frontier_block(orders_search):
    """log rho over an [R, F, K] block (several frontier histories, some reaching before the sequence
    start, K tokens each) equals stupid backoff computed from plain counts of each slot's sequence."""
    from collections import Counter

    g = torch.Generator().manual_seed(3)
    vocab, order, floor, backoff = 6, 3, 1e-3, 0.4
    model = NGramModel(vocab, order=order, floor=floor, backoff=backoff)
    seqs = {2: torch.randint(0, vocab, (40,), generator=g).tolist(), 5: torch.randint(0, 3, (25,), generator=g).tolist()}
    for slot, seq in seqs.items():
        model.observe(slot, seq[:17])
        model.observe(slot, seq[17:])  # counts carry across calls

    def rho(seq, hist, tok):
        padded = [-1] * (order - 1) + seq
        grams = Counter(tuple(padded[i : i + order]) for i in range(len(seq)))
        factor = 1.0
        for m in range(order - 1, -1, -1):
            ctx = tuple(hist[len(hist) - m :]) if m else ()
            if -1 in ctx:
                factor *= backoff
                continue
            ng = sum(c for w, c in grams.items() if w[order - 1 - m :] == ctx + (tok,) and -1 not in w[order - 1 - m :])
            cx = sum(c for w, c in grams.items() if w[order - 1 - m : order - 1] == ctx and -1 not in w[order - 1 - m :])
            if ng:
                return max(factor * ng / cx, floor)
            factor *= backoff
        return floor

    slots = [5, 2]
    hist = torch.randint(0, 3, (2, 4, order - 1), generator=g)
    hist[0, 1, 0] = -1  # one context token before the sequence start
    hist[1, 2] = -1  # no context at all
    toks = torch.randint(0, vocab, (2, 4, 5), generator=g)
    got = model.log_rho(torch.tensor(slots), hist, toks).exp()
    for r, slot in enumerate(slots):
        for f in range(4):
            for k in range(5):
                want = rho(seqs[slot], hist[r, f].tolist(), int(toks[r, f, k]))
                assert got[r, f, k].item() == pytest.approx(want, rel=1e-5), (r, f, k)


def test_corpus_table_roundtrip_and_mixing(tmp_path, orders_search):
    class CharTokenizer:
        def __len__(self):
            return 128

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    table = build_corpus_ngram(["abcabc", "abd"], CharTokenizer(), order=3)
    path = tmp_path / "corpus.safetensors"
    table.save(path)
    loaded = NGramCounts.load(path)
    model = NGramModel(128, order=3, corpus=path, corpus_weight=1.0)
    hist = torch.tensor([[[ord("a"), ord("b")]]])
    toks = torch.tensor([[[ord("c"), ord("d")]]])
    rho = model.log_rho(torch.tensor([4]), hist, toks).exp()
    assert rho[0, 0].tolist() == pytest.approx([2 / 3, 1 / 3])
    assert loaded.ngram_keys[2].numel() == 4  # abc, bca, cab, abd: saved without padding
    assert all(torch.equal(loaded.ngram_keys[m], table.real_entries("ngram", m)[0]) for m in range(3))
    with pytest.raises(ValueError, match="rebuild it with the target's tokenizer"):
        NGramModel(100, order=3, corpus=path)
    with pytest.raises(ValueError, match="does not exist"):
        NGramModel(128, corpus=tmp_path / "missing.safetensors")


def test_entropy_adaptive_lambda():
    sharp = torch.log_softmax(torch.tensor([[[20.0, 0.0, 0.0, 0.0]]]), -1)
    flat = torch.log_softmax(torch.zeros(1, 1, 4), -1)
    lam_sharp = entropy_adaptive_lambda(sharp, beta=0.4, c=1.0)
    lam_flat = entropy_adaptive_lambda(flat, beta=0.4, c=1.0)
    assert float(lam_sharp) < 0.01
    assert float(lam_flat) == pytest.approx(0.4 * math.log(4) / (math.log(4) + 1))


def test_fit_with_a_per_token_term_recovers_a_linear_cpu_step():
    # A 2-core AVX-512 CPU's step time grows with every row even where the roofline is flat (below its knee):
    # intercept + per-token fits it, the roofline alone cannot.
    cost = cost_model("cpu")
    s = torch.tensor([2.0, 5.0, 9.0, 17.0, 33.0, 65.0])
    ctx = torch.full_like(s, 300.0)
    measured = 0.055 + 0.0018 * s
    cost.fit(s, s * (ctx + s), ctx, measured, per_token=True)
    pred = cost.verify_seconds(s, s * (ctx + s), ctx)
    assert torch.allclose(pred.double(), measured.double(), rtol=0.02)
    roof_only = cost_model("cpu")
    roof_only.fit(s, s * (ctx + s), ctx, measured)
    assert (roof_only.verify_seconds(s, s * (ctx + s), ctx).double() - measured).abs().max() > 0.01


def test_fit_finds_where_a_flat_cpu_step_starts_to_grow():
    """A 2-core AVX-512 CPU's step costs the same from 2 to 9 rows and then ~1.5 ms more per row (the quick study's
    explored and fixed-budget steps). A per-token term from row 0 cannot draw that: through the 2-,
    9- and 65-row steps the old fit charged ~0.9 ms per row between 9 and 33 rows. The fitted knee
    puts the per-row price back (what that did to the timed budget: README, acceptance study)."""
    cost = cost_model("cpu")
    ctx = 300.0

    def true_seconds(rows):
        return 0.077 + 0.0015 * (rows - 9).clamp(min=0)

    s = torch.tensor([65.0, 2.0, 9.0])  # what exploration measures (64, 1 and 8 nodes + the root)
    c = torch.full_like(s, ctx)
    cost.fit(s, s * (c + s), c, true_seconds(s), per_token=True)
    assert cost.knee == 9.0
    every = torch.arange(2.0, 66.0)
    pred = cost.verify_seconds(every, every * (ctx + every), torch.full_like(every, ctx)).double()
    assert torch.allclose(pred, true_seconds(every).double(), rtol=0.01)
    # What the budget prices: the cost of 24 more nodes past 8 (0.9 ms a node before, in the docstring)
    marginal = float(pred[33 - 2] - pred[9 - 2]) / 24
    assert marginal == pytest.approx(1.5e-3, rel=0.02)
    # A step that grows from the first row keeps knee 0: the search only moves it where that fits better.
    linear = cost_model("cpu")
    linear.fit(every, every * (ctx + every), torch.full_like(every, ctx), 0.055 + 0.0018 * every, per_token=True)
    assert linear.knee == 0.0 and linear.per_token == pytest.approx(0.0018, rel=1e-3)


def staircase_seconds(rows):
    """The toy target's verify on a 2-core AVX-512 CPU (`benchmarks/results/verify_rows.json`, 200 tokens of
    context): 35-39 ms for 1-3 rows, a jump to 52 ms at 4 (the matmul kernels change with the row
    count), then ~1.4 ms a row; 16 rows cost less than 12."""
    rows = torch.as_tensor(rows, dtype=torch.float64)
    return torch.where(rows <= 3, 0.036 + 0.0022 * (rows - 1), 0.053 + 0.0014 * (rows - 4)) - \
        0.008 * ((rows >= 13) & (rows <= 16))


def test_the_residual_table_learns_the_steps_a_smooth_fit_cannot_draw():
    """Fitted through a staircase, the line-with-knee misses the sizes next to the jump by several ms
    (the quick study's controller: 59 ms predicted for a 2-row step that took 52, 70 for a 9-row one
    that took 81). The residual table puts each measured size back; sizes never measured keep the fit."""
    smollm2 = ModelShape(30, 576, 9, 3, 64, 1536, 49152, 4)  # SmolLM2-135M, float32
    auto = AutoBudget(CostModel(smollm2, get_profile("cpu")), 1, 64)
    ctx = 200.0
    sizes = [1 + b for b in (64, 64, 64, 64, 1, 1, 1, 8, 8, 8)] + [2, 3, 4, 5, 6, 9, 13, 17] * 6
    for rows in sizes:  # exploration, then steps of the sizes a controller settles around
        auto.observe_step(rows, rows * (ctx + rows), ctx, float(staircase_seconds(rows)))
    cost = auto.cost
    seen = torch.tensor(sorted(set(sizes)), dtype=torch.float64)
    pred = cost.verify_seconds(seen, seen * (ctx + seen), torch.full_like(seen, ctx))
    true = staircase_seconds(seen)
    smooth = pred - cost.residual[seen.long()]
    assert (smooth - true).abs().max() > 3e-3  # the fit alone misses by more than 3 ms somewhere
    # Each measured size is at least half way back (one point: half; six: 6/7), those the recent
    # window holds six of to within 1 ms.
    assert ((pred - true).abs() <= (smooth - true).abs() / 2 + 1e-6).all()
    assert (pred - true)[seen != 65].abs().max() < 1e-3
    never = torch.tensor([40.0])  # a size no step had: the smooth fit only
    assert float(cost.verify_seconds(never, never * (ctx + never), torch.tensor([ctx]))) == pytest.approx(
        float(cost.intercept + cost.slope * roofline_seconds(cost.shape, cost.profile, never, never * (ctx + never),
                                                             torch.tensor([ctx])) + cost.per_token * (40 - cost.knee)),
        rel=1e-5)
    assert auto.summary()["cost_residual_ms"]  # the table is in the benchmark's JSON
    # One step at a new size, 20 ms slower than the fit, moves that size by about half of it (the
    # table's n / (n + 1), and the line bends a little towards it), not all the way: one step may stall.
    fitted = float(cost.verify_seconds(never, never * (ctx + never), torch.tensor([ctx])))
    auto.calibration.recent.append((40.0, 40.0 * (ctx + 40), ctx, fitted + 0.020))
    auto.calibration.refit()
    moved = float(cost.verify_seconds(never, never * (ctx + never), torch.tensor([ctx]))) - fitted
    assert 0.008 < moved < 0.013


def test_fit_is_non_negative_least_squares_not_a_clamped_fit():
    # Batch 1 on a 2-core AVX-512 CPU: the roofline is flat in rows (below its knee) and moves only with the
    # context, so intercept and slope are nearly collinear. Here the unconstrained fit is
    # -0.28 s + 11.5 x roofline; clamping its intercept to 0 predicted up to 4x the measured time
    # (what made the reference decoder's auto budget overbuild). The constrained fit stays close.
    shape = ModelShape(30, 576, 9, 3, 64, 1536, 49152, 4)  # SmolLM2-135M, float32
    cost = CostModel(shape, get_profile("cpu"))
    s = torch.tensor([2.0, 8.0, 17.0, 33.0] * 6)
    ctx = torch.linspace(200, 1000, s.numel())
    measured = 0.08 + 0.002 * s + 5e-5 * ctx
    cost.fit(s, s * (ctx + s), ctx, measured, per_token=True)
    assert min(cost.intercept, cost.slope, cost.per_token) >= 0
    pred = cost.verify_seconds(s, s * (ctx + s), ctx).double()
    # What the fit must achieve: the least squared error of any non-negative combination of its terms,
    # over its own knee candidates (0 and the step sizes strictly inside the measured range), which
    # scipy's NNLS solver finds independently. A fit that clamps, or misses a subset, is worse.
    from scipy.optimize import nnls

    x = roofline_seconds(shape, cost.profile, s.double(), (s * (ctx + s)).double(), ctx.double())
    y, t = measured.double(), s.double()
    knees = [0.0] + sorted({float(v) for v in t if t.min() < v < t.max()})
    best = min(nnls(torch.stack([torch.ones_like(x), x, (t - k).clamp(min=0)], 1).numpy(), y.numpy())[1] ** 2
               for k in knees)
    assert float((pred - y).pow(2).sum()) == pytest.approx(best, rel=1e-4)
    # The scenario: the unconstrained fit's intercept is negative, and clamping it to 0 is not the
    # optimum (here ~1000x its squared error, predictions up to 4x the time).
    full = torch.linalg.lstsq(torch.stack([torch.ones_like(x), x, t], 1), y[:, None]).solution[:, 0]
    assert full[0] < 0
    assert float((x * full[1] + t * full[2] - y).pow(2).sum()) > best


def test_acceptance_calibration_learns_how_overconfident_the_drafter_is():
    torch.manual_seed(0)
    cal = AcceptanceCalibration(alpha=0.05)
    assert float(cal.beta) == 1.0  # no data: trust the drafter
    r = 64
    claimed = torch.arange(1, 5).float().expand(r, 4) * math.log(0.9)  # a chain the drafter rates 0.9 per token
    for _ in range(300):
        accepted = torch.distributions.Geometric(probs=torch.tensor(0.5)).sample((r,)).clamp(max=4)  # P(L >= d) = 0.5^d
        cal.update(claimed, torch.ones(r, 4, dtype=torch.bool), torch.arange(4)[None] < accepted[:, None])
    # 0.9^(d * beta) = 0.5^d  =>  beta = ln 0.5 / ln 0.9 = 6.58 (grid steps are 12% apart)
    assert float(cal.beta) == pytest.approx(math.log(0.5) / math.log(0.9), rel=0.12)
    scaled = cal.rescale(torch.tensor([[math.log(0.9), -math.inf]]))
    assert scaled[0, 0].exp() == pytest.approx(0.5, abs=0.05) and scaled[0, 1] == -math.inf
    # An underconfident drafter: the exponent goes below 1.
    under = AcceptanceCalibration(alpha=0.2)
    for _ in range(50):
        under.update(torch.full((r, 1), math.log(0.25)), torch.ones(r, 1, dtype=torch.bool), torch.rand(r, 1) < 0.5)
    assert float(under.beta) == pytest.approx(0.5, rel=0.12)
    # The exponent is kept between updates, and each update makes it anew (alpha 1: the last step alone).
    step = AcceptanceCalibration(alpha=1.0)
    node, verified = torch.full((1, 1), math.log(0.5)), torch.ones(1, 1, dtype=torch.bool)
    step.update(node, verified, torch.ones(1, 1, dtype=torch.bool))  # accepted: the drafter was underconfident
    low = float(step.beta)
    assert step.beta is step.beta  # kept
    step.update(node, verified, torch.zeros(1, 1, dtype=torch.bool))  # rejected: overconfident
    assert low == pytest.approx(0.25) and float(step.beta) == pytest.approx(8.0)


def test_acceptance_calibration_fits_the_shape_one_exponent_cannot():
    """n-gram rescoring bends the score-to-acceptance curve: confident nodes are accepted more often
    than p ** beta says and the low-score tail less often. Each score bin's reliability factor
    corrects it; before any data a bin keeps the exponent's prediction (the prior)."""
    torch.manual_seed(0)
    cal = AcceptanceCalibration()
    r = 32
    scores = torch.tensor([math.log(0.3), math.log(0.02)]).expand(r, 2)  # one confident node, one tail node
    true = torch.tensor([0.9, 0.002])  # no exponent maps (0.3, 0.02) to (0.9, 0.002)
    for _ in range(400):
        cal.update(scores, torch.ones(r, 2, dtype=torch.bool), torch.rand(r, 2) < true)
    calibrated = cal.rescale(scores[:1]).exp()[0]
    assert calibrated.tolist() == pytest.approx(true.tolist(), rel=0.15)
    beta = float(cal.beta)
    assert not (abs(0.3 ** beta - 0.9) < 0.15 * 0.9 and abs(0.02 ** beta - 0.002) < 0.15 * 0.002)
    # A score no verified node has had yet (another bin): the exponent's extrapolation.
    unseen = torch.tensor([[math.log(0.1), -math.inf]])
    assert cal.rescale(unseen)[0, 0].exp() == pytest.approx(0.1 ** beta, rel=1e-5)
    assert cal.rescale(unseen)[0, 1] == -math.inf
    # Nodes of infinite score (a lookup path's) are neither predicted nor counted.
    before = cal.bin_accepted.clone()
    cal.update(torch.full((1, 2), -math.inf), torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool))
    assert torch.allclose(cal.bin_accepted, before * cal.bin_decay)


def test_cost_calibration_explores_the_range_then_drives_the_budget_to_the_measured_optimum():
    cost = cost_model("cpu")
    cal = CostCalibration.for_range(cost, 1, 64)
    assert cal.budgets == (64, 1, 8)
    ctx = 300.0

    def true_seconds(tokens):  # a CPU-like step: 55 ms + 1.8 ms per row
        return 0.055 + 0.0018 * tokens

    tried = []
    while (b := cal.explore_budget()) is not None:
        tried.append(b)
        s = 1 + b
        cal.add(s, s * (ctx + s), ctx, true_seconds(s))
    assert cal.calibrated and set(tried) == set(cal.budgets)
    cal.add(9, 9 * (ctx + 9), ctx, 10.0)  # an idle gap, not a step: dropped
    assert len(cal.recent) == 0
    # Geometric acceptance 0.8 per depth along a chain: the best budget by the true cost.
    logp = (torch.arange(1, 65).float() * math.log(0.8)).view(1, 64)
    n = torch.arange(1, 65).float()
    true_speed = (1 + torch.cumsum(logp.exp()[0], 0)) / true_seconds(1 + n)
    plan = allocate_batch(logp, torch.tensor([ctx]), cost, 1, 64)
    chosen = int(plan.budgets[0])
    assert float(true_speed[chosen - 1]) >= 0.98 * float(true_speed.max())


def test_auto_budget_explores_then_chooses_and_caps_the_width():
    auto = AutoBudget(cost_model("cpu"), 1, 64)
    ctx = 300.0

    def true_seconds(tokens):
        return 0.055 + 0.0018 * tokens

    # A drafter that claims 0.9 per depth along a chain but is accepted at 0.8: beta must absorb it.
    claimed = (torch.arange(1, 65).float() * math.log(0.9)).view(1, 64)
    g = torch.Generator().manual_seed(0)
    widths, kept = [], []
    for _ in range(200):
        width = auto.build_width()
        widths.append(width)
        exploring = auto.exploring
        n = int(auto.choose(claimed[:, :width], torch.tensor([ctx]))[0])
        if exploring:
            kept.append(n)
        auto.grow(n)
        accepted = int((torch.rand(n, generator=g) < 0.8).long().cumprod(0).sum())
        verified = torch.arange(width)[None] < n
        auto.observe_acceptance(claimed[:, :width], verified, torch.arange(width)[None] < accepted)
        auto.observe_step(1 + n, (1 + n) * (ctx + 1 + n), ctx, true_seconds(1 + n))
    # Exploration: skip one, then 3 steps per size, each kept from a tree at least min_width wide.
    assert kept == [64] * 4 + [1] * 3 + [8] * 3 and widths[:10] == [64] * 4 + [8] * 6
    assert not auto.exploring
    # Calibrated: the chosen budget is near the optimum of the *true* acceptance (0.8) and cost.
    n = torch.arange(1, 65).float()
    true_speed = (1 + torch.cumsum(0.8 ** n, 0)) / true_seconds(1 + n)
    chosen = int(auto.choose(claimed[:, : auto.build_width()], torch.tensor([ctx]))[0])
    assert float(true_speed[chosen - 1]) >= 0.97 * float(true_speed.max())
    auto.grow(chosen)
    assert auto.build_width() == min(64, max(8, 2 * chosen))
    assert auto.summary()["cost_calibrated"]


def test_a_stalled_exploration_step_does_not_set_the_cost_of_large_trees():
    """The largest exploration size's steps alone set how cost grows with the tree (the controller
    rarely chooses large trees afterwards). One of them stalling by 150 ms must not move the fit:
    each size enters it as its median step, and the summary shows what the fit was given."""
    cost = cost_model("cpu")
    cal = CostCalibration.for_range(cost, 1, 64)
    ctx = 300.0

    def true_seconds(tokens):  # a CPU-like step: 55 ms + 1.8 ms per row
        return 0.055 + 0.0018 * tokens

    stalled = False
    while (b := cal.explore_budget()) is not None:
        s = 1 + b
        extra = 0.0
        if b == 64 and cal.explored and not stalled:  # the second measured 64-node step
            extra, stalled = 0.150, True
        cal.add(s, s * (ctx + s), ctx, true_seconds(s) + extra)
    assert stalled and cal.calibrated
    for s in (2.0, 9.0, 65.0):
        assert float(cost.verify_seconds(torch.tensor(s), torch.tensor(s * (ctx + s)), torch.tensor(ctx))) == \
            pytest.approx(true_seconds(s), rel=0.03)
    auto = AutoBudget(cost, 1, 64, calibration=cal)
    assert auto.summary()["explored_step_ms"] == {65: pytest.approx(1e3 * true_seconds(65), abs=0.1),
                                                  2: pytest.approx(1e3 * true_seconds(2), abs=0.1),
                                                  9: pytest.approx(1e3 * true_seconds(9), abs=0.1)}


def test_exploration_at_a_large_batch_stays_near_the_sizes_it_will_choose():
    """At batch 64 a 64-node tree per request would be a 4160-row exploration step: the sizes shrink
    so an exploration step verifies at most ~4 x the largest size in total, with a spread left to fit."""
    cal = CostCalibration.for_range(cost_model("cpu"), 1, 64)
    assert cal.sizes_for(1) == cal.sizes_for(4) == (64, 1, 8)  # small batches: as at batch 1
    assert cal.sizes_for(8) == (32, 1, 6)
    assert cal.sizes_for(64) == (4, 1, 2)
    assert cal.sizes_for(1000) == (3, 1, 2)  # never collapses to one size
    auto = AutoBudget(cost_model("cpu"), 1, 64)
    r, ctx = 64, 300.0
    claimed = (torch.arange(1, 65).float() * math.log(0.5)).repeat(r, 1)
    totals = []
    while auto.exploring:
        width = auto.build_width(r)
        n = auto.choose(claimed[:, :width], torch.full((r,), ctx))
        assert n.shape == (r,) and bool((n == n[0]).all())
        rows = int(n.sum()) + r
        totals.append(int(n.sum()))
        auto.observe_step(rows, rows * (ctx + rows / r), ctx * r, 0.4 + 0.0025 * rows)
    assert totals == [256] * 4 + [64] * 3 + [128] * 3
    assert auto.cost.per_token > 0 or auto.cost.slope > 1e-9  # the fit saw a spread of step sizes


def test_rate_objective_agrees_with_the_step_ratio_at_that_steps_best_ratio():
    # Dinkelbach: max A - lam * C with lam = max A / C picks the same plan as max A / C.
    cost = cost_model("h100")
    g = torch.Generator().manual_seed(3)
    for seed in range(4):
        r = 4
        logp = draft_logp(seed, r, torch.rand(r, generator=g) * 6)
        ctx = torch.randint(50, 4000, (r,), generator=g)
        ratio = allocate_batch(logp, ctx, cost, max_budget=128)
        at_best = allocate_batch(logp, ctx, cost, max_budget=128, rate=ratio.tokens_per_second)
        assert float(at_best.tokens_per_second) == pytest.approx(float(ratio.tokens_per_second), rel=1e-5)
        # A lower bar buys more nodes, a higher one fewer.
        low = allocate_batch(logp, ctx, cost, max_budget=128, rate=0.5 * ratio.tokens_per_second)
        high = allocate_batch(logp, ctx, cost, max_budget=128, rate=2.0 * ratio.tokens_per_second)
        assert int(low.budgets.sum()) >= int(ratio.budgets.sum()) >= int(high.budgets.sum())


def test_auto_budget_rate_beats_per_step_ratio_over_a_mix_of_steps():
    # Steps alternate between a confident drafter (accepted at 0.9 per depth) and an unsure one
    # (0.3), with a CPU-like cost known exactly. Throughput over all steps is sum(A) / sum(C): the
    # controller's running rate must reach more of it than maximising each step's own A / C.
    cost = cost_model("cpu")
    ctx = torch.tensor([300.0])
    s = torch.arange(1.0, 66.0)
    secs = 0.055 + 0.0018 * s
    cost.fit(s, s * (ctx + s), ctx.expand_as(s), secs, per_token=True)
    n = torch.arange(1, 65).float()
    steps = [(n * math.log(p)).view(1, 64) for p in (0.9, 0.3)] * 50

    def throughput(budgets_of):
        tokens = seconds = 0.0
        for logp in steps:
            b = budgets_of(logp)
            tokens += 1 + float(logp.exp()[0, :b].sum())
            seconds += 0.055 + 0.0018 * (1 + b)
        return tokens / seconds

    per_step = throughput(lambda lp: int(allocate_batch(lp, ctx, cost, 1, 64).budgets[0]))
    auto = AutoBudget(cost, 1, 64)
    auto.calibration.explored = [(0, 0, 0, 0)] * (len(auto.calibration.budgets) * auto.calibration.repeats)  # already calibrated: drive `choose` directly
    with_rate = throughput(lambda lp: int(auto.choose(lp, ctx)[0]))
    # Exact arithmetic (no noise), so no margin: strictly more than the per-step ratio, and at most the
    # best any policy reaches here (the best budget for each kind of step, searched exhaustively),
    # nearer that optimum than the per-step ratio is (the rate starts from one step's ratio and
    # moves with an EMA, so the first steps stay below it).
    def accepted(p, b):
        return 1 + sum(p ** k for k in range(1, b + 1))

    def secs_of(b):
        return 0.055 + 0.0018 * (1 + b)

    optimum = max((accepted(0.9, b1) + accepted(0.3, b2)) / (secs_of(b1) + secs_of(b2))
                  for b1 in range(1, 65) for b2 in range(1, 65))
    assert auto.rate_at(1) is not None and per_step < with_rate <= optimum * (1 + 1e-9)
    assert optimum - with_rate < with_rate - per_step, (per_step, with_rate, optimum)
    best_fixed = max(throughput(lambda lp, b=b: b) for b in range(1, 65))
    assert with_rate > best_fixed


def test_ngram_batched_observe_and_release_equal_one_request_at_a_time():
    """observe_batch / release_batch (what the vLLM proposer calls once per step) leave exactly the
    tables and tails that per-request observe / release calls leave: uneven lengths, empty lists,
    tails carried across steps, a request longer than another's whole history."""
    g = torch.Generator().manual_seed(5)
    vocab, order = 9, 3
    one, many = NGramModel(vocab, order=order), NGramModel(vocab, order=order)
    steps = [
        {0: 5, 3: 1, 7: 0},  # slot -> new tokens this step
        {0: 1, 3: 12, 7: 2, 4: 3},
        {0: 0, 3: 2, 7: 1, 4: 1},
    ]
    for step in steps:
        new = {s: torch.randint(0, vocab, (k,), generator=g).tolist() for s, k in step.items()}
        for s, toks in new.items():
            one.observe(s, toks)
        many.observe_batch(list(new), [torch.tensor(t, dtype=torch.int64) for t in new.values()])
    one.release(3)
    one.release(7)
    many.release_batch([3, 7])
    for kind in ("ngram", "context"):
        for m in range(order):
            assert all(torch.equal(x, y) for x, y in zip(one.online.real_entries(kind, m), many.online.real_entries(kind, m)))
    assert torch.equal(one.context_tail(range(8)), many.context_tail(range(8)))
    assert [i for i, t in enumerate(many.context_tail(range(8)).tolist()) if t != [-1] * (order - 1)] == [0, 4]
    assert many.online.real_entries("ngram", order - 1)[0].numel() > 0
    with pytest.raises(ValueError, match="twice"):
        many.observe_batch([0, 0], [[1], [2]])


def _key(namespace: int, tokens: list[int], radix: int) -> int:
    """A table key in plain Python: the namespace, then each token + 1 as a mixed-radix digit, in
    int64's wrapping arithmetic."""
    key = namespace
    for t in tokens:
        key = _wrap(key * radix + t + 1)
    return key


def test_keys_pack_as_plain_python_packs_them():
    g = torch.Generator().manual_seed(2)
    for radix, m in [(10, 0), (10, 3), (151937, 2), (151937, 4)]:  # the last wraps past 63 bits
        ns, toks = torch.randint(0, 300, (5,), generator=g), torch.randint(-1, radix - 1, (5, m), generator=g)
        assert _pack(ns, toks, radix).tolist() == [_key(int(a), b, radix) for a, b in zip(ns, toks.tolist())]


def test_lookup_calibration_scores_each_proposal_against_what_the_step_committed():
    cal = LookupCalibration(4, alpha=1.0)  # alpha 1: the state is this step's counts
    proposed = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9], [5, 6, 7, 0]])
    valid = torch.tensor([[True] * 4, [True] * 4, [False] * 4, [True, True, True, False]])
    committed = torch.tensor([
        [5, 6, 9, -1],  # matched 2, then a different token: accepted at 1-2, rejected at 3 (4: moot)
        [1, 2, -1, -1],  # matched all 2 committed: accepted at 1-2, 3 unknown (censored)
        [9, 9, 9, 9],  # proposed nothing
        [4, -1, -1, -1],  # rejected at 1
    ])
    cal.update(proposed, valid, committed)
    assert cal.hits.tolist() == [2, 2, 0, 0]
    assert cal.at_risk.tolist() == [3, 2, 1, 0]  # depth d counts only paths accepted to d - 1
    gains = cal.gains(torch.tensor([[True, True, True, False]]))
    assert gains[0].tolist() == pytest.approx([2 / 3, 2 / 3, 0.0, 0.0])
    with pytest.raises(ValueError, match="length"):
        LookupCalibration(0)


def test_lookup_calibration_is_not_biased_by_what_the_step_happened_to_commit():
    """Paths the target follows 80% per token, never verified: the step commits only 1-4 tokens, so
    deep hits are often unseen while misses show at once. The per-depth estimate still finds 0.8 ** d."""
    cal = LookupCalibration(6, alpha=0.01)
    g = torch.Generator().manual_seed(0)
    for _ in range(3000):
        follow = torch.rand(8, 6, generator=g) < 0.8
        target = torch.where(follow, 7, 3)  # the target's next tokens (the proposal is all 7)
        committed_len = torch.randint(1, 5, (8, 1), generator=g)  # what the tree happened to accept, + bonus
        committed = torch.where(torch.arange(6)[None, :] < committed_len, target, -1)
        cal.update(torch.full((8, 6), 7), torch.ones(8, 6, dtype=torch.bool), committed)
    expect = 0.8 ** torch.arange(1, 7).float()
    assert cal.acceptance[:4].tolist() == pytest.approx(expect[:4].tolist(), abs=0.04)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_allocation_with_a_lookup_path_is_the_best_split_between_tree_and_path(seed):
    """The merged best-first over tree and lookup nodes maximises tokens - rate * seconds over every
    (tree budget, path length) pair (exhaustive at batch 1); the path's nodes count in the cost."""
    cost = cost_model("cpu", t_draft=0.0)
    cost.per_token = 2e-3  # a CPU-like step: every row costs
    logp = draft_logp(seed, 1, 2.0, budget=24)
    g = torch.Generator().manual_seed(seed)
    look = torch.sort(torch.rand(1, 8, generator=g), descending=True).values
    ctx = torch.tensor([200.0])
    rate = 30.0
    plan = allocate_batch(logp, ctx, cost, 1, 24, rate=rate, extra_gains=look)
    gains = node_gains(logp)[0]
    best = max(
        (1 + float(gains[:b].sum()) + float(look[0, :e].sum()) - rate * float(cost.step_seconds(b + e, ctx.sum(), 1)), b, e)
        for b in range(1, 25) for e in range(9)
    )
    got = float(plan.expected_tokens) - rate * float(plan.step_seconds)
    assert got == pytest.approx(best[0], abs=1e-5)
    assert plan.step_seconds == pytest.approx(float(cost.step_seconds(plan.budgets + plan.extra, ctx.sum(), 1)))
    # No path (all gains 0): the same tree as without one, and nothing taken from the path.
    plain = allocate_batch(logp, ctx, cost, 1, 24, rate=rate)
    none = allocate_batch(logp, ctx, cost, 1, 24, rate=rate, extra_gains=torch.zeros(1, 8))
    assert none.budgets.tolist() == plain.budgets.tolist() and none.extra.tolist() == [0]


def test_auto_budget_buys_the_lookup_path_where_it_is_accepted_and_drops_it_where_it_is_not():
    """Steps whose lookup paths the target follows (90% per token) keep them once calibrated; paths
    it rejects are dropped, while their outcome is still measured from the committed tokens."""
    def run(follow: float) -> list[int]:
        auto = AutoBudget(cost_model("cpu"), 1, 32, lookup=LookupCalibration(6))
        g = torch.Generator().manual_seed(0)
        claimed = (torch.arange(1, 33).float() * math.log(0.5)).view(1, 32)  # an honest weak drafter
        taken = []
        for _ in range(150):
            width = auto.build_width()
            valid = torch.ones(1, 6, dtype=torch.bool)
            plan = auto.choose_plan(claimed[:, :width], torch.tensor([300.0]), valid)
            n, e = int(plan.budgets[0]), int(plan.extra[0])
            taken.append(e)
            auto.grow(n)
            # The target's next tokens: the path's (token 7) while it follows, then something else.
            target = torch.where(torch.rand(8, generator=g) < follow, 7, 3).long()
            target = torch.where(torch.cumprod((target == 7).long(), 0) == 1, 7, 3)
            accepted_path = int((target[:e] == 7).long().cumprod(0).sum()) if e else 0
            tree_accepted = int((torch.rand(n, generator=g) < 0.5 ** torch.arange(1, n + 1)).long().cumprod(0).sum())
            k = max(accepted_path, tree_accepted)
            committed = target[: k + 1][None]
            auto.observe_lookup(torch.full((1, 6), 7), valid, committed)
            verified = torch.arange(width)[None] < n
            auto.observe_acceptance(claimed[:, :width], verified, torch.arange(width)[None] < tree_accepted)
            rows = 1 + n + e
            auto.observe_step(rows, rows * (301 + rows), 300, 0.05 + 0.002 * rows)
        return taken

    follows, ignores = run(0.9), run(0.02)
    assert sum(follows[-50:]) / 50 >= 4  # most of the 6-token path, once calibrated
    assert sum(ignores[-50:]) <= 3  # dropped (a chance hit lifts the EMA for a step or two)


def _drafted(gate: SpeculationGate, tokens_per_second: float, num_requests: int = 1) -> None:
    """A drafted step: its plan expects 2 tokens in a predicted 10 ms; the step measures 2 / rate seconds."""
    gate.observe_plan(BudgetPlan(torch.tensor([4]), torch.tensor(2.0), torch.tensor(0.01), torch.tensor(200.0)),
                      num_requests)
    gate.observe_drafted_step(2.0 / tokens_per_second)


def test_speculation_gate_measures_the_target_alone_then_drafts_only_while_trees_beat_it():
    gate = SpeculationGate(probe_every=4, max_probe_every=64, alpha=0.5, probe_loss_share=1.0)  # doubling alone
    # A request count never decoded without drafting is measured first; until a measurement comes
    # (a step with prefills in it measures nothing), every 4th step tries again and the rest draft.
    assert [gate.speculate(1) for _ in range(6)] == [False, True, True, True, False, True]
    gate.observe_ar_step(1, 0.040)  # the target alone: 25 tokens/s
    assert gate.speculate(1) is True  # the gate starts open
    # That step: 0.8x the target alone, measured (the plan's own 10 ms prediction, 200 tokens/s, is
    # not what the gate goes by).
    _drafted(gate, 20.0)
    # advantage 0.5 + 0.5 * 0.8 = 0.9: the steps decode alone, the 4th drafts (a probe)
    assert [gate.speculate(1) for _ in range(4)] == [False, False, False, True]
    _drafted(gate, 20.0)  # the probe: 0.8x again, so the next probe waits twice as long
    assert [gate.speculate(1) for _ in range(8)] == [False] * 7 + [True]
    assert gate.advantage_at(1) == pytest.approx(0.85)
    gate.observe_plan(BudgetPlan(torch.tensor([4]), torch.tensor(9.0), torch.tensor(0.01), torch.tensor(900.0)), 1)
    assert gate.speculate(1) is False and gate.advantage_at(1) == pytest.approx(0.85)  # a step not timed: nothing learnt
    assert [gate.speculate(1) for _ in range(15)] == [False] * 14 + [True]  # the next probe, 16 steps on
    _drafted(gate, 50.0)  # worth 2x: the probe reopens the gate at once (an EMA would have said 1.425)
    assert gate.speculate(1) is True and gate.advantage_at(1) == pytest.approx(2.0)
    # Another batch size has its own measured baseline and its own advantage; a step is compared at
    # its own size.
    assert gate.speculate(4) is False
    gate.observe_ar_step(4, 0.050)  # 80 tokens/s
    gate.observe_ar_step(4, 0.900)  # a stall (over 4x the median): dropped
    assert gate.ar_rate(4) == pytest.approx(80.0)
    _drafted(gate, 40.0, 4)  # 0.5x at 4 requests: that size class closes, the lone request's stays open
    assert gate.speculate(4) is False and gate.advantage_at(4) == pytest.approx(0.75)
    assert gate.advantage_at(5) == gate.advantage_at(7) == gate.advantage_at(4)  # one class: 4-7 requests
    assert gate.speculate(1) is True and gate.advantage_at(1) == pytest.approx(2.0)
    assert (gate.drafted, gate.undrafted) == (10, 29)
    _drafted(gate, 10.0)  # open, drafted steps at 0.4x move the EMA (0.5 * 2 + 0.5 * 0.4) and close it
    assert gate.speculate(1) is True and gate.advantage_at(1) == pytest.approx(1.2)
    _drafted(gate, 10.0)
    assert gate.speculate(1) is False and gate.advantage_at(1) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="probe_every"):
        SpeculationGate(probe_every=0)
    with pytest.raises(ValueError, match="max_probe_every"):
        SpeculationGate(probe_every=8, max_probe_every=4)


def test_speculation_gate_backs_off_its_probes_while_trees_stay_behind_and_resets_when_they_pay():
    gate = SpeculationGate(probe_every=2, max_probe_every=8, alpha=1.0, probe_loss_share=1.0)  # doubling alone
    gate.observe_ar_step(32, 0.050)  # 640 tokens/s
    gaps, since = [], 0
    for _ in range(40):
        if gate.speculate(32):
            gaps.append(since)
            since = 0
            _drafted(gate, 320.0, 32)  # every probe: half the target alone's rate
        else:
            since += 1
    # the open gate's first drafted step closes it, then the waits double up to the cap
    assert gaps[:5] == [0, 1, 3, 7, 7] and set(gaps[5:]) == {7}
    # a batch size class never seen is open, whatever this one found
    gate.observe_ar_step(1, 0.040)
    assert gate.speculate(1) is True
    _drafted(gate, 1280.0, 32)  # a probe at 32 finds trees paying (2x): open at once, waits reset
    assert gate.speculate(32) is True and gate.advantage_at(32) == pytest.approx(2.0)
    _drafted(gate, 320.0, 32)
    assert [gate.speculate(32) for _ in range(2)] == [False, True]


def _probe(gate: SpeculationGate, num_requests: int, tokens: int, seconds: float) -> None:
    """A drafted step of `num_requests` requests that committed `tokens` in `seconds`."""
    gate.observe_plan(BudgetPlan(torch.tensor([4]), torch.tensor(2.0), torch.tensor(0.01), torch.tensor(200.0)),
                      num_requests)
    gate.observe_tokens(torch.tensor(tokens))
    gate.observe_drafted_step(seconds)


def _probe_gaps(gate: SpeculationGate, steps: int, tokens: int, seconds: float) -> list[int]:
    """Undrafted steps between the drafted ones of a 32-request class over `steps` decisions, each
    drafted step committing `tokens` in `seconds`."""
    gaps, since = [], 0
    for _ in range(steps):
        if gate.speculate(32):
            gaps.append(since)
            since = 0
            _probe(gate, 32, tokens, seconds)
        else:
            since += 1
    return gaps


def test_probes_far_from_paying_wait_until_their_loss_is_a_small_share_of_the_class_s_time():
    # The target alone: 60 ms a step of 32 requests (533 tokens/s). A probe that commits 64 tokens in
    # 240 ms runs at half that and loses 120 ms: 2% of 100 undrafted steps.
    gate = SpeculationGate(probe_every=8, max_probe_every=64)
    gate.observe_ar_step(32, 0.060)
    gaps = _probe_gaps(gate, 1000, 64, 0.240)
    # The open class's first drafted step closes it; every later probe comes 100 steps after the last
    # (99 undrafted between; doubling alone: 8, 16, 32, 64, 64, ...), and the probes' loss stays
    # within the share of the class's time.
    assert gaps[0] == 0 and set(gaps[1:]) == {99}
    probes = len(gaps) - 1  # the first drafted step was the open class's, not a probe
    assert 0.120 * probes / (0.060 * sum(gaps) + 0.240 * probes) <= gate.probe_loss_share
    # A probe that came close to paying (0.95x, three undrafted steps' time: a bound of 8 steps) keeps
    # the doubling schedule.
    near = SpeculationGate(probe_every=8, max_probe_every=64)
    near.observe_ar_step(32, 0.060)
    assert _probe_gaps(near, 300, round(0.95 * 533.3 * 0.180), 0.180)[:6] == [0, 7, 15, 31, 63, 63]
    # A probe that commits nothing waits at most max_loss_wait.
    stuck = SpeculationGate(probe_every=8, max_probe_every=64, max_loss_wait=200)
    stuck.observe_ar_step(32, 0.060)
    assert set(_probe_gaps(stuck, 1000, 0, 0.300)[1:]) == {199}
    # A lone request whose trees pay on the whole (five drafted steps at 1.5x) closes its class after two
    # bonus-only steps (0.5x) in a row: some of its recent steps paid, its first probe comes after 8.
    lone = SpeculationGate(probe_every=8, max_probe_every=64)
    lone.observe_ar_step(1, 0.040)  # 25 tokens/s
    for rate in [1.5] * 5 + [0.5] * 2:
        assert lone.speculate(1)
        _probe(lone, 1, round(rate * 25 * 0.070, 3), 0.070)
    assert [lone.speculate(1) for _ in range(8)] == [False] * 7 + [True]
    # Also where their mean lost (one step at 1.1x, then one at 0.25x: a mean loss of 23 ms, 29 steps'
    # worth): one of them paid.
    mixed = SpeculationGate(probe_every=8, max_probe_every=64)
    mixed.observe_ar_step(1, 0.040)
    for rate in (1.1, 0.25):
        assert mixed.speculate(1)
        _probe(mixed, 1, round(rate * 25 * 0.070, 3), 0.070)
    assert [mixed.speculate(1) for _ in range(8)] == [False] * 7 + [True]
    with pytest.raises(ValueError, match="probe_loss_share"):
        SpeculationGate(probe_loss_share=0.0)


def test_a_closed_size_class_left_alone_for_stale_s_probes_at_once():
    now = [0.0]
    gate = SpeculationGate(probe_every=2, max_probe_every=8, alpha=1.0, stale_s=5.0, clock=lambda: now[0],
                           probe_loss_share=1.0)  # the doubling alone
    gate.observe_ar_step(1, 0.040)
    gate.observe_ar_step(32, 0.050)
    for r in (1, 32):  # both classes close: trees at half the target alone's rate
        assert gate.speculate(r)
        _drafted(gate, 0.5 * r / (0.040 if r == 1 else 0.050), r)
    assert not gate.speculate(32) and not gate.speculate(1)
    for _ in range(50):  # a loaded phase: 32 requests for 10 s, the lone request's class not seen
        now[0] += 0.2
        gate.speculate(32)
    assert gate.advantage_at(32) < 1 and gate.advantage_at(1) < 1
    assert gate.speculate(1) is True and gate.advantage_at(1) < 1  # stale: a probe, the verdict kept
    _drafted(gate, 50.0)  # the probe finds trees paying now (2x): open at once
    assert gate.speculate(1) is True and gate.advantage_at(1) == pytest.approx(2.0)
    now[0] += 1.0
    assert gate.speculate(32) is False  # seen a second ago: still closed, no probe due


def _gate_after_a_drafted_step() -> SpeculationGate:
    """A gate whose one drafted step's plan expected 2 tokens (a calibration that underrates this
    request) and which committed 6 in 0.1 s: 60 tokens/s, 2.4x the target alone's 25."""
    gate = SpeculationGate(probe_every=2, max_probe_every=8, alpha=1.0)
    gate.observe_ar_step(1, 0.040)  # the target alone: 25 tokens/s
    assert gate.speculate(1)
    gate.observe_plan(BudgetPlan(torch.tensor([4]), torch.tensor(2.0), torch.tensor(0.01), torch.tensor(200.0)), 1)
    gate.observe_tokens(torch.tensor(6))
    gate.observe_drafted_step(0.1)
    return gate


def test_speculation_gate_judges_a_step_by_the_tokens_it_committed_not_the_plans_estimate():
    gate = _gate_after_a_drafted_step()
    # 2.4x the target alone (the plan's estimate alone would say 0.8x and close the gate)
    assert gate.speculate(1) and gate.advantage_at(1) == pytest.approx(2.4)
    gate.observe_tokens(torch.tensor(1))  # no plan pending (the step drafted nothing): nothing to replace
    assert gate._pending is None


def test_speculation_gate_reads_a_step_s_tokens_only_once_their_copy_has_landed(monkeypatch):
    # On a GPU the committed tokens' copy to the host is queued in the step's sampling, just before
    # the next decision, with no wait between: read then, the pinned buffer holds whatever it held.
    # The gate asks the copy's event and folds the step in at a later decision once it has landed.
    from vllm_ddtree.tree import gate as gate_module
    from vllm_ddtree.tree.transfer import HostLater

    class CopyEvent:  # a CUDA event's query(), as the copy's stream answers it
        landed = False

        def query(self) -> bool:
            return self.landed

    event = CopyEvent()
    in_flight = HostLater(torch.tensor(-1.0), event)  # the buffer before the copy lands
    monkeypatch.setattr(gate_module, "to_host_later", lambda t: in_flight if t.dtype == torch.float32
                        else HostLater(t.clone()))
    gate = _gate_after_a_drafted_step()
    assert gate.speculate(1) and gate.advantage_at(1) == 1.0  # not read: the class stays as it was
    in_flight.host.fill_(6.0)
    event.landed = True
    assert gate.speculate(1) and gate.advantage_at(1) == pytest.approx(2.4)  # 60 tokens/s over 25
    assert not gate._measured


def test_auto_budget_consults_its_gate_only_once_the_cost_is_calibrated():
    auto = AutoBudget(cost_model("cpu", t_draft=0.0), 1, 8, gate=SpeculationGate())
    scores = torch.log(torch.full((1, 8), 0.5))
    steps = 0
    while auto.exploring:  # exploration drafts every step, whatever the gate would say
        assert auto.speculate(1)
        rows = 1 + int(auto.choose_plan(scores, torch.tensor([100])).budgets[0])
        auto.observe_step(rows, rows * (100 + rows), 100, 0.04 + 0.001 * rows)
        steps += 1
    assert steps >= 9 and auto.gate.drafted == auto.gate.undrafted == 0 and auto.gate._pending is None
    assert not auto.speculate(1)  # then the target alone is measured once
    auto.observe_ar_step(1, 0.001)  # ... and found far faster than any tree
    assert auto.speculate(1)
    auto.choose_plan(scores, torch.tensor([100]))
    assert auto.gate._pending is not None  # the chosen plan's tokens, read at the next decision
    fitted = len(auto.calibration.recent)
    auto.observe_step(9, 9 * 109, 100, 0.05, fit=False)  # with that step's time (not for the cost fit)
    assert len(auto.calibration.recent) == fitted
    assert not auto.speculate(1) and auto.gate.advantage_at(1) < 1
    assert "gate_advantage" in auto.summary() and auto.summary()["gate_undrafted_step_ms"] == {1: 1.0}


def _counted(texts: dict[int, list[int]], order: int, radix: int) -> dict[tuple[str, int], dict[int, int]]:
    """Every table's counts from the whole texts, in plain Python: for each m, the (slot, m context
    tokens, token) keys of every position whose m-token context lies inside the text, and the
    (slot, context) keys of the same positions."""
    tables = {(kind, m): {} for kind in ("ngram", "context") for m in range(order)}
    for slot, text in texts.items():
        for i in range(len(text)):
            for m in range(order):
                if i - m < 0:
                    continue
                for kind, digits in (("ngram", text[i - m : i + 1]), ("context", text[i - m : i])):
                    key = _key(slot, digits, radix)
                    tables[kind, m][key] = tables[kind, m].get(key, 0) + 1
    return tables


@pytest.mark.parametrize("with_host", [False, True])
def test_step_observations_count_what_a_plain_counter_counts(with_host):
    """The engine's per-step observation (no host read: a sort-and-sum merge, tails on the device,
    a row's host-held tokens with their host history, -1 padded step tokens, released slots reused)
    leaves exactly the counts a Python counter gets from the whole texts, and its padding is cut
    off once the tables' lengths have come back."""
    g = torch.Generator().manual_seed(11)
    vocab, order = 7, 3
    model = NGramModel(vocab, order=order)
    texts: dict[int, list[int]] = {}
    for step in range(12):
        if step == 6:  # slot 1 finishes; its slot is reused by a new text
            model.release_batch([1])
            texts.pop(1)
        slots = [0, 1, 2] if step >= 2 else [0, 1]
        k = 4
        new = torch.randint(0, vocab, (len(slots), k), generator=g)
        keep = torch.randint(0, k + 1, (len(slots),), generator=g)  # a prefix of each row, -1 after
        new = torch.where(torch.arange(k) < keep[:, None], new, -1)
        host = []
        for i, s in enumerate(slots):
            prompt = torch.randint(0, vocab, (5,), generator=g).tolist() if s not in texts else []
            if with_host and prompt:  # a new text's first tokens are held by the host, as a prompt
                host.append(([], prompt))
            elif prompt:  # else they come as step tokens of a row of their own width
                model.observe_batch([s], [prompt])
                host.append(None)
            else:
                host.append(None)
            texts[s] = texts.get(s, []) + prompt + [t for t in new[i].tolist() if t >= 0]
        model.observe_step(slots, new, HostTokens.from_lists(host))
    want = _counted(texts, order, vocab + 1)
    for (kind, m), counts in want.items():
        keys, got = model.online.real_entries(kind, m)
        assert dict(zip(keys.tolist(), got.tolist())) == counts, (kind, m)
    assert model.context_tail([0, 1, 2]).tolist() == [([-1] * 2 + t)[-2:] for t in (texts[0], texts[1], texts[2])]
    # the padding: after the next change the tables are cut to the lengths reported for them
    model.observe_step([0], torch.tensor([[1, 2]]))
    model.observe_step([0], torch.tensor([[-1, -1]]))
    keys = model.online.ngram_keys[order - 1]
    assert keys.numel() == model.online.real_entries("ngram", order - 1)[0].numel() + 2  # this merge's 2 windows


def test_fixed_shape_tables_count_the_same_in_place_and_grow_by_generations(monkeypatch):
    """Tables a captured step reads (fixed_shape): one capacity, real keys first, every change written
    in place, so a capture reading them by address sees each step's counts; past the capacity (by a
    bound known without a host read) they grow, a new generation. The counts are the plain tables'."""
    from vllm_ddtree.tree.ngram import NGramCounts

    monkeypatch.setattr(NGramCounts, "FIRST_CAPACITY", 16)
    g = torch.Generator().manual_seed(5)
    vocab, order = 7, 3
    plain, fixed = NGramModel(vocab, order=order), NGramModel(vocab, order=order, fixed_shape=True)
    generations, address = {fixed.generation}, None
    for step in range(10):
        if step == 6:
            for model in (plain, fixed):
                model.release_batch([1])
        slots = [0, 1, 2]
        new = torch.randint(0, vocab, (3, 4), generator=g)
        new[1, 3:] = -1
        for model in (plain, fixed):
            model.observe_step(slots, new)
        keys = fixed.online.ngram_keys[order - 1]
        assert keys.numel() == fixed.online.capacity and fixed.tails.shape[0] >= 3
        if fixed.generation in generations and address is not None:  # same generation: the same memory
            assert keys.data_ptr() == address
        generations.add(fixed.generation)
        address = keys.data_ptr()
        for kind in ("ngram", "context"):
            for m in range(order):
                want, got = plain.online.real_entries(kind, m), fixed.online.real_entries(kind, m)
                assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (step, kind, m)
        assert torch.equal(plain.context_tail(slots), fixed.context_tail(slots))
    assert len(generations) > 1 and fixed.online.capacity > 16  # it grew, and kept every count
    hist, toks = torch.tensor([[[1, 2]]]), torch.tensor([[[3, 4, 5]]])
    assert torch.equal(plain.log_rho(torch.tensor([0]), hist, toks), fixed.log_rho(torch.tensor([0]), hist, toks))
    # the GPU's search, all orders at once over the stacked tables (the fixed ones: the buffers themselves)
    for want, got in zip(plain.online.lookup_orders(torch.tensor([0]), hist, toks, order),
                         fixed.online.lookup_orders(torch.tensor([0]), hist, toks, order)):
        assert torch.equal(want, got)
    assert fixed.online._stacked(order)[0].data_ptr() == fixed.online.ngram_keys[0].data_ptr()


@pytest.mark.parametrize("order, vocab", [(2, 7), (3, 7), (4, 7), (4, 200_003)])
def test_the_gpu_s_merge_of_all_tables_at_once_counts_as_the_merges_table_by_table(monkeypatch, order, vocab):
    """On a GPU a step's windows go into every order's n-gram and context table in one batched merge
    (the tables padded to one length); on a CPU table by table. Prompts (contexts before the start:
    PAD), padded rows (windows that count nothing), releases and keys past 63 bits (order 4 of a
    200K vocabulary: wrapped, a corpus table's case, never released) included, the real keys and
    counts must be the same, and so the scores."""
    import vllm_ddtree.tree.ngram as ngram_mod
    from vllm_ddtree.tree.ngram import HostTokens

    g = torch.Generator().manual_seed(order)
    wraps = 4 * (vocab + 1) ** order >= 1 << 63
    models = {False: NGramModel(vocab, order=order), True: NGramModel(vocab, order=order)}
    prompts = HostTokens.from_lists([([], torch.randint(0, 5, (n,), generator=g).tolist()) for n in (1, 6, 0, 9)])

    def observe(*args) -> None:
        for at_once, model in models.items():
            monkeypatch.setattr(ngram_mod, "_merge_orders_at_once", lambda device, at_once=at_once: at_once)
            model.observe_step(*args)

    observe([0, 1, 2, 3], torch.full((4, 0), -1), prompts)
    for step in range(6):
        if step == 3 and not wraps:
            for model in models.values():
                model.release_batch([1])
        new = torch.randint(0, 5, (4, 3), generator=g)
        new[step % 4, 1 + step % 2 :] = -1
        observe([0, 1, 2, 3], new)
        for kind in ("ngram", "context"):
            for m in range(order):
                want, got = models[False].online.real_entries(kind, m), models[True].online.real_entries(kind, m)
                assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (step, kind, m)
    assert all(models[True].online.real_entries(kind, m)[0].numel() > 0 for kind in ("ngram", "context")
               for m in range(order))
    hist = torch.randint(-1, 5, (2, 3, order - 1), generator=g)
    toks = torch.randint(0, 5, (2, 3, 4), generator=g)
    assert torch.equal(models[False].log_rho(torch.tensor([0, 3]), hist, toks),
                       models[True].log_rho(torch.tensor([0, 3]), hist, toks))


@pytest.mark.parametrize("order", [2, 3, 4])
def test_the_gpu_s_backoff_over_all_orders_at_once_scores_bit_for_bit_as_order_by_order(monkeypatch, order):
    """On a GPU the orders' counts come from one stacked search and the longest context with a count
    is picked in one gather; on a CPU order by order, a longer hit overwriting a shorter. Over blocks
    with hits at every order, none, and contexts before the sequence start, with a corpus table mixed
    in, log rho must be the same floats."""
    import vllm_ddtree.tree.ngram as ngram_mod
    from vllm_ddtree.tree.ngram import NGramCounts, windows_of

    g = torch.Generator().manual_seed(10 + order)
    vocab = 8  # (tokens 5-7 never occur: no count at any order)
    corpus = NGramCounts(order + 1, vocab)
    text = torch.randint(0, 5, (60,), generator=g)
    corpus.add(torch.zeros(1, dtype=torch.int64), windows_of(text, order + 1))
    model = NGramModel(vocab, order=order, backoff=0.3, corpus=corpus, corpus_weight=0.25)
    for slot in (0, 1, 2):
        model.observe(slot, torch.randint(0, 3, (30,), generator=g))
    hist = torch.randint(-1, vocab, (3, 6, order - 1), generator=g)
    toks = torch.randint(0, vocab, (3, 6, 7), generator=g)
    scores = {}
    for at_once in (False, True):
        monkeypatch.setattr(ngram_mod, "_search_orders_at_once", lambda device, at_once=at_once: at_once)
        scores[at_once] = model.log_rho(torch.tensor([2, 0, 1]), hist, toks)
    assert torch.equal(scores[False], scores[True])
    floor = math.log(model.floor)
    assert (scores[True] == floor).any() and scores[True].unique().numel() >= 8  # misses, and hits of many kinds
