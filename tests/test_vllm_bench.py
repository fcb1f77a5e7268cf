"""The benchmark use, run from the examples: `vllm bench throughput` with ddtree on random prompts.

Runs ``examples/bench_throughput.sh`` (``vllm bench throughput --model <target> --speculative-config
'{"method": "ddtree", ...}' --dataset-name random``, nothing downloaded) with a handful of prompts and
checks that it finishes, prints its throughput line and JSON, and that the engine ran ddtree (its
speculative config in the engine core's log, and drafts in vLLM's spec-decode metrics lines: the
stats logger, on in `vllm bench throughput`, logs after every step here).
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
NUM_PROMPTS = 4


def test_bench_throughput_with_ddtree(tmp_path, drafter):
    out_json = tmp_path / "bench.json"
    path, _ = drafter
    # VLLM_LOG_STATS_INTERVAL: vLLM logs its stats at most this often (seconds; 10 by default, longer
    # than this run's decoding), so with 0.01 every step with outputs after the first logs them.
    env = vllm_env(PYTHON=sys.executable, DRAFTER=str(path), NUM_PROMPTS=str(NUM_PROMPTS), INPUT_LEN="32",
                   OUTPUT_LEN="32", TREE_BUDGET="8", VLLM_LOG_STATS_INTERVAL="0.01")
    proc = subprocess.Popen(["bash", str(ROOT / "examples" / "bench_throughput.sh"), "--output-json", str(out_json)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"^Throughput: [\d.]+ requests/s, [\d.]+ total tokens/s, [\d.]+ output tokens/s", out, re.M), out[-4000:]
    res = json.loads(out_json.read_text())
    assert res["num_requests"] == NUM_PROMPTS and res["requests_per_second"] > 0, res
    # The engine core unpickled and logged a ddtree config: the plugin registered in that process too.
    assert "speculative_config=SpeculativeConfig(method='ddtree'" in out, out[-4000:]
    # A line is logged for each interval with drafts: 32 output tokens take several tree steps.
    drafted = [int(n) for n in re.findall(r"SpecDecoding metrics: .*Drafted: (\d+) tokens", out)]
    assert drafted and all(n > 0 for n in drafted), out[-4000:]
    # Its per-position acceptance goes as deep as a tree can: tree_budget 8 and the default 8-token
    # lookup branch reach depth 8 (vLLM's num_speculative_tokens, the verify width, is 16).
    rates = re.findall(r"Per-position acceptance rate: ([\d., ]+), Avg", out)
    assert rates and all(len(r.split(", ")) == 8 for r in rates), rates[:3]
