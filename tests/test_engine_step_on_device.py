"""The engine's verify step reads the runner's host buffers, never its device tensors.

`prepare_tree_step` (before the target's forward) and `sample_tree_step` (in place of the rejection
sampler) run inside vLLM's `execute_model` / `sample_tokens`, where a GPU-to-host read stalls the
step (and raises under vLLM's `VLLM_GPU_SYNC_CHECK=error`). A real engine on a CPU cannot show
such a read: every tensor is on the host. So the runner's device-side state is put on PyTorch's
"meta" device, where any read of a value raises (tests/test_tree_on_device.py shows the premise).

The runner is a stand-in holding exactly the attributes vLLM 0.32's GPUModelRunner gives these two
functions (same names, same layouts), used only for what the real engine cannot show here: the
values these functions compute are checked by the real engine in tests/test_vllm_ddtree.py (outputs
token-identical to the target), not here.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from vllm_ddtree.proposer import DDTreeStats, ProposedTrees, RequestTree  # noqa: E402
from vllm_ddtree.verify import prepare_tree_step, sample_tree_step  # noqa: E402

VOCAB, WIDTH = 400, 8
# Three requests in one step: "a" verifies its proposed tree (4 nodes), "b" decodes without drafts,
# "c" has drafts the proposer did not make (vLLM's placeholders): verified as a chain.
TREE_A = RequestTree(tokens=[10, 11, 12, 13], parents=[-1, -1, 0, 2], depths=[1, 1, 2, 3])
CTX = [7, 5, 9]  # tokens in each request's KV cache before its root
DRAFTS = [[10, 11, 12, 13], [], [20, 21]]
ROOTS = [100, 200, 300]


def stand_in_runner(device: torch.device):
    ids = [t for root, d in zip(ROOTS, DRAFTS) for t in [root, *d]]
    n = [len(d) for d in DRAFTS]
    total = len(ids)
    qsl = torch.tensor([0, *torch.cumsum(torch.tensor(n) + 1, 0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + 1 + k for c, k in zip(CTX, n)], dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + 1 + k) for c, k in zip(CTX, n)])
    host_ids = torch.zeros(64, dtype=torch.int32)
    host_ids[:total] = torch.tensor(ids, dtype=torch.int32)
    proposer = SimpleNamespace(proposed=ProposedTrees.from_requests({"a": TREE_A}), width=WIDTH, auto=None, stats=DDTreeStats(interval=1e9),
                               context_order=None, context_positions=None)
    sampling = SimpleNamespace(all_greedy=True, no_penalties=True, allowed_token_ids_mask=None, bad_words_token_ids={},
                               logitsprocs=LogitsProcessors(), max_num_logprobs=None,
                               logprob_token_ids=None)
    slot_mapping = SimpleNamespace(gpu=torch.arange(64).to(device))
    cache = torch.zeros(8, 1, 16, 4).to(device)  # [blocks, kv heads, block size, 2 * head dim] ("rows" layout)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=["a", "b", "c"], prev_sampled_token_ids=None,
                                    block_table=[SimpleNamespace(slot_mapping=slot_mapping)], sampling_metadata=sampling),
        input_ids=SimpleNamespace(cpu=host_ids, gpu=host_ids.to(device)),
        query_start_loc=SimpleNamespace(cpu=qsl, gpu=qsl.to(device)),
        optimistic_seq_lens_cpu=seq_lens, seq_lens=seq_lens.to(device),
        positions=torch.zeros(64, dtype=torch.int64).to(device),
        drafter=proposer, sampler=Sampler(), _ddtree_target_caches=([cache], "rows"))
    runner.positions[:total] = positions.to(device)
    spec = SimpleNamespace(num_draft_tokens=n, draft_token_ids=torch.tensor([t for d in DRAFTS for t in d]).to(device))
    return runner, spec, total


def target_logits(device: torch.device) -> torch.Tensor:
    """Logits rows request-major (root, then each draft): "a" accepts 10 -> 12 -> 13 then 55, "b"
    samples 66, "c" accepts 20 then 99."""
    want = [10, 12, 99, 13, 55, 66, 20, 99, 7]  # argmax per scheduled row
    logits = torch.zeros(len(want), VOCAB)
    logits[torch.arange(len(want)), torch.tensor(want)] = 1.0
    return logits.to(device)


def run_step(device: torch.device):
    runner, spec, total = stand_in_runner(device)
    step = prepare_tree_step(runner, spec, total)
    out = sample_tree_step(runner, step, target_logits(device), spec)
    return runner, step, out


def test_the_verify_step_never_reads_a_device_tensor():
    meta = torch.device("meta")
    runner, step, out = run_step(meta)
    assert step.batch.tokens.device == meta and step.order_index.device == meta and step.row_slots.device == meta
    assert out.sampled_token_ids.device == meta and runner.drafter.context_order.device == meta


def test_async_scheduling_s_device_side_tokens_are_refused():
    runner, spec, total = stand_in_runner(torch.device("cpu"))
    runner.input_batch.prev_sampled_token_ids = torch.zeros(3, 1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="async scheduling"):
        prepare_tree_step(runner, spec, total)


def test_the_automatic_budget_is_told_which_tree_nodes_were_accepted():
    """`sample_tree_step` hands the acceptance calibration each request's accepted nodes: "a" accepts
    its nodes 0, 2, 3 (10 -> 12 -> 13); "c" accepts 20 of a chain the drafter did not propose, which
    is neither verified nor accepted as far as the drafter's calibration is concerned."""
    from vllm_ddtree.tree import AcceptanceCalibration, AutoBudget, CostModel, ModelShape, get_profile

    seen = []

    class Recording(AcceptanceCalibration):
        def update_state(self, scores, verified, accepted):
            counted = verified & (scores > -math.inf)  # what the calibration counts (`update_state`)
            seen.append((counted, accepted & counted))
            super().update_state(scores, verified, accepted)

    runner, spec, total = stand_in_runner(torch.device("cpu"))
    shape = ModelShape(layers=30, hidden=576, q_heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=49152,
                       bytes_per_param=4)
    runner.drafter.auto = AutoBudget(CostModel(shape, get_profile("cpu")), 1, WIDTH, acceptance=Recording())
    runner.drafter.proposed = ProposedTrees.from_requests(
        {"a": RequestTree(TREE_A.tokens, TREE_A.parents, TREE_A.depths, [-0.1, -1.2, -0.3, -0.6])})
    step = prepare_tree_step(runner, spec, total)
    sample_tree_step(runner, step, target_logits(torch.device("cpu")), spec)
    (verified, accepted), = seen
    # [R, N]: verify rows, the root (no node of the drafter's) first
    assert verified.tolist() == [[False] + [True] * 4, [False] * 5, [False] * 5]
    assert accepted.tolist() == [[False, True, False, True, True], [False] * 5, [False] * 5]
    assert float(runner.drafter.auto.acceptance.bin_accepted.sum()) == 3.0
    assert runner.drafter.auto.acceptance.updates == 1  # the host's count of the update


def test_a_tree_step_s_drafter_order_does_not_outlive_the_next_step():
    """vLLM skips the propose after a step when a request nears the drafter's max_model_len: the
    tree step's context order must not reach a later propose, whose context is another step's."""
    runner, step, out = run_step(torch.device("cpu"))
    assert runner.drafter.context_order is not None and runner.drafter.step_tokens is not None
    assert prepare_tree_step(runner, None, 1) is None  # the next step (no drafts scheduled)
    assert runner.drafter.context_order is None and runner.drafter.context_positions is None
    assert runner.drafter.step_tokens is None


def _engine_like_observation(catch_up: bool) -> tuple[dict, dict, object]:
    """The proposer's n-gram bookkeeping over steps as vLLM runs them: drafted steps (`_observe`
    counts the step's tokens on the device), undrafted ones (the proposer returns before
    `_tree_drafts`), a request leaving, one arriving whose first prefill chunk is discarded; after
    each step the runner's bookkeeping appends the kept tokens to its host batch. Returns every
    live request's whole text, the proposer's slots, its n-gram model and its lookup's token history."""
    from vllm_ddtree.proposer import DDTreeProposer
    from vllm_ddtree.tree import NGramModel, TokenHistory

    g = torch.Generator().manual_seed(4)
    vocab, k = 9, 4
    texts = {rid: torch.randint(0, vocab, (n,), generator=g).tolist() for rid, n in (("a", 6), ("b", 9), ("c", 4))}
    p = object.__new__(DDTreeProposer)
    p.ngram, p.history, p._slots, p._seen = NGramModel(vocab, 3), TokenHistory(128, 2), {}, {}
    discarded = set()
    for step in range(14):
        if step == 6:
            texts.pop("b")
        if step == 8:
            texts["d"] = torch.randint(0, vocab, (10,), generator=g).tolist()
            discarded.add("d")  # its first prefill chunk: the sampled token is thrown away
        ids = list(texts)
        batch = SimpleNamespace(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                num_tokens_no_spec=[len(texts[rid]) for rid in ids],
                                token_ids_cpu=torch.tensor([texts[rid] + [0] * (64 - len(texts[rid])) for rid in ids]).numpy())
        p.runner = SimpleNamespace(input_batch=batch, discard_request_mask=SimpleNamespace(
            np=torch.tensor([rid in discarded for rid in ids]).numpy()))
        tokens = torch.randint(0, vocab, (len(ids), k), generator=g)
        kept = torch.randint(1, k + 1, (len(ids),), generator=g)
        tokens = torch.where(torch.arange(k) < kept[:, None], tokens, -1) if step < 13 else torch.full_like(tokens, -1)
        if step % 3 != 1 or step == 13:  # drafted (the last step counts what the host holds)
            slots, new_tokens = p._observe(ids, tokens)
            p.history.append(slots, new_tokens)  # what the step function does first (`_tree_drafts`)
        elif catch_up:
            p._catch_up()  # what propose does at an undrafted step
        for i, rid in enumerate(ids):  # vLLM's bookkeeping: the step's kept tokens join the host batch
            if rid not in discarded:
                texts[rid] += [t for t in tokens[i].tolist() if t >= 0]
        discarded.discard("d")
    return texts, p._slots, p.ngram, p.history


@pytest.mark.parametrize("catch_up", [True, False])
def test_the_proposer_counts_every_committed_token_once(catch_up):
    """Drafted steps count their tokens on the device, undrafted ones not at all: the tables must
    still hold each live request's whole text, counted once. Without `_catch_up` (a negative
    control) the tokens of undrafted steps are lost."""
    from test_tree_budget_ngram import _counted

    texts, slots, model, history = _engine_like_observation(catch_up)
    want, got = {}, {}
    for rid, text in texts.items():
        for key, n in _counted({slots[rid]: text}, 3, 10)[("ngram", 2)].items():
            want[key] = n
    keys, counts = model.online.real_entries("ngram", 2)
    got = dict(zip(keys.tolist(), counts.tolist()))
    tails = model.context_tail([slots[rid] for rid in texts]).tolist()
    assert len(want) > 20 and set(texts) == {"a", "c", "d"}
    same = got == want and tails == [text[-2:] for text in texts.values()]
    assert same == catch_up
    # the lookup's token history: each live request's text, position p at column p
    rows = [slots[rid] for rid in texts]
    kept = [history.tokens[s, : int(history.lengths[s])].tolist() for s in rows]
    assert (kept == list(texts.values())) == catch_up
