"""What a GPU machine receives for `make gpu-check`, against the 64 MiB one call may carry.

    python benchmarks/gpu_transfer.py [--carry gpu-wheels] [--top 10] [--root REPO]

A device call copies the working tree as git sees it (tracked files, and untracked files that git
does not ignore) plus the ignored folders it is told to carry: here `gpu-wheels/`, FlashInfer and
what it imports (`make gpu-wheels`). Over the limit, the call is refused before anything runs; this
prints the total, the room left and the largest files, and exits 1 when the total is over, so that
`make gpu-wheels` fails where there is time to trim rather than on the GPU machine.

`PINNED_WHEELS` records the size of the wheels `make gpu-wheels` downloads for its pins, so that a
test can keep the tracked tree within what is left without downloading them; run with `--carry`
after `make gpu-wheels`, this checks the record against the folder.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20  # the working tree and carried paths of one device call

#: The Makefile's GPU_PACKAGES (FLASHINFER_VERSION filled in) and the bytes of their CPython 3.12
#: manylinux wheels, as `make gpu-wheels` downloads them (the sum of the files' sizes). A change of pins
#: needs a new record: `make gpu-wheels`, then this script with `--carry gpu-wheels` prints it.
PINNED_WHEELS = {
    "packages": ("flashinfer-python==0.7.0.post1 apache-tvm-ffi==0.1.15.post2 nvidia-ml-py==13.615.71 "
                 "requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3"),
    "bytes": 37_630_263,
}


@dataclass
class Transfer:
    """Bytes a device call would copy: the working tree's files by path, the carried folders'."""

    tree: dict[str, int]  # path relative to the repository root -> bytes
    carried: dict[str, int]  # carried folder -> bytes of the files under it

    @property
    def total(self) -> int:
        return sum(self.tree.values()) + sum(self.carried.values())


def tree_files(root: Path = ROOT, untracked: bool = True) -> dict[str, int]:
    """{path: bytes} of the files git would hand over: tracked ones (and, with `untracked`, those
    git does not ignore); a tracked file deleted from the working tree is not there to copy."""
    args = ["git", "-C", str(root), "ls-files", "-z", "--cached"]
    if untracked:
        args += ["--others", "--exclude-standard"]
    listed = subprocess.run(args, check=True, capture_output=True).stdout.decode().split("\0")
    sizes = {}
    for rel in filter(None, listed):
        path = root / rel
        if path.is_file() and not path.is_symlink():
            sizes[rel] = path.stat().st_size
    return sizes


def folder_bytes(folder: Path) -> int:
    """Bytes of the regular files under `folder`."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def measure(root: Path = ROOT, carry: list[str] | None = None) -> Transfer:
    """The transfer of `root`'s working tree with the folders in `carry` (relative to `root`)."""
    carried = {}
    for rel in carry or []:
        folder = root / rel
        if not folder.is_dir():
            raise FileNotFoundError(f"no folder {folder} to carry (make gpu-wheels makes gpu-wheels/)")
        carried[rel] = folder_bytes(folder)
    return Transfer(tree_files(root), carried)


def makefile_gpu_packages(makefile: Path = ROOT / "Makefile") -> str:
    """The Makefile's GPU_PACKAGES with $(FLASHINFER_VERSION) filled in, spaces normalised."""
    text = makefile.read_text().replace("\\\n", " ")
    values = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":=")
        if sep and name.strip() in ("FLASHINFER_VERSION", "GPU_PACKAGES"):
            values[name.strip()] = " ".join(value.split())
    if "GPU_PACKAGES" not in values:
        raise ValueError(f"{makefile} defines no GPU_PACKAGES")
    return values["GPU_PACKAGES"].replace("$(FLASHINFER_VERSION)", values.get("FLASHINFER_VERSION", ""))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--carry", action="append", default=[], help="an ignored folder the call carries (repeatable)")
    ap.add_argument("--top", type=int, default=10, help="largest files listed (default 10)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = ap.parse_args(argv)
    t = measure(args.root, args.carry)
    tree = sum(t.tree.values())
    print(f"working tree: {len(t.tree)} files, {_mib(tree)}")
    for rel, n in t.carried.items():
        print(f"carried {rel}/: {_mib(n)}")
    room = LIMIT_BYTES - t.total
    print(f"total {_mib(t.total)} of {_mib(LIMIT_BYTES)}: {_mib(room)} left")
    for rel, n in sorted(t.tree.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {n:>11,d}  {rel}")
    status = 0
    if "gpu-wheels" in t.carried:
        packages = makefile_gpu_packages(args.root / "Makefile")
        if (packages, t.carried["gpu-wheels"]) != (PINNED_WHEELS["packages"], PINNED_WHEELS["bytes"]):
            print(f"PINNED_WHEELS in {Path(__file__).name} is out of date; it should read\n"
                  f"    {{'packages': {packages!r}, 'bytes': {t.carried['gpu-wheels']:_}}}", file=sys.stderr)
            status = 1
    if room < 0:
        print(f"over the limit by {_mib(-room)}: a device call would be refused. Trim the largest files "
              "above (or move them out of the tracked tree) before the GPU check.", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
