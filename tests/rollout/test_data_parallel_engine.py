"""An engine of two data-parallel ranks of the tiny Qwen3-MoE (vLLM's `AsyncLLM`, CPU: the experts split over both
ranks by their hidden dimension) fed through one weight group whose receivers are both ranks' workers.

A version reaches both ranks and the engine then scores what HF scores with those weights; requests in flight across
a version keep their tokens, each token stamped with the version that sampled it (old, then new, never mixed back);
a version refused at its first bucket leaves every rank on the running weights. A rank whose process dies takes the
engine with it: `lost()` shows it without a call, and decoding, a new request and a version all raise `EngineLost`
(the rollout worker then ends its process and the fleet replaces the engine); so does a request or a resume that
vLLM's client never answers, at the control bound.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from streamrl.net import free_port
from streamrl.rollout.data_parallel_engine import DataParallelEngine
from streamrl.rollout.request_table import EngineLost
from streamrl.rollout.worker_receiver import WeightsLost
from streamrl.weights import WeightGroup
from tests.rollout.test_engine import _encode, _hf_logprobs, _hf_model
from tests.rollout.test_sharded_engine import BUCKET_BYTES, TIMEOUT_S, _in_thread, _publish

PROMPT_TEXT = "<|im_start|>user\nadd 12 and 30<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs("qwen3_moe")


@pytest.fixture(scope="module")
def engine(moe_dir: Path) -> Iterator[tuple[DataParallelEngine, WeightGroup]]:
    """Two data-parallel ranks of one worker each: ranks 1 and 2 of a weight group this process leads."""
    dp = DataParallelEngine(moe_dir, data_parallel=2, kv_cache_bytes=32 << 20, max_model_len=256, start_timeout_s=300)
    port = free_port()
    memberships = [[("127.0.0.1", port, 1 + w, 3)] for w in range(2)]
    joined = _in_thread(lambda: dp.join_weight_groups(memberships, 0, TIMEOUT_S, "cpu"))
    group = WeightGroup("127.0.0.1", port, 0, 3, generation=0, timeout_s=TIMEOUT_S)
    joined()
    yield dp, group
    dp.close()


def _weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under its own names (one per expert), as a learner publishes them."""
    from safetensors.torch import load_file

    return sorted(load_file(model_dir / "model.safetensors").items())


def _gap_to_hf(engine: DataParallelEngine, model_dir: Path) -> float:
    prompt = _encode(model_dir, PROMPT_TEXT)
    response = _encode(model_dir, "the answer is 42.") + [4]
    expected = _hf_logprobs(_hf_model(model_dir), prompt, response)
    return max(abs(a - e) for a, e in zip(engine.score(prompt, response), expected, strict=True))


def test_a_version_reaches_every_rank_and_requests_in_flight_keep_their_tokens(
    engine: tuple[DataParallelEngine, WeightGroup], moe_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from streamrl.models.tiny import write_tiny_model

    dp, group = engine
    assert dp.workers == 2
    assert _gap_to_hf(dp, moe_dir) < 1e-3
    # Requests on both ranks (vLLM's coordinator balances them), of unequal lengths, in flight across the version.
    prompt = _encode(moe_dir, PROMPT_TEXT)
    lengths = [48, 12, 40, 20, 56, 8]
    for i, length in enumerate(lengths):
        dp.submit(f"long-{i}", prompt, n=2, max_tokens=64, exact_length=length)
    for _ in range(1000):  # bounded: an engine that made no token would otherwise step forever
        if sum(len(s.token_ids) for samples in dp._running.values() for s in samples) >= 40:
            break
        dp.step()
    else:
        raise AssertionError("the requests made fewer than 40 tokens in 1000 steps")
    other = write_tiny_model(tmp_path_factory.mktemp("tiny-moe-seed2"), arch="qwen3_moe", seed=2)
    assert _gap_to_hf(dp, other) > 1e-2  # the engine still serves the checkpoint it started from
    assert _publish(dp, group, 1, _weights(other)) == dp.policy_version == 1
    done = dp._run_until_done([f"long-{i}" for i in range(len(lengths))])
    straddled = 0
    for i, length in enumerate(lengths):
        for sample in done[f"long-{i}"]:
            assert len(sample.token_ids) == len(sample.versions) == len(sample.logprobs) == length
            assert sample.versions == sorted(sample.versions) and set(sample.versions) <= {0, 1}
            straddled += len(set(sample.versions)) == 2
    assert straddled > 0  # some samples began under version 0 and ended under version 1
    assert _gap_to_hf(dp, other) < 1e-3  # every rank now computes with the new weights (scores land on either)
    answers = dp._call(dp._on_every_rank("collective_rpc", "streamrl_worker_info", None, (), None))
    workers = [worker for rank in answers for worker in rank]
    assert sorted(w["rank"] for w in workers) == [0, 1]  # engine positions: data-parallel rank x TP + rank
    whole = sum(t.numel() * t.element_size() for _, t in _weights(moe_dir))
    assert all(w["parameter_bytes"] < whole for w in workers)  # the experts are split over the ranks


def test_a_version_refused_at_its_first_bucket_keeps_every_rank_running(
    engine: tuple[DataParallelEngine, WeightGroup], moe_dir: Path
) -> None:
    dp, group = engine
    assert _publish(dp, group, 2, _weights(moe_dir)) == 2
    named = _weights(moe_dir)
    name, tensor = named[0]
    named[0] = (name, tensor[:-1])  # wrong shape: refused before any weight is touched
    with pytest.raises(RuntimeError, match=re.escape(f"{name!r} has shape")) as refused:
        _publish(dp, group, 3, named, bucket_bytes=BUCKET_BYTES // 2)
    assert not isinstance(refused.value, WeightsLost)
    assert dp.policy_version == 2 and _gap_to_hf(dp, moe_dir) < 1e-3
    # The ranks resumed: generation goes on under version 2.
    (samples,) = dp.generate([_encode(moe_dir, PROMPT_TEXT)], n=2, max_tokens=6)
    assert all(s.versions == [2] * len(s.token_ids) and s.token_ids for s in samples)
    assert torch.isfinite(torch.tensor([lp for s in samples for lp in s.logprobs])).all()


def test_a_client_that_answers_no_control_call_is_a_lost_engine(
    engine: tuple[DataParallelEngine, WeightGroup],
    moe_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A request (or pause, resume) that vLLM's client never answers ends in `EngineLost` at the control bound: the
    rollout loop, blocked in such a call, is outside its stall watch, and would otherwise wait for 10 minutes. Where
    the client's coroutine waited goes to the engine's log."""
    import asyncio

    from streamrl.rollout import data_parallel_engine

    dp, _ = engine

    async def never_answered(*args: object, **kwargs: object) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(data_parallel_engine, "_CONTROL_TIMEOUT_S", 1.0)
    monkeypatch.setattr(dp.llm, "add_request", never_answered)
    started = time.monotonic()
    with pytest.raises(EngineLost, match="did not answer a request within 1s"):
        dp.submit("hung", _encode(moe_dir, PROMPT_TEXT), n=1, max_tokens=4)
    assert time.monotonic() - started < 10
    assert "in never_answered" in capsys.readouterr().err  # the hung coroutine's stack
    monkeypatch.setattr(dp.llm, "resume_generation", never_answered)
    with pytest.raises(EngineLost, match="did not resume.*did not answer the resume"):
        dp._resume()


def test_a_rank_that_dies_takes_the_engine_with_it(moe_dir: Path) -> None:
    import psutil

    earlier = {p.pid for p in psutil.Process().children(recursive=True)}  # the module's engine's processes
    dp = DataParallelEngine(moe_dir, data_parallel=2, kv_cache_bytes=32 << 20, max_model_len=256, start_timeout_s=300)
    try:
        prompt = _encode(moe_dir, PROMPT_TEXT)
        for i in range(4):
            dp.submit(f"r-{i}", prompt, n=2, max_tokens=128, exact_length=128)
        dp.step()
        children = [p for p in psutil.Process().children(recursive=True) if p.pid not in earlier]
        (core,) = [p for p in children if p.name().endswith("EngineCore_DP1")]
        core.kill()
        # Seen without asking the engine anything (the rollout worker's loop looks each turn, decoding or not).
        started = time.monotonic()
        while not dp.lost() and time.monotonic() - started < 30:
            time.sleep(0.1)
        assert dp.lost()
        # A version's calls to the dead rank are never answered: the wait for them ends on the dead rank (not at the
        # 600 s bound).
        started = time.monotonic()
        with pytest.raises(EngineLost, match="the engine's ranks could not receive"):
            dp.receive_version()
        assert time.monotonic() - started < 30
        with pytest.raises(EngineLost, match="a data-parallel rank died (during|before) a decoding step"):
            dp.step()
        with pytest.raises(EngineLost, match="a data-parallel rank died (during|before) a request"):
            dp.submit("late", prompt, n=1, max_tokens=4)
    finally:
        dp.close()
