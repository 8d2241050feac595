"""`streamrl status` and `streamrl stop` refuse what is not a run directory, and `status` names a status file that is
not one, each with exit code 2 and nothing written; a run directory whose job has not started has no status yet.
`streamrl train` refuses a model directory without the model's config or weights, a reward whose code is not there,
a prompts file that is missing or has a bad row, and a run whose checkpoint to resume from is not one, with exit code
2 naming the key or file, before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrl.cli import main
from streamrl.models import write_tiny_model
from streamrl.monitor.health import STATUS_FILE

TINY_CONFIG = Path(__file__).parents[1] / "configs" / "tiny.yaml"


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


def _train(run_dir: Path, model_dir: Path, *more: str) -> int:
    return main(
        ["train", "-c", str(TINY_CONFIG), f"run.dir={run_dir}", f"model.path={model_dir}", "--no-progress", *more]
    )


def test_train_refuses_a_model_directory_without_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "model"
    assert _train(tmp_path / "run", model_dir, "model.init_if_missing=null") == 2
    assert f"model.path: no config.json in {model_dir}" in capsys.readouterr().err
    write_tiny_model(model_dir, "qwen3")
    shard = model_dir / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    assert _train(tmp_path / "run", model_dir) == 2
    assert f"{shard}: not a safetensors file" in capsys.readouterr().err
    shard.unlink()
    assert _train(tmp_path / "run", model_dir) == 2
    assert f"model.path: no *.safetensors files in {model_dir}" in capsys.readouterr().err


def test_train_refuses_to_resume_from_a_checkpoint_that_is_not_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000003"
    checkpoint.mkdir(parents=True)
    (checkpoint.parent / "latest").write_text(checkpoint.name)
    (checkpoint / "meta.json").write_text("{}")
    assert _train(tmp_path / "run", tmp_path / "model") == 2
    assert f"checkpoint error: {checkpoint / 'meta.json'}: field 'format' must be int" in capsys.readouterr().err
    assert (checkpoint / "meta.json").read_text() == "{}"  # left as it was


def test_train_refuses_a_reward_whose_code_is_not_there(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _train(tmp_path / "run", tmp_path / "model", f"task.reward={tmp_path / 'reward.py'}:score") == 2
    assert f"config error: task.reward: no Python file at {tmp_path / 'reward.py'}" in capsys.readouterr().err


def test_train_refuses_a_prompts_file_that_is_missing_or_has_a_bad_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    assert _train(tmp_path / "run", tmp_path / "model", f"task.prompts_file={prompts}") == 2
    assert f"config error: task.prompts_file: no file at {prompts}" in capsys.readouterr().err
    prompts.write_text('{"prompt": "repeat #", "answer": "#"}\n{"prompt": "repeat *"}\n')
    assert _train(tmp_path / "run", tmp_path / "model", f"task.prompts_file={prompts}") == 2
    assert f"config error: task.prompts_file: {prompts} row 2 has no key 'answer'" in capsys.readouterr().err
