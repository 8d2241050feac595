"""`streamrl init-model` writes a HuggingFace model + character tokenizer that transformers loads, and replaces a
model already in its directory only with `--force`."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.cli import main
from streamrl.models.tiny import VOCAB_SIZE


@pytest.mark.parametrize("arch", ["qwen3", "llama", "deepseek_v3", "moonlight", "mixtral"])
def test_init_model_cli_writes_loadable_model(tmp_path: Path, arch: str) -> None:
    out = tmp_path / arch
    assert main(["init-model", str(out), "--arch", arch]) == 0
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) == VOCAB_SIZE
    text = "repeat #: 12+3=15"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text  # one token per character
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), VOCAB_SIZE) and torch.isfinite(logits).all()


def test_unknown_arch_is_refused(tmp_path: Path) -> None:
    from streamrl.models.tiny import write_tiny_model

    with pytest.raises(ValueError, match="arch: unknown architecture"):
        write_tiny_model(tmp_path, arch="gpt2")


def test_large_preset_has_qwen3_4b_body_and_is_written_in_bfloat16(tmp_path: Path) -> None:
    """The GPU benchmarks' large model: Qwen3-4B's layer shape (~3.6B without embeddings), saved in bfloat16 as
    released checkpoints are; written here with one layer (the shape per layer is what the preset fixes)."""
    from safetensors import safe_open

    from streamrl.models.tiny import write_tiny_model

    out = write_tiny_model(tmp_path / "large", "qwen3", "large", num_layers=1)
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    config = model.config
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        2560,
        32,
        8,
        128,
    )
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert 3.5e9 < 36 * per_layer < 3.7e9  # the preset's 36 layers
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}


def test_init_model_keeps_a_model_already_there_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["init-model", str(tmp_path), "--seed", "1"]) == 0
    weights = (tmp_path / "model.safetensors").read_bytes()
    assert main(["init-model", str(tmp_path), "--seed", "2"]) == 2
    assert f"{tmp_path} already holds a model (config.json); --force replaces it" in capsys.readouterr().err
    assert (tmp_path / "model.safetensors").read_bytes() == weights
    assert main(["init-model", str(tmp_path), "--seed", "2", "--force"]) == 0
    assert (tmp_path / "model.safetensors").read_bytes() != weights
