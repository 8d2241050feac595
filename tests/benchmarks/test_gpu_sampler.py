"""`benchmarks/gpu_sampler.py`'s busy fraction: the mean utilisation of the named GPUs over the samples read in a
window of time (the e2e benchmark's steady state, without its warm-up steps)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks import each other

from gpu_sampler import GpuSampler  # noqa: E402


def test_busy_is_the_mean_over_the_named_gpus_within_the_window() -> None:
    sampler = GpuSampler()  # not started: samples as nvidia-smi's reader would record them, (time, utilisation)
    sampler.samples = {
        0: [(0.0, 0.0), (1.0, 0.1), (2.0, 0.9), (3.0, 1.0)],  # an engine GPU: idle while warming up, then busy
        1: [(0.0, 0.2), (1.0, 0.2), (2.0, 0.6), (3.0, 0.8)],
        2: [(2.0, 0.0)],  # a GPU of neither side
    }
    assert sampler.busy([0, 1]) == pytest.approx(0.475)  # the whole run: every sample of both
    assert sampler.busy([0, 1], 2.0, 3.0) == pytest.approx(0.825)  # the window's bounds are included
    assert sampler.busy([0], 1.5) == pytest.approx(0.95) and sampler.busy([0], None, 1.0) == pytest.approx(0.05)
    assert sampler.busy([0, 1], 4.0) is None  # no sample in the window (a run too short for the sampling period)
    assert sampler.busy([5]) is None  # a GPU nvidia-smi did not list (on CPU: none)
