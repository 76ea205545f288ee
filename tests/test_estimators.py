"""Values and gradients of every estimator name against float64 maths written from the estimator table (docs/estimators.md)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.estimators import BASE_ESTIMATORS, ESTIMATORS, SAMPLED_ESTIMATORS, parse_estimator

# gradients toward the reference are checked here on purpose: its warning is expected
pytestmark = pytest.mark.filterwarnings("ignore:`ref_[a-z]*` requires grad")

SAMPLED = SAMPLED_ESTIMATORS
BASES = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "low_var_kl"}


def ref_value_and_grad(base: str, d: float) -> tuple[float, float]:
    """Value and d(value)/d(logprob) of a base estimator, in plain float64 Python maths."""
    if base == "k1":
        return d, 1.0
    if base == "abs":
        return abs(d), (d > 0) - (d < 0)
    if base == "k2":
        return d * d / 2, d
    c = min(max(d, -20.0), 20.0)  # k3 of the clamped log-ratio; its derivative is 0 outside the clamp
    k3 = math.exp(-c) + c - 1
    g3 = 1 - math.exp(-d) if -20 < d < 20 else 0.0
    if base == "k3":
        return k3, g3
    if base == "low_var_kl":
        return (min(k3, 10.0), g3 if k3 < 10 else 0.0)
    raise AssertionError(base)


def reference(name: str, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    plus = name.endswith("+")
    base = BASES[name.rstrip("+")]
    vals, grads = zip(*(ref_value_and_grad(base, x) for x in d.tolist()))
    grads = d.tolist() if plus else grads  # '+': the k2 gradient
    return torch.tensor(vals, dtype=torch.float64), torch.tensor(grads, dtype=torch.float64)


@pytest.fixture
def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logprob = -torch.rand(64, generator=g, dtype=torch.float64) * 6
    ref = -torch.rand(64, generator=g, dtype=torch.float64) * 6
    # far-drifted tokens, inside and outside every clamp
    logprob[:6] = torch.tensor([-0.1, -30.0, -1.0, -25.0, -4.0, -0.5], dtype=torch.float64)
    ref[:6] = torch.tensor([-28.0, -0.2, -6.0, -1.0, -0.3, -3.9], dtype=torch.float64)
    return logprob, ref


def test_estimator_names():
    assert set(BASE_ESTIMATORS) == {"k1", "abs", "k2", "k3", "low_var_kl"}
    for name in BASES:
        assert name in ESTIMATORS and f"{name}+" in ESTIMATORS
    assert len(set(ESTIMATORS)) == len(ESTIMATORS)


@pytest.mark.parametrize("name", SAMPLED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_and_gradients_match_formula(name, dtype, inputs):
    logprob64, ref64 = inputs
    logprob = logprob64.to(dtype).requires_grad_()
    ref = ref64.to(dtype).requires_grad_()
    out = lk.kl_penalty(logprob, ref, name)
    assert out.shape == logprob.shape and out.dtype == dtype
    out.sum().backward()
    d = logprob.detach().double() - ref.detach().double()
    want_value, want_grad = reference(name, d)
    tol = {} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    assert_close(out.detach().double(), want_value, **tol)
    assert_close(logprob.grad.double(), want_grad, **tol)
    assert_close(ref.grad.double(), -want_grad, **tol)


@pytest.mark.parametrize("base", [n for n in BASES])
def test_plus_variant_is_base_value_with_k2_gradient(base, inputs):
    """The regression test for the bug that started this project: every '+' name works."""
    logprob64, ref64 = inputs
    lp_plus, lp_k2 = logprob64.clone().requires_grad_(), logprob64.clone().requires_grad_()
    plus = lk.kl_penalty(lp_plus, ref64, f"{base}+")
    value = lk.kl_penalty(logprob64, ref64, base)
    k2 = lk.kl_penalty(lp_k2, ref64, "k2")
    assert_close(plus.detach(), value, rtol=0, atol=0)
    plus.sum().backward()
    k2.sum().backward()
    assert_close(lp_plus.grad, lp_k2.grad, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["k3+", "k1", "low_var_kl+"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_computed_in_float32(name, dtype, inputs):
    logprob64, ref64 = inputs
    logprob = logprob64[6:].to(dtype).requires_grad_()
    ref = ref64[6:].to(dtype)
    out = lk.kl_penalty(logprob, ref, name)
    assert out.dtype == dtype
    out.float().sum().backward()
    assert logprob.grad.dtype == dtype
    # within half an ulp of the exact answer for the half-precision values: the rounding of the
    # final cast alone (maths done in the half dtype would be several ulps off)
    d = logprob.detach().double() - ref.double()
    want_value, want_grad = reference(name, d)
    half_ulp = torch.finfo(dtype).eps / 2 * (1 + 1e-3)
    assert_close(out.double(), want_value, rtol=half_ulp, atol=1e-7)
    assert_close(logprob.grad.double(), want_grad, rtol=half_ulp, atol=1e-7)


@pytest.mark.parametrize(
    "bad, hint",
    [("k4", None), ("k3++", "'k3+'"), ("+", None), ("", None), ("K3+", "'k3+'"), ("low_var", "'low_var_kl'")],
)
def test_unknown_name_lists_valid_names_and_suggests(bad, hint):
    with pytest.raises(ValueError) as err:
        parse_estimator(bad)
    msg = str(err.value)
    assert repr(bad) in msg
    for name in ESTIMATORS:
        assert repr(name) in msg
    if hint is not None:
        assert f"Did you mean {hint}?" in msg
    else:
        assert bad == "" or "Did you mean" in msg


@pytest.mark.parametrize("bad", [None, 3, ["k3"], b"k3"])
def test_non_string_name_is_rejected(bad):
    with pytest.raises(ValueError, match="must be a string"):
        parse_estimator(bad)


@pytest.mark.parametrize("build", [lambda n: lk.KLPenaltyLoss(n), lambda n: lk.KLRewardCallback(n)])
def test_bad_name_fails_at_construction(build):
    with pytest.raises(ValueError, match="Valid names"):
        build("k3 +")


def test_kl_penalty_checks_inputs():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"logprob \(2, 3\) and ref_logprob \(3, 2\)"):
        lk.kl_penalty(a, torch.zeros(3, 2), "k1")
    with pytest.raises(ValueError, match=r"mask \(2,\) and logprob \(2, 3\)"):
        lk.kl_penalty(a, a, "k1", mask=torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="floating point"):
        lk.kl_penalty(a.long(), a, "k1")
    with pytest.raises(TypeError, match="torch.Tensor"):
        lk.kl_penalty([0.0], a, "k1")


@pytest.mark.parametrize("name", SAMPLED)
def test_mask_zeroes_value_and_gradient_whatever_the_padding_holds(name):
    logprob = torch.tensor([-1.0, float("nan"), float("inf"), -1e10, -2.0], requires_grad=True)
    ref = torch.tensor([-2.0, -1.0, float("-inf"), 0.0, float("nan")], requires_grad=True)
    mask = torch.tensor([True, False, False, False, False])
    out = lk.kl_penalty(logprob, ref, name, mask=mask)
    want_value, want_grad = reference(name, torch.tensor([1.0], dtype=torch.float64))
    assert_close(out, torch.tensor([want_value.item(), 0, 0, 0, 0]), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    assert_close(logprob.grad, torch.tensor([want_grad.item(), 0, 0, 0, 0]), rtol=1e-6, atol=1e-6)
    assert_close(ref.grad, torch.tensor([-want_grad.item(), 0, 0, 0, 0]), rtol=1e-6, atol=1e-6)
