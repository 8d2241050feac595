"""streamrl.learner.model.swiglu_kernel (GPU only): the Triton backward equals float64 autograd of
`silu(gate) * up * probs` (and of `silu(gate) * up`, without probabilities), at the Qwen3-30B-A3B expert width and
at a width that is no multiple of the kernel's column block, and handles no rows. The CPU runs `fused.swiglu`
eagerly; tests/learner/model/test_fused.py checks the GPU path end to end against eager ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "width"), [(1001, 768), (37, 300), (0, 768)])
def test_backward_matches_float64_autograd(rows: int, width: int, dtype: torch.dtype) -> None:
    from streamrl.learner.model.swiglu_kernel import swiglu_backward

    fc1_out = (torch.randn(rows, 2 * width, device="cuda") * 3).to(dtype)
    probs, grad = torch.rand(rows, device="cuda"), torch.randn(rows, width, device="cuda").to(dtype)
    d_fc1, d_probs = swiglu_backward(fc1_out, probs, grad)
    assert d_fc1.dtype == dtype and d_probs.dtype == torch.float32
    assert d_fc1.shape == fc1_out.shape and d_probs.shape == probs.shape
    leaves = [fc1_out.double().requires_grad_(), probs.double().requires_grad_()]
    gate, up = leaves[0].chunk(2, dim=-1)
    expected = torch.autograd.grad(F.silu(gate) * up * leaves[1].unsqueeze(-1), leaves, grad.double())
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for result, reference in zip((d_fc1, d_probs), expected, strict=True):
        assert torch.isfinite(result).all()
        assert float((result.double() - reference).norm()) <= tolerance * float(reference.norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "width"), [(1001, 768), (37, 300), (0, 768)])
def test_backward_without_probabilities_matches_float64_autograd(rows: int, width: int, dtype: torch.dtype) -> None:
    from streamrl.learner.model.swiglu_kernel import swiglu_backward

    fc1_out = (torch.randn(rows, 2 * width, device="cuda") * 3).to(dtype)
    grad = torch.randn(rows, width, device="cuda").to(dtype)
    d_fc1, d_probs = swiglu_backward(fc1_out, None, grad)
    assert d_probs is None and d_fc1.dtype == dtype and d_fc1.shape == fc1_out.shape
    leaf = fc1_out.double().requires_grad_()
    gate, up = leaf.chunk(2, dim=-1)
    (expected,) = torch.autograd.grad(F.silu(gate) * up, leaf, grad.double())
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.isfinite(d_fc1).all()
    assert float((d_fc1.double() - expected).norm()) <= tolerance * float(expected.norm())


def test_one_compiled_kernel_serves_every_row_count() -> None:
    """Micro-batches change their token count every step: the kernel compiles once per width class, dtype and routing,
    not again for a new count (another variant for an odd count cost seconds of a learner's first step)."""
    from streamrl.learner.model.swiglu_kernel import _backward_kernel, swiglu_backward

    def run(rows: int) -> int:
        fc1_out = torch.randn(rows, 2 * 1024, device="cuda", dtype=torch.bfloat16)
        swiglu_backward(fc1_out, None, torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16))
        return len(_backward_kernel.device_caches[torch.cuda.current_device()][0])  # Triton's compiled variants

    compiled = run(1024)
    assert [run(rows) for rows in (1001, 1, 77, 4096)] == [compiled] * 4
