"""The job: Redis, Ray, engines and learner ranks placed and supervised, and the driver loop. Public API below."""

from streamrl.api import exports

__all__, __getattr__ = exports(
    __name__,
    {
        "train": "driver",
        "prepare_run": "driver",
        "check_model_layout": "driver",
        "model_architecture": "driver",
        "RunResult": "driver",
        "Cluster": "cluster",
        "request_stop": "stop",
    },
)
