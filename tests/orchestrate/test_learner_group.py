"""The learner group's start-up: a rendezvous port picked free but taken by another process before rank 0 listens on it
(EADDRINUSE, a race on any busy node) makes the ranks start again on another port; a port the config names and
another process holds is an error naming `learner.master_port`."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run
from streamrl.orchestrate.placement import Placement
from tests.orchestrate.parity import tiny_config


def test_a_rendezvous_port_taken_before_rank_0_listens_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:  # another process's listener
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        picked: list[int] = []
        rendezvous = Placement.rendezvous

        def first_pick_taken(placement: Placement) -> tuple[str, int]:
            host, free = rendezvous(placement)
            picked.append(free)
            return host, port if len(picked) == 1 else free

        monkeypatch.setattr(Placement, "rendezvous", first_pick_taken)
        config = tiny_config(tmp_path / "picked", "wandb.mode=disabled", "train.checkpoint_every=0")
        prepare_run(config)
        with Cluster(config) as cluster:
            assert len(picked) == 2  # started again on the second pick
            assert cluster.learner_step(1)["train/policy_version"] == 1

        named = tiny_config(tmp_path / "named", "wandb.mode=disabled", f"learner.master_port={port}")
        prepare_run(named)
        with pytest.raises(RuntimeError, match=f"learner.master_port: {port} is in use"):
            Cluster(named).__enter__()
