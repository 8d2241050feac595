"""Make megatron-core 0.16.1's GPTModel (local layer spec) run forward/backward on a CPU-only PyTorch.

Contract: `apply_cpu_compat()` is idempotent, does nothing when CUDA is available (except the fixes marked
"everywhere" below), and must run before the parallel world / model are
built (`streamrl.learner.parallel.init_parallel` calls it). It raises
`RuntimeError` on any megatron-core version other than the one these patches were checked against, because
each patch replaces a specific code path that may move or change between releases.

What is patched, and only what our learner path (local spec, Megatron's DDP and optimizer, activation
recompute; no inference) actually hits:
- `torch.cuda.current_device()` raises on a CPU build, yet Megatron uses it as the device for the attention
  scratch buffer (`GlobalMemoryBuffer.get_tensor`) and moves RoPE `inv_freq` there on every forward; it is
  made to return the CPU device.
- The model-parallel RNG tracker (`CudaRNGStatesTracker.add` / `.fork`, used by `model_parallel_cuda_manual_seed`
  and around attention dropout on every forward) reads and writes CUDA generator states; on CPU it tracks the
  CPU default generator's state instead.
- Activation recomputation (`CheckpointFunction`) saves and restores the CUDA generator's state next to the host's
  and the tracker's (`_get_all_rng_states` / `_set_all_rng_states`); on CPU only the host's and the tracker's.
- `get_default_causal_mask` builds its mask on "cuda"; it is rebuilt on the CPU (only reached when a caller
  passes no attention mask).
- Distributed checkpointing (torch_dist backend) stages tensors to host memory with non-blocking copies and then
  calls `torch.cuda.synchronize()` (`FileSystemWriterAsync.preload_tensors`); on CPU the copies are made blocking
  (they are no-ops for host tensors), so nothing waits on a device that does not exist.

Pipeline parallelism (Megatron's schedules and p2p communication, `streamrl.learner.pipeline`):
- The schedules count tokens in `torch.zeros([], device="cuda")`: inside `megatron.core.pipeline_parallel.
  schedules` the name `torch` is bound to a view of torch whose `zeros` puts "cuda" tensors on the host.
- Exchanging activation shapes ends with `torch.cuda.synchronize()` (a guard for NCCL's batched p2p); there is no
  device to wait for, so it is made a no-op.
- With `variable_seq_lengths`, stages first exchange activation shapes in one batched p2p call on the pipeline
  group. With two stages the previous and the next rank are the same peer, so in the interleaved schedule a
  rank's shape sends to it (backward, then forward) are matched in issue order with its receives (forward, then
  backward) and the shapes cross over. On gloo the exchange goes through Megatron's own unbatched `_p2p_ops`
  instead, which sends the two directions over two different groups for exactly this case. On NCCL that
  exchange hung (H200, 2 GPUs), so there `streamrl.learner.parallel.init_parallel` refuses the interleaved
  schedule with two stages instead, as Megatron-LM once did.
- With tied embeddings, the last stage's copy of the embedding is synchronised at construction by an all-reduce
  of `weight.data.cuda()`: during `LanguageModule.setup_embeddings_and_output_layer`, `Tensor.cuda` returns the
  host tensor itself.

Megatron's DDP and optimizer (`streamrl.learner.optimizer`; DDP itself allocates its buffers on
`torch.cuda.current_device()`, patched above):
- The optimizers create their scalars (found-inf flag, loss scale, norm buffers) with `device="cuda"`: inside
  `megatron.core.optimizer.{optimizer, distrib_optimizer, clip_grads, grad_scaler}` the name `torch` is bound to
  the view of torch whose `zeros` / `tensor` put "cuda" tensors on the host.
- The mixed-precision / distributed optimizer constructors and `clip_grad_by_total_norm_fp32` accept parameters
  and gradients by their type names, which must be "torch.cuda.*Tensor": while they run, `Tensor.type()` names
  host tensors as CUDA ones.
- Without TE/apex the grad norm is `local_multi_tensor_l2_norm`, which moves its result to "cuda"; the same norm
  is computed with the result left on the host.
- The distributed optimizer's reshardable checkpoint gathers its shards with `send_tensor.cuda()`
  (`get_parameter_state_dp_zero`): while it runs, `Tensor.cuda` returns the host tensor itself.
- Everywhere: the optimizer's own fixes for our models (float32 norms beside bf16 weights, torch's AdamW without
  TE/apex, offload) are in `streamrl.learner.optimizer_fixes`, applied from here.
- Everywhere: Megatron's `CheckpointWithoutOutput()` (its `layernorm` recompute) takes a Transformer Engine path
  by default; `streamrl.learner.model.recompute.fix_megatron_checkpoint`, applied from here.

Mixture-of-experts (`streamrl.learner.model.moe`: local spec, "alltoall" token dispatcher):
- Everywhere: without Transformer Engine, `moe_utils` never binds `te_general_gemm` (its import sits inside the
  failed TE `try`), yet the router's `RouterGatingLinearFunction` tests it against None on every forward: a
  NameError. It is bound to None, which selects the plain torch matmul, only while the name is unbound.
- `MoEAlltoAllTokenDispatcher.__init__` creates a CUDA stream for its device-to-host copies of the token counts,
  and `_maybe_dtoh_and_synchronize` copies on it and records / waits on a CUDA event. On CPU the counts already
  live on the host: no stream is created, and at the copy point the split sizes are turned into lists - the GPU
  path turns them into numpy arrays there, and gloo's `all_to_all_single` rejects tensors as split sizes.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from streamrl.learner.model.recompute import fix_megatron_checkpoint
from streamrl.learner.optimizer_fixes import apply_optimizer_fixes

MEGATRON_VERSION = "0.16.1"

_applied = False


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """`CudaRNGStatesTracker.add` on the CPU generator: remember the state a generator seeded with `seed` has."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    # A private generator gives the seeded state without disturbing the default generator's stream.
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    self.states_[name] = generator.get_state()


@contextlib.contextmanager
def _cpu_tracker_fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
    """`CudaRNGStatesTracker.fork` on the CPU generator: run the body with `name`'s state, then restore.

    Unlike the CUDA original this does not warn that "the CPU RNG state changed": here the CPU generator *is*
    the tracked generator, so any random op (dropout > 0) in the body legitimately advances it.
    """
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    orig_state = torch.get_rng_state()
    orig_name = self._current_state_name
    if orig_name != "default-rng":
        self.states_[orig_name] = orig_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        if orig_name != "default-rng":
            orig_state = self.states_[orig_name]
        torch.set_rng_state(orig_state)
        self._current_state_name = orig_name


def _cpu_all_rng_states() -> tuple[torch.Tensor, None, dict[str, Any]]:
    """`_get_all_rng_states` without a CUDA generator: the host generator's and the tracker's states."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return torch.get_rng_state(), None, get_cuda_rng_tracker().get_states()


def _cpu_set_all_rng_states(cpu_rng_state: torch.Tensor, cuda_rng_state: None, tracker_states: dict[str, Any]) -> None:
    """`_set_all_rng_states` without a CUDA generator."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(cpu_rng_state)
    get_cuda_rng_tracker().set_states(tracker_states)


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


def _blocking_preload(original: Callable[..., list]) -> Callable[..., list]:
    """`FileSystemWriterAsync.preload_tensors` that always copies blocking (no `torch.cuda.synchronize()`)."""

    def preload_tensors(write_buckets: list, non_blocking: bool = True) -> list:
        return original(write_buckets, non_blocking=False)

    return preload_tensors


def _cpu_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
    """`MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize` on the host: nothing to copy or wait for."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for attr in ("input_splits", "output_splits", "output_splits_tp"):
            splits = getattr(self, attr)
            if torch.is_tensor(splits):
                setattr(self, attr, splits.tolist())
    return tokens_per_expert


def _host(device: Any) -> Any:
    return "cpu" if device == "cuda" else device


class _HostTorch(types.ModuleType):
    """torch, except that `zeros` / `tensor` with `device="cuda"` allocate on the host (bound as `torch` in the
    schedules and the optimizer modules)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*size, device=_host(device), **kwargs)

    @staticmethod
    def tensor(data: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(data, device=_host(device), **kwargs)


def _no_synchronize(device: Any = None) -> None:
    """`torch.cuda.synchronize` without a device: host work is already complete when a call returns."""


def _with_host_cuda(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run `method` with `Tensor.cuda` returning the host tensor itself (its target device is the host here)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    return wrapper


def _communicate_shapes_by_direction(
    self: Any,
    tensor_send_next: torch.Tensor | None,
    tensor_send_prev: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
) -> tuple[list[int], list[int]]:
    """`P2PCommunicator._communicate_shapes` over `_p2p_ops`: one group per direction when there are two stages."""
    from megatron.core.pipeline_parallel.p2p_communication import _p2p_ops

    device = torch.cuda.current_device()
    shape_of = lambda t: None if t is None else torch.tensor(t.size(), device=device, dtype=torch.int64)  # noqa: E731
    received = {
        d: torch.empty(3, device=device, dtype=torch.int64) if wanted else None
        for d, wanted in (("prev", recv_prev), ("next", recv_next))
    }
    requests = _p2p_ops(
        tensor_send_prev=shape_of(tensor_send_prev),
        tensor_recv_prev=received["prev"],
        tensor_send_next=shape_of(tensor_send_next),
        tensor_recv_next=received["next"],
        group=self.pp_group,
        prev_pipeline_rank=self.prev_rank,
        next_pipeline_rank=self.next_rank,
    )
    for request in requests.values():
        request.wait()
    shapes = [[0, 0, 0] if t is None else t.tolist() for t in (received["prev"], received["next"])]
    return shapes[0], shapes[1]


def _host_multi_tensor_l2_norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], per_tensor: bool, *args: Any
) -> tuple[torch.Tensor, None]:
    """`local_multi_tensor_l2_norm` (the L2 norm of all the tensors together) with its result left on the host."""
    norms = torch.stack([torch.linalg.vector_norm(t) for tensors in tensor_lists for t in tensors])
    return torch.linalg.vector_norm(norms).float().reshape(1), None


def _with_cuda_type_names(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run `method` with `Tensor.type()` naming host tensors as CUDA ones ("torch.cuda.FloatTensor"), the only
    names the optimizers' parameter checks accept; `type(dtype)` conversions are untouched."""
    original = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.Tensor.type = cuda_type
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.type = original

    return wrapper


# Stands in for the dispatcher's shared CUDA stream so that its constructor does not create one.
_NO_CUDA_STREAM = object()


def apply_cpu_compat() -> None:
    """Apply the patches described in the module docstring (once; only the "everywhere" ones when CUDA is available)."""
    global _applied
    if _applied:
        return
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    apply_optimizer_fixes()
    fix_megatron_checkpoint()
    if torch.cuda.is_available():
        _applied = True
        return
    import megatron.core
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if megatron.core.__version__ != MEGATRON_VERSION:
        raise RuntimeError(
            f"streamrl's CPU compatibility patches target megatron-core {MEGATRON_VERSION}, "
            f"found {megatron.core.__version__}; re-verify the patched code paths before bumping the version"
        )
    torch.cuda.current_device = _cpu_current_device
    mp_random.CudaRNGStatesTracker.add = _cpu_tracker_add
    mp_random.CudaRNGStatesTracker.fork = _cpu_tracker_fork
    mp_random._get_all_rng_states = _cpu_all_rng_states
    mp_random._set_all_rng_states = _cpu_set_all_rng_states
    # fused_softmax imported the function by name, so its module-level reference is the one that is called.
    transformer_utils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    FileSystemWriterAsync.preload_tensors = staticmethod(_blocking_preload(FileSystemWriterAsync.preload_tensors))
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_CUDA_STREAM
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize
    schedules.torch = _HostTorch("torch")
    P2PCommunicator._communicate_shapes = _communicate_shapes_by_direction
    torch.cuda.synchronize = _no_synchronize
    LanguageModule.setup_embeddings_and_output_layer = _with_host_cuda(LanguageModule.setup_embeddings_and_output_layer)
    _patch_optimizers()
    _applied = True


def _patch_optimizers() -> None:
    """The distributed-data-parallel / optimizer patches of the module docstring."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler, optimizer

    for module in (optimizer, distrib_optimizer, clip_grads, grad_scaler):
        module.torch = _HostTorch("torch")
    clip_grads.l2_norm_impl = _host_multi_tensor_l2_norm
    # optimizer.py imported the function by name: its module-level reference is the one that is called.
    optimizer.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    gather = distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero
    distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero = _with_host_cuda(gather)
