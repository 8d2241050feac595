"""Planning a job before it runs: the memory of each GPU and node of a layout (`streamrl plan`), and the tokens an
engine's KV cache holds."""

from streamrl.plan.kv_cache import check_kv_cache, kv_cache_bytes_per_token
from streamrl.plan.memory import MemoryPlan, format_plan, plan_memory, plans_by_recompute

__all__ = [
    "MemoryPlan",
    "check_kv_cache",
    "format_plan",
    "kv_cache_bytes_per_token",
    "plan_memory",
    "plans_by_recompute",
]
