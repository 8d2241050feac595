"""Make megatron-core 0.16.1's GPTModel (local layer spec) run forward/backward on a CPU-only PyTorch.

Contract: `apply_cpu_compat()` is idempotent, does nothing when CUDA is available (except the missing-name fix
below, which any install without Transformer Engine needs), and must run before the parallel world / model are
built (`streamrl.learner.parallel.init_parallel` calls it). It raises
`RuntimeError` on any megatron-core version other than the one these patches were checked against, because
each patch replaces a specific code path that may move or change between releases.

What is patched, and only what our learner path (local spec, no Megatron optimizer / DDP / activation
recompute / inference) actually hits:
- `torch.cuda.current_device()` raises on a CPU build, yet Megatron uses it as the device for the attention
  scratch buffer (`GlobalMemoryBuffer.get_tensor`) and moves RoPE `inv_freq` there on every forward; it is
  made to return the CPU device.
- The model-parallel RNG tracker (`CudaRNGStatesTracker.add` / `.fork`, used by `model_parallel_cuda_manual_seed`
  and around attention dropout on every forward) reads and writes CUDA generator states; on CPU it tracks the
  CPU default generator's state instead.
- `get_default_causal_mask` builds its mask on "cuda"; it is rebuilt on the CPU (only reached when a caller
  passes no attention mask).
- Distributed checkpointing (torch_dist backend) stages tensors to host memory with non-blocking copies and then
  calls `torch.cuda.synchronize()` (`FileSystemWriterAsync.preload_tensors`); on CPU the copies are made blocking
  (they are no-ops for host tensors), so nothing waits on a device that does not exist.

Mixture-of-experts (`streamrl.learner.moe`: local spec, "alltoall" token dispatcher):
- Without Transformer Engine, `moe_utils` never binds `te_general_gemm` (its import sits inside the failed TE
  `try`), yet the router's `RouterGatingLinearFunction` tests it against None on every forward: a NameError. It is
  bound to None, which selects the plain torch matmul; applied on GPU too, and only while the name is unbound.
- `MoEAlltoAllTokenDispatcher.__init__` creates a CUDA stream for its device-to-host copies of the token counts,
  and `_maybe_dtoh_and_synchronize` copies on it and records / waits on a CUDA event. On CPU the counts already
  live on the host: no stream is created, and at the copy point the split sizes are turned into lists - the GPU
  path turns them into numpy arrays there, and gloo's `all_to_all_single` rejects tensors as split sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

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


# Stands in for the dispatcher's shared CUDA stream so that its constructor does not create one.
_NO_CUDA_STREAM = object()


def apply_cpu_compat() -> None:
    """Apply the patches described in the module docstring (once; only the missing-name fix when CUDA is available)."""
    global _applied
    if _applied:
        return
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if torch.cuda.is_available():
        _applied = True
        return
    import megatron.core
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.fusions import fused_softmax
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
    # fused_softmax imported the function by name, so its module-level reference is the one that is called.
    transformer_utils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    FileSystemWriterAsync.preload_tensors = staticmethod(_blocking_preload(FileSystemWriterAsync.preload_tensors))
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_CUDA_STREAM
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize
    _applied = True
