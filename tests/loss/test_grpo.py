"""GRPO advantages and the PPO-clip loss with truncated importance weights."""

import numpy as np
import pytest
import torch

from streamrl.loss.grpo import grpo_advantages, policy_loss


def test_advantages_are_group_normalised() -> None:
    adv = grpo_advantages(np.array([0.0, 1.0, 1.0, 0.0], np.float32))
    np.testing.assert_allclose(adv, [-1, 1, 1, -1], atol=1e-5)
    assert np.all(grpo_advantages(np.full(4, 0.3, np.float32)) == 0)


def test_gradient_raises_logprob_of_positive_advantage_tokens() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = policy_loss(
        logp,
        logp.detach(),
        logp.detach(),
        torch.tensor([[1.0, -1.0]]),
        torch.tensor([[0.5, 0.5]]),
        clip_eps=0.2,
        importance_cap=2.0,
    )
    loss.backward()
    assert logp.grad[0, 0] < 0 < logp.grad[0, 1]  # descent raises token 0, lowers token 1
    assert stats.tokens == 2 and stats.truncated == 0


def test_importance_weight_is_truncated_at_cap() -> None:
    logp = torch.tensor([[-0.1, -0.1]], requires_grad=True)
    behaviour = torch.tensor([[-5.0, -0.1]])  # token 0 was far less likely under the stale engine
    loss, stats = policy_loss(
        logp, logp.detach(), behaviour, torch.ones(1, 2), torch.tensor([[1.0, 1.0]]), clip_eps=0.2, importance_cap=2.0
    )
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), [[-2.0, -1.0]], rtol=1e-6)
    assert stats.truncated == 1 and stats.importance_weight == 3.0


def test_padding_and_prompt_positions_do_not_contribute() -> None:
    logp = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    loss, stats = policy_loss(
        logp,
        logp.detach(),
        torch.zeros(1, 2),
        torch.ones(1, 2),
        torch.tensor([[1.0, 0.0]]),
        clip_eps=0.2,
        importance_cap=2.0,
    )
    loss.backward()
    assert logp.grad[0, 1] == 0 and stats.tokens == 1


def test_constant_groups_get_exactly_zero_advantages() -> None:
    # 128 equal rewards of the symbols task's k/12 kind: float32 rounding of the mean used to leave |A| up to 0.1.
    for value in (5 / 12, 7 / 12, 0.1, 1.0):
        rewards = np.full(128, value, np.float32)
        for std in ("unbiased", "population", "none"):
            assert np.all(grpo_advantages(rewards, std) == 0.0), (value, std)


def test_advantage_scales() -> None:
    rewards = np.array([0.0, 1.0, 1.0, 1.0], np.float32)
    centred = rewards - rewards.mean()
    np.testing.assert_allclose(grpo_advantages(rewards, "none"), centred, rtol=1e-6)
    np.testing.assert_allclose(grpo_advantages(rewards, "population"), centred / rewards.std(), rtol=1e-5)
    np.testing.assert_allclose(grpo_advantages(rewards, "unbiased"), centred / rewards.std(ddof=1), rtol=1e-5)
    with pytest.raises(ValueError, match="loss.std"):
        grpo_advantages(rewards, "median")


def _row() -> dict[str, torch.Tensor]:
    """A packed row of two sequences ({0, 1} and {2}) whose ratios fall inside and outside the clip range."""
    return {
        "logp": torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True),
        "old": torch.tensor([[-1.2, -0.6, -1.5]]),
        "adv": torch.tensor([[0.8, 0.8, -1.5]]),
        "weight": torch.tensor([[0.25, 0.25, 0.5]]),
        "cu": torch.tensor([0, 2, 3]),
    }


def _grad(surrogate: str, row: dict[str, torch.Tensor], eps: float = 0.2) -> torch.Tensor:
    loss, _ = policy_loss(row["logp"], row["old"], row["old"], row["adv"], row["weight"], eps, 2.0, "tis",
                          "token", row["cu"], surrogate)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, row["logp"])
    return grad


@pytest.mark.parametrize("surrogate", ["ppo", "gspo", "cispo"])
def test_each_surrogate_matches_its_hand_written_gradient(surrogate: str) -> None:
    row, eps = _row(), 0.2
    logp, old, adv, weight = row["logp"], row["old"], row["adv"], row["weight"]
    # The same objectives written out term by term (pi_old == pi_behaviour, so every importance weight is 1).
    if surrogate == "ppo":
        r = torch.exp(logp - old)
        reference = -(torch.minimum(r * adv, r.clamp(1 - eps, 1 + eps) * adv) * weight).sum()
    elif surrogate == "gspo":
        s1 = torch.exp(((logp[0, 0] - old[0, 0]) + (logp[0, 1] - old[0, 1])) / 2)
        s2 = torch.exp(logp[0, 2] - old[0, 2])
        term1 = -torch.minimum(s1 * adv[0, 0], s1.clamp(1 - eps, 1 + eps) * adv[0, 0])
        term2 = -torch.minimum(s2 * adv[0, 2], s2.clamp(1 - eps, 1 + eps) * adv[0, 2])
        reference = term1 * (weight[0, 0] + weight[0, 1]) + term2 * weight[0, 2]
    else:
        r = torch.exp(logp - old).detach()
        reference = -(r.clamp(max=1 + eps) * adv * logp * weight).sum()
    (expected,) = torch.autograd.grad(reference, logp)
    torch.testing.assert_close(_grad(surrogate, _row(), eps), expected)


def test_gspo_clips_a_sequence_whole_and_cispo_keeps_every_gradient() -> None:
    row = _row()
    row["old"] = torch.tensor([[-2.0, -1.5, -2.05]])  # sequence 1: ratio e^1, clipped (A > 0); sequence 2: e^0.05
    gspo = _grad("gspo", row)
    assert gspo[0, 0] == 0 and gspo[0, 1] == 0 and gspo[0, 2] != 0  # the whole sequence is clipped
    cispo = _grad("cispo", _row() | {"old": row["old"]})
    assert torch.all(cispo != 0)  # clipping only bounds the weight of each token's gradient
