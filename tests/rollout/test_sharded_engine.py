"""An engine of two tensor-parallel workers fed through the weight group: each worker receives the versions itself.

A version from a publisher in this process reaches both workers bucket by bucket and the engine then computes what
HF computes with those weights. A version refused at its first bucket leaves the running weights as they were, and
the engine keeps generating; one refused after a bucket was loaded is `WeightsLost` (the engine must end).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from streamrl.net import free_port
from streamrl.rollout.engine import VLLMEngine
from streamrl.rollout.worker_receiver import WeightsLost
from streamrl.weights import WeightGroup
from tests.rollout.test_engine import _encode, _hf_logprobs, _hf_model

TIMEOUT_S = 60.0
BUCKET_BYTES = 64 << 10  # several buckets per version


@pytest.fixture(scope="module")
def sharded(tiny_model_dir: Path) -> Iterator[tuple[VLLMEngine, WeightGroup]]:
    """A TP=2 engine of the tiny model whose two workers are ranks 1 and 2 of a weight group this process leads."""
    engine = VLLMEngine(tiny_model_dir, kv_cache_bytes=32 << 20, max_model_len=256, tensor_parallel=2)
    port = free_port()
    joined = _in_thread(
        lambda: engine.join_weight_groups([[("127.0.0.1", port, 1 + w, 3)] for w in range(2)], 0, TIMEOUT_S, "cpu")
    )
    group = WeightGroup("127.0.0.1", port, 0, 3, generation=0, timeout_s=TIMEOUT_S)
    joined()
    yield engine, group
    engine.llm.llm_engine.engine_core.shutdown()  # its workers and their queues end with the module


def _in_thread(task: Callable[[], Any]) -> Callable[[], Any]:
    """Start `task` in a thread; the returned function waits for it and returns (or raises) its result."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = task()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()

    def wait() -> Any:
        thread.join(TIMEOUT_S * 2)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return wait


def _publish(
    engine: VLLMEngine,
    group: WeightGroup,
    version: int,
    named: list[tuple[str, torch.Tensor]],
    bucket_bytes: int = BUCKET_BYTES,
) -> int:
    """Publish `named` as `version` while the engine's workers receive it; returns what the engine reports. A new
    `bucket_bytes` makes the publish a discovering one, whose layouts describe the tensors as sent (a planned publish
    of a tensor that no longer fits its plan is stopped by the publisher, see tests/weights)."""
    sent = _in_thread(lambda: group.publish(version, iter(named), bucket_bytes=bucket_bytes))
    try:
        return engine.receive_version()
    finally:
        try:
            sent()
        except ValueError:
            pass  # a version the test broke on purpose is not committed


def _gap_to_hf(engine: VLLMEngine, model_dir: Path) -> float:
    prompt = _encode(model_dir, "<|im_start|>user\nadd 12 and 30<|im_end|>\n<|im_start|>assistant\n")
    response = _encode(model_dir, "the answer is 42.") + [4]
    expected = _hf_logprobs(_hf_model(model_dir), prompt, response)
    return max(abs(a - e) for a, e in zip(engine.score(prompt, response), expected, strict=True))


def _weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.detach()) for n, t in _hf_model(model_dir).named_parameters()]


def test_a_version_reaches_both_workers_and_computes_what_hf_computes(
    sharded: tuple[VLLMEngine, WeightGroup], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from streamrl.models.tiny import write_tiny_model

    engine, group = sharded
    other = write_tiny_model(tmp_path_factory.mktemp("tiny-seed2"), arch="qwen3", seed=2)
    assert _gap_to_hf(engine, other) > 1e-2  # the engine still serves the checkpoint it started from
    assert _publish(engine, group, 1, _weights(other)) == engine.policy_version == 1
    assert _gap_to_hf(engine, other) < 1e-4
    assert _publish(engine, group, 2, _weights(tiny_model_dir)) == 2  # the second publish: planned buckets
    assert _gap_to_hf(engine, tiny_model_dir) < 1e-4
    workers = engine.llm.collective_rpc("streamrl_worker_info")
    assert sorted(w["rank"] for w in workers) == [0, 1]  # each worker holds its own slices, not the whole model
    whole = sum(t.numel() * t.element_size() for _, t in _weights(tiny_model_dir))
    assert all(w["parameter_bytes"] < whole for w in workers)


def test_a_version_refused_at_its_first_bucket_keeps_the_running_weights(
    sharded: tuple[VLLMEngine, WeightGroup], tiny_model_dir: Path
) -> None:
    engine, group = sharded
    _publish(engine, group, 3, _weights(tiny_model_dir))
    named = _weights(tiny_model_dir)
    name, tensor = named[0]
    named[0] = (name, tensor[:-1])  # the first tensor has the wrong shape: refused before any weight is touched
    with pytest.raises(RuntimeError, match=re.escape(f"{name!r} has shape")) as refused:
        _publish(engine, group, 4, named, bucket_bytes=BUCKET_BYTES // 2)
    assert not isinstance(refused.value, WeightsLost)
    assert engine.policy_version == 3 and _gap_to_hf(engine, tiny_model_dir) < 1e-4  # still running version 3


def test_a_version_refused_half_way_is_weights_lost(
    sharded: tuple[VLLMEngine, WeightGroup], tiny_model_dir: Path
) -> None:
    engine, group = sharded
    named = _weights(tiny_model_dir)
    name, tensor = named[-1]
    named[-1] = (name, tensor[:-1])  # the last tensor is wrong: earlier buckets were already loaded
    with pytest.raises(WeightsLost, match=re.escape(f"{name!r} has shape")):
        _publish(engine, group, 5, named, bucket_bytes=BUCKET_BYTES // 4)
