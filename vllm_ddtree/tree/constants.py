"""Constant tensors of the step path, made once and then shared.

An index range or a filled block made afresh is one more kernel launch per step on a GPU; a view of
one made once is none. The views are kept too (each shape's, up to `_VIEWS`): a view made afresh
launches no kernel but still costs a dispatch of host time, and a step asks for about twenty.
Memory stays bounded whatever shapes the steps take: a filled block is one scalar expanded (no
memory), an index range a slice of one range per device that grows by doubling to the longest
asked for. Made on the device (fills, `arange`): a host-to-device copy from pageable memory would
wait for the device.

Shared: never write into one (use out-of-place ops: `scatter`, not `scatter_`). Made on first use:
a CUDA graph's capture records kernels without running them, so a step is run eagerly before it is
captured (as vLLM warms up before capturing), and the constants it needs exist by then. Never freed:
a captured graph reads a constant by its address, so the memory under a view must outlive every
graph (kept views may be dropped; the ranges, scalars and int tuples under them are not, and a
range that grows keeps its predecessor).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

_RANGES: dict[torch.device, Tensor] = {}  # per device: 0, 1, ..., n - 1 (int64), n a power of two
_OUTGROWN: list[Tensor] = []  # ranges a longer one replaced: graphs captured before may still read them
# 512 KiB of int64: a step's longest range (requests x tree width, ~16K at 256 x 64) fits, so it
# seldom grows (a grown range makes every kept view anew once)
_FIRST_RANGE = 1 << 16
_VIEWS = 1024  # the views kept per kind (a step's shapes take a few dozen; serving adds a few per batch size)


@functools.cache  # never evicted (module docstring); the tuples are configuration constants
def device_ints(values: tuple[int, ...], device: torch.device) -> Tensor:
    """[len(values)] int64 `values` on `device` (digit weights, one-element constants); for values
    that do not depend on the step's shapes (each distinct tuple is kept)."""
    out = torch.empty(len(values), dtype=torch.int64, device=device)
    for i, v in enumerate(values):
        out[i : i + 1].fill_(v)
    return out


def arange(stop: int, device: torch.device, start: int = 0) -> Tensor:
    """[stop - start] int64 start, start + 1, ..., stop - 1 on `device` (a view)."""
    device = torch.device(device)
    base = _RANGES.get(device)
    if base is None or base.numel() < stop:
        size = _FIRST_RANGE
        while size < stop:
            size *= 2
        if base is not None:
            _OUTGROWN.append(base)
        base = _RANGES[device] = torch.arange(size, dtype=torch.int64, device=device)
    return _range_view(base, start, stop)


def arange_rows(rows: int, stop: int, device: torch.device, start: int = 0) -> Tensor:
    """[rows, stop - start] int64: each row start, start + 1, ..., stop - 1 (a view of `arange`'s)."""
    return _expanded(arange(stop, device, start), rows)


@functools.lru_cache(maxsize=_VIEWS)
def _expanded(row: Tensor, rows: int) -> Tensor:
    return row.expand(rows, row.shape[0])


@functools.lru_cache(maxsize=_VIEWS)
def _range_view(base: Tensor, start: int, stop: int) -> Tensor:
    # keyed by the base itself (hashed by identity): a grown range makes new views
    return base[start:stop]


def filled(shape: tuple[int, ...], value: float | int | bool, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A `shape` block of `value` on `device`: one stored scalar, expanded (a view)."""
    return _filled(tuple(shape), value, dtype, torch.device(device))


@functools.lru_cache(maxsize=_VIEWS)
def _filled(shape: tuple[int, ...], value: float | int | bool, dtype: torch.dtype, device: torch.device) -> Tensor:
    return _scalar(value, dtype, device).expand(shape)


@functools.cache  # never evicted (module docstring); the values are the code's own constants
def _scalar(value: float | int | bool, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.full((), value, dtype=dtype, device=device)


@functools.lru_cache(maxsize=256)
def eye(n: int, device: torch.device) -> Tensor:
    """[n, n] float32 identity on `device` (n^2 floats per size asked for: verify widths, at most a few hundred)."""
    return torch.eye(n, dtype=torch.float32, device=torch.device(device))
