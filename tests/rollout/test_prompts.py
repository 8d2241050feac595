"""Prompt streams are seeded and resume exactly from their torchdata state."""

import json
from pathlib import Path

import pytest

from streamrl.config import TaskConfig
from streamrl.rollout.prompts import PromptSource


def test_symbols_stream_resumes_from_state() -> None:
    source = PromptSource(TaskConfig(), seed=3)
    first = [next(source) for _ in range(5)]
    assert all(p.answer in TaskConfig().symbols and p.text == f"repeat {p.answer * 4}" for p in first)
    state = source.state_dict()
    expected = [next(source) for _ in range(5)]
    resumed = PromptSource(TaskConfig(), seed=3)
    resumed.reset(state)
    assert [next(resumed) for _ in range(5)] == expected


def test_jsonl_file_cycles_epochs_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"{i}+{i}=?", "a": str(2 * i)}) for i in range(4)))
    task = TaskConfig(name="math", prompts_file=path, prompt_key="q", answer_key="a")
    source = PromptSource(task, seed=0)
    epoch = [next(source) for _ in range(4)]
    assert sorted(p.answer for p in epoch) == ["0", "2", "4", "6"]
    next(source)
    state = source.state_dict()
    assert state == {"epoch": 1, "index": 1}
    resumed = PromptSource(task, seed=0)
    resumed.reset(state)
    assert next(resumed) == next(source)


def test_bad_prompt_file_names_row_and_key(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="row 1 has no key 'answer'"):
        PromptSource(TaskConfig(name="math", prompts_file=path), seed=0)
    with pytest.raises(FileNotFoundError, match=f"task.prompts_file: no file at {tmp_path / 'none.jsonl'}"):
        PromptSource(TaskConfig(name="math", prompts_file=tmp_path / "none.jsonl"), seed=0)


def test_parquet_prompt_file(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=?", "2+2=?"], "answer": ["2", "4"]}), path)
    source = PromptSource(TaskConfig(name="math", prompts_file=path), seed=0)
    assert sorted(next(source).answer for _ in range(2)) == ["2", "4"]


def test_long_tail_symbols_prompts_name_their_target() -> None:
    task = TaskConfig(long_fraction=0.25, long_factor=8, target_length=12)
    source = PromptSource(task, seed=1)
    prompts = [next(source) for _ in range(400)]
    long = [p for p in prompts if len(p.answer) > 1]
    assert 0.15 < len(long) / len(prompts) < 0.35
    assert all(p.answer == p.answer[0] + "96" and p.text.endswith(" x96") for p in long)
    short = [p for p in prompts if len(p.answer) == 1]
    assert all(p.text == f"repeat {p.answer * 4}" for p in short)
    assert all(p.exact_length is None for p in prompts)  # responses end where the model ends them


def test_exact_lengths_give_each_prompt_its_target_in_tokens() -> None:
    task = TaskConfig(long_fraction=0.25, long_factor=8, target_length=12, exact_lengths=True)
    source = PromptSource(task, seed=1)
    prompts = [next(source) for _ in range(200)]
    assert {p.exact_length for p in prompts if len(p.answer) > 1} == {96}
    assert {p.exact_length for p in prompts if len(p.answer) == 1} == {12}
