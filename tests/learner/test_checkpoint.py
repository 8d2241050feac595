"""Learner checkpoints round-trip model and optimizer state, across a change of tensor-parallel layout too.

Each scenario trains two steps, saves, then compares "continue in the saving process" against "load the
checkpoint into a freshly built model": one more optimizer step on a fixed batch, then the loss of another fixed
batch. That loss depends on the weights and on both Adam moments, so equal losses mean all of them round-tripped.
TP=2 saves (and the Qwen3-MoE EP=2 save, whose grouped experts are split over the ranks) run in two spawned gloo
ranks; every load runs at TP=1, EP=1 in the test process (`tp1_world`). The optimizer is the learner's: Megatron's
DDP + distributed optimizer (`streamrl.learner.optimizer`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state

from streamrl.config import OptimizerConfig
from streamrl.learner.checkpoint import load_checkpoint, save_checkpoint
from streamrl.learner.checkpoint_meta import CheckpointError, latest_checkpoint, read_meta, step_dir
from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.model.logprobs import token_logprobs
from streamrl.learner.optimizer import Training, build_training
from streamrl.learner.parallel import destroy_parallel, init_parallel
from tests.learner.ranks import TIMEOUT_S, layout, record_errors, run_ranks

SEQ = 24
TRAIN, NEXT, EVAL = 0, 1, 2  # batches: before the save, the step after it, the loss that is compared


def _batch(which: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.randint(1, vocab, (2, SEQ + 1), generator=torch.Generator().manual_seed(100 + which))
    return tokens[:, :-1], torch.arange(SEQ).repeat(2, 1), tokens[:, 1:]


def _loss(model: torch.nn.Module, which: int, vocab: int) -> torch.Tensor:
    device = next(model.parameters()).device
    return -token_logprobs(model, *(t.to(device) for t in _batch(which, vocab))).mean()


def _step(training: Training, which: int, vocab: int) -> None:
    training.zero_grad()
    # Data-parallel ranks (EP=2 below) all run the same batch: the global loss is their mean.
    (_loss(training.models[0], which, vocab) / parallel_state.get_data_parallel_world_size()).backward()
    training.finalize_grads(training.models)  # what the schedule does after the last micro-batch
    training.step()


def _learner(
    model_dir: Path, settings: OptimizerConfig | None = None, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, Training, int]:
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    model = build_gpt_model(hf_config, params_dtype=dtype)
    load_hf_weights(model, hf_state, hf_config)
    return model, build_training([model], settings or OptimizerConfig()), hf_config["vocab_size"]


def _train_save_continue(model_dir: Path, root: Path, *learner: object) -> float:
    """Two steps, checkpoint as step 2, one more step; the EVAL loss after it."""
    model, training, vocab = _learner(model_dir, *learner)
    for _ in range(2):
        _step(training, TRAIN, vocab)
    save_checkpoint(root, 2, 2, model, training.optimizer, config_hash="test")
    _step(training, NEXT, vocab)
    with torch.no_grad():
        return float(_loss(model, EVAL, vocab))


def _load_and_continue(model_dir: Path, path: Path, *learner: object) -> float:
    model, training, vocab = _learner(model_dir, *learner)
    meta = load_checkpoint(path, model, training.optimizer)
    assert (meta.step, meta.version) == (2, 2)
    adam_states = [state for opt in training.optimizer.chained_optimizers for state in opt.optimizer.state.values()]
    assert adam_states and all(int(state["step"]) == 2 for state in adam_states)
    _step(training, NEXT, vocab)
    with torch.no_grad():
        return float(_loss(model, EVAL, vocab))


def _two_rank_save(rank: int, port: int, tp: int, ep: int, model_dir: Path, root: Path, out_dir: Path) -> None:
    with record_errors(out_dir, rank):
        torch.set_num_threads(1)
        init_parallel(layout(2, tp, expert_parallel=ep), rank, "127.0.0.1", port, seed=0)
        loss = _train_save_continue(model_dir, root)
        (out_dir / f"loss-{rank}.json").write_text(json.dumps(loss))
        destroy_parallel()


def test_tp2_checkpoint_loads_at_tp1(tp1_world: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    run_ranks(_two_rank_save, 2, (2, 1, tiny_model_dir, root), tmp_path, 2 * TIMEOUT_S)
    tp2_losses = [json.loads((tmp_path / f"loss-{rank}.json").read_text()) for rank in range(2)]
    assert tp2_losses[0] == tp2_losses[1]
    meta = read_meta(step_dir(root, 2))
    assert (meta.tensor_parallel, meta.data_parallel) == (2, 1)
    assert latest_checkpoint(root) == step_dir(root, 2)
    assert _load_and_continue(tiny_model_dir, step_dir(root, 2)) == pytest.approx(tp2_losses[0], abs=1e-6, rel=0)


def test_ep2_moe_checkpoint_loads_at_ep1(
    tp1_world: None, tiny_model_dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    moe_dir, root = tiny_model_dirs("qwen3_moe"), tmp_path / "checkpoints"
    run_ranks(_two_rank_save, 2, (1, 2, moe_dir, root), tmp_path, 2 * TIMEOUT_S)  # 4 of the 8 experts per rank
    ep2_losses = [json.loads((tmp_path / f"loss-{rank}.json").read_text()) for rank in range(2)]
    assert ep2_losses[0] == ep2_losses[1]
    assert _load_and_continue(moe_dir, step_dir(root, 2)) == pytest.approx(ep2_losses[0], abs=1e-6, rel=0)


@pytest.fixture(scope="module")
def tp1_checkpoint(tp1_world: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(checkpoint root, EVAL loss of the saving process after one more step) for a TP=1 save at step 2."""
    root = tmp_path_factory.mktemp("tp1") / "checkpoints"
    return root, _train_save_continue(tiny_model_dir, root)


def test_tp1_round_trip_is_exact(tp1_checkpoint: tuple, tiny_model_dir: Path) -> None:
    root, expected = tp1_checkpoint
    assert _load_and_continue(tiny_model_dir, latest_checkpoint(root)) == expected


def _copy(root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(root, tmp_path / "checkpoints"))


def test_incomplete_checkpoint_is_not_latest(tp1_checkpoint: tuple, tmp_path: Path) -> None:
    root = _copy(tp1_checkpoint[0], tmp_path)
    crashed = step_dir(root, 3)  # a save that died after writing some shards, before meta.json and `latest`
    shutil.copytree(step_dir(root, 2) / "dist", crashed / "dist")
    assert latest_checkpoint(root) == step_dir(root, 2)
    with pytest.raises(CheckpointError, match=r"step_00000003/meta\.json: missing"):
        read_meta(crashed)
    (root / "latest").write_text("step_00000003\n")  # even a pointer to it is refused, not loaded
    with pytest.raises(CheckpointError, match="meta.json: missing"):
        latest_checkpoint(root)
    assert latest_checkpoint(tmp_path / "none") is None


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda meta: "{not json", r"meta\.json: not valid JSON"),
        (lambda meta: json.dumps({**meta, "step": "two"}), r"meta\.json: field 'step' must be int, got 'two'"),
        (lambda meta: json.dumps({k: v for k, v in meta.items() if k != "version"}), r"field 'version' must be int"),
        (lambda meta: json.dumps({**meta, "step": 7}), r"field 'step' is 7 but the directory is step_00000002"),
        (lambda meta: json.dumps([meta]), r"meta\.json: expected a JSON object"),
    ],
)
def test_corrupt_meta_is_refused_naming_it(
    tp1_checkpoint: tuple, tmp_path: Path, corrupt: Callable[[dict], str], message: str
) -> None:
    root = _copy(tp1_checkpoint[0], tmp_path)
    meta_file = step_dir(root, 2) / "meta.json"
    meta_file.write_text(corrupt(json.loads(meta_file.read_text())))
    with pytest.raises(CheckpointError, match=message):
        latest_checkpoint(root)


def test_corrupt_latest_pointer_is_refused(tp1_checkpoint: tuple, tmp_path: Path) -> None:
    root = _copy(tp1_checkpoint[0], tmp_path)
    (root / "latest").write_text("../elsewhere\n")
    with pytest.raises(CheckpointError, match=r"latest: expected a step directory name"):
        latest_checkpoint(root)


def test_bf16_checkpoint_continues_exactly(tp1_world: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    """bf16 weights with float32 norms (two grad buffers): the optimizer state of every parameter is saved as its own
    and a reload continues exactly (Megatron's order of the optimizer's groups, see `cpu_compat`)."""
    root = tmp_path / "checkpoints"
    expected = _train_save_continue(tiny_model_dir, root, None, torch.bfloat16)
    assert _load_and_continue(tiny_model_dir, step_dir(root, 2), None, torch.bfloat16) == pytest.approx(
        expected, abs=1e-6, rel=0
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [False, True], ids=["copies-then-update", "overlapped-copies"])
def test_offloaded_optimizer_checkpoint_continues_exactly_on_gpu(
    tp1_world: None, tiny_model_dir: Path, tmp_path: Path, overlap: bool
) -> None:
    """bf16 model, half the optimizer state on the host (precision-aware HybridDeviceOptimizer; with
    `overlap_host_copies`, one host optimizer per parameter): a reload continues with the same master weights and
    moments as the optimizer that never stopped."""
    learner = (
        OptimizerConfig(cpu_offload=True, offload_fraction=0.5, overlap_host_copies=overlap),
        torch.bfloat16,
    )
    root = tmp_path / "checkpoints"
    expected = _train_save_continue(tiny_model_dir, root, *learner)
    assert _load_and_continue(tiny_model_dir, step_dir(root, 2), *learner) == pytest.approx(expected, abs=1e-6, rel=0)
