"""In-job check that the engines compute with the weights the learner published (`train.parity_every`).

Contract: `ParityCheck(every, tolerance, whole_responses=False)`; `due(step)` says whether step `step` (1-based) checks,
which stays true on the following steps until one has tokens to check. `measure(start_logp, microbatches, version,
device)` takes the learner's log-probs at the step's starting weights (`{id(mb): [1, T]}` from the last pipeline stage's
first TP rank, `{}` from every other rank, so each token counts once) and compares them with the engines' behaviour
log-probs on the response tokens sampled under `version`, the version those weights were published as (any other token
is off-policy by design). With `whole_responses` (engines that keep their KV across versions,
`rollout.kv_on_update=keep`) only responses sampled wholly under `version` count: a later token of a response begun
under an older version was sampled over that version's KV, which the learner's weights do not reproduce. Every rank of
the learner world must call it; all get the same metrics (`rollout_corr/parity_abs_mean`, `_abs_max`, `_tokens`), and
all raise `ParityError` when the mean exceeds the tolerance, so a silent divergence (an engine computing with a stale
copy of a weight, a sampler the learner does not reproduce) stops the job with a reason instead of training on wrong
importance weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from streamrl.types import MicroBatch


class ParityError(RuntimeError):
    """The engines' log-probs differ from the learner's under the same weights beyond the tolerance."""


class ParityCheck:
    def __init__(self, every: int, tolerance: float, whole_responses: bool = False) -> None:
        self.every, self.tolerance, self.whole_responses = every, tolerance, whole_responses
        self._pending = False

    def due(self, step: int) -> bool:
        if self.every > 0 and step % self.every == 0:
            self._pending = True
        return self._pending

    def measure(
        self,
        start_logp: dict[int, torch.Tensor],
        microbatches: Sequence[MicroBatch],
        version: int,
        device: torch.device,
    ) -> dict[str, float]:
        """Compare, reduce over the learner world, raise past the tolerance; see the module docstring."""
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # sum |gap|, token count
        largest = torch.zeros(1, dtype=torch.float64, device=device)
        for mb in microbatches:
            if id(mb) not in start_logp:
                continue
            as_t = lambda array: torch.from_numpy(array).to(device)  # noqa: E731
            fresh = (as_t(mb.loss_weight) > 0) & (as_t(mb.behaviour_versions) == version)
            if self.whole_responses:
                fresh &= as_t(first_versions(mb)) == version
            gaps = (start_logp[id(mb)].double() - as_t(mb.behaviour_logprobs).double()).abs()[fresh]
            if gaps.numel():
                sums += torch.stack([gaps.sum(), torch.tensor(float(gaps.numel()), device=device)])
                largest = torch.maximum(largest, gaps.max().reshape(1))
        dist.all_reduce(sums)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        total, count = sums.tolist()
        if count == 0:
            return {"rollout_corr/parity_tokens": 0.0}
        self._pending = False
        mean = total / count
        if mean > self.tolerance:
            raise ParityError(
                f"train.parity_every: the engines' log-probs of {int(count)} tokens sampled with version {version} "
                f"differ from the learner's with the same weights by {mean:.3g} per token on average (largest "
                f"{float(largest):.3g}), above train.parity_tolerance {self.tolerance:g}: the engines do not compute "
                f"with the published weights, or sample differently from how the learner scores"
            )
        return {
            "rollout_corr/parity_abs_mean": mean,
            "rollout_corr/parity_abs_max": float(largest),
            "rollout_corr/parity_tokens": count,
        }


def first_versions(mb: MicroBatch) -> np.ndarray:
    """int32[1, T]: at every position, the version its sequence's response began under (its oldest; -1 for a
    sequence without response tokens)."""
    lengths = np.diff(mb.cu_seqlens)
    versions = mb.behaviour_versions[0]
    oldest = np.minimum.reduceat(np.where(versions >= 0, versions, np.iinfo(np.int32).max), mb.cu_seqlens[:-1])
    oldest = np.where(oldest == np.iinfo(np.int32).max, -1, oldest).astype(np.int32)
    return np.repeat(oldest, lengths)[None]
