"""The repository speaks of the project, not of how it was developed; README stays short; LICENSE ships.

Tracked text files must not mention numbered development periods, tracker numbers, private planning
notes or an unnamed "current" machine: a reader has only the repository, so a figure that depends
on hardware names the hardware. Fast, no vLLM.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Built from pieces so that this file does not match its own pattern.
_WORDS = [
    r"\b" + "sess" + r"ions? [0-9]+",
    r"\b" + "sess" + r"ion-[0-9]+",
    r"\b" + "iss" + r"ue #?[0-9]+",
    "design" + " notes",
    "this" + " machine",
    "work" + " period",
]
DEVELOPMENT_PROCESS = re.compile("|".join(f"(?:{w})" for w in _WORDS), re.IGNORECASE)

#: Not text, whatever their content: images and weights.
SKIPPED_SUFFIXES = (".png", ".safetensors", ".pt")

README_MAX_BYTES = 12_000


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no tracked-file list")
    return [ROOT / name for name in out.decode().split("\0") if name]


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary file (NUL bytes or not UTF-8) or one missing on disk."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_tracked_file_speaks_of_how_the_project_was_developed():
    hits = []
    for path in _tracked_files():
        if path.name.endswith(SKIPPED_SUFFIXES):
            continue
        text = _text(path)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            m = DEVELOPMENT_PROCESS.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {m.group(0)!r}: {line.strip()[:120]}")
    assert not hits, f"{len(hits)} development-process mention(s):\n" + "\n".join(hits)


def test_readme_is_short():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; keep it to {README_MAX_BYTES} (details go in docs/)"


def test_license_ships():
    license_file = ROOT / "LICENSE"
    assert license_file.is_file(), "LICENSE is missing (pyproject declares Apache-2.0)"
    assert "Apache License" in license_file.read_text()[:200]
