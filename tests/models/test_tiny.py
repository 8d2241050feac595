"""`streamrl init-model` writes a HuggingFace model + character tokenizer that transformers loads."""

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
