"""Small networking helpers shared by the stages: free ports for listening sockets, the Ray node a process runs on."""

from __future__ import annotations

import socket
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (the caller binds it soon after)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ray_node() -> dict[str, Any]:
    """The Ray node this process runs on (inside a Ray worker or driver): its node id, IP address and the GPUs Ray
    gave this process (their indices on the node)."""
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "gpus": [int(g) for g in ray.get_gpu_ids()],
    }
