"""DeepSeek-V3 on Megatron (float32, CPU/gloo): multi-latent attention, a dense first layer, sigmoid routing with
a frozen expert bias, group-limited top-k and a shared expert.

In process: the HF <-> Megatron round trip is bit-exact with the layouts stated independently here; TP x EP shards
hold the right pieces; unsupported configs are refused naming the field; at TP=1 the per-token log-probs of a
packed batch match HF transformers within 1e-4 (and the gradients match HF's) for the tiny preset and for a variant
without a q latent, with HF's non-interleaved RoPE layout and YaRN. Spawned gloo ranks: TP=2 x EP=2 (four)
reproduces the single-process loss, gradients and grad norm within 1e-5, and `stream_hf_weights` yields every HF
tensor (the expert bias included, unchanged by the step) exactly once, bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from streamrl.learner.hf.convert import (
    hf_to_megatron,
    load_hf_checkpoint,
    load_hf_weights,
    megatron_names,
    megatron_to_hf,
    stream_hf_weights,
)
from streamrl.learner.model.fused import SwiGLU
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.model.mla import mla_config_fields
from streamrl.learner.model.moe import moe_config_fields
from streamrl.models.tiny import write_tiny_model
from tests.learner.model.test_moe import (
    _build_and_step,
    _check_layouts,
    _parallel_rank,
    assert_grads_match_hf,
    assert_logprobs_match_hf,
)
from tests.learner.ranks import TIMEOUT_S, run_ranks

EXPERTS, ROPE, NOPE = 8, 16, 32  # of the tiny preset
# No q latent (q_proj), HF's non-interleaved RoPE layout (the converter reorders the rotary rows) and YaRN with a
# cos/sin factor and a softmax scale different from 1.
VARIANT = dict(
    q_lora_rank=None,
    rope_interleave=False,
    max_position_embeddings=32,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=8,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=0.707,
        mscale_all_dim=1.0,
    ),
)


@pytest.fixture(scope="module")
def ds_dir(tiny_model_dirs: Callable[[str], Path]) -> Path:
    return tiny_model_dirs("deepseek_v3")


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("deepseek-variant"), arch="deepseek_v3", **VARIANT)


@pytest.fixture(scope="module")
def reference(tp1_world: None, ds_dir: Path) -> tuple[torch.Tensor, list, dict, float, float]:
    """Single-process (TP=1, EP=1) loss, streamed weights and gradients."""
    return _build_and_step(ds_dir)


def test_round_trip_is_bit_exact(ds_dir: Path, variant_dir: Path) -> None:
    for model_dir in (ds_dir, variant_dir):
        hf_config, hf_state = load_hf_checkpoint(model_dir)
        mcore = hf_to_megatron(hf_state, hf_config)
        assert list(mcore) == megatron_names(hf_config)
        back = dict(megatron_to_hf(mcore, hf_config))
        assert back.keys() == hf_state.keys()
        assert all(torch.equal(back[name], tensor) for name, tensor in hf_state.items())
    # Independent statement of the layouts. Interleaved RoPE (the preset): MLA weights map unchanged.
    hf_config, hf_state = load_hf_checkpoint(ds_dir)
    mcore = hf_to_megatron(hf_state, hf_config)
    hf, mg = "model.layers.1.", "decoder.layers.1."
    for hf_name, mg_name in [
        ("self_attn.q_b_proj", "self_attention.linear_q_up_proj"),
        ("self_attn.kv_a_proj_with_mqa", "self_attention.linear_kv_down_proj"),
        ("self_attn.kv_b_proj", "self_attention.linear_kv_up_proj"),
        ("self_attn.kv_a_layernorm", "self_attention.kv_layernorm"),
    ]:
        assert torch.equal(mcore[f"{mg}{mg_name}.weight"], hf_state[f"{hf}{hf_name}.weight"])
    assert torch.equal(mcore[f"{mg}mlp.router.expert_bias"], hf_state[f"{hf}mlp.gate.e_score_correction_bias"])
    shared = torch.cat([hf_state[f"{hf}mlp.shared_experts.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(mcore[f"{mg}mlp.shared_experts.linear_fc1.weight"], shared)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in mcore and "decoder.layers.0.mlp.router.weight" not in mcore
    # Half-layout RoPE (the variant): Megatron's rotary rows interleave HF's two halves, per head and in the kv latent.
    hf_config, hf_state = load_hf_checkpoint(variant_dir)
    mcore = hf_to_megatron(hf_state, hf_config)
    q_hf = hf_state[f"{hf}self_attn.q_proj.weight"].view(4, NOPE + ROPE, -1)
    q_mg = mcore[f"{mg}self_attention.linear_q_proj.weight"].view(4, NOPE + ROPE, -1)
    kv_hf = hf_state[f"{hf}self_attn.kv_a_proj_with_mqa.weight"]
    kv_mg = mcore[f"{mg}self_attention.linear_kv_down_proj.weight"]
    for i in range(ROPE // 2):
        for half in range(2):
            assert torch.equal(q_mg[:, NOPE + 2 * i + half], q_hf[:, NOPE + half * ROPE // 2 + i])
            assert torch.equal(kv_mg[-ROPE + 2 * i + half], kv_hf[-ROPE + half * ROPE // 2 + i])
    assert torch.equal(q_mg[:, :NOPE], q_hf[:, :NOPE]) and torch.equal(kv_mg[:-ROPE], kv_hf[:-ROPE])


def test_tp2_ep2_shards_hold_their_pieces(ds_dir: Path) -> None:
    hf_config, hf_state = load_hf_checkpoint(ds_dir)
    full = hf_to_megatron(hf_state, hf_config)
    for tp_rank, ep_rank in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        shard = hf_to_megatron(hf_state, hf_config, tp_rank=tp_rank, tp_size=2, ep_rank=ep_rank, ep_size=2)
        assert list(shard) == megatron_names(hf_config)
        for name, tensor in shard.items():
            if ".mlp.experts." in name:  # stacked whole experts: row j is global expert ep_rank * E/EP + j
                local = EXPERTS // 2
                expected = full[name][ep_rank * local : (ep_rank + 1) * local]
            elif "layernorm" in name or ".router." in name or "down_proj" in name:  # replicated: norms, router,
                # expert bias and the latent down projections (see streamrl.learner.model.mla)
                expected = full[name]
            elif "linear_fc1" in name:  # dense and shared experts: cat(gate shard, up shard)
                expected = torch.cat([half.chunk(2)[tp_rank] for half in full[name].chunk(2)])
            else:  # row-parallel output projections split columns; every other matrix splits rows
                expected = full[name].chunk(2, dim=1 if "linear_proj" in name or "linear_fc2" in name else 0)[tp_rank]
            assert torch.equal(tensor, expected), name


def test_unsupported_configs_are_rejected(ds_dir: Path) -> None:
    hf_config, hf_state = load_hf_checkpoint(ds_dir)
    rope = {"rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}
    with pytest.raises(ValueError, match="rope_parameters.rope_type"):
        mla_config_fields({**hf_config, "rope_parameters": {**rope, "rope_type": "linear"}})
    with pytest.raises(ValueError, match="rope_parameters.mscale"):  # HF and Megatron scale differently then
        mla_config_fields({**hf_config, "rope_parameters": {**rope, "rope_type": "yarn", "mscale_all_dim": 1.0}})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        mla_config_fields({**hf_config, "num_key_value_heads": 2})
    with pytest.raises(ValueError, match="topk_group"):  # HF scores groups by their best 2, Megatron by top_k/groups
        moe_config_fields({**hf_config, "num_experts_per_tok": 4}, tp_size=1, ep_size=1)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        moe_config_fields({**hf_config, "norm_topk_prob": False}, tp_size=1, ep_size=1)
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        moe_config_fields({**hf_config, "first_k_dense_replace": 3}, tp_size=1, ep_size=1)
    with pytest.raises(ValueError, match="n_routed_experts"):
        mla_config_fields({**hf_config, "n_routed_experts": None})
    with pytest.raises(ValueError, match="n_shared_experts \\* moe_intermediate_size"):  # TP-sharded, unlike experts
        hf_to_megatron(hf_state, {**hf_config, "moe_intermediate_size": 63}, tp_rank=0, tp_size=2)


def test_tp1_matches_hf(tp1_world: None, ds_dir: Path, variant_dir: Path, reference: tuple) -> None:
    assert_logprobs_match_hf(variant_dir)
    hf_grads = assert_logprobs_match_hf(ds_dir)
    hf_state = load_hf_checkpoint(ds_dir)[1]
    _, weights, grads, unpacked_gap, norm = reference
    assert unpacked_gap < 1e-5
    # The expert bias is a buffer: streamed with the weights, unchanged by the step, and not trained.
    biases = {name for name in hf_state if name.endswith("e_score_correction_bias")}
    assert len(biases) == 2 and all(torch.equal(dict(weights)[name], hf_state[name]) for name in biases)
    assert_grads_match_hf({name: grad for name, grad in grads.items() if name not in biases}, norm, hf_grads)


def test_dense_and_shared_expert_mlps_use_the_fused_activation(tp1_world: None, ds_dir: Path) -> None:
    """Under Megatron's `use_te_activation_func` an MLP without the spec's activation would apply plain silu to its
    whole gate|up projection: every MLP of every layer kind must hold `fused.SwiGLU`."""
    model = build_gpt_model(load_hf_checkpoint(ds_dir)[0])
    mlps = [module for module in model.modules() if isinstance(module, MLP)]
    assert {type(mlp) for mlp in mlps} == {MLP, SharedExpertMLP}  # a dense first layer, then shared experts
    assert all(isinstance(mlp.activation_func, SwiGLU) for mlp in mlps)


def test_tp2_ep2_matches_single_process(ds_dir: Path, reference: tuple, tmp_path: Path) -> None:
    layouts = [(2, 2)]  # 4 ranks: TP pairs {0,1}, {2,3} each run half the batch; EP pairs are the TP pairs
    run_ranks(_parallel_rank, 4, (4, layouts, [], ds_dir), tmp_path, 3 * TIMEOUT_S)
    _check_layouts(tmp_path, 4, layouts, reference, load_hf_checkpoint(ds_dir)[1])


def test_streaming_in_the_engine_dtype_casts_once_and_keeps_the_router_bias(tp1_world: None, ds_dir: Path) -> None:
    """The publish path: every tensor in bf16 (stacked experts cast whole), the router bias still float32."""
    hf_config, hf_state = load_hf_checkpoint(ds_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, hf_state, hf_config)
    streamed = dict(stream_hf_weights(model, hf_config, dtype=torch.bfloat16))
    assert streamed.keys() == hf_state.keys()
    for name, tensor in streamed.items():
        expected = hf_state[name] if name.endswith("e_score_correction_bias") else hf_state[name].to(torch.bfloat16)
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name


def test_moonlight_variant_matches_hf(tp1_world: None, tiny_model_dirs: Callable[[str], Path]) -> None:
    """`init-model --arch moonlight` (plain q projection, ungrouped routing, two shared experts) builds and scores
    like transformers."""
    moonlight_dir = tiny_model_dirs("moonlight")
    hf_config, hf_state = load_hf_checkpoint(moonlight_dir)
    assert hf_config["q_lora_rank"] is None and hf_config["n_group"] == 1 and hf_config["n_shared_experts"] == 2
    assert list(hf_to_megatron(hf_state, hf_config)) == megatron_names(hf_config)
    assert_logprobs_match_hf(moonlight_dir)
