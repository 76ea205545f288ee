r"""``KLPenaltyLoss``: the KL term of an RL loss, as an ``nn.Module``."""

from __future__ import annotations

import math
from typing import Optional

from torch import Tensor, nn

from lightning_kl.estimators import parse_estimator
from lightning_kl.functional import (
    _check_pair,
    _kl_penalty_compute,
    aggregate,
    check_agg_mode,
    check_mask,
    check_old_logprob,
)
from lightning_kl.metric import KLMetric

__all__ = ["KLPenaltyLoss"]


class KLPenaltyLoss(nn.Module):
    r"""``coef * aggregate(kl_penalty(logprob, ref_logprob, estimator), mask, agg)``.

    Notation: ``b`` batch, ``t`` response length.

    .. math::
        \mathcal{L}_{\mathrm{KL}} = \mathrm{coef} \cdot \mathrm{agg}_{m}\big(k(\log\pi - \log\pi_{\mathrm{ref}})\big)

    Every forward call also feeds the detached per-token values (over valid tokens) to
    :attr:`metric`, a :class:`~lightning_kl.KLMetric`, so that a LightningModule can log it with
    ``self.log("train/kl", self.kl.metric)``.

    Args:
        estimator: one of :data:`lightning_kl.ESTIMATORS`; ``+`` names carry the k2 gradient, the
            unbiased gradient of the KL for on-policy samples. Validated here.
        coef: the loss coefficient (``>= 0``).
        agg: one of :data:`lightning_kl.AGG_MODES`.
        agg_norm: the constant divisor of ``seq-mean-token-sum-norm`` (default: the padded length).

    Shapes in ``forward``: ``logprob``, ``ref_logprob`` and ``mask`` are ``[b, t]`` (any shape,
    the same for all three). Half precision inputs are computed and reduced in float32; the loss is
    float32 and the gradients come back in the inputs' dtype.

    Raises:
        ValueError: at construction, for an unknown estimator or mode or a bad ``coef``; in forward,
            for shapes that do not match (both are named).

    Example:
        >>> import torch
        >>> loss_fn = KLPenaltyLoss("k3+", coef=0.5)
        >>> logprob = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
        >>> ref = torch.tensor([[-1.5, -1.0, float("nan")]])
        >>> mask = torch.tensor([[True, True, False]])
        >>> loss = loss_fn(logprob, ref, mask)  # 0.5 * (0.1065 + 0.7183) / 2
        >>> loss
        tensor(0.2062, grad_fn=<MulBackward0>)
        >>> loss.backward(); logprob.grad  # 0.5 * d / 2 on valid tokens, exactly 0 on padding
        tensor([[ 0.1250, -0.2500,  0.0000]])
    """

    def __init__(
        self,
        estimator: str = "k3+",
        coef: float = 0.001,
        agg: str = "token-mean",
        agg_norm: Optional[float] = None,
    ) -> None:
        super().__init__()
        self.spec = parse_estimator(estimator)
        self.agg = check_agg_mode(agg)
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
            raise ValueError(f"`coef` must be a finite number >= 0, got {coef!r}.")
        if agg_norm is not None and not (isinstance(agg_norm, (int, float)) and agg_norm > 0):
            raise ValueError(f"`agg_norm` must be a positive number or None, got {agg_norm!r}.")
        self.coef = float(coef)
        self.agg_norm = agg_norm
        self.metric = KLMetric()

    @property
    def estimator(self) -> str:
        """The estimator name as configured."""
        return self.spec.name

    def forward(
        self,
        logprob: Tensor,
        ref_logprob: Tensor,
        mask: Optional[Tensor] = None,
        old_logprob: Optional[Tensor] = None,
    ) -> Tensor:
        """The scalar KL loss; ``old_logprob`` (the sampling policy's) importance weights it."""
        _check_pair(logprob, ref_logprob)
        check_old_logprob(old_logprob, logprob)
        mask = check_mask(mask, logprob, "logprob")
        kl = _kl_penalty_compute(logprob, ref_logprob, self.spec, mask, old_logprob)
        self.metric(kl.detach(), mask)
        return self.coef * aggregate(kl, mask, self.agg, norm=self.agg_norm)

    def extra_repr(self) -> str:
        return f"estimator={self.spec.name!r}, coef={self.coef}, agg={self.agg!r}"
