"""The online use, run from the examples: `vllm serve` with ddtree, queried with the OpenAI client.

Runs ``examples/serve_and_query.sh`` (which starts ``vllm serve <target> --speculative-config
'{"method": "ddtree", ...}'`` on 127.0.0.1 and a free port, waits for /health, and runs
``examples/openai_client.py``: a chat completion, a text completion with its token ids, the same
completion scored with chosen tokens' logprobs, then with more logprobs than the server allows, the
completion again, a chat in JSON mode and a streamed chat, then reads the server's /metrics). Meanwhile ``examples/offline_generate.py
--baseline`` — the offline use — generates the same completion with and without ddtree in another
process. Checks: non-empty answers, a stream of several chunks, speculation really ran on the server
(spec-decode drafts in /metrics), the scored completion is the same tokens with a logprob per
chosen token, the refused request got HTTP 400 naming the parameter and the server served the next
request alike, the JSON-mode answer is the schema's object, and the greedy
completion's token ids equal offline generation's without speculation.

The drafter is the committed one when present, else a random one in the released format (then
nothing is accepted and only the plumbing is exercised).
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, stop, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT = 900  # s for the whole run; ~3 min on a busy 2-core CPU
PROMPT, MAX_TOKENS = "def fibonacci(n):", 32


def example_env(drafter: Path | None, **extra: str) -> dict:
    """The examples' environment; without a drafter they serve `{"method": "ddtree"}` alone."""
    env = vllm_env(PYTHON=sys.executable, **extra)
    for key in ("DRAFTER", "VLLM_DDTREE_DRAFTER", "TREE_BUDGET", "SPEC_CONFIG"):
        env.pop(key, None)
    return env if drafter is None else env | {"DRAFTER": str(drafter), "VLLM_DDTREE_DRAFTER": str(drafter)}


def test_serve_chat_completion_stream_and_metrics(tmp_path, drafter):
    path, trained = drafter
    client_json, offline_json, log = tmp_path / "client.json", tmp_path / "offline.json", tmp_path / "serve.log"
    # The committed drafter is the drafter table's: the server then runs `{"method": "ddtree"}` and
    # nothing else, as a user starts it (a random drafter must be named, with a fixed budget).
    served = dict(PORT=str(free_port()), LOG=str(log), HEALTH_TIMEOUT=str(TIMEOUT))
    from vllm_ddtree.drafters import TOY_DRAFTER

    table = trained and path.resolve() == TOY_DRAFTER
    serve_env = example_env(None, **served) if table else example_env(path, TREE_BUDGET="8", **served)
    serve = subprocess.Popen(
        ["bash", str(EXAMPLES / "serve_and_query.sh"), "--max-tokens", str(MAX_TOKENS), "--json", str(client_json)],
        env=serve_env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    offline = None
    try:
        # The offline reference runs while the server starts (one engine process: no multiprocessing).
        offline = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "offline_generate.py"), "--baseline", "--tree-budget", "8",
             "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--json", str(offline_json)],
            env=example_env(path, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        start = time.monotonic()
        off_out, _ = offline.communicate(timeout=TIMEOUT)
        out, _ = serve.communicate(timeout=max(TIMEOUT - (time.monotonic() - start), 60))
    finally:
        stop(serve)
        if offline is not None:
            stop(offline)
    server_log = log.read_text()[-4000:] if log.exists() else ""
    assert serve.returncode == 0, out[-4000:] + "\n--- server log ---\n" + server_log
    assert offline.returncode == 0, off_out[-4000:]
    # Start-up speaks of ddtree's choices, not of vLLM's "experimental" block-drop warning it would raise.
    full_log = log.read_text()
    assert "ddtree: the prefix cache keeps each request's trailing block" in full_log
    assert "block dropping is disabled" not in full_log

    res = json.loads(client_json.read_text())
    assert res["chat"].strip() and res["completion"].strip() and res["stream"].strip()
    # Chosen tokens' logprobs at every position: the greedy completion, scored.
    scored = res["scored"]
    assert scored["token_ids"] == res["completion_token_ids"], res
    assert len(scored["top_logprobs"]) == len(scored["token_ids"]), scored
    assert all(2 <= len(pos) <= 3 and all(v <= 0 for v in pos.values()) for pos in scored["top_logprobs"]), scored
    # A request beyond the server's limits: HTTP 400 with the reason, and the engine serves on.
    refused = res["refused"]
    assert refused is not None and refused["status"] == 400, res
    assert "logprobs" in refused["message"] and refused["param"] == "logprobs", refused
    assert res["completion_again_token_ids"] == res["completion_token_ids"], res
    # logit_bias and min_p pass through the server (vLLM refuses them for its own speculative methods)
    assert res["biased_token_ids"] and res["biased_token_ids"][0] != res["completion_token_ids"][0], res
    assert res["min_p_text"], res
    assert res["stream_chunks"] >= 3, res
    # JSON mode through the server: the answer is the schema's object (unless the token limit cut it).
    if res["json_finish_reason"] == "stop":
        answer = json.loads(res["json_answer"])
        assert set(answer) == {"color", "hex"} and re.fullmatch(r"#[0-9a-f]{6}", answer["hex"]), answer
    else:
        assert res["json_answer"].lstrip().startswith("{"), res
    metrics = res["metrics"]
    assert metrics.get("vllm:spec_decode_num_drafts", 0) > 0, metrics  # speculation really ran
    # Accepted tokens per position in the server's /metrics, per tree depth: the drafter's 15 under the
    # defaults, 8 with tree_budget 8 (vLLM's num_speculative_tokens would be 72 and 16).
    per_position = res["accepted_per_position"]
    assert len(per_position) == (15 if table else 8) and sum(per_position) == metrics.get(
        "vllm:spec_decode_num_accepted_tokens", 0), per_position
    if trained:
        assert metrics.get("vllm:spec_decode_num_accepted_tokens", 0) > 0, metrics

    ref = json.loads(offline_json.read_text())
    assert ref["identical"], ref  # offline: ddtree greedy == no speculation, token ids
    assert ref["output_token_ids"] == ref["baseline_token_ids"] and ref["baseline_token_ids"][0]
    assert ref["metrics"].get("vllm:spec_decode_num_drafts", 0) > 0, ref
    # Served greedy == offline without speculation, token for token (text can coincide where ids do not).
    assert res["completion_token_ids"] == ref["baseline_token_ids"][0], (res["completion_token_ids"], ref)
