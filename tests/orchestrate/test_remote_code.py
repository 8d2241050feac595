"""`model.trust_remote_code`: a checkpoint whose tokenizer is its own Python code (as Moonlight's is) loads as that
class with it, and a job with it set (passed to the engine's vLLM and to the worker's tokenizer) trains."""

from __future__ import annotations

import json
from pathlib import Path

from streamrl.models.tiny import write_tiny_model
from streamrl.orchestrate.driver import train
from tests.orchestrate.parity import tiny_config

CUSTOM = '''from transformers import PreTrainedTokenizerFast


class CustomTokenizer(PreTrainedTokenizerFast):
    """The checkpoint's own tokenizer class (as Moonlight ships one)."""
'''


def test_a_tokenizer_with_its_own_code_loads_and_trains_with_trust_remote_code(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = write_tiny_model(tmp_path / "model", "qwen3")
    (model / "tokenization_custom.py").write_text(CUSTOM)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings |= {
        "tokenizer_class": "CustomTokenizer",
        "auto_map": {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]},
    }
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    assert type(AutoTokenizer.from_pretrained(str(model), trust_remote_code=True)).__name__ == "CustomTokenizer"
    config = tiny_config(
        tmp_path, "model.trust_remote_code=true", "train.steps=1", "train.checkpoint_every=0", "wandb.mode=disabled"
    )
    assert len(train(config, show_progress=False).history) == 1
