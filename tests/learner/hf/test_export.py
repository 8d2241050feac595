"""A trained Megatron model exported as a HF checkpoint loads in transformers and scores like the learner;
`streamrl export-hf` writes a saved learner checkpoint's weights exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from megatron.core.optimizer import MegatronOptimizer
from safetensors.torch import load_file

from streamrl.config import OptimizerConfig
from streamrl.learner.checkpoint import save_checkpoint
from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights, stream_hf_weights
from streamrl.learner.hf.export import export_hf
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.model.logprobs import token_logprobs
from streamrl.learner.optimizer import build_training

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
