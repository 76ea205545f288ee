"""Off-policy importance weights (``old_logprob``) and their truncation (``max_weight``), by exact enumeration.

A categorical policy over a vocabulary of ``V`` tokens, ``pi = softmax(theta)`` with ``theta`` a float64
parameter, a fixed reference ``pi_ref`` and a fixed sampler ``pi_old``. Every token of the vocabulary is one
"sample": ``kl_penalty`` on the ``[V]`` vector of log-probs gives the per-sample estimate ``k(x)``, and

    E_s[value]    = sum_x s(x) k(x)
    E_s[gradient] = sum_x s(x) grad_theta k(x) = grad_theta of sum_x s(x).detach() k(x)

for the sampling distribution ``s`` (``pi_old`` off-policy, ``pi`` on-policy). The targets are exact:
``KL = sum_x pi (log pi - log pi_ref)`` and its gradient by autograd, in float64. Nothing is sampled.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.estimators import SAMPLED_ESTIMATORS, estimator_value, parse_estimator

V = 6
SAMPLED = SAMPLED_ESTIMATORS  # 'full' takes logits, not sampled log-probs
PLUS = [name for name in SAMPLED if name.endswith("+")]
EXACT_GRADIENT = ["k1", "kl", "k3", "k2", "mse", *PLUS]  # expected gradient = grad KL (with weights)
UNBIASED_VALUE = ["k1", "kl", "k3", "k1+", "kl+", "k3+"]  # expected value = KL


class Policy(NamedTuple):
    theta: torch.Tensor  # [V] float64 logits, requires grad
    ref: torch.Tensor  # [V] log pi_ref
    old: torch.Tensor  # [V] log pi_old (the sampler)


@pytest.fixture
def pol() -> Policy:
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(V, generator=g, dtype=torch.float64)
    ref = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64), 0)
    old = torch.log_softmax(theta + torch.randn(V, generator=g, dtype=torch.float64), 0)
    w = (torch.log_softmax(theta, 0) - old).exp()
    # a sampler far enough from the policy for the biases below to be visible, with weights on both
    # sides of the truncation cap used in the tests
    assert w.max() > 2.0 and w.min() < 0.5 and (w > 1.5).sum() >= 2
    return Policy(theta.requires_grad_(), ref, old)


def exact_kl(pol: Policy, reverse: bool = False) -> tuple[float, torch.Tensor]:
    """KL(pi || pi_ref) (or KL(pi_ref || pi)) and its gradient w.r.t. theta, exactly."""
    lp = torch.log_softmax(pol.theta, 0)
    if reverse:
        kl = (pol.ref.exp() * (pol.ref - lp)).sum()
    else:
        kl = (lp.exp() * (lp - pol.ref)).sum()
    (grad,) = torch.autograd.grad(kl, pol.theta)
    return kl.item(), grad


def expectation(
    pol: Policy, name: str, mode: str, max_weight: Optional[float] = None
) -> tuple[float, torch.Tensor]:
    """E[value] and E[gradient] of ``kl_penalty`` over the sampler of ``mode``.

    modes: ``on`` (sampled from pi, no old_logprob), ``on-detach`` (sampled from pi,
    old_logprob = logprob.detach()), ``off`` (sampled from pi_old, old_logprob given),
    ``off-naive`` (sampled from pi_old, no old_logprob: the bug this feature fixes).
    """
    lp = torch.log_softmax(pol.theta, 0)
    old = {"on": None, "on-detach": lp.detach(), "off": pol.old, "off-naive": None}[mode]
    sampler = lp.detach().exp() if mode.startswith("on") else pol.old.exp()
    k = lk.kl_penalty(lp, pol.ref, name, old_logprob=old, max_weight=max_weight)
    value = (sampler * k).sum()
    (grad,) = torch.autograd.grad(value, pol.theta)
    return value.item(), grad


# ---------------------------------------------------------------------------------------------
# the claims of importance_weight's docstring


@pytest.mark.parametrize("mode", ["on", "on-detach", "off"])
@pytest.mark.parametrize("name", UNBIASED_VALUE)
def test_expected_value_is_kl(pol, name, mode):
    kl, _ = exact_kl(pol)
    value, _ = expectation(pol, name, mode)
    assert value == pytest.approx(kl, rel=1e-12)


@pytest.mark.parametrize("mode", ["on-detach", "off"])
@pytest.mark.parametrize("name", EXACT_GRADIENT)
def test_expected_gradient_is_kl_gradient(pol, name, mode):
    _, grad_kl = exact_kl(pol)
    _, grad = expectation(pol, name, mode)
    assert_close(grad, grad_kl, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["k2", "mse", *PLUS])
def test_gradient_estimators_need_no_weight_on_policy(pol, name):
    _, grad_kl = exact_kl(pol)
    _, grad = expectation(pol, name, "on")
    assert_close(grad, grad_kl, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["abs", "low_var_kl"])
@pytest.mark.parametrize("mode", ["on-detach", "off"])
def test_other_value_estimators_get_the_gradient_of_their_own_expectation(pol, name, mode):
    # E_old[grad(w k)] = grad E_pi[k]: exact for the quantity they estimate, which is not the KL for abs
    lp = torch.log_softmax(pol.theta, 0)
    d = lp - pol.ref
    k = d.abs() if name == "abs" else (torch.exp(-d) + d - 1).clamp(max=10.0)
    target_value = (lp.exp() * k).sum()
    (target_grad,) = torch.autograd.grad(target_value, pol.theta)
    value, grad = expectation(pol, name, mode)
    assert value == pytest.approx(target_value.item(), rel=1e-12)
    assert_close(grad, target_grad, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# the known failures, as exact expectations (so these tests would notice a change of behaviour)


@pytest.mark.parametrize("name", ["k1", "kl"])
def test_k1_as_a_loss_on_policy_without_weights_has_zero_expected_gradient(pol, name):
    # grad k1 = grad log pi, and E_pi[grad log pi] = 0
    _, grad_kl = exact_kl(pol)
    _, grad = expectation(pol, name, "on")
    assert grad_kl.norm() > 0.1
    assert_close(grad, torch.zeros_like(grad), rtol=0, atol=1e-14)


def test_k3_as_a_loss_on_policy_without_weights_follows_the_forward_kl(pol):
    # E_pi[(1 - pi_ref/pi) grad log pi] = -sum pi_ref grad log pi = grad KL(pi_ref || pi)
    _, grad_kl = exact_kl(pol)
    _, grad_forward = exact_kl(pol, reverse=True)
    _, grad = expectation(pol, "k3", "on")
    assert_close(grad, grad_forward, rtol=1e-10, atol=1e-12)
    assert (grad - grad_kl).norm() > 0.1 * grad_kl.norm()


def test_off_policy_without_weights_is_biased(pol):
    kl, grad_kl = exact_kl(pol)
    lp = torch.log_softmax(pol.theta, 0)
    d = lp - pol.ref
    s = pol.old.exp()
    # k3 value: E_old[pi_ref/pi - 1 + d], not E_pi[...]
    value, _ = expectation(pol, "k3", "off-naive")
    assert value == pytest.approx((s * (torch.exp(-d) - 1 + d)).sum().item(), rel=1e-12)
    assert abs(value - kl) > 0.05 * kl
    # k3 gradient: E_old[(1 - e^-d) grad log pi]; k3+ gradient: E_old[d grad log pi]
    (target_k3,) = torch.autograd.grad((s * (torch.exp(-d) + d)).sum(), pol.theta, retain_graph=True)
    (target_k3p,) = torch.autograd.grad((s * d.square() / 2).sum(), pol.theta)
    for name, target in [("k3", target_k3), ("k3+", target_k3p)]:
        _, grad = expectation(pol, name, "off-naive")
        assert_close(grad, target, rtol=1e-10, atol=1e-12)
        assert (grad - grad_kl).norm() > 0.1 * grad_kl.norm(), name


@pytest.mark.parametrize("name", list(SAMPLED))
def test_per_sample_gradient_is_the_documented_one(name):
    # importance_weight's per-sample gradients: w (k + k') for a differentiable weight (k1: w (d + 1),
    # k3: w d, abs: w (|d| + sign d), low_var_kl: w (k3 + k3') inside its clamp), w d for a detached one
    # (k2 and every '+'): the other choice of detaching gives w k' or w (k + d) and fails here
    spec = parse_estimator(name)
    lp = torch.tensor([-1.0, -2.0, -0.3, -4.0, -0.7], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -0.5, -0.3, -1.0, -3.5], dtype=torch.float64)
    old = torch.tensor([-0.8, -2.4, -0.1, -3.0, -0.2], dtype=torch.float64)
    (grad,) = torch.autograd.grad(lk.kl_penalty(lp, ref, name, old_logprob=old).sum(), lp)
    d, w = lp.detach() - ref, torch.exp(lp.detach() - old)
    k3 = torch.expm1(-d) + d
    k3_prime = -torch.expm1(-d)
    per_sample = {
        "k1": w * (d + 1),
        "abs": w * (d.abs() + d.sign()),
        "k2": w * d,
        "k3": w * d,
        "low_var_kl": torch.where(k3 <= 10, w * (k3 + k3_prime), w * 10),
    }
    want = w * d if spec.straight_through else per_sample[spec.base]
    assert_close(grad, want, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# truncation: max_weight = c, w -> min(w, c)


def truncated_targets(pol: Policy, name: str, c: float) -> tuple[float, torch.Tensor]:
    """importance_weight's documented truncated expectations, written from the formula.

    m = min(pi, c pi_old); value: sum m k(d); gradient: sum m g_pi, with g_pi the on-policy per-sample
    gradient: grad(pi k) / pi = (k + k') grad log pi for a differentiable weight (k1, k3),
    d grad log pi for a detached one (k2, '+').
    """
    lp = torch.log_softmax(pol.theta, 0)
    pi, d = lp.exp(), lp - pol.ref
    m = torch.minimum(pi, c * pol.old.exp())
    base = parse_estimator(name).base
    k = {"k1": d, "k2": d.square() / 2, "k3": torch.exp(-d) - 1 + d}[base]
    value = (m * k).sum()
    if name.endswith("+") or base == "k2":
        surrogate = (m.detach() * d.square() / 2).sum()
    else:
        surrogate = ((m / pi).detach() * pi * k).sum()
    (grad,) = torch.autograd.grad(surrogate, pol.theta)
    return value.item(), grad


def on_policy_sample_gradients(pol: Policy, name: str) -> torch.Tensor:
    """[V, V]: row x is g_pi(x), the on-policy per-sample gradient of token x, in closed form."""
    lp = torch.log_softmax(pol.theta, 0).detach()
    d = lp - pol.ref
    grad_log_pi = torch.eye(V, dtype=torch.float64) - lp.exp()[None]  # softmax: e_x - pi
    coef = d + 1 if name == "k1" else d  # (k + k') for k1; d for k3 and every detached weight
    return coef[:, None] * grad_log_pi


@pytest.mark.parametrize("c", [1.0, 1.5])
@pytest.mark.parametrize("name", ["k1", "k3", "k2", "k1+", "k3+", "k2+"])
def test_truncated_expectations_follow_the_documented_formula(pol, name, c):
    value, grad = expectation(pol, name, "off", max_weight=c)
    target_value, target_grad = truncated_targets(pol, name, c)
    assert value == pytest.approx(target_value, rel=1e-12)
    assert_close(grad, target_grad, rtol=1e-10, atol=1e-12)
    # and the cap did bite: the truncated gradient is not the KL gradient
    _, grad_kl = exact_kl(pol)
    assert (grad - grad_kl).norm() > 1e-3 * grad_kl.norm()


@pytest.mark.parametrize("name", ["k1", "k3", "k3+"])
def test_truncated_gradient_in_closed_form(pol, name):
    # per clipped sample: c g_pi(x), the weight keeping its gradient; so sum_x m(x) g_pi(x)
    c = 1.5
    pi, s = torch.log_softmax(pol.theta, 0).exp().detach(), pol.old.exp()
    clipped = pi > c * s
    m = torch.where(clipped, c * s, pi)
    target = (m[:, None] * on_policy_sample_gradients(pol, name)).sum(0)
    _, grad = expectation(pol, name, "off", max_weight=c)
    assert clipped.any() and not clipped.all()
    assert_close(grad, target, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("c", [1.5, 2.0])
@pytest.mark.parametrize("name", ["k1", "k3", "k2", "k3+"])
def test_truncation_bias_is_bounded_by_the_dropped_mass(pol, name, c):
    # ||E[g] - grad KL|| <= sum_C (pi - c pi_old) max_C ||g_pi||; a plain clamp of the weight (gradient
    # 0 where it clips) breaks this bound for k1 and k3
    pi = torch.log_softmax(pol.theta, 0).exp().detach()
    excess = (pi - c * pol.old.exp()).clamp(min=0)
    clipped = excess > 0
    bound = excess.sum() * on_policy_sample_gradients(pol, name)[clipped].norm(dim=1).max()
    _, grad_kl = exact_kl(pol)
    _, grad = expectation(pol, name, "off", max_weight=c)
    assert (grad - grad_kl).norm() <= bound * (1 + 1e-9)


@pytest.mark.parametrize("name", SAMPLED)
def test_a_cap_above_every_weight_changes_nothing(pol, name):
    lp = torch.log_softmax(pol.theta, 0)
    c = (lp - pol.old).exp().max().item() * 1.01
    outs = []
    for max_weight in (None, c):
        k = lk.kl_penalty(lp, pol.ref, name, old_logprob=pol.old, max_weight=max_weight)
        (grad,) = torch.autograd.grad(k.sum(), pol.theta, retain_graph=True)
        outs.append((k, grad))
    assert_close(outs[0], outs[1], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["k1", "k3", "k3+"])
def test_on_policy_weights_are_never_clipped(pol, name):
    # c = 1 with old_logprob = logprob.detach(): log w = 0 sits on the cap, and the gradient of the
    # (differentiable) weight must still pass
    kl, grad_kl = exact_kl(pol)
    value, grad = expectation(pol, name, "on-detach", max_weight=1.0)
    assert value == pytest.approx(kl, rel=1e-12)
    assert_close(grad, grad_kl, rtol=1e-10, atol=1e-12)


def test_truncation_keeps_far_drifted_tokens_finite():
    logprob = torch.tensor([-0.1, -1.0], requires_grad=True)
    old = torch.tensor([-500.0, -1.0])  # w = e^499.9 overflows float32
    ref = torch.tensor([-0.5, -2.0])
    k = lk.kl_penalty(logprob, ref, "k3", old_logprob=old, max_weight=4.0)
    k.sum().backward()
    d = 0.4
    assert_close(k[0], torch.tensor(4.0 * (math.exp(-d) + d - 1)))
    assert_close(logprob.grad[0], torch.tensor(4.0 * d))  # c (k3 + k3') = c d: the weight keeps its gradient
    assert torch.isfinite(logprob.grad).all()


def test_truncation_under_a_mask():
    logprob = torch.tensor([[-1.0, -2.0, float("nan")]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -3.0]])
    old = torch.tensor([[-3.0, -2.5, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    k = lk.kl_penalty(logprob, ref, "k3+", mask=mask, old_logprob=old, max_weight=2.0)
    k.sum().backward()
    w = torch.tensor([min(math.exp(2.0), 2.0), math.exp(0.5)])
    d = torch.tensor([0.5, -1.0])
    assert_close(k[0, :2], w * (torch.exp(-d) + d - 1))
    assert_close(logprob.grad[0], torch.cat([w * d, torch.zeros(1)]))
    assert k[0, 2].item() == 0.0


def test_loss_forwards_max_weight(pol):
    lp = torch.log_softmax(pol.theta, 0)[None]
    old, ref = pol.old[None], pol.ref[None]
    loss_fn = lk.KLPenaltyLoss("k3", coef=1.0, agg="token-sum", max_weight=1.5)
    assert loss_fn.max_weight == 1.5 and "max_weight=1.5" in repr(loss_fn)
    loss = loss_fn(lp, ref, old_logprob=old)
    target = lk.kl_penalty(lp, ref, "k3", old_logprob=old, max_weight=1.5).sum()
    unclipped = lk.kl_penalty(lp, ref, "k3", old_logprob=old).sum()
    assert_close(loss, target, rtol=1e-12, atol=0)
    assert abs(loss.item() - unclipped.item()) > 1e-3
    grads = [torch.autograd.grad(x, pol.theta, retain_graph=True)[0] for x in (loss, target)]
    assert_close(grads[0], grads[1], rtol=1e-12, atol=0)
    # without old_logprob there is nothing to truncate
    assert_close(loss_fn(lp, ref), lk.kl_penalty(lp, ref, "k3").sum())


@pytest.mark.parametrize("bad", [0.5, 0, -1.0, float("inf"), float("nan"), True, "2"])
def test_bad_max_weight_fails_at_construction(bad):
    with pytest.raises(ValueError, match=r"`max_weight` must be None .* or a finite number >= 1"):
        lk.KLPenaltyLoss("k3", max_weight=bad)
    lp = torch.zeros(3)
    with pytest.raises(ValueError, match=r"`max_weight`.*got " + repr(bad).replace("(", r"\(")):
        lk.kl_penalty(lp, lp, "k3", old_logprob=lp, max_weight=bad)
