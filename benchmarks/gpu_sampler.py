"""Every GPU's utilisation by nvidia-smi, sampled on a thread: the benchmarks' "GPU busy" columns.

Contract: `GpuSampler().start()` samples every GPU every 0.5 s until `stop()`; `busy(gpus, start, end)` is the mean
utilisation (0-1) of those GPU indices over the samples read in the `time.monotonic()` window [start, end] (either
bound None: open), None where nvidia-smi is absent (CPU) or gave none there. nvidia-smi numbers
GPUs physically; `visible_gpu(i)` maps this process's CUDA device `i` to that number (through
`CUDA_VISIBLE_DEVICES`), so benchmarks run side by side on different GPUs each report their own.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import threading
import time


class GpuSampler:
    """nvidia-smi's utilisation of every GPU, sampled every 0.5 s on a thread until stopped."""

    def __init__(self) -> None:
        self.samples: dict[int, list[tuple[float, float]]] = {}  # GPU -> (monotonic time read, utilisation 0-1)
        self._process: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if shutil.which("nvidia-smi") is None:
            return
        command = ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-lms", "500"]
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            index, utilisation = (part.strip() for part in line.split(","))
            self.samples.setdefault(int(index), []).append((time.monotonic(), float(utilisation) / 100))

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)

    def busy(self, gpus: list[int], start: float | None = None, end: float | None = None) -> float | None:
        low, high = -math.inf if start is None else start, math.inf if end is None else end
        values = [v for g in gpus for t, v in self.samples.get(g, []) if low <= t <= high]
        return statistics.fmean(values) if values else None


def visible_gpu(index: int) -> int:
    """nvidia-smi's number of this process's CUDA device `index` (CUDA_VISIBLE_DEVICES, when it lists numbers)."""
    listed = [part.strip() for part in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if part.strip()]
    if index < len(listed) and listed[index].isdigit():
        return int(listed[index])
    return index
