"""Rewards: the built-in `symbols` and `math` rewards, a user's function or an HTTP service, scored off the
decode thread in a bounded pool (`RewardPool`). Public API below."""

from streamrl.api import exports

__all__, __getattr__ = exports(
    __name__,
    {"RewardPool": "pool", "PendingGroup": "pool", "Scorer": "pool", "load_function": "plugin", "check_spec": "plugin"},
)
