"""Every divergence through the one vocabulary engine: source x direction x sampler x reference, values and
gradients, in one process, against float64 maths written from the formulas.

The dense side: ``transformers``' own warpers process the scores (as in ``test_engine_matrix.py``), each
side's log-probs by ``log_softmax`` (``-inf`` off its support), then the divergence written out term by
term from its definition (:func:`dense_divergence`: the two KLs, the mixture, TRL's generalized JSD with
``m = (1 - beta) p + beta q``), and autograd for every gradient: the policy's logits, hidden states, head
and bias, and the other side's when it requires grad. Masked rows hold NaN: value and gradient exactly 0.
A head's tiles and the split vocabulary's shards are in ``test_a_head_tiles_...`` below and in
``test_vocab_parallel.py``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.logprobs import REFERENCES

from test_engine_matrix import B, D, SAMPLERS, T, V, processed_scores  # noqa: E402

F64 = torch.float64
NINF = float("-inf")

#: (divergence, beta) cases: the directions, the JSD inside and at both ends, the mixture inside and at an end
CASES = [("reverse", None), ("forward", None), ("jsd", 0.3), ("jsd", 0.0), ("jsd", 1.0), ("mixed", 0.25), ("mixed", 0.0)]


def _kl_terms(la: Tensor, lb: Tensor, safe: bool = False) -> Tensor:
    """KL(a || b) per row from log-probs, 0 log 0 = 0 (a = 0 adds nothing, whatever b holds). ``safe``: a
    finite stand-in for log 0 where b = 0 < a (the infinite rows, weighted 0), for NaN-free autograd."""
    a = la.exp()
    if safe:
        lb = lb.masked_fill(lb == NINF, 0)
    return torch.where(a > 0, a * (la.where(a > 0, 0) - lb.where(a > 0, 0)), 0).sum(-1)


def dense_divergence(lp: Tensor, lq: Tensor, name: str, beta: Optional[float], safe: bool = False) -> Tensor:
    """The divergence of each row written from its definition (TRL's ends: beta 0 forward, 1 reverse)."""
    if name == "reverse" or (name == "jsd" and beta == 1.0):
        return _kl_terms(lp, lq, safe)
    if name == "forward" or (name == "jsd" and beta == 0.0):
        return _kl_terms(lq, lp, safe)
    if name == "mixed":  # a term of weight 0 is left out (0 * inf)
        return sum(w * _kl_terms(a, b, safe) for w, a, b in ((1 - beta, lq, lp), (beta, lp, lq)) if w)
    m = (1 - beta) * lp.exp() + beta * lq.exp()
    lm = torch.where(m > 0, m.where(m > 0, 1).log(), NINF)  # log 0 = -inf without an infinite derivative
    return beta * _kl_terms(lq, lm) + (1 - beta) * _kl_terms(lp, lm)


def dense_sides(z: Tensor, zr: Tensor, s: lk.Sampling, reference: str) -> tuple[Tensor, Tensor]:
    kept = processed_scores(z, s)
    if reference == "processed":
        ref = processed_scores(zr, s)
    else:
        ref = zr / s.temperature
        if reference == "policy_kept":
            ref = ref.masked_fill(kept == NINF, NINF)
    return kept.log_softmax(-1), ref.log_softmax(-1)


def _inputs(seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "z": 2 * torch.randn(B, T, V, generator=g, dtype=F64),
        "zr": 2 * torch.randn(B, T, V, generator=g, dtype=F64),
        "hidden": torch.randn(B, T, D, generator=g, dtype=F64),
        "weight": torch.randn(V, D, generator=g, dtype=F64),
        "bias": torch.randn(V, generator=g, dtype=F64),
        "rhidden": torch.randn(B, T, D, generator=g, dtype=F64),
        "rweight": torch.randn(V, D, generator=g, dtype=F64),
        "mask": torch.tensor([[True, True, False, True, True], [True, False, True, True, False]]),
        "weights": torch.randn(B, T, generator=g, dtype=F64),
    }


HEAD = dict(logit_scale=0.8, softcap=3.0)


class Side:
    """One model's leaves, its engine input (NaN at masked rows), and its dense logits from clean leaves."""

    def __init__(self, kind: str, x: dict[str, Tensor], mask: Tensor, other: bool, grad: bool) -> None:
        self.kind = kind
        if kind == "logits":
            self.clean = [x["zr" if other else "z"].clone().requires_grad_(grad)]
            self.dirty = [self.clean[0].detach().clone().masked_fill(~mask.unsqueeze(-1), float("nan")).requires_grad_(grad)]
        else:
            h, w = x["rhidden" if other else "hidden"], x["rweight" if other else "weight"]
            b = x["bias"]
            self.clean = [t.clone().requires_grad_(grad) for t in (h, w, b)]
            self.dirty = [h.masked_fill(~mask.unsqueeze(-1), float("nan")).requires_grad_(grad), w.clone().requires_grad_(grad), b.clone().requires_grad_(grad)]

    def engine(self) -> Any:
        if self.kind == "logits":
            return self.dirty[0]
        return lk.FromHidden(*self.dirty, **(HEAD if self.kind == "capped" else {}))

    def dense(self) -> Tensor:
        if self.kind == "logits":
            return self.clean[0]
        a = F.linear(*self.clean)
        if self.kind == "capped":
            return HEAD["softcap"] * torch.tanh(HEAD["logit_scale"] * a / HEAD["softcap"])
        return a


def check(kind: str, name: str, beta: Optional[float], s: lk.Sampling, reference: str, other_grad: bool = False, seed: int = 0, **kw: Any) -> None:
    x = _inputs(seed)
    mask = x["mask"]
    pol, oth = Side(kind, x, mask, False, True), Side(kind, x, mask, True, other_grad)
    got = lk.full_kl(pol.engine(), oth.engine(), mask, sampling=s, reference=reference, divergence=name, beta=beta, **kw)
    lp, lq = dense_sides(pol.dense(), oth.dense(), s, reference)
    want = dense_divergence(lp, lq, name, beta).where(mask, 0)
    assert (got[~mask] == 0).all()
    finite = want.isfinite()
    assert torch.equal(finite, got.isfinite()) and torch.equal(want[~finite], got[~finite])
    assert_close(got[finite], want[finite].detach(), rtol=1e-10, atol=1e-12)
    w = x["weights"].where(finite, 0)
    leaves = pol.dirty + (oth.dirty if other_grad else [])
    grads = torch.autograd.grad((w * got.where(finite, 0)).sum(), leaves)
    # where the value is +inf its weight is 0: the dense side's NaN there stays out of autograd
    safe = dense_divergence(lp, lq, name, beta, True).where(mask, 0)
    expect = torch.autograd.grad((w * safe.where(finite, 0)).sum(), pol.clean + (oth.clean if other_grad else []))
    for a, e in zip(grads, expect):
        assert torch.isfinite(a).all() and torch.isfinite(e).all()
        assert_close(a, e, rtol=1e-9, atol=1e-12)
    if kind == "logits":
        assert (grads[0][~mask] == 0).all()


@pytest.mark.filterwarnings("ignore:`ref_")
@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("name,beta", CASES)
@pytest.mark.parametrize("kind", ["logits", "hidden", "capped"])
def test_matrix(kind: str, name: str, beta: Optional[float], sampler: str, reference: str) -> None:
    check(kind, name, beta, SAMPLERS[sampler], reference, other_grad=(sampler in ("none", "T", "top_k")), chunk_size=3)
