"""The micro-batch objective: the policy loss plus the configured regularisers, nothing else."""

import numpy as np
import pytest
import torch

from streamrl.config import LossConfig
from streamrl.loss.grpo import policy_loss
from streamrl.loss.objective import microbatch_objective
from streamrl.loss.regularizers import regularization_loss
from streamrl.types import MicroBatch


def _microbatch() -> MicroBatch:
    ids = np.array([[3, 4, 5, 6]], np.int64)
    row = lambda *values: np.array([values], np.float32)  # noqa: E731
    return MicroBatch(
        ids,
        ids,
        np.arange(4)[None],
        row(0, 0.5, 0.25, 0.25),
        row(0, 1.0, 1.0, -1.0),
        row(0, -0.9, -2.5, -0.1),
        np.array([[-1, 0, 0, 0]], np.int32),
        np.array([0, 2, 4], np.int32),
    )


def test_objective_adds_the_configured_terms_to_the_policy_loss() -> None:
    mb = _microbatch()
    logp = torch.tensor([[-0.3, -1.0, -2.0, -0.2]], requires_grad=True)
    entropy, ref_logp = torch.tensor([[1.0, 2.0, 0.5, 0.1]]), torch.tensor([[-1.0, -0.5, -2.5, -0.4]])
    cfg = LossConfig(entropy_coef=0.05, kl_coef=0.3, kl_estimator="k2", policy_loss="mis")
    loss, stats, regularizers = microbatch_objective(cfg, logp, mb, entropy, ref_logp)
    as_t = torch.from_numpy
    expected, expected_stats = policy_loss(
        logp,
        logp.detach(),
        as_t(mb.behaviour_logprobs),
        as_t(mb.advantages),
        as_t(mb.loss_weight),
        cfg.clip_eps,
        cfg.importance_cap,
        "mis",
        "token",
        as_t(mb.cu_seqlens),
    )
    extra, expected_regularizers = regularization_loss(logp, as_t(mb.loss_weight), entropy, ref_logp, 0.05, 0.3, "k2")
    assert float(loss) == pytest.approx(float(expected + extra)) and float(extra) != 0.0
    assert stats == expected_stats and regularizers == expected_regularizers
    plain, _, none = microbatch_objective(LossConfig(policy_loss="mis"), logp, mb)
    assert float(plain) == pytest.approx(float(expected)) and none.entropy == none.kl_ref == 0.0
