"""A trained Megatron model exported as a HF checkpoint loads in transformers and scores like the learner;
`streamrl export-hf` writes a saved learner checkpoint's weights exactly, and refuses a run without a checkpoint, a
checkpoint that is not one and a `model.path` without the model (exit 2, naming the file or key, nothing written);
small shards come with HF's index, and pipeline stages write their own shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.optimizer import MegatronOptimizer
from safetensors.torch import load_file

from streamrl.cli import main
from streamrl.config import OptimizerConfig
from streamrl.learner.checkpoint import save_checkpoint
from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights, stream_hf_weights
from streamrl.learner.hf.export import export_hf
from streamrl.learner.model.gpt import build_gpt_model, build_model_chunks
from streamrl.learner.model.logprobs import token_logprobs
from streamrl.learner.optimizer import build_training
from streamrl.learner.parallel import destroy_parallel, init_parallel
from streamrl.models.tiny import write_tiny_model
from tests.learner.ranks import TIMEOUT_S, layout, record_errors, run_ranks

SEQ = 20
TINY_CONFIG = Path(__file__).parents[3] / "configs" / "tiny.yaml"


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.randint(1, vocab, (2, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return tokens[:, :-1], torch.arange(SEQ).repeat(2, 1), tokens[:, 1:]


def _trained(model_dir: Path) -> tuple[torch.nn.Module, MegatronOptimizer, dict]:
    """The tiny model after one step of the learner's optimizer: an export must carry trained weights, not the
    original file's."""
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, hf_state, hf_config)
    training = build_training([model], OptimizerConfig(lr=1e-2))
    training.zero_grad()
    (-token_logprobs(model, *_batch(hf_config["vocab_size"])).mean()).backward()
    training.finalize_grads(training.models)
    training.step()
    return model, training.optimizer, hf_config


def test_export_hf_round_trip(tp1_world: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, _, hf_config = _trained(tiny_model_dir)
    ids, positions, labels = _batch(hf_config["vocab_size"])
    model.eval()
    with torch.no_grad():
        expected = token_logprobs(model, ids, positions, labels).cpu()  # the model may be on a GPU

    out = tmp_path / "hf"
    export_hf(model, hf_config, out, tiny_model_dir)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = hf_model(input_ids=ids, position_ids=positions).logits
    got = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[..., None])[..., 0]
    assert (got - expected).abs().max().item() < 1e-5
    original = load_hf_checkpoint(tiny_model_dir)[1]["lm_head.weight"]
    assert not torch.equal(hf_model.lm_head.weight, original)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer.encode("#*@", add_special_tokens=False)) == "#*@"


def test_export_hf_cli_writes_the_latest_checkpoint(tp1_world: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    model, optimizer, hf_config = _trained(tiny_model_dir)
    save_checkpoint(tmp_path / "run" / "checkpoints", 1, 1, model, optimizer, config_hash="test")
    expected = {name: tensor.cpu().clone() for name, tensor in stream_hf_weights(model, hf_config)}
    out = tmp_path / "hf"
    command = [
        sys.executable,
        "-m",
        "streamrl.cli",
        "export-hf",
        "-c",
        str(TINY_CONFIG),
        "--out",
        str(out),
        f"run.dir={tmp_path / 'run'}",
        f"model.path={tiny_model_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith(str(out))
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[name], expected[name]) for name in expected)


def _export_cli(tmp_path: Path, model_dir: Path, *more: str) -> int:
    out = tmp_path / "hf"
    code = main(["export-hf", "-c", str(TINY_CONFIG), "--out", str(out), f"run.dir={tmp_path / 'run'}", *more])
    assert not out.exists()  # refused before anything is written
    return code


def test_export_hf_cli_refuses_an_output_directory_that_holds_files(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00003-of-00003.safetensors").write_bytes(b"an earlier export's shard")
    command = ["export-hf", "-c", str(TINY_CONFIG), "--out", str(out), f"model.path={tiny_model_dir}"]
    assert main([*command, f"run.dir={tmp_path / 'run'}"]) == 2
    assert f"--out {out} is not empty" in capsys.readouterr().err
    assert [path.name for path in out.iterdir()] == ["model-00003-of-00003.safetensors"]


def test_export_hf_cli_names_a_missing_or_broken_checkpoint(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _export_cli(tmp_path, tiny_model_dir, f"model.path={tiny_model_dir}") == 2
    assert (
        f"{tmp_path / 'run' / 'checkpoints' / 'latest'}: missing (no completed checkpoint)" in capsys.readouterr().err
    )
    broken = tmp_path / "run" / "checkpoints" / "step_00000005"
    broken.mkdir(parents=True)
    (broken / "meta.json").write_text('{"format": 1, "st')
    assert _export_cli(tmp_path, tiny_model_dir, f"model.path={tiny_model_dir}", "--checkpoint", str(broken)) == 2
    assert f"{broken / 'meta.json'}: not valid JSON" in capsys.readouterr().err


def test_export_hf_cli_names_a_model_path_without_the_model(
    tp1_world: None, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, optimizer, _ = _trained(tiny_model_dir)
    save_checkpoint(tmp_path / "run" / "checkpoints", 1, 1, model, optimizer, config_hash="test")
    assert _export_cli(tmp_path, tiny_model_dir, f"model.path={tmp_path / 'nothing'}") == 2
    assert f"model.path: {tmp_path / 'nothing'} has no config.json" in capsys.readouterr().err


def test_export_streams_shards_with_an_index(tp1_world: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    """With small shards the export is several files and HF's index; transformers loads them as one model."""
    from transformers import AutoModelForCausalLM

    model, _, hf_config = _trained(tiny_model_dir)
    expected = {name: tensor.cpu().clone() for name, tensor in stream_hf_weights(model, hf_config)}
    out = tmp_path / "hf"
    export_hf(model, hf_config, out, tiny_model_dir, shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files and not list(out.glob("part-*"))
    exported = {name: tensor for file in files for name, tensor in load_file(out / file).items()}
    assert exported.keys() == expected.keys() == index["weight_map"].keys()
    assert all(torch.equal(exported[name], expected[name]) for name in expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(hf_model.lm_head.weight.detach(), expected["lm_head.weight"])


def _export_stage(rank: int, port: int, model_dir: Path, out: Path, out_dir: Path) -> None:
    with record_errors(out_dir, rank):
        torch.set_num_threads(1)
        init_parallel(layout(2, 1, pipeline_parallel=2), rank, "127.0.0.1", port, seed=0)
        hf_config, hf_state = load_hf_checkpoint(model_dir)
        chunks = build_model_chunks(hf_config)
        for chunk in chunks:
            load_hf_weights(chunk, hf_state, hf_config)
        export_hf(chunks, hf_config, out, model_dir, shard_bytes=64 * 1024)
        destroy_parallel()


def test_pipeline_stages_write_their_own_shards(tiny_model_dirs, tmp_path: Path) -> None:
    """Two pipeline stages each write their layers' shards; rank 0 numbers them and writes one index: the export
    is the checkpoint, exactly, and no rank gathered the other stage's weights."""
    model_dir = write_tiny_model(tmp_path / "model", arch="qwen3", num_layers=4)
    out = tmp_path / "hf"
    run_ranks(_export_stage, 2, (model_dir, out), tmp_path, 2 * TIMEOUT_S)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    hf_state = load_hf_checkpoint(model_dir)[1]
    assert index["weight_map"].keys() == hf_state.keys()
    files = sorted(set(index["weight_map"].values()))
    first, last = index["weight_map"]["model.embed_tokens.weight"], index["weight_map"]["lm_head.weight"]
    assert first == files[0] and last == files[-1]  # stage 0's shards come first, the last stage's last
    for file in files:
        assert all(torch.equal(tensor, hf_state[name]) for name, tensor in load_file(out / file).items())
