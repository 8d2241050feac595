"""Off-policy correction variants at token and sequence level."""

import math

import pytest
import torch

from streamrl.loss.grpo import policy_loss
from streamrl.loss.importance import importance_weights, sequence_sums

MASK = torch.tensor([[True, True, True]])
LOG_RATIO = torch.tensor([[math.log(4.0), math.log(0.5), 0.0]])  # pi_old / pi_behaviour = 4, 0.5, 1


@pytest.mark.parametrize(
    ("variant", "expected", "capped"),
    [
        ("tis", [2.0, 0.5, 1.0], [True, False, False]),
        ("mis", [0.0, 0.5, 1.0], [True, False, False]),
        ("decoupled", [4.0, 0.5, 1.0], [False, False, False]),
        ("ppo_behaviour", [1.0, 1.0, 1.0], [False] * 3),
    ],
)
def test_token_level_variants(variant: str, expected: list[float], capped: list[bool]) -> None:
    weights, over = importance_weights(LOG_RATIO, MASK, variant, cap=2.0, level="token", cu_seqlens=None)
    torch.testing.assert_close(weights, torch.tensor([expected]))
    assert over.tolist() == [capped]


def test_sequence_level_weights_are_constant_per_sequence() -> None:
    cu_seqlens = torch.tensor([0, 2, 3])  # sequences {0, 1} and {2}
    assert sequence_sums(torch.tensor([[1.0, 2.0, 5.0]]), cu_seqlens).tolist() == [[3.0, 3.0, 5.0]]
    weights, over = importance_weights(LOG_RATIO, MASK, "tis", cap=3.0, level="sequence", cu_seqlens=cu_seqlens)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 2.0, 1.0]]))  # 4 * 0.5 = 2 for the first sequence
    assert not over.any()
    with pytest.raises(ValueError, match="importance_level"):
        importance_weights(LOG_RATIO, MASK, "tis", 2.0, "sequence", None)


def test_masked_tokens_get_no_gradient_and_plain_ppo_clips_against_behaviour() -> None:
    logp = torch.tensor([[-0.1, -0.1]], requires_grad=True)
    behaviour = torch.tensor([[-3.0, -0.1]])  # token 0: pi/pi_behaviour = e^2.9, far outside the clip range
    weight, advantages = torch.tensor([[0.5, 0.5]]), torch.ones(1, 2)
    loss, stats = policy_loss(logp, logp.detach(), behaviour, advantages, weight, 0.2, 2.0, variant="mis")
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] < 0 and stats.truncated == 1
    logp.grad = None
    loss, stats = policy_loss(logp, logp.detach(), behaviour, advantages, weight, 0.2, 2.0, variant="ppo_behaviour")
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] < 0 and stats.clipped == 1  # clipped: no gradient


def test_unknown_variant_is_refused() -> None:
    with pytest.raises(ValueError, match="loss.policy_loss"):
        importance_weights(LOG_RATIO, MASK, "vtrace", 2.0, "token", None)
