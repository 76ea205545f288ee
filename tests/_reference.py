"""Float64 references written from the documented formulas, independent of the library's code.

``value(name, d)`` and ``grad(name, d)`` are each estimator's value and its gradient w.r.t. ``logprob``
(the estimator table), ``weights(mask, mode)`` the per-token weight ``w`` of each aggregation mode
(every mode is linear: ``aggregate(v, mask, mode) = sum(w * v)``).
"""

from __future__ import annotations

import torch
from torch import Tensor

BASE = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "low_var_kl"}


def _k3(d: Tensor) -> Tensor:
    c = d.clamp(-20.0, 20.0)
    return torch.exp(-c) + c - 1


def value(name: str, d: Tensor) -> Tensor:
    """The estimator's value of the log-ratio ``d`` (float64)."""
    d = d.double()
    base = BASE[name.removesuffix("+")]
    if base == "k1":
        return d.clone()
    if base == "abs":
        return d.abs()
    if base == "k2":
        return d**2 / 2
    if base == "k3":
        return _k3(d)
    return _k3(d).clamp(-10.0, 10.0)


def grad(name: str, d: Tensor) -> Tensor:
    """The derivative of the estimator's loss w.r.t. ``logprob`` at ``d`` (float64)."""
    d = d.double()
    if name.endswith("+"):
        return d.clone()
    base = BASE[name]
    if base == "k1":
        return torch.ones_like(d)
    if base == "abs":
        return torch.sign(d)
    if base == "k2":
        return d.clone()
    inside = d.abs() <= 20.0
    if base == "low_var_kl":
        inside = inside & (_k3(d) <= 10.0)
    return torch.where(inside, 1 - torch.exp(-d), torch.zeros_like(d))


def weights(mask: Tensor, mode: str) -> Tensor:
    """``[b, t]`` weights with ``aggregate(v, mask, mode) == (weights * v).sum()`` (0 on padding)."""
    m = mask.double()
    n = m.sum(-1, keepdim=True)
    seqs = max(int((n > 0).sum()), 1)
    if mode == "token-mean":
        w = m / max(float(m.sum()), 1.0)
    elif mode == "token-sum":
        w = m
    elif mode == "seq-mean-token-sum":
        w = m / seqs
    elif mode == "seq-mean-token-mean":
        w = m / n.clamp(min=1) / seqs
    elif mode == "seq-mean-token-sum-norm":
        w = m / mask.shape[-1]
    else:
        raise ValueError(mode)
    return w
