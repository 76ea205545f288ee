"""``torch.compile(fullgraph=True)`` of the KL term of a loss, on CPU: one graph, eager's values and gradients.

What a GPU user compiles (``docs/performance.md``): the sampled-token estimator and its aggregation,
``aggregate(kl_penalty(lp, ref, "k3+", mask=m), m, "token-mean")``. ``fullgraph=True`` fails on any
graph break (a host read, a Python branch on a tensor's value, an untraceable call), so this test also
guards the path against one. Small inputs: the compile dominates (tens of seconds on 2 cores, once).
Inductor's CPU backend needs a C++ compiler; without one the test skips, saying so.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk


def _cxx() -> str | None:
    """The C++ compiler inductor would call (its ``cpp.cxx`` setting, ``g++`` by default), if installed."""
    from torch._inductor import config

    name = config.cpp.cxx[1] if isinstance(config.cpp.cxx, tuple) else config.cpp.cxx
    return shutil.which(name or "g++")


def kl_term(lp: torch.Tensor, ref: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return lk.aggregate(lk.kl_penalty(lp, ref, "k3+", mask=m), m, "token-mean")


# torch's own modules that the compiler imports on its first use define TorchScript methods, which torch
# 2.13 deprecates: 14 warnings from torch/jit/_script.py, none from this package's code
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.skipif(_cxx() is None, reason="torch.compile's CPU backend needs a C++ compiler (g++/clang++), none found")
def test_compiled_kl_term_matches_eager_values_and_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 8, generator=g) * 4
    ref = -torch.rand(3, 8, generator=g) * 4
    m = torch.rand(3, 8, generator=g) < 0.7
    m[2] = False  # a sequence with no valid token
    lp[~m] = float("nan")  # junk on padding: it must reach neither the value nor the gradient
    ref[0, ~m[0]] = float("inf")
    lp.requires_grad_()

    compiled = torch.compile(kl_term, fullgraph=True)
    value = compiled(lp, ref, m)
    (grad,) = torch.autograd.grad(value, lp)
    eager = kl_term(lp, ref, m)
    (eager_grad,) = torch.autograd.grad(eager, lp)

    assert_close(value, eager, rtol=1e-6, atol=0)  # the compiler may reorder the sum: float32 rounding
    assert_close(grad, eager_grad, rtol=1e-6, atol=0)
    assert torch.all(grad[~m] == 0)

    # and both against float64 maths: k3+ has k3's value and gradient d / n_valid (the "+" straight-through)
    d = (lp.detach().double() - ref.double())[m]
    k3 = torch.expm1(-d) + d
    n = m.sum()
    assert_close(value.double(), k3.sum() / n, rtol=1e-6, atol=0)
    expected = torch.zeros_like(lp, dtype=torch.float64)
    expected[m] = d / n
    assert_close(grad.double(), expected, rtol=1e-5, atol=1e-7)
