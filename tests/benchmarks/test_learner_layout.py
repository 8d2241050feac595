"""`benchmarks/learner_layout.py` runs on CPU (gloo): the GPU runs of a preset's learner start from this script, and a
device session must not find it broken. The preset's layout (EP 4 over 4 ranks) on a shrunken model, new lengths each
step (`--vary`) with the attention shapes unrounded (`--exact-shapes`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "model.architecture.num_hidden_layers=2",
    "model.architecture.num_experts=8",
    "model.architecture.moe_intermediate_size=64",
    "model.architecture.hidden_size=128",
    "model.architecture.intermediate_size=256",
    "model.architecture.num_attention_heads=4",
    "model.architecture.num_key_value_heads=2",
    "model.architecture.head_dim=32",
    # The output layer's matmuls in bfloat16 over 151,936 entries took ~20 s a step on a CPU without bf16 instructions.
    "model.architecture.vocab_size=4096",
    "learner.recompute=none",
]


def test_a_presets_learner_steps_at_its_layout_next_to_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "layout.json"
    command = [sys.executable, "benchmarks/learner_layout.py", "-c", "configs/qwen3-30b-a3b.yaml", "cluster.gpus=4"]
    command += [*SMALL, "--steps", "2", "--groups", "2", "--n", "2", "--mean-len", "32", "--max-len", "64"]
    command += ["--prompt-len", "16", "--profile", "--vary", "--exact-shapes", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["gpus"] == 4 and result["layout"]["expert_parallel"] == 4
    assert result["vary"] and result["exact_shapes"] and len(result["steps"]) == 2
    # 2 groups x 2 responses of 16-64 tokens (lognormal around 32, clipped) after 16-token prompts.
    assert 2 * 2 * (16 + 16) <= result["tokens"] <= 2 * 2 * (16 + 64) and result["step_seconds"] > 0
    assert result["plan"]["gpu_gb"] > 0 and result["plan"]["host_gb"] > 0
    assert result["groups"] == 2 and result["responses_per_group"] == 2 and result["startup_s"] > 0
    assert result["warmup_phases"]["perf/forward_backward_s"] > 0 and "perf/optimizer_s" in result["warmup_phases"]
    assert "step s" in done.stdout
