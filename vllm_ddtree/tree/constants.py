"""Constant tensors of the step path, made once per shape and device and then shared.

An index range or a filled block made afresh is one more kernel launch per step on a GPU; made once,
it is none (and a CUDA graph captures it as a plain input). Made on the device by fills or `arange`:
a host-to-device copy from pageable memory would wait for the device.

Shared: never write into one (use out-of-place ops: `scatter`, not `scatter_`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.lru_cache(maxsize=1024)
def device_ints(values: tuple[int, ...], device: torch.device) -> Tensor:
    """[len(values)] int64 `values` on `device` (digit weights, one-element constants)."""
    out = torch.empty(len(values), dtype=torch.int64, device=device)
    for i, v in enumerate(values):
        out[i : i + 1].fill_(v)
    return out


@functools.lru_cache(maxsize=1024)
def arange(stop: int, device: torch.device, start: int = 0) -> Tensor:
    """[stop - start] int64 start, start + 1, ..., stop - 1 on `device`."""
    return torch.arange(start, stop, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=1024)
def filled(shape: tuple[int, ...], value: float | int | bool, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A `shape` block of `value` on `device`."""
    return torch.full(shape, value, dtype=dtype, device=device)
