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


def chunk_kl(z: torch.Tensor, zr: torch.Tensor, sampling: lk.Sampling) -> torch.Tensor:
    """The engine's per-chunk maths (kernels/engine.py: ``_log_pair`` then the KL of a chunk): the
    sampler's processing of the tempered scores, both log-softmaxes, and ``sum p~ (log p~ - log q)``
    with ``0 log 0 = 0`` off the kept set."""
    from lightning_kl.ground.sampler import process_scores

    logp = torch.log_softmax(process_scores(z / sampling.temperature, sampling), dim=-1)
    logq = torch.log_softmax(zr / sampling.temperature, dim=-1)
    kept = logp > float("-inf")
    logp = torch.where(kept, logp, torch.zeros_like(logp))  # no -inf in either branch: finite gradients
    return (logp.exp() * kept * (logp - logq)).sum(-1)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.skipif(_cxx() is None, reason="torch.compile's CPU backend needs a C++ compiler (g++/clang++), none found")
def test_the_engines_chunk_maths_compiles_with_every_processor() -> None:
    """temperature, top-k, top-p and min-p in one chunk, ``fullgraph=True`` (no graph break): eager's values
    and gradients, and the value of ``lk.full_kl`` on the same rows (the engine runs these ops)."""
    g = torch.Generator().manual_seed(1)
    z, zr = torch.randn(6, 33, generator=g, dtype=torch.float64), torch.randn(6, 33, generator=g, dtype=torch.float64)
    s = lk.Sampling(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)
    compiled = torch.compile(lambda a, b: chunk_kl(a, b, s), fullgraph=True, dynamic=False)
    got_z = z.clone().requires_grad_()
    got = compiled(got_z, zr)
    got.sum().backward()
    want_z = z.clone().requires_grad_()
    want = chunk_kl(want_z, zr, s)
    want.sum().backward()
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_close(got_z.grad, want_z.grad, rtol=1e-10, atol=1e-12)
    assert_close(got, lk.full_kl(z, zr, sampling=s), rtol=1e-10, atol=1e-12)
    assert (got > 0).all()


def head_chunk_kl(h: torch.Tensor, w: torch.Tensor, hr: torch.Tensor, wr: torch.Tensor, sampling: lk.Sampling) -> torch.Tensor:
    """A chunk of two real heads (kernels/engine.py: ``Source.read``): Gemma's soft cap on the policy's
    matmul, Cohere's logit scale on the reference's, then the chunk's KL."""
    z = 2.0 * torch.tanh(0.5 * (h @ w.T) / 2.0)
    return chunk_kl(z, 0.0625 * (hr @ wr.T), sampling)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.skipif(_cxx() is None, reason="torch.compile's CPU backend needs a C++ compiler (g++/clang++), none found")
def test_a_capped_heads_chunk_maths_compiles_and_matches_the_engine() -> None:
    """``c tanh(s a / c)`` and a logit scale in the chunk maths, ``fullgraph=True``: eager's values and gradients, and
    ``lk.full_kl`` of two ``lk.FromHidden`` with those scales and caps."""
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(33, 8, generator=g, dtype=torch.float64) * 2
    hr, wr = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(33, 8, generator=g, dtype=torch.float64) * 20
    s = lk.Sampling(temperature=0.8, top_k=20)
    compiled = torch.compile(lambda a, b: head_chunk_kl(a, b, hr, wr, s), fullgraph=True, dynamic=False)
    got_h, got_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = compiled(got_h, got_w)
    got.sum().backward()
    want_h, want_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = head_chunk_kl(want_h, want_w, hr, wr, s)
    want.sum().backward()
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_close(got_h.grad, want_h.grad, rtol=1e-10, atol=1e-12)
    assert_close(got_w.grad, want_w.grad, rtol=1e-10, atol=1e-12)
    eng_h, eng_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    engine = lk.full_kl(
        lk.FromHidden(eng_h, eng_w, logit_scale=0.5, softcap=2.0), lk.FromHidden(hr, wr, logit_scale=0.0625), sampling=s
    )
    engine.sum().backward()
    assert_close(engine, got, rtol=1e-10, atol=1e-12)
    assert_close(eng_h.grad, got_h.grad, rtol=1e-9, atol=1e-12)
    assert_close(eng_w.grad, got_w.grad, rtol=1e-9, atol=1e-12)
