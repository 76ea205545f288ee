r"""Estimator names and the elementwise maths of every sampled-token KL estimator.

Notation: ``d = logprob - ref_logprob`` is the per-token log-ratio of the policy to the reference,
for tokens sampled from the policy. Every estimator is a function of ``d`` alone:

======================  ==========================================  =====================================
name (aliases)          value                                       gradient w.r.t. ``logprob``
======================  ==========================================  =====================================
``k1`` (``kl``)         :math:`d`                                   :math:`1`
``abs``                 :math:`|d|`                                 :math:`\operatorname{sign}(d)`
``k2`` (``mse``)        :math:`d^2 / 2`                             :math:`d`
``k3``                  :math:`e^{-c} + c - 1`, :math:`c=` clamp    :math:`1 - e^{-d}` for
                        of :math:`d` to :math:`[-20, 20]`           :math:`|d| \le 20`, else 0
``low_var_kl``          clamp of ``k3`` to :math:`[-10, 10]`        as ``k3`` where ``k3 <= 10``, else 0
``NAME+``               value of ``NAME``                           :math:`d` (the k2 gradient)
======================  ==========================================  =====================================

The gradient with respect to ``ref_logprob`` is the negative of the one with respect to ``logprob``.

**A non-finite log-ratio at a valid token** (``ref_logprob = -inf``: the reference gives the sampled
token no mass; or a NaN): a base estimator keeps its own value (``k1``: ``d``; ``k3``: the clamped
value, 19.0 at ``d = +inf``, with a zero gradient; ``low_var_kl``: 10), while every ``NAME+`` value
is NaN there: its gradient ``d`` is infinite, and a finite value would hide an infinite gradient
behind a finite loss. The NaN then poisons the loss, where ``Trainer(detect_anomaly=True)`` and the
logs show it. The small-input composition and the fused kernels give the same, at every size.

One more name, ``full``, is not a sampled-token estimator: it takes both models' logits
``[..., V]`` and returns the exact KL over the vocabulary (:mod:`lightning_kl.kernels.full`). Its gradient is
exact, so ``full+`` is rejected. :data:`SAMPLED_ESTIMATORS` lists every name but ``full``.

Names are parsed once, by :func:`parse_estimator`, when an object is built; the maths below only ever
sees a parsed :class:`EstimatorSpec`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
from torch import Tensor

__all__ = [
    "BASE_ESTIMATORS",
    "ESTIMATORS",
    "FULL",
    "SAMPLED_ESTIMATORS",
    "EstimatorName",
    "EstimatorSpec",
    "SampledEstimatorName",
    "parse_estimator",
]

# canonical base name for every accepted spelling (aliases map to the canonical name)
_ALIASES: dict[str, str] = {
    "k1": "k1",
    "kl": "k1",
    "abs": "abs",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "low_var_kl",
}

#: The canonical base estimators, in table order.
BASE_ESTIMATORS: tuple[str, ...] = ("k1", "abs", "k2", "k3", "low_var_kl")

#: The estimators of sampled tokens (they take ``logprob``, ``ref_logprob``): the bases, their
#: aliases, and each with the ``+`` suffix.
SAMPLED_ESTIMATORS: tuple[str, ...] = tuple(_ALIASES) + tuple(f"{name}+" for name in _ALIASES)

#: The exact KL over the whole vocabulary: takes logits ``[..., V]`` (see :mod:`lightning_kl.kernels.full`).
FULL = "full"

#: Every accepted estimator name: the sampled ones and ``full``.
ESTIMATORS: tuple[str, ...] = SAMPLED_ESTIMATORS + (FULL,)

#: The type of an ``estimator`` argument: one of :data:`ESTIMATORS`. LightningCLI's ``--help`` lists
#: them; any other string passes the parser and is refused when the object is built, by a message that
#: lists the valid names (the last line a YAML user sees, not a parser's type error).
EstimatorName = Union[Literal[ESTIMATORS], str]  # type: ignore[valid-type]

#: The type of a sampled ``estimator`` argument (:class:`~lightning_kl.KLRewardCallback`'s): one of
#: :data:`SAMPLED_ESTIMATORS`, as :data:`EstimatorName`.
SampledEstimatorName = Union[Literal[SAMPLED_ESTIMATORS], str]  # type: ignore[valid-type]

# -d is clamped to this range before exp() in k3: exp(20) ~ 4.9e8 is far from float32 overflow.
K3_CLAMP = 20.0
# low_var_kl clamps the k3 value to this range (the variant common in RL frameworks).
LOW_VAR_KL_CLAMP = 10.0


@dataclass(frozen=True)
class EstimatorSpec:
    """A parsed estimator name.

    Attributes:
        name: the name as given (``"mse+"``), kept for messages and logs.
        base: the canonical base estimator (``"k2"``).
        straight_through: ``True`` for a ``+`` name: the value of ``base`` with the k2 gradient.
    """

    name: str
    base: str
    straight_through: bool


def parse_estimator(name: Any) -> EstimatorSpec:
    """Parse and validate an estimator name.

    Args:
        name: one of :data:`ESTIMATORS`, or an :class:`EstimatorSpec` (returned unchanged).

    Raises:
        ValueError: if ``name`` is not a string or not a known name; the message lists every valid
            name and suggests the closest one.

    Example:
        >>> parse_estimator("k3+")
        EstimatorSpec(name='k3+', base='k3', straight_through=True)
        >>> parse_estimator("mse")
        EstimatorSpec(name='mse', base='k2', straight_through=False)
    """
    if isinstance(name, EstimatorSpec):
        return name
    if isinstance(name, str):
        if name == FULL:
            return EstimatorSpec(name=name, base=FULL, straight_through=False)
        if name == FULL + "+":
            raise ValueError(
                f"Unknown KL estimator {name!r}: 'full' is the exact KL over the vocabulary and its gradient is "
                "already the exact gradient of the KL, so there is no straight-through '+' variant (the '+' "
                "suffix gives a sampled estimator the k2 gradient). Use 'full'."
            )
        straight_through = name.endswith("+")
        base = _ALIASES.get(name[:-1] if straight_through else name)
        if base is not None:
            return EstimatorSpec(name=name, base=base, straight_through=straight_through)
    raise ValueError(_unknown_name_message(name))


def _unknown_name_message(name: Any) -> str:
    valid = ", ".join(repr(n) for n in ESTIMATORS)
    if not isinstance(name, str):
        return f"KL estimator name must be a string, got {name!r} of type {type(name).__name__}. Valid names: {valid}."
    close = difflib.get_close_matches(name, ESTIMATORS, n=1, cutoff=0.0)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"Unknown KL estimator {name!r}.{hint} Valid names: {valid}."


# ---------------------------------------------------------------------------------------------
# elementwise maths on the float32 log-ratio d


def base_value(base: str, d: Tensor) -> Tensor:
    """The value of a base estimator at log-ratio ``d``, differentiable with the table's gradient."""
    if base == "k1":
        return d.clone()
    if base == "abs":
        return d.abs()
    if base == "k2":
        return 0.5 * d.square()
    if base in ("k3", "low_var_kl"):
        # k3 of the clamped log-ratio: exact for |d| <= 20, saturated (zero gradient) beyond
        c = d.clamp(-K3_CLAMP, K3_CLAMP)
        k3 = torch.expm1(-c) + c
        if base == "k3":
            return k3
        return k3.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    raise AssertionError(f"unparsed estimator base {base!r}")  # parse_estimator guards this


def estimator_value(spec: EstimatorSpec, d: Tensor) -> Tensor:
    """The value of ``spec`` at ``d``; for a ``+`` name it carries the k2 gradient ``d`` instead."""
    value = base_value(spec.base, d)
    if not spec.straight_through:
        return value
    k2 = 0.5 * d.square()
    return value.detach() + (k2 - k2.detach())
