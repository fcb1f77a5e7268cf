"""Static compatibility check of a vLLM release against every runtime patch vllm-ddtree applies.

vllm-ddtree wraps and subclasses private vLLM code (:mod:`vllm_ddtree.vllm_patches`, P0–P21, and the
classes and helpers the tree proposer, sampler and attention backends build on). A vLLM release is
safe to patch only where that code is what the patches were written against: vLLM 0.32.0.

This module reads a release's Python sources — an installed ``vllm`` package, a site-packages folder,
or a wheel (a zip: nothing is installed or imported, no GPU needed) — finds each target with
:mod:`ast` and compares its normalised source (``ast.unparse`` without docstrings, so formatting and
comments do not count) with a fingerprint of vLLM 0.32.0's, committed in
``vllm_ddtree/vllm_0.32.0_targets.json``. Command line::

    python -m vllm_ddtree.compat VLLM_WHEEL_OR_SITE_PACKAGES [--json REPORT.json] [--markdown REPORT.md]
        [--reference OTHER_VLLM]   # compare against another tree and show diffs
    python -m vllm_ddtree.compat --write-reference VLLM_0_32_0   # regenerate the fingerprint file

The plugin runs the same check at start-up on any vLLM other than 0.32.0 (:func:`check_installed`):
where every target is unchanged it patches with a warning that the version was checked statically,
not run; where any changed or is missing it patches nothing and says which. Its report is cached per
installed vLLM, so only the first process after an install pays for reading the files.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import os
import re
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

#: The vLLM version the patches were written against and run with.
REFERENCE_VERSION = "0.32.0"
REFERENCE_FILE = Path(__file__).with_name(f"vllm_{REFERENCE_VERSION}_targets.json")


@dataclass(frozen=True)
class Target:
    """One piece of vLLM source a patch depends on."""

    patch: str  # "P3", or "engine" / "attention" for code our classes subclass or call
    file: str  # path inside the vllm package, e.g. "config/speculative.py"
    name: str  # "SpeculativeConfig.__post_init__", "SpeculativeMethod", "SpeculativeConfig:fields"
    why: str


def _t(patch: str, file: str, names: str, why: str) -> list[Target]:
    return [Target(patch, file, n.strip(), why) for n in names.split(",")]


#: Every target, grouped by the patch that needs it (see vllm_patches' docstring for P0–P21).
TARGETS: tuple[Target, ...] = tuple(
    _t("P1", "config/speculative.py", "SpeculativeMethod, SpeculativeConfig:fields",
       "the method Literal widened with 'ddtree'; the dataclass a 'ddtree' field is added to")
    + _t("P2", "config/speculative.py", "SpeculativeConfig:fields",
         "top-level ddtree keys are moved out before pydantic's extra='forbid' sees them")
    + _t("P3", "config/speculative.py", "SpeculativeConfig.__post_init__",
         "run as method 'dflash' to build the drafter config, then restored")
    + _t("P4", "config/speculative.py", "SpeculativeConfig.use_eagle, SpeculativeConfig.use_dflash",
         "answer True for ddtree")
    + _t("P5", "config/speculative.py", "SpeculativeConfig.max_num_new_slots_for_drafting",
         "the drafter width for ddtree")
    + _t("P6", "config/vllm.py", "VllmConfig.num_lookahead_tokens", "KV slots for the drafter's block, W + 1")
    + _t("P6b", "config/vllm.py", "VllmConfig.use_v2_model_runner, VllmConfig._get_v2_model_runner_unsupported_features",
         "ddtree always runs on the V1 runner P10-P13 patch")
    + _t("P7", "config/speculative.py", "SpeculativeConfig.compute_hash", "adds ddtree's options")
    + _t("P8", "sampling_params.py", "SamplingParams._validate_spec_decode",
         "vLLM's refusal of min_p and logit_bias is skipped for ddtree (the tree sampler applies them)")
    + _t("P9", "v1/attention/selector.py", "_cached_get_attn_backend",
         "CPU_ATTN -> the CPU tree backend (its kernel, SDPA for trees); FLASHINFER -> its tree subclass")
    + _t("P10", "v1/spec_decode/dflash.py", "DFlashProposer.__init__", "built as DFlash of the drafter width")
    + _t("P10", "v1/worker/gpu_model_runner.py", "GPUModelRunner.__init__",
         "the drafter becomes DDTreeProposer after the DFlash branch")
    + _t("P10", "v1/sample/logits_processor/__init__.py", "build_logitsprocs, BUILTIN_LOGITS_PROCESSORS",
         "a ddtree engine gets vLLM's built-in logits processors (min_p, logit_bias) as without speculation")
    + _t("P11", "v1/worker/gpu_model_runner.py", "GPUModelRunner._prepare_inputs",
         "tree rows get positions context + depth; the tree masks go to attention")
    + _t("P12", "v1/worker/gpu_model_runner.py", "GPUModelRunner._sample, GPUModelRunner._calc_spec_decode_metadata",
         "the tree walk replaces the chain rejection sampler; reads the spec-decode metadata it builds")
    + _t("P12", "v1/worker/gpu_model_runner.py", "GPUModelRunner._bookkeeping_sync",
         "a seeded request's generator is left one draw on per emitted token (in place of vLLM's rewind of a "
         "discarded draw, which a CPU generator cannot make)")
    + _t("P13", "v1/worker/gpu_model_runner.py", "GPUModelRunner._input_fits_in_drafter",
         "the drafter's query is 1 + drafter width rows")
    + _t("P13", "v1/worker/gpu_model_runner.py", "GPUModelRunner.take_draft_token_ids",
         "no drafts (not vLLM's zero-filled chain) for a step whose drafter was skipped")
    + _t("P15", "v1/worker/gpu_model_runner.py", "GPUModelRunner.calculate_reorder_batch_threshold",
         "tree verifies are ordered before longer prefill chunks")
    + _t("P14", "v1/worker/gpu_worker.py", "Worker.compile_or_warm_up_model",
         "after vLLM's warm-up and graph capture, the automatic budget times its step sizes (GPU)")
    + _t("P14", "v1/worker/cpu_worker.py", "CPUWorker.compile_or_warm_up_model",
         "the same on a CPU")
    + _t("engine", "v1/worker/gpu_model_runner.py", "GPUModelRunner._dummy_run",
         "vLLM's dummy step, timed at start-up for the automatic budget")
    + _t("engine", "v1/worker/gpu_model_runner.py", "GPUModelRunner._attn_group_iterator",
         "the layer groups whose FlashInfer tree kernels are built at start-up")
    + _t("engine", "v1/spec_decode/dflash.py",
         "DFlashProposer, DFlashProposer.set_inputs_first_pass",
         "DDTreeProposer subclasses DFlashProposer and calls its first-pass input set-up")
    + _t("engine", "v1/spec_decode/llm_base_proposer.py",
         "SpecDecodeBaseProposer.propose, SpecDecodeBaseProposer.load_model, SpecDecodeBaseProposer._sample_draft_tokens",
         "DDTreeProposer overrides or calls these")
    + _t("P16", "v1/core/sched/scheduler.py", "Scheduler.update_draft_token_ids",
         "takes the flattened trees as ragged per-request drafts; wrapped to keep a structured request's tree parents")
    + _t("P16", "v1/structured_output/__init__.py",
         "StructuredOutputManager.grammar_bitmask, StructuredOutputManager.validate_tokens, "
         "StructuredOutputManager._fill_bitmasks, StructuredOutputManager._get_constraint_bounds",
         "grammar masks per tree row, filled with vLLM's own row filling and constraint bounds per path")
    + _t("P16", "v1/structured_output/utils.py", "apply_grammar_bitmask, strip_speculative_padding",
         "the runner's row layout of the masks (1 + drafts per request) that tree rows follow")
    + _t("P16", "v1/structured_output/backend_types.py", "StructuredOutputGrammar",
         "the grammar calls a tree row's mask takes: validate, accept, roll back, fill")
    + _t("engine", "v1/sample/ops/topk_topp_sampler.py", "apply_top_k_top_p", "tree sampler: top-k / top-p")
    + _t("engine", "model_executor/layers/utils.py", "apply_penalties", "tree sampler: penalties")
    + _t("engine", "v1/sample/ops/bad_words.py", "apply_bad_words", "tree sampler: bad words")
    + _t("engine", "v1/sample/logits_processor/builtin.py", "MinTokensLogitsProcessor",
         "tree sampler: min_tokens state")
    + _t("engine", "v1/sample/logits_processor/builtin.py", "MinPLogitsProcessor, LogitBiasLogitsProcessor",
         "tree sampler: min_p and logit_bias, from these processors' state and with their operations")
    + _t("engine", "v1/sample/sampler.py", "Sampler.sample",
         "tree sampler: the order of temperature, min_p and top-k/top-p")
    + _t("engine", "v1/outputs.py", "SamplerOutput", "what the tree sampler returns")
    + _t("engine", "v1/sample/ops/topk_topp_sampler.py",
         "TopKTopPSampler.__init__, TopKTopPSampler.forward_cpu, random_sample",
         "tree sampler: the draw, as vLLM's sampler chooses and makes it (its CPU op with a seed per row; the "
         "exponential race)")
    + _t("engine", "v1/sample/sampler.py", "Sampler.__init__", "tree sampler: use_fp64_gumbel, as the sampler holds it")
    + _t("engine", "v1/sample/sampler.py",
         "Sampler.compute_logprobs, Sampler.gather_logprobs, Sampler.gather_specific_token_logprobs",
         "tree sampler: the emitted positions' logprobs (top-n, the whole vocabulary, logprob_token_ids)")
    + _t("engine", "v1/sample/ops/logprobs.py", "batched_count_greater_than",
         "tree sampler: the emitted token's rank, for logprob_token_ids (gather_specific_token_logprobs' layout)")
    + _t("engine", "v1/worker/gpu_input_batch.py", "InputBatch.add_request",
         "tree sampler: logprobs=-1 counted as the vocabulary size, logprob_token_ids kept per request")
    + _t("P17", "engine/arg_utils.py", "EngineArgs.create_engine_config, EngineArgs.create_speculative_config",
         "vLLM's LoRA step rule, raised there, is reworded for ddtree")
    + _t("P18", "v1/core/sched/scheduler.py", "Scheduler.__init__, Scheduler.schedule",
         "an identity Dynamic SD schedule for ddtree turns off the placeholder padding of requests that start decoding")
    + _t("P19", "v1/core/sched/scheduler.py", "Scheduler.make_spec_decoding_stats",
         "per-position acceptance counted to the deepest tree node, not the verify width")
    + _t("P19", "v1/spec_decode/metrics.py", "SpecDecodingStats, SpecDecodingProm.__init__",
         "per-position acceptance counted to the deepest tree node, not the verify width")
    + _t("P19", "v1/core/sched/scheduler.py", "Scheduler.add_request",
         "the opt-in per-request acceptance histogram sized by the deepest tree node")
    + _t("P19", "v1/metrics/stats.py", "RequestSpecDecodeMetrics",
         "the opt-in per-request acceptance histogram sized by the deepest tree node")
    + _t("P20", "v1/worker/gpu_model_runner.py", "GPUModelRunner._dummy_sampler_run",
         "ddtree's largest verify and drafting step run after vLLM's dummy sampler, inside its memory profile")
    + _t("P21", "v1/worker/gpu_model_runner.py",
         "GPUModelRunner._is_uniform_decode, GPUModelRunner._determine_batch_execution_and_padding, "
         "GPUModelRunner._check_and_update_cudagraph_mode",
         "a ddtree runner's uniform decode is one token per request: FULL decode graphs for steps without trees")
    + _t("P21", "v1/cudagraph_dispatcher.py",
         "CudagraphDispatcher.__init__, CudagraphDispatcher._create_padded_batch_descriptor, "
         "CudagraphDispatcher.initialize_cudagraph_keys, CudagraphDispatcher.dispatch",
         "a ddtree runner's uniform decode is one token per request: FULL decode graphs for steps without trees")
    + _t("P21", "config/compilation.py", "CompilationConfig.resolve_cudagraph_mode_and_sizes",
         "a ddtree runner's uniform decode is one token per request: FULL decode graphs for steps without trees")
    + _t("engine", "v1/sample/thinking_budget_state.py",
         "ThinkingBudgetStateHolder.__init__, ThinkingBudgetStateHolder._init_state_entry, "
         "ThinkingBudgetStateHolder._update_think_state, ThinkingBudgetStateHolder._apply_forcing_to_logits",
         "thinking budgets: vLLM's state machine run per request without drafts, and its forcing rule")
    + _t("engine", "v1/sample/sampler.py", "Sampler.apply_logits_processors",
         "thinking budgets: what vLLM's sampler asks of the holder ddtree stands in for")
    + _t("engine", "v1/worker/gpu_input_batch.py", "InputBatch.refresh_metadata, InputBatch._make_sampling_metadata",
         "thinking budgets: where the input batch hands its holder to the sampling metadata")
    + _t("attention", "v1/attention/backends/cpu_attn.py", "CPUAttentionBackend",
         "the CPU tree backend subclasses it")
    + _t("attention", "v1/attention/backends/flashinfer.py",
         "FlashInferBackend, FlashInferMetadataBuilder.__init__, FlashInferMetadataBuilder.build, "
         "FlashInferMetadataBuilder.get_cudagraph_support, FlashInferMetadataBuilder._get_prefill_wrapper, "
         "FlashInferMetadata, FIPrefill, FIDecode",
         "the GPU tree backend subclasses the builder and plans its own custom-mask prefill")
    + _t("attention", "v1/attention/backends/flashinfer.py", "FlashInferImpl.forward",
         "runs the tree plan as the step's first ('decode') part and the causal plan after it")
)


# ---- reading a vLLM release -----------------------------------------------------------------------


class VLLMSource:
    """The Python sources of one vLLM release: a wheel, a site-packages folder or a ``vllm`` folder."""

    def __init__(self, location: str | Path) -> None:
        self.location = Path(location)
        self._zip: zipfile.ZipFile | None = None
        if self.location.is_file() and zipfile.is_zipfile(self.location):
            self._zip = zipfile.ZipFile(self.location)
            self._root = "vllm/"
        elif (self.location / "vllm" / "__init__.py").is_file():
            self._root = self.location / "vllm"
        elif (self.location / "__init__.py").is_file() and self.location.name == "vllm":
            self._root = self.location
        else:
            raise FileNotFoundError(
                f"{location}: not a vLLM wheel, a site-packages folder containing vllm/, or a vllm package folder"
            )
        self._trees: dict[str, ast.Module | None] = {}

    def read(self, file: str) -> str | None:
        """The text of ``vllm/<file>``, or None where the release has no such file."""
        if self._zip is not None:
            try:
                return self._zip.read(self._root + file).decode()
            except KeyError:
                return None
        path = Path(self._root) / file
        return path.read_text() if path.is_file() else None

    def module(self, file: str) -> ast.Module | None:
        if file not in self._trees:
            text = self.read(file)
            self._trees[file] = None if text is None else ast.parse(text)
        return self._trees[file]

    @property
    def version(self) -> str:
        """The release's version, from its wheel metadata or ``vllm/_version.py``."""
        if self._zip is not None:
            for name in self._zip.namelist():
                if re.fullmatch(r"vllm-[^/]+\.dist-info/METADATA", name):
                    m = re.search(r"^Version: (\S+)", self._zip.read(name).decode(), re.M)
                    if m:
                        return m.group(1)
        text = self.read("_version.py") or ""
        m = re.search(r"""(?:__version__|version)\s*(?::\s*str)?\s*=\s*['"]([^'"]+)['"]""", text)
        return m.group(1) if m else "unknown"


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for sub in ast.walk(node):
        body = getattr(sub, "body", None)
        if (isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            sub.body = body[1:] or [ast.Pass()]
    return node


def _find(module: ast.Module, name: str) -> tuple[ast.AST, int] | None:
    """The node a target names, and its line, or None."""
    path, _, part = name.partition(":")
    scope: list[ast.stmt] = module.body
    node: ast.AST | None = None
    for piece in path.split("."):
        node = None
        for stmt in scope:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == piece:
                node = stmt
            elif isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == piece for t in stmt.targets):
                node = stmt
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == piece:
                node = stmt
        if node is None:
            return None
        scope = getattr(node, "body", [])
    if part == "fields":  # a dataclass's field declarations only: name, annotation, default
        assert isinstance(node, ast.ClassDef)
        fields = [s for s in node.body if isinstance(s, ast.AnnAssign)]
        return ast.Module(body=fields, type_ignores=[]), node.lineno
    return node, node.lineno


def target_source(src: VLLMSource, target: Target) -> tuple[str, int] | None:
    """The normalised source of a target in a release, and its line; None where it does not exist."""
    module = src.module(target.file)
    if module is None:
        return None
    found = _find(module, target.name)
    if found is None:
        return None
    node, line = found
    return ast.unparse(_strip_docstrings(ast.parse(ast.unparse(node)))), line


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _key(target: Target) -> str:
    return f"{target.file}::{target.name}"


# ---- the reference fingerprints ---------------------------------------------------------------------


def fingerprints(src: VLLMSource) -> dict[str, dict]:
    """``{file::name: {sha, line}}`` for every target of a release (missing targets left out)."""
    out = {}
    for target in TARGETS:
        found = target_source(src, target)
        if found is not None:
            out[_key(target)] = {"sha": _digest(found[0]), "line": found[1]}
    return out


def write_reference(location: str | Path, path: Path = REFERENCE_FILE) -> Path:
    """Fingerprint vLLM 0.32.0's targets into the file the plugin and the command compare with."""
    src = VLLMSource(location)
    if src.version.split("+")[0] != REFERENCE_VERSION:
        raise ValueError(f"{location} is vLLM {src.version}, not the reference {REFERENCE_VERSION}")
    prints = fingerprints(src)
    missing = [_key(t) for t in TARGETS if _key(t) not in prints]
    if missing:
        raise ValueError(f"targets missing from vLLM {REFERENCE_VERSION} (fix TARGETS): {missing}")
    path.write_text(json.dumps({"vllm": REFERENCE_VERSION, "targets": prints}, indent=1, sort_keys=True) + "\n")
    return path


def load_reference(path: Path = REFERENCE_FILE) -> dict[str, dict]:
    """The committed fingerprints of vLLM 0.32.0's targets."""
    return json.loads(path.read_text())["targets"]


# ---- the check ----------------------------------------------------------------------------------


@dataclass
class TargetStatus:
    """One target in one release: ``unchanged``, ``changed`` or ``missing``."""

    patch: str
    file: str
    name: str
    status: str
    line: int | None
    reference_line: int | None
    why: str
    diff: str | None = None


@dataclass
class CompatReport:
    """What a vLLM release means for vllm-ddtree's patches."""

    vllm: str
    reference: str
    targets: list[TargetStatus]

    @property
    def compatible(self) -> bool:
        """Every target exists with the reference's source."""
        return all(t.status == "unchanged" for t in self.targets)

    @property
    def blocking(self) -> list[TargetStatus]:
        return [t for t in self.targets if t.status != "unchanged"]

    def summary(self) -> str:
        """One line: the verdict and, where refused, the targets that changed."""
        if self.compatible:
            return (f"vLLM {self.vllm}: all {len(self.targets)} patch targets unchanged from {self.reference} "
                    "(checked statically, not run)")
        listed = ", ".join(f"{t.patch} {t.name} ({t.status})" for t in self.blocking)
        return f"vLLM {self.vllm}: {len(self.blocking)} of {len(self.targets)} patch targets differ from {self.reference}: {listed}"

    def to_dict(self) -> dict:
        return {"vllm": self.vllm, "reference": self.reference, "compatible": self.compatible,
                "summary": self.summary(), "targets": [asdict(t) for t in self.targets]}

    @classmethod
    def from_dict(cls, d: dict) -> CompatReport:
        """The report :meth:`to_dict` wrote."""
        return cls(d["vllm"], d["reference"], [TargetStatus(**t) for t in d["targets"]])

    def to_markdown(self) -> str:
        verdict = ("accepted: every target unchanged (statically checked, not run)" if self.compatible
                   else "refused: the plugin leaves this vLLM untouched")
        lines = [f"# vLLM {self.vllm} against vllm-ddtree's patches", "",
                 f"Generated by `python -m vllm_ddtree.compat` against vLLM {self.reference}'s fingerprints.",
                 "", f"**Verdict: {verdict}.** {len(self.blocking)} of {len(self.targets)} targets differ.", "",
                 "| patch | target | status | line (0.32.0 → this) | why ddtree needs it |", "|---|---|---|---|---|"]
        for t in self.targets:
            where = f"{t.reference_line} → {t.line if t.line is not None else '—'}"
            lines.append(f"| {t.patch} | `{t.file}` `{t.name}` | {t.status} | {where} | {t.why} |")
        diffs = [t for t in self.targets if t.diff]
        if diffs:
            lines += ["", "## Diffs of the changed targets (normalised source, docstrings removed)", ""]
            for t in diffs:
                lines += [f"### {t.patch} `{t.file}` `{t.name}`", "", "```diff", t.diff.rstrip(), "```", ""]
        return "\n".join(lines) + "\n"


def check(location: str | Path, reference: str | Path | None = None) -> CompatReport:
    """Compare a vLLM release's targets with vLLM 0.32.0's.

    ``reference`` (another vLLM tree or wheel, normally 0.32.0) replaces the committed fingerprints
    and adds a unified diff to every changed target.
    """
    src = VLLMSource(location)
    ref_src = VLLMSource(reference) if reference is not None else None
    ref = fingerprints(ref_src) if ref_src is not None else load_reference()
    statuses = []
    seen = set()
    for target in TARGETS:
        key = _key(target)
        if (key, target.patch) in seen:
            continue
        seen.add((key, target.patch))
        found = target_source(src, target)
        expected = ref.get(key)
        ref_line = expected["line"] if expected else None
        if found is None:
            status, line, diff = "missing", None, None
        else:
            text, line = found
            status = "unchanged" if expected is not None and _digest(text) == expected["sha"] else "changed"
            diff = None
            if status == "changed" and ref_src is not None:
                old = target_source(ref_src, target)
                old_text = old[0] + "\n" if old else ""
                diff = "".join(difflib.unified_diff(old_text.splitlines(True), (text + "\n").splitlines(True),
                                                    f"{REFERENCE_VERSION}/{target.file}", f"{src.version}/{target.file}",
                                                    n=2))
        statuses.append(TargetStatus(target.patch, target.file, target.name, status, line, ref_line, target.why, diff))
    return CompatReport(src.version, ref_src.version if ref_src else REFERENCE_VERSION, statuses)


def installed_vllm() -> Path:
    """The vllm/ folder this process would import (found, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise ImportError("vLLM is not installed")
    return Path(spec.origin).parent


def check_installed(cache_dir: str | Path | None = None) -> CompatReport:
    """The check for the vLLM this process imports (read from its files; nothing of vLLM's runs).

    The plugin runs it in every process vLLM starts (API server, engine core, each worker), and
    parsing the targets' files takes 0.5-1.3 s. So the report is kept under
    ``cache_dir/compat`` (default ``$VLLM_DDTREE_CACHE`` or ``~/.cache/vllm-ddtree``), named by a
    key of everything the verdict depends on: this module, the committed fingerprints, and the path,
    size and modification time of each target file. Any edit or reinstall of vLLM (or of this
    plugin) makes a new key; a cache that cannot be read or written is passed over.
    """
    root = installed_vllm()
    path = None
    try:
        from vllm_ddtree.models.target import default_cache_dir

        path = Path(cache_dir or default_cache_dir()) / "compat" / f"{_files_key(root)}.json"
        if path.is_file():
            return CompatReport.from_dict(json.loads(path.read_text()))
    except Exception:  # noqa: BLE001 — the cache is optional (no home directory, a foreign file): check
        pass
    report = check(root)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(report.to_dict()))
            os.replace(tmp, path)  # atomic: a process starting meanwhile reads the whole report or none
        except Exception:  # noqa: BLE001 — an unwritable cache only costs the next process the check
            pass
    return report


def _files_key(root: Path) -> str:
    """A digest of what :func:`check` reads from ``root`` and compares it with (stats, not contents)."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(json.dumps(load_reference(), sort_keys=True).encode())  # the fingerprints check() compares with
    h.update(str(root.resolve()).encode())
    for file in sorted({t.file for t in TARGETS} | {"_version.py"}):
        try:
            st = (root / file).stat()
            h.update(f"\n{file} {st.st_size} {st.st_mtime_ns}".encode())
        except FileNotFoundError:
            h.update(f"\n{file} missing".encode())
    return h.hexdigest()[:32]


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_ddtree.compat``: print (and optionally save) a release's report."""
    parser = argparse.ArgumentParser(prog="python -m vllm_ddtree.compat", description=__doc__.split("\n\n")[0])
    parser.add_argument("vllm", nargs="?", help="a vLLM wheel (.whl), a site-packages folder with vllm/, or a "
                                                "vllm/ folder (default: the vLLM this Python imports)")
    parser.add_argument("--reference", help="compare against this vLLM tree or wheel (adds diffs) instead of "
                                            "the committed 0.32.0 fingerprints")
    parser.add_argument("--json", help="write the report as JSON here")
    parser.add_argument("--markdown", help="write the report as Markdown here")
    parser.add_argument("--write-reference", action="store_true",
                        help=f"regenerate {REFERENCE_FILE.name} from this vLLM {REFERENCE_VERSION} tree")
    args = parser.parse_args(argv)
    if args.write_reference:
        if args.vllm is None:
            parser.error("--write-reference needs the vLLM 0.32.0 tree to read")
        print(write_reference(args.vllm))
        return 0
    if args.vllm is None:
        try:
            args.vllm = str(installed_vllm())
        except ImportError:
            parser.error("vLLM is not installed here: name a wheel or site-packages folder to check")
    report = check(args.vllm, args.reference)
    width = max(len(f"{t.file} {t.name}") for t in report.targets)
    for t in report.targets:
        print(f"{t.patch:>9}  {f'{t.file} {t.name}':<{width}}  {t.status}")
    print(report.summary())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(report.to_markdown())
    return 0 if report.compatible else 1


if __name__ == "__main__":
    sys.exit(main())
