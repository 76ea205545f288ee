r"""The divergences between the policy (the student) and another model, as sums of pointwise terms.

For one row, with :math:`p` the policy's distribution and :math:`q` the other model's (the reference,
a teacher), each divergence is :math:`D = \sum_i f(\log p_i, \log q_i)`:

* ``"reverse"``: :math:`\mathrm{KL}(p \,\|\, q)`, :math:`f = p (\log p - \log q)` (mode seeking);
* ``"forward"``: :math:`\mathrm{KL}(q \,\|\, p)`, :math:`f = q (\log q - \log p)` (mass covering);
* ``"jsd"`` with ``beta`` in [0, 1], the generalized Jensen-Shannon divergence of GKD, TRL's convention:
  :math:`m = (1 - \beta) p + \beta q`, :math:`D = \beta\,\mathrm{KL}(q \,\|\, m) + (1 - \beta)\,\mathrm{KL}(p \,\|\, m)`
  for :math:`0 < \beta < 1`; ``beta = 0`` is the forward KL and ``beta = 1`` the reverse KL (TRL's
  ``generalized_jsd_loss`` special-cases both ends so; the formula itself vanishes there);
* ``"mixed"`` with ``beta`` in [0, 1]: :math:`(1 - \beta)\,\mathrm{KL}(q \,\|\, p) + \beta\,\mathrm{KL}(p \,\|\, q)`,
  the same ends as ``"jsd"`` (``beta = 0`` forward, ``beta = 1`` reverse). NeMo-RL's ``mixed_kl_weight``
  ``w`` weighs the *forward* KL: its ``w`` is ``beta = 1 - w`` here.

The gradient w.r.t. the policy's log-probabilities, through :math:`\log p = z - \log\sum e^{z}`, is
:math:`\partial D / \partial z_j = g_j - p_j \sum_i g_i` with :math:`g = \partial f / \partial \log p`
(:func:`pointwise`): reverse :math:`p (\log p - \log q + 1)`, forward :math:`-q`, JSD
:math:`(1 - \beta)\, p (\log p - \log m)`, and the mixture's weighted sum.

Conventions at the edges: :math:`0 \log 0 = 0` (a term of a zero-probability side is 0, whatever the
other holds), so the KLs are ``+inf`` only where the side they are taken under has mass the other lacks;
the JSD is finite for ``0 < beta < 1``. These are plain functions of log-probability tensors (any
shape, the categories in the last dimension): the engine sums them chunk by chunk, and the top-k
coarsening applies them to its ``k + 1`` cells.
"""

from __future__ import annotations

import math
from typing import Literal, Optional, Union

import torch
from torch import Tensor

__all__ = ["DIVERGENCES", "Divergence", "check_divergence", "divergence", "kl_weights", "pointwise"]

#: The divergences between the policy and the other model (``divergence=``).
DIVERGENCES: tuple[str, ...] = ("reverse", "forward", "jsd", "mixed")

#: The type of a ``divergence`` argument, listed by LightningCLI's ``--help``; any other string is refused
#: when the object is built, with the valid names.
Divergence = Union[Literal[DIVERGENCES], str]  # type: ignore[valid-type]

_DEFAULT_BETA = {"jsd": 0.5, "mixed": 0.5}


def check_divergence(divergence: object, beta: object = None) -> tuple[str, Optional[float]]:
    """Validate ``divergence`` and its ``beta``; return ``(divergence, beta)`` with the default ``beta`` (0.5)
    of ``"jsd"`` and ``"mixed"`` filled in, and ``None`` for the KLs.

    Raises:
        ValueError: for an unknown name (the valid ones listed), a ``beta`` outside [0, 1] or not a number,
            or a ``beta`` given to ``"reverse"`` or ``"forward"`` (which take none).
    """
    if not isinstance(divergence, str) or divergence not in DIVERGENCES:
        valid = ", ".join(repr(d) for d in DIVERGENCES)
        raise ValueError(f"Unknown divergence {divergence!r}. Valid divergences: {valid}.")
    if divergence not in _DEFAULT_BETA:
        if beta is not None:
            raise ValueError(f"`beta` is for divergence='jsd' or 'mixed'; divergence={divergence!r} takes none, got beta={beta!r}.")
        return divergence, None
    if beta is None:
        return divergence, _DEFAULT_BETA[divergence]
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (0.0 <= beta <= 1.0):
        raise ValueError(
            f"`beta` must be a number in [0, 1] for divergence={divergence!r} (0: the forward KL, 1: the reverse KL), got {beta!r}."
        )
    return divergence, float(beta)


def _plogratio(p: Tensor, lp: Tensor, lx: Tensor) -> Tensor:
    # p (lp - lx) with 0 where p == 0 (0 log 0 = 0, whatever lx holds); the masked branch reads zeros, so that
    # autograd never forms 0 * inf there
    has = p > 0
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    return torch.where(has, p * (torch.where(has, lp, zero) - torch.where(has, lx, zero)), zero)


def kl_weights(divergence: str, beta: Optional[float]) -> Optional[tuple[float, float]]:
    """``(weight of the forward KL, weight of the reverse KL)`` of a checked divergence that is a mix of the
    two KLs (``"reverse"``, ``"forward"``, ``"mixed"``, the JSD's ends ``beta`` 0 and 1), or None for the
    JSD with ``0 < beta < 1``."""
    if divergence == "reverse" or (divergence == "jsd" and beta == 1.0):
        return 0.0, 1.0
    if divergence == "forward" or (divergence == "jsd" and beta == 0.0):
        return 1.0, 0.0
    if divergence == "jsd":
        return None
    assert divergence == "mixed" and beta is not None
    return 1.0 - beta, beta


def pointwise(lp: Tensor, lq: Tensor, divergence: str, beta: Optional[float] = None) -> tuple[Tensor, Tensor]:
    r"""The terms :math:`f(\log p_i, \log q_i)` of ``divergence`` and their derivatives :math:`g_i` w.r.t. :math:`\log p_i`.

    ``lp``, ``lq``: log-probabilities (``-inf`` for no mass), broadcastable; ``divergence``, ``beta`` as
    :func:`check_divergence` returns them. Returns ``(f, g)``; the row's divergence is ``f.sum(-1)`` and
    its gradient w.r.t. the policy's logits ``g - p * g.sum(-1, keepdim=True)``. The other side's ``g`` is
    not formed: callers that need it differentiate :func:`divergence`.
    """
    p, q = lp.exp(), lq.exp()
    if divergence == "jsd" and beta is not None and 0.0 < beta < 1.0:
        lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
        f = beta * _plogratio(q, lq, lm) + (1.0 - beta) * _plogratio(p, lp, lm)
        return f, (1.0 - beta) * _plogratio(p, lp, lm)
    weights = kl_weights(divergence, beta)
    assert weights is not None
    w_fwd, w_rev = weights
    f = torch.zeros((), dtype=p.dtype, device=p.device)
    g = torch.zeros((), dtype=p.dtype, device=p.device)
    if w_fwd:
        f, g = f + w_fwd * _plogratio(q, lq, lp), g - w_fwd * q
    if w_rev:
        f, g = f + w_rev * _plogratio(p, lp, lq), g + w_rev * (_plogratio(p, lp, lq) + p)
    return torch.broadcast_to(f, torch.broadcast_shapes(lp.shape, lq.shape)), torch.broadcast_to(g, torch.broadcast_shapes(lp.shape, lq.shape))


def divergence(lp: Tensor, lq: Tensor, divergence: str = "reverse", beta: Optional[float] = None) -> Tensor:
    """The divergence of each row (the last dimension holds the categories): ``pointwise(...)[0].sum(-1)``,
    differentiable by autograd w.r.t. both sides (for small category counts, such as top-k cells)."""
    name, beta = check_divergence(divergence, beta)
    return pointwise(lp, lq, name, beta)[0].sum(-1)
