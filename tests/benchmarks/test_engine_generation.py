"""`benchmarks/engine_generation.py` gives every arrangement the same work: the first prompts of engine 0's stream,
each response as long as the task asks (the long tail of `task.exact_lengths`), so that standalone vLLM, the bare
engine and the rollout loop are compared on the same tokens."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks import each other

from engine_generation import _prompt_ids, _sampling_params  # noqa: E402

from streamrl.config import load_config  # noqa: E402
from streamrl.orchestrate.driver import ensure_model  # noqa: E402
from streamrl.rollout.prompts import PromptSource  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_every_arrangement_samples_the_lengths_the_task_asks(tmp_path: Path) -> None:
    long_tail = ["task.exact_lengths=true", "task.long_fraction=0.5", "task.target_length=8", "task.long_factor=4"]
    config = load_config(CONFIGS / "tiny.yaml", [f"model.path={tmp_path / 'm'}", "rollout.max_tokens=64", *long_tail])
    ensure_model(config)
    drawn = _prompt_ids(config, 16)
    stream = PromptSource(config.task, seed=config.run.seed * 1000)  # engine 0's, as its rollout loop draws them
    assert [exact for _, exact in drawn] == [next(stream).exact_length for _ in range(16)]
    assert {exact for _, exact in drawn} == {8, 32}  # both lengths of the tail among the first 16
    long = _sampling_params(config, 32)
    assert (long.max_tokens, long.ignore_eos, long.n, long.logprobs) == (32, True, config.rollout.n, 0)
    free = _sampling_params(config, None)  # no exact length: up to max_tokens, ended by end-of-sequence
    assert (free.max_tokens, free.ignore_eos) == (config.rollout.max_tokens, False)
