"""Subprocess helper: start requests, abort them mid-generation, report KV blocks free before/after.

    python abort_requests.py OUT.json SPEC_JSON
"""

import json
import sys

if __name__ == "__main__":
    from vllm import EngineArgs, LLMEngine, SamplingParams

    from vllm_ddtree.models.target import prepare_target

    spec = json.loads(sys.argv[2])
    args = EngineArgs(model=str(prepare_target()), dtype="float32", enforce_eager=True, max_model_len=512,
                      speculative_config=spec)
    engine = LLMEngine.from_engine_args(args)
    pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool  # in-process engine core
    free_at_start = pool.get_num_free_blocks()
    ids = [f"r{i}" for i in range(3)]
    for rid in ids:
        engine.add_request(rid, "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(6):
        engine.step()
    free_mid = pool.get_num_free_blocks()
    engine.abort_request(ids)
    for _ in range(2):
        engine.step()
    with open(sys.argv[1], "w") as f:
        json.dump({"start": free_at_start, "mid": free_mid, "end": pool.get_num_free_blocks(),
                   "unfinished": engine.has_unfinished_requests()}, f)
