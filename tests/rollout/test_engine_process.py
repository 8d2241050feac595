"""VLLMEngine with vLLM's engine core in a process of its own (`engine_process`): the core steps on its own, so a
version loaded while requests run must land between two of its steps, with every token sampled before it stamped
with the old version. Checked by the weights themselves: the tokens stamped old carry the old model's log-probs and
the tokens stamped new the new model's, in every sample that ran across the update."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrl.net import free_port
from streamrl.rollout.engine import VLLMEngine
from streamrl.weights import WeightGroup
from tests.rollout.test_engine import _encode, _hf_logprobs, _hf_model
from tests.rollout.test_sharded_engine import TIMEOUT_S, _in_thread, _publish


@pytest.fixture(scope="module", params=[1, 2], ids=["one-worker", "two-workers-tp2"])
def process_engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[tuple[VLLMEngine, WeightGroup]]:
    """The engine, whose workers are ranks 1.. of a weight group this process leads (tensors do not cross to the
    core's process: its workers receive the versions themselves); with two, a tensor-parallel engine whose workers
    the core's process starts."""
    workers = request.param
    engine = VLLMEngine(
        tiny_model_dir,
        max_model_len=256,
        dtype="float32",
        enforce_eager=True,
        engine_process=True,
        tensor_parallel=workers,
    )
    port = free_port()
    joined = _in_thread(
        lambda: engine.join_weight_groups(
            [[("127.0.0.1", port, 1 + w, 1 + workers)] for w in range(workers)], 0, TIMEOUT_S, "cpu"
        )
    )
    group = WeightGroup("127.0.0.1", port, 0, 1 + workers, generation=0, timeout_s=TIMEOUT_S)
    joined()
    yield engine, group
    engine.llm.llm_engine.engine_core.shutdown()


def test_async_scheduling_needs_an_engine_core_of_its_own(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="async_scheduling"):
        VLLMEngine(tiny_model_dir, async_scheduling=True)


def test_update_in_flight_stamps_each_token_with_the_weights_that_sampled_it(
    process_engine: tuple[VLLMEngine, WeightGroup], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from streamrl.models.tiny import write_tiny_model

    engine, group = process_engine
    prompt = _encode(tiny_model_dir, "<|im_start|>user\nrepeat #<|im_end|>\n<|im_start|>assistant\n")
    old = engine.policy_version
    engine.submit("inflight", prompt, n=8, max_tokens=48, seed=7)
    for _ in range(3):
        engine.step()
    new_model = _hf_model(write_tiny_model(tmp_path / "seed1", arch="qwen3", seed=1))
    assert _publish(engine, group, old + 1, [(n, t.detach()) for n, t in new_model.named_parameters()]) == old + 1
    while engine.has_unfinished():
        engine.step()
    (samples,) = engine.pop_finished(["inflight"]).values()
    old_model = _hf_model(tiny_model_dir)
    crossed = 0
    for sample in samples:
        before = sample.versions.count(old)
        assert sample.versions == [old] * before + [old + 1] * (len(sample.versions) - before)
        assert before >= min(3, len(sample.token_ids))  # the three steps taken before the update
        expected = _hf_logprobs(old_model, prompt, sample.token_ids[:before])
        if before < len(sample.token_ids):
            crossed += 1
            expected += _hf_logprobs(new_model, prompt + sample.token_ids[:before], sample.token_ids[before:])
        assert max(abs(a - e) for a, e in zip(sample.logprobs, expected, strict=True)) < 1e-4
    assert crossed, "no sample ran across the update: lengthen max_tokens"
    assert engine.policy_version == old + 1
