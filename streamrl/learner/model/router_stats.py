"""Load balance of the MoE routers over a training step, counted by forward hooks on Megatron's `TopKRouter`s.

Contract: `RouterLoad(chunks)` hooks every router of this rank's model chunks; each router forward adds, per
expert, the tokens it sent there (its routing map summed over tokens). `reset()` zeroes the counts (at the start
of a step's training pass: other forwards, e.g. parity checks, are counted too); `metrics()`, a collective every
rank must call, sums each layer's counts over the ranks of its pipeline stage and returns, averaged over all MoE
layers of the model (every stage):
- `moe/load_max_over_mean`: tokens of the busiest expert over the mean per expert (1.0 = perfectly balanced,
  E/k = every token on the same k experts, top-k routing);
- `moe/load_cv`: coefficient of variation (std / mean) of the tokens per expert (0.0 = balanced).
The ranks of a stage (tensor x data x context parallel) route different tokens: data- and context-parallel ranks
run different tokens, and MoE models at TP>1 run sequence parallel, so TP peers route different parts of the
sequence. Both metrics are ratios, unchanged if every count is scaled: a forward run twice (activation
recomputation) or routers that saw the same tokens (TP without sequence parallelism) do not bias them. The few
padding tokens (sequence/context-parallel padding, filler micro-batches) are routed and counted like real ones.
Routing is dropless (`streamrl.learner.model.moe`), so no token is dropped and no drop count is reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter


class RouterLoad:
    """Tokens per expert of every MoE layer of this rank's chunks since the last `reset()`; see the module doc."""

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        experts = chunks[0].config.num_moe_experts
        if not experts:
            raise ValueError("RouterLoad: a dense model has no router (num_experts)")
        # A stage may hold no MoE layer (DeepSeek-V3's dense first layers): it still joins the reductions.
        routers = [module for chunk in chunks for module in chunk.modules() if isinstance(module, TopKRouter)]
        device = next(chunks[0].parameters()).device
        self.counts = torch.zeros(len(routers), experts, dtype=torch.int64, device=device)  # [layer, expert]
        for layer, router in enumerate(routers):
            router.register_forward_hook(partial(self._count, layer))

    def _count(
        self, layer: int, router: torch.nn.Module, inputs: Any, output: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        _, routing_map = output  # bool [tokens, experts]
        self.counts[layer] += routing_map.detach().sum(dim=0)

    def reset(self) -> None:
        self.counts.zero_()

    def metrics(self) -> dict[str, float]:
        """Collective over all ranks: the load-balance metrics of the counts since `reset()` (identical everywhere)."""
        counts = self.counts.double()
        stage = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        if dist.get_world_size(stage) > 1:
            dist.all_reduce(counts, group=stage)
        mean = counts.mean(dim=1).clamp_min(1e-12)  # a layer that routed nothing reports 0, not NaN
        ratio, cv = counts.amax(dim=1) / mean, counts.std(dim=1, correction=0) / mean
        # Every rank of a stage now holds its stage's sums; the pipeline group has one rank per stage.
        sums = torch.stack([ratio.sum(), cv.sum(), torch.tensor(float(len(counts)), device=counts.device)])
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(sums, group=parallel_state.get_pipeline_model_parallel_group())
        ratio_sum, cv_sum, layers = sums.tolist()
        return {"moe/load_max_over_mean": ratio_sum / layers, "moe/load_cv": cv_sum / layers}
