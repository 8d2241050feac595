"""Sharded loading: a checkpoint saved as several safetensors shards (with an index) loads into a TP=2 learner over
gloo, and each rank's peak host memory grows by no more than its own share of the weights plus a constant: no rank
reads the whole checkpoint."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamrl.learner.hf.checkpoint_files import INDEX, CheckpointTensors
from streamrl.models.tiny import write_tiny_model
from tests.learner.ranks import TIMEOUT_S, layout, record_errors, run_ranks

SHARDS = 3
CONSTANT_BYTES = 48 << 20  # the tensors of the one parameter a rank is building, and allocator slack


def _sharded_model(out: Path) -> tuple[Path, int]:
    """A ~54M-parameter Qwen3 (width 1024, 4 layers, float32: ~220 MB) saved as SHARDS files and an index."""
    model = write_tiny_model(out, "qwen3", "medium", num_layers=4)
    single = model / "model.safetensors"
    state = load_file(single)
    single.unlink()
    names = sorted(state)
    weight_map = {}
    for shard in range(SHARDS):
        file = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = {name: state[name].contiguous() for name in names[shard::SHARDS]}
        save_file(part, str(model / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (model / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model, sum(t.numel() * t.element_size() for t in state.values())


def _load_rank(rank: int, port: int, model_dir: Path, out_dir: Path) -> None:
    with record_errors(out_dir, rank):
        torch.set_num_threads(1)
        from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights
        from streamrl.learner.model.gpt import build_gpt_model
        from streamrl.learner.parallel import destroy_parallel, init_parallel

        init_parallel(layout(2, 2), rank, "127.0.0.1", port, seed=0)
        model = build_gpt_model(json.loads((model_dir / "config.json").read_text()))  # this rank's half, allocated
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        hf_config, hf_state = load_hf_checkpoint(model_dir)  # the measurement covers opening and loading
        load_hf_weights(model, hf_state, hf_config)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        share = sum(p.numel() * p.element_size() for p in model.parameters())
        (out_dir / f"rank-{rank}.json").write_text(json.dumps({"grown": grown, "share": share}))
        destroy_parallel()


def test_each_rank_reads_only_its_share(tmp_path: Path) -> None:
    model_dir, total = _sharded_model(tmp_path / "model")
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(_load_rank, 2, (model_dir,), out, TIMEOUT_S * 4)
    for rank in range(2):
        result = json.loads((out / f"rank-{rank}.json").read_text())
        print(
            f"rank {rank}: peak RSS grew {result['grown'] / 2**20:.0f} MiB loading; share {result['share'] / 2**20:.0f}"
            f" MiB of {total / 2**20:.0f} MiB"
        )
        assert result["grown"] <= result["share"] + CONSTANT_BYTES < total


def test_the_index_is_checked(tmp_path: Path) -> None:
    model_dir, _ = _sharded_model(tmp_path / "model")
    tensors = CheckpointTensors(model_dir)
    assert len(tensors) > 0 and "model.norm.weight" in tensors and "nope" not in tensors
    index = json.loads((model_dir / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "missing.safetensors"
    (model_dir / INDEX).write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        CheckpointTensors(model_dir)


def test_a_shard_or_an_index_that_is_not_one_is_named(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "model", "qwen3")
    shard = model_dir / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])  # cut short, as an interrupted copy leaves it
    with pytest.raises(ValueError, match=f"{shard}: not a safetensors file"):
        CheckpointTensors(model_dir)
    (model_dir / INDEX).write_text("[1, 2")
    with pytest.raises(ValueError, match=f"{model_dir / INDEX}: not a JSON object"):
        CheckpointTensors(model_dir)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="model.path: no \\*.safetensors files"):
        CheckpointTensors(model_dir)
