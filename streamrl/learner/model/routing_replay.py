"""Routing replay (`loss.routing_replay: rollout`): the learner's MoE routers use the experts the engine chose.

Contract: `enable_routing_replay(chunks)` gives every Megatron `TopKRouter` of the chunks a `RouterReplay` (Megatron's
own mechanism, in its unfused top-k path). Then, around each micro-batch's forward, `replay_routes(chunk, mb)` sets
the experts of `mb.routed_experts` (`[1, T, L, k]`, the engine's choice at each of this rank's positions, column
`layer_number - 1` for each router) as every router's target, or with no routes (a micro-batch not recorded, a
parity probe) lets the routers choose; `after_forward(chunk)` switches them to replay in the backward pass (activation
recomputation re-runs the forward in the same order), and `end_replay(chunks)` drops what is left after a schedule.

With replay the router still gets gradients: Megatron computes the routing probabilities from the current router
logits, gathered at the replayed experts (and renormalised as configured); only the choice of experts is fixed.
That removes the main source of train/rollout mismatch on MoE models, tokens routed to different experts by the
engine and the learner. The positions follow the model's input layout: the sequence-parallel padding
(`logprobs._pad_for_sequence_parallel`) gets experts 0..k-1, and under sequence parallelism each TP rank keeps its
contiguous share of the (padded) positions, as Megatron scatters the hidden states.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from streamrl.types import MicroBatch


def _routers(chunk: torch.nn.Module) -> list[TopKRouter]:
    return [m for m in chunk.modules() if isinstance(m, TopKRouter) and m.router_replay is not None]


def enable_routing_replay(chunks: Iterable[torch.nn.Module]) -> int:
    """Give every router of `chunks` a replay slot; returns how many routers there are (0: not a MoE model)."""
    count = 0
    for chunk in chunks:
        for router in (m for m in chunk.modules() if isinstance(m, TopKRouter)):
            if router.config.moe_router_fusion:
                raise ValueError("loss.routing_replay: Megatron replays only in its unfused top-k (moe_router_fusion)")
            router.router_replay = RouterReplay()
            count += 1
    return count


def _local_positions(routes: np.ndarray, config: object) -> np.ndarray:
    """`[T, L, k]` → this TP rank's `[S_local, L, k]`: padded like the inputs under sequence parallelism, sliced."""
    if not getattr(config, "sequence_parallel", False):
        return routes
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    cp_size = parallel_state.get_context_parallel_world_size()
    multiple = math.lcm(tp_size, 2 if cp_size > 1 else 1)
    pad = -len(routes) % multiple
    if pad:
        filler = np.broadcast_to(np.arange(routes.shape[2], dtype=routes.dtype), (pad, *routes.shape[1:]))
        routes = np.concatenate([routes, filler])
    share = len(routes) // tp_size
    rank = parallel_state.get_tensor_model_parallel_rank()
    return routes[rank * share : (rank + 1) * share]


def replay_routes(chunk: torch.nn.Module, mb: MicroBatch) -> None:
    """Before `mb`'s forward through `chunk`: force its routers to the recorded experts, or let them choose."""
    routers = _routers(chunk)
    if not routers:
        return
    if mb.routed_experts is None:
        for router in routers:
            router.router_replay.clear_router_replay_action()
        return
    routes = _local_positions(mb.routed_experts[0], routers[0].config)
    device = next(chunk.parameters()).device
    # int64 for Megatron's gather; one host-to-device copy for all layers of the chunk.
    layers = sorted({router.layer_number - 1 for router in routers})
    if layers[-1] >= routes.shape[1]:
        raise ValueError(
            f"routed_experts: the engine recorded {routes.shape[1]} layers, the learner's router is layer {layers[-1]}"
        )
    on_device = torch.from_numpy(np.ascontiguousarray(routes[:, layers]).astype(np.int64)).to(device)
    column = {layer: i for i, layer in enumerate(layers)}
    for router in routers:
        router.router_replay.set_target_indices(on_device[:, column[router.layer_number - 1]])
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def after_forward(chunk: torch.nn.Module) -> None:
    """After a replayed forward: a recomputation in the backward pass takes the same experts, in forward order."""
    for router in _routers(chunk):
        if router.router_replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)


def end_replay(chunks: Iterable[torch.nn.Module]) -> None:
    """After a schedule: drop the targets left (without recomputation nothing pops them) and let routers choose."""
    for chunk in chunks:
        for router in _routers(chunk):
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
