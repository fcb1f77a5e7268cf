"""The reference decoder: every speculative method is token-identical to the target alone (float32).

A tiny random Llama target with a 32-token vocabulary and a random DFlash drafter: a budget of 64
covers every depth-1 token, so every step accepts a node (usually off the drafter's top-1 spine),
and n-gram rescoring follows the target's short cycles to accept 3-4 deep paths: KV compaction
runs on every step. (The real SmolLM2 pair is tested in the vLLM tests.) At the end: replaying a
fixed budget on teacher-forced trees (`reference.replay`) gives the decoder's accepted lengths.
"""

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_ddtree.drafter import DFlashDrafter, DrafterConfig
from vllm_ddtree.reference import ReferenceDecoder, SamplingConfig, SpecConfig
from vllm_ddtree.reference.decoder import process_logits
from vllm_ddtree.reference.replay import PositionTree, fit_step_cost, replay, teacher_forced_trees

VOCAB = 32
SHARPEN = 4.0


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )
    target = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharper next-token distributions, like a real LM's
        target.lm_head.weight.mul_(SHARPEN)
    dcfg = DrafterConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, draft_vocab_size=VOCAB, block_size=8, target_layer_ids=[0, 2],
        num_target_layers=4, mask_token_id=VOCAB - 1,
    )
    drafter = DFlashDrafter(dcfg, target.model.embed_tokens.weight.detach()).float().eval()
    return target, drafter


PROMPTS = [[1, 5, 9], [3] * 11, [7, 2, 30, 4, 4, 8, 1, 19, 22, 3, 5, 6, 0, 2, 2, 17, 9, 12]]
SPECS = [
    SpecConfig(method="dflash"),
    SpecConfig(method="ddtree", budget=1),
    SpecConfig(method="ddtree", budget=8),
    SpecConfig(method="ddtree", budget=64),
    SpecConfig(method="ddtree", budget=24, ngram_weight=1.0),
    SpecConfig(method="ddtree", budget=64, adaptive=True, min_budget=2),
    SpecConfig(method="ddtree", budget=8, prompt_lookup_tokens=6),
    SpecConfig(method="ddtree", budget=16, adaptive=True, min_budget=2, prompt_lookup_tokens=6),
]


@pytest.fixture(scope="module")
def decoder(pair):
    target, drafter = pair
    return ReferenceDecoder(target, drafter)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}-B{s.budget}-ng{s.ngram_weight}-ad{int(s.adaptive)}-lk{s.prompt_lookup_tokens}")
def test_greedy_is_token_identical_to_target_alone(decoder, spec):
    accepted_multi = 0
    for prompt in PROMPTS:
        for n in (1, 2, 7, 40):
            ar = decoder.generate(prompt, n, SpecConfig(method="ar")).tokens
            out = decoder.generate(prompt, n, spec)
            assert out.tokens == ar, (prompt, n)
            # one timed step per target forward after prefill, so per-step costs can be reported
            assert len(out.step_seconds) == len(out.accept_lengths) and all(t > 0 for t in out.step_seconds)
            accepted_multi += sum(1 for a in out.accept_lengths if a > 1)
    if spec.method == "ddtree" and spec.budget >= 8:
        # trees were accepted beyond the bonus token, so compaction ran on the paths checked above
        # (how often depends on the drafter and, for the adaptive budget, on measured step times)
        assert accepted_multi > 0


def test_adaptive_budget_calibrates_online_and_stays_in_range(pair):
    target, drafter = pair
    dec = ReferenceDecoder(target, drafter)  # a fresh controller: it must explore, fit, then choose
    spec = SpecConfig(method="ddtree", budget=32, adaptive=True, min_budget=2)
    ar = ReferenceDecoder(target).generate(PROMPTS[2], 60, SpecConfig(method="ar")).tokens
    budgets = []
    for _ in range(3):
        out = dec.generate(PROMPTS[2], 60, spec)
        assert out.tokens == ar
        budgets += out.budgets
    auto = dec.auto_budget(spec)  # the controller those runs calibrated
    assert auto.calibration.calibrated and auto.summary()["cost_intercept_ms"] + auto.summary()["cost_per_token_ms"] > 0
    assert {32, 2, 8} <= set(budgets)  # the exploration sizes were verified
    assert all(2 <= b <= 32 for b in budgets)
    assert auto.acceptance.updates == len(budgets)  # every step fed the drafter-confidence fit


def test_steps_the_gate_keeps_from_drafting_are_exact_and_the_drafter_catches_up_on_them(pair):
    target, drafter = pair
    dec = ReferenceDecoder(target, drafter)
    spec = SpecConfig(method="ddtree", budget=16, adaptive=True, min_budget=0)  # 0: the gate may skip drafting
    auto = dec.auto_budget(spec)
    auto.gate.probe_every = auto.gate.max_probe_every = auto.gate.max_loss_wait = 3
    auto.gate.stale_s = float("inf")
    auto.gate.ar_seconds[1] = [1e-6]  # the target alone looks far faster than any tree: the gate closes
    budgets = []
    for prompt in PROMPTS:
        for n in (7, 40):
            ar = dec.generate(prompt, n, SpecConfig(method="ar")).tokens
            out = dec.generate(prompt, n, spec, keep_cache=True)
            assert out.tokens == ar, (prompt, n)
            assert len(out.budgets) == len(out.accept_lengths) == len(out.step_seconds)
            budgets += out.budgets
            # The drafter's context K/V, built step by step (trees, undrafted steps, the catch-up after
            # them), equals one pass over every committed token's target features.
            committed = prompt + out.tokens[:-1]
            with torch.no_grad():
                _, feats, _ = dec._target_forward(torch.tensor([committed]), torch.arange(len(committed))[None],
                                                  None, None)
                fresh = drafter.context_kv(drafter.fuse_features(feats), torch.arange(len(committed))[None])
            m = out.drafter_cache.length
            assert m >= len(prompt)
            for (k, v), (fk, fv) in zip(out.drafter_cache.layers, fresh):
                torch.testing.assert_close(k, fk[:, :, :m], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v, fv[:, :, :m], atol=1e-5, rtol=1e-5)
    assert auto.calibration.calibrated
    after = budgets[len(auto.calibration.explored) + 1:]  # past exploration: undrafted steps and probes
    assert after.count(0) > sum(b > 0 for b in after) > 0
    assert auto.gate.undrafted == budgets.count(0) and auto.summary()["gate_advantage"][1] < 1


def test_eos_inside_an_accepted_path_ends_at_that_token(pair, decoder):
    target, drafter = pair
    prompt = PROMPTS[2]
    ar = decoder.generate(prompt, 40, SpecConfig(method="ar")).tokens
    for eos in sorted(set(ar[2:]))[:6]:
        stop = ReferenceDecoder(target, drafter, eos_token_ids=(eos,))
        expect = ar[: ar.index(eos) + 1]
        assert stop.generate(prompt, 40, SpecConfig(method="ar")).tokens == expect
        assert stop.generate(prompt, 40, SpecConfig(method="ddtree", budget=64)).tokens == expect


def test_compacted_cache_equals_a_fresh_prefill(pair, decoder):
    target, _ = pair
    prompt = PROMPTS[0]
    # n-gram rescoring follows the target's short cycles: deep, off-spine paths get accepted
    out = decoder.generate(prompt, 30, SpecConfig(method="ddtree", budget=64, ngram_weight=1.0), keep_cache=True)
    assert any(a > 2 for a in out.accept_lengths)
    committed = prompt + out.tokens[:-1]  # the last token is the next root: not in the cache yet
    with torch.no_grad():
        fresh = target(torch.tensor([committed]), use_cache=True).past_key_values
    n = len(committed)  # the last step may hold one more row: its tokens were cut by max_new_tokens
    assert out.cache.get_seq_length() >= n
    for got, ref in zip(out.cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys[:, :, :n], ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values[:, :, :n], ref.values, atol=1e-5, rtol=1e-5)


def _target_joint(target, prompt: list[int], sampling: SamplingConfig, length: int) -> dict[tuple, float]:
    """The target alone's exact distribution of its first `length` sampled tokens after `prompt`: every
    prefix in the support enumerated, each next token's probability from `process_logits`, as the
    decoder samples it."""
    joint = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, p in joint.items():
            with torch.no_grad():
                logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            probs = process_logits(logits, sampling)
            for t in torch.nonzero(probs).flatten().tolist():
                nxt[prefix + (t,)] = p * float(probs[t])
        joint = nxt
    return joint


def _fit_pvalue(samples: list[tuple], joint: dict[tuple, float]) -> float:
    """Chi-square goodness of fit of `samples` to `joint`, outcomes expected fewer than 5 times pooled."""
    n, total = len(samples), sum(joint.values())
    joint = {k: p / total for k, p in joint.items()}  # (its float32 products sum to 1 within rounding)
    counts = {k: samples.count(k) for k in joint}
    common = [k for k in joint if n * joint[k] >= 5]
    rare = [k for k in joint if n * joint[k] < 5]
    observed = [counts[k] for k in common] + ([sum(counts[k] for k in rare)] if rare else [])
    expected = [n * joint[k] for k in common] + ([n * sum(joint[k] for k in rare)] if rare else [])
    return float(chisquare(observed, expected).pvalue)


def test_sampling_matches_the_target_distribution(pair, decoder):
    # top_k=3 keeps the joint of the first three tokens to 27 outcomes; tokens 2 and 3 come from
    # the first speculative step (the first token after prefill is never speculated). The reference
    # is the target's exact joint, not a sample of it.
    target, _ = pair
    sampling = lambda seed: SamplingConfig(temperature=1.0, top_k=3, seed=seed)  # noqa: E731
    # The second case's trees are one drafter node plus a prompt-lookup path: with bigrams (order 2)
    # over a prompt that holds every token once, the lookup proposes a path after any root.
    cases = [(PROMPTS[1], SpecConfig(method="ddtree", budget=16)),
             (list(range(VOCAB - 1)), SpecConfig(method="ddtree", budget=1, prompt_lookup_tokens=4, ngram_order=2))]
    for prompt, spec in cases:
        runs = [decoder.generate(prompt, 3, spec, sampling(10_000 + s)) for s in range(400)]
        if spec.prompt_lookup_tokens:
            assert max(b for r in runs for b in r.budgets) > 1  # lookup nodes were verified
        tree = [tuple(r.tokens) for r in runs]
        joint = _target_joint(target, prompt, sampling(0), 3)
        assert set(tree) <= set(joint), spec  # nothing outside the target's support
        assert _fit_pvalue(tree, joint) > 1e-3, spec  # alpha = 1e-3, fixed seeds
        # The negative control: the same samples against the target's joint at a lower temperature.
        # (The first case's joint is close to uniform over its 27 outcomes: temperatures down to 0.5
        # are within what 400 samples tell apart.)
        cooler = _target_joint(target, prompt, SamplingConfig(temperature=0.3, top_k=3), 3)
        assert _fit_pvalue(tree, cooler) < 1e-3, spec


def test_bad_configs_raise(decoder):
    with pytest.raises(ValueError, match="method must be one of"):
        SpecConfig(method="medusa")
    with pytest.raises(ValueError, match="min_budget"):
        SpecConfig(budget=0)
    with pytest.raises(ValueError, match="adaptive budget needs method 'ddtree'"):
        SpecConfig(method="dflash", adaptive=True)
    with pytest.raises(ValueError, match="prompt_lookup_tokens needs method 'ddtree'"):
        SpecConfig(method="dflash", prompt_lookup_tokens=4)
    with pytest.raises(ValueError, match="needs a drafter"):
        ReferenceDecoder(decoder.target).generate([1], 3, SpecConfig(method="ddtree"))


# ---- replay of budget rules on teacher-forced trees (vllm_ddtree.reference.replay) ----
@pytest.mark.parametrize("budget,width,ngram", [(1, 1, 0.0), (8, 8, 0.0), (8, 64, 0.0), (64, 64, 0.0), (24, 24, 1.0)])
def test_fixed_budget_replays_to_the_decoders_accepted_lengths(decoder, budget, width, ngram):
    for prompt in PROMPTS:
        spec = SpecConfig(method="ddtree", budget=budget, ngram_weight=ngram)
        real = decoder.generate(prompt, 40, spec)
        out = decoder.generate(prompt, 40, SpecConfig(method="ar")).tokens
        trees = teacher_forced_trees(decoder, prompt, out, width, ngram_weight=ngram)
        lengths = []
        replay(trees, lambda t: budget, observe=lambda t, n, a: lengths.append(min(a + 1, t.remaining)))
        assert lengths == real.accept_lengths


@pytest.mark.parametrize("budget,ngram", [(8, 0.0), (64, 0.0), (24, 1.0)])
def test_sampled_decode_replays_to_its_own_accepted_lengths(decoder, budget, ngram):
    """At T > 0 a step's accepted length is the tree path that spells the next output tokens, so
    replaying along a sampled speculative decode's own output gives back its accepted lengths
    (what makes the replay along a sampled AR decode exact in distribution)."""
    steps_with_a_node = 0
    for seed, prompt in enumerate(PROMPTS):
        spec = SpecConfig(method="ddtree", budget=budget, ngram_weight=ngram)
        real = decoder.generate(prompt, 40, spec, SamplingConfig(temperature=1.0, seed=seed))
        trees = teacher_forced_trees(decoder, prompt, real.tokens, budget, ngram_weight=ngram)
        lengths = []
        replay(trees, lambda t: budget, observe=lambda t, n, a: lengths.append(min(a + 1, t.remaining)))
        assert lengths == real.accept_lengths
        steps_with_a_node += sum(k > 1 for k in lengths)
    assert steps_with_a_node > 0, "no step accepted a draft node"  # the comparison has teeth


@pytest.mark.slow
def test_chain_replay_on_the_real_pair():
    """On the real pair (the toy drafter is random: its chain never accepts, a toy check could not fail)."""
    from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval
    from vllm_ddtree.reference.pair import load_pair

    pair = load_pair()
    dec = ReferenceDecoder(pair.target, pair.drafter, eos_token_ids=pair.eos_token_ids)
    prompt = pair.tokenizer(chat_prompt(pair.tokenizer, load_humaneval(1)[0]["prompt"]),
                            add_special_tokens=False)["input_ids"]
    real = dec.generate(prompt, 48, SpecConfig(method="dflash"))
    out = dec.generate(prompt, 48, SpecConfig(method="ar")).tokens
    assert real.tokens == out
    chains = [t.as_chain() for t in teacher_forced_trees(dec, prompt, out, 4)]
    lengths = []
    replay(chains, lambda t: dec.depth, observe=lambda t, n, a: lengths.append(min(a + 1, t.remaining)))
    assert lengths == real.accept_lengths
    assert max(lengths) > 2  # drafts were accepted: the comparison has teeth


def test_replay_steps_and_caps():
    # Three roots; the path's nodes sit at best-first ranks 0 and 5 at the first root.
    t0 = PositionTree(torch.zeros(8), torch.zeros(8), torch.tensor([0, 5]), remaining=3, context=10)
    t1 = PositionTree(torch.zeros(8), torch.zeros(8), torch.tensor([0]), remaining=2, context=11)
    t2 = PositionTree(torch.zeros(8), torch.zeros(8), torch.tensor([], dtype=torch.long), remaining=1, context=12)
    trees = [t0, t1, t2]
    r = replay(trees, lambda t: 4, seconds=lambda n: 0.1 + 0.01 * n)
    # budget 4: accepts rank 0 only at t0 -> emits 2, lands on t2 (remaining 1) -> emits 1.
    assert (r.steps, r.tokens, r.nodes) == (2, 3, 8) and r.seconds == pytest.approx(0.28)
    assert r.histogram == (0, 1, 1)  # one step emitted 1 token, one emitted 2
    r = replay(trees, lambda t: 6)  # both path nodes, capped by the 3 tokens left
    assert (r.steps, r.tokens, r.histogram) == (1, 3, (0, 0, 0, 1))
    with pytest.raises(ValueError):
        replay(trees, lambda t: -1)


def test_step_cost_fit_recovers_a_line():
    rows = [{"budget": b, "tau": 2.0, "tokens_per_s": 2.0 / (0.1 + 0.002 * b)} for b in (4, 8, 32, 64)]
    rows.append({"budget": None, "tau": 1.0, "tokens_per_s": 20.0})  # AR and auto rows are ignored
    c0, c1 = fit_step_cost(rows)
    assert c0 == pytest.approx(0.1) and c1 == pytest.approx(0.002)
    with pytest.raises(ValueError):
        fit_step_cost(rows[:1])


def test_chain_by_window_counts_each_step_where_its_root_sits():
    """`benchmarks/chain_by_position.py`: a chain step counts in the window of its root's output
    position, with the tokens it emits (capped by what the decode has left); roots past the last edge
    are not counted."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from chain_by_position import chain_by_window
    finally:
        sys.path.pop(0)
    n_prompt, accepted = 10, [2, 9, 9, 0, 5, 0]  # output positions 0..5: steps at 0 (+2), 3 (+0), 4 (+5, capped)
    trees = [PositionTree(torch.zeros(16), torch.zeros(16), torch.tensor([], dtype=torch.long),
                          remaining=6 - i, context=n_prompt + i, chain_accepted=k) for i, k in enumerate(accepted)]
    assert chain_by_window(trees, n_prompt, 15, [0, 2, 6]) == ([1, 2], [3, 3])  # 3 tokens, then 1 + 2
    assert chain_by_window(trees, n_prompt, 15, [0, 2, 4]) == ([1, 1], [3, 1])  # the step at 4 is outside
    assert chain_by_window(trees, n_prompt, 1, [0, 6]) == ([3], [6])  # depth 1: steps at 0, 2, 4, each emits 2
