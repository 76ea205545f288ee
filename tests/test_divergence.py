"""The pointwise divergences (lightning_kl.kernels.divergence) against float64 formulas written out."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_kl.kernels.divergence import DIVERGENCES, check_divergence, divergence, pointwise


def _kl(a, b):  # KL(a || b) of two float64 probability rows, 0 log 0 = 0
    return sum(x * (math.log(x) - math.log(y)) if x > 0 else 0.0 for x, y in zip(a, b))


def _expected(p, q, name, beta):
    if name == "reverse" or (name == "jsd" and beta == 1.0):
        return _kl(p, q)
    if name == "forward" or (name == "jsd" and beta == 0.0):
        return _kl(q, p)
    if name == "mixed":
        return (1 - beta) * _kl(q, p) + beta * _kl(p, q)
    m = [(1 - beta) * a + beta * b for a, b in zip(p, q)]
    return beta * _kl(q, m) + (1 - beta) * _kl(p, m)


CASES = [("reverse", None), ("forward", None), ("jsd", 0.0), ("jsd", 0.3), ("jsd", 0.5), ("jsd", 1.0), ("mixed", 0.0), ("mixed", 0.25), ("mixed", 1.0)]


@pytest.mark.parametrize("name,beta", CASES)
def test_values_and_gradients_match_the_formulas(name, beta):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    zq = torch.randn(5, 7, generator=g, dtype=torch.float64)
    z2 = z.detach().clone().requires_grad_(True)
    lp, lq = z.log_softmax(-1), zq.log_softmax(-1)
    value = divergence(lp, lq, name, beta)
    for r in range(5):
        want = _expected(lp[r].exp().tolist(), lq[r].exp().tolist(), name, beta)
        assert value[r].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
    # the analytic gradient g - p sum(g) equals autograd's
    value.sum().backward()
    f, gp = pointwise(z2.log_softmax(-1).detach(), lq, *check_divergence(name, beta))
    p = lp.detach().exp()
    analytic = gp - p * gp.sum(-1, keepdim=True)
    torch.testing.assert_close(analytic, z.grad, rtol=1e-10, atol=1e-13)


def test_a_side_without_mass_is_neutral_where_it_should_be_and_infinite_where_it_must():
    lp = torch.tensor([[0.0, -math.inf]], dtype=torch.float64)   # p = (1, 0)
    lq = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=torch.float64)
    assert divergence(lp, lq, "reverse").item() == pytest.approx(math.log(2))  # p's zero cell adds 0
    assert divergence(lp, lq, "forward").item() == math.inf                    # q has mass where p has none
    assert math.isfinite(divergence(lp, lq, "jsd", 0.5).item())
    # gradients through a -inf cell stay finite (no 0 * inf in autograd)
    z = torch.tensor([[1.0, -math.inf, 0.5]], dtype=torch.float64, requires_grad=True)
    lq3 = torch.tensor([[-1.0, -2.0, -math.inf]], dtype=torch.float64).log_softmax(-1)
    divergence(z.log_softmax(-1), lq3, "jsd", 0.5).sum().backward()
    assert torch.isfinite(z.grad[0, [0, 2]]).all() and z.grad[0, 1] == 0


@pytest.mark.parametrize("bad", [dict(divergence="kl"), dict(divergence="jsd", beta=1.5), dict(divergence="mixed", beta=-0.1),
                                 dict(divergence="reverse", beta=0.5), dict(divergence="jsd", beta=True), dict(divergence="jsd", beta="0.5")])
def test_bad_configuration_is_refused_with_the_valid_values(bad):
    with pytest.raises(ValueError, match="divergence|beta"):
        check_divergence(bad["divergence"], bad.get("beta"))
    if bad["divergence"] == "kl":
        with pytest.raises(ValueError, match="'reverse', 'forward', 'jsd', 'mixed'"):
            check_divergence("kl")


def test_defaults_and_names():
    assert DIVERGENCES == ("reverse", "forward", "jsd", "mixed")
    assert check_divergence("jsd") == ("jsd", 0.5) and check_divergence("reverse") == ("reverse", None)
