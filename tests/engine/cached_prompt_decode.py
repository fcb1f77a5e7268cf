"""Subprocess helper: a prompt cached but for its last token starts decoding (in-process engine).

    python cached_prompt_decode.py OUT.json SPEC_JSON [SPEC_JSON ...]

Per spec ("none": no speculation) one engine with 32-token blocks, prefix caching and a step token
budget of 48 (below 1 + ddtree's default verify width, 73): a 65-token prompt generates 16 greedy
tokens, then the same prompt runs again, alone: its first 64 tokens come from the prefix cache, so
it enters its first step with one token to compute. Writes {"outputs": [per spec: [first, again]],
"cached": [per spec: prompt tokens the second run read from the cache]}.
"""

import argparse
import json

from generate_spec import collect_and_freeze  # same folder: the script's directory is on sys.path

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.models.target import prepare_target

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("specs", nargs="+")
    args = ap.parse_args()
    result = {"outputs": [], "cached": []}
    collect_and_freeze()
    for arg in args.specs:
        llm = LLM(model=str(prepare_target()), speculative_config=None if arg == "none" else json.loads(arg),
                  dtype="float32", max_model_len=256, enforce_eager=True, seed=0, block_size=32,
                  max_num_batched_tokens=48, enable_prefix_caching=True)
        ids = llm.get_tokenizer()("def fibonacci(n):\n    # the n-th Fibonacci number, iteratively. " * 4)["input_ids"]
        prompt = TokensPrompt(prompt_token_ids=ids[:65])
        greedy = SamplingParams(temperature=0, max_tokens=16)
        first = llm.generate([prompt], greedy, use_tqdm=False)[0]
        again = llm.generate([prompt], greedy, use_tqdm=False)[0]
        result["outputs"].append([list(first.outputs[0].token_ids), list(again.outputs[0].token_ids)])
        result["cached"].append(again.num_cached_tokens)
        del llm
        collect_and_freeze()
    with open(args.out, "w") as f:
        json.dump(result, f)
