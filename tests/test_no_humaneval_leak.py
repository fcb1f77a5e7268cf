"""No HumanEval prompt or canonical solution may enter the drafter's training data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_ddtree.data.humaneval import load_humaneval
from vllm_ddtree.train.contamination import find_leaks
from vllm_ddtree.train.prompts import stdlib_prompts

ROOT = Path(__file__).resolve().parents[1]


def test_detector_catches_planted_leaks():
    probs = load_humaneval(20)
    long_sol = next(p for p in probs if len(p["canonical_solution"].split()) >= 15)
    clean = "def add_numbers(a, b):\n    return a + b\n"
    planted_sig = "```python\n" + probs[1]["prompt"] + "```"
    planted_sol = "Here it is:\n" + long_sol["canonical_solution"]
    leaks = find_leaks([clean, planted_sig, planted_sol], probs)
    assert {(l.index, l.task_id) for l in leaks} >= {(1, probs[1]["task_id"]), (2, long_sol["task_id"])}
    assert not [l for l in leaks if l.index == 0]


def test_training_prompts_have_no_humaneval_signature_or_solution():
    probs = load_humaneval()
    prompts = stdlib_prompts()
    assert len(prompts) > 1000
    assert find_leaks(prompts, probs) == []


def test_committed_training_manifest_is_clean():
    """The trained checkpoint ships the leak check it ran over its decoded training texts."""
    manifest = ROOT / "checkpoints" / "smollm2-dflash" / "data_manifest.json"
    if not manifest.exists():
        pytest.skip("no trained checkpoint committed yet")
    m = json.loads(manifest.read_text())
    assert m["leak_check"]["leaks_in_training_data"] == 0
    assert m["leak_check"]["texts_checked"] == m["train_sequences"]
