"""`streamrl.net.free_port`: the kernel's pick by default, a port of STREAMRL_PORT_RANGE when set, errors naming it."""

import socket

import pytest

from streamrl.net import PORT_RANGE_VAR, free_port, port_range


def test_without_a_range_the_kernel_picks_a_bindable_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_RANGE_VAR, raising=False)
    assert port_range() is None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))


def _two_free_ports() -> tuple[int, int]:
    """Two neighbouring ports of this worker's range (tests/conftest.py) that are free now."""
    while True:
        low = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", low + 1))
            except OSError:
                continue
        return low, low + 1


def test_ports_come_from_the_range_and_skip_the_taken_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    low, high = _two_free_ports()
    with socket.socket() as held:
        held.bind(("127.0.0.1", low))
        held.listen()
        # A range of two ports, one of them held: every pick is the other one.
        monkeypatch.setenv(PORT_RANGE_VAR, f"{low}-{high}")
        assert port_range() == (low, high)
        assert {free_port() for _ in range(20)} == {high}
        monkeypatch.setenv(PORT_RANGE_VAR, f"{low}-{low}")
        with pytest.raises(RuntimeError, match=f"{PORT_RANGE_VAR}={low}-{low}: no free port .* among 1 tried"):
            free_port()


def test_the_test_workers_pick_from_their_own_range_below_the_ephemeral_ports() -> None:
    low, high = port_range()  # set by tests/conftest.py for this worker
    assert 20000 <= low <= high < 32768
    assert low <= free_port() <= high


@pytest.mark.parametrize("raw", ["20000", "a-b", "20000-19999", "80-90", "20000-70000", "1-2-3"])
def test_a_malformed_range_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(PORT_RANGE_VAR, raw)
    with pytest.raises(ValueError, match=PORT_RANGE_VAR):
        port_range()
