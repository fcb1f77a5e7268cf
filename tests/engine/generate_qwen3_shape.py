"""Subprocess helper: greedy generation on the Qwen3-8B-shaped target for several speculative configs.

    python generate_qwen3_shape.py OUT.json TARGET_DIR SPEC_JSON [SPEC_JSON ...]   (SPEC_JSON "none": no speculation)

Writes {"prompts": [...], "outputs": [[token ids per prompt] per spec], "metrics": [spec-decode
counters per spec]}. One prompt goes through the tokenizer's chat template.
"""

import json
import sys

from generate_spec import collect_and_freeze  # same folder: the script's directory is on sys.path

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "1, 2, 3, 4,",
    "Hello",
    "Q: What is 2+2?\nA:",
]
MAX_TOKENS = 32


def counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "value", None) if getattr(m, "value", None) is not None else getattr(m, "values", None)
    return out


if __name__ == "__main__":
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    out_path, target = sys.argv[1], sys.argv[2]
    chat = AutoTokenizer.from_pretrained(target).apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}], tokenize=False, add_generation_prompt=True)
    prompts = PROMPTS + [chat]
    result = {"prompts": prompts, "outputs": [], "metrics": []}
    collect_and_freeze()
    for arg in sys.argv[3:]:
        spec = None if arg == "none" else json.loads(arg)
        llm = LLM(model=target, dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
                  speculative_config=spec, max_num_batched_tokens=256, disable_log_stats=False)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        result["outputs"].append([list(o.outputs[0].token_ids) for o in outs])
        result["metrics"].append(counters(llm))
        del llm
        collect_and_freeze()
    with open(out_path, "w") as f:
        json.dump(result, f)
