"""HuggingFace <-> Megatron-core weight conversion for the models `streamrl.learner.model.gpt` builds.

Contract (all conversions are pure reindexing - views, cat, chunk - so a round trip is bit-exact):
- `hf_to_megatron(hf_state, hf_config, tp_rank, tp_size, ep_rank, ep_size)` returns this tensor- and
  expert-parallel rank's shard of every Megatron parameter, keyed by the `GPTModel.state_dict()` names (no
  `_extra_state`), ready for `model.load_state_dict(..., strict=False)`.
- `megatron_to_hf(mcore_state, hf_config)` takes FULL Megatron tensors (unsharded; stacked expert weights hold
  all E experts) and yields HF `(name, tensor)` pairs tensor by tensor; each Megatron tensor converts on its own,
  so a lazy mapping or the stream of `gather_tp_shards` never materialises more than one fused tensor at a time.
  It also takes single experts named `...mlp.experts.<e>.linear_fc1.weight` (global index e), as streamed below.
- `gather_tp_shards(model, tp_group, ep_group)` yields each parameter's full tensor under its full name,
  all-gathering TP shards over the TP group, and each expert's weights (one expert at a time, under its
  single-expert name) over the EP group: a collective every rank must drive in the same order, after which
  every rank has seen every tensor of its pipeline stage exactly once (the stages together: the whole model; a
  tied embedding's copy on the last stage is skipped). `stream_hf_weights` chains the two, over one model or
  this rank's chunks.
- `load_hf_weights(model, hf_state, hf_config)` loads this rank's shard into a built model (or into each of its
  pipeline chunks: a chunk's layers are numbered locally from 0, and `stage_names(chunk)` maps them to the
  model-wide layer numbers these conversions use).
- Names and sharding kinds come from `names.py`.
- `load_hf_checkpoint(path)` reads `config.json` and maps every tensor of the `*.safetensors` shards, each read from
  its shard only when a conversion looks it up (`checkpoint_files.CheckpointTensors`): a rank reads only what it
  loads.

Layouts. Megatron fuses q/k/v into `linear_qkv` with rows grouped per query group g:
`[q heads of group g, k_g, v_g]` for g in 0..num_query_groups-1 (same for the Qwen2 qkv bias), and gate/up
into `linear_fc1` = cat(gate, up). Tensor-parallel sharding (kinds below): column-parallel `linear_qkv` is a
plain dim-0 chunk because whole groups are contiguous; `linear_fc1` is cat(gate_shard, up_shard); the
vocab-parallel embedding / output layer split dim 0; row-parallel `linear_proj` / `linear_fc2` split dim 1;
norms are replicated.

Mixture of experts (Qwen3-MoE, DeepSeek-V3): the router `mlp.router.weight` is HF's `mlp.gate.weight`, replicated.
The experts are stacked (`streamrl.learner.model.experts`): `mlp.experts.linear_fc1.weight` [E, 2F, H] holds expert e's
cat(`experts.e.gate_proj`, `experts.e.up_proj`) at [e] and `mlp.experts.linear_fc2.weight` [E, H, F] its
`experts.e.down_proj`; experts are whole on every rank that holds them (expert TP 1, see `streamrl.learner.model.moe`),
and EP rank r holds global experts r*E/EP .. (r+1)*E/EP - 1 as rows 0.. of its stacked weights. DeepSeek-V3 adds
the router's `expert_bias` buffer (HF `mlp.gate.e_score_correction_bias`, replicated, streamed with the weights),
`mlp.shared_experts.linear_fc1/2` (from `mlp.shared_experts.gate/up/down_proj`, TP-sharded like a dense MLP) and
dense first layers (dense names). Its multi-latent attention maps `q_a_proj` / `q_b_proj` (or `q_proj`),
`q_a_layernorm`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj` to `linear_q_down_proj` /
`linear_q_up_proj` (or `linear_q_proj`), `q_layernorm`, `linear_kv_down_proj`, `kv_layernorm`, `linear_kv_up_proj`,
`linear_proj`: down projections replicated, up projections column-parallel by heads, output row-parallel; rotary
rows reordered only for HF's `rope_interleave=False` (why both: `streamrl.learner.model.mla`). Multi-token-prediction
layers of a DeepSeek checkpoint (indices >= `num_hidden_layers`) are not part of the model and are skipped.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from streamrl.learner.hf.checkpoint_files import CheckpointTensors
from streamrl.learner.hf.fp8 import dequantized_view
from streamrl.learner.hf.names import (
    COLUMN,
    GLU,
    IGNORED_HF,
    REPLICATED,
    STACKED_RE,
    expert_name,
    hf_sources,
    megatron_names,
    part_names,
    sharding_kind,
    source_name,
    stage_names,
    state_tensors,
)
from streamrl.learner.model.gpt import head_dim, is_expert_parameter, num_query_groups
from streamrl.learner.model.layout import check_tensor_and_expert_split
from streamrl.learner.model.mla import is_mla, rope_interleaved, rope_rows_to_hf, rope_rows_to_megatron
from streamrl.learner.model.moe import num_experts

logger = logging.getLogger(__name__)


def _rope_rows(name: str, hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """(rows per block, rotary rows ending each block) of an MLA weight whose rotary output rows are reordered
    because HF does not interleave them (see `streamrl.learner.model.mla`); None for every other tensor."""
    if not is_mla(hf_config) or rope_interleaved(hf_config):
        return None
    rope = hf_config["qk_rope_head_dim"]
    if name.endswith(("linear_q_proj.weight", "linear_q_up_proj.weight")):  # per head: [nope, rope]
        return hf_config["qk_nope_head_dim"] + rope, rope
    if name.endswith("linear_kv_down_proj.weight"):  # [kv latent, shared rotary key]
        return hf_config["kv_lora_rank"] + rope, rope
    return None


def _qkv_shape(hf_config: dict[str, Any]) -> tuple[int, int, int]:
    """(query groups, query heads per group, head dim) of the fused QKV layout."""
    groups = num_query_groups(hf_config)
    return groups, hf_config["num_attention_heads"] // groups, head_dim(hf_config)


def _fuse(name: str, parts: list[Tensor], hf_config: dict[str, Any]) -> Tensor:
    """Build the full Megatron tensor `name` from its HF parts (in `hf_sources` order)."""
    if "linear_qkv" in name and len(parts) == 3:
        groups, per_group, dim = _qkv_shape(hf_config)
        q, k, v = parts
        rest = q.shape[1:]  # (hidden,) for the weight, () for the bias
        q = q.reshape(groups, per_group * dim, *rest)
        return torch.cat([q, k.reshape(groups, dim, *rest), v.reshape(groups, dim, *rest)], dim=1).reshape(-1, *rest)
    full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # linear_fc1 = cat(gate, up)
    rope = _rope_rows(name, hf_config)
    return full if rope is None else rope_rows_to_megatron(full, *rope)


def _split(name: str, full: Tensor, hf_config: dict[str, Any]) -> list[Tensor]:
    """Inverse of `_fuse`: the HF parts of the full Megatron tensor `name`."""
    if "linear_qkv" in name:
        groups, per_group, dim = _qkv_shape(hf_config)
        rest = full.shape[1:]
        grouped = full.reshape(groups, per_group + 2, dim, *rest)
        return [
            grouped[:, :per_group].reshape(groups * per_group * dim, *rest),
            grouped[:, per_group].reshape(groups * dim, *rest),
            grouped[:, per_group + 1].reshape(groups * dim, *rest),
        ]
    rope = _rope_rows(name, hf_config)
    if rope is not None:
        return [rope_rows_to_hf(full, *rope)]
    if "linear_fc1" in name:
        return list(full.chunk(2, dim=0))
    return [full]


def _shard(full: Tensor, kind: str, tp_rank: int, tp_size: int) -> Tensor:
    """This rank's shard of a full tensor of sharding `kind`."""
    if kind == REPLICATED or tp_size == 1:
        return full
    if kind == GLU:  # each rank holds cat(gate_shard, up_shard)
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=0 if kind == COLUMN else 1)[tp_rank].contiguous()


def _unshard(shards: list[Tensor], kind: str) -> Tensor:
    """Inverse of `_shard` given every rank's shard in rank order."""
    if kind == REPLICATED or len(shards) == 1:
        return shards[0]
    if kind == GLU:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([half[0] for half in halves] + [half[1] for half in halves], dim=0)
    return torch.cat(shards, dim=0 if kind == COLUMN else 1)


def hf_to_megatron(
    hf_state: Mapping[str, Tensor],
    hf_config: dict[str, Any],
    tp_rank: int = 0,
    tp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
    names: list[str] | None = None,
) -> dict[str, Tensor]:
    """This TP and EP rank's shard of every Megatron parameter (or of `names`, model-wide names), from a full HF
    state dict (see module docstring)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: {tp_rank} outside [0, {tp_size})")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank: {ep_rank} outside [0, {ep_size})")
    check_tensor_and_expert_split(hf_config, tp_size, ep_size)
    local = num_experts(hf_config) // ep_size
    own_experts = range(ep_rank * local, (ep_rank + 1) * local)
    out: dict[str, Tensor] = {}
    for name in megatron_names(hf_config) if names is None else names:
        parts = []  # one tensor, or this EP rank's experts of a stacked expert weight
        for part_name in part_names(source_name(name, hf_config), own_experts):
            hf_names, kind = hf_sources(part_name, hf_config)
            missing = [n for n in hf_names if n not in hf_state]
            if missing:
                raise KeyError(f"HF checkpoint lacks {missing} needed for Megatron {part_name!r}")
            parts.append(_shard(_fuse(part_name, [hf_state[n] for n in hf_names], hf_config), kind, tp_rank, tp_size))
        out[name] = torch.stack(parts) if STACKED_RE.fullmatch(name) else parts[0]
    # Every HF tensor of the model, including the experts other EP ranks load.
    every_expert = range(num_experts(hf_config))
    known = {
        hf
        for name in megatron_names(hf_config)
        for n in part_names(name, every_expert)
        for hf in hf_sources(n, hf_config)[0]
    }
    mtp = {n for n in hf_state if _is_mtp(n, hf_config)}
    if mtp:
        logger.info(
            "skipping %d multi-token-prediction tensors (layers >= num_hidden_layers): RL trains without MTP", len(mtp)
        )
    leftover = {n for n in hf_state if n not in known and not IGNORED_HF.fullmatch(n) and n not in mtp}
    # A tied checkpoint may still store lm_head.weight (a copy of the embedding); the model has no slot for it.
    if hf_config.get("tie_word_embeddings", False):
        leftover.discard("lm_head.weight")
    if leftover:
        raise ValueError(f"HF checkpoint has tensors with no Megatron counterpart: {sorted(leftover)}")
    return out


def _is_mtp(hf_name: str, hf_config: dict[str, Any]) -> bool:
    """Whether `hf_name` belongs to a DeepSeek-V3 multi-token-prediction module (layers past `num_hidden_layers`):
    a speculative-decoding head that transformers ignores too and the learner does not train."""
    match = re.match(r"model\.layers\.(\d+)\.", hf_name)
    return (
        bool(hf_config.get("num_nextn_predict_layers"))
        and match is not None
        and (int(match.group(1)) >= hf_config["num_hidden_layers"])
    )


def load_hf_weights(model: torch.nn.Module, hf_state: Mapping[str, Tensor], hf_config: dict[str, Any]) -> None:
    """Copy a full HF state dict into this rank's Megatron model shard or pipeline chunk (TP/EP rank and size from
    `parallel_state`)."""
    local_names = stage_names(model)
    shard = hf_to_megatron(
        hf_state,
        hf_config,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_model_parallel_world_size(),
        names=list(local_names.values()),
    )
    shard = {local: shard[model_wide] for local, model_wide in local_names.items()}
    # Non-strict only because `_extra_state` entries (Transformer Engine FP8 metadata slots) have no HF source.
    result = model.load_state_dict(shard, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"state dict mismatch: missing {missing}, unexpected {result.unexpected_keys}")


def megatron_to_hf(mcore_state: Mapping[str, Tensor], hf_config: dict[str, Any]) -> Iterator[tuple[str, Tensor]]:
    """Yield HF `(name, tensor)` pairs from FULL Megatron tensors, one Megatron tensor at a time."""
    for name, full in mcore_state.items():
        if name.endswith("_extra_state"):
            continue
        stacked = STACKED_RE.fullmatch(name) is not None
        parts = zip(part_names(name, range(len(full))), full, strict=True) if stacked else [(name, full)]
        for part_name, part in parts:
            hf_names, _ = hf_sources(part_name, hf_config)
            yield from zip(hf_names, _split(part_name, part, hf_config), strict=True)


# Kept in float32 whatever the streaming dtype: DeepSeek-V3's router bias, as HF stores it and engines load it.
_FLOAT32_STATE = (".mlp.router.expert_bias",)


def gather_tp_shards(
    model: torch.nn.Module,
    tp_group: dist.ProcessGroup | None = None,
    ep_group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """Yield each parameter's (and persistent buffer's: MoE expert bias) full tensor under its full name,
    all-gathering TP shards and EP ranks' experts.

    A collective: every rank of `tp_group` and `ep_group` (Megatron's tensor- and expert-parallel groups by
    default) must consume the generator to the end, in lockstep. Each local expert parameter is all-gathered over
    the EP group expert by expert (global experts j, E/EP + j, ... for local row j, under single-expert names), so
    every rank yields every tensor exactly once and holds at most EP experts' weights of it at a time. Replicated
    tensors (and everything at TP=1, EP=1) are yielded as detached views of the live parameters, so copy them
    before the next optimizer step if they must persist. With `dtype` every tensor (but the float32 router bias)
    is cast before it is gathered: one cast per parameter (a stacked expert weight is cast whole, not expert by
    expert), and the gathers move the smaller tensors.
    """
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    if ep_group is None:
        ep_group = parallel_state.get_expert_model_parallel_group()
    tp_size, ep_size = dist.get_world_size(tp_group), dist.get_world_size(ep_group)
    mla = bool(getattr(model.config, "multi_latent_attention", False))
    model_wide = stage_names(model)
    for local_name, param in state_tensors(model):
        if getattr(param, "shared", False):  # the last stage's copy of a tied embedding: the first stage sends it
            continue
        name = model_wide[local_name]
        local = param.detach()
        if dtype is not None and not name.endswith(_FLOAT32_STATE):
            local = local.to(dtype)
        if is_expert_parameter(name):  # stacked [E/EP, ...], whole experts (expert TP 1): only EP splits them
            for row, expert in enumerate(local):
                parts = [expert]
                if ep_size > 1:
                    parts = [torch.empty_like(expert) for _ in range(ep_size)]
                    dist.all_gather(parts, expert.contiguous(), group=ep_group)
                for ep_rank, part in enumerate(parts):
                    yield expert_name(name, ep_rank * len(local) + row), part
            continue
        kind = sharding_kind(name, mla)
        if kind == REPLICATED or tp_size == 1:
            yield name, local
            continue
        shards = [torch.empty_like(local) for _ in range(tp_size)]
        dist.all_gather(shards, local.contiguous(), group=tp_group)
        yield name, _unshard(shards, kind)


def stream_hf_weights(
    chunks: torch.nn.Module | list[torch.nn.Module],
    hf_config: dict[str, Any],
    tp_group: dist.ProcessGroup | None = None,
    ep_group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """Stream this stage's full weights under HF names on every rank, cast to `dtype` if given (a collective, see
    `gather_tp_shards`)."""
    for chunk in [chunks] if isinstance(chunks, torch.nn.Module) else chunks:
        for name, full in gather_tp_shards(chunk, tp_group, ep_group, dtype):
            yield from megatron_to_hf({name: full}, hf_config)


def load_hf_checkpoint(path: str | Path) -> tuple[dict[str, Any], Mapping[str, Tensor]]:
    """`config.json` of a HF checkpoint directory and its tensors, each read when looked up (`CheckpointTensors`;
    block-wise FP8 weights dequantised to bf16 on read, `fp8.dequantized_view`)."""
    path = Path(path)
    hf_config = json.loads((path / "config.json").read_text())
    return hf_config, dequantized_view(hf_config, CheckpointTensors(path))
