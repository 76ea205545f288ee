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

import math
import warnings
from typing import Any, Literal, NamedTuple, Optional, Union

import torch
from torch import Tensor

from lightning_kl.estimators import K3_CLAMP, EstimatorSpec, estimator_value, parse_estimator
from lightning_kl.ground.checks import (
    check_floating,
    check_mask,
    check_matching,
    check_temperature,
    check_values,
    host_reads,
    warn_if_reference_requires_grad,
)
from lightning_kl.vocab_inputs import check_full_hidden_inputs, check_full_inputs
from lightning_kl.ground.sampler import Sampling
from lightning_kl.ground.vocab_shards import is_vocab_parallel, local_part, sampled_locals
from lightning_kl.kernels import fused
from lightning_kl.kernels.full import full_kl_compute, full_kl_from_hidden_compute
from lightning_kl.logprobs import FromHidden
from lightning_kl.sequence import (
    check_kl_to_go,
    check_level,
    check_sampled_logprob,
    full_with_kl_to_go,
    prefix_log_weights,
    weighted_kl_to_go,
    with_kl_to_go,
)

__all__ = [
    "AGG_MODES",
    "AggMode",
    "KLInputs",
    "aggregate",
    "aggregate_checked",
    "aggregate_counts",
    "aggregate_counts_checked",
    "check_agg_mode",
    "check_count",
    "check_kl_inputs",
    "check_max_weight",
    "full_kl_values",
    "importance_weight",
    "kl_penalty",
    "kl_penalty_compute",
    "kl_penalty_values",
    "resolve_sampling",
]

#: The aggregation modes accepted by :func:`aggregate` (verl's names and semantics).
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

#: The type of an ``agg`` argument: one of the modes of :func:`aggregate`, listed by LightningCLI's
#: ``--help``; any other string is refused when the object is built, by a message that lists the valid
#: modes. The modes: ``typing.get_args(typing.get_args(lk.AggMode)[0])``.
AggMode = Union[Literal[AGG_MODES], str]  # type: ignore[valid-type]

#: How far above 0 a log-prob may be before it is refused: rounding of a log-softmax in the input's
#: dtype (a gathered logit, the usual mistake, is off by its log-sum-exp, often several nats).
LOGPROB_SLACK: dict[torch.dtype, float] = {torch.float16: 0.0625, torch.bfloat16: 0.25}
DEFAULT_LOGPROB_SLACK = 1e-3


def check_agg_mode(mode: object) -> str:
    """Validate an aggregation mode name; raise ``ValueError`` listing the valid ones."""
    if not isinstance(mode, str) or mode not in AGG_MODES:
        valid = ", ".join(repr(m) for m in AGG_MODES)
        raise ValueError(f"Unknown aggregation mode {mode!r}. Valid modes: {valid}.")
    return mode


def check_count(name: str, n: object) -> None:
    """A divisor given in place of a batch's own count: ``None``, a number ``>= 0``, or a one-element tensor."""
    if n is None:
        return
    if isinstance(n, Tensor):
        if n.numel() != 1 or n.is_complex():
            raise ValueError(f"`{name}` must be a number or a one-element tensor, got shape {tuple(n.shape)}.")
        return  # its value is not read here: that would synchronize with the device
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not n >= 0 or n == float("inf"):
        raise ValueError(f"`{name}` must be a finite number >= 0 or a tensor, got {n!r}.")


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


def resolve_sampling(sampling: Any, temperature: Any, estimator: str, where: str, stacklevel: int = 3) -> Sampling:
    """The sampler of an entry point from ``sampling=`` and the deprecated ``temperature=`` (None: not given).

    ``temperature=T`` warns (``DeprecationWarning`` naming ``sampling=lk.Sampling(temperature=T)``) and is
    read as that. A sampler that changes the distribution belongs to ``"full"`` only: sampled estimators take
    log-probs that were computed under it already.

    Raises:
        ValueError: for both given, a ``sampling`` that is not an ``lk.Sampling``, or a non-neutral sampler
            with a sampled estimator (saying where it belongs).
    """
    if temperature is not None:
        warnings.warn(
            f"`{where}(temperature=...)` is deprecated: pass `sampling=lk.Sampling(temperature={temperature!r})`, "
            "the same object that configures the sampler and the scorer.",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        if sampling is not None:
            raise ValueError("Pass `sampling=lk.Sampling(...)` alone, not with the deprecated `temperature=`.")
        sampling = Sampling(temperature=check_temperature(temperature))
    if sampling is None:
        return Sampling()
    if not isinstance(sampling, Sampling):
        raise TypeError(f"`sampling` must be an `lk.Sampling` or None, got {type(sampling).__name__}.")
    if estimator != "full" and sampling != Sampling():
        raise ValueError(
            f"`sampling` applies to the 'full' estimator (logits) only, got {sampling!r} with {estimator!r}: a "
            "sampled estimator takes log-probs, so compute the policy's and the reference's under the same sampler, "
            "`lk.token_logprobs(logits, tokens, sampling=sampling)`."
        )
    return sampling


class KLInputs(NamedTuple):
    """The checked inputs of :func:`kl_penalty` (:func:`check_kl_inputs`): each tensor checked once."""

    logprob: Any
    ref_logprob: Any
    mask: Optional[Tensor]
    old_logprob: Optional[Tensor]
    sampled_logprob: Optional[Tensor]


def check_kl_inputs(
    logprob: Any,
    ref_logprob: Any,
    spec: EstimatorSpec,
    mask: Any,
    old_logprob: Any,
    sampled_logprob: Any,
    level: str,
    stacklevel: int = 3,
) -> KLInputs:
    """Check the tensors of one :func:`kl_penalty` or :class:`~lightning_kl.KLPenaltyLoss` call, once.

    The configuration (``spec``, ``level``) is checked by the caller. Returns the inputs to compute
    with: the mask as bool, a DTensor of sampled log-probs as its local part, ``old_logprob`` detached.
    ``stacklevel`` points the warnings at the user's call (Python's, counted from this function: 3 for a
    function the user calls that calls this one).

    Raises:
        TypeError, ValueError: naming the argument, the shapes, and what fits.
    """
    sequence = level == "sequence"
    if spec.base == "full":
        if old_logprob is not None:
            raise ValueError(
                "`old_logprob` does not apply to the 'full' estimator: it sums over the whole vocabulary under "
                "the current policy, so it needs no importance weights (they correct sampled tokens drawn by an "
                "older policy). Drop `old_logprob`, or use a sampled estimator."
            )
        hidden = isinstance(logprob, FromHidden), isinstance(ref_logprob, FromHidden)
        if any(hidden) and not all(hidden):
            raise TypeError(
                f"`lk.FromHidden` inputs take the 'full' estimator with one for each model, got {spec.name!r} with "
                f"{type(logprob).__name__} and {type(ref_logprob).__name__}."
            )
        if all(hidden):
            mask = check_full_hidden_inputs(*logprob, *ref_logprob, mask, stacklevel=stacklevel + 2)
            like, what = logprob.hidden, "hidden"
        else:
            mask = check_full_inputs(logprob, ref_logprob, mask, stacklevel=stacklevel + 2)
            like, what = local_part(logprob), "logits"
        if mask is None and like.ndim < 3:
            raise ValueError(
                f"'full' takes the {what} of every position `[b, t, {'d' if what == 'hidden' else 'V'}]` and a mask "
                f"`[b, t]`; got {what} {tuple(like.shape)} and no mask: a `[b, t]` tensor of log-probs here would "
                "be read as b rows of a vocabulary of t. Pass both models' logits (or `lk.FromHidden`) with the "
                "mask; for flat rows `[n, V]` pass `mask=torch.ones(n, dtype=torch.bool)`."
            )
        sampled_logprob = check_sampled_logprob(sampled_logprob, logprob.hidden if all(hidden) else logprob, sequence)
        check_logprob_values({"sampled_logprob": sampled_logprob}, mask)
        return KLInputs(logprob, ref_logprob, mask, None, sampled_logprob)
    if any(isinstance(x, FromHidden) for x in (logprob, ref_logprob)):
        raise TypeError(
            f"`lk.FromHidden` inputs take the 'full' estimator with one for each model, got {spec.name!r} with "
            f"{type(logprob).__name__} and {type(ref_logprob).__name__}; for a sampled estimator compute the log-probs "
            "with `lk.token_logprobs(lk.FromHidden(hidden, weight), tokens)`."
        )
    check_sampled_logprob(sampled_logprob, logprob, False)
    logprob, ref_logprob, old_logprob = sampled_locals(logprob, ref_logprob, old_logprob)  # loss_parallel's DTensors
    if sequence and isinstance(logprob, Tensor) and logprob.ndim == 0:
        raise ValueError("level='sequence' needs a token dimension (the last one), got a scalar `logprob`.")
    check_matching("logprob", logprob, "ref_logprob", ref_logprob)
    warn_if_reference_requires_grad("ref_logprob", ref_logprob, stacklevel=stacklevel + 1)
    if old_logprob is not None:
        check_matching("old_logprob", old_logprob, "logprob", logprob)
        if old_logprob.requires_grad:
            warnings.warn(
                "`old_logprob` requires grad: it is the sampling policy's log-probs, a constant of the importance "
                "weight pi / pi_old; its gradient would change the estimator's (k3's by about half). It is detached "
                "here; pass `old_logprob.detach()` (or compute it under `torch.no_grad()`).",
                UserWarning,
                stacklevel=stacklevel,
            )
            old_logprob = old_logprob.detach()
    mask = check_mask(mask, logprob, "logprob")
    check_logprob_values({"logprob": logprob, "ref_logprob": ref_logprob, "old_logprob": old_logprob}, mask)
    return KLInputs(logprob, ref_logprob, mask, old_logprob, None)


def check_logprob_values(named: dict[str, Optional[Tensor]], mask: Optional[Tensor]) -> None:
    """Refuse a log-prob above 0 (beyond rounding: :data:`LOGPROB_SLACK`) at a valid position, in each
    tensor of ``named`` (``{name: tensor or None}``).

    The usual cause: logits gathered at the tokens (``logits.gather(-1, tokens)``) passed as log-probs.
    On the CPU the error names the value; on an accelerator the check runs on the device, with no host
    read (:func:`~lightning_kl.ground.checks.check_values`). NaN and ``-inf`` pass (handled downstream).
    """
    for name, logprob in named.items():
        if logprob is None:
            continue
        slack = LOGPROB_SLACK.get(logprob.dtype, DEFAULT_LOGPROB_SLACK)
        with torch.no_grad():
            if host_reads(logprob.device) and logprob.numel() and not torch.compiler.is_compiling():
                # one vectorized pass: nothing above the slack, mask or not (a NaN max takes the full
                # check below); torch's comparison into bool is a scalar loop, several times slower
                if bool(logprob.detach().amax() <= slack):
                    continue
            bad = logprob.detach() > slack
            if mask is not None:
                bad = bad & mask
        rule = (
            f"`{name}` must hold log-probabilities (<= 0): logits gathered at the tokens are not log-probs; use "
            "`lk.token_logprobs(logits, tokens)` (log_softmax, then gather)"
        )

        def error(lp: Tensor = logprob, bad: Tensor = bad, rule: str = rule) -> ValueError:
            return ValueError(f"{rule}. Got {float(lp.detach()[bad][0])!r} at a valid position.")

        check_values(bad, error, rule)


def full_kl_values(x: Any, ref_x: Any, mask: Optional[Tensor], sampling: Sampling) -> Tensor:
    r"""The exact per-position KL of checked inputs: the one place where ``"full"`` reaches the kernels.

    :math:`\mathrm{KL}(\tilde\pi \,\|\, \pi_{\mathrm{ref}})`, the policy processed by ``sampling`` and the
    reference at the same temperature, unprocessed (``lk.full_kl``'s ``reference="unprocessed"``).
    ``x`` and ``ref_x``: logits (a tensor, a vocabulary-split DTensor or an ``lk.VocabShard``) or one
    :class:`~lightning_kl.FromHidden` each; ``mask`` bool or None.

    Raises:
        ValueError: for a truncating sampler (top-k, top-p, min-p) with vocabulary-split logits: its kept
            set is a selection across ranks, which the engine does not build.
    """
    if sampling.truncates and (is_vocab_parallel(x) or is_vocab_parallel(ref_x) or (isinstance(x, FromHidden) and is_vocab_parallel(x.weight))):
        raise ValueError(
            f"The exact KL of a truncating sampler ({sampling!r}) is not available on a vocabulary split over "
            "processes (top-k, top-p and min-p select across the shards): pass the whole logits of both models, "
            "or a sampling with the temperature alone."
        )
    if isinstance(x, FromHidden):
        return full_kl_from_hidden_compute(*x, *ref_x, mask, sampling)
    return full_kl_compute(x, ref_x, mask, sampling)


def kl_penalty_values(
    inputs: KLInputs,
    spec: EstimatorSpec,
    max_weight: Optional[float] = None,
    level: str = "token",
    kl_to_go: str = "k1",
    sampling: Optional[Sampling] = None,
) -> Tensor:
    """Per-token values of checked inputs (:func:`check_kl_inputs`), in the compute dtype: the way of
    :func:`kl_penalty` and :class:`~lightning_kl.KLPenaltyLoss` alike."""
    if spec.base == "full":
        kl = full_kl_values(inputs.logprob, inputs.ref_logprob, inputs.mask, sampling or Sampling())
        if inputs.sampled_logprob is not None:
            kl = full_with_kl_to_go(kl, inputs.sampled_logprob, inputs.mask)
        return kl
    return kl_penalty_compute(
        inputs.logprob, inputs.ref_logprob, spec, inputs.mask, inputs.old_logprob, max_weight, level, kl_to_go
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
) -> Tensor:
    """Per-token estimate in the compute dtype (float32 for half inputs); 0 where ``mask`` is False.

    The single dispatch point of every caller (the function, the loss, the callback). Inputs are
    checked by the caller. ``level="sequence"``: see :mod:`lightning_kl.sequence`.
    """
    dtype = torch.promote_types(torch.promote_types(logprob.dtype, ref_logprob.dtype), torch.float32)  # compute_dtype
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
            prefix = (log_w.cumsum(-1) - log_w).detach()
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


def check_pair(logprob: object, ref_logprob: object) -> None:
    """``logprob`` and ``ref_logprob``: floating tensors of one shape on one device; warns if the reference requires grad."""
    check_matching("logprob", logprob, "ref_logprob", ref_logprob)
    warn_if_reference_requires_grad("ref_logprob", ref_logprob)


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
    spec = parse_estimator(estimator)
    max_weight = check_max_weight(max_weight)
    level = check_level(level)
    kl_to_go = check_kl_to_go(kl_to_go, level, spec.base == "full")
    sampling = resolve_sampling(sampling, temperature, spec.name, "kl_penalty")
    inputs = check_kl_inputs(logprob, ref_logprob, spec, mask, old_logprob, sampled_logprob, level)
    out_dtype = _out_dtype(inputs.logprob, inputs.ref_logprob)
    return kl_penalty_values(inputs, spec, max_weight, level, kl_to_go, sampling).to(out_dtype)


def _out_dtype(x: Any, ref_x: Any) -> torch.dtype:
    # the inputs' promoted dtype (the heads' for hidden states)
    if isinstance(x, FromHidden):
        return torch.promote_types(torch.promote_types(x.weight.dtype, ref_x.weight.dtype), torch.float32)
    return torch.promote_types(local_part(x).dtype, local_part(ref_x).dtype)


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
    check_floating("values", values)
    if values.ndim == 0:
        raise ValueError("`values` must have at least one (token) dimension, got a scalar.")
    mask = check_mask(mask, values, "values")
    if norm is not None and not norm > 0:
        raise ValueError(f"`norm` must be a positive number, got {norm!r}.")
    check_count("num_tokens", num_tokens)
    check_count("num_seqs", num_seqs)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size` must be a positive integer, got {world_size!r}.")
    return aggregate_checked(values, mask, mode, norm, num_tokens, num_seqs, world_size)


def aggregate_checked(
    values: Tensor,
    mask: Optional[Tensor],
    mode: str,
    norm: Optional[float] = None,
    num_tokens: Optional[Tensor | float] = None,
    num_seqs: Optional[Tensor | float] = None,
    world_size: int = 1,
) -> Tensor:
    """:func:`aggregate` of checked arguments (``mask`` bool or None): the maths, shared with the loss."""
    dtype = torch.promote_types(values.dtype, torch.float32)  # compute_dtype
    v = values.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=v.device)
    if mask is not None:
        v = torch.where(mask, v, zero)
    if mode == "token-sum":
        return _times(v.sum(), world_size)
    if mode == "token-mean":
        if num_tokens is None:
            num_tokens = v.numel() if mask is None else torch.count_nonzero(mask)
        return _times(v.sum() / _at_least_one(num_tokens, dtype, v.device), world_size)
    if mode == "seq-mean-token-sum-norm":
        return _times(v.sum() / (values.shape[-1] if norm is None else norm), world_size)

    t = values.shape[-1]
    if v.numel() == 0:
        return v.sum()
    seq_sums = v.reshape(-1, t).sum(-1)
    if mask is None:
        counts = torch.full_like(seq_sums, t)
    else:
        counts = mask.reshape(-1, t).sum(-1).to(dtype)
    if num_seqs is None:
        num_seqs = (counts > 0).sum()
    n_seqs = _at_least_one(num_seqs, dtype, v.device)
    if mode == "seq-mean-token-sum":
        return _times(seq_sums.sum() / n_seqs, world_size)
    # seq-mean-token-mean: empty sequences contribute 0 to the sum and nothing to the count
    return _times((seq_sums / counts.clamp(min=1)).sum() / n_seqs, world_size)


def aggregate_counts(values: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """This batch's ``[valid tokens, sequences with a valid token]``: a detached int64 ``[2]`` tensor.

    The local counts that :func:`aggregate` divides by; sum them over processes (one
    ``all_reduce``) and pass them back as ``num_tokens`` and ``num_seqs``.
    """
    check_floating("values", values)
    if values.ndim == 0:
        raise ValueError("`values` must have at least one (token) dimension, got a scalar.")
    return aggregate_counts_checked(values, check_mask(mask, values, "values"))


def aggregate_counts_checked(values: Tensor, mask: Optional[Tensor]) -> Tensor:
    """:func:`aggregate_counts` of checked arguments (``mask`` bool or None)."""
    if mask is None:
        n_seqs = math.prod(values.shape[:-1]) if values.shape[-1] else 0
        return torch.tensor([values.numel(), n_seqs], dtype=torch.int64, device=values.device)
    m = mask.detach()
    return torch.stack([torch.count_nonzero(m), torch.count_nonzero(m.any(-1))]).to(torch.int64)


def _times(x: Tensor, world_size: int) -> Tensor:
    # multiply only when needed: one process keeps the plain graph
    return x if world_size == 1 else x * world_size


def _at_least_one(n: Tensor | int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.as_tensor(n, dtype=dtype, device=device).reshape(()).clamp(min=1)
