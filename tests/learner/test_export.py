"""A trained Megatron model exported as a HF checkpoint loads in transformers and scores like the learner."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from streamrl.learner.convert import load_hf_checkpoint, load_hf_weights
from streamrl.learner.export import export_hf
from streamrl.learner.logprobs import token_logprobs
from streamrl.learner.model import build_gpt_model

SEQ = 20


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.randint(1, vocab, (2, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return tokens[:, :-1], torch.arange(SEQ).repeat(2, 1), tokens[:, 1:]


def test_export_hf_round_trip(tp1_world: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_config, hf_state = load_hf_checkpoint(tiny_model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, hf_state, hf_config)
    ids, positions, labels = _batch(hf_config["vocab_size"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (-token_logprobs(model, ids, positions, labels).mean()).backward()
    optimizer.step()  # the export must carry trained weights, not the original file's
    model.eval()
    with torch.no_grad():
        expected = token_logprobs(model, ids, positions, labels)

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
