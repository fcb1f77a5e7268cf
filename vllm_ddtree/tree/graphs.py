"""A step's device function captured once per shape and replayed: CUDA graphs for the tree step.

    graphs = StepGraphs("cuda")
    out = graphs(key, fn, *inputs)     # fn(*inputs) -> tensors in tuples / dataclasses / None / ints

Eagerly each op is a kernel launch of several microseconds of host time; a step of a few hundred
small ops keeps the GPU waiting on the host. A CUDA graph replays them all in one launch. A graph
holds the addresses it was captured with, so each key (the caller's: shapes, widths, the state's
identity) gets its own graph with its own input buffers: a call copies its inputs into them and
replays, and its outputs are the graph's own tensors, overwritten by the key's next replay (the
caller reads them before then). A key is captured the `capture_after`-th time it is seen (its
first calls run eagerly: they make the constants a capture must not allocate). At most
`max_graphs` are kept, the least recently used dropped first. A capture that fails turns the
graphs off for good (with a warning): the step runs eagerly from then on, as without them.

`backend="trace"` stands in for CUDA graphs on a CPU: `make_fx` freezes Python numbers and holds
tensors where they lie, as a capture does, so the same caller logic is tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict, defaultdict
from typing import Any, Callable

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

BACKENDS = ("cuda", "trace")


def _leaves(obj: Any) -> list[Tensor]:
    """The tensors of `obj` (tensors, None, numbers, tuples/lists and dataclasses of them), in order."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _leaves(x)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _leaves(getattr(obj, f.name))]
    return []


def _rebuild(obj: Any, leaves: list[Tensor]) -> Any:
    """`obj` with its tensors replaced by `leaves` (consumed from the front, in `_leaves`' order)."""
    if isinstance(obj, Tensor):
        return leaves.pop(0)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_rebuild(x, leaves) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _rebuild(getattr(obj, f.name), leaves)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _leading_block(buffer: Tensor, x: Tensor) -> Tensor:
    """The block of `buffer` that `x` fills (`buffer` itself when the shapes agree)."""
    if buffer.shape == x.shape:
        return buffer
    return buffer[tuple(slice(0, n) for n in x.shape)]


def _padded(x: Tensor | None, shape: tuple[int, ...] | None) -> Tensor | None:
    """`x` zero-padded at the end of each dimension to `shape` (None: `x` as it is)."""
    if x is None or shape is None or tuple(x.shape) == tuple(shape):
        return x
    out = x.new_zeros(shape)
    _leading_block(out, x).copy_(x)
    return out


@dataclasses.dataclass
class _Captured:
    inputs: list[Tensor | None]  # the graph's input buffers (None where the caller passes None)
    run: Callable[[], Any]  # replays; returns the outputs
    replays: int = 0  # calls answered by a replay (the capture's own included, on CUDA)


class StepGraphs:
    """Captures `fn` once per key and replays it (see the module docstring)."""

    MAX_SEEN = 4096  # keys counted towards a capture at most (then the count starts over)

    def __init__(self, backend: str, capture_after: int = 2, max_graphs: int = 32) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"StepGraphs backend must be one of {BACKENDS}, got {backend!r}")
        if capture_after < 1 or max_graphs < 1:
            raise ValueError(f"capture_after and max_graphs must be >= 1, got {capture_after}, {max_graphs}")
        self.backend, self.capture_after, self.max_graphs = backend, capture_after, max_graphs
        self.graphs: OrderedDict[Any, _Captured] = OrderedDict()
        self.seen: defaultdict[Any, int] = defaultdict(int)
        self.failed: str | None = None  # why the graphs are off, once a capture failed
        self.captures = self.replays = self.eager_calls = 0

    def __call__(self, key: Any, fn: Callable[..., Any], *inputs: Tensor | None,
                 shapes: tuple[tuple[int, ...] | None, ...] | None = None) -> Any:
        """`fn(*inputs)`, replayed from the key's graph where there is one (captured now if due).

        shapes: per input, its buffer's shape (None: the input's own; the key must fix them). An input
        smaller than its buffer is copied into the buffer's leading block, and the rest keeps what it
        held (zeros at first, an earlier call's values later), so `fn` must make those elements
        inert through an input passed whole (a mask). Eager calls get the inputs zero-padded alike:
        every call of a key runs `fn` on the same shapes."""
        if shapes is not None:
            if len(shapes) != len(inputs):
                raise ValueError(f"shapes has {len(shapes)} entries for {len(inputs)} inputs")
            for x, shape in zip(inputs, shapes):
                if shape is not None and (x is None or x.dim() != len(shape)
                                          or any(a > b for a, b in zip(x.shape, shape))):
                    raise ValueError(f"an input of shape {None if x is None else tuple(x.shape)} does not fit "
                                     f"a buffer of shape {tuple(shape)}")
        entry = self.graphs.get(key)
        if entry is None and shapes is not None:  # eager or capturing: the key's full shapes
            inputs = tuple(_padded(x, shape) for x, shape in zip(inputs, shapes))
        if entry is None and self.failed is None:
            if len(self.seen) >= self.MAX_SEEN:  # keys seen once and never again: forget them
                self.seen.clear()
            self.seen[key] += 1
            if self.seen[key] >= self.capture_after:
                out = self._capture(key, fn, inputs)
                if out is not None:  # this call's outputs: the capture ran the step once, as a call does
                    return out
        if entry is None:
            self.eager_calls += 1
            return fn(*inputs)
        self.graphs.move_to_end(key)
        for buffer, x in zip(entry.inputs, inputs):
            if buffer is not None:
                _leading_block(buffer, x).copy_(x)
        self._count_replay(entry)
        return entry.run()

    def _capture(self, key: Any, fn: Callable[..., Any], inputs: tuple) -> Any:
        """Capture `fn` for `key` on copies of `inputs`; returns this call's outputs (None: it failed)."""
        buffers = [None if x is None else x.clone() for x in inputs]
        present = [i for i, b in enumerate(buffers) if b is not None]
        try:
            if self.backend == "trace":
                from torch.fx.experimental.proxy_tensor import make_fx

                traced_call: list = []

                def tensors_only(*xs):
                    args = list(buffers)
                    for i, x in zip(present, xs):
                        args[i] = x
                    traced_call.append(fn(*args))  # real values: make_fx runs the ops while it traces
                    return tuple(_leaves(traced_call[-1]))

                traced = make_fx(tensors_only)(*(buffers[i] for i in present))
                template = traced_call[0]

                def run() -> Any:
                    return _rebuild(template, list(traced(*(buffers[i] for i in present))))

                out = template  # the tracing ran the step once: that is this call
            else:
                # A private memory pool per graph: graphs of different keys replay in any order, and
                # one's temporaries must not be another's outputs.
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    template = fn(*buffers)  # recorded, not run
                outputs = _leaves(template)

                def run() -> Any:
                    graph.replay()
                    return _rebuild(template, list(outputs))

                out = None
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager from now on
            self.failed = f"{type(exc).__name__}: {exc}"
            self.graphs.clear()
            if self.backend == "cuda":
                try:  # surface what the failed capture left on the stream now, not in the next kernel
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001
                    pass
            logger.warning("ddtree: capturing the tree step in a CUDA graph failed (%s); it runs eagerly from now on",
                           self.failed)
            return None
        entry = _Captured(buffers, run)
        self.graphs[key] = entry
        self.captures += 1
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        if out is None:
            self._count_replay(entry)
            out = run()
        return out

    def _count_replay(self, entry: _Captured) -> None:
        entry.replays += 1
        self.replays += 1

    def replays_of(self, key: Any) -> int:
        """How many calls of `key` its current capture has answered (0: none held)."""
        entry = self.graphs.get(key)
        return 0 if entry is None else entry.replays

    def turn_off(self, reason: str) -> None:
        """Drop every capture and run eagerly from now on (`failed` says why), with a warning."""
        self.failed = reason
        self.graphs.clear()
        logger.warning("ddtree: step captures turned off (%s); the step runs eagerly from now on", reason)
