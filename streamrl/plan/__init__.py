"""Planning a job before it runs: the tensors of each learner stage and the memory of each GPU and node."""

from streamrl.plan.memory import MemoryPlan, format_plan, plan_memory
from streamrl.plan.stages import StageParameters, stage_parameters

__all__ = ["MemoryPlan", "StageParameters", "format_plan", "plan_memory", "stage_parameters"]
