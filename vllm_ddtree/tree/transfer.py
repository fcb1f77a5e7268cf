"""Copies between the host and the device, the two ways ddtree makes them.

Host to device: `to_device`, queued (pinned memory), never waited for. Device to host: `to_host`,
which waits for the device and is therefore counted (`HostReads`): the step makes one such copy,
the draft lists vLLM's scheduler takes; and `to_host_later`, queued and read only once the device
has made it (a table's length, for the next step), which never waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """`t` on `device`; a host tensor bound for a GPU goes through pinned memory, non-blocking.

    A plain copy from pageable host memory blocks the host until the GPU has drained its queue,
    and a `non_blocking` one from pageable memory is silently synchronous too (vLLM's
    VLLM_GPU_SYNC_CHECK reports both); from pinned memory the copy is queued and the host goes on.
    """
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_device_together(tensors: Sequence[Tensor], device: torch.device | str) -> tuple[Tensor, ...]:
    """Host tensors of one shape and dtype on `device` in one copy: stacked on the host, unbound on
    the device (two device ops, whatever their number)."""
    return tuple(to_device(torch.stack(list(tensors)), device).unbind(0))


class HostReads:
    """Device-to-host reads ddtree makes on purpose (`to_host`), counted so a benchmark or a test can
    check the step makes the one copy the scheduler needs and no other."""

    count: int = 0

    @classmethod
    def reset(cls) -> int:
        """The count so far; starts a new one."""
        n, cls.count = cls.count, 0
        return n


def to_host(t: Tensor) -> Tensor:
    """`t` on the host: the one way ddtree reads device data (counted in `HostReads`).

    On a GPU this waits for the queue up to `t`, so the step path calls it once, for what vLLM's
    scheduler takes as Python lists; everything else stays on the device.
    """
    HostReads.count += 1
    return t.cpu()


@dataclass
class HostLater:
    """A device value on its way to the host: the copy is queued, and `get` returns it once the
    device has made it (None before), without waiting. Read it a step later: by then the step's one
    wait (`to_host`) has let the device catch up."""

    host: Tensor
    event: object | None = None  # a CUDA event recorded after the copy (None: the copy was made)

    def get(self) -> Tensor | None:
        """The host copy, or None while the device has not made it yet (never, from meta tensors)."""
        if self.host.device.type != "cpu" or (self.event is not None and not self.event.query()):
            return None
        return self.host


def to_host_later(t: Tensor) -> HostLater:
    """`t` copied to the host without waiting (pinned memory, non-blocking, and an event to ask);
    not a read of device data until `HostLater.get`, which never waits either."""
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return HostLater(host, event)
    return HostLater(t.detach().clone())
