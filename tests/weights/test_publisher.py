"""A sender's weight-group address: its store listens on the port from the answer on (no other process can take the
port before the group forms, as with a port picked free and bound later), and the group forms on that store."""

import multiprocessing as mp
import os
import socket

import pytest

from streamrl.config import TrainConfig
from streamrl.weights.publisher import StagePublisher

TIMEOUT_S = 30.0


def _receiver(host: str, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from streamrl.weights.transport import WeightGroup

    WeightGroup(host, port, 1, 2, generation=1, timeout_s=TIMEOUT_S)  # joins: returns once the group has formed


def test_the_store_listens_from_the_address_on_and_the_group_forms_on_it() -> None:
    publisher = StagePublisher(TrainConfig(publish_timeout_s=TIMEOUT_S), "cpu")
    host, port = publisher.address()
    with socket.create_connection((host, port), timeout=5):  # listening before any group is asked for
        pass
    with pytest.raises(RuntimeError, match="not the one this sender opened"):
        publisher.open(host, port + 1, 2, 1)
    receiver = mp.get_context("spawn").Process(target=_receiver, args=(host, port))
    receiver.start()
    try:
        publisher.open(host, port, 2, 1)
        receiver.join(TIMEOUT_S)
        assert receiver.exitcode == 0 and publisher.group is not None
    finally:
        if receiver.is_alive():
            receiver.kill()
