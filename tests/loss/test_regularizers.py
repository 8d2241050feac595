"""KL estimators to the reference policy and the entropy bonus, against exact categorical distributions."""

import pytest
import torch

from streamrl.loss.regularizers import kl_estimate, regularization_loss


def _policies() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.log_softmax(torch.randn(12, generator=gen, dtype=torch.float64), 0),
        torch.log_softmax(torch.randn(12, generator=gen, dtype=torch.float64), 0),
    )


def test_k1_and_k3_are_unbiased_estimates_of_the_kl() -> None:
    logp, ref_logp = _policies()  # every token of the vocabulary, weighted below by its probability under pi
    exact = (logp.exp() * (logp - ref_logp)).sum()
    for estimator in ("k1", "k3"):
        expected = (logp.exp() * kl_estimate(logp, ref_logp, estimator)).sum()
        assert float(expected) == pytest.approx(float(exact), rel=1e-12), estimator
    k2 = kl_estimate(logp, ref_logp, "k2")
    assert (k2 >= 0).all() and (kl_estimate(logp, ref_logp, "k3") >= 0).all()
    torch.testing.assert_close(k2, 0.5 * (ref_logp - logp) ** 2)


def test_k3_gradient_pulls_towards_the_reference_and_never_overflows() -> None:
    logp = torch.tensor([-1.0, -3.0, -200.0], dtype=torch.float64, requires_grad=True)
    ref_logp = torch.tensor([-2.0, -1.0, -0.5], dtype=torch.float64)
    kl = kl_estimate(logp, ref_logp, "k3")
    kl.sum().backward()
    r = ref_logp - logp.detach()
    torch.testing.assert_close(logp.grad[:2], 1.0 - r.exp()[:2])  # d/dlogp [e^r - r - 1] = 1 - e^r
    assert logp.grad[0] > 0 > logp.grad[1]  # descent lowers tokens the reference finds less likely, raises others
    assert torch.isfinite(kl).all() and float(kl[2]) == pytest.approx(float(torch.exp(torch.tensor(20.0)) - 21))
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref_logp, "k4")


def test_terms_are_weighted_like_the_policy_loss_and_counted_on_response_tokens() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    entropy = torch.tensor([[0.7, 1.5, 2.0]], requires_grad=True)
    ref_logp = torch.tensor([[-1.5, -2.0, -9.0]])
    weight = torch.tensor([[0.25, 0.5, 0.0]])  # the last position is a prompt token
    loss, stats = regularization_loss(logp, weight, entropy, ref_logp, entropy_coef=0.1, kl_coef=0.2, kl_estimator="k1")
    loss.backward()
    assert float(loss) == pytest.approx(-0.1 * (0.7 * 0.25 + 1.5 * 0.5) + 0.2 * (0.5 * 0.25 + 0.0))
    torch.testing.assert_close(entropy.grad, -0.1 * weight)  # the bonus raises entropy where tokens count
    torch.testing.assert_close(logp.grad, 0.2 * weight)  # k1 = logp - ref_logp
    assert stats.entropy == pytest.approx(2.2) and stats.kl_ref == pytest.approx(0.5)
    none, empty = regularization_loss(logp, weight, None, None, entropy_coef=0.1, kl_coef=0.2)
    assert float(none) == 0.0 and empty.entropy == empty.kl_ref == 0.0
