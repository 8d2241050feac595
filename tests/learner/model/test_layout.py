"""Parallel layouts are checked against the model before any process starts; errors name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from streamrl.cli import main
from streamrl.learner.model.layout import check_layout

DENSE = {
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
}
MOE = {
    **DENSE,
    "num_experts": 8,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
    "architectures": ["Qwen3MoeForCausalLM"],
}


@pytest.mark.parametrize(
    ("hf_config", "layout", "field"),
    [
        (DENSE, (4, 1, 1, 1, None), "num_key_value_heads"),
        ({**DENSE, "vocab_size": 63}, (2, 1, 1, 1, None), "vocab_size"),
        ({**DENSE, "intermediate_size": 95}, (2, 1, 1, 1, None), "intermediate_size"),
        (DENSE, (1, 2, 1, 1, None), r"learner\.expert_parallel"),
        (MOE, (1, 3, 1, 1, None), "num_experts"),
        (DENSE, (1, 1, 4, 1, None), r"learner\.pipeline_parallel"),
        (DENSE, (1, 1, 2, 2, None), r"learner\.pipeline_parallel"),
        (DENSE, (1, 1, 2, 1, 6), r"learner\.last_stage_layers"),
        (DENSE, (1, 1, 1, 1, 2), r"learner\.last_stage_layers"),
        (DENSE, (1, 1, 4, 1, 1, 2), r"learner\.pipeline_parallel"),  # 3 layers over 2 middle stages
        (DENSE, (1, 1, 2, 2, None, 2), r"learner\.first_stage_layers"),
    ],
)
def test_layouts_the_model_cannot_take_name_the_field(hf_config: dict, layout: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        check_layout(hf_config, *layout)


def test_layouts_that_fit_pass() -> None:
    check_layout(DENSE, 2, 1, 3, 2, None)  # 6 layers over 3 stages x 2 chunks
    check_layout(DENSE, 1, 1, 2, 1, 2)  # 4 + 2 layers
    check_layout(DENSE, 1, 1, 2, 1, None, 1)  # 1 + 5 layers
    check_layout(DENSE, 1, 1, 4, 1, 1, 1)  # 1 + 2 x 2 + 1 layers
    check_layout(DENSE, 1, 1, 3, 1, 1, 2)  # 2 + 3 + 1 layers
    check_layout({**MOE, "intermediate_size": 95}, 2, 4, 1, 1, None)  # an all-MoE model's dense size is unused


def test_cli_rejects_a_layout_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(DENSE))
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {"model": {"path": str(model)}, "run": {"dir": str(tmp_path / "run")}, "learner": {"pipeline_parallel": 4}}
        )
    )
    assert main(["check-config", "-c", str(path)]) == 2
    assert main(["train", "-c", str(path)]) == 2
    assert "learner.pipeline_parallel" in capsys.readouterr().err
