"""Small networking helpers shared by the stages: free ports for listening sockets, the Ray node a process runs on.

`free_port(host)` is a TCP port free on `host` right now, which the caller binds soon after. By default the kernel
picks it (from its ephemeral range). With `STREAMRL_PORT_RANGE=LOW-HIGH` in the environment it is one of the ports
LOW..HIGH (inclusive): the ports a firewall opens between nodes, or disjoint ranges for processes that pick ports side
by side (the test workers). A range outside the kernel's ephemeral range also keeps an outgoing connection of another
process from taking the port between the pick and the bind. A malformed range is a `ValueError` naming the variable.
"""

from __future__ import annotations

import os
import random
import socket
from typing import Any

PORT_RANGE_VAR = "STREAMRL_PORT_RANGE"
# Ports of a range tried before giving up: a range that is mostly taken is a misconfiguration, not a reason to scan it.
_PORT_TRIES = 256
# Not the `random` module's state: processes forked from one parent would share it, and pick the same ports.
_chooser = random.SystemRandom()


def port_range() -> tuple[int, int] | None:
    """`STREAMRL_PORT_RANGE` as (low, high), inclusive; None when unset or empty."""
    raw = os.environ.get(PORT_RANGE_VAR, "").strip()
    if not raw:
        return None
    try:
        low, high = (int(part) for part in raw.split("-"))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_VAR}={raw!r}: expected LOW-HIGH, e.g. 20000-20999") from None
    if not 1024 <= low <= high <= 65535:
        raise ValueError(f"{PORT_RANGE_VAR}={raw!r}: expected 1024 <= LOW <= HIGH <= 65535")
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (the caller binds it soon after); see the module docstring."""
    span = port_range()
    if span is None:
        with socket.socket() as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]
    low, high = span
    tries = min(_PORT_TRIES, high - low + 1)
    for port in _chooser.sample(range(low, high + 1), tries):
        if _bindable(host, port):
            return port
    raise RuntimeError(f"{PORT_RANGE_VAR}={low}-{high}: no free port on {host} among {tries} tried")


def ray_node() -> dict[str, Any]:
    """The Ray node this process runs on (inside a Ray worker or driver): its node id, IP address and the GPUs Ray
    gave this process (their indices on the node)."""
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "gpus": [int(g) for g in ray.get_gpu_ids()],
    }
