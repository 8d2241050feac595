"""`benchmarks/stack_sampler.py`: a thread's stack, sampled, says where it spends its time."""

from __future__ import annotations

import threading
import time

from benchmarks.stack_sampler import StackSampler


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _sleep_then_spin(done: threading.Event) -> None:
    time.sleep(0.15)
    _spin(0.45)
    done.set()


def test_the_samples_split_a_threads_time_between_its_functions() -> None:
    done = threading.Event()
    worker = threading.Thread(target=_sleep_then_spin, args=(done,))
    worker.start()
    assert worker.ident is not None
    stacks = StackSampler(worker.ident).start()
    done.wait(10)
    stacks.stop()
    worker.join()
    assert stacks.samples > 50
    spin = stacks.share("_spin")
    # Three quarters of the thread's time, the rest asleep before it; sampled 5x less often while it spins (it holds
    # the GIL), weighed by time.
    assert 0.6 < spin < 0.9
    assert stacks.share("_sleep_then_spin") > 0.95 and stacks.share("absent") == 0.0
    report = stacks.report(5)
    assert report.splitlines()[0].startswith(f"{stacks.samples} samples") and "_spin (test_stack_sampler.py:" in report
