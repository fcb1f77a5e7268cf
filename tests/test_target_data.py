"""Target preparation (PyPI GGUF → float32 safetensors) and HumanEval helpers."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval
from vllm_ddtree.models import target as target_module
from vllm_ddtree.models.target import MARKER, prepare_target


@pytest.fixture(scope="module")
def target_dir():
    return prepare_target()


def test_prepare_target_is_idempotent_and_plain_float32(target_dir):
    assert (target_dir / MARKER).exists()
    assert prepare_target() == target_dir  # second call returns at once (marker)
    cfg = json.loads((target_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["dtype"] == "float32" and "quantization_config" not in cfg
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152
    assert (target_dir / "model.safetensors").exists() and (target_dir / "tokenizer.json").exists()


def test_processes_that_prepare_the_target_at_once_convert_it_once(tmp_path, monkeypatch):
    # Four callers on an empty cache (as test workers or servers started together): one converts, the
    # others wait on the cache's lock and then find the marker. The conversion is slow on purpose, so
    # callers arrive while it runs; it writes the marker last, as the real one does.
    calls, inside, most_inside = [], [0], [0]

    def slow_convert(out):
        inside[0] += 1
        most_inside[0] = max(most_inside[0], inside[0])
        calls.append(out)
        time.sleep(0.5)
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text("test\n")
        inside[0] -= 1

    monkeypatch.setattr(target_module, "_convert", slow_convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(prepare_target(tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and most_inside[0] == 1, (calls, most_inside)
    assert got == [target_module.target_dir(tmp_path)] * 4


@pytest.mark.slow
def test_target_completes_code_coherently(target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    text = chat_prompt(tok, "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n")
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    reply = tok.decode(out[0, ids.shape[1]:])
    assert "def add(a, b)" in reply and "return" in reply


def test_humaneval_loader_and_chat_prompt(target_dir):
    from transformers import AutoTokenizer

    probs = load_humaneval()
    assert len(probs) == 164 and probs[0]["task_id"] == "HumanEval/0"
    assert len(load_humaneval(5)) == 5
    tok = AutoTokenizer.from_pretrained(target_dir)
    text = chat_prompt(tok, probs[0]["prompt"])
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert probs[0]["prompt"].strip() in text
