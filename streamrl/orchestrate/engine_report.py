"""Why a wait for groups ran out: where each engine's loop stands, in one line each.

`engines_report(engines, timeout_s)` asks every engine actor for `RolloutWorker.loop_state()` at once (which also
writes the stacks of the engine's threads to its log) and returns "engine-i: key=value, ..." lines joined by "; ";
an engine that does not answer within `timeout_s` (hung, or dead) is named so. For the errors of the driver's waits:
a run that stops making steps says which stage holds the groups (generating, scoring, the outbox, admission) and
whether an engine's loop still goes round.
"""

from __future__ import annotations

from typing import Any


def engines_report(engines: list[Any], timeout_s: float = 10.0) -> str:
    import ray

    asks = [engine.loop_state.remote() for engine in engines]
    lines = []
    for slot, ask in enumerate(asks):
        try:
            state = ray.get(ask, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - what this engine could not say is part of the report
            lines.append(f"engine-{slot}: no answer ({type(exc).__name__})")
            continue
        lines.append(f"engine-{slot}: " + ", ".join(f"{key}={value}" for key, value in state.items()))
    return "; ".join(lines)
