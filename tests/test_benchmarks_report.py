"""docs/benchmarks.md is generated from benchmarks/results/: it must match what the generator writes."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmarks_doc_matches_the_result_files():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr + "\nregenerate with: python benchmarks/report.py"


def test_every_result_file_is_described():
    """A result file with neither a meta block nor a studies.json entry lands under 'Other results'."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "## Other results" not in text and "## Described but absent" not in text
