"""Fused versions of the learner's memory-bound elementwise work: RMSNorm, RoPE, SwiGLU, token cross-entropy.

Contract: each function below computes exactly the math written in its body. On CUDA tensors it runs as a
`torch.compile`d (Inductor / Triton) function, so its forward and its backward are each one or a few kernels
that read every input once, instead of the ~10 eager kernels (fp32 copies, broadcast multiplies, reductions,
`cat`s) the same expression costs in eager PyTorch; on the CPU (tests, the CPU learner) the same function runs
eagerly, so CPU and GPU compute the same function and the CPU tests check its numerics. Compiled symbolic in
the token axis only (`compiled_on_gpu`): packed micro-batches of every length share one compiled graph.
Inductor keeps intermediates in fp32 registers (it does not round them to bf16 between fused steps), so on the
GPU results can differ from eager bf16 by bf16 rounding, never by more.

- `rms_norm(x, weight, eps)`: torch's RMSNorm (normalised in fp32, times the weight in fp32, one rounding).
- `rotary(t, freqs)`: Megatron's non-interleaved RoPE `t * cos + rotate_half(t) * sin` with cos/sin of the fp32
  `freqs` rounded to t's dtype first (megatron `_apply_rotary_pos_emb_bshd`, rotary dim == head dim, mscale 1).
- `swiglu(fc1_out, probs=None)`: `silu(gate) * up * probs` of a `[N, 2F]` gate|up projection scaled by fp32 per-row
  routing probabilities (`streamrl.learner.model.experts`), or `silu(gate) * up` without them, rounded to the compute
  dtype. On the GPU its backward is not the compiled one but `streamrl.learner.model.swiglu_kernel`'s single Triton
  kernel (the same derivative, in fp32). `SwiGLU` is its module form without routing probabilities, the gate|up
  activation of Megatron's dense and shared-expert MLPs (given in the layer spec, `streamrl.learner.model.gpt`).
- `token_cross_entropy(logits, labels)`: float32 `-log softmax(logits)[label]` over the last axis; the backward
  is `(softmax - onehot) * grad` in one pass over the logits, without the fp32 copies of the logits (10 GiB for
  16k tokens of a 152k vocabulary) that Megatron's unfused vocab-parallel cross-entropy keeps (whole vocabulary
  only: `streamrl.learner.model.gpt` uses it at tensor-parallel size 1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from streamrl.learner.model.recompute import recomputable, recompute_modules


def compiled_on_gpu(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """`fn` compiled when its first argument is a CUDA tensor, eager `fn` otherwise; symbolic in the token axis only.

    The token axis is the leading axis of the first argument, and of every other tensor argument of that leading
    size. Every other size is compiled in as a constant (one graph per model width, reused by every micro-batch
    length): with all sizes symbolic (`dynamic=True`), Inductor's flattened kernels divide every element's index
    by run-time sizes (64-bit integer divisions), which held them to a fifth of the memory bandwidth.
    """
    compiled = torch.compile(fn, dynamic=False)  # lazy: nothing compiles until the first CUDA call

    @functools.wraps(fn)
    def dispatch(*args: object) -> Tensor:
        if not args[0].is_cuda:
            return fn(*args)
        tokens = args[0].shape[0]
        for arg in args:
            if isinstance(arg, Tensor) and arg.dim() and arg.shape[0] == tokens:
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return compiled(*args)

    return dispatch


@compiled_on_gpu
def _rms_norm_rows(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Rows of the last axis: one compiled graph per width, whatever the leading axes (hidden states, or q and k
    # with their different head counts). Each leading shape would be a graph of its own, and past torch's recompile
    # limit (8, with the grad-mode variants of recomputation) the rest ran eagerly.
    return _rms_norm_rows(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


@compiled_on_gpu
def rotary(t: Tensor, freqs: Tensor) -> Tensor:
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    first, second = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-second, first), dim=-1) * sin


def _swiglu_math(fc1_out: Tensor, probs: Tensor) -> Tensor:
    gate, up = fc1_out.chunk(2, dim=-1)
    return (F.silu(gate) * up * probs.unsqueeze(-1)).to(fc1_out.dtype)


def _swiglu_unscaled_math(fc1_out: Tensor) -> Tensor:
    gate, up = fc1_out.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(fc1_out.dtype)


_swiglu_forward = compiled_on_gpu(_swiglu_math)
_swiglu_unscaled_forward = compiled_on_gpu(_swiglu_unscaled_math)


class _SwiGLU(torch.autograd.Function):
    """GPU: the compiled forward, and the backward as one Triton kernel (`streamrl.learner.model.swiglu_kernel`)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, fc1_out: Tensor, probs: Tensor | None) -> Tensor:
        ctx.save_for_backward(fc1_out, probs)
        return _swiglu_unscaled_forward(fc1_out) if probs is None else _swiglu_forward(fc1_out, probs)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, Tensor | None]:
        from streamrl.learner.model.swiglu_kernel import swiglu_backward  # Triton: GPU installs only

        fc1_out, probs = ctx.saved_tensors
        d_fc1, d_probs = swiglu_backward(fc1_out, probs, grad)
        return d_fc1, None if probs is None else d_probs.to(probs.dtype)


def swiglu(fc1_out: Tensor, probs: Tensor | None = None) -> Tensor:
    """`silu(gate) * up * probs`, or `silu(gate) * up` without `probs` (see the module docstring); on CUDA its
    backward is one Triton kernel."""
    if fc1_out.is_cuda:
        return _SwiGLU.apply(fc1_out, probs)
    return _swiglu_unscaled_math(fc1_out) if probs is None else _swiglu_math(fc1_out, probs)


class SwiGLU(torch.nn.Module):
    """`silu(gate) * up` of a `[..., 2F]` gate|up projection: `swiglu` without probabilities. Megatron's MLP builds
    it from its spec with `config` and applies it to the whole projection; under `recompute_modules` `mlp_act` its
    output is recomputable (`streamrl.learner.model.recompute`: the MLP's down projection releases it)."""

    def __init__(self, config: TransformerConfig | None = None) -> None:
        super().__init__()
        self.recompute = "mlp_act" in recompute_modules(config)

    def forward(self, fc1_out: Tensor) -> Tensor:
        return recomputable(self._swiglu, fc1_out) if self.recompute else self._swiglu(fc1_out)

    @staticmethod
    def _swiglu(fc1_out: Tensor) -> Tensor:
        rows = fc1_out.reshape(-1, fc1_out.shape[-1])
        return swiglu(rows).view(*fc1_out.shape[:-1], rows.shape[-1] // 2)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        return {}  # no state; Megatron's MLP asks each of its children for its checkpoint shards


@compiled_on_gpu
def _nll_and_logsumexp(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    lf = logits.float()
    logsumexp = torch.logsumexp(lf, dim=-1)
    return logsumexp - lf.gather(-1, labels.unsqueeze(-1)).squeeze(-1), logsumexp


@compiled_on_gpu
def _nll_grad(logits: Tensor, labels: Tensor, logsumexp: Tensor, grad: Tensor) -> Tensor:
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab == labels.unsqueeze(-1)).float()
    return ((torch.exp(logits.float() - logsumexp.unsqueeze(-1)) - onehot) * grad.unsqueeze(-1)).to(logits.dtype)


class _TokenCrossEntropy(torch.autograd.Function):
    """Forward and backward as two single passes; only the logits (in their own dtype) and the logsumexp are kept."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: Tensor, labels: Tensor) -> Tensor:
        nll, logsumexp = _nll_and_logsumexp(logits, labels)
        ctx.save_for_backward(logits, labels, logsumexp)
        return nll

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        logits, labels, logsumexp = ctx.saved_tensors
        return _nll_grad(logits, labels, logsumexp, grad.float()), None


def token_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """float32 `-log softmax(logits)[..., label]`, shape of `labels`; see the module docstring."""
    return _TokenCrossEntropy.apply(logits, labels)
