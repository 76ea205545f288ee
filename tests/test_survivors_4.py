"""Bugs that survived the tests of the module they were planted in (the fourth hour's 14), one test each.

Each test names its plant: the wrong implementation that was put in by hand, seen to fail the test, and
taken out again. They are grouped by the module the bug was planted in.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.ground import checks
from lightning_kl.kernels import engine

F64 = torch.float64
INF = float("inf")


def _entropy64(z: Tensor) -> Tensor:
    """-sum p log p over the support (0 log 0 = 0), float64."""
    lp = torch.log_softmax(z.double(), -1)
    return -torch.where(lp > -INF, lp.exp() * lp, 0.0).sum(-1)


def _reverse_kl64(z: Tensor, zr: Tensor) -> Tensor:
    """sum_i p_i (log p_i - log q_i) over the policy's support, float64."""
    lp, lq = torch.log_softmax(z.double(), -1), torch.log_softmax(zr.double(), -1)
    return torch.where(lp > -INF, lp.exp() * (lp - lq), 0.0).sum(-1)


# ---------------------------------------------------------------------------------------------
# kernels/engine.py


def test_off_the_cpu_a_token_off_the_policys_support_counts_0_log_0_as_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: ``_row_sums``'s device form without ``nan_to_num`` (its ``p * e`` of 0 * -inf stays NaN).

    The device form (one ``nan_to_num``, no host read) is the one every accelerator and ``torch.compile``
    run; switching off the CPU's host reads runs it here."""
    g = torch.Generator().manual_seed(0)
    z, zr = torch.randn(4, 9, generator=g, dtype=F64), torch.randn(4, 9, generator=g, dtype=F64)
    z[:, 2] = -INF  # off the policy's support in every row
    z[1, 5] = -INF
    want_h, want_kl = _entropy64(z), _reverse_kl64(z, zr)
    monkeypatch.setattr(checks, "HOST_READ_DEVICES", frozenset())
    assert not checks.host_reads(z.device)
    assert_close(lk.token_entropy(z), want_h, rtol=1e-12, atol=1e-14)
    assert_close(lk.full_kl(z, zr), want_kl, rtol=1e-12, atol=1e-14)
    h, w = torch.randn(4, 3, generator=g, dtype=F64), torch.randn(9, 3, generator=g, dtype=F64)
    b = torch.zeros(9, dtype=F64)
    b[2] = -INF  # from a head: the bias takes token 2 off the support
    assert_close(lk.token_entropy(lk.FromHidden(h, w, b)), _entropy64(h @ w.T + b), rtol=1e-12, atol=1e-14)


def test_a_vocabulary_tile_without_mass_adds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: ``_Rows``'s whole rows keep ``c = NaN`` (log_softmax of a tile of -inf) instead of ``-inf``.

    A head's vocabulary is read in tiles of columns (here 3 tiles of 4, the tile size made small); a
    bias of -inf over the first tile leaves it without mass, which must add nothing to the rows."""
    monkeypatch.setattr(engine, "HIDDEN_CPU_TILE_ELEMENTS", 6 * 4)  # 6 rows: tiles of 4 columns
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(2, 3, 5, generator=g, dtype=F64), torch.randn(12, 5, generator=g, dtype=F64)
    b = torch.randn(12, generator=g, dtype=F64)
    b[:4] = -INF
    src = lk.FromHidden(h, w, b)
    assert len(engine.Source(engine.Tensors(h, w, b)).tiles(6, True)) == 3
    z = h @ w.T + b
    tokens = torch.randint(4, 12, (2, 3), generator=g)
    lp, ent = lk.token_logprobs_and_entropy(src, tokens)
    assert_close(lp, torch.log_softmax(z, -1).gather(-1, tokens[..., None]).squeeze(-1), rtol=1e-12, atol=1e-14)
    assert_close(ent, _entropy64(z), rtol=1e-12, atol=1e-14)


def test_a_token_outside_the_kept_set_sends_no_gradient() -> None:
    """Plant: ``_Rows.backward`` without ``masked_fill(outside, 0)`` on the log-prob's gradient (a token
    outside the kept set, value -inf whatever the logits, still sent ``-p`` into its row)."""
    g = torch.Generator().manual_seed(2)
    z = torch.randn(5, 8, generator=g, dtype=F64, requires_grad=True)
    s = lk.Sampling(temperature=0.7, top_k=3)
    inside = z.detach().argmax(-1)
    tokens = torch.where(torch.arange(5) % 2 == 0, inside, z.detach().argmin(-1))  # rows 1, 3: outside
    lp = lk.token_logprobs(z, tokens, sampling=s, outside="-inf")
    assert torch.isinf(lp[1::2]).all() and torch.isfinite(lp[0::2]).all()
    (grad,) = torch.autograd.grad(lp, z, torch.ones(5, dtype=F64))
    assert torch.equal(grad[1::2], torch.zeros(2, 8, dtype=F64))  # a constant: no gradient at all
    # inside: the gradient of log softmax over the kept set, from float64 autograd
    zd = z.detach().clone().requires_grad_()
    scores = zd / 0.7
    kept = scores >= scores.topk(3, -1).values[:, -1:]
    want = torch.log_softmax(scores.masked_fill(~kept, -INF), -1).gather(-1, tokens[:, None]).squeeze(-1)
    want[0::2].sum().backward()
    assert_close(grad[0::2], zd.grad[0::2], rtol=1e-12, atol=1e-14)
