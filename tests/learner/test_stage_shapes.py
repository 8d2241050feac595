"""The planner's per-stage parameters come from the learner's own model builder, under a simulated layout."""

import json
from pathlib import Path

import torch

from streamrl.config import LearnerConfig, load_config
from streamrl.learner.model.gpt import build_gpt_model, is_expert_parameter
from streamrl.learner.parallel import destroy_parallel, init_parallel
from streamrl.learner.stage_shapes import stage_layer_counts, stage_parameters
from streamrl.net import free_port

CONFIGS = Path(__file__).parents[2] / "configs"


def test_one_rank_equals_the_model_the_learner_builds(tiny_model_dirs) -> None:
    hf = json.loads((tiny_model_dirs("qwen3_moe") / "config.json").read_text())
    (stage,) = stage_parameters(hf, LearnerConfig())
    init_parallel(LearnerConfig(), 0, "127.0.0.1", free_port(), seed=0)
    try:
        params = list(build_gpt_model(hf, torch.bfloat16).named_parameters())
    finally:
        destroy_parallel()
    assert stage.experts == sum(p.numel() for n, p in params if is_expert_parameter(n))
    assert stage.dense == sum(p.numel() for n, p in params if not is_expert_parameter(n))
    assert stage.embedding and stage.output and stage.layers == hf["num_hidden_layers"]


def test_the_seed_models_have_their_released_sizes() -> None:
    """Qwen3-30B-A3B at EP 4: one rank's dense part + four ranks' experts is the released 30,532,122,624."""
    config = load_config(CONFIGS / "qwen3-30b-a3b.yaml", ["cluster.gpus=4"])
    (stage,) = stage_parameters(config.model.architecture, config.learner)
    assert stage.dense + 4 * stage.experts == 30_532_122_624
    # DeepSeek-V3 at TP 1, PP 16, EP 32: the stages together are the 671B model (MTP excluded).
    config = load_config(CONFIGS / "deepseek-v3-671b.yaml", ["cluster.gpus=512"])
    stages = stage_parameters(config.model.architecture, config.learner)
    assert [s.layers for s in stages] == [4] * 15 + [1]
    assert stages[0].embedding and stages[-1].output and not stages[1].embedding
    total = sum(s.dense + 32 * s.experts for s in stages)
    assert abs(total / 671e9 - 1) < 0.005, total


def test_uneven_stage_counts() -> None:
    assert stage_layer_counts(94, 8, 10, 6) == [10] + [13] * 6 + [6]
    assert stage_layer_counts(61, 12, None, 6) == [5] * 11 + [6]
    assert stage_layer_counts(48, 1, None, None) == [48]
