"""`benchmarks/e2e_async_vs_sync.py`'s reward at equal versions: each arrangement's reward over the same policy
versions, whatever lag its samples had; a comparison run in several invocations merged into one table; each
arrangement's split of the GPUs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks import each other

from e2e_async_vs_sync import _reward_at_equal_versions, arrangement, gpu_split, merge  # noqa: E402

from streamrl.config import load_config  # noqa: E402

MEASURED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "e2e_async_vs_sync_large_4gpu.json"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _run(steps: int, lag: int, reward_of_version: float) -> dict:
    """A run whose step s trained the samples of version s - 1 - lag (its learner's version before the step, less
    the lag), each sample scoring `reward_of_version` times its version."""
    rows = [[s - 1 - lag, reward_of_version * (s - 1 - lag)] for s in range(1, steps + 1)]
    return {"steps": steps, "reward_by_version": rows}


def test_async_is_compared_on_the_versions_sync_also_reached() -> None:
    sync, lagged = _run(16, 0, 0.01), _run(16, 2, 0.01)  # the same learning per version, two versions behind
    _reward_at_equal_versions([sync, lagged])
    # Versions 10-13: the last quarter of the highest version both reached (13, the lagged run's last).
    assert sync["reward_versions"] == lagged["reward_versions"] == [9, 13]
    expected = pytest.approx(math.fsum([0.10, 0.11, 0.12, 0.13]) / 4)
    assert sync["reward_at_equal_versions"] == expected and lagged["reward_at_equal_versions"] == expected
    # Per consumed sample the lagged run scores less, by its lag: what the column corrects for.
    consumed = [sum(r for _, r in run["reward_by_version"]) / 16 for run in (sync, lagged)]
    assert consumed[1] < consumed[0]


def test_invocations_merge_into_one_comparison(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The 4-GPU runs of the ~3.6B model, split as they ran (sync arrangements, then async), merged again."""
    runs = json.loads(MEASURED.read_text())["runs"]
    parts = []
    for name, part in (("sync", [r for r in runs if r["mode"] != "async"]), ("async", runs[2:4])):
        parts.append(tmp_path / f"{name}.json")
        parts[-1].write_text(json.dumps({"config": "c.yaml", "overrides": [name], "runs": part}))
    merge(parts, tmp_path / "merged.json")
    merged = json.loads((tmp_path / "merged.json").read_text())["runs"]
    assert [r["mode"] for r in merged] == ["sync", "colocated", "async", "async"]
    assert [r["overrides"] for r in merged] == [["sync"], ["sync"], ["async"], ["async"]]
    assert len({tuple(r["reward_versions"]) for r in merged}) == 1  # one window of versions for every arrangement
    table = capsys.readouterr().out
    # Runs measured before the GPU split was recorded show none; against the faster sync arrangement (split, 7.5k).
    assert "| async | - | 4 |" in table and "| 1.57 |" in table


def test_each_arrangement_names_its_gpu_split() -> None:
    """The 4-GPU config: two one-GPU engines and two learner ranks; colocated, four of each on the same GPUs; a merged
    table of several splits tells them apart by this."""
    base = load_config(CONFIGS / "qwen3-large-gpu.yaml", [])
    assert gpu_split(arrangement(base, "async", 2)) == "2x1 + 2"
    assert gpu_split(arrangement(base, "colocated", 1)) == "4x1 + 4 shared"
    one_engine = load_config(CONFIGS / "qwen3-large-gpu.yaml", ["rollout.engines=1", "learner.data_parallel=3"])
    assert gpu_split(arrangement(one_engine, "sync", 1)) == "1x1 + 3"
