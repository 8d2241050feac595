"""The backward of `streamrl.learner.model.fused.swiglu` as one Triton kernel (CUDA only; imported on first GPU use).

Contract: `swiglu_backward(fc1_out [N, 2F], probs [N] float32 or None, grad [N, F])` returns `(d fc1_out [N, 2F] in
fc1_out's dtype, d probs [N] float32)` of `y = silu(gate) * up * probs[:, None]` (gate|up the two halves of
fc1_out), computed in float32 from the inputs as stored; with `probs` None, `(d fc1_out, None)` of
`y = silu(gate) * up` (a dense MLP's: nothing read or computed for probabilities):

    d gate = grad * probs * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))
    d up   = grad * probs * silu(gate)
    d probs = sum over the F columns of grad * silu(gate) * up

Why a kernel: each program owns whole rows, so one pass reads fc1_out and grad once and writes both gradients,
the per-row sum included. Inductor's compiled backward of the same expression is two kernels (the elementwise
gradients, then the row sums re-reading both inputs) and ran at 1.6 TB/s on the H200 against this one's ~4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ROWS_PER_PROGRAM = 8  # with 256 columns per block and 4 warps: the fastest of five shapes timed on an H200
COLUMNS_PER_BLOCK = 256


# The row count is not specialised on (divisible by 16 or not: a second compile for a last, odd micro-batch), and the
# columns are a loop, not unrolled: unrolled over the 3.6B model's width, each of its two variants took ~7 s to
# compile, ~13 s of the learner's first step (the Triton compile cache did not spare a restarted process).
@triton.jit(do_not_specialize=["rows_total"])
def _backward_kernel(
    fc1_ptr,
    probs_ptr,
    grad_ptr,
    d_fc1_ptr,
    d_probs_ptr,
    rows_total,
    width,
    block_rows: tl.constexpr,
    block_cols: tl.constexpr,
    has_probs: tl.constexpr,
):
    rows = tl.program_id(0) * block_rows + tl.arange(0, block_rows)
    row_ok = rows < rows_total
    rows64 = rows.to(tl.int64)  # N * 2F can pass 2^31 elements
    if has_probs:
        probs = tl.load(probs_ptr + rows, mask=row_ok, other=0.0)
    probs_grad = tl.zeros([block_rows], dtype=tl.float32)
    for start in tl.range(0, width, block_cols):
        cols = start + tl.arange(0, block_cols)
        ok = row_ok[:, None] & (cols < width)[None, :]
        gate_at = rows64[:, None] * (2 * width) + cols[None, :]
        gate = tl.load(fc1_ptr + gate_at, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(fc1_ptr + gate_at + width, mask=ok, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + rows64[:, None] * width + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        sigmoid = tl.sigmoid(gate)
        silu = gate * sigmoid
        if has_probs:
            probs_grad += tl.sum(grad * silu * up, axis=1)
            scaled = grad * probs[:, None]
        else:
            scaled = grad
        d_gate = scaled * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))
        tl.store(d_fc1_ptr + gate_at, d_gate.to(d_fc1_ptr.dtype.element_ty), mask=ok)
        tl.store(d_fc1_ptr + gate_at + width, (scaled * silu).to(d_fc1_ptr.dtype.element_ty), mask=ok)
    if has_probs:
        tl.store(d_probs_ptr + rows, probs_grad, mask=row_ok)


def swiglu_backward(fc1_out: Tensor, probs: Tensor | None, grad: Tensor) -> tuple[Tensor, Tensor | None]:
    """(d fc1_out, d probs) of `silu(gate) * up * probs`, or (d fc1_out, None) of `silu(gate) * up` when `probs` is
    None (see the module docstring)."""
    fc1_out, grad = fc1_out.contiguous(), grad.contiguous()
    rows, width = grad.shape
    d_fc1 = torch.empty_like(fc1_out)
    probs = None if probs is None else probs.float().contiguous()
    d_probs = None if probs is None else torch.empty_like(probs)
    if rows:
        block_cols = min(COLUMNS_PER_BLOCK, triton.next_power_of_2(width))
        grid = (triton.cdiv(rows, ROWS_PER_PROGRAM),)
        # Without probabilities the kernel never touches their pointers (a compile-time branch): any tensor will do.
        probs_in, d_probs_out = (fc1_out, d_fc1) if probs is None else (probs, d_probs)
        _backward_kernel[grid](
            fc1_out,
            probs_in,
            grad,
            d_fc1,
            d_probs_out,
            rows,
            width,
            ROWS_PER_PROGRAM,
            block_cols,
            probs is not None,
            num_warps=4,
        )
    return d_fc1, d_probs
