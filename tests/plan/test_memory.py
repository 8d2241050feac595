"""`streamrl plan`: every shipped row fits its GPUs, terms follow the stated assumptions, DeepSeek-V3 at 96 GPUs lands
near the measured 66 GB per GPU and 1,500 GB per node, and a layout that does not fit (a GPU, or a node's host memory
when known) exits non-zero naming its largest term."""

import json
import time
from pathlib import Path

import pytest

from streamrl.cli import main
from streamrl.config import load_config
from streamrl.learner import stage_parameters
from streamrl.models.tiny import tiny_model_config
from streamrl.plan import plan_memory
from streamrl.plan.memory import GB, HOST_PROCESS_BYTES, HOST_USABLE, RUNTIME_BYTES
from tests.config.test_layouts import ROWS

CONFIGS = Path(__file__).parents[2] / "configs"


def test_every_shipped_row_fits_and_plans_in_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    for path, gpus in ROWS:
        assert main(["plan", "-c", str(path), f"cluster.gpus={gpus}"]) == 0, (path.name, gpus)
        out = capsys.readouterr().out
        assert "fits" in out.splitlines()[-1] and "peak GPU" in out, out
    assert time.perf_counter() - start < 60 * len(ROWS) / 14  # about a second a row on 2 cores


def test_deepseek_v3_at_96_gpus_is_near_the_measured_figures() -> None:
    config = load_config(CONFIGS / "deepseek-v3-671b.yaml", ["cluster.gpus=96"])
    plan = plan_memory(config, config.model.architecture, 96)
    assert abs(plan.peak() / 66e9 - 1) < 0.15, plan.peak() / GB
    assert abs(plan.host_per_node / 1500e9 - 1) < 0.15, plan.host_per_node / GB
    # Data-parallel attention ranks inside the engines (TP 8 x 4; planned, not trained yet) fit too, with more of the
    # weights on each engine GPU (1/8 of the attention instead of 1/32).
    attention_ranks = ["cluster.gpus=96", "rollout.tensor_parallel=8"]
    config = load_config(CONFIGS / "deepseek-v3-671b.yaml", attention_ranks)
    data_parallel = plan_memory(config, config.model.architecture, 96)
    assert data_parallel.largest_overflow() is None
    assert data_parallel.engine["weights"] > plan.engine["weights"]


def test_terms_follow_the_stated_assumptions() -> None:
    """Qwen3-30B-A3B at EP 4 x DP 4, bf16: 2 bytes of parameters, 4 of float32 gradients, 12 of optimizer state
    sharded over DP (dense) or the one expert-data-parallel rank (experts), a fraction of it on the host."""
    config = load_config(CONFIGS / "qwen3-30b-a3b.yaml", ["cluster.gpus=4", "optimizer.offload_fraction=0.25"])
    hf = config.model.architecture
    (stage,) = stage_parameters(hf, config.learner)
    (learner,) = plan_memory(config, hf, 80).learner
    params = stage.dense + stage.experts
    owned = stage.dense / 4 + stage.experts
    assert learner.terms["parameters"] == 2 * params and learner.terms["gradients"] == 4 * params
    assert learner.terms["optimizer"] == pytest.approx(12 * owned * 0.75)
    assert learner.host == pytest.approx(
        16 * owned * 0.25 + hf["vocab_size"] * hf["hidden_size"] * 2 + HOST_PROCESS_BYTES
    )
    assert learner.terms["runtime"] == RUNTIME_BYTES
    assert learner.terms["logits"] == 4 * 16384 * hf["vocab_size"]  # TP 1: bf16 logits and their gradient


def test_a_dense_layer_keeps_what_the_plan_lists() -> None:
    """Without recomputation, per token and layer: the input, both norms' outputs and the residual (4 x hidden), q/k/v,
    q and k again before their norms, the attention output twice (the kernel's padded copy and the output
    projection's input) and the MLP's gate/up and SwiGLU outputs, in bf16: the ~3.6B model of the async runs."""
    overrides = ["learner.data_parallel=1", "rollout.engines=1", "learner.recompute=none"]
    config = load_config(CONFIGS / "qwen3-large-gpu.yaml", [*overrides, "batching.max_tokens_per_microbatch=8192"])
    hf = tiny_model_config("qwen3", "large")  # the config's model, written on first use
    (learner,) = plan_memory(config, hf, 141).learner
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    per_token_and_layer = 4 * hf["hidden_size"] + (q + 2 * kv) + (q + kv) + 2 * q + 3 * hf["intermediate_size"]
    assert learner.terms["activations"] == 2 * 8192 * hf["num_hidden_layers"] * per_token_and_layer


@pytest.mark.parametrize(
    ("config_name", "overrides"),
    [
        ("qwen3-large-gpu.yaml", ["learner.data_parallel=1", "rollout.engines=1"]),
        ("qwen3-30b-a3b.yaml", ["cluster.gpus=4"]),
    ],
)
def test_selective_recomputation_drops_what_its_modules_name(config_name: str, overrides: list[str]) -> None:
    """`recompute: selective` with the default modules: both norms' outputs, the SwiGLU output (dense) or every
    SwiGLU output (MoE: top-k routed copies and the shared experts) and the attention output's packed copy, per token
    and layer, as `tests/learner/model/test_recompute.py` measures them on a GPU; `core_attn` alone drops nothing."""
    base = [*overrides, "batching.max_tokens_per_microbatch=8192"]

    def plan(*more: str) -> tuple[dict, float]:
        config = load_config(CONFIGS / config_name, [*base, *more])
        hf = config.model.architecture or tiny_model_config("qwen3", "large")  # the dense config's written model
        (learner,) = plan_memory(config, hf, 141).learner
        return hf, learner.terms["activations"]

    hf, none = plan("learner.recompute=none")
    sparse = "moe_intermediate_size" in hf
    act = hf["num_experts_per_tok"] * hf["moe_intermediate_size"] if sparse else hf["intermediate_size"]
    dropped = 2 * hf["hidden_size"] + act + hf["num_attention_heads"] * hf["head_dim"]
    assert none - plan("learner.recompute=selective")[1] == pytest.approx(2 * 8192 * hf["num_hidden_layers"] * dropped)
    assert plan("learner.recompute=selective", "learner.recompute_modules=[core_attn]")[1] == none


def test_recomputation_methods_keep_what_they_say() -> None:
    """Full recomputation keeps a layer's input per recomputed unit plus one unit's activations: uniform blocks of k
    layers, or (block) the first k layers one at a time with the other layers keeping all of theirs."""
    base = ["cluster.gpus=4", "optimizer.offload_fraction=1.0"]

    def activations(*overrides: str) -> float:
        config = load_config(CONFIGS / "qwen3-30b-a3b.yaml", [*base, *overrides])
        (learner,) = plan_memory(config, config.model.architecture, 141).learner
        return learner.terms["activations"]

    config = load_config(CONFIGS / "qwen3-30b-a3b.yaml", base)
    hf, layers = config.model.architecture, config.model.architecture["num_hidden_layers"]
    layer_input = 2 * hf["hidden_size"] * config.batching.max_tokens_per_microbatch
    none, full = activations("learner.recompute=none"), activations("learner.recompute=full")
    per_layer = none / layers  # every layer is a MoE layer of the same shape
    assert full == pytest.approx(layers * layer_input + per_layer)
    assert activations("learner.recompute=full", "learner.recompute_num_layers=4") == pytest.approx(
        layers / 4 * layer_input + 4 * per_layer
    )
    block = [
        activations("learner.recompute=full", "learner.recompute_method=block", f"learner.recompute_num_layers={k}")
        for k in (1, 12, 47, 48, 64)
    ]
    # Block: what a micro-batch keeps (the recomputed layers' inputs, the others whole), larger than a layer's input
    # plus the one layer recomputed at a time.
    assert block[0] == pytest.approx(layer_input + 47 * per_layer)
    assert block[1] == pytest.approx(12 * layer_input + 36 * per_layer)
    assert block[2] == pytest.approx(47 * layer_input + per_layer)  # the last layer whole, or one recomputed
    assert none > block[0] > block[1] > block[2] and block[3] == block[4] == pytest.approx(full)


def test_a_layout_that_does_not_fit_names_its_largest_term(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "-c", str(CONFIGS / "qwen3-30b-a3b.yaml"), "cluster.gpus=4", "optimizer.cpu_offload=false"]
    assert main(args) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("does not fit: learner stage 0 needs") and "largest term is optimizer" in last
    assert main([*args[:4], "--gpu-memory", "200GB"]) == 0  # the same layout on 200 GB GPUs
    assert main([*args[:4], "--gpu-memory", "180GiB"]) == 0  # 193 GB


def test_plan_names_the_least_recomputation_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    """Beside the configured setting, `streamrl plan` prints each `learner.recompute` setting's peak (the same plans
    as each setting configured) and the least recomputation that fits: the ~3.6B layout, configured with full
    recomputation, fits without any on a 141 GB GPU, needs selective at 100 GB and full at 80 GB."""
    base = ["rollout.engines=2", "learner.data_parallel=2"]
    config = load_config(CONFIGS / "qwen3-large-gpu.yaml", base)
    hf = tiny_model_config("qwen3", "large")
    peaks = {
        r: plan_memory(load_config(CONFIGS / "qwen3-large-gpu.yaml", [*base, f"learner.recompute={r}"]), hf, 141).peak()
        for r in ("none", "selective", "full")
    }
    assert peaks["none"] > peaks["selective"] > peaks["full"]
    for memory, least in (("141", "none"), ("100", "selective"), ("80", "full"), ("40", None)):
        assert main(["plan", "-c", str(CONFIGS / "qwen3-large-gpu.yaml"), *base, "--gpu-memory", memory]) == (
            0 if config.learner.recompute == "full" and least else 1
        )
        line = capsys.readouterr().out.splitlines()[-2]
        listed = ", ".join(f"{r} {peak / GB:.1f} GB" for r, peak in peaks.items())
        verdict = f"the least that fits: {least}" if least else "none fits"
        assert line == f"learner.recompute at peak: {listed}; {verdict}"


def test_a_node_whose_host_memory_is_too_small_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """With `cluster.host_memory_gb` set, the node's planned host memory must stay under HOST_USABLE of it: Qwen3-30B
    -A3B with all its optimizer state on the host of a 512 GiB node (the measured case that ran out) does not fit."""
    args = ["plan", "-c", str(CONFIGS / "qwen3-30b-a3b.yaml"), "cluster.gpus=4", "--gpu-memory", "141"]
    config = load_config(CONFIGS / "qwen3-30b-a3b.yaml", ["cluster.gpus=4", "optimizer.offload_fraction=1.0"])
    host = plan_memory(config, config.model.architecture, 141).host_per_node
    assert main([*args, "optimizer.offload_fraction=1.0", "--host-memory", "512GiB"]) == 1  # 549.8 GB
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"does not fit: the host of a node needs {host / GB:.0f} GB of 550 GB"), last
    assert host > HOST_USABLE * 549.8e9
    assert main([*args, "optimizer.offload_fraction=1.0", f"cluster.host_memory_gb={host / GB / HOST_USABLE + 1}"]) == 0
    assert main([*args, "optimizer.offload_fraction=1.0", "--host-memory", "2TiB"]) == 0
    out = capsys.readouterr().out
    assert f"host per node {host / GB:.0f} GB of" in out and out.splitlines()[-1] == "fits"
    assert main([*args, "optimizer.offload_fraction=1.0"]) == 0  # the node's memory unknown: planned, not checked


def test_plan_answers_bad_input_with_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No architecture anywhere, or a size that is not one: exit 2 naming what is wrong, no traceback."""
    tiny = CONFIGS / "tiny.yaml"
    assert main(["plan", "-c", str(tiny), f"model.path={tmp_path / 'absent'}", "model.init_if_missing=null"]) == 2
    assert "model.path: no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "-c", str(tiny), "--gpu-memory", "lots"])
    assert "expected a size such as 96GB" in capsys.readouterr().err


def test_plan_of_a_model_not_written_yet_is_the_plan_of_the_written_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config whose model.init_if_missing has not written its random model yet plans with the HF config that model
    will have (`configs/qwen3-large-gpu.yaml` before its 7 GB are written): the same table as once it is there."""
    from streamrl.models.tiny import tiny_model_config, write_tiny_model

    config = CONFIGS / "qwen3-medium-gpu.yaml"
    model = tmp_path / "medium"
    assert main(["plan", "-c", str(config), f"model.path={model}"]) == 0
    before = capsys.readouterr().out
    assert not model.exists()  # planning writes nothing
    assert before.startswith("qwen3-medium: 2 GPUs, 1 node(s)")  # its learner rank's and its engine's
    write_tiny_model(model, "qwen3", "medium")
    assert main(["plan", "-c", str(config), f"model.path={model}"]) == 0
    assert capsys.readouterr().out == before
    written = json.loads((model / "config.json").read_text())
    planned = tiny_model_config("qwen3", "medium")
    assert {k: v for k, v in planned.items() if k in written and k != "transformers_version"} == {
        k: v for k, v in written.items() if k in planned and k != "transformers_version"
    }
    assert planned["architectures"] == written["architectures"] == ["Qwen3ForCausalLM"]
