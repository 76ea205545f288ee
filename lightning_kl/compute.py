r"""The compute step: per-token KL values of checked inputs (:mod:`lightning_kl.inputs`).

One call in (:func:`kl_penalty_values`), one way down for each kind of input: the sampled estimators
(on-policy, or importance weighted off-policy, :func:`importance_weight`), the sequence level's KL-to-go
(:mod:`lightning_kl.sequence`), and the exact KL over the vocabulary (the engine,
:mod:`lightning_kl.kernels.full`). The values come back in the compute dtype, 0 where the mask is False;
nothing here checks inputs or calls back up.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_kl.distill.topk import TopK, topk_divergence
from lightning_kl.estimators import K3_CLAMP, EstimatorSpec, estimator_value, parse_estimator
from lightning_kl.ground.checks import compute_dtype
from lightning_kl.ground.kept import KeptSets
from lightning_kl.ground.sampler import Sampling
from lightning_kl.inputs import KLInputs
from lightning_kl.kernels import fused
from lightning_kl.kernels.engine import Head
from lightning_kl.kernels.full import full_kl_compute, full_kl_from_hidden_compute
from lightning_kl.logprobs import FromHidden
from lightning_kl.sequence import exclusive_cumsum, full_with_kl_to_go, prefix_log_weights, weighted_kl_to_go, with_kl_to_go

__all__ = ["check_max_weight", "full_kl_values", "importance_weight", "kl_penalty_compute", "kl_penalty_values"]

_NEUTRAL = Sampling()


def check_max_weight(max_weight: object) -> Optional[float]:
    """Validate the importance weight cap: ``None``, or a finite real number ``>= 1``.

    Raises:
        ValueError: naming the bad value and the valid ones.
    """
    if max_weight is None:
        return None
    valid = isinstance(max_weight, (int, float)) and not isinstance(max_weight, bool)
    if not valid or not math.isfinite(max_weight) or max_weight < 1:
        raise ValueError(
            "`max_weight` must be None (no truncation) or a finite number >= 1 (a cap below 1 would "
            f"scale down on-policy tokens too, whose weight is 1), got {max_weight!r}."
        )
    return float(max_weight)


def full_kl_values(
    x: Any, ref_x: Any, mask: Optional[Tensor], sampling: Sampling, divergence: tuple[str, Optional[float]] = ("reverse", None),
    kept: Optional[KeptSets] = None,
) -> Tensor:
    r"""The exact per-position KL of checked inputs: the one place where ``"full"`` reaches the kernels.

    :math:`\mathrm{KL}(\tilde\pi \,\|\, \pi_{\mathrm{ref}})`, the policy processed by ``sampling`` and the
    reference at the same temperature, unprocessed (``lk.full_kl``'s ``reference="unprocessed"``); or
    another divergence, a checked ``(divergence, beta)`` (:mod:`lightning_kl.kernels.divergence`).
    ``x`` and ``ref_x``: logits (a tensor, a vocabulary-split DTensor or an ``lk.VocabShard``) or one
    :class:`~lightning_kl.FromHidden` each; ``mask`` bool or None. ``ref_x`` may be a teacher's
    :class:`~lightning_kl.TopK` (any form of ``x``): the divergence coarsened onto its ids and a tail, the
    function ``lk.full_kl`` calls for it (:func:`~lightning_kl.distill.topk.topk_divergence`, which checks the payload).
    A truncating sampler on a vocabulary split was refused by the checks (:mod:`lightning_kl.inputs`).
    ``kept``: the policy's recorded kept sets, checked (:func:`~lightning_kl.kept_inputs.check_kept`): replayed in
    place of the sampler's truncation (``sampling`` then gives the temperature).
    """
    if isinstance(ref_x, TopK):  # replay included: topk_divergence reads kept= itself
        return topk_divergence(x, ref_x, mask, sampling=sampling, divergence=divergence[0], beta=divergence[1], kept=kept)
    if kept is not None:
        sampling = Sampling(sampling.temperature)
    if isinstance(x, FromHidden):
        return full_kl_from_hidden_compute(
            x.hidden, x.weight, x.bias, ref_x.hidden, ref_x.weight, ref_x.bias, mask, sampling,
            head=Head(x.logit_scale, x.softcap), ref_head=Head(ref_x.logit_scale, ref_x.softcap), divergence=divergence, replay=kept,
        )
    return full_kl_compute(x, ref_x, mask, sampling, divergence=divergence, replay=kept)


def kl_penalty_values(
    inputs: KLInputs,
    spec: EstimatorSpec,
    max_weight: Optional[float] = None,
    level: str = "token",
    kl_to_go: str = "k1",
    sampling: Optional[Sampling] = None,
    divergence: tuple[str, Optional[float]] = ("reverse", None),
    kept: Optional[KeptSets] = None,
) -> Tensor:
    """Per-token values of checked inputs (:func:`~lightning_kl.inputs.check_kl_inputs`), in the compute dtype:
    the compute step of :func:`~lightning_kl.kl_penalty` and :class:`~lightning_kl.KLPenaltyLoss` alike
    (``divergence``: a checked ``(divergence, beta)`` for ``"full"``, at ``level="token"``; ``kept``: the
    policy's recorded kept sets for ``"full"``, checked by :func:`~lightning_kl.kept_inputs.check_kept`)."""
    if spec.base == "full":
        kl = full_kl_values(inputs.logprob, inputs.ref_logprob, inputs.mask, _NEUTRAL if sampling is None else sampling, divergence, kept)
        if inputs.sampled_logprob is not None:
            kl = full_with_kl_to_go(kl, inputs.sampled_logprob, inputs.mask)
        return kl
    return kl_penalty_compute(
        inputs.logprob, inputs.ref_logprob, spec, inputs.mask, inputs.old_logprob, max_weight, level, kl_to_go, inputs.dtype
    )


def kl_penalty_compute(
    logprob: Tensor,
    ref_logprob: Tensor,
    spec: EstimatorSpec,
    mask: Optional[Tensor],
    old_logprob: Optional[Tensor] = None,
    max_weight: Optional[float] = None,
    level: str = "token",
    kl_to_go: str = "k1",
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Per-token estimate in the compute dtype (float32 for half inputs); 0 where ``mask`` is False.

    The single dispatch point of every caller (the function, the loss, the callback). Inputs are
    checked by the caller, which may give the compute dtype it found. ``level="sequence"``: see
    :mod:`lightning_kl.sequence`.
    """
    if dtype is None:
        dtype = compute_dtype(logprob, ref_logprob)
    zero = torch.zeros((), dtype=dtype, device=logprob.device)
    if level == "token" and old_logprob is not None and spec.base == "k3" and not spec.straight_through:
        return _off_policy_k3(logprob, ref_logprob, old_logprob, mask, max_weight, dtype)
    if fused.use_fused(spec, logprob):
        # the same maths in one chunked pass each way (set fused.ENABLED = False for the composition)
        value = fused.fused_kl_value(logprob, ref_logprob, spec, mask, dtype)
    else:
        d = logprob.to(dtype) - ref_logprob.to(dtype)
        if mask is not None:
            # select before the maths so that junk at padded positions never reaches the value or
            # the gradient (where() routes an exact 0 gradient to the unselected inputs)
            d = torch.where(mask, d, zero)
        value = estimator_value(spec, d)
    if level == "sequence":
        return _sequence_level(value, logprob, ref_logprob, spec, mask, old_logprob, max_weight, zero, kl_to_go)
    if old_logprob is None:
        return value
    log_w = logprob.to(dtype) - old_logprob.to(dtype)
    if mask is not None:
        log_w = torch.where(mask, log_w, zero)
    return importance_weight(log_w, spec, max_weight) * value


def _sequence_level(
    value: Tensor,
    logprob: Tensor,
    ref_logprob: Tensor,
    spec: EstimatorSpec,
    mask: Optional[Tensor],
    old_logprob: Optional[Tensor],
    max_weight: Optional[float],
    zero: Tensor,
    kl_to_go: str,
) -> Tensor:
    # per-decision weights rho_{1:t} (truncated by max_weight), then the KL-to-go score term
    weight = None
    if old_logprob is not None:
        log_w = logprob.to(zero.dtype) - old_logprob.to(zero.dtype)
        weight = importance_weight(prefix_log_weights(log_w, mask), spec, max_weight)
        if spec.base == "k3" and not spec.straight_through:
            # the token level's cancellation-free w * k3, with the prefix's log-weight moved into the
            # sampler's log-prob: lp - (old - sum_{u<t} log w_u) = log rho_{1:t}, gradient of lp alone
            log_w = torch.where(mask, log_w, zero) if mask is not None else log_w
            prefix = exclusive_cumsum(log_w.detach())  # sum_{u<t} log w_u, small prefixes exact
            value = _off_policy_k3(logprob, ref_logprob, old_logprob.to(zero.dtype) - prefix, mask, max_weight, zero.dtype)
        else:
            value = weight * value
    future = weighted_kl_to_go(logprob, ref_logprob, mask, weight, kl_to_go)
    return with_kl_to_go(value, logprob, future, mask)


def _off_policy_k3(
    logprob: Tensor,
    ref_logprob: Tensor,
    old_logprob: Tensor,
    mask: Optional[Tensor],
    max_weight: Optional[float],
    dtype: torch.dtype,
) -> Tensor:
    r"""``w * k3(d)`` with a differentiable weight, its gradient computed without cancellation.

    The product rule gives :math:`\nabla(w\,k_3) = w(e^{-d} + d - 1)\nabla\log w + w(1 - e^{-d})\nabla d`:
    two terms of size :math:`w e^{-d}` that cancel to the exact :math:`w\,d`, which float32 loses for
    :math:`d < -12` (-12.0 instead of -16.29 at :math:`d = -18`). Written as
    :math:`w\,k_3 = w e^{-c} + w(c - 1)` with :math:`w e^{-c} = e^{\log w - c}`, and inside the clamp
    :math:`\log w - d = \log\pi_{ref} - \log\pi_{old}` free of the policy, the first term carries no
    gradient to ``logprob`` there and the second carries :math:`w\,c` exactly. The value is still
    ``w * (expm1(-c) + c)`` (accurate for small ``d``, where the two-term form would cancel); the
    gradient w.r.t. ``ref_logprob`` is the product's, too (``old_logprob`` comes detached). Not fused: the
    composition's temporaries, for this one case.
    """
    zero = torch.zeros((), dtype=dtype, device=logprob.device)
    lp, ref, old = logprob.to(dtype), ref_logprob.to(dtype), old_logprob.to(dtype)
    d, log_w, ref_old = lp - ref, lp - old, ref - old
    if mask is not None:
        d, log_w, ref_old = (torch.where(mask, x, zero) for x in (d, log_w, ref_old))
    log_w = _truncated_log_weight(log_w, max_weight)
    w = torch.exp(log_w)
    c = d.clamp(-K3_CLAMP, K3_CLAMP)
    value = w * (torch.expm1(-c) + c)
    # log w - c with the gradient of log(pi_ref) - log(pi_old) where the clamp passes d (an exact 0
    # toward logprob), and of log w - 20 sign(d) (c constant) outside it
    z = log_w - c
    inside = (d >= -K3_CLAMP) & (d <= K3_CLAMP)
    z = torch.where(inside, z.detach() + (ref_old - ref_old.detach()), z)
    surrogate = torch.exp(z) + w * (c - 1)
    return value.detach() + (surrogate - surrogate.detach())


def _truncated_log_weight(log_w: Tensor, max_weight: Optional[float]) -> Tensor:
    if max_weight is None:
        return log_w
    # the value of min(log w, log c) with the gradient of log w (log w - log w.detach() is an exact 0)
    return log_w.detach().clamp(max=math.log(max_weight)) + (log_w - log_w.detach())


def importance_weight(log_w: Tensor, spec: EstimatorSpec, max_weight: Optional[float] = None) -> Tensor:
    r"""The weight :math:`w = \pi / \pi_{old}` of an off-policy estimate, differentiable or not.

    For tokens :math:`x` sampled from :math:`\pi_{old}`, with :math:`\nabla` taken w.r.t. the policy
    (:math:`\pi_{old}` and :math:`\pi_{ref}` fixed) and :math:`k' = dk/dd`:

    * ``k1``, ``k3``, ``abs``, ``low_var_kl`` (value estimators): the weight is differentiable.
      :math:`E_{old}[w\,k] = E_\pi[k]`, and since :math:`\pi_{old}` is fixed the expected gradient
      is the gradient of that expectation: per sample :math:`\nabla(w k) = w(k + k')\nabla\log\pi`
      (:math:`\nabla w = w\nabla\log\pi`), which is :math:`w\,d\,\nabla\log\pi` for ``k3`` and
      :math:`w(d+1)\nabla\log\pi` for ``k1``; both have expectation
      :math:`E_\pi[d\,\nabla\log\pi] = \nabla\mathrm{KL}` (as :math:`E_\pi[\nabla\log\pi] = 0`).
      A detached weight would leave :math:`w\,k'\nabla\log\pi`: expectation 0 for ``k1``, the
      forward-KL gradient for ``k3``. ``abs`` and ``low_var_kl`` get the exact gradient of
      :math:`E_\pi[|d|]` and :math:`E_\pi[\min(k_3, 10)]`, values that are biased to begin with.
    * ``k2`` and every ``+`` name (gradient estimators): their on-policy gradient
      :math:`d\,\nabla\log\pi` is already a sample of the KL gradient, so the weight is *detached*:
      gradient :math:`w\,d\,\nabla\log\pi`, expectation :math:`\nabla\mathrm{KL}`; value :math:`w`
      times the base value (expectation :math:`E_\pi[k]`). A differentiable weight would add
      :math:`w\,k\,\nabla\log\pi`, of expectation :math:`E_\pi[k\nabla\log\pi] \ne 0`.

    With ``old_logprob = logprob.detach()`` (on-policy) :math:`w = 1` but :math:`\nabla w =
    \nabla\log\pi`, so ``k1`` and ``k3`` then give the exact KL gradient in a loss, too.

    **Truncation** (``max_weight`` :math:`= c \ge 1`): the weight's *value* is cut to
    :math:`\bar w = \min(w, c)` (computed from :math:`\min(\log w, \log c)`, so that a far-drifted
    token never overflows) while a differentiable weight keeps its gradient,
    :math:`\nabla\bar w = \bar w\,\nabla\log\pi` (straight-through, like the ``+`` names). A
    clipped token's whole per-sample gradient is thus scaled by :math:`c / w`: this is truncated
    importance sampling of the on-policy per-sample gradient :math:`g_\pi` (:math:`(k + k')\nabla\log\pi`
    for a differentiable weight, :math:`d\,\nabla\log\pi` for a detached one). With
    :math:`m(x) = \min(\pi(x), c\,\pi_{old}(x))` (the policy's mass, cut at :math:`c` times the
    sampler's; :math:`\sum_x m \le 1`) and :math:`C = \{x : \pi(x) > c\,\pi_{old}(x)\}` the clipped
    tokens, for :math:`x \sim \pi_{old}`:

    * value: :math:`E_{old}[\bar w k] = \sum_x m\,k = E_\pi[k] - \sum_{x \in C}(\pi - c\,\pi_{old})\,k`:
      the mass above the cap is dropped (an underestimate for ``k3``, whose ``k >= 0``).
    * gradient: :math:`E_{old}[\bar w\,g_\pi] = \sum_x m\,g_\pi = \nabla\mathrm{KL} - \sum_{x \in C}
      (\pi - c\,\pi_{old})\,g_\pi`, with :math:`g_\pi = d\,\nabla\log\pi` for ``k3``, ``k2`` and every
      ``+`` name (so ``k3`` and ``k3+`` still have the same gradient, token by token) and
      :math:`(d + 1)\nabla\log\pi` for ``k1``. The bias is bounded by the dropped mass
      :math:`\sum_C (\pi - c\,\pi_{old}) \le P_\pi(C)` times :math:`\max_C \|g_\pi\|`, and vanishes
      with it.

    Why not a plain ``clamp`` of the weight: its gradient would be 0 on :math:`C`, which drops the
    score term :math:`w\,k\nabla\log\pi` and leaves :math:`c\,k'\nabla\log\pi` (:math:`c\nabla\log\pi`
    for ``k1``). That is the exact gradient of the truncated value :math:`\sum_x m\,k`, but its
    bias on :math:`\nabla\mathrm{KL}` does not shrink with the dropped mass: in
    ``examples/estimator_study.py``, with 1.3% of the mass above :math:`c = 2`, the relative
    gradient error is 0.87 (``k1``) and 0.29 (``k3``) that way, against 0.03 here.

    :math:`c \ge 1` leaves on-policy tokens (:math:`w = 1`) untouched, and with :math:`c \ge \max w`
    on the batch the result equals the untruncated one.

    Args:
        log_w: ``[..., t]`` the log-weights :math:`\log\pi - \log\pi_{old}`.
        spec: the parsed estimator, which decides whether the weight is detached.
        max_weight: ``None`` (no truncation) or the cap :math:`c`, checked by :func:`check_max_weight`.

    Example:
        >>> log_w = torch.tensor([-1.0, 0.0, 3.0], requires_grad=True)
        >>> w = importance_weight(log_w, parse_estimator("k3"), max_weight=2.0)
        >>> w
        tensor([0.3679, 1.0000, 2.0000], grad_fn=<ExpBackward0>)
        >>> w.sum().backward(); log_w.grad  # d w / d log w = w: the clipped value, its gradient kept
        tensor([0.3679, 1.0000, 2.0000])
    """
    w = torch.exp(_truncated_log_weight(log_w, max_weight))
    if spec.straight_through or spec.base == "k2":
        return w.detach()
    return w
