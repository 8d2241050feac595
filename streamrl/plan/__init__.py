"""Planning a job before it runs: the memory of each GPU and node of a layout (`streamrl plan`)."""

from streamrl.plan.memory import MemoryPlan, format_plan, plan_memory

__all__ = ["MemoryPlan", "format_plan", "plan_memory"]
