r"""The functional API: the elementwise KL estimate and its masked reduction.

Shapes: ``b`` batch (sequences, any number of leading dims), ``t`` response length.

* :func:`kl_penalty` takes ``logprob`` and ``ref_logprob`` of shape ``[..., t]`` (any shape, the
  same for both) and returns the per-token estimate of the same shape.
* :func:`aggregate` reduces a ``[..., t]`` tensor of per-token values with a ``[..., t]`` mask to a
  scalar.

Each is a short composition of the layers below, the steps of :class:`~lightning_kl.KLPenaltyLoss`:
the inputs checked once (:mod:`lightning_kl.inputs`), the values computed (:mod:`lightning_kl.compute`),
reduced (:mod:`lightning_kl.reduce`). Masking is done with :func:`torch.where`, never by multiplying: a
NaN or inf at a padded position would otherwise survive as ``nan = inf * 0`` in the result or in the
gradient.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_kl.compute import check_max_weight, importance_weight, kl_penalty_compute, kl_penalty_values
from lightning_kl.distill.inputs import check_topk_inputs
from lightning_kl.distill.topk import TopK
from lightning_kl.estimators import EstimatorSpec, parse_estimator
from lightning_kl.ground.checks import DEFAULT_LOGPROB_SLACK, LOGPROB_SLACK
from lightning_kl.ground.sampler import Sampling
from lightning_kl.inputs import KLInputs, check_aggregate_args, check_kl_inputs, resolve_sampling
from lightning_kl.kept_inputs import check_loss_kept
from lightning_kl.logprobs import FromHidden
from lightning_kl.reduce import AGG_MODES, AggMode, aggregate_checked, aggregate_counts_checked, check_agg_mode
from lightning_kl.sequence import check_kl_to_go, check_level

__all__ = [
    "AGG_MODES",
    "DEFAULT_LOGPROB_SLACK",
    "LOGPROB_SLACK",
    "AggMode",
    "aggregate",
    "aggregate_counts",
    "importance_weight",
    "kl_penalty",
    "kl_penalty_compute",
]


def kl_penalty(
    logprob: Tensor,
    ref_logprob: Tensor,
    estimator: str | EstimatorSpec = "k3+",
    *,
    mask: Optional[Tensor] = None,
    old_logprob: Optional[Tensor] = None,
    max_weight: Optional[float] = None,
    temperature: Optional[float] = None,
    level: str = "token",
    sampled_logprob: Optional[Tensor] = None,
    kl_to_go: str = "k1",
    sampling: Optional[Sampling] = None,
    kept: Any = None,
) -> Tensor:
    r"""Per-token estimate of :math:`\mathrm{KL}(\pi \,\|\, \pi_{\mathrm{ref}})` for sampled tokens.

    With :math:`d = \log \pi(x_t) - \log \pi_{\mathrm{ref}}(x_t)`, for example

    .. math::
        \texttt{k3}(d) = e^{-d} + d - 1, \qquad \texttt{k3+}: \text{value of k3, gradient } d.

    See :mod:`lightning_kl.estimators` for the full table of values and gradients.

    With ``estimator="full"`` the inputs are both models' *logits* ``[..., V]`` instead (or one
    :class:`~lightning_kl.FromHidden` each: hidden states and LM head, the logits made chunk by chunk),
    ``mask`` is ``[...]``, and the result ``[...]`` is the exact KL over the vocabulary of the policy's
    distribution as ``sampling`` draws from it (``softmax(logits / T)``, truncated and renormalized by
    top-k, top-p, min-p) to ``softmax(ref_logits / T)``, with its exact gradient, computed by chunks in
    bounded memory. ``old_logprob`` is rejected there: the exact KL needs no importance weights.
    ``[b, t]`` inputs without a mask are refused there (log-probs where logits belong).

    Every valid log-prob must be ``<= 0`` (beyond rounding): logits gathered at the tokens are refused.

    Args:
        logprob: ``[..., t]`` log-probabilities of the sampled tokens under the policy.
        ref_logprob: ``[..., t]`` log-probabilities of the same tokens under the reference.
        estimator: one of the names of :data:`lightning_kl.EstimatorName`.
        mask: optional ``[..., t]`` mask, True on valid tokens. Where it is False the result is 0 with
            a zero gradient, whatever the inputs hold there (NaN, inf, -1e10 padding).
        old_logprob: optional ``[..., t]`` log-probabilities of the sampled tokens under the policy
            that sampled them (several PPO epochs per rollout, an inference engine). The estimate is
            then importance weighted by ``pi / pi_old`` so that its expected value (``k1``, ``k3``,
            ``k1+``, ``k3+``) and
            its expected gradient (``k1``, ``k3``, ``k2`` and every ``+`` name) are those of
            ``KL(pi || pi_ref)``; see :func:`importance_weight`.
        max_weight: optional cap ``c >= 1`` of the importance weights (truncated importance sampling,
            ``w -> min(w, c)``): bounds the variance at the price of a bias, documented exactly in
            :func:`importance_weight`. Ignored without ``old_logprob``.
        temperature: deprecated, ``sampling=lk.Sampling(temperature=T)`` (a ``DeprecationWarning``).
        sampling: ``full`` only: the sampler, an :class:`~lightning_kl.Sampling` (default: plain
            softmax at T = 1). Sampled estimators take log-probs already computed under the sampler,
            so any other sampler is an error for them: compute both models' log-probs with it.
        level: ``"token"`` (default): each token's KL given its prefix. ``"sequence"``: the KL of
            whole responses along the last dimension. The values are the token level's on-policy
            (``rho_{1:t}`` times them with ``old_logprob``: per-decision weights), and the gradient
            gains the KL-to-go term ``grad log pi_t * sum_{s > t} d_s`` of every valid token, so
            that the expected gradient is that of the responses' KL for ``k2`` and every ``+`` name
            (and ``k1``, ``k3`` with ``old_logprob``); aggregate with ``token-sum``,
            ``seq-mean-token-sum`` or ``seq-mean-token-sum-norm`` (``token-mean`` when the token
            count is fixed). Derivations: :mod:`lightning_kl.sequence`. With ``full`` (on-policy) it
            needs ``sampled_logprob``.
        sampled_logprob: ``full`` at ``level="sequence"`` only: ``[..., t]`` the policy's log-probs of
            the sampled tokens under ``sampling``'s processed distribution (differentiable:
            ``lk.token_logprobs(logits, tokens, sampling=sampling)``), whose score carries the KL-to-go
            term; the future term is then the exact KL of the later positions.
        kl_to_go: sampled estimators at ``level="sequence"``: ``"k1"`` (default), the KL-to-go as the
            sum of the later log-ratios ``d_s``, or ``"k3"``, the sum of their ``k3`` values: the same
            expectation (exact) with less noise. See :data:`lightning_kl.sequence.KL_TO_GO`.
        kept: ``full`` only: replay, the rollout's recorded kept sets (``return_kept=True``): the policy
            renormalized on them instead of its own kept set now, as :class:`~lightning_kl.KLPenaltyLoss`'s
            ``kept`` (there: what is refused).

    Returns:
        The per-token estimate, same shape as the inputs, in their (promoted) dtype. Half precision
        inputs are computed in float32 and the result is cast back.

    Raises:
        ValueError: for an unknown estimator name or level, a bad ``max_weight``, ``full`` at
            ``level="sequence"`` without ``sampled_logprob`` (or it anywhere else), or shapes that do
            not match (both are named).
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
    # the settings, then the loss's steps: validate (one call) -> compute (one call) -> the inputs' dtype
    spec = parse_estimator(estimator)
    max_weight = check_max_weight(max_weight)
    level = check_level(level)
    kl_to_go = check_kl_to_go(kl_to_go, level, spec.base == "full")
    sampling = resolve_sampling(sampling, temperature, spec.name, "kl_penalty")
    checked = sampling if kept is None else Sampling(sampling.temperature)  # a record replaces the truncation
    topk = isinstance(logprob, TopK) or isinstance(ref_logprob, TopK)  # a teacher's lk.TopK: its own checks
    check = check_topk_inputs if topk else check_kl_inputs
    inputs = check(logprob, ref_logprob, spec, mask, old_logprob, sampled_logprob, level, checked)
    if kept is not None:
        kept = check_loss_kept(kept, inputs, spec, False, sampling.temperature)
    kl = kl_penalty_values(inputs, spec, max_weight, level, kl_to_go, sampling, kept=kept)
    return kl.to(_out_dtype(inputs))


def _out_dtype(inputs: KLInputs) -> torch.dtype:
    # the inputs' promoted dtype (the heads' for hidden states, at least float32 there, as for a teacher's lk.TopK)
    x, ref_x = inputs.logprob, inputs.ref_logprob
    if isinstance(x, FromHidden) or isinstance(ref_x, TopK):
        return inputs.dtype
    return torch.promote_types(getattr(x, "local", x).dtype, getattr(ref_x, "local", ref_x).dtype)


def aggregate(
    values: Tensor,
    mask: Optional[Tensor] = None,
    mode: str = "token-mean",
    *,
    norm: Optional[float] = None,
    num_tokens: Optional[Tensor | float] = None,
    num_seqs: Optional[Tensor | float] = None,
    world_size: int = 1,
) -> Tensor:
    r"""Reduce per-token values ``[..., t]`` to a scalar, over the positions where ``mask`` is True.

    With :math:`m` the mask, :math:`S_i = \sum_t m_{it} v_{it}` a sequence's token sum, :math:`n_i`
    its valid-token count, :math:`N = \sum_i n_i` (or ``num_tokens``), :math:`B` the number of
    sequences with at least one valid token (or ``num_seqs``) and :math:`W` = ``world_size``:

    ================================  =====================================================
    ``token-mean``                    :math:`W \sum_i S_i / N`
    ``token-sum``                     :math:`W \sum_i S_i`
    ``seq-mean-token-sum``            :math:`\frac{W}{B}\sum_i S_i`
    ``seq-mean-token-mean``           :math:`\frac{W}{B}\sum_{i: n_i > 0} S_i / n_i`
    ``seq-mean-token-sum-norm``       :math:`W \sum_i S_i / T` (Dr. GRPO, as in verl), with
                                      :math:`T` = ``norm`` or the padded length ``t``
    ================================  =====================================================

    Every leading dimension counts as a sequence dimension. With no valid token the result is 0
    (and its gradient is zero). Positions where the mask is False never reach the result or the
    gradient, even if they hold NaN or inf.

    ``num_tokens``, ``num_seqs`` and ``world_size`` exist for data parallel training (as verl's
    ``agg_loss`` with the global token count and ``dp_size``): DDP *averages* the gradients of
    the ``W`` processes, so a process that divides by the global counts and multiplies by ``W``
    gets, after averaging, exactly the gradient of one process over the global batch, whatever
    each process holds. This function does no communication: the caller reduces the counts
    (:class:`~lightning_kl.KLPenaltyLoss` does it with ``global_batch=True``).

    Args:
        values: ``[..., t]`` per-token values (at least one dimension).
        mask: optional ``[..., t]`` mask (bool, or 0/1 numbers read as ``mask != 0``).
        mode: one of :data:`lightning_kl.AggMode`'s modes.
        norm: the constant divisor of ``seq-mean-token-sum-norm`` (default: ``t``); keep it fixed
            across a run (e.g. the maximum response length) to reproduce Dr. GRPO.
        num_tokens: the divisor of ``token-mean`` in place of this batch's valid-token count,
            e.g. the count summed over every process (a number or a 0-d tensor; at least 1 is used).
        num_seqs: the divisor of the ``seq-mean-*`` modes in place of this batch's count of
            sequences with a valid token, e.g. summed over every process.
        world_size: a positive integer multiplying the result: the number of processes whose
            gradients are averaged.

    Returns:
        A scalar in the values' dtype promoted to at least float32.

    Raises:
        ValueError: for an unknown mode, a scalar ``values``, a mask that does not fit (both shapes
            are named), or a bad ``norm``, ``num_tokens``, ``num_seqs`` or ``world_size``.

    Example:
        >>> v = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0]])
        >>> m = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregate(v, m, "token-mean"), aggregate(v, m, "seq-mean-token-mean")
        (tensor(2.5000), tensor(3.))
        >>> aggregate(v, m, "token-mean", num_tokens=8, world_size=2)  # 2 * 10 / 8
        tensor(2.5000)
    """
    mode = check_agg_mode(mode)
    mask = check_aggregate_args(values, mask, norm, num_tokens, num_seqs, world_size)
    return aggregate_checked(values, mask, mode, norm, num_tokens, num_seqs, world_size)


def aggregate_counts(values: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """This batch's ``[valid tokens, sequences with a valid token]``: a detached int64 ``[2]`` tensor.

    The local counts that :func:`aggregate` divides by; sum them over processes (one
    ``all_reduce``) and pass them back as ``num_tokens`` and ``num_seqs``.
    """
    return aggregate_counts_checked(values, check_aggregate_args(values, mask, None, None, None, 1))
