"""Two numeric edges, each checked on the small-input composition and on the fused path.

1. A *valid* token with a non-finite log-ratio (``ref_logprob = -inf``: the reference gives the
   sampled token no mass). Documented meaning (lightning_kl.estimators): a ``NAME+`` value is NaN
   there (its gradient ``d`` is infinite, and a finite value would hide it from the loss), a base
   estimator keeps its own value (``k3`` clamps ``d``: 19 at ``d = +inf``, with a zero gradient).
   Both paths give it, at 4 elements and at 70,000 (above one chunk: fused).
2. ``k3`` with ``old_logprob``: the gradient ``w * d`` without the float32 cancellation for ``d < -12``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.estimators import BASE_ESTIMATORS, parse_estimator
from lightning_kl.kernels import fused

# gradients toward the reference are checked here on purpose: its warning is expected
pytestmark = pytest.mark.filterwarnings("ignore:`ref_[a-z]*` requires grad")

NAMES = [b for b in BASE_ESTIMATORS] + [f"{b}+" for b in BASE_ESTIMATORS]
SMALL, LARGE = 4, 70_000
INF, NAN = float("inf"), float("nan")
# (logprob, ref_logprob) at the edge position: d = +inf, -inf, NaN
EDGES = {"ref=-inf": (-1.0, -INF), "logprob=-inf": (-INF, -1.0), "nan": (-1.0, NAN)}


def _k3_f32(c: float) -> float:
    c32 = torch.tensor(c)
    return float(torch.expm1(-c32) + c32)


# the documented value of each base estimator at d = +inf, -inf, NaN (float32)
BASE_VALUE = {
    "k1": (INF, -INF, NAN),
    "abs": (INF, INF, NAN),
    "k2": (INF, INF, NAN),
    "k3": (_k3_f32(20.0), _k3_f32(-20.0), NAN),
    "low_var_kl": (10.0, 10.0, NAN),
}


def _edge(name: str, n: int, edge: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Value and gradient w.r.t. logprob at the edge position (index 2) of an n-element input."""
    g = torch.Generator().manual_seed(n)
    logprob = -torch.rand(n, generator=g) * 3
    ref = -torch.rand(n, generator=g) * 3
    logprob[2], ref[2] = EDGES[edge]
    mask = torch.ones(n, dtype=torch.bool)
    mask[3] = False  # a padded position next to it stays out of everything
    ref[3] = NAN
    logprob.requires_grad_()
    assert fused.use_fused(parse_estimator(name), logprob) == (n == LARGE)
    value = lk.kl_penalty(logprob, ref, name, mask=mask)
    value.backward(torch.ones_like(value))
    assert value[3] == 0 and logprob.grad[3] == 0
    return value[2].detach(), logprob.grad[2]


@pytest.mark.parametrize("edge", list(EDGES))
@pytest.mark.parametrize("name", NAMES)
def test_non_finite_log_ratio_means_the_same_on_both_paths(name: str, edge: str) -> None:
    small_value, small_grad = _edge(name, SMALL, edge)
    large_value, large_grad = _edge(name, LARGE, edge)
    spec = parse_estimator(name)
    want = NAN if spec.straight_through else BASE_VALUE[spec.base][list(EDGES).index(edge)]
    for value in (small_value, large_value):
        assert_close(value, torch.tensor(want), equal_nan=True, rtol=0, atol=0)
    assert_close(large_grad, small_grad, equal_nan=True, rtol=0, atol=0)


def test_a_reference_without_mass_makes_the_plus_loss_nan_on_both_paths() -> None:
    # the issue's case: k3+ gave NaN on 4 elements and 19.0 on 70,000
    for n in (SMALL, LARGE):
        logprob = torch.full((n,), -1.0, requires_grad=True)
        ref = torch.full((n,), -1.5)
        ref[0] = -INF
        loss = lk.KLPenaltyLoss("k3+")(logprob, ref)
        assert torch.isnan(loss)
        loss.backward()
        assert torch.isnan(logprob.grad).all()  # every valid gradient, so detect_anomaly sees it


def _off_policy_grad(d: float, n: int, dtype: torch.dtype, max_weight: float | None = None) -> tuple[float, float]:
    """(gradient w.r.t. logprob at position 0, w * d in float64 from the dtype's own inputs)."""
    logprob = torch.full((n,), -30.0, dtype=dtype)  # log-probs: every input <= 0
    ref = logprob - d
    old = logprob + 0.1  # w = e^-0.1
    logprob.requires_grad_()
    lk.kl_penalty(logprob, ref, "k3", old_logprob=old, max_weight=max_weight).sum().backward()
    lp64, ref64, old64 = (t.detach()[0].double() for t in (logprob, ref, old))
    log_w = float(lp64 - old64)
    w = math.exp(min(log_w, math.log(max_weight)) if max_weight else log_w)
    d64 = float(lp64 - ref64)
    c = min(max(d64, -20.0), 20.0)
    # inside the clamp the exact gradient is w * d; outside, c is constant and only w moves: w * k3(c)
    exact = w * d64 if abs(d64) <= 20 else w * (math.expm1(-c) + c)
    return float(logprob.grad[0]), exact


@pytest.mark.parametrize("n", [SMALL, LARGE])
@pytest.mark.parametrize("d", [-25.0, -20.0, -19.5, -18.0, -15.0, -12.0, -5.0, -0.01, 0.5, 7.0, 25.0])
def test_off_policy_k3_gradient_is_w_times_d_in_float32(d: float, n: int) -> None:
    got, exact = _off_policy_grad(d, n, torch.float32)
    assert got == pytest.approx(exact, rel=2e-6, abs=1e-7)
    got64, exact64 = _off_policy_grad(d, n, torch.float64)
    assert got64 == pytest.approx(exact64, rel=1e-13, abs=1e-15)


def test_off_policy_k3_the_issue_numbers_and_truncation() -> None:
    # the product rule in float32 gave -12.0 and -32.0 here
    assert _off_policy_grad(-18.0, SMALL, torch.float32)[0] == pytest.approx(-16.2871, abs=1e-4)
    assert _off_policy_grad(-20.0, SMALL, torch.float32)[0] == pytest.approx(-18.0967, abs=1e-4)
    # a truncated weight (w = e^2 capped at 2) keeps its straight-through gradient: 2 * d
    logprob = torch.full((3,), -30.0, requires_grad=True)
    ref, old = logprob.detach() + 18.0, logprob.detach() - 2.0
    lk.kl_penalty(logprob, ref, "k3", old_logprob=old, max_weight=2.0).sum().backward()
    assert_close(logprob.grad, torch.full((3,), 2.0 * -18.0))


def test_off_policy_k3_value_and_other_gradients_are_the_products() -> None:
    # value w * k3(d) and the gradients w.r.t. logprob and ref, against float64 autograd of the product
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(2, 6, generator=g, dtype=torch.float64) * 3 - 25
    ref = lp - torch.linspace(-22, 22, 12, dtype=torch.float64).reshape(2, 6)
    old = lp + 0.3 * torch.randn(2, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 5] = False
    # the sampler's old_logprob is a constant (one that requires grad is detached, with a warning)
    ins = [t.clone().requires_grad_() for t in (lp, ref)]
    got = lk.kl_penalty(*ins, "k3", old_logprob=old, mask=mask)
    got_grads = torch.autograd.grad(got.sum(), ins)
    want_ins = [t.clone().requires_grad_() for t in (lp, ref)]
    d = want_ins[0] - want_ins[1]
    c = d.clamp(-20, 20)
    want = torch.where(mask, torch.exp(want_ins[0] - old) * (torch.exp(-c) + c - 1), 0.0)
    want_grads = torch.autograd.grad(want.sum(), want_ins)
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        # the float64 product rule itself cancels at d = -20 (relative error ~ 1e-16 e^20 / 20)
        assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_fused_low_var_kl_gradient_where_k3_is_exactly_ten(monkeypatch: pytest.MonkeyPatch) -> None:
    # the clamp's gradient includes its ends: at k3 = 10.0 exactly the gradient is 1 - e^-d, not 0
    d = torch.tensor(10.999982833862305)
    assert float(torch.expm1(-d) + d) == 10.0
    logprob = torch.full((LARGE,), -5.0)
    ref = logprob - torch.linspace(-3, 3, LARGE)
    ref[5] = logprob[5] - d
    grads = []
    for enabled in (True, False):
        monkeypatch.setattr(fused, "ENABLED", enabled)
        lp = logprob.clone().requires_grad_()
        lk.kl_penalty(lp, ref, "low_var_kl").sum().backward()
        grads.append(lp.grad)
    assert grads[0][5] == grads[1][5] == -torch.expm1(-(logprob[5] - ref[5]))
    assert_close(grads[0], grads[1])
