"""Export the learner's Megatron model as a HuggingFace checkpoint (config.json, safetensors shards, tokenizer).

Contract: `export_hf(chunks, hf_config, out_dir, tokenizer_dir)` is a collective over the learner world: every rank
streams its pipeline stage's full weights in HF names (`stream_hf_weights` all-gathers TP shards and experts, one
tensor at a time), and one writer per stage (its tensor-, context- and data-parallel rank 0) writes them as they
arrive into safetensors shards of at most `shard_bytes` (a tensor larger than that gets a shard of its own): no rank
ever holds more than one shard and one tensor, and no rank gathers the model. Rank 0 then numbers the shards across
the stages (`model-00001-of-0000N.safetensors`, or a single `model.safetensors`), writes
`model.safetensors.index.json` (the weight map, HF's format) when there are several, config.json and the tokenizer
and generation files of `tokenizer_dir` (the original model directory). The result loads with
`transformers.AutoModelForCausalLM.from_pretrained` and serves with vLLM. Weights keep the parameters' dtype (fp32:
lossless) unless `dtype` is given; config.json records it. `out_dir` must be one directory every writer sees.

`export_checkpoint(config, checkpoint_dir, out_dir)` does the same for a saved learner checkpoint of any layout,
in this one process (a world of one rank); `streamrl export-hf` calls it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file

from streamrl.config import Config, ConfigError, LearnerConfig
from streamrl.learner.checkpoint import load_checkpoint
from streamrl.learner.checkpoint_meta import CheckpointError, checkpoint_root, latest_checkpoint, read_meta
from streamrl.learner.hf.convert import stream_hf_weights
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.parallel import destroy_parallel, init_parallel
from streamrl.net import free_port

SHARD_BYTES = 5 * 10**9  # HF's customary shard size
# Files of a HF model directory that describe tokenisation and generation rather than weights.
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template*",
    "generation_config.json",
    "*.tiktoken",
)


def export_hf(
    chunks: torch.nn.Module | list[torch.nn.Module],
    hf_config: dict[str, Any],
    out_dir: Path,
    tokenizer_dir: Path,
    dtype: torch.dtype | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> None:
    """Write `out_dir` from this rank's live chunks; every rank must call it (see the module docstring)."""
    stage = parallel_state.get_pipeline_model_parallel_rank()
    writer = (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    shards = _ShardWriter(out_dir, stage, shard_bytes) if writer else None
    written_dtype = None
    for name, tensor in stream_hf_weights(chunks, hf_config):
        if shards is not None:  # the others only drive the gathers
            tensor = tensor.to("cpu", dtype or tensor.dtype, copy=True).contiguous()
            written_dtype = written_dtype or str(tensor.dtype).removeprefix("torch.")  # the embedding's, as before
            shards.add(name, tensor)
    if shards is not None:
        shards.close(written_dtype)
    dist.barrier()  # every stage's shards and partial index are on disk
    if dist.get_rank() == 0:
        dtype_name = _number_shards(out_dir)
        config = dict(hf_config, dtype=dtype_name)
        if "torch_dtype" in config:  # the older spelling, still read by older transformers
            config["torch_dtype"] = dtype_name
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for pattern in TOKENIZER_FILES:
            for file in tokenizer_dir.glob(pattern):
                shutil.copy2(file, out_dir / file.name)
    dist.barrier()  # the export is complete when any rank returns


class _ShardWriter:
    """One stage's shards, written as they fill: `part-<stage>-<n>.safetensors` and `part-<stage>.json` (their
    tensors' names), renamed by `_number_shards` once every stage is done."""

    def __init__(self, out_dir: Path, stage: int, shard_bytes: int) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir, self.stage, self.shard_bytes = out_dir, stage, shard_bytes
        self.tensors: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[dict[str, Any]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.tensors and self.size + nbytes > self.shard_bytes:
            self._flush()
        self.tensors[name] = tensor
        self.size += nbytes

    def _flush(self) -> None:
        file = f"part-{self.stage:05d}-{len(self.files):05d}.safetensors"
        save_file(self.tensors, str(self.out_dir / file), metadata={"format": "pt"})
        self.files.append({"file": file, "names": list(self.tensors), "bytes": self.size})
        self.tensors, self.size = {}, 0

    def close(self, dtype: str | None) -> None:
        if self.tensors:
            self._flush()
        part = {"files": self.files, "dtype": dtype}
        (self.out_dir / f"part-{self.stage:05d}.json").write_text(json.dumps(part))


def _number_shards(out_dir: Path) -> str:
    """Rank 0: give the stages' shards their final names, in stage order, write the index; returns the dtype that
    config.json records (the embedding's)."""
    parts = sorted(out_dir.glob("part-*.json"))
    files = [entry for part in parts for entry in json.loads(part.read_text())["files"]]
    dtype = json.loads(parts[0].read_text())["dtype"]  # the first stage's first tensor: the embedding
    single = len(files) == 1
    weight_map, total = {}, 0
    for number, entry in enumerate(files, start=1):
        final = "model.safetensors" if single else f"model-{number:05d}-of-{len(files):05d}.safetensors"
        (out_dir / entry["file"]).replace(out_dir / final)
        weight_map.update(dict.fromkeys(entry["names"], final))
        total += entry["bytes"]
    for part in parts:
        part.unlink()
    if not single:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return dtype


def export_checkpoint(config: Config, checkpoint_dir: Path | None, out_dir: Path) -> Path:
    """Export the checkpoint at `checkpoint_dir` (default: the run's latest) as a HF model in `out_dir`. Before any
    process group starts, a checkpoint that is not one raises CheckpointError naming its file and field, and a
    `model.path` without the model's config.json ConfigError."""
    if checkpoint_dir is None:
        checkpoint_dir = latest_checkpoint(checkpoint_root(config.run.dir))
        if checkpoint_dir is None:
            raise CheckpointError(f"{checkpoint_root(config.run.dir) / 'latest'}: missing (no completed checkpoint)")
    read_meta(checkpoint_dir)
    if not (config.model.path / "config.json").is_file():
        raise ConfigError(
            f"model.path: {config.model.path} has no config.json (the run's HF model: its config and tokenizer go "
            "with the export)"
        )
    init_parallel(
        LearnerConfig(collective_timeout_s=config.learner.collective_timeout_s),
        0,
        "127.0.0.1",
        free_port(),
        seed=config.run.seed,
    )
    try:
        hf_config = json.loads((config.model.path / "config.json").read_text())
        model = build_gpt_model(hf_config)
        load_checkpoint(checkpoint_dir, model, optimizer=None)
        export_hf(model, hf_config, out_dir, config.model.path)
    finally:
        destroy_parallel()
    return out_dir
