"""Guards that keep HumanEval out of the drafter's training data.

Two signals: a HumanEval function signature (its ``def entry_point(...)`` line from the prompt,
whitespace-normalised) in a training text, and any
``n``-word window (whitespace-split, default 10 words) of a canonical solution appearing in a
training text (solutions shorter than ``n`` words but at least ``min_words`` are matched whole).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable


@dataclass
class Leak:
    """One training text that matches a HumanEval problem."""

    index: int
    task_id: str
    kind: str  # "signature" | "solution-ngram"


def _words(s: str) -> list[str]:
    return s.split()


def solution_ngrams(problems: list[dict], n: int = 10, min_words: int = 6) -> dict[str, str]:
    """Map each n-word window (joined by spaces) of each canonical solution to its task id."""
    grams: dict[str, str] = {}
    for p in problems:
        w = _words(p["canonical_solution"])
        if len(w) < n:
            if len(w) >= min_words:
                grams[" ".join(w)] = p["task_id"]
            continue
        for i in range(len(w) - n + 1):
            grams[" ".join(w[i : i + n])] = p["task_id"]
    return grams


def signatures(problems: list[dict]) -> dict[str, str]:
    """task id → whitespace-normalised ``def <entry_point>(...)`` line of its prompt."""
    out = {}
    for p in problems:
        for line in p["prompt"].splitlines():
            if re.match(r"\s*def\s+" + re.escape(p["entry_point"]) + r"\s*\(", line):
                out[p["task_id"]] = " ".join(line.split())
                break
    return out


def find_leaks(texts: Iterable[str], problems: list[dict], n: int = 10, min_words: int = 6) -> list[Leak]:
    """All (text index, task) pairs where a HumanEval signature or solution n-gram occurs."""
    sig = signatures(problems)
    grams = solution_ngrams(problems, n, min_words)
    sizes = sorted({len(g.split()) for g in grams})
    leaks: list[Leak] = []
    for idx, text in enumerate(texts):
        w = _words(text)
        flat = " ".join(w)
        for tid, line in sig.items():
            if line in flat:
                leaks.append(Leak(idx, tid, "signature"))
        hit: set[str] = set()
        for k in sizes:
            for i in range(len(w) - k + 1):
                t = grams.get(" ".join(w[i : i + k]))
                if t is not None and t not in hit:
                    hit.add(t)
                    leaks.append(Leak(idx, t, "solution-ngram"))
    return leaks
