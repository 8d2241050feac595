"""Per-token log-probabilities from a Megatron `GPTModel`, computed vocab-parallel, for packed or padded batches.

Contract: `token_logprobs(model, input_ids, position_ids, labels, cu_seqlens=None)` returns
`out[b, t] = log p(labels[b, t] | the tokens of t's own sequence up to and including t)` as float32 `[B, S]`,
differentiable w.r.t. the model parameters.

- Packed (`cu_seqlens` int32[n+1] given): one row `[1, T]` of n concatenated sequences, sequence i spanning
  `cu_seqlens[i]:cu_seqlens[i+1]`, with `position_ids` restarting at 0 in each (checked). The model runs them as
  `qkv_format='thd'` packed sequences: attention never crosses a boundary and RoPE positions restart per
  sequence, so each sequence's log-probs equal those of running it alone. No padding is processed.
- Context parallel (CP group of c > 1 ranks): packed only. Each CP rank passes its zigzag shard of the packed row
  (`streamrl.learner.context_parallel.shard_microbatch`): local `cu_seqlens`, true `position_ids` (checked), and
  gets the log-probs of its own tokens; the attention all-gathers keys/values over the CP group.
- Padded (`cu_seqlens=None`): every row is one sequence from position 0 under a causal mask, so right padding
  is harmless (its outputs are garbage for the caller to mask).

The model's output with labels is Megatron's per-token vocab-parallel cross-entropy: with tensor parallelism
each rank only holds its vocabulary shard of the logits, so the result is identical on every TP rank and no rank
gathers the full vocabulary. Inputs are moved to the model's device (`cu_seqlens` stays on the host: only its
values are read). Under sequence parallelism (MoE models at TP>1) the length is padded to a multiple of TP
(and of 2 under CP) internally - a trailing dummy sequence when packed, right padding otherwise, both inert for the
real tokens - and the result trimmed back. Every TP rank of a group must call it with the same inputs, every CP
rank with its shard of the same row. `microbatch_logprobs(model, mb)`
does the same for a packed `streamrl.types.MicroBatch`. Under pipeline parallelism only the last stage has
log-probs: `model_forward` / `microbatch_forward` return any chunk's raw output (`streamrl.learner.pipeline`),
which `per_token_outputs` turns into log-probs on the last stage.

Entropy (`model_forward(..., with_entropy=True)`): the model runs without labels and returns its
vocabulary shard of the logits (under sequence parallelism the output layer has already gathered the sequence, as
for the cross-entropy), from which `streamrl.learner.model.vocab_parallel` computes both the log-probs and the
entropy of each position's next-token distribution, still without gathering the vocabulary. The labels path stays the
default: Megatron's cross-entropy works in place in the logits' buffer and skips the entropy's extra reduction.

Sampling distribution (`score_as_sampled(chunks, temperature, top_p)`): the chunks then score what the engines
sample, the softmax of logits / temperature over the top-p nucleus (plus the label: `vocab_parallel.nucleus_keep`),
which is what vLLM's processed log-probs are. With top_p < 1 the last stage always takes the logits path.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_attr_wrapped_model

from streamrl.learner.context_parallel import zigzag_columns
from streamrl.learner.model.vocab_parallel import nucleus_keep, vocab_parallel_logprob_entropy
from streamrl.types import MicroBatch


def causal_attention_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """Megatron's mask convention: bool `[1, 1, S, S]`, True where attention is *forbidden* (future keys)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def packed_seq_params(cu_seqlens: torch.Tensor, position_ids: torch.Tensor) -> PackedSeqParams:
    """Megatron's description of a packed row (under CP: of this rank's shard of one); checks `cu_seqlens` and
    that `position_ids` are each token's true position in its sequence."""
    cu_seqlens = cu_seqlens.to("cpu", torch.int32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    total = position_ids.shape[1]
    if position_ids.shape[0] != 1 or cu_seqlens[0] != 0 or cu_seqlens[-1] != total or not bool((lengths > 0).all()):
        raise ValueError(
            f"cu_seqlens: expected strictly increasing offsets from 0 to the packed length {total} of one row, got "
            f"{cu_seqlens.tolist()} for shape {tuple(position_ids.shape)}"
        )
    cp_size = parallel_state.get_context_parallel_world_size()
    # Megatron's attention and RoPE take the (padded) global boundaries; a CP shard holds 1/cp of each sequence.
    global_cu = cu_seqlens * cp_size
    starts = torch.repeat_interleave(global_cu[:-1].long(), lengths.long())
    # Raises under CP unless every sequence splits into 2 * cp_size equal chunks (the zigzag shard).
    columns = zigzag_columns(global_cu.numpy(), cp_size, parallel_state.get_context_parallel_rank())
    if not torch.equal(position_ids[0].cpu(), torch.from_numpy(columns) - starts):
        raise ValueError(
            "position_ids: must be each token's position in its own sequence (restarting at 0 at every "
            "cu_seqlens boundary; a context-parallel shard's zigzag positions under CP)"
        )
    # The exact longest sequence matters: Megatron builds RoPE tables of that length and applies them from 0 in
    # each sequence (it would use absolute packed positions if the table were as long as the whole row).
    longest = int((global_cu[1:] - global_cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=global_cu, cu_seqlens_kv=global_cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def _pad_for_sequence_parallel(
    model: GPTModel, tensors: list[torch.Tensor], packing: PackedSeqParams | None
) -> tuple[list[torch.Tensor], PackedSeqParams | None]:
    """Pad `[input_ids, position_ids, labels]` so sequence parallelism can split their length evenly over TP."""
    seq_len = tensors[0].shape[1]
    cp_size = parallel_state.get_context_parallel_world_size()
    # Under CP the padding is a sequence of its own on every CP rank: an even local length (two zigzag chunks).
    multiple = math.lcm(model.config.tensor_model_parallel_size, 2 if cp_size > 1 else 1)
    pad = -seq_len % multiple if model.config.sequence_parallel else 0
    if pad == 0:
        return tensors, packing
    input_ids, position_ids, labels = tensors
    rows = input_ids.shape[0]
    # Packed: the padding is a sequence of its own (positions from 0); unpacked: positions simply continue.
    start = 0 if packing is not None else seq_len
    positions = torch.arange(start, start + pad, device=position_ids.device).expand(rows, pad)
    zeros = torch.zeros(rows, pad, dtype=input_ids.dtype, device=input_ids.device)
    padded = [torch.cat(pair, dim=1) for pair in ((input_ids, zeros), (position_ids, positions), (labels, zeros))]
    if packing is not None:
        cu = torch.cat([packing.cu_seqlens_q, packing.cu_seqlens_q[-1:] + pad * cp_size])
        longest = max(packing.max_seqlen_q, pad * cp_size)
        packing = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
    return padded, packing


def token_logprobs(
    model: GPTModel,
    input_ids: torch.LongTensor,
    position_ids: torch.LongTensor,
    labels: torch.LongTensor,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(labels[:, t] | its sequence up to t) for every position, shape `[B, S]`, float32."""
    # With labels, GPTModel returns the per-token cross-entropy -log p(label) in [B, S] instead of logits.
    logp, _ = per_token_outputs(model_forward(model, input_ids, position_ids, labels, cu_seqlens), input_ids.shape[1])
    return logp


LastStageOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # cross-entropy, or (log-prob, entropy)


def per_token_outputs(output: LastStageOutput, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A last stage's `model_forward` output as float32 `[B, length]` (log-probs, entropy or None), the padding
    for sequence parallelism trimmed."""
    if isinstance(output, tuple):
        logp, entropy = output
        return logp[:, :length], entropy[:, :length]
    return -output[:, :length].float(), None


def model_forward(
    model: GPTModel,
    input_ids: torch.LongTensor,
    position_ids: torch.LongTensor,
    labels: torch.LongTensor,
    cu_seqlens: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> LastStageOutput:
    """The raw output of `model` (one pipeline chunk) on these inputs: if it is the last stage, the per-token
    cross-entropy `[B, S']` (or with `with_entropy` the pair (log-prob, entropy), each `[B, S']`), else its
    hidden states for the next stage (`S' >= S`: sequence-parallel padding)."""
    if input_ids.shape != labels.shape or input_ids.shape != position_ids.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids/position_ids/labels: expected equal [B, S] shapes, got "
            f"{tuple(input_ids.shape)}, {tuple(position_ids.shape)}, {tuple(labels.shape)}"
        )
    if cu_seqlens is None and parallel_state.get_context_parallel_world_size() > 1:
        raise ValueError("cu_seqlens: context parallelism needs a packed shard (streamrl.learner.context_parallel)")
    packing = None if cu_seqlens is None else packed_seq_params(cu_seqlens, position_ids)
    # Batches are assembled on the host; the model may live on a GPU.
    device = next(model.parameters()).device
    (input_ids, position_ids, labels), packing = _pad_for_sequence_parallel(
        model, [input_ids.to(device), position_ids.to(device), labels.to(device)], packing
    )
    mask = causal_attention_mask(input_ids.shape[1], device) if packing is None else None
    top_p = _top_p(model)
    # A chunk after the first takes its input from the previous stage (`set_input_tensor`) and ignores input_ids.
    if not with_entropy and top_p == 1.0:
        return model(input_ids, position_ids, mask, labels=labels, packed_seq_params=packing)
    output = model(input_ids, position_ids, mask, packed_seq_params=packing)
    if not get_attr_wrapped_model(model, "post_process"):
        return output  # hidden states for the next stage
    keep = None if top_p == 1.0 else nucleus_keep(output, labels, top_p)
    logp, entropy = vocab_parallel_logprob_entropy(output, labels, keep)  # from the logits' vocabulary shard
    return (logp, entropy) if with_entropy else -logp  # without entropy: the cross-entropy, as Megatron returns it


def _top_p(model: torch.nn.Module) -> float:
    """The nucleus `score_as_sampled` set on this chunk (under its DDP wrappers); 1.0 if none."""
    while not hasattr(model, "sampling_top_p") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "sampling_top_p", 1.0)


def microbatch_logprobs(model: GPTModel, mb: MicroBatch) -> torch.Tensor:
    """`token_logprobs` of a packed `MicroBatch`: float32 `[1, T]`, aligned with its per-position fields."""
    as_t = torch.from_numpy
    return token_logprobs(model, as_t(mb.input_ids), as_t(mb.position_ids), as_t(mb.labels), as_t(mb.cu_seqlens))


def microbatch_forward(model: GPTModel, mb: MicroBatch, with_entropy: bool = False) -> LastStageOutput:
    """`model_forward` of a packed `MicroBatch` (one pipeline chunk's output)."""
    as_t = torch.from_numpy
    return model_forward(
        model, as_t(mb.input_ids), as_t(mb.position_ids), as_t(mb.labels), as_t(mb.cu_seqlens), with_entropy
    )


def score_as_sampled(chunks: list[GPTModel], temperature: float, top_p: float) -> None:
    """Make the chunks' log-probs those of the engines' sampling distribution (`rollout.temperature`, `rollout.top_p`):
    the output layer's logits are divided by the temperature before any log-softmax, on both the cross-entropy and
    the entropy path, and with top_p < 1 the softmax runs over the nucleus (see the module docstring). The engines
    report processed log-probs (after temperature and top-p), so the importance weights compare like with like.
    Nothing changes at temperature 1 and top_p 1."""
    for chunk in chunks:
        chunk.sampling_top_p = top_p
    if temperature == 1.0:
        return

    def scaled(module: torch.nn.Module, inputs: tuple, output: tuple) -> tuple:
        logits, bias = output
        return logits / temperature, bias

    for chunk in chunks:
        output_layer = getattr(chunk, "output_layer", None) if chunk.post_process else None
        if output_layer is not None:
            output_layer.register_forward_hook(scaled)
