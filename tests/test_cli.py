"""`streamrl status` and `streamrl stop` refuse what is not a run directory, and `status` names a status file that is
not one, each with exit code 2 and nothing written; a run directory whose job has not started has no status yet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrl.cli import main
from streamrl.monitor.health import STATUS_FILE


@pytest.mark.parametrize("command", ["status", "stop"])
def test_a_directory_without_a_config_is_not_a_run_directory(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, str(tmp_path)]) == 2
    assert f"{tmp_path} is not a run directory (no config.yaml)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no stop request left behind


@pytest.mark.parametrize("content", ['{"step": 3, "upd', "[3]"], ids=["cut-short", "not-an-object"])
def test_a_status_file_that_is_not_one_is_named(
    tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.yaml").write_text("run: {}\n")
    (tmp_path / STATUS_FILE).write_text(content)
    assert main(["status", str(tmp_path)]) == 2
    assert f"{tmp_path / STATUS_FILE} is not a status file (" in capsys.readouterr().err


def test_a_run_without_status_has_not_started_and_a_written_one_is_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.yaml").write_text("run: {}\n")
    assert main(["status", str(tmp_path)]) == 0
    assert "no status (the job has not started)" in capsys.readouterr().out
    (tmp_path / STATUS_FILE).write_text(json.dumps({"updated": 0.0, "step": 7, "perf/tokens_per_s": 12.5}))
    assert main(["status", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert f"{tmp_path}: step 7" in shown and "perf/tokens_per_s: 12.5" in shown
