"""`make demo`'s program (`python -m vllm_ddtree.demo`) on a small setting: it runs its three engines side
by side, finds every greedy output equal to the target alone's, and reports each engine's own tau.

With the engines alive together, vLLM's process-wide metrics registry holds only the last-started
engine's counters; a tau read from there gave ddtree 1.00 while the chain's was right. The table must
give the target alone 1.00 and each speculative engine its own.
"""

import re
import subprocess
import sys

import pytest
from conftest import threads_per_worker, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

METHODS = ("ddtree (defaults)", "target alone", "dflash chain")
# a table row: the method, then tau, tok/s and the ratio to the target alone, one at a time and as a batch
ROW = re.compile(r"^(" + "|".join(re.escape(m) for m in METHODS) + r")" + r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x" * 2,
                 re.MULTILINE)


def test_demo_runs_its_engines_side_by_side_and_reports_each_engine_s_tau(drafter):
    _, trained = drafter
    proc = subprocess.run([sys.executable, "-m", "vllm_ddtree.demo", "--prompts", "2", "--max-new-tokens", "24",
                           "--repeats", "2", "--threads", str(threads_per_worker())],
                          env=vllm_env(), capture_output=True, text=True, timeout=1200)
    out = proc.stdout
    assert proc.returncode == 0, (out[-3000:], proc.stderr[-3000:])
    assert "token-identical to the target alone (every method, both ways, every repeat): yes" in out, out[-3000:]
    rows = {m.group(1): [float(x) for x in m.groups()[1:]] for m in ROW.finditer(out)}
    assert set(rows) == set(METHODS), out[-3000:]
    # (tau, tok/s, ratio) one at a time, then as a batch
    assert rows["target alone"][0] == rows["target alone"][3] == 1.0
    for name in ("ddtree (defaults)", "dflash chain"):
        assert all(v > 0 for v in rows[name]), (name, rows[name])
        if trained:  # the committed drafter's drafts are accepted: each engine counted its own
            assert rows[name][0] > 1 and rows[name][3] > 1, (name, rows[name])
    assert re.search(r"ddtree \(defaults\) vs dflash chain, one at a time: [\d.]+x", out), out[-3000:]
    # the demo says how often ddtree's speculation gate let a step draft, each way of sending
    gate_line = r"^ddtree \(defaults\), (.+?): the speculation gate let (\d+) of the \d+ steps it decided draft"
    gate = dict(re.findall(gate_line, out, re.M))
    assert set(gate) == {"one at a time", "batch of 2"}, out[-3000:]
    if trained:
        assert int(gate["one at a time"]) > 0, out[-3000:]
