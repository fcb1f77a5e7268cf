"""Two `vllm serve` processes under a mixed streamed load: no request lost, no 5xx, greedy output exact.

Runs ``benchmarks/serve_load.py --quick`` (a server without speculation and one with
``{"method": "ddtree"}`` at its defaults; 16 chat and completion requests at 8 streams, with shared
long prefixes, chunked prefill, prompts that run into max-model-len, too-long prompts, stop strings
and streams closed mid-way; then greedy completions at 1 and 8 streams) and checks what it records.
No timing is asserted: the benchmark's figures move with the machine's load.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 1200  # s; about 3 min on an idle 2-core CPU, longer while other engines run


def test_serve_load_quick(tmp_path):
    out = tmp_path / "serve_load.json"
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--quick", "--json", str(out)],
                            env=vllm_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the benchmark then stops both servers' process groups
        log, _ = proc.communicate(timeout=120)
        pytest.fail("serve_load.py --quick did not finish in time:\n" + log[-4000:])
    assert out.exists(), log[-4000:]
    res = json.loads(out.read_text())
    for name in ("base", "ddtree"):
        s = res["servers"][name]
        assert s["lost"] == 0 and s["server_errors"] == 0, (name, s, res["failures"])
        # The too-long prompts, and only they, were refused with a 4xx.
        assert s["too_long"] >= 2 and s["too_long_refused"] == s["too_long"], (name, s)
        assert s["client_errors"] == s["too_long"] and s["unexpected_client_errors"] == 0, (name, res["failures"])
        assert s["completed"] + s["cancelled"] + s["client_errors"] == s["requests"], (name, s)
        assert s["cancelled"] > 0, (name, s)  # streams closed mid-way were really closed before the end
        assert s["healthy_after"] and s["healthy_at_end"], (name, s)
        assert s["running_after"] == 0 and s["waiting_after"] == 0 and s["kv_usage_after"] == 0, (name, s)
        assert s["prefix_cache_hits"] > 0, (name, s)
    dd = res["servers"]["ddtree"]
    assert dd.get("mean_acceptance_length", 0) > 1, dd  # speculation ran on the ddtree server, and was accepted
    assert dd["greedy_compared"] > 0 and dd["greedy_mismatches"] == 0, res["greedy_mismatch_details"]
    assert [r["streams"] for r in res["by_streams"]] == [1, 8], res["by_streams"]
    for row in res["by_streams"]:
        assert row["greedy_mismatches"] == 0 and row["not_completed_base"] == row["not_completed_ddtree"] == 0, row
    assert all(res["checks"].values()), res["checks"]
    assert proc.returncode == 0, log[-4000:]
