"""The trajectory queue (Redis Streams): the wire codec, the embedded server, producers, the consumer,
admission by staleness and sync mode's prompt budget. Public API below; docs/DESIGN.md has the stage page."""

from streamrl.api import exports

__all__, __getattr__ = exports(
    __name__,
    {
        "QueueKeys": "stream",
        "TrajectoryProducer": "stream",
        "TrajectoryConsumer": "consumer",
        "connect": "client",
        "connect_for": "client",
        "EmbeddedRedis": "server",
        "encode_group": "codec",
        "decode_group": "codec",
        "DecodeError": "codec",
        "split_by_staleness": "admission",
        "lag_histogram": "admission",
        "ahead_of": "admission",
        "SyncBudget": "sync_budget",
        "grant_prompts": "sync_budget",
        "reset_budgets": "sync_budget",
    },
)
