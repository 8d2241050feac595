"""Weights received inside each vLLM worker: what an engine of several GPUs (tensor / expert parallel) runs.

Contract
--------
`InWorkerReceiver` is mixed into `WeightReloadExtension`, so its methods run in every worker of an engine through
`collective_rpc` (an engine of several GPUs runs vLLM's multiprocess executor: tensors cannot pass by reference
from the engine's process to its workers, so each worker is a member of the weight groups itself):

- `streamrl_join_weight_groups(memberships, generation, timeout_s, device)`: the worker of engine rank r (`engine_rank`:
  data-parallel ranks' workers follow each other) joins one new weight group per learner pipeline stage,
  `memberships[r]`: (host, port, rank, world size) each.
- `streamrl_receive_version()`: receives one version bucket by bucket (`WeightGroup.receive_buckets`: at most two
  buckets staged, never the model) and loads each through vLLM's layerwise reload, whose weight loaders take the
  HF tensors in the learner's full (gathered) layout and keep the slices this worker's TP rank owns, and the experts
  its EP rank owns: the resharding from the learner's layout to the engine's. Each bucket is validated as it comes
  (names, shapes, dtypes, repeats), completeness at the end. The caller pauses decoding for the whole call. It
  answers a dict, `version` once every stage committed it, else `error` and `lost`: a version that fails before
  its first bucket leaves the weights as they were (lost False); one that fails half way (a publish not committed,
  a bad tensor, a dead publisher) has replaced part of them and nothing staged could restore them (lost True: the
  engine raises `WeightsLost`, must not sample again, and its process ends so that the fleet replaces it).
"""

from __future__ import annotations

from typing import Any

import torch

from streamrl.rollout.request_table import EngineLost
from streamrl.rollout.weight_checks import validate_bucket, validate_complete
from streamrl.weights import WeightGroup, join_groups


class WeightsLost(EngineLost):
    """A version was applied in part: the worker's weights are a mix of versions and must not be sampled from."""


def version_received(answers: list[dict[str, Any]]) -> int:
    """The version every worker of an engine loaded, from their `streamrl_receive_version` answers: `WeightsLost` when
    any loaded part of one or they differ, RuntimeError when none changed a weight but some received nothing."""
    errors = [a["error"] for a in answers if a["error"] is not None]
    if any(a["lost"] for a in answers):
        raise WeightsLost(f"weights: a version was loaded in part, the engine cannot run it: {errors}")
    if errors:
        raise RuntimeError(f"weights: the engine's workers received no version ({errors}); the old one runs")
    versions = {a["version"] for a in answers}
    if len(versions) != 1:
        raise WeightsLost(f"weights: the engine's workers loaded different versions {sorted(versions)}")
    return versions.pop()


def engine_rank(worker: Any) -> int:
    """A vLLM worker's position in its engine: data-parallel rank x ranks per data-parallel rank + its own rank (each
    data-parallel rank of an engine has workers of its own, numbered from 0), so the position of its GPU."""
    parallel = worker.vllm_config.parallel_config
    return parallel.data_parallel_rank * parallel.world_size + int(worker.rank)


class InWorkerReceiver:
    """Mixed into vLLM's Worker (through `WeightReloadExtension`); `self` is the worker (`rank`, `model_runner`)."""

    def streamrl_join_weight_groups(
        self, memberships: list[list[tuple[str, int, int, int]]], generation: int, timeout_s: float, device: str
    ) -> list[int]:
        """Join this worker's weight group of each stage, `memberships[rank]`; returns its rank in each. The groups
        of several stages rendezvous with their senders at once, so they are joined concurrently."""
        mine = memberships[engine_rank(self)]
        self._streamrl_groups = join_groups(mine, generation, timeout_s, device)
        return [rank for _, _, rank, _ in mine]

    def streamrl_receive_version(self) -> dict[str, Any]:
        """Receive and load one whole version from every stage; see the module docstring. Answers a dict (the
        multiprocess executor keeps only the text of a worker's exception): `version` when loaded, else `error` and
        `lost` (True once any weight was replaced)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        groups: list[WeightGroup] = getattr(self, "_streamrl_groups", [])
        if not groups:
            return {"version": None, "error": "this worker is in no weight group", "lost": False}
        shapes, optional = self._streamrl_expected_shapes()  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        seen: set[str] = set()

        def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            validate_bucket(bucket, shapes, seen)
            if not started:  # the layers go to the meta device here: from now on a failure loses the weights
                initialize_layerwise_reload(model)
                started.append(True)
            model.load_weights(bucket)

        started: list[bool] = []
        with torch.no_grad():
            try:
                # Stage by stage: each stage's publisher waits in its own group until its receivers get to it.
                versions = [group.receive_buckets(load) for group in groups]
                validate_complete(shapes, optional, seen)
                if len(set(versions)) != 1:
                    raise ValueError(f"pipeline stages sent different versions {versions}")
            except Exception as exc:  # noqa: BLE001 - answered to the engine, which decides whether it can go on
                return {"version": None, "error": f"{type(exc).__name__}: {exc}", "lost": bool(started)}
            finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]
            self._streamrl_refresh(model)  # type: ignore[attr-defined]
        return {"version": versions[0], "error": None, "lost": False}

    def streamrl_worker_placement(self) -> dict[str, Any]:
        """A worker of vLLM's Ray executor (a Ray actor of its own): its rank in the engine, its node and the GPU of its
        placement-group bundle."""
        from streamrl.net import ray_node

        return {"rank": engine_rank(self), **ray_node()}

    def streamrl_worker_info(self) -> dict[str, Any]:
        """This worker's rank in its engine and the bytes of its own (sharded) parameters."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {
            "rank": engine_rank(self),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        }
