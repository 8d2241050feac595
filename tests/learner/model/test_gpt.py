"""Megatron GPTModel built from a HF config + converted weights reproduces HF transformers (float32, CPU/gloo).

TP=1 runs in the test process; TP=2 runs two spawned gloo ranks that write their results to files. Both check
per-token log-probs (within 1e-4 of HF), gradients of their sum (against HF's, via the HF-named gather), and
that streaming the live model back to HF names reproduces the checkpoint bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.mlp import MLP

from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights, megatron_names, stream_hf_weights
from streamrl.learner.model.fused import SwiGLU
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.model.logprobs import token_logprobs
from streamrl.learner.parallel import destroy_parallel, init_parallel
from tests.learner.grads import complete, grads_by_hf_name, wrap
from tests.learner.ranks import TIMEOUT_S, layout, record_errors, run_ranks

BATCH, SEQ, PAD_FROM = 2, 16, 11  # row 1 is row 0 right-padded from position PAD_FROM (labels from PAD_FROM-1)


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, position_ids, labels [B, S]; labels are the next tokens (a random one at the end)."""
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(1, vocab, (1, SEQ + 1), generator=gen)
    ids = tokens[:, :-1].repeat(BATCH, 1)
    labels = tokens[:, 1:].repeat(BATCH, 1)
    ids[1, PAD_FROM:] = 0
    labels[1, PAD_FROM - 1 :] = 0
    return ids, torch.arange(SEQ).repeat(BATCH, 1), labels


def _megatron_logprobs_and_grads(
    model: torch.nn.Module, hf_config: dict
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Log-probs, HF-named full gradients of their sum, and HF-named full weights of the live model."""
    training = wrap([model])
    ids, pos, labels = _inputs(hf_config["vocab_size"])
    logprobs = token_logprobs(model, ids, pos, labels)
    logprobs.sum().backward()
    complete(training)  # Megatron's DDP completes the gradients (TP-partial q/k-norm sums), as in the learner
    weights = {name: t.cpu().clone() for name, t in stream_hf_weights(model, hf_config)}
    return logprobs.detach().cpu(), grads_by_hf_name([model], hf_config), weights  # compared with HF on the host


def _hf_logprobs_and_grads(model_dir: Path, vocab: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, pos, labels = _inputs(vocab)
    logits = model(input_ids=ids, position_ids=pos).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[..., None])[..., 0]
    logprobs.sum().backward()
    return logprobs.detach(), {name: p.grad for name, p in model.named_parameters()}


def _check_against_hf(model_dir: Path, logprobs: torch.Tensor, grads: dict, weights: dict) -> None:
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    expected, hf_grads = _hf_logprobs_and_grads(model_dir, hf_config["vocab_size"])
    assert (logprobs - expected).abs().max().item() < 1e-4
    assert torch.allclose(logprobs[1, : PAD_FROM - 1], logprobs[0, : PAD_FROM - 1], atol=1e-6)  # right padding is inert
    assert weights.keys() == hf_state.keys()
    assert all(torch.equal(weights[n], hf_state[n]) for n in hf_state)
    assert grads.keys() == hf_grads.keys()
    # HF's nn.Embedding(padding_idx=pad_token_id) never accumulates a gradient into the pad row; Megatron's does.
    pad = hf_config["pad_token_id"]
    hf_grads["model.embed_tokens.weight"][pad] = grads["model.embed_tokens.weight"][pad]
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert torch.allclose(grad, hf_grads[name], rtol=1e-3, atol=1e-5), name


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_tp1_matches_hf(tp1_world: None, tiny_model_dirs: Callable[[str], Path], arch: str) -> None:
    hf_config, hf_state = load_hf_checkpoint(tiny_model_dirs(arch))
    model = build_gpt_model(hf_config)
    assert [k for k in model.state_dict() if not k.endswith("_extra_state")] == megatron_names(hf_config)
    mlps = [module for module in model.modules() if isinstance(module, MLP)]
    assert mlps and all(isinstance(mlp.activation_func, SwiGLU) for mlp in mlps)  # the fused gate|up activation
    load_hf_weights(model, hf_state, hf_config)
    _check_against_hf(tiny_model_dirs(arch), *_megatron_logprobs_and_grads(model, hf_config))


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short, so the tiny head's low frequencies are scaled
    "rope_theta": 10000.0,
}


def test_llama3_rope_scaling_matches_hf(tp1_world: None, tmp_path: Path) -> None:
    """Llama-3.x RoPE scaling with the checkpoint's own parameters (Megatron's switch would fix all but the factor);
    a rope type the model cannot build is refused, naming the key."""
    from streamrl.models.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "llama3", "llama", rope_parameters=LLAMA3_ROPE)
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, hf_state, hf_config)
    _check_against_hf(model_dir, *_megatron_logprobs_and_grads(model, hf_config))
    plain = build_gpt_model({**hf_config, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    assert not torch.equal(plain.rotary_pos_emb.inv_freq, model.rotary_pos_emb.inv_freq)  # the scaling did act
    with pytest.raises(ValueError, match="rope_parameters.rope_type"):
        build_gpt_model({**hf_config, "rope_parameters": {**LLAMA3_ROPE, "rope_type": "longrope"}})


def _tp2_rank(rank: int, port: int, model_dirs: dict[str, Path], out_dir: Path) -> None:
    """One TP=2 rank: per arch, save (logprobs, grads, weights) to `out_dir/{arch}-{rank}.pt`."""
    with record_errors(out_dir, rank):
        torch.set_num_threads(1)
        init_parallel(layout(2, 2), rank, "127.0.0.1", port, seed=0)
        for arch, model_dir in model_dirs.items():
            hf_config, hf_state = load_hf_checkpoint(model_dir)
            model = build_gpt_model(hf_config)
            load_hf_weights(model, hf_state, hf_config)
            torch.save(_megatron_logprobs_and_grads(model, hf_config), out_dir / f"{arch}-{rank}.pt")
        destroy_parallel()


def test_tp2_matches_hf(tiny_model_dirs: Callable[[str], Path], tmp_path: Path) -> None:
    model_dirs = {arch: tiny_model_dirs(arch) for arch in ("qwen3", "llama")}
    run_ranks(_tp2_rank, 2, (model_dirs,), tmp_path, 2 * TIMEOUT_S)
    for arch, model_dir in model_dirs.items():
        ranks = [torch.load(tmp_path / f"{arch}-{rank}.pt") for rank in range(2)]
        assert torch.equal(ranks[0][0], ranks[1][0])  # every TP rank gets the same log-probs
        for rank in ranks:
            _check_against_hf(model_dir, *rank)
