r"""The rollout engine is not the trainer: the mismatch between their log-probs, measured and corrected.

Notation: ``b`` sequences (every leading dimension counts as one), ``t`` response length. For the
tokens the rollout engine sampled, ``logprob`` is the trainer's log-prob :math:`\log\pi(x_t)` and
``rollout_logprob`` the engine's :math:`\log\mu(x_t)`; the per-token log-ratio is

.. math::
    \ell_t = \log\rho_t = \log\pi(x_t) - \log\mu(x_t), \qquad \rho_t = \pi(x_t) / \mu(x_t),

set to 0 wherever the mask is False (before any maths, so that NaN or inf at padded positions never
reach a value). A sequence with no valid token counts nowhere: not as a sequence of perplexity 1
(as verl's batch means count it), not in a sequence mean.

This module holds the maths as plain functions, without a host read (no ``.item()``, no branch on
tensor values): the metrics as float64 sums, counts, maxima and minima (:func:`mismatch_totals`)
and their division (:func:`mismatch_compute`), so that :class:`~lightning_kl.MismatchMetric` reduces
the same states across processes exactly; the importance weights (:func:`importance_weights`), the
rejection by divergence (:func:`rejection_keep`), the DeepSeek-V3.2 off-policy sequence mask
(:func:`offpolicy_keep`) and the batch normalization (:func:`normalize_weights`).
:class:`~lightning_kl.RolloutCorrection` is the configured shell around them.

The estimators are this package's (:func:`lightning_kl.estimators.base_value`): verl's rejection
statistics ``k1``, ``k2``, ``k3`` and its ``k3_kl`` are ``k1``, ``k2`` and ``k3`` of :math:`-\ell`
or :math:`\ell`; ``k3`` saturates at :math:`|\ell| = 20` as everywhere in the package (verl's
``k3_kl`` diagnostic does not clamp; the two differ only beyond that).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_kl.estimators import base_value
from lightning_kl.ground.checks import check_logprobs, check_mask, check_matching, compute_dtype

__all__ = [
    "LOG_RATIO_BOUND",
    "METRIC_KEYS",
    "REJECTION_OPTIONS",
    "TOTALS_REDUCTIONS",
    "WEIGHT_LEVELS",
    "WEIGHT_MODES",
    "RejectionOption",
    "check_mismatch_inputs",
    "dtype_of",
    "importance_weights",
    "log_ratio",
    "mismatch_compute",
    "mismatch_metrics",
    "mismatch_totals",
    "normalize_weights",
    "offpolicy_keep",
    "parse_rejection",
    "rejection_keep",
    "weight_mean_terms",
    "weight_metrics",
]

#: Log-weights are clamped to ``[-20, 20]`` before ``exp`` (verl's ``SAFETY_BOUND``).
LOG_RATIO_BOUND = 20.0

#: The levels of an importance weight: each token's ratio, the sequence's product of ratios, or
#: their geometric mean (the product to the power ``1 / n``).
WEIGHT_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")

#: What happens to a weight outside ``[lower, upper]``: ``"truncate"`` clamps it (TIS), ``"mask"``
#: sets it to 0 (IcePop, MIS).
WEIGHT_MODES: tuple[str, ...] = ("truncate", "mask")

#: verl's rejection options (``rollout_rs``): a divergence per token, or its sum, mean or maximum
#: over the sequence; ``k1`` is bounded on both sides, the others from above.
REJECTION_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)

#: The keys of :func:`mismatch_metrics`, by the stack that defines them (formulas: ``docs/mismatch.md``).
METRIC_KEYS: tuple[str, ...] = (
    # verl (compute_offpolicy_metrics)
    "training_ppl",
    "training_log_ppl",
    "kl",
    "k3_kl",
    "rollout_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
    # NeMo-RL (ClippedPGLossFn, kl_type "k3")
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    # TRL (the sampling/ metrics of GRPOTrainer), before any truncation
    "logp_abs_diff_mean",
    "logp_abs_diff_max",
    "ratio_min",
    "ratio_mean",
    "ratio_max",
)

_F64 = torch.float64

#: How each state of :func:`mismatch_totals` combines across batches and processes.
TOTALS_REDUCTIONS: dict[str, str] = {
    "tokens": "sum",
    "sequences": "sum",
    "log_ratio_sum": "sum",
    "k3_kl_sum": "sum",
    "policy_kl_sum": "sum",
    "abs_sum": "sum",
    "mult_prob_error_sum": "sum",
    "ratio_sum": "sum",
    "rho2_sum": "sum",
    "training_log_ppl_sum": "sum",
    "training_ppl_sum": "sum",
    "rollout_log_ppl_sum": "sum",
    "rollout_ppl_sum": "sum",
    "log_ppl_diff_sum": "sum",
    "log_ppl_abs_diff_sum": "sum",
    "ppl_ratio_sum": "sum",
    "rho2_seq_sum": "sum",
    "log_ratio_max": "max",
    "log_ratio_min": "min",
    "abs_max": "max",
    "log_ppl_diff_max": "max",
    "log_ppl_diff_min": "min",
}


def check_mismatch_inputs(logprob: Any, rollout_logprob: Any, mask: Any) -> Optional[Tensor]:
    """Both log-probs floating tensors ``[..., t]`` of one shape, ``<= 0`` at valid positions; the mask
    (bool) of that shape or None.

    The value check is the loss's (:func:`lightning_kl.ground.checks.check_logprobs`): a log-prob
    above 0 (logits gathered at the tokens, the usual mistake) is refused, with no host read off the CPU.

    Raises:
        TypeError, ValueError: naming the argument and the shapes, or a log-prob above 0.
    """
    check_matching("logprob", logprob, "rollout_logprob", rollout_logprob)
    if logprob.ndim == 0:
        raise ValueError("`logprob` and `rollout_logprob` need a token dimension (the last one), got 0-d tensors.")
    mask = check_mask(mask, logprob, "logprob")
    check_logprobs({"logprob": logprob, "rollout_logprob": rollout_logprob}, mask)
    return mask


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x


def _valid(mask: Optional[Tensor], like: Tensor) -> Tensor:
    return torch.ones(like.shape, dtype=torch.bool, device=like.device) if mask is None else mask


def log_ratio(logprob: Tensor, rollout_logprob: Tensor, mask: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    r"""``logprob - rollout_logprob`` in ``dtype``, detached, 0 where ``mask`` is False (junk never read)."""
    lr = logprob.detach().to(dtype) - rollout_logprob.detach().to(dtype)
    if mask is None:
        return lr
    return torch.where(mask, lr, torch.zeros((), dtype=dtype, device=lr.device))


def _masked_max(x: Tensor, keep: Tensor) -> Tensor:
    if x.numel() == 0:
        return torch.full((), -math.inf, dtype=x.dtype, device=x.device)
    return torch.where(keep, x, torch.full((), -math.inf, dtype=x.dtype, device=x.device)).amax()


def _masked_min(x: Tensor, keep: Tensor) -> Tensor:
    return -_masked_max(-x, keep)


def mismatch_totals(logprob: Tensor, rollout_logprob: Tensor, mask: Optional[Tensor]) -> dict[str, Tensor]:
    """The float64 sums, int64 counts and maxima/minima behind :func:`mismatch_metrics` (inputs checked).

    Every state combines across batches and processes by :data:`TOTALS_REDUCTIONS`; a batch with no
    valid token gives zero sums and counts and infinite maxima and minima (the neutral elements).
    """
    lp, ro = _rows(logprob.detach().to(_F64)), _rows(rollout_logprob.detach().to(_F64))
    m = _rows(_valid(mask, logprob))
    zero = torch.zeros((), dtype=_F64, device=lp.device)
    lp, ro = torch.where(m, lp, zero), torch.where(m, ro, zero)
    lr = lp - ro
    n = m.sum(-1)
    valid = n > 0
    nf = n.clamp(min=1).to(_F64)

    def tsum(v: Tensor) -> Tensor:
        return torch.where(m, v, zero).sum()

    def ssum(v: Tensor) -> Tensor:
        return torch.where(valid, v, zero).sum()

    mean_lp, mean_ro = lp.sum(-1) / nf, ro.sum(-1) / nf
    diff = mean_ro - mean_lp  # log(training ppl / rollout ppl) of each sequence
    rho2 = torch.exp(2.0 * lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    rho2_seq = torch.exp(2.0 * lr.sum(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return {
        "tokens": n.sum(),
        "sequences": valid.sum(),
        "log_ratio_sum": tsum(lr),
        "k3_kl_sum": tsum(base_value("k3", -lr)),  # exp(l) - l - 1: KL(mu || pi) for tokens from mu
        "policy_kl_sum": tsum(base_value("k3", lr)),  # exp(-l) + l - 1
        "abs_sum": tsum(lr.abs()),
        "mult_prob_error_sum": tsum(torch.exp(lr.abs())),
        "ratio_sum": tsum(torch.exp(lr)),
        "rho2_sum": tsum(rho2),
        "training_log_ppl_sum": ssum(-mean_lp),
        "training_ppl_sum": ssum(torch.exp(-mean_lp)),
        "rollout_log_ppl_sum": ssum(-mean_ro),
        "rollout_ppl_sum": ssum(torch.exp(-mean_ro)),
        "log_ppl_diff_sum": ssum(diff),
        "log_ppl_abs_diff_sum": ssum(diff.abs()),
        "ppl_ratio_sum": ssum(torch.exp(diff)),
        "rho2_seq_sum": ssum(rho2_seq),
        "log_ratio_max": _masked_max(lr, m),
        "log_ratio_min": _masked_min(lr, m),
        "abs_max": _masked_max(lr.abs(), m),
        "log_ppl_diff_max": _masked_max(diff, valid),
        "log_ppl_diff_min": _masked_min(diff, valid),
    }


def mismatch_compute(totals: dict[str, Tensor]) -> dict[str, Tensor]:
    """The metrics (:data:`METRIC_KEYS`, float64) from :func:`mismatch_totals`; NaN where no data."""
    n = totals["tokens"].to(_F64)
    b = totals["sequences"].to(_F64)
    nan = torch.full((), math.nan, dtype=_F64, device=n.device)

    def tmean(key: str) -> Tensor:
        return totals[key] / n  # 0 / 0 = NaN: no token, no data

    def smean(key: str) -> Tensor:
        return totals[key] / b

    def seen(x: Tensor, count: Tensor) -> Tensor:
        return torch.where(count > 0, x, nan)

    return {
        "training_ppl": smean("training_ppl_sum"),
        "training_log_ppl": smean("training_log_ppl_sum"),
        "kl": -tmean("log_ratio_sum"),
        "k3_kl": tmean("k3_kl_sum"),
        "rollout_ppl": smean("rollout_ppl_sum"),
        "rollout_log_ppl": smean("rollout_log_ppl_sum"),
        "log_ppl_diff": smean("log_ppl_diff_sum"),
        "log_ppl_abs_diff": smean("log_ppl_abs_diff_sum"),
        "log_ppl_diff_max": seen(totals["log_ppl_diff_max"], b),
        "log_ppl_diff_min": seen(totals["log_ppl_diff_min"], b),
        "ppl_ratio": smean("ppl_ratio_sum"),
        "chi2_token": tmean("rho2_sum") - 1.0,
        "chi2_seq": smean("rho2_seq_sum") - 1.0,
        "token_mult_prob_error": tmean("mult_prob_error_sum"),
        "gen_kl_error": tmean("k3_kl_sum"),
        "policy_kl_error": tmean("policy_kl_sum"),
        "logp_abs_diff_mean": tmean("abs_sum"),
        "logp_abs_diff_max": seen(totals["abs_max"], n),
        "ratio_min": seen(torch.exp(totals["log_ratio_min"]), n),
        "ratio_mean": tmean("ratio_sum"),
        "ratio_max": seen(torch.exp(totals["log_ratio_max"]), n),
    }


def mismatch_metrics(logprob: Tensor, rollout_logprob: Tensor, mask: Optional[Tensor] = None) -> dict[str, Tensor]:
    r"""How far the trainer's log-probs are from the rollout engine's, by every stack's diagnostics.

    With :math:`\ell_t = \log\pi - \log\mu` on the valid tokens (``N`` of them), :math:`n_i` a
    sequence's valid tokens, :math:`\bar\ell^{\pi}_i`, :math:`\bar\ell^{\mu}_i` its mean log-probs and
    ``B`` the sequences with a valid token, for example

    .. math::
        \texttt{kl} = -\tfrac1N\textstyle\sum_t \ell_t, \quad
        \texttt{k3\_kl} = \tfrac1N\sum_t (e^{\ell_t} - \ell_t - 1), \quad
        \texttt{log\_ppl\_diff} = \tfrac1B\sum_i (\bar\ell^{\mu}_i - \bar\ell^{\pi}_i), \quad
        \texttt{chi2\_seq} = \tfrac1B\sum_i e^{2\sum_t \ell_{it}} - 1.

    Every key and formula, and which stack calls it what: ``docs/mismatch.md``. verl's keys have
    verl's definitions (``compute_offpolicy_metrics``), NeMo-RL's ``token_mult_prob_error``,
    ``gen_kl_error`` (:math:`\mathrm{KL}(\mu\|\pi)`) and ``policy_kl_error``
    (:math:`\mathrm{KL}(\pi\|\mu)`) theirs with the ``k3`` estimator, TRL's absolute log-prob
    difference and importance ratio statistics theirs, before any truncation.

    Args:
        logprob: ``[..., t]`` the trainer's log-probs of the sampled tokens (detached here).
        rollout_logprob: ``[..., t]`` the rollout engine's log-probs of the same tokens.
        mask: optional ``[..., t]`` mask, True on response tokens. Padded positions may hold anything.

    Returns:
        A dict of 0-d float64 tensors (:data:`METRIC_KEYS`), computed on the device without a host
        read. With no valid token every value is NaN (no data, not a mismatch of 0).

    Raises:
        TypeError, ValueError: for inputs that are not floating tensors of one shape, or a bad mask.

    Example:
        >>> lp = torch.tensor([[-1.0, -2.0, 0.0]]); ro = torch.tensor([[-1.5, -2.0, float("nan")]])
        >>> m = mismatch_metrics(lp, ro, torch.tensor([[True, True, False]]))
        >>> m["kl"], m["logp_abs_diff_max"], m["ratio_max"]
        (tensor(-0.2500, dtype=torch.float64), tensor(0.5000, dtype=torch.float64), tensor(1.6487, dtype=torch.float64))
    """
    mask = check_mismatch_inputs(logprob, rollout_logprob, mask)
    return mismatch_compute(mismatch_totals(logprob, rollout_logprob, mask))


# ---------------------------------------------------------------------------------------------
# importance weights


def _level_log_weight(lr: Tensor, mask: Tensor, level: str) -> Tensor:
    """Each token's log-weight at ``level`` (``lr`` already 0 at padding), clamped to +-20."""
    if level == "token":
        lw = lr
    else:
        total = lr.sum(-1, keepdim=True)
        if level == "geometric":
            total = total / mask.sum(-1, keepdim=True).clamp(min=1).to(lr.dtype)
        lw = total.expand_as(lr)
    return lw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def importance_weights(
    lr: Tensor, mask: Tensor, level: str, mode: str, lower: Optional[float], upper: Optional[float]
) -> tuple[Tensor, Tensor]:
    r"""The raw and the processed importance weights ``[..., t]``, 0 at padded positions.

    The raw weight is :math:`e^{\ell_t}` (``"token"``), :math:`e^{\sum_t \ell_t}` (``"sequence"``) or
    :math:`e^{\frac1n\sum_t \ell_t}` (``"geometric"``), its log clamped to :math:`[-20, 20]`. Then
    ``"truncate"`` clamps it to ``[lower, upper]`` (a bound of None is no bound) and ``"mask"``
    sets it to 0 outside ``[lower, upper]`` (both bounds inclusive).

    Args:
        lr: ``[..., t]`` the log-ratios :math:`\ell`, 0 where ``mask`` is False (:func:`log_ratio`).
        mask: ``[..., t]`` bool, the valid tokens.
        level, mode: one of :data:`WEIGHT_LEVELS`, :data:`WEIGHT_MODES` (checked by the caller).
        lower, upper: the bounds, or None.
    """
    zero = torch.zeros((), dtype=lr.dtype, device=lr.device)
    raw = torch.where(mask, torch.exp(_level_log_weight(lr, mask, level)), zero)
    if mode == "truncate":
        w = raw if lower is None and upper is None else raw.clamp(min=lower, max=upper)
    else:
        keep = torch.ones_like(mask)
        if lower is not None:
            keep = keep & (raw >= lower)
        if upper is not None:
            keep = keep & (raw <= upper)
        w = torch.where(keep, raw, zero)
    return raw, torch.where(mask, w, zero)


def _per_sequence(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each sequence's mean of ``values`` over its valid tokens, and which sequences have one."""
    n = mask.sum(-1)
    total = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(-1)
    return total / n.clamp(min=1).to(values.dtype), n > 0


def weight_metrics(
    raw: Tensor,
    weights: Tensor,
    lr: Tensor,
    mask: Tensor,
    level: str,
    mode: str,
    lower: Optional[float],
    upper: Optional[float],
) -> dict[str, Tensor]:
    r"""verl's statistics of the weights (``compute_is_metrics``), over valid tokens and sequences only.

    ``rollout_is_mean`` is the token mean of the weights; ``_max``/``_min`` their extremes (at the
    sequence levels: of the raw sequence weight, before truncation, as verl); ``_std`` and
    ``_eff_sample_size`` (:math:`\bar w^2 / \overline{w^2}`, in ``(0, 1]``) of the weights;
    ``_ratio_fraction_high``/``_low`` the share of tokens (sequences) whose raw weight is above
    ``upper`` / below ``lower`` (default ``1 / upper``); ``_oob_ratio`` (``"mask"``) the share of
    tokens whose weight was zeroed.
    """
    f = weights.dtype
    zero = torch.zeros((), dtype=f, device=weights.device)
    n = mask.sum().to(f)

    def tmean(v: Tensor) -> Tensor:
        return torch.where(mask, v.to(f), zero).sum() / n

    low = lower if lower is not None else (1.0 / upper if upper is not None else None)
    out: dict[str, Tensor] = {"rollout_is_mean": tmean(weights)}
    if level == "token":
        out["rollout_is_max"] = _masked_max(weights, mask)
        out["rollout_is_min"] = _masked_min(weights, mask)
        high_frac = tmean(raw > upper) if upper is not None else zero
        low_frac = tmean(raw < low) if low is not None else zero
    else:
        valid = mask.any(-1)
        unclamped = lr.sum(-1) if level == "sequence" else _per_sequence(lr, mask)[0]
        b = valid.sum().to(f)
        out["rollout_is_max"] = torch.exp(_masked_max(unclamped, valid).clamp(max=LOG_RATIO_BOUND))
        out["rollout_is_min"] = torch.exp(_masked_min(unclamped, valid))
        high_frac = (valid & (unclamped > math.log(upper))).sum().to(f) / b if upper is not None else zero
        low_frac = (valid & (unclamped < math.log(low))).sum().to(f) / b if low is not None else zero
    out["rollout_is_ratio_fraction_high"] = high_frac
    out["rollout_is_ratio_fraction_low"] = low_frac
    mean = out["rollout_is_mean"]
    out["rollout_is_std"] = torch.sqrt((tmean(weights.square()) - mean.square()).clamp(min=0.0))
    out["rollout_is_eff_sample_size"] = mean.square() / tmean(weights.square())
    if mode == "mask":
        out["rollout_is_oob_ratio"] = tmean(_outside(raw, lower, upper))
    return out


def _outside(raw: Tensor, lower: Optional[float], upper: Optional[float]) -> Tensor:
    out = torch.zeros_like(raw, dtype=torch.bool)
    if lower is not None:
        out = out | (raw < lower)
    if upper is not None:
        out = out | (raw > upper)
    return out


def weight_mean_terms(weights: Tensor, mask: Tensor, level: str) -> Tensor:
    """``[sum, count]`` (float64) of the batch mean that normalization divides by: over valid tokens
    (``"token"``), or over the sequences with a valid token of their weight (the other levels).

    A data parallel caller sums this vector over the group before :func:`normalize_weights`.
    """
    if level == "token":
        zero = torch.zeros((), dtype=_F64, device=weights.device)
        return torch.stack([torch.where(mask, weights.to(_F64), zero).sum(), mask.sum().to(_F64)])
    seq, valid = _per_sequence(weights.to(_F64), mask)
    return torch.stack([torch.where(valid, seq, torch.zeros_like(seq)).sum(), valid.sum().to(_F64)])


def normalize_weights(weights: Tensor, terms: Tensor) -> tuple[Tensor, Tensor]:
    """The weights divided by their batch mean ``terms[0] / terms[1]`` when it exceeds 1e-8 (verl's rule),
    and the factor used (1 otherwise)."""
    mean = terms[0] / terms[1]
    factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
    return weights / factor.to(weights.dtype), factor


# ---------------------------------------------------------------------------------------------
# rejection


@dataclass(frozen=True)
class RejectionOption:
    """One parsed rejection criterion: a name of :data:`REJECTION_OPTIONS` and its bounds.

    ``k1`` options keep :math:`\\log(\\text{lower}) \\le s \\le \\log(\\text{upper})` (bounds on the ratio
    :math:`\\mu / \\pi`); the others keep :math:`s \\le \\text{upper}`.
    """

    name: str
    upper: float
    lower: Optional[float] = None


def _threshold_list(spec: Any) -> list[str]:
    if isinstance(spec, bool) or spec is None:
        raise TypeError(f"a rejection threshold must be a number or a string, got {spec!r}.")
    if isinstance(spec, (int, float)):
        return [repr(float(spec))]
    if isinstance(spec, str):
        return [part.strip() for part in spec.split(",") if part.strip()]
    if isinstance(spec, Sequence):
        out: list[str] = []
        for item in spec:
            out += _threshold_list(item)
        return out
    raise TypeError(f"a rejection threshold must be a number, a string or a list of them, got {type(spec).__name__}.")


def _positive(option: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"rejection threshold {text!r} of option {option!r} is not a number.") from None
    if not value > 0:  # NaN too; inf is no bound
        raise ValueError(f"rejection thresholds must be positive, got {text!r} for option {option!r}.")
    return value


def parse_rejection(options: Any, thresholds: Any) -> tuple[RejectionOption, ...]:
    """Parse verl's ``rollout_rs`` (comma-separated string or list) and ``rollout_rs_threshold``.

    One threshold is shared by every option, or there is one per option, in order (a string with
    commas, or a list). A ``k1`` option takes ``"lower_upper"`` ratio bounds, or one ``upper`` (lower
    ``1 / upper``); the others take one upper bound. Duplicated options count once.

    Raises:
        ValueError: for an unknown option (the valid ones listed), a missing, non-positive or
            misplaced threshold, or ``lower > upper``.
    """
    if isinstance(options, str):
        names = [o.strip() for o in options.split(",") if o.strip()]
    elif isinstance(options, Sequence) and all(isinstance(o, str) for o in options):
        names = [o.strip() for o in options]
    else:
        raise TypeError(f"`rejection` must be a string (comma-separated) or a list of strings, got {options!r}.")
    if not names:
        raise ValueError(f"`rejection` names no option; valid options: {', '.join(REJECTION_OPTIONS)}.")
    unique: list[str] = []
    for name in names:
        if name not in REJECTION_OPTIONS:
            raise ValueError(f"unknown rejection option {name!r}; valid options: {', '.join(REJECTION_OPTIONS)}.")
        if name not in unique:
            unique.append(name)
    if thresholds is None:
        raise ValueError(f"rejection {','.join(unique)} needs a `rejection_threshold`.")
    specs = _threshold_list(thresholds)
    if len(specs) == 1:
        specs = specs * len(unique)
    if len(specs) != len(unique):
        raise ValueError(
            f"{len(specs)} rejection thresholds for {len(unique)} options ({', '.join(unique)}): give one shared "
            "threshold or one per option."
        )
    out = []
    for name, spec in zip(unique, specs):
        if name.endswith("k1"):
            if "_" in spec:
                lo, hi = spec.split("_", 1)
                lower, upper = _positive(name, lo), _positive(name, hi)
            else:
                upper = _positive(name, spec)
                lower = 1.0 / upper
            if lower > upper:
                raise ValueError(f"rejection threshold {spec!r} of option {name!r} has lower > upper.")
            out.append(RejectionOption(name, upper, lower))
        else:
            if "_" in spec:
                raise ValueError(
                    f"option {name!r} takes one upper bound, not the range {spec!r} ('lower_upper' is for the k1 options)."
                )
            out.append(RejectionOption(name, _positive(name, spec)))
    return tuple(out)


def _rejection_statistic(option: str, lr: Tensor, mask: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """The per-token statistic (a sequence's broadcast) and the per-sequence one (None at token level)."""
    safe = lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    estimator = option[-2:]
    # verl's k1 = -l, k2 = l^2 / 2, k3 = e^l - 1 - l: this package's k1, k2, k3 of d = -l
    token = base_value(estimator, -safe)
    zero = torch.zeros((), dtype=token.dtype, device=token.device)
    if option.startswith("token"):
        return token, None
    if option.startswith("seq_sum"):
        seq = torch.where(mask, token, zero).sum(-1)
    elif option.startswith("seq_mean"):
        seq = _per_sequence(token, mask)[0]
    else:
        top = torch.where(mask, token, torch.full((), -math.inf, dtype=token.dtype, device=token.device)).amax(-1)
        seq = torch.where(mask.any(-1), top, zero)
    return seq.unsqueeze(-1).expand_as(token), seq


def rejection_keep(lr: Tensor, mask: Tensor, options: Sequence[RejectionOption]) -> tuple[Tensor, dict[str, Tensor]]:
    """The tokens every option keeps (``[..., t]`` bool, within ``mask``) and verl's statistics per option.

    Args:
        lr: ``[b, t]`` the log-ratios, 0 where ``mask`` is False.
        mask: ``[b, t]`` bool.
        options: parsed by :func:`parse_rejection`.

    Returns:
        ``(keep, metrics)``: ``metrics`` has, per option, ``rollout_rs_{name}_mean`` (the token mean of
        the statistic), ``_max``, ``_min`` (over tokens, or sequences for a sequence option),
        ``_masked_fraction`` (valid tokens it rejects) and ``_seq_masked_fraction`` (sequences in
        which it rejects a token); then ``rollout_rs_masked_fraction`` and
        ``rollout_rs_seq_masked_fraction`` for all options together.
    """
    f = lr.dtype
    zero = torch.zeros((), dtype=f, device=lr.device)
    n = mask.sum().to(f)
    valid = mask.any(-1)
    b = valid.sum().to(f)
    keep = mask.clone()
    metrics: dict[str, Tensor] = {}
    for opt in options:
        stat, seq = _rejection_statistic(opt.name, lr, mask)
        if opt.lower is not None:
            ok = (stat >= math.log(opt.lower)) & (stat <= math.log(opt.upper))
        else:
            ok = stat <= opt.upper
        prefix = f"rollout_rs_{opt.name}"
        metrics[f"{prefix}_mean"] = torch.where(mask, stat, zero).sum() / n
        if seq is None:
            metrics[f"{prefix}_max"] = _masked_max(stat, mask)
            metrics[f"{prefix}_min"] = _masked_min(stat, mask)
        else:
            metrics[f"{prefix}_max"] = _masked_max(seq, valid)
            metrics[f"{prefix}_min"] = _masked_min(seq, valid)
        rejected = mask & ~ok
        metrics[f"{prefix}_masked_fraction"] = rejected.sum().to(f) / n
        metrics[f"{prefix}_seq_masked_fraction"] = rejected.any(-1).sum().to(f) / b
        keep = keep & ok
    dropped = mask & ~keep
    metrics["rollout_rs_masked_fraction"] = dropped.sum().to(f) / n
    metrics["rollout_rs_seq_masked_fraction"] = dropped.any(-1).sum().to(f) / b
    return keep, metrics


def offpolicy_keep(lr: Tensor, mask: Tensor, advantages: Tensor, threshold: float) -> Tensor:
    r"""DeepSeek-V3.2's off-policy sequence mask (TRL's ``off_policy_mask_threshold``), ``[b, t]`` bool.

    A sequence is dropped when its advantage is negative *and* its mean
    :math:`\frac1n\sum_t(\log\mu - \log\pi) = -\bar\ell` exceeds ``threshold``: kept where
    :math:`A \ge 0` or :math:`-\bar\ell \le \delta`. ``advantages`` is ``[b]``, ``[b, 1]`` or ``[b, t]``.
    """
    seq_kl = -_per_sequence(lr, mask)[0]
    adv = advantages.detach()
    if adv.ndim == mask.ndim - 1:
        adv = adv.unsqueeze(-1)
    keep = (adv >= 0) | (seq_kl <= threshold).unsqueeze(-1)
    return mask & keep.expand_as(mask)


def dtype_of(logprob: Tensor, rollout_logprob: Tensor) -> torch.dtype:
    """The dtype of the weights: the inputs' promoted dtype, at least float32."""
    return compute_dtype(logprob, rollout_logprob)
