"""streamrl.learner.checkpoint_meta.prune_checkpoints: all but the `keep` newest complete checkpoints go, the one
`latest` names stays whatever its age, and a crashed save's leftovers older than the latest go too."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from streamrl.learner.checkpoint_meta import FORMAT, LATEST, CheckpointMeta, prune_checkpoints, step_dir


def _complete(root: Path, step: int) -> Path:
    path = step_dir(root, step)
    (path / "dist").mkdir(parents=True)
    (path / "dist" / "metadata.json").write_text("{}")
    (path / "meta.json").write_text(json.dumps(asdict(CheckpointMeta(FORMAT, step, step, 1, 1, "h"))))
    return path


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_keeps_the_newest_complete_ones_and_drops_crashed_leftovers(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        _complete(tmp_path, step)
    (step_dir(tmp_path, 5) / "dist").mkdir(parents=True)  # a save that crashed before its meta.json
    (step_dir(tmp_path, 10) / "dist").mkdir(parents=True)  # newer than the latest: not this prune's to judge
    assert prune_checkpoints(tmp_path, 2) == []  # no `latest` yet: nothing is known to be complete
    (tmp_path / LATEST).write_text("step_00000008\n")
    removed = prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["step_00000002", "step_00000004", "step_00000005"]
    assert _names(tmp_path) == [LATEST, "step_00000006", "step_00000008", "step_00000010"]
    assert prune_checkpoints(tmp_path, 2) == []  # idempotent


def test_the_latest_stays_even_when_newer_complete_ones_exist(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _complete(tmp_path, step)
    (tmp_path / LATEST).write_text("step_00000001\n")  # a job resumed from an older checkpoint
    assert prune_checkpoints(tmp_path, 1) == []
    assert _names(tmp_path) == [LATEST, "step_00000001", "step_00000002", "step_00000003"]
    with pytest.raises(ValueError, match=r"train\.keep_checkpoints"):
        prune_checkpoints(tmp_path, 0)
