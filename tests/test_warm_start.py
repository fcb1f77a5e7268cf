"""`conftest.run_helper` runs an engine helper in a child of a process that has imported vLLM: the helper
must see what `python helper.py args...` in a fresh process would (arguments, environment, working
directory, exit status, output), and a helper that hangs must end with the timeout, as subprocess.run's."""

import os
import signal
import subprocess

import pytest
from conftest import run_helper, vllm_env

pytestmark = [pytest.mark.vllm]

SCRIPT = """
import json, os, sys
import torch
import vllm  # already imported in the warm process
a = torch.randn(512, 512)
a @ a  # Intel OpenMP sets its threads' affinity as it starts them
print(json.dumps({"cores": sorted(os.sched_getaffinity(0)),
                  "argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "main": __name__,
                  "job": os.environ.get("WARM_START_JOB"), "parent_only": os.environ.get("WARM_START_PARENT_ONLY"),
                  "inductor_threads": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")}))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "abort":
    os.abort()
if sys.argv[1] == "hang":
    import time
    time.sleep(600)
if sys.argv[1] == "raise":
    raise ValueError("from the helper")
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "helper.py"
    path.write_text(SCRIPT)
    return path


def warm_env(**extra: str) -> dict:
    return vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", **extra)


def test_a_warm_run_sees_what_a_fresh_process_sees(script, tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DDTREE_TESTS_FRESH_PROCESSES", raising=False)
    warm = run_helper(script, "3", "a b", env=warm_env(WARM_START_JOB="x"), timeout=300)
    monkeypatch.setenv("DDTREE_TESTS_FRESH_PROCESSES", "1")
    fresh = run_helper(script, "3", "a b", env=warm_env(WARM_START_JOB="x"), timeout=300)
    assert warm.returncode == fresh.returncode == 3, (warm.stderr[-2000:], fresh.stderr[-2000:])
    assert json.loads(warm.stdout) == json.loads(fresh.stdout) == {
        "cores": sorted(os.sched_getaffinity(0)),  # (forked, Intel OpenMP once bound them to the first core)
        "argv": ["3", "a b"], "cwd": str(tmp_path), "path0": str(script.parent), "main": "__main__", "job": "x",
        "parent_only": None, "inductor_threads": "1"}  # (vLLM's env_override sets the last on import)
    assert warm.stderr.splitlines()[-1] == "to stderr"


def test_a_variable_of_the_warm_process_the_job_lacks_is_unset(script, monkeypatch):
    import json

    import conftest

    monkeypatch.delenv("DDTREE_TESTS_FRESH_PROCESSES", raising=False)
    monkeypatch.setattr(conftest, "_warm_start", conftest._WarmStart())  # a warm process started with it set
    monkeypatch.setenv("WARM_START_PARENT_ONLY", "1")
    first = run_helper(script, "0", env=warm_env(), timeout=300)
    assert json.loads(first.stdout)["parent_only"] == "1"
    second = run_helper(script, "0", env={k: v for k, v in warm_env().items() if k != "WARM_START_PARENT_ONLY"},
                        timeout=300)
    assert json.loads(second.stdout)["parent_only"] is None


def test_signals_exceptions_and_timeouts_end_a_warm_run_as_a_fresh_process(script, monkeypatch):
    monkeypatch.delenv("DDTREE_TESTS_FRESH_PROCESSES", raising=False)
    assert run_helper(script, "abort", env=warm_env(), timeout=300).returncode == -signal.SIGABRT
    raised = run_helper(script, "raise", env=warm_env(), timeout=300)
    assert raised.returncode == 1 and "ValueError: from the helper" in raised.stderr
    with pytest.raises(subprocess.TimeoutExpired) as hung:
        run_helper(script, "hang", env=warm_env(), timeout=5)
    assert "to stderr" in hung.value.stderr
    assert run_helper(script, "0", env=warm_env(), timeout=300).returncode == 0  # the warm process goes on
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0"  # nothing leaked into the test process
