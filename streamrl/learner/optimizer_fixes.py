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
- `HybridDeviceOptimizer` copies each updated host master (float32, in pageable memory) into its bf16 GPU parameter
  with one `copy_`, which converts on the host into a temporary pageable tensor that the driver then stages through
  a buffer of its own, synchronously (on Qwen3-30B-A3B at EP 4: 2.4 s of a 23 s step in "Memcpy HtoD (Pageable ->
  Device)"). Here the updated masters go through two pinned buffers of `STAGING_BYTES` per rank instead: the host
  converts a chunk into one while the other's asynchronous copy runs (same layout, 64 groups a step: the optimizer
  phase 4.8 s -> 3.2 s). Nothing large is pinned (pinning the masters themselves page-locks ~15 GB a rank at start,
  each block rounded up to a power of two by torch's host allocator, and made that benchmark slower).
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
_megatron_copy_back = HybridDeviceOptimizer._register_param_copy_back_gpu_hook
STAGING_BYTES = 256 * 2**20  # each of a rank's two pinned buffers for the offloaded weights' way back to the GPU


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


class _PinnedRing:
    """Two pinned host buffers of `STAGING_BYTES` through which host tensors reach the GPU in chunks: the host
    converts a chunk into one buffer while the other buffer's copy to the GPU is in flight."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.copied: list[torch.cuda.Event | None] = [None, None]  # when each buffer's last copy has finished
        self.turn = 0

    def send(self, source: torch.Tensor, target: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Copy the host tensor `source` into the contiguous GPU tensor `target` (converting its dtype) on `stream`."""
        if not self.buffers:
            self.buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        flat_source, flat_target = source.reshape(-1), target.view(-1)
        per_chunk = STAGING_BYTES // flat_target.element_size()
        for start in range(0, flat_source.numel(), per_chunk):
            count = min(per_chunk, flat_source.numel() - start)
            turn, self.turn = self.turn, 1 - self.turn
            copied = self.copied[turn]
            if copied is not None:
                copied.synchronize()  # the buffer's previous chunk has left it
            chunk = self.buffers[turn][: count * flat_target.element_size()].view(flat_target.dtype)
            chunk.copy_(flat_source[start : start + count])  # the conversion, on the host's threads
            flat_target[start : start + count].copy_(chunk, non_blocking=True)
            self.copied[turn] = stream.record_event()


def _register_pinned_copy_back(self: Any) -> None:
    """`HybridDeviceOptimizer._register_param_copy_back_gpu_hook` through a pinned ring (see the module docstring).

    Each host sub-optimizer's post-step hook sends its updated parameters to their GPU parameters on the optimizer's
    host-to-device stream, which the current stream then waits for."""
    host_optimizers, self.cpu_optimizers = self.cpu_optimizers, []
    _megatron_copy_back(self)  # Megatron's own hook for the GPU share (16-bit parameters from their float32 masters)
    self.cpu_optimizers = host_optimizers
    ring = self.pinned_ring = _PinnedRing()

    def copy_back(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._h2d_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._h2d_stream):
            for group in optimizer.param_groups:
                for param in group["params"]:
                    ring.send(param.data, self.cpu_copys_map_gpu_param[param].data, self._h2d_stream)
        self._h2d_stream.record_event().wait(torch.cuda.current_stream())

    for optimizer in host_optimizers:
        optimizer.register_step_post_hook(copy_back)


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
    HybridDeviceOptimizer._register_param_copy_back_gpu_hook = _register_pinned_copy_back
    build = DistributedOptimizer._build_model_and_main_param_groups  # bound to the class
    DistributedOptimizer._build_model_and_main_param_groups = _leaf_fp32_shards(build)
    ranges = DistributedOptimizer._build_optimizer_group_ranges
    DistributedOptimizer._build_optimizer_group_ranges = _fp32_first_group_ranges(ranges)
    _applied = True
