"""End to end on GPUs (`pytest -m gpu`, with the GPU kit): `streamrl train` on CUDA must finish and learn.

The run goes through everything a GPU run needs and CPU CI never touches: the learner's NCCL world (the step's
group broadcast and its statistics as device tensors), NCCL weight groups, vLLM on CUDA with CUDA graphs captured
and weights updated in place, and checkpoints of CUDA tensors. The parity test publishes twice into a bf16 engine
from a bf16 learner and compares log-probs at the bf16 tolerance below; on 4 GPUs the same from a TP=2 learner into
an engine of 2 GPUs (tensor parallel, and a MoE with its experts split over the engine's GPUs), whose workers each
receive the versions and keep their own shards (also with vLLM's Ray executor, the workers Ray actors in the
engine's own placement group, as an engine wider than a node runs; and into an engine of two data-parallel ranks with
the experts over both, vLLM's AsyncLLM); and into an engine that drives vLLM's core in a
process of its own with async scheduling (`rollout.engine_process`). The colocated test shares the GPUs between the
learner and the engines (sync mode, vLLM sleeping while the learner trains): on one GPU, versions through host memory;
on two, publishing over NCCL from a rank on the other GPU (the default where the learner's stages have two ranks) or,
with `train.colocated_publish=host`, through host memory, with an engine of vLLM's Ray executor whose workers share
the learner ranks' GPUs, and with an engine of two data-parallel ranks (a MoE, its experts over both) that sleep and
wake together.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from streamrl.config import Config
from streamrl.monitor.wandb_files import read_history
from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run, train
from tests.orchestrate.parity import engine_logprobs, learner_logprobs, tiny_config, train_and_publish

torch = pytest.importorskip("torch")


def needs_gpus(count: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < count, reason=f"needs {count} CUDA GPUs"
    )


def colocated_on(gpus: int, *layout: str, id: str) -> object:
    """A colocated case on `gpus` GPUs, skipped on a machine with fewer."""
    return pytest.param([f"cluster.gpus={gpus}", *layout], id=id, marks=needs_gpus(gpus))


needs_two_gpus = needs_gpus(2)
needs_four_gpus = needs_gpus(4)
BF16_PARITY_TOL = 0.01  # max |engine - learner| log-prob per token in bf16 (measured 0.0006 on H200)
GPU = ["run.device=cuda", "learner.collective_timeout_s=300"]
BF16 = ["rollout.dtype=bfloat16", "learner.params_dtype=bfloat16"]
ENGINE_TP2 = ["rollout.gpus_per_engine=2", "rollout.tensor_parallel=2"]
MOE_EP2 = ["model.init_if_missing.arch=qwen3_moe", "learner.data_parallel=2", "learner.expert_parallel=2"]


@pytest.mark.gpu
@needs_two_gpus
def test_train_on_gpus_finishes_and_learns(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, *GPU, "train.steps=60", "train.checkpoint_every=30")
    result = train(config, show_progress=False)
    history = read_history(config.run.dir)
    assert len(history) == config.train.steps
    rewards = np.array([row["rollout/reward_mean"] for row in history])
    quarter = len(rewards) // 4
    first, last = rewards[:quarter].mean(), rewards[-quarter:].mean()
    print(f"GPU run: reward first quarter {first:.3f}, last quarter {last:.3f}; {result.summary}")
    assert last >= first + 0.15, (first, last)
    assert history[-1]["rollout/engine_version"] == config.train.steps
    assert (config.run.dir / "checkpoints" / "latest").exists()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout",
    [
        # One GPU: the learner's single rank and a one-GPU engine take turns on it, versions through host memory.
        colocated_on(1, id="one-gpu"),
        colocated_on(2, "learner.data_parallel=2", "rollout.engines=2", id="dp2-two-engines"),
        colocated_on(
            2,
            "learner.tensor_parallel=2",
            "rollout.gpus_per_engine=2",
            "rollout.tensor_parallel=2",
            id="tp2-one-engine-of-two-gpus",
        ),
        colocated_on(
            2,
            "learner.data_parallel=2",
            "rollout.engines=2",
            "train.colocated_publish=host",
            id="dp2-two-engines-publish-through-host",
        ),
        colocated_on(
            2,
            "learner.data_parallel=2",
            "rollout.gpus_per_engine=2",
            "rollout.tensor_parallel=2",
            "rollout.executor=ray",
            id="dp2-one-engine-of-two-gpus-ray-executor",
        ),
        # Two data-parallel ranks (`DataParallelEngine`), one on each GPU, the experts over both.
        colocated_on(
            2,
            *MOE_EP2,
            "rollout.gpus_per_engine=2",
            "rollout.tensor_parallel=1",
            "rollout.expert_parallel=2",
            id="moe-ep2-one-engine-of-two-data-parallel-ranks",
        ),
    ],
)
def test_colocated_sync_shares_the_gpus_and_learns(tmp_path: Path, layout: list[str]) -> None:
    """Every GPU holds a learner rank and (part of) an engine; the engines free their GPU memory while the learner
    trains, and every version reaches them whole. With vLLM's Ray executor (as an engine wider than a node runs),
    the engine's workers are Ray actors in the learner's bundles, worker w on learner rank w's GPU."""
    steps = 40
    config = tiny_config(tmp_path, *GPU, "train.mode=sync", *layout, f"train.steps={steps}", "train.checkpoint_every=0")
    gpus = config.cluster.gpus
    # Host memory where asked, or where no stage has a second rank to send from (one GPU).
    through_host = "train.colocated_publish=host" in layout or gpus == 1
    assert config.colocated and config.weights_device == ("cpu" if through_host else "cuda")
    result = train(config, show_progress=False)
    history = read_history(config.run.dir)
    assert len(history) == steps
    assert history[-1]["rollout/engine_version"] == steps
    assert all(row["queue/policy_lag_max"] == 0 for row in history)
    freed = min(row["rollout/sleep_freed_gb"] for row in history)
    assert freed * 1e9 >= 0.9 * gpus * config.rollout.kv_cache_bytes  # at least the KV cache of every GPU, every step
    # The learner's weights, gradients and Adam state were on the host while the engines generated, every step.
    assert min(row["learner/parked_gb"] for row in history) > 0
    rewards = np.array([row["rollout/reward_mean"] for row in history])
    first, last = rewards[: steps // 4].mean(), rewards[-steps // 4 :].mean()
    if "rollout.executor=ray" in layout:
        placement = json.loads((config.run.dir / "placement.json").read_text())
        workers = sorted(placement["engines"][0]["workers"], key=lambda worker: worker["rank"])
        ranks = placement["learners"]
        assert [(w["node_id"], w["gpus"]) for w in workers] == [(r["node_id"], r["gpus"]) for r in ranks], placement
    step_s = np.median([row["perf/step_time_s"] for row in history])
    print(f"colocated {layout}: reward {first:.3f} -> {last:.3f}, freed {freed:.2f} GB, step {step_s:.2f} s")
    print(result.summary)
    assert last >= first + 0.15, (first, last)


@pytest.mark.gpu
@needs_two_gpus
def test_bf16_logprob_parity_after_publishes(tmp_path: Path) -> None:
    gap = _bf16_parity_gap(tiny_config(tmp_path, *GPU, *BF16, "wandb.mode=disabled"))
    print(f"bf16 parity after two publishes: max |engine - learner| = {gap:.4f}")
    assert gap <= BF16_PARITY_TOL


@pytest.mark.gpu
@needs_two_gpus
def test_bf16_parity_through_an_engine_core_of_its_own_with_async_scheduling(tmp_path: Path) -> None:
    """`rollout.engine_process` with vLLM's async scheduling: a step is always in flight in the core's process, so each
    version must land with the core paused and drained (`VLLMEngine._between_steps`); parity after two publishes."""
    process = ["rollout.engine_process=true", "rollout.async_scheduling=true"]
    gap = _bf16_parity_gap(tiny_config(tmp_path, *GPU, *BF16, *process, "wandb.mode=disabled"))
    print(f"bf16 parity through an engine core of its own: max |engine - learner| = {gap:.4f}")
    assert gap <= BF16_PARITY_TOL


def _bf16_parity_gap(config: Config) -> float:
    """Max |engine - learner| log-prob per token after two publishes (that must change the engine's log-probs)."""
    prepare_run(config)
    with Cluster(config) as cluster:
        before = engine_logprobs(cluster, config)
        train_and_publish(cluster, 2)
        engine_lp, learner_lp = engine_logprobs(cluster, config), learner_logprobs(cluster, config)
    assert np.abs(engine_lp - before).max() > 1e-3  # the published weights reached the engine's CUDA graphs
    return float(np.abs(engine_lp - learner_lp).max())


@pytest.mark.gpu
@needs_four_gpus
@pytest.mark.parametrize(
    "layout",
    [
        ["learner.tensor_parallel=2", *ENGINE_TP2],
        [*MOE_EP2, *ENGINE_TP2, "rollout.expert_parallel=2"],
        ["learner.tensor_parallel=2", *ENGINE_TP2, "rollout.executor=ray"],
        # Two data-parallel ranks of one GPU each (`DataParallelEngine`, vLLM's AsyncLLM), the experts over both.
        [*MOE_EP2, "rollout.gpus_per_engine=2", "rollout.tensor_parallel=1", "rollout.expert_parallel=2"],
    ],
    ids=["dense-tp2", "moe-ep2", "dense-tp2-ray-executor", "moe-ep2-engine-dp2"],
)
def test_bf16_parity_into_an_engine_of_two_gpus(tmp_path: Path, layout: list[str]) -> None:
    config = tiny_config(tmp_path, *GPU, *BF16, *layout, "wandb.mode=disabled")
    gap = _bf16_parity_gap(config)
    print(f"bf16 parity into a 2-GPU engine ({layout}): max |engine - learner| = {gap:.4f}")
    assert gap <= BF16_PARITY_TOL


@pytest.mark.gpu
@needs_two_gpus
def test_routing_replay_brings_the_learner_closer_to_the_engine_on_moe(tmp_path: Path) -> None:
    """Tiny Qwen3-MoE, bf16 engine and learner, sync mode (every token sampled with the weights its step starts
    from): the in-job parity check measures the mean |engine - learner| log-prob per token, with the learner routing
    on its own and with the engine's experts replayed. Replay must not be further from the engine."""
    gaps = {}
    for replay in ("none", "rollout"):
        config = tiny_config(
            tmp_path / replay,
            *GPU,
            "model.init_if_missing.arch=qwen3_moe",
            "rollout.dtype=bfloat16",
            "learner.params_dtype=bfloat16",
            "train.mode=sync",
            "train.steps=6",
            "train.checkpoint_every=0",
            "train.parity_every=1",
            "train.parity_tolerance=10",  # measured here, not enforced
            f"loss.routing_replay={replay}",
        )
        train(config, show_progress=False)
        history = read_history(config.run.dir)
        assert all(row["rollout_corr/parity_tokens"] > 0 for row in history)
        gaps[replay] = (
            float(np.mean([row["rollout_corr/parity_abs_mean"] for row in history])),
            float(np.max([row["rollout_corr/parity_abs_max"] for row in history])),
        )
    print(
        f"bf16 tiny MoE, mean / max |engine - learner| log-prob per token: without replay {gaps['none']}, "
        f"with replay {gaps['rollout']}"
    )
    assert gaps["rollout"][0] <= gaps["none"][0]
