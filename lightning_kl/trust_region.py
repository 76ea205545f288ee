r"""DPPO's binary trust regions toward the sampler: which tokens a policy-gradient step may move.

Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning" (DPPO, arXiv 2602.04879),
replace PPO's ratio clipping by a bound on a divergence between the two *binary* distributions of a
sampled token :math:`x_t`: "this token" with probability :math:`p = \pi(x_t)` under the policy and
:math:`q = \mu(x_t)` under the policy that sampled it, and "any other token". A token outside the
trust region is masked when the step would move it further out: upward for a positive advantage,
downward otherwise.

* **binary total variation** (``"binary_tv"``): :math:`D = p - q`; kept where
  :math:`A > 0 \Rightarrow p - q \le \delta_{high}` and :math:`A \le 0 \Rightarrow p - q \ge -\delta_{low}`.
* **binary KL** (``"binary_kl"``): :math:`D = q \log\frac{q}{p} + (1 - q)\log\frac{1-q}{1-p}`
  (:math:`\mathrm{KL}(\mathrm{Bern}(q)\,\Vert\,\mathrm{Bern}(p))`); kept where
  :math:`A > 0 \Rightarrow D \le \delta_{high} \vee p \le q` and
  :math:`A \le 0 \Rightarrow D \le \delta_{low} \vee p \ge q`.

The bounds are inclusive (a token exactly at :math:`\delta` is kept) and a zero advantage takes the
second branch, as verl 0.9.1's ``compute_policy_loss_dppo_tv`` / ``_dppo_kl`` and prime-rl's default
loss. The binary KL is computed with ``log1p``/``expm1`` (:func:`log1m_exp`), finite where the
probabilities round to 1 in the dtype; verl adds ``1e-8`` inside its logarithms instead, which
differs only where :math:`1 - p` is within a few ``1e-8`` of 0. A NaN log-prob is outside the
region (every comparison with NaN is False).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["TRUST_REGIONS", "binary_kl", "check_trust_threshold", "log1m_exp", "trust_region_keep"]

#: the trust regions of :func:`trust_region_keep` (``RolloutCorrection(trust_region=...)``)
TRUST_REGIONS = ("binary_tv", "binary_kl")


def check_trust_threshold(value: Any) -> tuple[float, float]:
    """``(low, high)`` from one positive number (both sides) or a pair of them; else ``ValueError``."""
    pair = list(value) if isinstance(value, (tuple, list)) else [value, value]
    ok = len(pair) == 2 and all(
        not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in pair
    )
    if not ok:
        raise ValueError(
            f"`trust_region_threshold` must be a positive finite number or a pair (low, high) of them, got {value!r}."
        )
    return float(pair[0]), float(pair[1])


def log1m_exp(x: Tensor) -> Tensor:
    r""":math:`\log(1 - e^{x})` for :math:`x \le 0`, accurate at both ends (``-inf`` at 0)."""
    near = x > -math.log(2.0)
    return torch.where(near, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def binary_kl(logq: Tensor, logp: Tensor) -> Tensor:
    r""":math:`\mathrm{KL}(\mathrm{Bern}(q)\,\Vert\,\mathrm{Bern}(p))` from :math:`\log q` and :math:`\log p`.

    ``0 log 0 = 0``: :math:`q = 1` gives :math:`-\log p`; :math:`p = 1 > q` gives ``inf``.
    """
    q = torch.exp(logq)
    other = -torch.expm1(logq)  # 1 - q, without cancellation
    tail = other * (log1m_exp(logq) - log1m_exp(logp))
    tail = torch.where(other == 0, torch.zeros((), dtype=tail.dtype, device=tail.device), tail)
    return q * (logq - logp) + tail


def trust_region_keep(
    logprob: Tensor,
    rollout_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    region: str,
    low: float,
    high: float,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    r"""The tokens inside DPPO's binary trust region (module docstring), ``[..., t]`` bool, False at padding.

    Args:
        logprob: ``[..., t]`` :math:`\log p`, the policy's log-probs (detached here).
        rollout_logprob: ``[..., t]`` :math:`\log q`, the sampler's (or the old policy's).
        advantages: ``[...]``, ``[..., 1]`` or ``[..., t]``; only their sign is read (``> 0``).
        mask: ``[..., t]`` bool, the valid tokens.
        region: one of :data:`TRUST_REGIONS`.
        low, high: :math:`\delta_{low}`, :math:`\delta_{high}` (positive).
        dtype: the dtype of the maths (default: the log-probs', at least float32).
    """
    if dtype is None:
        dtype = torch.promote_types(torch.promote_types(logprob.dtype, rollout_logprob.dtype), torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprob.device)
    lp = torch.where(mask, logprob.detach().to(dtype), zero)  # padding: p = q = 1, never read
    lq = torch.where(mask, rollout_logprob.detach().to(dtype), zero)
    adv = advantages.detach()
    if adv.ndim == mask.ndim - 1:
        adv = adv.unsqueeze(-1)
    up = (adv > 0).expand_as(mask)
    p, q = torch.exp(lp), torch.exp(lq)
    if region == "binary_tv":
        diff = p - q
        inside = torch.where(up, diff <= high, diff >= -low)
    elif region == "binary_kl":
        d = binary_kl(lq, lp)
        inside = torch.where(up, (d <= high) | (p <= q), (d <= low) | (p >= q))
    else:
        raise ValueError(f"unknown trust region {region!r}; valid values: {', '.join(map(repr, TRUST_REGIONS))}.")
    return mask & inside
