"""The GPU check's CPU part (`benchmarks/gpu_check.py --device cpu --quick`), so it cannot rot between
GPU runs: it runs where the GPU machine runs it, in a bare PyTorch + transformers environment
(`benchmarks/gpu_image.py`: no vLLM) with FlashInfer's Python package, and every part that needs no CUDA
kernel compares our tree attention inputs, tree pipeline and KV compaction against independent references.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FLASHINFER_DIR = Path(sys.prefix) / "flashinfer"
CPU_PARTS = {"a.plan", "b.pipeline", "b.profile", "b.seeded", "c.compaction", "d.verify_cost", "b.topk"}
CUDA_PARTS = {"a.kernel", "b.sync", "b.graphs", "a.xqa"}

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402

from vllm_ddtree.tree import CostModel  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    assert (FLASHINFER_DIR / "flashinfer").is_dir(), f"{FLASHINFER_DIR} is missing: run `make test` (it installs it)"
    out = tmp_path_factory.mktemp("gpu_check") / "check.json"
    # The bare image: PyTorch, transformers and their requirements from this venv, plus FlashInfer and what it
    # imports (the venv's own tvm-ffi and requests stand in for the carried wheels).
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_image.py"), "--site", str(FLASHINFER_DIR),
           "--keep", "apache-tvm-ffi", "--keep", "requests", "--", "python", str(REPO / "benchmarks" / "gpu_check.py"),
           "--device", "cpu", "--quick", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "bare image:" in done.stdout
    return json.loads(out.read_text()) | {"_stdout": done.stdout}


def test_report_schema_names_device_and_versions(report):
    assert report["device_type"] == "cpu" and report["device_slug"] == "cpu"
    assert report["torch"] == torch.__version__ and report["cuda"] is None
    assert report["flashinfer"], "FlashInfer's Python package did not import in the bare environment"
    assert [p["name"] for p in report["parts"]] == [name for name, _, _ in gpu_check.PARTS]
    assert all({"name", "passed"} <= set(p) for p in report["parts"])


def test_every_cpu_part_passed_and_cuda_parts_are_not_run(report):
    parts = {p["name"]: p for p in report["parts"]}
    for name in CPU_PARTS:
        assert parts[name]["passed"] is True, (name, {k: v for k, v in parts[name].items() if k != "traceback"})
    for name in CUDA_PARTS:
        assert parts[name]["passed"] is None and "needs CUDA" in parts[name]["not_run"]


def test_cpu_parts_checked_what_they_claim(report):
    parts = {p["name"]: p for p in report["parts"]}
    plan = parts["a.plan"]
    assert plan["flashinfer_checked"]
    for case in plan["cases"].values():
        assert case["mask_equals_tree_core"] and case["flashinfer_mask_offsets_match"] and case["plan_signature_binds"]
        assert case["tree_mask_effect"] > 1e-2  # the oracle's tree masks differ from causal ones
        assert case["xqa_read_max_abs_err"] < 1e-4  # the XQA plan, read as XQA documents it
    steps = parts["b.pipeline"]["steps"]
    assert {s["variant"] for s in steps} == set(gpu_check.VARIANTS) and all(not s["problems"] for s in steps)
    assert all(b["equal"] and b["real_moves"] > 0 and b["layers"] == 36 and b["stacks"] == 1
               for b in parts["c.compaction"]["batches"])
    seeded = parts["b.seeded"]["cases"]  # imported without vLLM: the bare image has none
    assert [c["noise"] for c in seeded] == ["float32", "float64"]
    assert all(c["equal"] and c["states_equal"] and c["settled"] and c["one_draw_per_row_differs"] for c in seeded)
    profiles = parts["b.profile"]["profiles"]
    assert {(p["batch"], p["variant"]) for p in profiles} == {(b, v) for b in (1, 4) for v in gpu_check.VARIANTS}
    for p in profiles:  # every stage dispatched work, the lookup stage only with the lookup branch
        assert p["outside_stages"]["ops"] == 0
        assert all((p["stages"][s]["ops"] > 0) == (s != "lookup" or p["variant"] == "lookup") for s in gpu_check.STAGES)
        assert p["ops"] == sum(s["ops"] for s in p["stages"].values())
        assert (p.get("observe", {}).get("ops", 0) > 0) == (p["variant"] != "plain")
    topk = parts["b.topk"]
    selections = ["torch"] + [f"segmented/{n}" for n in gpu_check.TOPK_SEGMENT_CHOICES]
    assert topk["selections"] == selections and [b["batch"] for b in topk["batches"]] == [1, 4]
    for b in topk["batches"]:
        assert b["select_mismatches"] == dict.fromkeys(selections, 0)
        assert b["chunked_mismatches"] == 0 and b["chunked_ms"] > 0
    d = parts["d.verify_cost"]
    assert len(d["points"]) == 8 and d["fitted"]["slope"] > 0 and set(d["knee_n"]) == {"1", "4"}
    # the timed static forward (CUDA-graph replayed on a GPU) computes what transformers computes
    assert [c["batch"] for c in d["static_vs_transformers"]] == [1, 4]
    assert all(c["max_abs_diff"] <= 1e-3 * max(1.0, c["max_abs_logit"]) for c in d["static_vs_transformers"])


def test_topk_comparison_counts_a_changed_id_set_unless_the_kth_place_is_tied():
    ref = torch.tensor([[5, 3, 1], [5, 3, 1]])
    ids = torch.tensor([[3, 5, 1], [5, 3, 2]])  # row 0: same set, other order; row 1: another third id
    kth, nxt = torch.tensor([0.5, 0.5]), torch.tensor([0.4, 0.4])
    assert gpu_check.boundary_mismatches(ids, ref, kth, nxt) == 1
    assert gpu_check.boundary_mismatches(ids, ref, kth, torch.tensor([0.4, 0.5])) == 0  # a tie: either id is right


@pytest.mark.parametrize("vocab,k", [(4096, 32), (4100, 32), (151936, 64), (300, 64), (1000, 1)])
def test_the_topk_by_slices_keeps_the_same_values_and_ids(vocab, k):
    # whole slices and a remainder (4100 = 16 x 256 + 4), slices shorter than k (300 / 16 < 64)
    g = torch.Generator().manual_seed(vocab)
    scores = torch.randn(6, vocab, generator=g)
    scores[1, ::3] = scores[1, 0]  # equal values across slices
    scores[2, -3] = 100.0  # the best value in the remainder
    want = torch.topk(scores, k, dim=-1)
    v, i = gpu_check.segmented_topk(scores, k, 16)
    assert torch.equal(v, want.values)
    assert torch.equal(scores.gather(-1, i), v)  # ids point at their values
    untied = [r for r in range(6) if r != 1]  # row 1's ties may keep other ids of the same value
    assert torch.equal(i[untied].sort(-1).values, want.indices[untied].sort(-1).values)


def test_static_verify_forward_equals_transformers_and_the_check_has_teeth():
    class Ctx:
        sizes, device = gpu_check.sizes_for("cpu", quick=True), torch.device("cpu")

    model, config = gpu_check.verify_model(Ctx)
    torch.manual_seed(0)
    with torch.inference_mode():
        cache = model(torch.randint(config.vocab_size, (2, 40)), use_cache=True, logits_to_keep=1).past_key_values
        new = torch.randint(config.vocab_size, (2, 5))
        static = gpu_check.StaticVerify(model, cache, new, context=40)
        want = model(new, past_key_values=cache, use_cache=True).logits
        scale = want.abs().max()
        assert (static.forward() - want).abs().max() <= 1e-4 * scale
        assert (static.forward() - want).abs().max() <= 1e-4 * scale  # again: the rows' cache slots are reused
        static.mask[:] = True  # the rows see each other's future: a different computation
        assert (static.forward() - want).abs().max() > 1e-2 * scale


def test_the_step_profile_counts_ops_by_stage_and_finds_ops_outside_them():
    def step():
        x = torch.ones(8)
        with gpu_check.stage("build"):
            y = (x * 2).sum()  # two ops, each with internals that are not counted again
        with gpu_check.stage("walk"):
            y = y + 1
        return torch.stack([y, y])  # outside every stage

    prof = gpu_check.profile_step(step, torch.device("cpu"))
    assert prof["stages"]["build"]["ops"] == 2 and prof["stages"]["walk"]["ops"] == 1
    assert prof["outside_stages"]["ops"] == 2  # ones, stack
    assert prof["ops"] == 5 and prof["kernels"] == 0


def test_one_part_reruns_into_an_earlier_report(report, tmp_path):
    path = tmp_path / "cpu.json"
    earlier = {k: v for k, v in report.items() if k != "_stdout"}
    path.write_text(json.dumps(earlier))
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
           "--site", str(FLASHINFER_DIR), "--only", "c.compaction", "--update", "--json", str(path)]
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO).returncode == 0
    updated = json.loads(path.read_text())
    assert [p["name"] for p in updated["parts"]] == [p["name"] for p in earlier["parts"]] and updated["rerun"] == ["c.compaction"]
    kept = lambda r: [p for p in r["parts"] if p["name"] != "c.compaction"]  # noqa: E731
    assert kept(updated) == kept(earlier)
    # a report of other versions is not updated: the whole check must run
    path.write_text(json.dumps(earlier | {"torch": "0.0"}))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode != 0 and "differs in torch" in done.stderr


def test_the_report_redraws_as_a_png(report, tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({k: v for k, v in report.items() if k != "_stdout"}))
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--plot", str(path)], check=True,
                   capture_output=True, timeout=120)
    assert (tmp_path / "cpu.png").stat().st_size > 10_000


def test_the_checks_catch_a_wrong_mask_and_a_wrong_walk():
    # The references have teeth: a flipped mask bit changes the paged read, a corrupted path is reported.
    reqs = gpu_check.attention_cases(0.1)["mixed"]
    step = gpu_check.paged_step(reqs, torch.float32, torch.device("cpu"), seed=1)
    plan = gpu_check.step_plan(step)
    want = gpu_check.oracle_attention(step)
    assert float((gpu_check.paged_read_like_flashinfer(step, plan) - want).abs().max()) < 1e-4
    tree = next(i for i, r in enumerate(reqs) if r.tree is not None and r.q > 30)
    start = int((torch.tensor([r.q for r in reqs]) * step.seq_lens)[:tree].sum())
    kv = int(step.seq_lens[tree])
    plan.custom_mask[start + 5 * kv + kv - 2] ^= True  # row 5 of the big tree: one tree column flipped
    assert float((gpu_check.paged_read_like_flashinfer(step, plan) - want).abs().max()) > 1e-3

    cpu = torch.device("cpu")
    state, tail = gpu_check.step_state(2, 512, cpu, seed=7)
    x = gpu_check.step_inputs(2, 512, tail, seed=3, dtype=torch.float32, device=cpu)
    out = gpu_check.tree_step(x, state, "plain")
    assert gpu_check.reference_mismatches(x, out, "plain", 512) == []
    out["built_parents"] = out["built_parents"].clone()
    out["built_parents"][0, 3] = -1 if int(out["built_parents"][0, 3]) != -1 else 0
    assert "build_tree != build_tree_reference" in gpu_check.reference_mismatches(x, out, "plain", 512)


def test_the_xqa_plan_reads_as_the_oracle_on_this_step_and_the_next_and_a_wrong_bit_shows():
    # a.xqa's inputs on the CPU: the plan XQA is handed, read as its documentation says, is the oracle's
    # attention, on the step and on `restep`'s next step (what the captured graph replays); a flipped
    # mask bit, or the stale step's plan, is not.
    cases = gpu_check.xqa_cases(0.1)
    assert all(r.kind != "prefill" and r.q <= gpu_check.TOKEN_WIDTH for reqs in cases.values() for r in reqs)
    assert max(r.q for r in cases["trees_across_pages"]) == gpu_check.TOKEN_WIDTH  # the 128-node tree, cut
    step = gpu_check.paged_step(cases["trees_across_pages"], torch.float32, torch.device("cpu"), seed=7)
    plan = gpu_check.step_xqa_plan(step)
    assert float((gpu_check.xqa_read_like(step, plan) - gpu_check.oracle_attention(step)).abs().max()) < 1e-4
    nxt = gpu_check.restep(step, seed=70)
    want = gpu_check.oracle_attention(nxt)
    assert nxt.seq_lens.tolist() != step.seq_lens.tolist() and not torch.equal(nxt.masks.ancestors, step.masks.ancestors)
    assert float((gpu_check.xqa_read_like(nxt, gpu_check.step_xqa_plan(nxt)) - want).abs().max()) < 1e-4
    assert float((gpu_check.xqa_read_like(nxt, plan) - want).abs().max()) > 1e-3
    big = max(range(len(step.reqs)), key=lambda i: step.reqs[i].q)
    row = int(step.qsl[big]) + 5
    plan.mask[row, 0] ^= 1 << 3  # row 5 of the biggest tree: new token 3's bit flipped
    assert float((gpu_check.xqa_read_like(step, plan) - gpu_check.oracle_attention(step)).abs().max()) > 1e-3


class _RecordingGraph:
    """A CUDA graph's contract without CUDA: the XQA call made while capturing is replayed with the same
    tensors, read afresh (what a real graph does with device memory); `stale` replays nothing."""

    captured: list = []
    stale = False

    def replay(self) -> None:
        if not self.stale:
            for args, kwargs in self.captured:
                gpu_check.xqa_read_like(args[0], args[1], kwargs["q"], out=kwargs["out"])


@pytest.mark.parametrize("stale", [False, True])
def test_the_xqa_part_runs_through_with_a_reference_kernel_and_catches_a_graph_that_does_not_replay(
        monkeypatch, stale):
    # a.xqa's own code, end to end on the CPU, so a lent GPU's run is not spent on a slip in it: the kernel
    # is the reference reader, the graph the recording one above. With a graph that replays nothing
    # (the stale output of the capture step) the part must fail.
    import contextlib
    import types

    capturing = []

    def kernel(step, plan, workspace, q=None, out=None):
        if capturing:
            _RecordingGraph.captured.append(((step, plan), {"q": q, "out": out}))
        got = gpu_check.xqa_read_like(step, plan, q, out=out)
        return got if out is not None else got.to(step.q.dtype)  # the kernel's output dtype is the query's

    @contextlib.contextmanager
    def graph(_):
        capturing.append(True)
        yield
        capturing.clear()

    monkeypatch.setattr(_RecordingGraph, "captured", [])
    monkeypatch.setattr(_RecordingGraph, "stale", stale)
    monkeypatch.setattr(gpu_check, "run_xqa", kernel)
    monkeypatch.setattr(gpu_check, "flashinfer_module", lambda: types.SimpleNamespace(__version__="reference"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _RecordingGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    check = gpu_check.Check(torch.device("cpu"), gpu_check.sizes_for("cpu", True), gpu_check.Deadline(600), [])
    got = gpu_check.part_a_xqa(check)
    cases = {k: v for k, v in got["cases"].items() if isinstance(v, dict)}
    assert len(cases) == 8 and all(c["ok"] and c["max_q"] <= gpu_check.TOKEN_WIDTH for c in cases.values()), cases
    assert got["graph"]["ok"] is not stale and got["passed"] is not stale, got["graph"]
    if not stale:
        assert got["graph"]["replay_vs_eager_max_abs_diff"] < 1e-5


def test_the_state_moved_on_between_capture_and_replay_is_what_a_capture_reads():
    """`b.graphs` replays a captured step after `advance_state`: the state it moves (the drafter's
    confidence exponent, the lookup path's acceptance, the cost model's refit, the token history the
    lookup reads) must change, and in the tensors a capture holds, or the replay would not test what
    serving does to a captured step."""
    st, _ = gpu_check.step_state(4, 512, torch.device("cpu"), seed=7)
    beta, coef, history = st.auto.acceptance.beta, st.auto.cost.coefficients("cpu"), st.history.tokens
    before = [t.clone() for t in (beta, coef.slope, coef.intercept, coef.residual, st.auto.lookup.hits, history)]
    gpu_check.advance_state(st, 4, seed=1)
    assert st.auto.acceptance.beta is beta and st.auto.cost.coefficients("cpu") is coef and st.history.tokens is history
    after = (beta, coef.slope, coef.intercept, coef.residual, st.auto.lookup.hits, history)
    moved = [not torch.equal(a, b) for a, b in zip(after, before)]
    assert moved[1] or moved[2], "the cost model did not refit"
    assert moved[3] and moved[4] and moved[5], moved


@pytest.mark.parametrize("requests", [4, 64])
def test_the_proposers_captured_step_replays_equal_to_eager_after_the_state_moves_on(requests):
    """`b.graphs`' rows of the proposer's own captures (`step_graphs_run`), with `make_fx` traces for
    CUDA graphs: the same calls, keys and comparison the GPU runs. At 64 requests the refit's residual
    table covers steps of up to 64 x 65 rows, longer than the cost model's default device buffer."""
    rec = gpu_check.step_graphs_run(requests, 512, torch.device("cpu"), "trace", reps=1 if requests == 4 else 0)
    assert rec["replay_equals_eager"] and not rec["differs"], rec
    assert rec["padding_kept_plans"] and not rec["padding_differs"], rec  # the unpadded step, bit for bit
    assert rec["graphs"] == {"captures": 1, "replays": 1, "failed": None}
    assert rec["capture_requests"] == requests + 1  # captured on more requests than the replay: stale rows
    assert (rec.get("replay_ms", 0) > 0) == (requests == 4)  # the timed replays, as the GPU run times them


@pytest.mark.parametrize("requests", [4, 64])
def test_the_captured_step_rescored_by_n_grams_reads_the_tables_moved_in_place(requests, monkeypatch):
    """`b.graphs`' rows of the proposer's captured step with n-gram rescoring (`StepGraphs+ngram`):
    tables of fixed shape count a step's tokens in place between the capture and the replay, and
    the replay equals the eager step on the moved tables. Negative control: tables made anew at each
    count (the eager engine's) leave the capture reading the old ones, and its trees differ."""
    rec = gpu_check.step_graphs_run(requests, 512, torch.device("cpu"), "trace", reps=1 if requests == 4 else 0,
                                    ngram=True)
    assert rec["replay_equals_eager"] and not rec["differs"] and not rec["padding_differs"], rec
    assert rec["graphs"] == {"captures": 1, "replays": 1, "failed": None}
    fresh = gpu_check.step_state
    monkeypatch.setattr(gpu_check, "step_state", lambda *a, fixed_shape=False, **k: fresh(*a, fixed_shape=False, **k))
    stale = gpu_check.step_graphs_run(requests, 512, torch.device("cpu"), "trace", reps=0, ngram=True)
    assert stale["graphs"]["replays"] == 1 and "tree.tokens" in stale["differs"], stale


@pytest.mark.parametrize("requests", [4, 64])
def test_the_verify_side_s_captured_step_replays_equal_to_eager_over_stale_buffers(requests):
    """`b.graphs`' rows of the verify side's captures (`verify_graphs_run`) with `make_fx` traces: five
    steps of one padded shape, the later ones smaller than an earlier one, walk and counts equal to
    eager; the calibrations agree to float32 rounding."""
    rec = gpu_check.verify_graphs_run(requests, torch.device("cpu"), "trace", reps=1 if requests == 4 else 0)
    assert rec["replay_equals_eager"] and not rec["differs"], rec
    assert rec["graphs"] == {"captures": 1, "replays": 3, "eager_calls": 1, "failed": None}
    assert rec["padded"] == [7 if requests == 4 else 127, 64]
    assert rec["calibration_max_rel_gap"] < 1e-5
    assert (rec.get("replay_ms", 0) > 0) == (requests == 4)


def test_b_graphs_rows_of_the_product_s_captures_record_results_and_failures():
    """`capture_rows`, which writes b.graphs' rows of the proposer's and the verify side's own captures:
    a passing run's record and log line, a capture that differs from eager, and one that raises,
    each in its own row, the failing ones named."""
    from types import SimpleNamespace

    ctx = SimpleNamespace(sizes=SimpleNamespace(batches=(1, 4)), deadline=gpu_check.Deadline(600))
    rows, bad = [], []
    gpu_check.capture_rows(ctx, gpu_check.VERIFY_GRAPHS,
                           lambda r: gpu_check.verify_graphs_run(r, torch.device("cpu"), "trace", reps=1),
                           lambda rec: f"calibration gap {rec['calibration_max_rel_gap']:.1e}", rows, bad)
    assert not bad and [r["batch"] for r in rows] == [1, 4] and all(r["replay_equals_eager"] for r in rows), rows

    def differs(r):
        return {"replay_equals_eager": False, "differs": ["walk"], "graphs": {}, "eager_ms": 1.0, "replay_ms": 0.5}

    def raises(r):
        raise RuntimeError("operation not permitted when stream is capturing")

    gpu_check.capture_rows(ctx, "x", differs, lambda rec: "", rows, bad)
    gpu_check.capture_rows(ctx, "y", raises, lambda rec: "", rows, bad)
    assert bad == ["x@1", "x@4", "y@1", "y@4"]
    assert "operation not permitted" in rows[-1]["error"]


def test_a_cost_model_sized_for_less_than_its_steps_makes_the_capture_stale(monkeypatch):
    """The negative control of the test above: without `max_step_rows` the refit at 64 requests
    replaces the residual's device buffer. The proposer's key then changes (the step runs eagerly,
    nothing replays), and the old capture would have read the replaced buffer (`b.graphs`' direct
    captures: budgets and trees that differ from eager on an H200)."""
    monkeypatch.setattr(gpu_check, "CostModel", lambda shape, profile, max_step_rows: CostModel(shape, profile))
    rec = gpu_check.step_graphs_run(64, 512, torch.device("cpu"), "trace", reps=0)
    assert not rec["replay_equals_eager"] and rec["graphs"]["replays"] == 0, rec


@pytest.mark.parametrize("requests", [4, 64, 256])
def test_the_verify_rows_cut_before_the_forward_replay_equal_to_eager_over_stale_buffers(requests):
    """`b.graphs`' rows of the schedule capture (`schedule_graphs_run`) with `make_fx` traces: five
    steps of one padded shape, the later ones smaller than an earlier one, every field equal to eager."""
    rec = gpu_check.schedule_graphs_run(requests, torch.device("cpu"), "trace", reps=1 if requests == 4 else 0)
    assert rec["replay_equals_eager"] and not rec["differs"], rec
    assert rec["graphs"] == {"captures": 1, "replays": 3, "eager_calls": 1, "failed": None}
    assert rec["padded"] == [{4: 7, 64: 127, 256: 511}[requests], [64]]
    assert (rec.get("replay_ms", 0) > 0) == (requests == 4)
