"""ddtree's largest step runs inside vLLM's memory profile (vllm_patches P20): the profile's shapes are
the largest a step can have, and no real step exceeds them."""

import json

import pytest
from conftest import run_helper, vllm_env

from vllm_ddtree.verify import largest_verify_step, profile_step_enabled


def test_the_largest_verify_step_is_bound_by_the_step_tokens_or_the_requests():
    # 256 step tokens, 17 rows a request: 15 whole trees and a 1-row prefix of a 16th
    assert largest_verify_step(256, 32, 16) == (256, 16)
    # few requests: each with its whole tree, the step's tokens to spare
    assert largest_verify_step(8192, 4, 72) == (4 * 73, 4)
    # exactly whole trees
    assert largest_verify_step(146, 8, 72) == (146, 2)
    # a verify width of 0 (no tree yet): one row per request
    assert largest_verify_step(256, 32, 0) == (32, 32)


def test_the_profile_step_runs_where_the_kv_cache_is_profiled(monkeypatch):
    monkeypatch.delenv("VLLM_DDTREE_PROFILE_STEP", raising=False)
    assert profile_step_enabled(is_cpu=False) and not profile_step_enabled(is_cpu=True)
    monkeypatch.setenv("VLLM_DDTREE_PROFILE_STEP", "1")
    assert profile_step_enabled(is_cpu=True)
    monkeypatch.setenv("VLLM_DDTREE_PROFILE_STEP", "0")
    assert not profile_step_enabled(is_cpu=False)
    monkeypatch.setenv("VLLM_DDTREE_PROFILE_STEP", "yes")
    with pytest.raises(ValueError, match="auto .*, 0 or 1"):
        profile_step_enabled(is_cpu=False)


HELPER = r'''
import json
import os
from vllm import LLM, SamplingParams
from vllm_ddtree.models.target import prepare_target
import vllm_ddtree.proposer as proposer_module
import vllm_ddtree.verify as verify_module

os.environ.pop("VLLM_DDTREE_PROFILE_STEP", None)
calls = {"sample": [], "head": []}
sample_rows, head_topk = verify_module.sample_rows, proposer_module.head_topk


def sample_spy(logits, rows, md, batch, counts, **kw):  # the real sampler, its shapes recorded
    calls["sample"].append([logits.shape[0], bool(md.all_greedy), len(counts), max(counts)])
    return sample_rows(logits, rows, md, batch, counts, **kw)


def head_spy(hidden, head, vocab, k, *args, **kw):  # the real head top-k, its shapes recorded
    calls["head"].append([hidden.shape[0], k])
    return head_topk(hidden, head, vocab, k, *args, **kw)


verify_module.sample_rows, proposer_module.head_topk = sample_spy, head_spy
llm = LLM(model=str(prepare_target()), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
          max_num_seqs=32, max_num_batched_tokens=256,
          speculative_config={"method": "ddtree", "tree_budget": 8, "prompt_lookup_tokens": 8})
runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
runner.profile_run()  # on a CPU: no tree step (its KV cache is not profiled)
skipped = not hasattr(runner, "_ddtree_profiled") and not calls["sample"] and not calls["head"]
os.environ["VLLM_DDTREE_PROFILE_STEP"] = "1"
runner.profile_run()  # as vLLM's GPU worker runs it to size the KV cache
out = {"skipped_on_cpu": skipped, "profiled": vars(runner._ddtree_profiled),
       "profile_calls": {k: list(v) for k, v in calls.items()}}
calls["sample"].clear(), calls["head"].clear()
prompts = [f"def f{i}(x):" for i in range(16)]
llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24))
out["step_calls"] = calls
print("RESULT " + json.dumps(out))
'''


@pytest.mark.vllm
@pytest.mark.slow
def test_the_profile_runs_the_largest_tree_step_and_serving_stays_within_it(tmp_path):
    """A fixed budget of 8 with an 8-token lookup branch (verify width 16: 17 rows a request), 256 step
    tokens and 32 sequences: vLLM's profile run samples 256 verify rows (15 trees and one root) with
    top-k and top-p, and the drafter head's top-8 over 8 depths of the 16 requests whose 16 query rows
    fit; a sampled batch of 16 requests then runs no larger sampling step or head. By default a CPU
    engine's profile run leaves the tree step out."""
    script = tmp_path / "run.py"
    script.write_text(HELPER)
    proc = run_helper(script, env=vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), timeout=900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    res = json.loads(line[0][len("RESULT "):])
    assert res["skipped_on_cpu"]
    width, drafter_width = 8 + 8, 15
    rows, requests = min(256, 32 * (1 + width)), -(-min(256, 32 * (1 + width)) // (1 + width))
    head_requests = min(32, 256 // (1 + drafter_width))
    assert res["profiled"] == {"verify_rows": rows, "verify_requests": requests,
                               "draft_rows": head_requests * min(drafter_width, 8), "draft_top_k": 8}
    # The profile ran the tree sampler itself, sampled (not greedy), over every row in whole requests
    assert res["profile_calls"]["sample"] == [[256, False, 16, 17]]
    assert res["profile_calls"]["head"] == [[128, 8]]
    steps = res["step_calls"]
    tree_steps = [c for c in steps["sample"] if c[3] > 1]
    assert tree_steps and steps["head"], "the batch never verified a tree"
    assert max(c[0] for c in steps["sample"]) <= res["profiled"]["verify_rows"]
    assert max(c[0] for c in steps["head"]) <= res["profiled"]["draft_rows"]
    assert max(c[1] for c in steps["head"]) <= res["profiled"]["draft_top_k"]
