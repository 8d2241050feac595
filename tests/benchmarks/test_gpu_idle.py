"""`benchmarks/gpu_idle.py` charges each gap between GPU kernels to the host work that ended it, on a hand-built
timeline of profiler events (the CPU machines have no CUDA kernels to profile)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from benchmarks.gpu_idle import idle_report


def _event(name: str, start: float, end: float, device: DeviceType, id: int = 0, parent=None):
    return SimpleNamespace(
        name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device, id=id, cpu_parent=parent
    )


def _cpu(name: str, start: float, end: float, id: int = 0, parent=None):
    return _event(name, start, end, DeviceType.CPU, id, parent)


def _launch(op, at: float, correlation: int):
    """The runtime call by which `op` launched the kernel of CUPTI correlation id `correlation`."""
    return _cpu("cudaLaunchKernel", at, at + 5, id=correlation, parent=op)


def _kernel(start: float, end: float, correlation: int):
    return _event("kernel", start, end, DeviceType.CUDA, id=correlation)


def test_gaps_are_charged_to_the_op_after_them_and_to_the_sync_before_them() -> None:
    # Forward: linear -> mm (op 1), then an .item() (op 2) whose sync returns at 2,100 µs, then mm (op 3) launched
    # late. Backward: MmBackward0 -> mm (op 4) after a 50 µs launch gap. Optimizer: a foreach op (op 5) after 2 ms.
    linear = _cpu("aten::linear", 0, 3000, id=10)
    item = _cpu("aten::_local_scalar_dense", 1000, 2100, id=2, parent=linear)
    backward = _cpu("autograd::engine::evaluate_function: MmBackward0", 3500, 4200, id=11)
    step = _cpu("Optimizer.step#AdamW.step", 6000, 9000, id=12)
    mm1 = _cpu("aten::mm", 10, 20, id=1, parent=linear)
    mm3 = _cpu("aten::mm", 2500, 2510, id=3, parent=linear)
    mm4 = _cpu("aten::mm", 3550, 3560, id=4, parent=backward)
    foreach = _cpu("aten::_foreach_add_", 6100, 6110, id=5, parent=step)
    events = [
        *(linear, mm1, item, mm3, backward, mm4, step, foreach),
        _cpu("cudaStreamSynchronize", 1010, 2100, id=102, parent=item),
        _cpu("cudaMemcpyAsync", 6200, 6210, id=106, parent=foreach),  # asynchronous: no sync
        *(_launch(mm1, 12, 101), _launch(mm3, 2502, 103), _launch(mm4, 3552, 104), _launch(foreach, 6102, 105)),
        _kernel(100, 2000, 101),
        _kernel(2600, 3700, 103),  # 600 µs idle after the sync
        _kernel(3750, 4000, 104),  # 50 µs launch gap
        _kernel(6000, 7000, 105),  # 2,000 µs gap
        _kernel(6500, 6800, 106),  # overlaps the previous kernel (another stream): no gap
    ]
    lines = idle_report(events)
    assert lines[0].startswith("GPU idle 0.003 s of the 0.007 s") and "in 3 gaps" in lines[0]
    assert "< 0.1 ms 0.000 s, 0.1-1 ms 0.001 s, > 1 ms 0.002 s" in lines[0]
    phases = "optimizer 0.002 s, forward and the rest 0.001 s, backward 0.000 s"
    assert lines[1] == f"idle by the phase of the kernel after the gap: {phases}"
    assert lines[2] == "idle after a host synchronisation: 0.001 s in 1 gaps"
    assert lines[5] == "      0.6      1  aten::linear / aten::_local_scalar_dense"  # the op that synchronised
    ranked = lines[lines.index("idle by the op whose kernel ended the gap:") + 2 :]
    assert [row.split("  ")[-1] for row in ranked] == [  # most idle first: 2 ms, 0.6 ms, 0.05 ms
        "Optimizer.step#AdamW.step / aten::_foreach_add_",
        "aten::linear / aten::mm",
        "autograd::engine::evaluate_function: MmBackward0 / aten::mm",
    ]


def test_a_profile_without_kernels_says_so() -> None:
    assert idle_report([_cpu("aten::mm", 0, 1, id=1)]) == ["GPU idle: no GPU kernels in the profile"]


@pytest.mark.parametrize("name", ["cudaMemcpyAsync", "cudaLaunchKernel"])
def test_asynchronous_calls_are_not_syncs(name: str) -> None:
    op = _cpu("aten::copy_", 0, 500, id=1)
    events = [op, _cpu(name, 10, 400, id=7, parent=op), _kernel(0, 100, 7), _kernel(300, 400, 8)]
    assert idle_report(events)[2] == "idle after a host synchronisation: 0.000 s in 0 gaps"
