"""The stall watch counts only the time spent waiting on the engine since its last token: short waits without tokens
add up, a token starts the count again, time between the waits is free, and a wait that never returns is seen by the
watch's own thread. Before the first token the bound is the longer first-token one.
"""

import threading
import time

import pytest

from streamrl.rollout.stall_watch import StallWatch


class _Stalls:
    """What the watch reports, and when."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.seen = threading.Event()

    def __call__(self, message: str) -> None:
        self.messages.append(message)
        self.seen.set()


def test_waits_without_a_token_add_up_and_a_token_starts_again() -> None:
    stalls = _Stalls()
    watch = StallWatch(1.5, stalls)  # wide margins: sleeps overshoot on a loaded machine
    try:
        for _ in range(3):  # 0.3 s of waiting, each wait followed by a token
            with watch.waiting():
                time.sleep(0.1)
            watch.progressed()
        time.sleep(1.6)  # outside any wait: not counted
        assert watch.waited_s() == 0.0 and not stalls.messages
        for _ in range(4):  # 0.4 s of short waits without a token, then time outside them
            with watch.waiting():
                time.sleep(0.1)
        time.sleep(1.6)
        assert 0.4 <= watch.waited_s() < 1.5 and not stalls.messages
        with watch.waiting():  # the fifth wait passes the bound
            time.sleep(1.2)
        assert stalls.seen.wait(2.0)
        assert len(stalls.messages) == 1 and "rollout.stall_timeout_s" in stalls.messages[0]
    finally:
        watch.close()


def test_a_wait_that_never_returns_is_seen_from_the_watch_thread(capfd: pytest.CaptureFixture[str]) -> None:
    stalls = _Stalls()
    watch = StallWatch(0.3, stalls)
    released = threading.Event()

    def blocked_step_in_vllm() -> None:  # a decoding step blocked in vLLM: it returns only after the watch reported it
        with watch.waiting():
            released.wait(10.0)

    stepping = threading.Thread(target=blocked_step_in_vllm)
    started = time.monotonic()
    stepping.start()
    try:
        assert stalls.seen.wait(5.0)
        assert 0.3 <= time.monotonic() - started < 2.0
        assert stepping.is_alive()  # seen while the wait was still blocked
        assert "blocked_step_in_vllm" in capfd.readouterr().err  # the stacks, for the diagnosis: where it waited
    finally:
        released.set()
        stepping.join()
        watch.close()


def test_the_first_token_has_its_own_longer_bound() -> None:
    stalls = _Stalls()
    watch = StallWatch(0.3, stalls, first_token_timeout_s=1.5)
    try:
        with watch.waiting():  # an engine's first step, slow: past the bound of later tokens, within the first's
            time.sleep(0.8)
        time.sleep(0.3)  # the watch thread looks several times meanwhile
        assert not stalls.messages
        watch.progressed()  # the first token: from now on the short bound
        with watch.waiting():
            assert stalls.seen.wait(3.0)
        assert len(stalls.messages) == 1 and "made no token" in stalls.messages[0]
    finally:
        watch.close()


def test_an_engine_that_never_makes_a_first_token_is_seen_at_the_first_token_bound() -> None:
    stalls = _Stalls()
    watch = StallWatch(0.3, stalls, first_token_timeout_s=0.6)
    try:
        started = time.monotonic()
        with watch.waiting():
            assert stalls.seen.wait(5.0)
        assert time.monotonic() - started >= 0.6 and "made no first token" in stalls.messages[0]
    finally:
        watch.close()


@pytest.mark.parametrize("bounds", [(0.0, None), (1.0, 0.0)])
def test_a_bound_that_is_not_positive_is_refused(bounds: tuple[float, float | None]) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        StallWatch(bounds[0], _Stalls(), first_token_timeout_s=bounds[1])
