r"""The functional API: the elementwise KL estimate and its masked reduction.

Shapes: ``b`` batch (sequences, any number of leading dims), ``t`` response length.

* :func:`kl_penalty` takes ``logprob`` and ``ref_logprob`` of shape ``[..., t]`` (any shape, the
  same for both) and returns the per-token estimate of the same shape.
* :func:`aggregate` reduces a ``[..., t]`` tensor of per-token values with a ``[..., t]`` mask to a
  scalar.

Masking is done with :func:`torch.where`, never by multiplying: a NaN or inf at a padded position
would otherwise survive as ``nan = inf * 0`` in the result or in the gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_kl.estimators import EstimatorSpec, estimator_value, parse_estimator

__all__ = ["AGG_MODES", "aggregate", "kl_penalty"]

#: The aggregation modes accepted by :func:`aggregate` (verl's names and semantics).
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def check_agg_mode(mode: object) -> str:
    """Validate an aggregation mode name; raise ``ValueError`` listing the valid ones."""
    if not isinstance(mode, str) or mode not in AGG_MODES:
        valid = ", ".join(repr(m) for m in AGG_MODES)
        raise ValueError(f"Unknown aggregation mode {mode!r}. Valid modes: {valid}.")
    return mode


def _check_floating(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}.")
    if not x.is_floating_point():
        raise TypeError(f"`{name}` must be a floating point tensor, got dtype {x.dtype}.")
    return x


def check_mask(mask: Optional[Tensor], like: Tensor, like_name: str) -> Optional[Tensor]:
    """Return ``mask`` as a bool tensor of ``like``'s shape, or raise an error naming both shapes.

    A bool mask is used as is; an integer or floating mask is read as ``mask != 0``.
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"`mask` must be a torch.Tensor or None, got {type(mask).__name__}.")
    if mask.shape != like.shape:
        raise ValueError(
            f"`mask` must have the shape of `{like_name}`: got mask {tuple(mask.shape)} "
            f"and {like_name} {tuple(like.shape)}."
        )
    if mask.device != like.device:
        raise ValueError(f"`mask` is on {mask.device} but `{like_name}` is on {like.device}.")
    return mask if mask.dtype == torch.bool else mask != 0


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the maths runs in: the inputs' promoted dtype, at least float32."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.promote_types(dtype, torch.float32)


def _kl_penalty_compute(
    logprob: Tensor,
    ref_logprob: Tensor,
    spec: EstimatorSpec,
    mask: Optional[Tensor],
    old_logprob: Optional[Tensor] = None,
) -> Tensor:
    """Per-token estimate in the compute dtype (float32 for half inputs); 0 where ``mask`` is False.

    The single dispatch point of every caller (the function, the loss, the callback). Inputs are
    checked by the caller.
    """
    dtype = compute_dtype(logprob, ref_logprob)
    zero = torch.zeros((), dtype=dtype, device=logprob.device)
    d = logprob.to(dtype) - ref_logprob.to(dtype)
    if mask is not None:
        # select before the maths so that junk at padded positions never reaches the value or
        # the gradient (where() routes an exact 0 gradient to the unselected inputs)
        d = torch.where(mask, d, zero)
    value = estimator_value(spec, d)
    if old_logprob is None:
        return value
    log_w = logprob.to(dtype) - old_logprob.to(dtype)
    if mask is not None:
        log_w = torch.where(mask, log_w, zero)
    return importance_weight(log_w, spec) * value


def importance_weight(log_w: Tensor, spec: EstimatorSpec) -> Tensor:
    r"""The weight :math:`w = \pi / \pi_{old}` of an off-policy estimate, differentiable or not.

    For tokens sampled from :math:`\pi_{old}`, with :math:`\nabla` taken w.r.t. the policy:

    * ``k1``, ``k3`` (value estimators): :math:`E_{old}[w\,k] = E_\pi[k] = \mathrm{KL}`, and with
      :math:`w` differentiable (:math:`\nabla w = w \nabla\log\pi`) the per-sample gradient is
      :math:`w\nabla\log\pi\,(k + k')`, which is :math:`w\,d\,\nabla\log\pi` for ``k3`` and
      :math:`w(d+1)\nabla\log\pi` for ``k1``: both have expectation
      :math:`E_\pi[d\,\nabla\log\pi] = \nabla\mathrm{KL}`. ``abs`` and ``low_var_kl`` follow the
      same rule (their values are biased to begin with).
    * ``k2`` and every ``+`` name (gradient estimators): their on-policy gradient
      :math:`d\,\nabla\log\pi` is already the KL gradient's sample, so the weight is *detached*:
      gradient :math:`w\,d\,\nabla\log\pi`, value :math:`w` times the base value.
    """
    w = torch.exp(log_w)
    if spec.straight_through or spec.base == "k2":
        return w.detach()
    return w


def _check_pair(logprob: object, ref_logprob: object) -> None:
    _check_floating("logprob", logprob)
    _check_floating("ref_logprob", ref_logprob)
    assert isinstance(logprob, Tensor) and isinstance(ref_logprob, Tensor)
    if logprob.shape != ref_logprob.shape:
        raise ValueError(
            "`logprob` and `ref_logprob` must have the same shape: got logprob "
            f"{tuple(logprob.shape)} and ref_logprob {tuple(ref_logprob.shape)}."
        )
    if logprob.device != ref_logprob.device:
        raise ValueError(f"`logprob` is on {logprob.device} but `ref_logprob` is on {ref_logprob.device}.")


def check_old_logprob(old_logprob: Optional[Tensor], logprob: Tensor) -> None:
    if old_logprob is None:
        return
    _check_floating("old_logprob", old_logprob)
    if old_logprob.shape != logprob.shape:
        raise ValueError(
            "`old_logprob` must have the shape of `logprob`: got old_logprob "
            f"{tuple(old_logprob.shape)} and logprob {tuple(logprob.shape)}."
        )
    if old_logprob.device != logprob.device:
        raise ValueError(f"`old_logprob` is on {old_logprob.device} but `logprob` is on {logprob.device}.")


def kl_penalty(
    logprob: Tensor,
    ref_logprob: Tensor,
    estimator: str | EstimatorSpec = "k3+",
    *,
    mask: Optional[Tensor] = None,
    old_logprob: Optional[Tensor] = None,
) -> Tensor:
    r"""Per-token estimate of :math:`\mathrm{KL}(\pi \,\|\, \pi_{\mathrm{ref}})` for sampled tokens.

    With :math:`d = \log \pi(x_t) - \log \pi_{\mathrm{ref}}(x_t)`, for example

    .. math::
        \texttt{k3}(d) = e^{-d} + d - 1, \qquad \texttt{k3+}: \text{value of k3, gradient } d.

    See :mod:`lightning_kl.estimators` for the full table of values and gradients.

    Args:
        logprob: ``[..., t]`` log-probabilities of the sampled tokens under the policy.
        ref_logprob: ``[..., t]`` log-probabilities of the same tokens under the reference.
        estimator: one of :data:`lightning_kl.ESTIMATORS` (or a parsed spec).
        mask: optional ``[..., t]`` mask, True on valid tokens. Where it is False the result is 0 with
            a zero gradient, whatever the inputs hold there (NaN, inf, -1e10 padding).
        old_logprob: optional ``[..., t]`` log-probabilities of the sampled tokens under the policy
            that sampled them (several PPO epochs per rollout, an inference engine). The estimate is
            then importance weighted by ``pi / pi_old`` so that its expected value (``k1``, ``k3``) and
            its expected gradient (``k1``, ``k3``, ``k2`` and every ``+`` name) are those of
            ``KL(pi || pi_ref)``; see :func:`importance_weight`.

    Returns:
        The per-token estimate, same shape as the inputs, in their (promoted) dtype. Half precision
        inputs are computed in float32 and the result is cast back.

    Raises:
        ValueError: for an unknown estimator name, or shapes that do not match (both are named).
        TypeError: for inputs that are not floating point tensors.

    Example:
        >>> import torch
        >>> logprob = torch.tensor([-1.0, -2.0], requires_grad=True)
        >>> ref = torch.tensor([-1.5, -1.0])
        >>> kl = kl_penalty(logprob, ref, "k3+")
        >>> kl
        tensor([0.1065, 0.7183], grad_fn=<AddBackward0>)
        >>> kl.sum().backward(); logprob.grad  # the k2 gradient: d
        tensor([ 0.5000, -1.0000])
    """
    spec = parse_estimator(estimator)
    _check_pair(logprob, ref_logprob)
    check_old_logprob(old_logprob, logprob)
    mask = check_mask(mask, logprob, "logprob")
    out_dtype = torch.promote_types(logprob.dtype, ref_logprob.dtype)
    return _kl_penalty_compute(logprob, ref_logprob, spec, mask, old_logprob).to(out_dtype)


def aggregate(
    values: Tensor,
    mask: Optional[Tensor] = None,
    mode: str = "token-mean",
    *,
    norm: Optional[float] = None,
) -> Tensor:
    r"""Reduce per-token values ``[..., t]`` to a scalar, over the positions where ``mask`` is True.

    With :math:`m` the mask, :math:`S_i = \sum_t m_{it} v_{it}` a sequence's token sum, :math:`n_i`
    its valid-token count, and :math:`B` the number of sequences with at least one valid token:

    ================================  =====================================================
    ``token-mean``                    :math:`\sum_i S_i / \sum_i n_i`
    ``token-sum``                     :math:`\sum_i S_i`
    ``seq-mean-token-sum``            :math:`\frac{1}{B}\sum_i S_i`
    ``seq-mean-token-mean``           :math:`\frac{1}{B}\sum_{i: n_i > 0} S_i / n_i`
    ``seq-mean-token-sum-norm``       :math:`\sum_i S_i / T` (Dr. GRPO, as in verl), with
                                      :math:`T` = ``norm`` or the padded length ``t``
    ================================  =====================================================

    Every leading dimension counts as a sequence dimension. With no valid token the result is 0
    (and its gradient is zero). Positions where the mask is False never reach the result or the
    gradient, even if they hold NaN or inf.

    Args:
        values: ``[..., t]`` per-token values (at least one dimension).
        mask: optional ``[..., t]`` mask (bool, or 0/1 numbers read as ``mask != 0``).
        mode: one of :data:`AGG_MODES`.
        norm: the constant divisor of ``seq-mean-token-sum-norm`` (default: ``t``); keep it fixed
            across a run (e.g. the maximum response length) to reproduce Dr. GRPO.

    Returns:
        A scalar in the values' dtype promoted to at least float32.

    Example:
        >>> v = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0]])
        >>> m = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregate(v, m, "token-mean"), aggregate(v, m, "seq-mean-token-mean")
        (tensor(2.5000), tensor(3.))
    """
    mode = check_agg_mode(mode)
    _check_floating("values", values)
    if values.ndim == 0:
        raise ValueError("`values` must have at least one (token) dimension, got a scalar.")
    mask = check_mask(mask, values, "values")
    if norm is not None and not norm > 0:
        raise ValueError(f"`norm` must be a positive number, got {norm!r}.")
    dtype = compute_dtype(values)
    v = values.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=v.device)
    if mask is not None:
        v = torch.where(mask, v, zero)
    if mode == "token-sum":
        return v.sum()
    if mode == "token-mean":
        n = v.numel() if mask is None else mask.sum()
        return v.sum() / _at_least_one(n, dtype, v.device)
    if mode == "seq-mean-token-sum-norm":
        return v.sum() / (values.shape[-1] if norm is None else norm)

    t = values.shape[-1]
    if v.numel() == 0:
        return v.sum()
    seq_sums = v.reshape(-1, t).sum(-1)
    if mask is None:
        counts = torch.full_like(seq_sums, t)
    else:
        counts = mask.reshape(-1, t).sum(-1).to(dtype)
    n_seqs = _at_least_one((counts > 0).sum(), dtype, v.device)
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / n_seqs
    # seq-mean-token-mean: empty sequences contribute 0 to the sum and nothing to the count
    return (seq_sums / counts.clamp(min=1)).sum() / n_seqs


def _at_least_one(n: Tensor | int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.as_tensor(n, dtype=dtype, device=device).clamp(min=1)
