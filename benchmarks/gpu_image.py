"""A bare GPU image's Python packages, emulated on a CPU machine: which carried wheels the GPU check needs.

The GPU check (`benchmarks/gpu_check.py`) runs on a CUDA machine that has PyTorch and transformers
but no vLLM and no network, with FlashInfer and what it imports carried as wheels (`make gpu-wheels`).
Whether that set is complete can be checked without a GPU: build a folder of links to the venv's
packages that a bare PyTorch + transformers image has (the two and everything they require,
read from the installed metadata), run Python without its site-packages and with that folder, the
carried packages and the repository on the path, and import what the check imports. vLLM, and
anything else only this venv has, is then not importable.

    python benchmarks/gpu_image.py --site DIR [--keep NAME ...] -- CMD...   # run CMD in that environment
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

#: What the bare image is built from: PyTorch, transformers and their requirements.
IMAGE_ROOTS = ("torch", "transformers")


def _norm(name: str) -> str:
    """A distribution's canonical name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(roots: tuple[str, ...] | list[str]) -> set[str]:
    """Canonical names of the installed distributions `roots` require, transitively (extras left out)."""
    seen: set[str] = set()
    todo = [_norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # required but not installed here (another platform's marker): the image lacks it too
        seen.add(name)
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            todo.append(_norm(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0]))
    return seen


def _top_level_entries(dist: metadata.Distribution) -> set[str]:
    """First path components of a distribution's installed files (packages, modules, its dist-info)."""
    return {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}


def build_bare_site(dest: Path, keep: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Link into `dest` the venv's files of the image's distributions (and of `keep`); return their names."""
    names = requirement_closure(list(IMAGE_ROOTS) + list(keep))
    dest.mkdir(parents=True, exist_ok=True)
    for dist in metadata.distributions():
        if _norm(dist.metadata["Name"]) not in names:
            continue
        base = Path(dist.locate_file(""))
        for entry in _top_level_entries(dist):
            src, link = base / entry, dest / entry
            if src.exists() and not link.exists() and entry not in ("bin", "__pycache__"):
                link.symlink_to(src)
    return sorted(names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", action="append", default=[], help="a carried --target folder to put on the path")
    ap.add_argument("--keep", action="append", default=[], help="one more distribution the image is given")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command (python scripts run without site)")
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give a command after --")
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="bare-image-") as tmp:
        names = build_bare_site(Path(tmp), args.keep)
        print(f"bare image: {len(names)} distributions ({', '.join(IMAGE_ROOTS)} and their requirements)", flush=True)
        path = [str(Path(s).resolve()) for s in args.site] + [tmp, str(repo)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        if cmd[0] in ("python", "python3"):
            cmd = [sys.executable, "-S", *cmd[1:]]  # -S: no site-packages, so only the path above
        sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
