"""`benchmarks/engine_generation.py` gives every arrangement the same work: the first prompts of engine 0's stream,
each response as long as the task asks (the long tail of `task.exact_lengths`), so that standalone vLLM, the bare
engine and the rollout loop are compared on the same tokens; `engine-versions` restarts the requests in flight as
weight versions do and still generates exactly those tokens."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks import each other

from engine_generation import _bare_engine, _prompt_ids, _sampling_params  # noqa: E402
from gpu_sampler import GpuSampler  # noqa: E402

from streamrl.config import load_config  # noqa: E402
from streamrl.orchestrate.driver import ensure_model  # noqa: E402
from streamrl.rollout.prompts import PromptSource  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


LONG_TAIL = ["task.exact_lengths=true", "task.long_fraction=0.5", "task.target_length=8", "task.long_factor=4"]


def test_every_arrangement_samples_the_lengths_the_task_asks(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "tiny.yaml", [f"model.path={tmp_path / 'm'}", "rollout.max_tokens=64", *LONG_TAIL])
    ensure_model(config)
    drawn = _prompt_ids(config, 16)
    stream = PromptSource(config.task, seed=config.run.seed * 1000)  # engine 0's, as its rollout loop draws them
    assert [exact for _, exact in drawn] == [next(stream).exact_length for _ in range(16)]
    assert {exact for _, exact in drawn} == {8, 32}  # both lengths of the tail among the first 16
    long = _sampling_params(config, 32)
    assert (long.max_tokens, long.ignore_eos, long.n, long.logprobs) == (32, True, config.rollout.n, 0)
    free = _sampling_params(config, None)  # no exact length: up to max_tokens, ended by end-of-sequence
    assert (free.max_tokens, free.ignore_eos) == (config.rollout.max_tokens, False)


def test_requests_restarted_by_versions_still_make_exactly_the_asked_tokens(tmp_path: Path) -> None:
    overrides = [f"model.path={tmp_path / 'm'}", "rollout.max_tokens=64", "rollout.prompts_per_batch=4", *LONG_TAIL]
    config = load_config(CONFIGS / "tiny.yaml", overrides)
    ensure_model(config)
    expected = config.rollout.n * sum(exact for _, exact in _prompt_ids(config, 12))
    row = _bare_engine(config, 12, GpuSampler(), profile=False, version_every_s=0.01)
    assert row["versions"] >= 3, row  # restarts landed while requests were in flight
    assert (row["groups"], row["tokens"]) == (12, expected)
