"""Weights from the learner to the engines: buckets with manifests, the weight group (gloo/NCCL), the
publisher (learner and driver sides) and copy plans for the engines' loads. Public API below."""

from streamrl.api import exports

__all__, __getattr__ = exports(
    __name__,
    {
        "DTYPES": "bucket",
        "WeightGroup": "transport",
        "PublishStats": "transport",
        "receive_stages": "transport",
        "join_groups": "transport",
        "StagePublisher": "publisher",
        "Publisher": "publisher",
        "CopyPlan": "copy_plan",
        "StreamedLoad": "copy_plan",
    },
)
