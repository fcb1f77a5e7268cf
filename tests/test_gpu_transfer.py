"""What travels to a GPU machine for `make gpu-check` stays within the 64 MiB a device call carries."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_transfer  # noqa: E402


def test_the_recorded_wheel_bytes_are_for_the_makefile_s_pins():
    # A pin changed without a new record would let the next test pass on the old wheels' size.
    assert gpu_transfer.makefile_gpu_packages() == gpu_transfer.PINNED_WHEELS["packages"]


def test_the_tracked_tree_leaves_room_for_the_gpu_wheels():
    tree = gpu_transfer.tree_files(ROOT, untracked=False)
    total = sum(tree.values()) + gpu_transfer.PINNED_WHEELS["bytes"]
    largest = sorted(tree.items(), key=lambda kv: -kv[1])[:5]
    assert total <= gpu_transfer.LIMIT_BYTES, (
        f"tracked tree + gpu-wheels = {total:,d} bytes, over {gpu_transfer.LIMIT_BYTES:,d}: a GPU check's device call "
        f"would be refused; largest tracked files: {largest}")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_untracked_files_count_ignored_ones_do_not_and_over_the_limit_fails(tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("/ignored/\n")
    (repo / "tracked.txt").write_bytes(b"x" * 1000)
    _git(repo, "add", ".gitignore", "tracked.txt")
    (repo / "untracked.txt").write_bytes(b"y" * 300)
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_bytes(b"z" * 5000)
    t = gpu_transfer.measure(repo)
    assert t.tree == {".gitignore": 10, "tracked.txt": 1000, "untracked.txt": 300}
    assert gpu_transfer.tree_files(repo, untracked=False) == {".gitignore": 10, "tracked.txt": 1000}
    # a carried folder counts although git ignores it
    assert gpu_transfer.measure(repo, ["ignored"]).total == 1310 + 5000
    assert gpu_transfer.main(["--root", str(repo)]) == 0
    # an untracked file one byte past the limit (sparse: it takes no disk)
    with open(repo / "large.bin", "wb") as f:
        f.truncate(gpu_transfer.LIMIT_BYTES - 1310 + 1)
    assert gpu_transfer.main(["--root", str(repo)]) == 1
    err = capsys.readouterr().err
    assert "over the limit" in err and "refused" in err
