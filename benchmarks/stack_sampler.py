"""Where one Python thread spends its time, by sampling its stack: the benchmarks' low-overhead profile.

Contract: `StackSampler(thread_id).start()` reads that thread's stack (`sys._current_frames`) every `interval_s`
(1 ms) on a thread of its own until `stop()`; `report(top)` is a text table of the functions by inclusive share (the
fraction of the time with the function anywhere on the stack) and by own share (on top of it). Each sample weighs
the wall time since the one before: the sampler needs the GIL to read a stack, so while the thread computes in
Python it samples only at the interpreter's switch interval (5 ms), and while the GIL is free (I/O, sleeps, native
calls that release it) every millisecond; counting samples would over-weigh the latter. Unlike cProfile it leaves
the profiled thread's speed nearly unchanged, so a loop's rate and its profile come from the same run; a thread
waiting for the GIL is sampled where it waits.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from types import FrameType


def _name(frame: FrameType) -> str:
    code = frame.f_code
    return f"{code.co_qualname} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


class StackSampler:
    """Samples thread `thread_id`'s stack every `interval_s` until stopped (module docstring)."""

    def __init__(self, thread_id: int, interval_s: float = 0.001):
        self.thread_id, self.interval_s = thread_id, interval_s
        self.samples, self.seconds = 0, 0.0
        self.inclusive: collections.Counter[str] = collections.Counter()  # function -> seconds on the stack
        self.own: collections.Counter[str] = collections.Counter()  # function -> seconds on top of it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            frame = sys._current_frames().get(self.thread_id)
            now = time.perf_counter()
            weight, last = now - last, now  # the wall time this stack stands for (module docstring)
            if frame is not None:
                self.samples += 1
                self.seconds += weight
                self.own[_name(frame)] += weight
                seen = set()
                while frame is not None:  # a recursive function counts once per sample
                    seen.add(_name(frame))
                    frame = frame.f_back
                for name in seen:
                    self.inclusive[name] += weight
            time.sleep(self.interval_s)

    def share(self, qualname: str) -> float:
        """The fraction of the sampled time with a function of this qualified name on the stack (0 without
        samples)."""
        spent = max((t for name, t in self.inclusive.items() if name.startswith(qualname + " ")), default=0.0)
        return spent / self.seconds if self.seconds else 0.0

    def report(self, top: int = 30) -> str:
        every = f"every {self.interval_s * 1e3:g} ms"
        lines = [f"{self.samples} samples of the thread's stack over {self.seconds:.2f} s, {every}"]
        for title, spent in (("inclusive (on the stack)", self.inclusive), ("own (top of the stack)", self.own)):
            lines += [f"{title}:", f"{'share':>7}  function"]
            lines += [f"{t / max(self.seconds, 1e-9):>7.1%}  {name}" for name, t in spent.most_common(top)]
        return "\n".join(lines)
