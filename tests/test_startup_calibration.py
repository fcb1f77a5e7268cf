"""The automatic budget is calibrated before serving: step sizes timed at start-up, not explored on
users' requests; the speculation gate's baseline for any request count comes from those timings."""

import json
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import run_helper, vllm_env

from vllm_ddtree.tree import AutoBudget, CostModel, ModelShape, SpeculationGate, get_profile

SHAPE = ModelShape(layers=30, hidden=576, q_heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=49152, bytes_per_param=4)


def timed_steps(intercept: float = 0.020, per_token: float = 0.001) -> list[tuple[float, float, float, float]]:
    """Start-up points as the engine makes them: n tokens as n one-token requests, no context."""
    return [(float(n), n * 1.0, 0.0, intercept + per_token * n) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)]


def test_a_seeded_calibration_is_calibrated_and_fits_the_timed_steps():
    auto = AutoBudget(CostModel(SHAPE, get_profile("cpu")), 1, 64, gate=SpeculationGate())
    assert auto.exploring and auto.calibration.explore_budget(1) is not None
    auto.calibration.seed(timed_steps())
    assert not auto.exploring and auto.calibration.explore_budget(8) is None
    # The cost model now predicts the timed steps (the line they lie on), not the roofline's guess.
    for tokens, pairs, ctx, seconds in timed_steps():
        predicted = float(auto.cost.verify_seconds(torch.tensor(tokens), torch.tensor(pairs), torch.tensor(ctx)))
        assert predicted == pytest.approx(seconds, rel=0.02)
    # Calibrated: the gate decides. With no baseline for one request it first decodes one step alone.
    assert auto.speculate(1) is False
    with pytest.raises(ValueError, match="two sizes"):
        auto.calibration.seed([(8.0, 8.0, 0.0, 0.01)])


def test_the_gate_s_baseline_is_interpolated_from_start_up_timings_and_follows_serving():
    gate = SpeculationGate()
    assert gate.ar_rate(12) is None  # nothing timed, nothing measured
    gate.ar_prior = {1: 0.010, 8: 0.024, 32: 0.072}
    assert gate.ar_rate(8) == pytest.approx(8 / 0.024)
    assert gate.ar_rate(20) == pytest.approx(20 / (0.024 + 0.5 * 0.048))  # between the timed counts
    assert gate.ar_rate(64) == pytest.approx(64 / (0.072 + 32 * 0.048 / 24))  # the last two's line
    assert gate.ar_rate(1) == pytest.approx(100.0)
    # A count with a timed baseline is not forced to decode alone first.
    assert gate.speculate(20)
    # Serving measures undrafted steps 1.5x slower than the dummy forwards: every estimate follows.
    gate.observe_ar_step(8, 0.036)
    assert gate.ar_rate(8) == pytest.approx(8 / 0.036)  # measured at that count: the measurement
    assert gate.ar_rate(20) == pytest.approx(20 / (1.5 * 0.048))


@pytest.mark.vllm
@pytest.mark.slow
def test_a_ddtree_engine_starts_calibrated(tmp_path):
    """`{"method": "ddtree"}` (automatic budget, gate) on the toy pair: before any request the cost is
    calibrated from timed steps and the gate has start-up baselines; then greedy output equals the
    target alone's."""
    script = tmp_path / "run.py"
    script.write_text(
        "import json, os, sys\n"
        "from vllm import LLM, SamplingParams\n"
        "from vllm_ddtree.models.target import prepare_target\n"
        "target = str(prepare_target())\n"
        "params = SamplingParams(temperature=0, max_tokens=32)\n"
        "prompts = ['def add(a, b):', 'The capital of France is']\n"
        "out = {}\n"
        "for name, spec in (('ddtree', {'method': 'ddtree'}), ('none', None)):\n"
        "    llm = LLM(model=target, dtype='float32', max_model_len=1024, enforce_eager=True, seed=0,\n"
        "              speculative_config=spec)\n"
        "    if spec:\n"
        "        drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter\n"
        "        out['before'] = drafter.budget_summary()\n"
        "        out['prior'] = {str(k): v for k, v in drafter.auto.gate.ar_prior.items()}\n"
        "        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner\n"
        "        out['uniform'] = [runner.uniform_decode_query_len,\n"
        "                          runner.cudagraph_dispatcher.uniform_decode_query_len,\n"
        "                          llm.llm_engine.vllm_config.num_speculative_tokens]\n"
        "    out[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]\n"
        "    del llm\n"
        "print('RESULT ' + json.dumps(out, default=str))\n")
    proc = run_helper(script, env=vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), timeout=900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    res = json.loads(line[0][len("RESULT "):])
    before = res["before"]
    assert before["cost_calibrated"] and before["gate_drafted_steps"] == before["gate_undrafted_steps"] == 0
    assert len(before["explored_step_ms"]) >= 3 and all(ms > 0 for ms in before["explored_step_ms"].values())
    assert "1" in res["prior"] and all(s > 0 for s in res["prior"].values())
    # P21: the runner's uniform decode is one token per request (vLLM's would be 1 + verify width)
    assert res["uniform"][:2] == [1, 1] and res["uniform"][2] > 1, res["uniform"]
    assert res["ddtree"] == res["none"]


class _DummyRunRecorder:
    """The two things `calibrate_at_startup` asks of vLLM's runner: `_dummy_run` (recorded here; a
    uniform decode returns at once, any other run takes `mixed_s`) and its CUDA-graph dispatcher's keys.
    A stand-in because vLLM captures no CUDA graphs on a CPU: the real engine (the slow test above)
    only ever takes the branch without FULL decode graphs."""

    def __init__(self, full_decode: bool, mixed_s: float = 0.005) -> None:
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor

        keys = {BatchDescriptor(num_tokens=8, num_reqs=8, uniform=True)} if full_decode else set()
        self.cudagraph_dispatcher = SimpleNamespace(cudagraph_keys={CUDAGraphMode.FULL: keys,
                                                                    CUDAGraphMode.PIECEWISE: set()})
        self.mixed_s, self.calls = mixed_s, []

    def _dummy_run(self, num_tokens: int, uniform_decode: bool = False) -> None:
        self.calls.append((num_tokens, uniform_decode))
        if not uniform_decode:
            time.sleep(self.mixed_s)


@pytest.mark.parametrize("full_decode", [False, True])
def test_the_gate_s_baseline_is_timed_as_undrafted_steps_run(full_decode):
    """Where vLLM holds FULL decode graphs (P21), the gate's baseline comes from uniform-decode dummy
    runs (what a step without trees replays) and the cost fit from the piecewise ones (what a tree
    step runs); without them both come from the same runs, and no run is added."""
    from vllm_ddtree.proposer import DDTreeProposer, has_full_decode_graphs

    auto = AutoBudget(CostModel(SHAPE, get_profile("cpu")), 1, 64, gate=SpeculationGate())
    sched = SimpleNamespace(max_num_seqs=16, max_num_batched_tokens=256)
    proposer = SimpleNamespace(auto=auto, ddtree_vllm_config=SimpleNamespace(scheduler_config=sched),
                               max_budget=64, device=torch.device("cpu"), live_timing=True)
    runner = _DummyRunRecorder(full_decode)
    assert has_full_decode_graphs(runner) is full_decode
    measured = DDTreeProposer.calibrate_at_startup(proposer, runner)
    mixed = [n for n, uniform in runner.calls if not uniform]
    uniform = [n for n, uniform in runner.calls if uniform]
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert sorted(set(mixed)) == sizes and mixed.count(1) == 3  # a warm-up and two timed runs each
    assert sorted(set(uniform)) == ([1, 2, 4, 8, 16] if full_decode else [])  # requests up to max_num_seqs
    assert sorted(auto.gate.ar_prior) == [1, 2, 4, 8, 16]
    assert not auto.exploring and all(ms >= 5.0 for ms in measured["step_ms"].values())
    if full_decode:
        assert all(s < 0.005 for s in auto.gate.ar_prior.values())
    else:
        assert auto.gate.ar_prior == pytest.approx({n: measured["step_ms"][n] / 1e3 for n in auto.gate.ar_prior})
