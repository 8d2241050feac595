"""Megatron's optimizer, fixed for our models: bfloat16 weights beside float32 norms, torch's AdamW (no Transformer
Engine or apex on any machine) and CPU offload (HybridDeviceOptimizer). Megatron-LM never meets these: its TE norms
are bf16 and its optimizer is TE's FusedAdam. `apply_optimizer_fixes()` installs them (idempotent; called by
`streamrl.learner.cpu_compat.apply_cpu_compat`, on CPU and GPU alike). Tests: tests/learner/test_checkpoint.py
(bf16 and offloaded checkpoints continue exactly), tests/learner/test_optimizer.py.

- The distributed optimizer's reshardable load copies every key of the per-parameter state from the loaded tensors,
  including torch AdamW's "step", which the load does not carry (it sets the common step itself): a KeyError. Only
  the loaded tensors are copied.
- The distributed optimizer slices float32 parameters into their shards without detaching them (its
  float16 branch detaches), so the shards are non-leaf views, and an optimizer constructed on them refuses them
  ("can't optimize a non-leaf Tensor"): `HybridDeviceOptimizer`, i.e. `optimizer.cpu_offload`, for any model
  with float32 parameters (our norms' weights stay float32 under bf16). The shards are replaced by detached views
  of the same storage (same attributes), before the optimizer's groups are built from them.
- After a load, `HybridDeviceOptimizer` copies each restored master weight into the float32 copy of its
  parameter, which only 16-bit parameters have: our float32 norms raised KeyError. Their master is their host copy
  (offloaded) or the parameter itself. It then sends a sub-optimizer's restored state to the host when the
  sub-optimizer is an instance of the host optimizer's class, which without TE is also the GPU one's (torch's
  AdamW): the state goes to the device of the sub-optimizer's own parameters instead.
- Loading an offloaded optimizer's checkpoint: its param groups name the Adam classes, which the checkpoint's
  weights-only load refuses; `streamrl.learner.checkpoint` allows exactly those classes.
- The distributed optimizer records each parameter's place in its optimizer group in the grad buffers'
  order (the bf16 buffer, then the float32 one), but hands the optimizer each group as its float32 shards first,
  then the 16-bit ones; its checkpoint code looks states up by the recorded place. With every parameter of one
  dtype (Megatron-LM's TE norms are bf16) the orders agree; our bf16 models keep float32 norms, so saving a bf16
  learner's optimizer state paired each parameter with another's state and failed on the size. The recorded order
  is made float32-first as well.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

_applied = False


def _set_main_param_and_optimizer_states(
    self: Any, model_param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]
) -> None:
    """`DistributedOptimizer._set_main_param_and_optimizer_states` copying only the tensors it is given.

    With torch's AdamW the per-parameter state also holds "step" (already set from the checkpoint's common step by
    `load_state_dict`), which the original tries to copy from `tensors` too: a KeyError on every reshardable load.
    Under the precision-aware path (`optimizer.cpu_offload`: HybridDeviceOptimizer) the state is set as the original
    sets it, the master weights under "master_param".
    """
    group_index, group_order = self.model_param_group_index_map[model_param]
    param = self.optimizer.param_groups[group_index]["params"][group_order]
    if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        if not isinstance(self.optimizer, HybridDeviceOptimizer):
            raise RuntimeError("streamrl: the precision-aware optimizer is only used with HybridDeviceOptimizer")
        for key, tensor in tensors.items():
            self.optimizer.state[param]["master_param" if key == "param" else key] = tensor
        return
    destinations = {"param": param, **self.optimizer.state[param]}
    for key, tensor in tensors.items():
        destinations[key].copy_(tensor)


def _update_masters_by_new_state(self: Any) -> None:
    """`HybridDeviceOptimizer._update_fp32_params_by_new_state` for models with float32 parameters too.

    After a load it copies each state's "master_param" into the parameter's float32 copy, which only 16-bit parameters
    have: a float32 parameter (our norms) raised KeyError. Its master is its host copy when offloaded, else itself.
    """
    if not self.param_update_in_fp32:
        return
    for param, state in self.state.items():
        if "master_param" not in state:  # a fresh state (before the first step or a load): nothing to restore
            continue
        master = self.param_to_fp32_param.get(param, self.gpu_params_map_cpu_copy.get(param, param))
        if master is not state["master_param"]:
            master.data.copy_(state["master_param"])


def _move_states_to_their_params(self: Any) -> None:
    """`HybridDeviceOptimizer._move_new_state_to_right_device` by each sub-optimizer's parameters' device.

    The original sends a sub-optimizer's restored state to the host when it is an instance of the host optimizer's
    class; without TE both classes are torch's AdamW, so the GPU share's moments went to the host too and its next
    (fused, CUDA) step failed on the device mix."""
    for optimizer in self.sub_optimizers:
        for param, state in optimizer.state.items():
            orig_param = self.inner_param_to_orig_param.get(param, param)
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self.state[orig_param][key] = state[key] = value.to(param.device)


def _leaf_fp32_shards(build: Callable[..., tuple]) -> classmethod:
    """`DistributedOptimizer._build_model_and_main_param_groups` with float32 shards detached (see docstring)."""

    def wrapper(cls: type, gbuf_ranges: list, param_gbuf_map: dict, opt_group_ranges: list, config: Any) -> tuple:
        groups = build(gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        leaves: dict[int, torch.Tensor] = {}
        for shards in groups[3]:  # shard_fp32_groups
            for index, shard in enumerate(shards):
                if not shard.is_leaf:
                    leaf = shard.detach()
                    leaf.__dict__.update(shard.__dict__)  # tensor-parallel attributes, `shared`
                    leaves[id(shard)] = shards[index] = leaf
        for group_range in opt_group_ranges:
            orig_group = group_range["orig_group"]
            orig_group["params"] = [leaves.get(id(param), param) for param in orig_group["params"]]
        return groups

    return classmethod(wrapper)


def _fp32_first_group_ranges(build: Callable[..., tuple]) -> classmethod:
    """`DistributedOptimizer._build_optimizer_group_ranges` with each group's float32 parameters first (see docstring),
    the order `_build_model_and_main_param_groups` gives the optimizer."""

    def wrapper(cls: type, param_groups: list, gbuf_ranges: list) -> tuple:
        index_map, group_ranges = build(param_groups, gbuf_ranges)
        for group_index, group_range in enumerate(group_ranges):
            params = group_range["params"]
            params.sort(key=lambda param: param.dtype != torch.float32)  # stable: float32 first, order kept
            for order, param in enumerate(params):
                index_map[param] = (group_index, order)
        return index_map, group_ranges

    return classmethod(wrapper)


def apply_optimizer_fixes() -> None:
    """Install the fixes of the module docstring (once)."""
    global _applied
    if _applied:
        return
    if not HAVE_APEX_OR_TE:  # torch's AdamW: its state has a "step" per parameter
        DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    HybridDeviceOptimizer._update_fp32_params_by_new_state = _update_masters_by_new_state
    HybridDeviceOptimizer._move_new_state_to_right_device = _move_states_to_their_params
    build = DistributedOptimizer._build_model_and_main_param_groups  # bound to the class
    DistributedOptimizer._build_model_and_main_param_groups = _leaf_fp32_shards(build)
    ranges = DistributedOptimizer._build_optimizer_group_ranges
    DistributedOptimizer._build_optimizer_group_ranges = _fp32_first_group_ranges(ranges)
    _applied = True
