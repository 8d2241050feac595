"""Vocabulary-parallel log-probs and entropy against torch's full log-softmax (in process, one TP rank).

Values and gradients (through both outputs at once) match in float64 to rounding, autograd's numerical gradient
check passes, and half-precision logits are reduced in float32 with a gradient of their own dtype. The TP=2 split
(each rank a vocabulary shard, under sequence parallelism too) is checked inside whole models against a single
process in `tests/learner/test_regularized_step.py`.
"""

from __future__ import annotations

import pytest
import torch

from streamrl.learner.model.vocab_parallel import nucleus_keep, vocab_parallel_logprob_entropy


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(2, 5, 64, generator=gen, dtype=torch.float64)).to(dtype)  # peaked and flat rows
    return logits, torch.randint(0, 64, (2, 5), generator=gen)


def test_matches_full_log_softmax_with_gradients(tp1_world: None) -> None:
    logits, labels = _inputs(torch.float64)
    mine, full = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    logp, entropy = vocab_parallel_logprob_entropy(mine, labels)
    log_probs = torch.log_softmax(full, dim=-1)
    expected_logp = log_probs.gather(-1, labels[..., None])[..., 0]
    expected_entropy = -(log_probs.exp() * log_probs).sum(-1)
    torch.testing.assert_close(logp, expected_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=1e-12)
    weights = torch.randn(2, 2, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (weights[0] * logp + weights[1] * entropy).sum().backward()
    (weights[0] * expected_logp + weights[1] * expected_entropy).sum().backward()
    torch.testing.assert_close(mine.grad, full.grad, rtol=0, atol=1e-12)
    point = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: vocab_parallel_logprob_entropy(z, labels), (point,))


def test_half_precision_logits_reduce_in_float32(tp1_world: None) -> None:
    logits, labels = _inputs(torch.bfloat16)
    logits.requires_grad_()
    logp, entropy = vocab_parallel_logprob_entropy(logits, labels)
    assert logp.dtype == entropy.dtype == torch.float32
    log_probs = torch.log_softmax(logits.detach().float(), dim=-1)
    torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1), rtol=0, atol=1e-5)
    entropy.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_labels_must_match_the_logits(tp1_world: None) -> None:
    logits, labels = _inputs(torch.float32)
    with pytest.raises(ValueError, match="labels"):
        vocab_parallel_logprob_entropy(logits, labels[:, :-1])


def test_the_nucleus_is_vllms_plus_the_label(tp1_world: None) -> None:
    """`nucleus_keep` keeps what vLLM's top-p sampler keeps (its own function is the reference), and the label."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits, _ = _inputs(torch.float32)
    flat = logits.reshape(-1, 64)
    sampled = apply_top_k_top_p_pytorch(flat.clone(), None, torch.full((flat.shape[0],), 0.9), allow_cpu_sync=True)
    vllm_keeps = torch.isfinite(sampled).reshape(logits.shape)
    assert 1 <= int(vllm_keeps.sum(-1).min()) and int(vllm_keeps.sum(-1).max()) < 64  # peaked and flat rows differ
    inside = vllm_keeps.float().argmax(-1)  # a token of each nucleus
    assert torch.equal(nucleus_keep(logits, inside, 0.9, chunk_elements=3 * 64), vllm_keeps)  # chunks of 3 rows
    outside = (~vllm_keeps).float().argmax(-1)
    keep = nucleus_keep(logits, outside, 0.9)
    assert torch.equal(keep & ~vllm_keeps, torch.nn.functional.one_hot(outside, 64).bool() & ~vllm_keeps)


def test_kept_entries_are_the_whole_distribution(tp1_world: None) -> None:
    """With a keep mask, log-prob and entropy are those of the softmax over the kept entries (float64, values and
    gradients); dropped entries get no gradient."""
    logits, labels = _inputs(torch.float64)
    keep = nucleus_keep(logits, labels, 0.8)
    assert bool((~keep).any())
    mine, full = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    logp, entropy = vocab_parallel_logprob_entropy(mine, labels, keep)
    log_probs = torch.log_softmax(full.masked_fill(~keep, float("-inf")), dim=-1)
    expected_logp = log_probs.gather(-1, labels[..., None])[..., 0]
    expected_entropy = -(log_probs.exp() * log_probs.masked_fill(~keep, 0.0)).sum(-1)
    torch.testing.assert_close(logp, expected_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=1e-12)
    (logp + 0.3 * entropy).sum().backward()
    (expected_logp + 0.3 * expected_entropy).sum().backward()
    torch.testing.assert_close(mine.grad, full.grad, rtol=0, atol=1e-12)
    assert bool((mine.grad[~keep] == 0).all())
