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
    },
)
