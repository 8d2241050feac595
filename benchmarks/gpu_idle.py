"""Where a profiled step leaves the GPU idle: each gap between kernels charged to what the host launched after it.

Contract: `idle_report(events, top)` takes torch.profiler's `prof.events()` (CUDA kernels with their time ranges; the
CUDA runtime and driver calls that launched them as CPU events with the same `id`, CUPTI's correlation id, nested
under the op that made them, `cpu_parent`) and returns report lines:

- the GPU's idle time between its first kernel's start and its last one's end (the gaps in the union of all kernel
  intervals, every stream together) and how it splits by gap length: below 0.1 ms is the host's launch latency
  between back-to-back kernels, longer gaps are host work with no kernel queued behind it;
- the idle time that follows a host synchronisation (a `cudaStreamSynchronize`, `cudaDeviceSynchronize`,
  `cudaEventSynchronize` or blocking `cudaMemcpy` ending inside the gap: the host waited for the GPU to drain, so
  the GPU then waited for the host to launch again), by the op that synchronised;
- the idle time by the step's phase and by the op whose kernel ended the gap, named with the root of that op's
  CPU-parent chain: an autograd node (`autograd::engine::evaluate_function: MmBackward0`) in the backward, the
  optimizer's `Optimizer.step#...` annotation, else the top-level op of the forward.

A gap is the host's lateness in launching the kernel after it, so this answers "which host work is the GPU waiting
for". Used by `benchmarks.learner_mfu.profile_step` (every `--profile` of the learner benchmarks).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from torch.autograd import DeviceType

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_BACKWARD_ROOT = "autograd::engine::evaluate_function: "


def _is_sync(name: str) -> bool:
    return name.startswith(SYNC_CALLS) and "Async" not in name  # cudaMemcpyAsync returns at once


def _root(op: Any) -> Any:
    while op.cpu_parent is not None:
        op = op.cpu_parent
    return op


def _phase(root_name: str) -> str:
    if root_name.startswith(_BACKWARD_ROOT):
        return "backward"
    if root_name.startswith("Optimizer."):
        return "optimizer"
    return "forward and the rest"


def _label(op: Any | None) -> tuple[str, str]:
    """(root name, op name) of a launching op; unknown when the profiler linked none."""
    if op is None:
        return "(no linked op)", "(no linked op)"
    return _root(op).name, op.name


def _charge(entry: list[float], gap: float) -> None:
    """Add one gap to an [idle seconds, gaps] entry."""
    entry[0] += gap
    entry[1] += 1


def idle_report(events: Iterable[Any], top: int = 12) -> list[str]:
    """Report lines for one profiled window; see the module docstring."""
    events = list(events)
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if not kernels:
        return ["GPU idle: no GPU kernels in the profile"]
    # CUDA runtime / driver calls (cudaLaunchKernel, cuLaunchKernel, cudaMemcpyAsync, ...): a kernel has its
    # launch's correlation id, and the call sits under the op that made it.
    calls = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("cu")]
    launches = {e.id: e for e in calls}
    syncs = sorted(((e.time_range.end, e.cpu_parent) for e in calls if _is_sync(e.name)), key=lambda s: s[0])
    by_length = {"< 0.1 ms": 0.0, "0.1-1 ms": 0.0, "> 1 ms": 0.0}
    by_phase: dict[str, float] = defaultdict(float)
    by_op: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    after_sync: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    busy_until, idle, gaps, next_sync = kernels[0].time_range.end, 0.0, 0, 0
    for kernel in kernels[1:]:
        start = kernel.time_range.start
        if start > busy_until:
            gap = (start - busy_until) / 1e6  # µs -> s
            idle, gaps = idle + gap, gaps + 1
            by_length["< 0.1 ms" if gap < 1e-4 else "0.1-1 ms" if gap < 1e-3 else "> 1 ms"] += gap
            launch = launches.get(kernel.id)
            root, name = _label(None if launch is None else launch.cpu_parent)
            by_phase[_phase(root)] += gap
            _charge(by_op[(root, name)], gap)
            while next_sync < len(syncs) and syncs[next_sync][0] < busy_until:
                next_sync += 1
            if next_sync < len(syncs) and syncs[next_sync][0] <= start:  # a sync returned inside this gap
                _charge(after_sync[_label(syncs[next_sync][1])], gap)
        busy_until = max(busy_until, kernel.time_range.end)
    window = (busy_until - kernels[0].time_range.start) / 1e6
    lines = [
        f"GPU idle {idle:.3f} s of the {window:.3f} s from first to last kernel ({idle / window:.0%}) in {gaps} gaps: "
        + ", ".join(f"{length} {seconds:.3f} s" for length, seconds in by_length.items()),
        "idle by the phase of the kernel after the gap: "
        + ", ".join(f"{phase} {seconds:.3f} s" for phase, seconds in sorted(by_phase.items(), key=lambda i: -i[1])),
    ]

    def table(rows: dict[tuple[str, str], list[float]], title: str) -> list[str]:
        ranked = sorted(rows.items(), key=lambda item: -item[1][0])[:top]
        return [f"{title}:", f"{'idle ms':>9}{'gaps':>7}  root / op"] + [
            f"{seconds * 1e3:>9.1f}{count:>7}  {root[:90]} / {name[:60]}" for (root, name), (seconds, count) in ranked
        ]

    synced = sum(seconds for seconds, _ in after_sync.values())
    lines.append(f"idle after a host synchronisation: {synced:.3f} s in {sum(c for _, c in after_sync.values())} gaps")
    if after_sync:
        lines += table(after_sync, "  by the op that synchronised")
    lines += table(by_op, "idle by the op whose kernel ended the gap")
    return lines
