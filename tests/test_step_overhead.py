"""The step's device work does not grow with the batch, and it reads device data on the host once.

Runs the product's own step functions (the tree part of `DDTreeProposer.propose`, `prepare_tree_step`,
`sample_tree_step`) through benchmarks/step_overhead.py's counters: aten ops with a device operand
or on the n-gram tables, and every host read of data a GPU would hold (a tensor subclass marks it),
on a stand-in runner.
"""

import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import step_overhead  # noqa: E402

VOCAB, LAYERS = 2048, 4


def count(batch: int, budget, ngram: bool, lookup: int, steady: bool = False) -> dict:
    with torch.no_grad(), step_overhead.gpu_code_paths():
        return step_overhead.one_step(step_overhead.product(), batch, budget, ngram, lookup, VOCAB, LAYERS, 0, True,
                                      steady=steady)


@pytest.mark.parametrize("steady", [False, True], ids=["first step", "steady step"])
@pytest.mark.parametrize("budget, ngram, lookup", [(8, False, 0), (64, False, 0), ("auto", False, 8), ("auto", True, 8)])
def test_device_ops_and_python_lines_do_not_grow_with_the_batch(budget, ngram, lookup, steady):
    """No loop over requests or nodes on the device: the same ops at 1, 8 and 32 requests, the n-gram
    tables' ops (merge, lookups) included. No Python loop over requests on the host either: the
    step runs fewer added lines of vllm_ddtree's Python than it has added requests (a loop over
    requests runs one or more per request). Both for every request's first step (each brings its
    prompt) and for the step after (the last step's lookup paths scored, nothing new from the host)."""
    rows = {batch: count(batch, budget, ngram, lookup, steady) for batch in (1, 8, 32)}
    ops = {batch: row["device_ops"] for batch, row in rows.items()}
    lines = {batch: row["python_lines"] for batch, row in rows.items()}
    assert len(set(ops.values())) == 1, ops
    assert lines[1] > 0 and lines[32] - lines[1] < 32 - 1, lines


def test_the_steady_step_s_python_does_not_grow_with_the_model_s_layers():
    """The KV moves cover every layer of the target with one op pair per strided stack, and the layers
    are checked and stacked once per engine (`compaction.CacheStacks`): a steady step of a 36-layer
    target runs the same lines of Python and the same device ops as one of a 4-layer target. Looking
    at each layer every step ran 12 more lines per layer (rerun with that fault: 913 lines at 4 layers,
    1297 at 36)."""
    rows = {}
    for layers in (4, 36):
        with torch.no_grad(), step_overhead.gpu_code_paths():
            rows[layers] = step_overhead.one_step(step_overhead.product(), 2, "auto", False, 8, VOCAB, layers, 0,
                                                  True, steady=True)
    assert rows[4]["python_lines"] == rows[36]["python_lines"], {k: r["python_lines"] for k, r in rows.items()}
    assert rows[4]["device_ops"] == rows[36]["device_ops"], {k: r["device_ops"] for k, r in rows.items()}


def test_counting_the_gpu_code_paths_leaves_the_cpu_s_in_place():
    """The GPU's code paths are swapped in for counting only: after it, the CPU's are back."""
    import vllm_ddtree.tree.build as build
    import vllm_ddtree.tree.compile as compile_mod
    import vllm_ddtree.tree.ngram as ngram

    before = (compile_mod.ancestor_mask, build._top_scores, ngram._search_orders_at_once, ngram._merge_orders_at_once)
    with step_overhead.gpu_code_paths():
        assert compile_mod.ancestor_mask is compile_mod.ancestors_by_squaring
        assert build._top_scores is build._top_scores_by_sort
        assert ngram._search_orders_at_once(torch.device("cpu"))
        assert ngram._merge_orders_at_once(torch.device("cpu"))
    count(1, 8, False, 0)
    assert (compile_mod.ancestor_mask, build._top_scores, ngram._search_orders_at_once,
            ngram._merge_orders_at_once) == before
    assert not ngram._search_orders_at_once(torch.device("cpu"))
    assert not ngram._merge_orders_at_once(torch.device("cpu"))


def test_the_n_gram_tables_ops_are_device_ops():
    """The tables live on the drafter's device in an engine: their merge and lookups are counted as
    device ops, though here every tensor is a plain host one; cutting the step's new tokens into
    windows is host work in an engine too, and is not counted."""
    from vllm_ddtree.tree import NGramModel, windows_of

    model = NGramModel(VOCAB, 3)
    with step_overhead.OpCounter() as cut:
        windows_of([5, 6, 7, 5, 6], 3)
    assert cut.device_ops == 0 and cut.host_ops > 0
    with step_overhead.OpCounter() as merge:
        model.observe_batch([0, 1], [[5, 6, 7, 5, 6], [9, 9]])
    slots, history, candidates = torch.tensor([0, 1]), torch.tensor([[[6, 7]], [[9, 9]]]), torch.tensor([[[7, 9]], [[5, 6]]])
    with step_overhead.OpCounter() as lookup:
        model.log_rho(slots, history, candidates)
    assert merge.device_ops > 0 and lookup.device_ops > 0 and lookup.host_ops == 0
    with step_overhead.OpCounter() as plain:  # the same kind of op outside the n-gram model: host
        torch.searchsorted(torch.arange(8), torch.tensor([3]))
    assert plain.device_ops == 0


@pytest.mark.parametrize("ngram, lookup", [(False, 0), (False, 8), (True, 0), (True, 8)])
def test_the_step_reads_device_data_once(ngram, lookup):
    """One host read, through `to_host`: the tree copy vLLM's scheduler takes as lists. The n-gram
    tables (rescoring or the lookup branch) take the step's sampled tokens on the device."""
    row = count(8, 8, ngram, lookup)
    assert row["host_copies"] == 1 and row["counted_host_reads"] == 1, row
    assert row["nodes"] >= 1 and row["accepted"] >= 1  # a real step: trees verified, nodes accepted
    assert row["python_lines"] > 0  # and the lines of vllm_ddtree's Python it ran, counted


def test_the_counters_see_what_they_count():
    """Negative controls: a read of device data and an op on it are counted; host work is not."""
    step_overhead.MARK[0] = True
    x = step_overhead.device(torch.arange(6))
    step_overhead.DeviceData.reads = 0
    with step_overhead.OpCounter() as ops:
        y = x * 2
        torch.arange(3) + 1  # a host op
        y.tolist()
        int(y[0])
    assert step_overhead.DeviceData.reads == 2
    assert ops.device_ops >= 2 and ops.host_ops >= 2
    # What is made on the device (a factory given the device's data's device, a copy to it) is a
    # device op, and what it makes is device data; the same factory on the host is not.
    host = torch.tensor([1, 2])
    with step_overhead.OpCounter() as made:
        index = torch.arange(4, device=x.device)
        copied = host.to(x.device)
        torch.arange(4)
    assert x.device == step_overhead.STANDIN and made.device_ops == 2 and made.host_ops == 1
    step_overhead.DeviceData.reads = 0
    index.tolist(), copied.tolist()
    assert step_overhead.DeviceData.reads == 2
    # a view of device data is a device op, and counted among the views
    with step_overhead.OpCounter() as viewed:
        x.view(2, 3), x + 1
    assert viewed.device_ops == 2 and viewed.device_views == 1
    # and a move of device data to where it is makes nothing, whichever way it is asked for; a
    # change of dtype there is a device op
    with step_overhead.OpCounter() as moved:
        x.to(x.device), torch.as_tensor(x, device=x.device)
    assert moved.device_ops == moved.host_ops == 0
    with step_overhead.OpCounter() as cast:
        torch.as_tensor(x, device=x.device, dtype=torch.float32)
    assert cast.device_ops == 1


class EagerCapturable(step_overhead.CapturedOpCounter):
    """The eager step's ops with those a captured step replays set apart: the proposer's step function
    (`draft_trees` calls it: the token history's append, the lookup calibration, `plan_trees`), what
    `schedule_rows` runs (the request table's copy included) and what `verify_trees` runs (without
    graphs they call `scheduled_rows` and `verify_step` directly)."""

    functions = step_overhead.CAPTURED + ("verify_trees", "schedule_rows")

    def captured(self) -> bool:
        return super().captured() or step_overhead.inside("step", "proposer.py")


@pytest.mark.parametrize("budget, lookup", [(8, 8), ("auto", 8), ("auto", 0)])
def test_a_captured_step_is_the_ops_outside_its_graphs_their_input_copies_and_three_launches(budget, lookup):
    """The "pipeline, captured" rows: the steady step through the proposer's and the verify side's
    capture paths, with the ops inside `plan_trees` (build, budget, lookup path), `scheduled_rows`
    (the verify rows cut from the proposed trees, ancestor masks) and `verify_step` (walk,
    statistics, calibration) set apart as three graph launches after one copy per input.
    Everything the eager step runs outside them is still counted, the capture paths add their padding
    of the inputs and cut of the outputs, and the graphs' contents do not depend on how many padding
    rows the batch got (batch 1: none; batch 2: one)."""
    plan_inputs = 2 + (budget == "auto") + 2 * bool(lookup)
    verify_inputs = 7 + (budget == "auto")  # the trees' fields, the target's tokens, the rows' KV slots, the node scores
    schedule_inputs = 3  # the proposed trees' block, the request table, the step's token ids
    inside = []
    for batch in (1, 2):
        with torch.no_grad(), step_overhead.gpu_code_paths():
            code = step_overhead.product()
            eager = step_overhead.one_step(code, batch, budget, False, lookup, VOCAB, LAYERS, 0, True, steady=True,
                                           counter_class=EagerCapturable)
            captured = step_overhead.captured_step(code, batch, budget, lookup, VOCAB, LAYERS)
        assert captured["captured_ops"] >= 50 + 20  # the build alone is dozens of ops, the walk a score
        assert captured["launches"] == 3
        outside = eager["device_ops"]  # the eager step's ops outside what the graphs hold
        assert captured["device_ops"] >= outside + plan_inputs + schedule_inputs + verify_inputs + 3, (captured, eager)
        assert captured["device_ops"] < outside + eager["captured_ops"]  # fewer launches than eagerly
        assert captured["host_copies"] == eager["host_copies"] == 1
        inside.append(captured["captured_ops"])
    assert inside[0] == inside[1]


def test_the_host_held_tokens_go_to_the_n_gram_tables_without_python_per_request():
    """A step where every request brings tokens the host holds (prompts, prefill chunks) cuts them
    into windows (and writes them into the lookup's token history) with tensor ops over all rows: the same lines of vllm_ddtree's Python run for 1 and
    for 32 such requests. Negative control: building the same input from per-request lists
    (`HostTokens.from_lists`, a loop) runs more lines for more requests."""
    from vllm_ddtree.tree import HostTokens, NGramModel, TokenHistory

    def lines(r: int, code) -> int:
        model = NGramModel(VOCAB, 3)
        g = torch.Generator().manual_seed(r)
        texts = [torch.randint(0, VOCAB, (40,), generator=g).tolist() for _ in range(r)]
        host = HostTokens(torch.tensor(texts), torch.zeros(r, dtype=torch.int64), torch.full((r,), 40))
        step = torch.randint(0, VOCAB, (r, 3), generator=g)
        with step_overhead.LineCounter() as counted:
            code(model, r, texts, host, step)
        return counted.lines

    def observe(model, r, texts, host, step):
        model.observe_step(list(range(r)), step, host)

    def from_lists(model, r, texts, host, step):
        HostTokens.from_lists([([], t) for t in texts])

    def observe_history(model, r, texts, host, step):  # the lookup's token history takes them alike
        TokenHistory(64, 2, slots=32).observe_step(list(range(r)), step, host)

    # once first: the shared index ranges they slice are made on first use in a process (the suite's
    # order decides which test that is)
    lines(32, observe)
    assert lines(1, observe) == lines(32, observe) > 0
    lines(32, observe_history)
    assert lines(1, observe_history) == lines(32, observe_history) > 0
    assert lines(32, from_lists) > lines(1, from_lists)


def test_the_host_time_outside_the_ops_leaves_their_calls_out():
    """`outside_ops_ms` is the step's wall time less the time inside its ops' calls: positive, below
    the wall time of the same step, and it does not count what an op computes (a step whose ops are
    made 4 ms slower each keeps it, up to the host's noise, while its wall time grows by the ops'
    number times 4 ms).
    `host_ops_ms` times the counted step's host ops."""
    def timed(slow: bool) -> dict:
        with torch.no_grad(), step_overhead.gpu_code_paths():
            if not slow:
                return step_overhead.one_step(step_overhead.product(), 2, 8, False, 0, VOCAB, LAYERS, 0, False,
                                              timer=True)
            original = step_overhead.OpTimer.__torch_dispatch__

            def slower(self, func, types, args=(), kwargs=None):
                return original(self, lambda *a, **k: (time.sleep(0.004), func(*a, **k))[1], types, args, kwargs)
            step_overhead.OpTimer.__torch_dispatch__ = slower
            try:
                return step_overhead.one_step(step_overhead.product(), 2, 8, False, 0, VOCAB, LAYERS, 0, False,
                                              timer=True)
            finally:
                step_overhead.OpTimer.__torch_dispatch__ = original

    fast, slow = timed(False), timed(True)
    assert 0 < fast["outside_ops_ms"] < fast["glue_ms"], fast
    assert slow["glue_ms"] > fast["glue_ms"] + 100 * 4  # more than 100 ops, each 4 ms slower
    # Counting the ops' time would add all of the wall time's growth; a quarter leaves room for the
    # host's scheduling noise over a step made more than a second long.
    assert slow["outside_ops_ms"] - fast["outside_ops_ms"] < 0.25 * (slow["glue_ms"] - fast["glue_ms"]), (fast, slow)
    counted = count(2, 8, False, 0)
    assert counted["host_ops"] > 0 and counted["host_ops_ms"] > 0, counted
