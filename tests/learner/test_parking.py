"""Parking a learner's GPU state on the host (colocated engines): storages move, views follow them back."""

from __future__ import annotations

import pytest
import torch

from streamrl.learner.parking import HostParking, training_tensors


def _model_and_optimizer(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8, device=device)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def test_training_tensors_lists_weights_gradients_and_optimizer_state() -> None:
    model, optimizer = _model_and_optimizer("cpu")
    listed = {id(t) for t in training_tensors([model], optimizer)}
    for parameter in model.parameters():
        assert id(parameter) in listed and id(parameter.grad) in listed
        assert all(id(v) in listed for v in optimizer.state[parameter].values() if isinstance(v, torch.Tensor))
    # Host tensors stay where they are: nothing to park on a machine without a GPU.
    parking = HostParking(lambda: training_tensors([model], optimizer))
    assert parking.park() == 0 and not parking.parked


def test_training_tensors_walks_every_part_of_a_chained_optimizer() -> None:
    """A MoE learner with expert parallelism gets Megatron's chained optimizer (dense and expert parameters apart),
    whose `optimizer` asserts a single part: every part's parameters, gradients and state are listed."""
    from streamrl.learner.cpu_compat import apply_cpu_compat

    apply_cpu_compat()  # Megatron's optimizers keep a loss scale on "cuda"
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    torch.manual_seed(0)
    dense, experts = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
    config = OptimizerConfig(lr=1e-2)
    parts = [FP32Optimizer(torch.optim.Adam(m.parameters(), lr=1e-2), config, None) for m in (dense, experts)]
    chained = ChainedOptimizer(parts)
    experts(dense(torch.randn(3, 8))).square().sum().backward()
    for part in parts:
        part.optimizer.step()
    with pytest.raises(AssertionError, match="more than one optimizer"):
        _ = chained.optimizer
    listed = {id(t) for t in training_tensors([dense, experts], chained)}
    for parameter in [*dense.parameters(), *experts.parameters()]:
        assert id(parameter) in listed and id(parameter.grad) in listed
    states = [value for part in parts for state in part.optimizer.state.values() for value in state.values()]
    assert all(id(value) in listed for value in states if isinstance(value, torch.Tensor))


@pytest.mark.gpu
def test_parked_state_frees_the_gpu_and_comes_back_bit_for_bit() -> None:
    model, optimizer = _model_and_optimizer("cuda")
    flat = torch.arange(1 << 20, dtype=torch.float32, device="cuda")  # a Megatron-style buffer and views of it
    views = [flat[:1000].view(10, 100), flat[5000:6000]]
    before = {id(t): t.clone() for t in [*training_tensors([model], optimizer), flat]}
    parking = HostParking(lambda: [*training_tensors([model], optimizer), *views])
    allocated = torch.cuda.memory_allocated()
    parked = parking.park()
    assert parked >= flat.numel() * 4 and parking.parked
    assert torch.cuda.memory_allocated() <= allocated - flat.numel() * 4
    assert flat.untyped_storage().nbytes() == 0
    parking.unpark()
    assert not parking.parked
    for tensor in [*training_tensors([model], optimizer), flat]:
        assert torch.equal(tensor, before[id(tensor)])
    assert torch.equal(views[1], flat[5000:6000])
    optimizer.step()  # the optimizer goes on with its state where it was
    assert all(torch.isfinite(p).all() for p in model.parameters())
