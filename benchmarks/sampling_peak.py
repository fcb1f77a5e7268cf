"""Peak memory of the verify rows' sampling step: the padded sampler against the ragged one (a measurement).

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so python benchmarks/sampling_peak.py [--json PATH] [--cases R:N,...]
        [--memory auto|profiler] [--update]

One sampling step (`sample_rows`) at temperature 1 with top-p 0.9, every request with N verify rows
(full trees: the case where padding adds no rows, so any difference is the samplers' own
temporaries), float32 logits [R × N, V] with V = 151936 (Qwen3's vocabulary). Variants:
"padded" is `vllm_ddtree/sampling.py` as of PADDED_REV (gathers the rows into [R, N, V] tensors),
loaded from git; "ragged" is the working tree's (chunks of whole requests on the ragged logits).
Each case runs in its own subprocess, so peaks do not mix.

What is measured (``measured_with``):
- cuda-allocator (on a GPU): ``torch.cuda.max_memory_allocated`` over the step, after
  ``reset_peak_memory_stats``; transient = that peak minus what was allocated just before (the inputs).
- rss-hwm (CPU, the default there): the process's resident-set high-water mark (VmHWM in
  /proc/self/status), reset just before the step through /proc/self/clear_refs; transient = VmHWM
  after the step minus VmRSS before it. PyTorch's CPU allocator has no cache (large blocks are
  mmap'd and returned at once), so resident growth is the pages the step's tensors touched.
  tracemalloc would not see them. Needs the logits in memory too.
- torch-profiler (CPU, ``--memory profiler``): torch.profiler with profile_memory, the peak of the
  torch memory the step holds, replayed from every allocation and free (intra-op temporaries
  included; the logits count from the step's first read of them); transient = that peak minus the
  logits. The logits are a mapping of a temporary file, so a case needs free memory only for its
  temporaries.
In all, ``peak_bytes`` = the logits (the step's input) + transient; ``ragged_logits_bytes`` =
Σ rows × V × 4; their ratio (``peak_vs_logits``) is the figure to compare.

A case whose estimated need exceeds the memory available (MemAvailable on CPU, free memory on CUDA)
is not run: its row says so (``skipped``) and carries no peak. Timings are recorded, not compared.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PADDED_REV = "75ac8d86509703c825be39d35605e59d478ed4b4"  # a commit with the padded sampler
VOCAB = 151936
DEFAULT_CASES = [(16, 65), (32, 65), (256, 65), (256, 5), (1024, 5)]
GiB = 1 << 30


def _status_kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def _mem_available() -> int:
    """Bytes this process may still use: MemAvailable on the host, free memory on a CUDA device."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M).group(1)) * 1024


def estimate_bytes(variant: str, batch: int, rows_per_request: int, vocab: int) -> int:
    """A rough upper estimate of a case's need (for the skip decision only; never reported as a peak).

    padded: the logits plus about seven [R, N, V] float32-sized tensors at the top-p sort (the gathered
    rows, their scaled copy, sort values and int64 indices, cumulative softmax); ragged: the logits
    plus about 24 bytes per element of one chunk.
    """
    from vllm_ddtree.sampling import CHUNK_ELEMENTS

    logits = batch * rows_per_request * vocab * 4
    if variant == "padded":
        return logits + 7 * logits
    return logits + 24 * CHUNK_ELEMENTS + (1 << 28)


def _load_padded():
    """`sample_rows` of vllm_ddtree/sampling.py at PADDED_REV, as a module."""
    import types

    try:
        src = subprocess.run(["git", "show", f"{PADDED_REV}:vllm_ddtree/sampling.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"the padded variant needs git history with {PADDED_REV} (a full clone): {e}")
    mod = types.ModuleType("padded_sampling")
    sys.modules[mod.__name__] = mod
    exec(compile(src, f"{PADDED_REV[:7]}:vllm_ddtree/sampling.py", "exec"), mod.__dict__)
    return mod.sample_rows


def _file_logits(rows: int, vocab: int, path: Path):
    """Random float32 logits [rows, V] written to `path` and mapped back read-only-in-effect (MAP_PRIVATE):
    clean file pages the kernel may drop and re-read, so the input takes no anonymous memory."""
    import torch

    g = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        for lo in range(0, rows, 256):
            f.write(torch.randn(min(256, rows - lo), vocab, generator=g).mul_(2.0).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    return torch.from_file(str(path), shared=False, size=rows * vocab, dtype=torch.float32).view(rows, vocab)


def _step_inputs(batch: int, n: int, vocab: int, top_p: float, temperature: float, device,
                 logits_file: Path | None = None):
    """Logits [R × N, V], rows [R, N], vLLM's SamplingMetadata and a chain TreeBatch (R requests of N rows).

    With `logits_file` (CPU) the logits are a mapping of that file (see :func:`_file_logits`)."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    from vllm_ddtree.tree import DraftTree, compile_tree

    r, d = batch, n - 1
    par = torch.arange(-1, d - 1).repeat(r, 1) if d else torch.zeros(r, 0, dtype=torch.int64)
    dep = torch.arange(1, d + 1).repeat(r, 1) if d else torch.zeros(r, 0, dtype=torch.int64)
    tok = torch.randint(0, vocab, (r, d))
    valid = dep > 0
    zeros = torch.zeros(r, d)
    tree = DraftTree(tok, par, dep, zeros, zeros, valid, valid.sum(1), max(d, 1))
    tree_batch = compile_tree(tree, torch.randint(0, vocab, (r,)), torch.full((r,), 100)).to(device)
    rows = (torch.arange(r).unsqueeze(1) * n + torch.arange(n)).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    if logits_file is not None:
        logits = _file_logits(r * n, vocab, logits_file)
    else:
        logits = torch.randn(r * n, vocab, device=device, generator=g).mul_(2.0)
    f = lambda x: torch.full((r,), x, device=device)  # noqa: E731
    md = SamplingMetadata(temperature=f(float(temperature)), all_greedy=False, all_random=True,
                          top_p=f(float(top_p)), top_k=None, generators={}, max_num_logprobs=None,
                          no_penalties=True, prompt_token_ids=None, frequency_penalties=f(0.0),
                          presence_penalties=f(0.0), repetition_penalties=f(1.0),
                          output_token_ids=[[] for _ in range(r)], allowed_token_ids_mask=None,
                          bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    return logits, rows, md, tree_batch


def _child(params: dict) -> dict:
    """Run one case in this process and measure it (see the module docstring)."""
    import torch

    variant, r, n, v = params["variant"], params["batch"], params["rows_per_request"], params["vocab"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if variant == "padded":
        sample = _load_padded()
    else:
        from vllm_ddtree.sampling import sample_rows

        def sample(logits, rows, md, batch):
            return sample_rows(logits, rows, md, batch, [n] * rows.shape[0])

    profiler = params.get("memory") == "profiler"
    if profiler and device.type == "cuda":
        raise ValueError("memory='profiler' is the CPU method; on CUDA the allocator's own peak is used")
    # Warm-up on a tiny step: lazy imports and one-time state are not the step's memory.
    sample(*_step_inputs(2, n, v, params["top_p"], params["temperature"], device))
    logits_file = Path(params["logits_file"]) if profiler else None
    try:
        logits, rows, md, batch = _step_inputs(r, n, v, params["top_p"], params["temperature"], device, logits_file)
        if profiler:
            return _profile_step(sample, logits, rows, md, batch)
    finally:
        if logits_file is not None and logits_file.exists():
            logits_file.unlink()  # the mapping stays valid until the process ends
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t = time.perf_counter()
        tokens = sample(logits, rows, md, batch)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        transient = torch.cuda.max_memory_allocated() - before
        how = "cuda-allocator"
        name = torch.cuda.get_device_name()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
        before = _status_kib("VmRSS") * 1024
        t = time.perf_counter()
        tokens = sample(logits, rows, md, batch)
        seconds = time.perf_counter() - t
        transient = _status_kib("VmHWM") * 1024 - before
        how = "rss-hwm"
        name = "cpu"
    assert tokens.shape == rows.shape
    logits_bytes = logits.numel() * logits.element_size()
    return {"peak_bytes": logits_bytes + transient, "transient_bytes": transient, "seconds": round(seconds, 3),
            "measured_with": how, "device_name": name}


def _profile_step(sample, logits, rows, md, batch) -> dict:
    """The step under torch.profiler with profile_memory: the peak of the torch CPU memory it holds
    (every allocation and free, as the profiler's memory timeline replays them; intra-op temporaries
    included), whatever else the machine does. The timeline counts tensors made before the profile
    once the step reads them, so its peak includes the logits: transient = peak - the logits."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        tokens = sample(logits, rows, md, batch)
    seconds = time.perf_counter() - t  # with the profiler's overhead
    assert tokens.shape == rows.shape
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    peak = int(np.asarray(sizes).sum(1).max())
    logits_bytes = logits.numel() * logits.element_size()
    return {"peak_bytes": peak, "transient_bytes": peak - logits_bytes, "seconds": round(seconds, 3),
            "measured_with": PROFILER_METHOD, "device_name": "cpu"}


PROFILER_METHOD = "torch-profiler"
METHODS = {
    "cuda-allocator": "torch.cuda.max_memory_allocated over the step, minus what was allocated before it",
    "rss-hwm": "the resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) over the step, "
               "minus VmRSS before it",
    PROFILER_METHOD: "torch.profiler with profile_memory: the peak of the torch memory the step holds (the logits "
                     "it reads included), replayed from every allocation and free; the logits a file mapping (no "
                     "anonymous memory)",
}


def measure(variant: str, batch: int, rows_per_request: int, vocab: int = VOCAB, temperature: float = 1.0,
            top_p: float = 0.9, margin_bytes: int = 3 * GiB // 2, memory: str = "auto") -> dict:
    """Peak memory of one sampling step in a fresh subprocess; a result row (see the module docstring).

    variant: "padded" (the sampler at PADDED_REV) or "ragged" (the working tree's). Every request has
    `rows_per_request` verify rows. A case estimated not to fit in the available memory (less
    `margin_bytes`) is not run: ``skipped`` says why and ``peak_bytes`` is None. memory: "auto" (the CUDA
    allocator's peak on a GPU, the resident-set high-water mark on the CPU) or "profiler" (CPU: torch's
    profiler replays the step's allocations; the logits are a file mapping, so only the step's own
    temporaries need free memory).
    """
    if variant not in ("padded", "ragged"):
        raise ValueError(f"variant must be 'padded' or 'ragged', got {variant!r}")
    if memory not in ("auto", "profiler"):
        raise ValueError(f"memory must be 'auto' or 'profiler', got {memory!r}")
    total_rows = batch * rows_per_request
    row = {"engine": "pipeline", "variant": variant, "batch": batch, "rows": rows_per_request, "vocab": vocab,
           "temperature": temperature, "top_p": top_p, "total_rows": total_rows,
           "ragged_logits_bytes": total_rows * vocab * 4}
    need, have = estimate_bytes(variant, batch, rows_per_request, vocab), _mem_available()
    if memory == "profiler":
        need -= row["ragged_logits_bytes"]  # file-backed: the page cache may drop and re-read it
    if need > have - margin_bytes:
        row.update(peak_bytes=None, transient_bytes=None, peak_vs_logits=None,
                   skipped=f"not run: needs about {need / GiB:.1f} GiB, {have / GiB:.1f} GiB available")
        return row
    params = {"variant": variant, "batch": batch, "rows_per_request": rows_per_request, "vocab": vocab,
              "temperature": temperature, "top_p": top_p, "memory": memory}
    if memory == "profiler":
        import tempfile

        params["logits_file"] = str(Path(tempfile.gettempdir()) / f"sampling_peak_logits_{os.getpid()}.bin")
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(params)], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode == -9:  # the kernel's out-of-memory killer: the memory free at the start went elsewhere
        row.update(peak_bytes=None, transient_bytes=None, peak_vs_logits=None,
                   skipped=f"killed (SIGKILL, out of memory?): needed about {need / GiB:.1f} GiB, "
                           f"{have / GiB:.1f} GiB were available at the start")
        return row
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} R={batch} N={rows_per_request} failed (rc {proc.returncode}):\n"
                           + proc.stderr[-3000:])
    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    row["peak_vs_logits"] = round(row["peak_bytes"] / row["ragged_logits_bytes"], 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--cases", default=",".join(f"{r}:{n}" for r, n in DEFAULT_CASES),
                    help="batch:rows_per_request, comma-separated (default: %(default)s)")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--memory", choices=("auto", "profiler"), default="auto",
                    help="auto: the CUDA allocator's peak, or on the CPU the resident-set high-water mark; "
                         "profiler (CPU): torch's profiler, logits file-backed (needs far less free memory)")
    ap.add_argument("--update", action="store_true",
                    help="re-measure only --cases and replace their rows in the existing --json file (e.g. a case "
                         "skipped for want of memory), keeping the other rows")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    rows = []
    print(f"{'R':>5} {'N':>3} {'variant':>7} {'logits GiB':>10} {'peak GiB':>9} {'peak/logits':>11} {'s':>7}")
    for r, n in cases:
        for variant in ("padded", "ragged"):
            row = measure(variant, r, n, args.vocab, memory=args.memory)
            rows.append(row)
            peak = "–" if row["peak_bytes"] is None else f"{row['peak_bytes'] / GiB:.2f}"
            rel = "–" if row["peak_vs_logits"] is None else f"{row['peak_vs_logits']:.2f}×"
            secs = row.get("seconds", "–")
            print(f"{r:>5} {n:>3} {variant:>7} {row['ragged_logits_bytes'] / GiB:>10.2f} {peak:>9} {rel:>11} "
                  f"{secs:>7}  {row.get('skipped', '')}", flush=True)
    if args.json:
        write_json(Path(args.json), rows, args)


def _command(path: Path, args: argparse.Namespace) -> str:
    default = args.cases == ",".join(f"{r}:{n}" for r, n in DEFAULT_CASES)
    return ("python benchmarks/sampling_peak.py --json " + os.path.relpath(path, ROOT)
            + ("" if default else f" --cases {args.cases}") + ("" if args.memory == "auto" else f" --memory {args.memory}")
            + (" --update" if args.update else ""))


def write_json(path: Path, rows: list[dict], args: argparse.Namespace) -> None:
    """{"meta": ..., "rows": [...]}: what the run was (benchmarks/report.py reads it), then one row per case;
    settings every measured row shares (how memory was measured, the device) move to meta. With --update,
    the file's rows for the re-measured cases are replaced and its commands kept."""
    commands = [_command(path, args)]
    if args.update and path.is_file():
        old = json.loads(path.read_text())
        keep = {k: old["meta"][k] for k in ("measured_with", "device_name") if k in old["meta"]}
        merged = [({**keep, **r} if r.get("peak_bytes") is not None else r) for r in old["rows"]]
        for row in rows:
            # A new row replaces the case's row measured the same way, or the case's skipped row; a new
            # skipped row replaces only a skipped one.
            case = lambda r: (r["variant"], r["batch"], r["rows"], r["vocab"])  # noqa: E731
            same = [i for i, r in enumerate(merged) if case(r) == case(row) and (
                r.get("peak_bytes") is None or (row.get("peak_bytes") is not None
                                                and r.get("measured_with") == row.get("measured_with")))]
            if same:
                merged[same[0]] = row
                merged = [r for i, r in enumerate(merged) if i not in same[1:]]
            else:
                merged.append(row)
        rows = merged
        commands = list(dict.fromkeys(old["meta"].get("commands", []) + commands))
    measured = [r for r in rows if r.get("peak_bytes") is not None]
    shared = {}
    for key in ("measured_with", "device_name"):
        values = {r.get(key) for r in measured}
        if len(values) == 1:
            shared[key] = values.pop()
            for r in measured:
                r.pop(key, None)
    on_cuda = shared.get("device_name", "cpu") != "cpu"
    meta = {
        "title": "Peak memory of the verify rows' sampling step: padded against ragged",
        "group": "kernels", "kind": "sampling_peak",
        "what": ("One sample_rows step at temperature 1 with top-p 0.9, every request with N verify rows (full "
                 "trees: padding adds no rows, so the difference is the samplers' temporaries), float32 logits "
                 "[R × N, V]. padded: the sampler at " + PADDED_REV[:7] + " ([R, N, V] tensors); ragged: chunks of "
                 "whole requests on the ragged logits. peak_bytes = the logits + the step's transient peak "
                 "(transient_bytes); peak_vs_logits = peak_bytes / ragged_logits_bytes (Σ rows × V × 4). "
                 "Each case in its own process. A case whose estimated need exceeded the free memory was not "
                 "run (skipped). Memory (measured_with): " + "; ".join(
                     f"{k}: {v}" for k, v in METHODS.items() if any(r.get("measured_with", shared.get(
                         "measured_with")) == k for r in measured)) + "."),
        "engine": "the verify-row sampler alone (vllm_ddtree/sampling.py with vLLM's sampling ops), no model",
        "device": shared.get("device_name") if on_cuda else "epyc-2",
        "model": "none: random logits over Qwen3's vocabulary (V = " + str(args.vocab) + ")",
        "date": time.strftime("%Y-%m-%d"),
        "commands": commands,
        **shared,
    }
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
