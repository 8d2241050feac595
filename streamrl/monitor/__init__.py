"""Progress bar, W&B logging and the offline W&B file reader. Public API below."""

from streamrl.api import exports

__all__, __getattr__ = exports(
    __name__,
    {
        "RunMonitor": "run_monitor",
        "policy_reward": "run_monitor",
        "read_history": "wandb_files",
        "HealthServer": "health",
        "describe_status": "health",
    },
)
