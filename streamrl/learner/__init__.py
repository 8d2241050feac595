"""The Megatron learner: model parts (`model/`), HF conversion (`hf/`) and the runtime (worker, trainer,
parallel state, pipeline, checkpoints, CPU compatibility). Public API below."""

from streamrl.api import exports

__all__, __getattr__ = exports(
    __name__,
    {
        "LearnerWorker": "worker",
        "check_layout": "model.layout",
        "export_checkpoint": "hf.export",
        "completed_step": "checkpoint_meta",
        "CheckpointError": "checkpoint_meta",
        "CheckpointTensors": "hf.checkpoint_files",
        "StageParameters": "stage_shapes",
        "stage_parameters": "stage_shapes",
        "moe_layers": "model.moe",
        "expert_size": "model.moe",
        "num_experts": "model.moe",
        "shared_expert_size": "model.moe",
        "has_qk_layernorm": "model.gpt",
    },
)
