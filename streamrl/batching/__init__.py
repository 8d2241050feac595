"""Dynamic sequence-balanced batching: the step source (admission, step composition, broadcast to the
learner ranks), per-rank micro-batches with exact loss weights, and the cost models. Public API below."""

from streamrl.api import exports

__all__, __getattr__ = exports(
    __name__,
    {
        "Step": "step_source",
        "StepSource": "step_source",
        "plan_rank": "microbatch",
        "plan_step": "microbatch",
        "filler_microbatch": "microbatch",
        "CostModel": "cost",
        "cost_model": "cost",
        "flops_cost_model": "cost",
    },
)
