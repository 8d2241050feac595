"""The routed experts of a MoE layer as two grouped GEMMs over stacked expert weights (`torch._grouped_mm`).

Contract: `GroupedExperts(num_local_experts, config, pg_collection)` is the `experts` submodule of Megatron's
`MoELayer`, with the constructor and `forward` of megatron-core's `SequentialMLP` / `GroupedMLP`:
`forward(tokens [T, H], tokens_per_expert [E_local], probs [T]) -> (out [T, H], None)`, where the dispatcher has
sorted the tokens by local expert (the first `tokens_per_expert[0]` rows go to expert 0, ...) and each row gets
its expert's SwiGLU MLP scaled by its routing probability (`streamrl.learner.model.fused.swiglu`), exactly as
`SequentialMLP`'s per-expert loop computes:

    out_t = W_down[e] ((silu(W_gate[e] x_t) * (W_up[e] x_t)) * prob_t)      for the expert e of row t

Weights (one tensor per projection, not one per expert, so that one kernel runs all experts):
- `linear_fc1.weight` [E_local, 2F, H]: expert e's slice is cat(gate, up), i.e. `SequentialMLP`'s
  `local_experts.e.linear_fc1.weight` (HF's `experts.e.gate_proj` over `up_proj`);
- `linear_fc2.weight` [E_local, H, F]: expert e's `linear_fc2.weight` (HF's `down_proj`).
Experts are whole (expert tensor parallelism 1): expert parallelism splits the leading axis, EP rank r holding
global experts r*E_local .. (r+1)*E_local - 1. `sharded_state_dict` saves them as the global [E, 2F, H] and
[E, H, F] tensors under `SequentialMLP`'s checkpoint keys (`<prefix>experts.linear_fc{1,2}.weight`), sharded
along the expert axis, so a checkpoint reloads under any expert-parallel size.

Same code on CPU and GPU: `torch._grouped_mm` is one op with one autograd formula; torch 2.13's CPU build runs
it as a matmul per group (any float dtype), torch 2.11 on Hopper as a CUTLASS grouped GEMM in bf16, and float32
there too (both checked against the per-expert loop by tests/learner/model/test_experts.py). Its alignment rule,
checked at construction: row strides a multiple of 16 bytes, i.e. hidden size and expert FFN size multiples of 8
elements (bf16) or 4 (fp32). Group sizes need no alignment and may be 0 (such an expert gets a zero gradient).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from streamrl.learner.model.fused import swiglu
from streamrl.learner.model.recompute import recomputable, recompute_modules, release


class StackedLinear(torch.nn.Module):
    """Bias-free linear maps of `experts` experts, `weight` [experts, out, in]; rows are grouped by expert."""

    def __init__(
        self,
        experts: int,
        in_features: int,
        out_features: int,
        config: TransformerConfig,
        init_method: Callable[[Tensor], None],
    ) -> None:
        super().__init__()
        # On the host: torch's default device, which is the host unless a `torch.device("meta")` context asks for
        # shapes only (`streamrl.plan` builds the model that way).
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(experts, out_features, in_features, dtype=config.params_dtype, device=device)
        )
        # As Megatron's expert layers mark theirs (parallel over the expert-TP group, here of one rank): not a copy
        # of a TP peer's weight, so the expert optimizer, whose grad-norm group (expert TP x EP x PP) leaves out the
        # dense TP peers holding the same experts, counts it on every rank.
        self.weight.tensor_model_parallel = True
        if config.perform_initialization:
            # The expert-parallel stream: each EP rank draws different experts, its TP peers the same ones.
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                init_method(self.weight)

    def forward(self, rows: Tensor, group_ends: Tensor) -> Tensor:
        """rows [T, in] grouped by expert, group_ends int32 [experts] (cumulative row counts) -> [T, out]."""
        return torch._grouped_mm(rows, self.weight.transpose(1, 2), offs=group_ends)


class GroupedExperts(MegatronModule):
    """All local experts of a MoE layer in two grouped GEMMs; see the module docstring."""

    def __init__(
        self, num_local_experts: int, config: TransformerConfig, pg_collection: ProcessGroupCollection | None = None
    ) -> None:
        super().__init__(config=config)
        _check_supported(config, pg_collection)
        self.num_local_experts = num_local_experts
        self.ep_group, self.dp_group = pg_collection.ep, pg_collection.expt_dp
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        self.linear_fc1 = StackedLinear(num_local_experts, hidden, 2 * ffn, config, config.init_method)
        self.linear_fc2 = StackedLinear(num_local_experts, ffn, hidden, config, config.output_layer_init_method)
        self.recompute_act = "mlp_act" in recompute_modules(config)  # the SwiGLU output, rebuilt in backward
        for param in self.parameters():
            # Megatron's DDP / distributed optimizer reduce expert weights over the expert-data-parallel group, which
            # (expert TP 1) includes the TP and CP peers that routed other tokens: needed at EP=1 too, where Megatron's
            # own experts would be marked dense and summed over the data-parallel ranks only.
            param.allreduce = False

    def forward(self, tokens: Tensor, tokens_per_expert: Tensor, probs: Tensor) -> tuple[Tensor, None]:
        # The dispatcher may hand the counts over on the host; the kernel reads the group ends on the device.
        group_ends = tokens_per_expert.cumsum(0).to(device=tokens.device, dtype=torch.int32)
        # As SequentialMLP: the (fp32) probabilities scale the activation, then back to the compute dtype.
        fc1_out = self.linear_fc1(tokens, group_ends)
        hidden = recomputable(swiglu, fc1_out, probs) if self.recompute_act else swiglu(fc1_out, probs)
        out = self.linear_fc2(hidden, group_ends)
        release(hidden, out)
        return out, None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the ordinary backward (Megatron's delayed-wgrad hook)."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> ShardedStateDict:
        """The stacked weights as expert-axis shards of the global [E, ...] tensors (keys as SequentialMLP's)."""
        if (metadata or {}).get("singleton_local_shards"):
            raise ValueError("metadata.singleton_local_shards: per-expert checkpoint keys are not supported")
        ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
        expert_axis = len(sharded_offsets)  # after the axes the enclosing modules prepend (none today)
        return {
            f"{prefix}{name}.weight": ShardedTensor.from_rank_offsets(
                f"{prefix}experts.{name}.weight",
                linear.weight,
                *sharded_offsets,
                (expert_axis, ep_rank, ep_size),
                # Every rank of the expert-data-parallel group (data-parallel and TP peers) holds a replica.
                replica_id=(0, 0, self.dp_group.rank()),
                prepend_axis_num=len(sharded_offsets),
            )
            for name, linear in (("linear_fc1", self.linear_fc1), ("linear_fc2", self.linear_fc2))
        }


def _check_supported(config: TransformerConfig, pg_collection: ProcessGroupCollection | None) -> None:
    """Reject settings under which the computation above is not what MoELayer asks of its experts."""
    if pg_collection is None:
        raise ValueError("pg_collection: GroupedExperts needs the expert-parallel process groups")
    if pg_collection.expt_tp.size() != 1:
        raise ValueError(f"expert_tensor_parallel_size: must be 1 (whole experts), got {pg_collection.expt_tp.size()}")
    if not config.gated_linear_unit or config.activation_func is not F.silu:
        raise ValueError("activation_func: GroupedExperts computes SwiGLU (gated_linear_unit with silu) only")
    if config.add_bias_linear:
        raise ValueError("add_bias_linear: expert biases are not supported")
    if config.moe_apply_probs_on_input:
        raise ValueError("moe_apply_probs_on_input: probabilities are applied after the activation")
    if config.glu_linear_offset or config.activation_func_clamp_value is not None:
        raise ValueError("glu_linear_offset / activation_func_clamp_value: plain SwiGLU only")
    align = 16 // config.params_dtype.itemsize  # torch._grouped_mm's 16-byte stride rule
    for field in ("hidden_size", "moe_ffn_hidden_size"):
        if getattr(config, field) % align:
            raise ValueError(f"{field}: {getattr(config, field)} must be a multiple of {align} for grouped GEMM")
