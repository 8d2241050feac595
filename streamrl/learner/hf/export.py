"""Export the learner's Megatron model as a HuggingFace checkpoint (config.json + model.safetensors + tokenizer).

Contract: `export_hf(model, hf_config, out_dir, tokenizer_dir)` is a collective over the tensor-parallel group:
every rank streams the full weights in HF names (`stream_hf_weights` all-gathers the TP shards) and rank 0 of
the world writes `out_dir`, which then loads with `transformers.AutoModelForCausalLM.from_pretrained` and serves
with vLLM. The tokenizer and generation files of `tokenizer_dir` (the original model directory) are copied
along. Weights keep the parameters' dtype (fp32: lossless) unless `dtype` is given; config.json records it.
Rank 0 holds one full copy of the weights while writing (a single safetensors file).

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
from safetensors.torch import save_file

from streamrl.config import Config, LearnerConfig
from streamrl.learner.checkpoint import load_checkpoint
from streamrl.learner.checkpoint_meta import CheckpointError, checkpoint_root, latest_checkpoint
from streamrl.learner.hf.convert import stream_hf_weights
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.parallel import destroy_parallel, init_parallel
from streamrl.net import free_port

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
    model: torch.nn.Module,
    hf_config: dict[str, Any],
    out_dir: Path,
    tokenizer_dir: Path,
    dtype: torch.dtype | None = None,
) -> None:
    """Write `out_dir` (rank 0) from the live model; every rank must call it (see the module docstring)."""
    writer = dist.get_rank() == 0
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in stream_hf_weights(model, hf_config):
        if writer:  # the others only drive the TP gathers
            weights[name] = tensor.to("cpu", dtype or tensor.dtype, copy=True).contiguous()
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        written = str(next(iter(weights.values())).dtype).removeprefix("torch.")
        config = dict(hf_config, dtype=written)
        if "torch_dtype" in config:  # the older spelling, still read by older transformers
            config["torch_dtype"] = written
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for pattern in TOKENIZER_FILES:
            for file in tokenizer_dir.glob(pattern):
                shutil.copy2(file, out_dir / file.name)
    dist.barrier()  # the export is complete when any rank returns


def export_checkpoint(config: Config, checkpoint_dir: Path | None, out_dir: Path) -> Path:
    """Export the checkpoint at `checkpoint_dir` (default: the run's latest) as a HF model in `out_dir`."""
    if checkpoint_dir is None:
        checkpoint_dir = latest_checkpoint(checkpoint_root(config.run.dir))
        if checkpoint_dir is None:
            raise CheckpointError(f"{checkpoint_root(config.run.dir) / 'latest'}: missing (no completed checkpoint)")
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
