"""docs/benchmarks.md is generated from benchmarks/results/: it must match what the generator writes."""

import json
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


def _benchmarks_module(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def test_prefix_agreement_is_the_share_before_the_first_difference():
    prefix_agreement = _benchmarks_module("vllm_e2e").prefix_agreement
    reference = [[1, 2, 3, 4], [5, 6]]
    assert prefix_agreement([reference], reference) == 1.0
    # prompt 0 differs at its third token (2 of 4 agree), prompt 1 at its first (0 of 2)
    assert prefix_agreement([[[1, 2, 9, 4], [7, 6]]], reference) == 0.25
    # an output that stops early agrees up to where it stops; repeats are averaged
    assert prefix_agreement([[[1, 2], [5, 6]], reference], reference) == (0.5 + 1 + 1 + 1) / 4


def test_row_settings_say_when_greedy_outputs_differ():
    row_settings = _benchmarks_module("report").row_settings
    differ = "some greedy outputs differ from no speculation (see the table)"
    assert differ in row_settings([{"identical_to_ar": True}, {"identical_to_ar": False}])  # False is not 0 mismatches
    assert differ in row_settings([{"mismatches_vs_ar": 0}, {"mismatches_vs_ar": 2}])
    assert differ not in row_settings([{"identical_to_ar": True}, {"mismatches_vs_ar": 0}])


def test_serve_load_figures_are_redrawn_from_their_results_with_their_titles(tmp_path):
    # --replot draws a committed study's PNG again from its JSON alone (no server starts); the figure
    # carries the study's own title (dtype, step budget), which two studies on one machine differ by.
    serve_load = _benchmarks_module("serve_load")
    studies = sorted((ROOT / "benchmarks" / "results").glob("serve_load*.json"))
    assert len(studies) >= 2
    titled = []
    for study in studies:
        png = tmp_path / (study.stem + ".png")
        before = study.read_bytes()
        assert serve_load.main(["--json", str(study), "--plot", str(png), "--replot"]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and study.read_bytes() == before
        titled.append(json.loads(before)["meta"]["title"])
    assert len(set(titled)) == len(titled), titled
