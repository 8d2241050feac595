"""Packed-sequence attention equals attention on each sequence alone (module, and full GPTModel vs HF per sequence).

Module level: `PackedSequenceAttention` on a packed [T, heads, d] input (GQA) against a plain softmax reference run
on each sequence separately (also with sequences in several padded buckets, and with whole padding sequences that
round a bucket's count up, output and gradients; the bucket plan's bound on padding; the few padded shapes that RL
micro-batches of changing lengths take), and its unpacked path against the same reference; on a GPU (marked `gpu`)
the packed path in bf16 with the Qwen3-30B-A3B heads against the same reference in float64, output and gradients.
Model level (TP=1; TP=2 is in test_packing.py): the log-probs of a packed micro-batch from `plan_step` against HF
transformers run on each sequence separately, within 1e-5.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from streamrl.batching.microbatch import plan_step
from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights
from streamrl.learner.model.attention import (
    FREE_AREA,
    PAD_SLACK,
    PackedSequenceAttention,
    _padded_plan,
    attention_buckets,
    grid_size,
)
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.model.logprobs import microbatch_logprobs, token_logprobs
from tests.queue.test_codec import make_group

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
LENGTHS = [5, 1, 9, 3]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of one sequence: q [L, heads, d], k/v [L, kv_heads, d] -> [L, heads * d]."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(len(q), len(q), dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(q), -1)


def _attention(
    heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, kernel: str = "auto"
) -> PackedSequenceAttention:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        attention_dropout=0.0,
    )
    config.attention_kernel = kernel  # as `gpt.transformer_config` sets it from learner.attention_kernel
    return PackedSequenceAttention(config, 1, AttnMaskType.causal, "self")


def test_an_unknown_attention_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="attention_kernel"):
        _attention(kernel="xformers")


def _packed_params(lengths: list[int]) -> PackedSeqParams:
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )


def _qkv(total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(total, heads, HEAD_DIM, generator=gen) for heads in (HEADS, KV_HEADS, KV_HEADS))


def test_packed_attention_equals_each_sequence_alone() -> None:
    packed = _packed_params(LENGTHS)
    q, k, v = _qkv(sum(LENGTHS))
    out = _attention()(q, k, v, None, packed_seq_params=packed)
    assert out.shape == (len(q), HEADS * HEAD_DIM)
    cu_seqlens = packed.cu_seqlens_q
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
        expected = _reference(q[start:end], k[start:end], v[start:end])
        assert (out[start:end] - expected).abs().max().item() < 1e-5


def test_buckets_hold_every_sequence_once_and_bound_their_padding() -> None:
    lengths = [700, 40, 650, 3, 1, 600, 90, 2048, 17, 17, 17, 1900]
    buckets = attention_buckets(lengths)
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(lengths)))
    for bucket in buckets:
        own = [lengths[i] for i in bucket]
        assert own == sorted(own, reverse=True)
        assert len(own) * own[0] ** 2 <= PAD_SLACK * sum(n * n for n in own) + FREE_AREA
    assert [[lengths[i] for i in b] for b in buckets] == [[2048, 1900], [700, 650, 600], [90, 40, 17, 17, 17, 3, 1]]
    assert attention_buckets([64] * 300) == [list(range(300))]  # short responses: one call


def test_sequences_in_several_padded_buckets_attend_as_alone_output_and_gradients() -> None:
    lengths = [700, 40, 650, 3, 1, 600, 90]  # two buckets: 700/650/600 and 90/40/3/1, both with padding
    assert len(attention_buckets(lengths)) == 2
    _packed_matches_reference(lengths)


def _packed_matches_reference(lengths: list[int]) -> None:
    """Output and input gradients of the packed attention against the float64 reference on each sequence alone."""
    leaves = [t.requires_grad_() for t in _qkv(sum(lengths))]
    out = _attention()(*leaves, None, packed_seq_params=_packed_params(lengths))
    cotangent = torch.randn_like(out)
    grads = torch.autograd.grad((out * cotangent).sum(), leaves)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    exact = [t.detach().double().requires_grad_() for t in leaves]
    expected = torch.cat([_reference(*(t[start:end] for t in exact)) for start, end in itertools.pairwise(bounds)])
    expected_grads = torch.autograd.grad((expected * cotangent.double()).sum(), exact)
    for result, reference in zip([out, *grads], [expected, *expected_grads], strict=True):
        assert (result.double() - reference).abs().max().item() < 1e-5


def test_whole_padding_sequences_change_no_output_or_gradient() -> None:
    lengths = [5, 1, 9, 3, 2, 7, 4, 6, 8]  # one bucket of 9 sequences, padded to 10 of length 10
    shapes, rows, _ = _padded_plan(tuple(np.concatenate([[0], np.cumsum(lengths)]).tolist()), torch.device("cpu"))
    assert shapes == [(10, 10)] and len(rows) == 100
    _packed_matches_reference(lengths)


def test_padded_shapes_are_few_across_changing_micro_batches() -> None:
    """cuDNN builds an attention graph per new shape: micro-batches of RL responses whose lengths change every step
    must keep meeting shapes already built."""
    assert [grid_size(n) for n in (1, 7, 8, 9, 16, 17, 33, 100, 1000)] == [1, 7, 8, 10, 16, 20, 40, 112, 1024]
    assert all(n <= grid_size(n) <= 1.25 * n and grid_size(grid_size(n)) == grid_size(n) for n in range(1, 5000))
    rng = np.random.default_rng(0)
    seen: set[tuple[int, int]] = set()
    raw: set[tuple[int, int]] = set()
    new_shapes = []
    for _ in range(200):  # 200 steps of 256 responses: mostly ~64 tokens, one in eight ~8x longer, plus a prompt
        lengths = 32 + np.minimum(rng.lognormal(np.log(64), 0.5, 256) * np.where(rng.random(256) < 0.125, 8, 1), 480)
        lengths = lengths.astype(int).tolist()
        shapes, _, _ = _padded_plan(tuple(np.concatenate([[0], np.cumsum(lengths)]).tolist()), torch.device("cpu"))
        new_shapes.append(len(set(shapes) - seen))
        seen.update(shapes)
        raw.update((len(b), lengths[b[0]]) for b in attention_buckets(lengths))
    # Measured: 71 shapes in all (681 unrounded), 40 of them by step 20, 1 in the last 60 steps.
    assert len(seen) <= 100 and len(raw) >= 5 * len(seen), (len(seen), len(raw))
    assert sum(new_shapes[100:]) <= 10, new_shapes


def test_unpacked_attention_is_causal_per_row() -> None:
    q, k, v = (t.reshape(2, 6, *t.shape[1:]).transpose(0, 1) for t in _qkv(12))  # [S=6, B=2, h, d]
    out = _attention()(q, k, v, None)
    for b in range(2):
        assert (out[:, b] - _reference(q[:, b], k[:, b], v[:, b])).abs().max().item() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel, runs", [("auto", ""), ("flash", "flash"), ("cudnn", "cudnn")])
def test_packed_attention_equals_each_sequence_alone_on_gpu(kernel: str, runs: str) -> None:
    """Every `learner.attention_kernel` computes each sequence's own attention, and the one asked for runs it."""
    lengths, heads, kv_heads, head_dim = [300, 1, 77, 1030, 5, 512], 32, 4, 128  # the Qwen3-30B-A3B heads
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), h, head_dim, device="cuda") for h in (heads, kv_heads, kv_heads))
    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    attention = _attention(heads, kv_heads, head_dim, kernel)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        out = attention(*leaves, None, packed_seq_params=_packed_params(lengths))
        cotangent = torch.randn_like(out, dtype=torch.float32)
        grads = torch.autograd.grad((out.float() * cotangent).sum(), leaves)
        torch.cuda.synchronize()
    kernels = {event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA}
    assert any(runs in name.lower() for name in kernels), sorted(kernels)
    # The reference in float64 on the same (bf16-rounded) inputs, sequence by sequence.
    exact = [t.detach().double().requires_grad_() for t in leaves]
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    expected = torch.cat([_reference(*(t[start:end] for t in exact)) for start, end in itertools.pairwise(bounds)])
    expected_grads = torch.autograd.grad((expected * cotangent.double()).sum(), exact)
    for result, reference in zip([out, *grads], [expected, *expected_grads], strict=True):
        assert torch.isfinite(result).all()
        assert float((result.double() - reference).norm() / reference.norm()) < 1e-2


def _hf_sequence_logprobs(hf_model: torch.nn.Module, tokens: np.ndarray) -> torch.Tensor:
    ids = torch.from_numpy(tokens)[None]
    logits = hf_model(input_ids=ids[:, :-1]).logits
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[0, :, 0]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_packed_model_logprobs_equal_hf_per_sequence(
    tp1_world: None, tiny_model_dirs: Callable[[str], Path], arch: str
) -> None:
    from transformers import AutoModelForCausalLM

    hf_config, hf_state = load_hf_checkpoint(tiny_model_dirs(arch))
    model = build_gpt_model(hf_config)
    load_hf_weights(model, hf_state, hf_config)
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs(arch), dtype=torch.float32)
    groups = [make_group([9, 2, 14], seed=0), make_group([5, 1], seed=1)]
    ((mb,),) = plan_step(groups, 1, 10_000, "token_mean")
    assert len(mb.cu_seqlens) == 6  # all five sequences in one packed row
    with torch.no_grad():
        logp = microbatch_logprobs(model, mb)[0].cpu()  # the model may live on a GPU
        for start, end in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:], strict=True):
            tokens = np.append(mb.input_ids[0, start:end], mb.labels[0, end - 1])
            assert (logp[start:end] - _hf_sequence_logprobs(hf_model, tokens)).abs().max().item() < 1e-5


def test_packed_positions_must_restart_per_sequence(tp1_world: None, tiny_model_dir: Path) -> None:
    hf_config, _ = load_hf_checkpoint(tiny_model_dir)
    model = build_gpt_model(hf_config)
    ids = torch.ones(1, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match="position_ids"):
        token_logprobs(model, ids, torch.arange(6)[None], ids, torch.tensor([0, 2, 6], dtype=torch.int32))
