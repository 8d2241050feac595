"""Config: typed, validated, overridable from the command line; errors name the key."""

from pathlib import Path

import pytest
import yaml

from streamrl.cli import main
from streamrl.config import ConfigError, apply_override, build_config, load_config, save_resolved

BASE = {"model": {"path": "m"}}


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.nn: unknown key"):
        build_config({**BASE, "rollout": {"nn": 3}})


def test_bad_value_is_named() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.n: .*greater than or equal to 2"):
        build_config({**BASE, "rollout": {"n": 1}})
    with pytest.raises(ConfigError, match=r"train\.steps: .*integer"):
        build_config({**BASE, "train": {"steps": "many"}})


def test_regularizer_coefficients_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"loss\.entropy_coef: .*greater than or equal to 0"):
        build_config({**BASE, "loss": {"entropy_coef": -0.1}})
    with pytest.raises(ConfigError, match=r"loss\.kl_coef: .*greater than or equal to 0"):
        build_config({**BASE, "loss": {"kl_coef": -1}})
    with pytest.raises(ConfigError, match=r"loss\.kl_estimator"):
        build_config({**BASE, "loss": {"kl_estimator": "k4"}})
    loss = build_config({**BASE, "loss": {"kl_coef": 0.1, "entropy_coef": 0.01}}).loss
    assert (loss.kl_coef, loss.entropy_coef, loss.kl_estimator) == (0.1, 0.01, "k3")


def test_cross_field_check_names_key() -> None:
    with pytest.raises(ConfigError, match=r"task\.target_length"):
        build_config({**BASE, "task": {"target_length": 50}, "rollout": {"max_tokens": 10}})
    with pytest.raises(ConfigError, match=r"task\.exact_lengths: only for the symbols task's own prompts"):
        build_config({**BASE, "task": {"exact_lengths": True, "prompts_file": "p.jsonl"}})
    with pytest.raises(ConfigError, match=r"task\.prompts_file"):
        build_config({**BASE, "task": {"name": "math"}})
    with pytest.raises(ConfigError, match=r"queue\.url"):
        build_config({**BASE, "queue": {"url": "http://x"}})
    with pytest.raises(ConfigError, match=r"rollout\.weight_apply: 'streamed' .* needs rollout\.weight_update"):
        build_config({**BASE, "rollout": {"weight_apply": "streamed", "weight_update": "drain"}})
    with pytest.raises(ConfigError, match=r"rollout\.kv_on_update: 'keep' .* rollout\.weight_update 'drain'"):
        build_config({**BASE, "rollout": {"kv_on_update": "keep", "weight_update": "drain"}})
    with pytest.raises(ConfigError, match=r"rollout\.async_scheduling: needs rollout\.engine_process"):
        build_config({**BASE, "rollout": {"async_scheduling": True}})
    with pytest.raises(ConfigError, match=r"optimizer\.cpu_offload: needs optimizer\.distributed"):
        build_config({**BASE, "optimizer": {"cpu_offload": True, "distributed": False}})
    with pytest.raises(ConfigError, match=r"optimizer\.offload_fraction: .*less than or equal to 1"):
        build_config({**BASE, "optimizer": {"cpu_offload": True, "offload_fraction": 1.5}})
    with pytest.raises(ConfigError, match=r"learner\.recompute_num_layers: only used with learner\.recompute 'full'"):
        build_config({**BASE, "learner": {"recompute": "selective", "recompute_num_layers": 2}})
    with pytest.raises(ConfigError, match=r"loss\.overlong_buffer: 300 is more than rollout\.max_tokens 256"):
        build_config({**BASE, "loss": {"overlong_buffer": 300}, "rollout": {"max_tokens": 256}})
    with pytest.raises(ConfigError, match=r"optimizer\.min_lr_ratio: only used with optimizer\.lr_schedule"):
        build_config({**BASE, "optimizer": {"min_lr_ratio": 0.1}})
    with pytest.raises(ConfigError, match=r"optimizer\.lr_schedule: .*'constant', 'linear' or 'cosine'"):
        build_config({**BASE, "optimizer": {"lr_schedule": "step"}})
    with pytest.raises(ConfigError, match=r"optimizer\.lr_warmup_steps: 50 is more than train\.steps 40"):
        build_config({**BASE, "optimizer": {"lr_warmup_steps": 50}, "train": {"steps": 40}})
    with pytest.raises(ConfigError, match=r"learner\.recompute_method: only used with learner\.recompute 'full'"):
        build_config({**BASE, "learner": {"recompute": "none", "recompute_method": "block"}})
    with pytest.raises(ConfigError, match=r"learner\.recompute_method: .*'uniform' or 'block'"):
        build_config({**BASE, "learner": {"recompute": "full", "recompute_method": "first"}})
    with pytest.raises(ConfigError, match=r"learner\.recompute: .*'none', 'selective' or 'full'"):
        build_config({**BASE, "learner": {"recompute": "some"}})
    with pytest.raises(ConfigError, match=r"learner\.moe_dispatcher: 'allgather' needs learner\.context_parallel 1"):
        build_config({**BASE, "learner": {"moe_dispatcher": "allgather", "context_parallel": 2}})
    with pytest.raises(ConfigError, match=r"learner\.moe_dispatcher: .*'alltoall' or 'allgather'"):
        build_config({**BASE, "learner": {"moe_dispatcher": "deepep"}})
    with pytest.raises(ConfigError, match=r"loss\.routing_replay: 'rollout' needs engines on run\.device=cuda"):
        build_config({**BASE, "loss": {"routing_replay": "rollout"}})
    with pytest.raises(ConfigError, match=r"train\.parity_every: engines serve lagged weights"):
        build_config({**BASE, "train": {"parity_every": 5, "publish_lag": 2}})


def test_dotted_overrides_are_typed(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(BASE))
    config = load_config(path, ["train.steps=7", "rollout.temperature=0.5", "optimizer.betas=[0.8, 0.9]"])
    assert config.train.steps == 7 and config.rollout.temperature == 0.5 and config.optimizer.betas == (0.8, 0.9)
    tree: dict = {"a": 1}
    with pytest.raises(ConfigError, match="is a value"):
        apply_override(tree, "a.b=2")
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        apply_override(tree, "novalue")


def test_the_backlog_defaults_to_what_the_staleness_gate_lets_in(tmp_path: Path) -> None:
    assert build_config(BASE).queue.max_backlog == (4 + 1) * 8  # default max_staleness and groups_per_step
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**BASE, "batching": {"groups_per_step": 32}}))
    assert load_config(path, ["queue.max_staleness=1"]).queue.max_backlog == 64
    assert load_config(path, ["queue.max_backlog=7"]).queue.max_backlog == 7  # a value given wins
    with pytest.raises(ConfigError, match=r"queue\.max_staleness"):
        build_config({**BASE, "queue": {"max_staleness": "many"}})


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    config = build_config({**BASE, "train": {"steps": 3}})
    saved = save_resolved(config, tmp_path)
    assert load_config(saved) == config


def test_cli_exits_nonzero_naming_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**BASE, "queue": {"bogus": 1}}))
    assert main(["train", "-c", str(path)]) == 2
    assert "queue.bogus: unknown key" in capsys.readouterr().err


def test_shipped_configs_validate() -> None:
    """The configs without a layout table (presets: tests/config/test_layouts.py)."""
    for path in Path(__file__).parents[1].joinpath("configs").glob("*.yaml"):
        if "layouts" not in yaml.safe_load(path.read_text()):
            load_config(path)
