"""Build a Megatron-core `GPTModel` equivalent to a HuggingFace causal LM.

Contract: `build_model_chunks(hf_config)` takes the contents of a HF `config.json` for `Qwen3ForCausalLM`,
`Qwen2ForCausalLM`, `LlamaForCausalLM`, `Qwen3MoeForCausalLM` or `DeepseekV3ForCausalLM` and returns this rank's
randomly initialised `GPTModel` chunks (its tensor- and expert-parallel shard of the layers of its pipeline stage:
one chunk, or one per virtual stage; MoE settings and layout in `streamrl.learner.model.moe`, the experts' grouped GEMMs
in `streamrl.learner.model.experts`, multi-latent attention in `streamrl.learner.model.mla`) which together match
the HF model once `streamrl.learner.hf.convert.load_hf_weights` weights are loaded. Without pipeline parallelism
`build_gpt_model(hf_config)` is the one whole model. Layers split evenly over the pipeline stages (and virtual
stages), except that `first_stage_layers` / `last_stage_layers` may give the first / last stage fewer or more
(Megatron's uneven split). It must be called after `streamrl.learner.parallel.init_parallel`. Only the local layer
spec is used (no Transformer Engine / apex), with its core attention replaced on CPU and GPU alike by
`streamrl.learner.model.attention.PackedSequenceAttention` so that packed micro-batches (`qkv_format='thd'`) run
without padding, and its memory-bound parts replaced by fused ones (`streamrl.learner.model.fused`: RMSNorm, the
whole-vocabulary per-token cross-entropy; `streamrl.learner.model.fused_paths`: RoPE, MoE token permutation).
Unsupported configurations raise `ValueError` naming the field.

Gradients are completed (data/context/expert-data-parallel, TP-partial and tied-embedding sums) by Megatron's DDP
(`streamrl.learner.optimizer`), which finds the TP-partial ones by Megatron's own marks (`sequence_parallel`, the
q/k layernorms) and the expert weights by `allreduce=False` (`streamrl.learner.model.experts`, at every layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from streamrl.config.stages import CHEAP_RECOMPUTE
from streamrl.learner.model.attention import PackedSequenceAttention
from streamrl.learner.model.experts import GroupedExperts
from streamrl.learner.model.fused import SwiGLU, token_cross_entropy
from streamrl.learner.model.fused_paths import use_fused_paths
from streamrl.learner.model.layout import check_pipeline_split, num_query_groups
from streamrl.learner.model.mla import (
    allow_mla_without_transformer_engine,
    is_mla,
    mla_config_fields,
    use_latent_modules,
)
from streamrl.learner.model.moe import (
    MOE_ARCHITECTURES,
    SequenceParallelRMSNorm,
    moe_config_fields,
    moe_layers,
    num_experts,
)
from streamrl.learner.model.recompute import OURS, ReleasingRowParallelLinear
from streamrl.learner.model.rope import rope_theta, scale_rotary_frequencies
from streamrl.learner.model.wgrad import use_fused_wgrad_accumulation

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", *MOE_ARCHITECTURES)


def architecture(hf_config: dict[str, Any]) -> str:
    """Return the single supported architecture named by `hf_config["architectures"]`."""
    archs = hf_config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architectures: unsupported {archs!r}; expected one of {SUPPORTED_ARCHITECTURES}")
    return archs[0]


def head_dim(hf_config: dict[str, Any]) -> int:
    """Per-head dimension; Qwen2 configs omit it and derive it from hidden / heads."""
    return hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]


def has_qkv_bias(hf_config: dict[str, Any]) -> bool:
    """Qwen2 always has q/k/v biases (and no other bias); the others have none."""
    return architecture(hf_config) == "Qwen2ForCausalLM"


def has_qk_layernorm(hf_config: dict[str, Any]) -> bool:
    """Qwen3 (dense and MoE) RMS-normalises each query/key head before RoPE."""
    return architecture(hf_config) in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _check_supported(hf_config: dict[str, Any]) -> None:
    """Reject HF options the Megatron model below would silently get wrong."""
    architecture(hf_config)
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: only 'silu' (SwiGLU) is supported, got {hf_config['hidden_act']!r}")
    # Llama/Qwen3 `attention_bias` also biases o_proj, and `mlp_bias` the MLP: Megatron's local spec cannot
    # bias those without biasing every linear layer, so these variants are out of scope.
    for field in ("attention_bias", "mlp_bias"):
        if hf_config.get(field):
            raise ValueError(f"{field}: biased projections are not supported")
    if hf_config.get("use_sliding_window"):
        raise ValueError("use_sliding_window: sliding-window attention is not supported")


def _pipeline_fields(
    hf_config: dict[str, Any], last_stage_layers: int | None, first_stage_layers: int | None
) -> dict[str, Any]:
    """Megatron's pipeline settings for this world, validated against the model's layer count."""
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    check_pipeline_split(hf_config["num_hidden_layers"], stages, virtual or 1, last_stage_layers, first_stage_layers)
    if stages == 1:
        return {}
    return dict(
        pipeline_model_parallel_size=stages,
        virtual_pipeline_model_parallel_size=virtual,
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
        # RL micro-batches are packed to different lengths: stages exchange each activation's shape first.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # Megatron checks it even for dense models; MoE models use it anyway
        # Batched p2p needs NCCL's coalescing; gloo sends and receives one by one.
        batch_p2p_comm=torch.cuda.is_available(),
    )


def _recompute_fields(
    recompute: str, recompute_num_layers: int, recompute_method: str, recompute_modules: list[str]
) -> dict[str, Any]:
    """Megatron's activation recomputation for `learner.recompute` (none, selective: Megatron's own names of
    `recompute_modules`, full: `recompute_method`)."""
    if recompute == "none":
        return {}
    if recompute == "selective":  # our names join after Megatron's validation (`transformer_config`)
        megatron_modules = [name for name in recompute_modules if name not in OURS]
        return dict(recompute_granularity="selective", recompute_modules=megatron_modules)
    if recompute == "full":
        if recompute_method not in ("uniform", "block"):
            raise ValueError(f"learner.recompute_method: expected uniform or block, got {recompute_method!r}")
        return dict(
            recompute_granularity="full", recompute_method=recompute_method, recompute_num_layers=recompute_num_layers
        )
    raise ValueError(f"learner.recompute: expected none, selective or full, got {recompute!r}")


def model_layout(learner: Any) -> dict[str, Any]:
    """`transformer_config`'s layout keywords from a `learner.*` config (`streamrl.config.LearnerConfig`)."""
    return {
        "last_stage_layers": learner.last_stage_layers,
        "recompute": learner.recompute,
        "recompute_num_layers": learner.recompute_num_layers,
        "first_stage_layers": learner.first_stage_layers,
        "moe_dispatcher": learner.moe_dispatcher,
        "recompute_method": learner.recompute_method,
        "recompute_modules": list(learner.recompute_modules),
        "attention_kernel": learner.attention_kernel,
    }


def transformer_config(
    hf_config: dict[str, Any],
    params_dtype: torch.dtype = torch.float32,
    last_stage_layers: int | None = None,
    recompute: str = "none",
    recompute_num_layers: int = 1,
    first_stage_layers: int | None = None,
    moe_dispatcher: str = "alltoall",
    recompute_method: str = "uniform",
    trained_through_ddp: bool = False,
    recompute_modules: Sequence[str] = CHEAP_RECOMPUTE,
    attention_kernel: str = "auto",
) -> TransformerConfig:
    """Translate a HF config into a Megatron `TransformerConfig` for this process's device and parallel layout.

    `params_dtype` is the dtype of the model's weights and activations (bfloat16: Megatron's optimizer keeps float32
    master weights, `streamrl.learner.optimizer`); `recompute` selects activation recomputation (none, selective:
    `recompute_modules` (`streamrl.learner.model.recompute`), full: `recompute_num_layers` layers by
    `recompute_method`); `moe_dispatcher` is Megatron's token dispatcher of MoE layers (`learner.moe_dispatcher`);
    `attention_kernel` the SDPA kernel the packed attention asks for first (`learner.attention_kernel`).
    `trained_through_ddp`: the model's weights get Megatron DDP's float32 main grads (the trainer's models), which on
    a GPU each linear layer's weight-gradient GEMM then adds into directly (`streamrl.learner.model.wgrad`); a model
    trained any other way must not set it.
    """
    _check_supported(hf_config)
    on_cpu = not torch.cuda.is_available()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    cp_size = parallel_state.get_context_parallel_world_size()
    if num_experts(hf_config):
        moe = moe_config_fields(hf_config, tp_size, ep_size, moe_dispatcher)
    elif ep_size > 1:
        raise ValueError(f"expert_parallel: {ep_size} needs a mixture-of-experts model, got {architecture(hf_config)}")
    else:
        moe = {}
    if is_mla(hf_config):
        config_class, attention = MLATransformerConfig, mla_config_fields(hf_config)
    else:
        config_class = TransformerConfig
        attention = dict(
            num_query_groups=num_query_groups(hf_config),
            kv_channels=head_dim(hf_config),
            qk_layernorm=has_qk_layernorm(hf_config),
        )
    config = config_class(
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=hf_config["num_attention_heads"],
        normalization="RMSNorm",
        layernorm_epsilon=hf_config["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        # RL log-probs must be deterministic functions of the weights: no dropout anywhere.
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        # With TP, each rank keeps only its share of the sequence outside attention and the MLP (norms, residual
        # stream, activations saved for backward): Megatron's sequence parallelism, always on at TP > 1.
        sequence_parallel=tp_size > 1,
        pipeline_dtype=params_dtype,
        # The policy loss is normalised over the whole global step already (invariant 6): Megatron's schedules
        # must not divide it again by token or micro-batch counts.
        calculate_per_token_loss=True,
        # Context parallelism runs through our core attention (K/V all-gather), not Transformer Engine's.
        context_parallel_size=cp_size,
        cp_comm_type="all_gather" if cp_size > 1 else None,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # On CPU the weights must be created on the host; the GPU path allocates them on the device directly.
        use_cpu_initialization=on_cpu,
        # No Transformer Engine / apex on these machines: the local spec's unfused kernels only.
        attention_backend="local",
        # Megatron's switch for an MLP activation module given in the layer spec (`_layer`: ours, one fused kernel
        # each way), not only Transformer Engine's, despite its name.
        use_te_activation_func=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=trained_through_ddp and not on_cpu,
        persist_layer_norm=False,
        **attention,
        # One mapping, later keys winning: the MoE fields repeat the pipeline's token dispatcher.
        **(
            _pipeline_fields(hf_config, last_stage_layers, first_stage_layers)
            | moe
            | _recompute_fields(recompute, recompute_num_layers, recompute_method, list(recompute_modules))
        ),
    )
    if recompute == "selective":
        config.recompute_modules = list(recompute_modules)  # with ours, which Megatron's validation refuses
    config.attention_kernel = attention_kernel  # ours: read by `attention.PackedSequenceAttention`
    return config


def is_expert_parameter(name: str) -> bool:
    """Whether the Megatron parameter `name` is a routed expert's weight (held per expert-parallel rank)."""
    return ".mlp.experts." in name


def _layer(config: TransformerConfig, sparse: bool) -> ModuleSpec:
    """One layer's local spec (MoE MLP if `sparse`) with our core attention and norms (fused, and allowing
    sequence parallelism); MoE experts are our grouped GEMMs (Megatron's own need Transformer Engine or the
    grouped_gemm package); MLA gets our latent modules (`streamrl.learner.model.mla`)."""
    mla = config.multi_latent_attention
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts if sparse else None,
        moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=mla,
        normalization="RMSNorm",
    )
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    # The local spec's DotProductAttention rejects packed sequences; ours attends within each one.
    attention.core_attention = PackedSequenceAttention
    if mla:
        use_latent_modules(attention)
    if sparse:
        layer.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    # The dense MLP's and the shared experts' gate|up activation: `fused.SwiGLU` (on the GPU one kernel forward and
    # one backward, where Megatron's unfused path runs chunk, silu and multiply, and a `cat` of their gradients).
    # Every MLP of the layer must get it: under `use_te_activation_func` one without would apply plain silu.
    mlps = [layer.mlp.submodules.shared_experts] if sparse else [layer.mlp]
    for mlp in mlps:
        if mlp is not None:
            mlp.submodules.activation_func = SwiGLU
            mlp.submodules.linear_fc2 = _releasing(mlp.submodules.linear_fc2)
    # The consumers of the activations `recompute_modules` may drop: they release them once used.
    attention.linear_proj = _releasing(attention.linear_proj)
    # Our RMSNorm: fused on the GPU (the local spec's is eager torch), and it allows sequence parallelism.
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelRMSNorm
    if config.qk_layernorm and not mla:
        attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    return spec


def _releasing(linear: type) -> type:
    """The local spec's row-parallel linear layer as one that releases a recomputable input
    (`streamrl.learner.model.recompute`)."""
    if linear is not RowParallelLinear:
        raise ValueError(f"layer spec: expected Megatron's RowParallelLinear here, got {linear}")
    return ReleasingRowParallelLinear


def _layer_spec(
    config: TransformerConfig, hf_config: dict[str, Any], vp_stage: int | None
) -> ModuleSpec | TransformerBlockSubmodules:
    """The per-layer specs (dense or MoE MLP) of this chunk's layers."""
    sparse = moe_layers(hf_config)
    specs = {kind: _layer(config, kind) for kind in set(sparse)}
    # A block spec, because a bare layer spec gets Megatron's default final norm: unfused, and it refuses sequence
    # parallelism.
    first = get_transformer_layer_offset(config, vp_stage)  # this chunk's layers only
    chunk = sparse[first : first + get_num_layers_to_build(config, vp_stage)]
    return TransformerBlockSubmodules(layer_specs=[specs[kind] for kind in chunk], layer_norm=SequenceParallelRMSNorm)


class _GPTModel(GPTModel):
    """Megatron's GPTModel with `fused.token_cross_entropy` as the per-token loss when the vocabulary is whole
    (tensor-parallel size 1): the same float32 -log p(label), without fp32 copies of the logits."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.config.tensor_model_parallel_size > 1:  # vocab-parallel logits: Megatron's all-reducing loss
            return super().compute_language_model_loss(labels, logits)
        return token_cross_entropy(logits, labels.transpose(0, 1)).transpose(0, 1).contiguous()  # [S, B] <-> [B, S]


def build_model_chunks(
    hf_config: dict[str, Any], params_dtype: torch.dtype = torch.float32, **layout: Any
) -> list[GPTModel]:
    """This rank's model chunks, in virtual-stage order (one without virtual stages); `layout`: `transformer_config`'s
    keywords (stage layers, recomputation, MoE dispatcher). See the module docstring."""
    virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return [
        build_gpt_model(hf_config, params_dtype, stage, **layout)
        for stage in ([None] if virtual is None else range(virtual))
    ]


def build_gpt_model(
    hf_config: dict[str, Any], params_dtype: torch.dtype = torch.float32, vp_stage: int | None = None, **layout: Any
) -> GPTModel:
    """Build one (randomly initialised) Megatron GPTModel chunk for `hf_config`, `layout` as `transformer_config`
    takes it; see the module docstring."""
    config = transformer_config(hf_config, params_dtype, **layout)
    if config.multi_latent_attention:
        allow_mla_without_transformer_engine()
    use_fused_paths()
    if config.gradient_accumulation_fusion:
        use_fused_wgrad_accumulation()
    model = _GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(config, hf_config, vp_stage),
        vocab_size=hf_config["vocab_size"],
        max_sequence_length=hf_config["max_position_embeddings"],
        # The embedding lives on the first (virtual) stage, the output layer and loss on the last.
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        # Each TP rank keeps its vocabulary shard of the logits: the loss is computed vocab-parallel.
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        # MLA applies RoPE inside its attention, from the config's rope fields; the others use GPTModel's table.
        rotary_base=config.rotary_base if is_mla(hf_config) else rope_theta(hf_config),
        vp_stage=vp_stage,
    )
    if not is_mla(hf_config):
        scale_rotary_frequencies(model, hf_config)  # Llama-3.x scaling, with the checkpoint's parameters
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
