"""The port a test's `vllm serve` gets: free, outside the kernel's ephemeral range, not handed out twice."""

import socket

from conftest import _ports, free_port


def test_a_server_port_is_free_below_the_ephemeral_range_and_never_given_twice():
    low = _ports._ephemeral_low()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        if low > 20000:  # Linux: the kernel never hands these out by itself
            assert 20000 <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
