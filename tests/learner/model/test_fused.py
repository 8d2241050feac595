"""streamrl.learner.model.fused: each function equals the eager ops it replaces (CPU), and its compiled GPU form equals
the eager form (GPU only), forward and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streamrl.learner.model import fused
from streamrl.learner.model.fused_paths import _originals


def _inputs(dtype: torch.dtype, device: str = "cpu") -> dict[str, list[torch.Tensor]]:
    """Fresh random arguments of every fused function (float tensors require grad)."""
    tokens, vocab = 37, 1000
    leaf = lambda t: t.to(device).requires_grad_()  # noqa: E731
    return {
        "rms_norm": [leaf(torch.randn(tokens, 64, dtype=dtype) * 3), leaf(torch.rand(64, dtype=dtype) + 0.5), 1e-6],
        "rotary": [leaf(torch.randn(tokens, 4, 32, dtype=dtype)), (torch.rand(tokens, 1, 32) * 50).to(device)],
        "swiglu": [leaf(torch.randn(tokens, 48, dtype=dtype)), leaf(torch.rand(tokens))],
        "SwiGLU": [leaf(torch.randn(tokens, 1, 48, dtype=dtype))],  # a dense MLP's [S, B, 2F] gate|up projection
        "token_cross_entropy": [
            leaf(torch.randn(tokens, 2, vocab, dtype=dtype) * 4),
            torch.randint(0, vocab, (tokens, 2)).to(device),
        ],
    }


def _reference(name: str, args: list) -> torch.Tensor:
    """The eager torch / Megatron computation each fused function replaces."""
    if name == "rms_norm":
        return F.rms_norm(args[0], args[0].shape[-1:], args[1], args[2])
    if name == "rotary":  # Megatron's own (unpatched) RoPE
        return _originals["rope"](*args)
    if name == "swiglu":
        gate, up = args[0].chunk(2, dim=-1)
        return (F.silu(gate) * up * args[1].unsqueeze(-1)).to(args[0].dtype)
    if name == "SwiGLU":  # Megatron MLP's unfused gated linear unit
        gate, up = args[0].chunk(2, dim=-1)
        return F.silu(gate) * up
    logits, labels = args
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)


def _fused(name: str) -> object:
    """The fused function `name`, or the module of that name built as Megatron's MLP builds it."""
    return fused.SwiGLU(config=None) if name == "SwiGLU" else getattr(fused, name)


def _grads(out: torch.Tensor, args: list) -> list[torch.Tensor]:
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    weights = torch.randn_like(out, dtype=torch.float32)  # a random cotangent
    return list(torch.autograd.grad((out.float() * weights).sum(), leaves))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", ["rms_norm", "rotary", "swiglu", "SwiGLU", "token_cross_entropy"])
def test_eager_matches_the_ops_it_replaces(name: str) -> None:
    torch.manual_seed(0)
    args = _inputs(torch.float32)[name]
    out, ref = _fused(name)(*args), _reference(name, args)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert _rel_err(out, ref) < 1e-6
    torch.manual_seed(1)
    grads = _grads(out, args)
    torch.manual_seed(1)
    for grad, ref_grad in zip(grads, _grads(ref, args), strict=True):
        assert _rel_err(grad, ref_grad) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["rms_norm", "rotary", "swiglu", "SwiGLU", "token_cross_entropy"])
def test_compiled_matches_eager_on_gpu(name: str, dtype: torch.dtype) -> None:
    args = _inputs(dtype, "cuda")[name]
    out, ref = _fused(name)(*args), _reference(name, args)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert out.dtype == ref.dtype and _rel_err(out, ref) < tolerance
    torch.manual_seed(1)
    grads = _grads(out, args)
    torch.manual_seed(1)
    for grad, ref_grad in zip(grads, _grads(ref, args), strict=True):
        assert _rel_err(grad, ref_grad) < tolerance


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rms_norm_compiles_once_per_width_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hidden states and q / k of every head count, with and without gradients (full recomputation's forward), of
    one width share the compiled graphs; before rows were flattened each leading shape was a graph of its own, and
    past torch's recompile limit the Qwen3-30B-A3B learner ran its norms eagerly."""
    torch._dynamo.reset()  # count this test's graphs only, not those of the tests before it in this process
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 4)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    weight = torch.rand(128, device="cuda") + 0.5
    for tokens in (64, 96):
        for leading in ((tokens,), (tokens, 1), (tokens, 1, 32), (tokens, 1, 4), (tokens, 2, 8)):
            x = torch.randn(*leading, 128, device="cuda", dtype=torch.bfloat16)
            for grad in (True, False):
                with torch.set_grad_enabled(grad):
                    out = fused.rms_norm(x.requires_grad_(grad), weight, 1e-6)
                assert _rel_err(out.float(), _reference("rms_norm", [x.detach().float(), weight, 1e-6])) < 1e-2
