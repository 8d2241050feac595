"""streamrl.rollout.engine_settings: a job's engine arguments come from its config (each engine its own seed; CUDA
graphs on by default only on GPUs; routing replay, engine layout and the engine-core process passed through)."""

from __future__ import annotations

from streamrl.config import load_config
from streamrl.rollout.engine_settings import engine_settings


def test_each_engine_of_a_job_starts_as_the_config_says() -> None:
    cpu = load_config("configs/tiny.yaml", ["run.seed=7", "rollout.engine_process=true"])
    first, third = engine_settings(cpu, 0), engine_settings(cpu, 2)
    assert (first["seed"], third["seed"]) == (7, 9)
    assert first["enforce_eager"] and not first["sleep_mode"] and first["engine_process"]
    assert {k: v for k, v in first.items() if k != "seed"} == {k: v for k, v in third.items() if k != "seed"}
    gpu = load_config("configs/qwen3-medium-gpu.yaml", ["rollout.enforce_eager=true", "loss.routing_replay=rollout"])
    assert engine_settings(gpu)["enforce_eager"] and engine_settings(gpu)["record_routes"]
    assert not engine_settings(load_config("configs/qwen3-medium-gpu.yaml"))["enforce_eager"]  # CUDA graphs on GPU
    assert engine_settings(load_config("configs/qwen3-medium-gpu.yaml"))["executor"] == "mp"
    ray = ["rollout.executor=ray", "rollout.gpus_per_engine=2", "rollout.tensor_parallel=2"]
    assert engine_settings(load_config("configs/qwen3-medium-gpu.yaml", ray))["executor"] == "ray"
