"""The in-job parity check's choice of tokens: with `whole_responses` (engines keeping their KV across versions) a
response begun under an older version does not count, even its tokens sampled under the checked version."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl.learner.parity import ParityCheck, ParityError, first_versions
from streamrl.types import MicroBatch


def _packed(versions: list[list[int]], gaps: list[list[float]]) -> tuple[MicroBatch, torch.Tensor]:
    """One row of sequences, each a prompt position then its response; the learner's log-probs are the behaviour's
    plus `gaps`."""
    rows = {key: [] for key in ("versions", "weight", "behaviour", "learner")}
    for seq_versions, seq_gaps in zip(versions, gaps, strict=True):
        rows["versions"] += [-1, *seq_versions]
        rows["weight"] += [0.0] + [1.0] * len(seq_versions)
        rows["behaviour"] += [0.0] + [-1.0] * len(seq_versions)
        rows["learner"] += [0.0] + [-1.0 + gap for gap in seq_gaps]
    total = len(rows["versions"])
    cu_seqlens = np.concatenate([[0], np.cumsum([1 + len(v) for v in versions])]).astype(np.int32)
    zeros = np.zeros((1, total), np.int64)
    mb = MicroBatch(
        input_ids=zeros,
        labels=zeros,
        position_ids=zeros,
        loss_weight=np.array([rows["weight"]], np.float32),
        advantages=np.zeros((1, total), np.float32),
        behaviour_logprobs=np.array([rows["behaviour"]], np.float32),
        behaviour_versions=np.array([rows["versions"]], np.int32),
        cu_seqlens=cu_seqlens,
    )
    return mb, torch.tensor([rows["learner"]])


def test_first_versions_marks_each_position_with_its_response_start() -> None:
    mb, _ = _packed([[1, 1], [0, 1, 2], []], [[0, 0], [0, 0, 0], []])
    assert first_versions(mb).tolist() == [[1, 1, 1, 0, 0, 0, 0, -1]]


def test_whole_responses_leaves_out_a_response_begun_under_an_older_version(tp1_world: None) -> None:
    # Response A is wholly version 1 and matches; response B began under version 0 and its version-1 tokens, sampled
    # over version 0's KV, are far from the learner's.
    mb, learner = _packed([[1, 1, 1], [0, 1, 1]], [[0.0, 0.0, 0.0], [0.0, 5.0, 5.0]])
    with pytest.raises(ParityError, match="5 tokens sampled with version 1"):
        ParityCheck(1, 0.1).measure({id(mb): learner}, [mb], 1, torch.device("cpu"))
    metrics = ParityCheck(1, 0.1, whole_responses=True).measure({id(mb): learner}, [mb], 1, torch.device("cpu"))
    assert metrics == {
        "rollout_corr/parity_abs_mean": 0.0,
        "rollout_corr/parity_abs_max": 0.0,
        "rollout_corr/parity_tokens": 3.0,
    }
