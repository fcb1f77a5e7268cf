"""A TCP port for a local `vllm serve` that no other process is handed before the server binds it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_given: set[int] = set()  # ports handed out by this process (two servers started at once differ)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, below the kernel's ephemeral range where it has one.

    A port the kernel hands out (a bind to port 0) and that is then released goes back to its
    ephemeral pool: until the server binds it, any process's outgoing connection or port-0 bind may
    take it, and vLLM's start-up binds several (a server started beside an offline engine failed with
    "Address already in use"). Below that range the kernel hands out nothing by itself."""
    low = _ephemeral_low()
    if low > 20000:
        for port in random.sample(range(20000, low), min(200, low - 20000)):
            if port in _given:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _given.add(port)
            return port
    with socket.socket() as s:  # no range known: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (0 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
