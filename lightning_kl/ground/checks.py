r"""Input checks and dtype rules shared by every layer.

Each check either returns a normalized value or raises an error that names the argument, the value
or shapes it got and what it accepts. Checks read shapes, dtypes and devices only, never tensor
values (that would synchronize with the device), except where a value check is their point.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = [
    "AGG_MODES",
    "check_agg_mode",
    "check_count",
    "check_floating",
    "check_full_inputs",
    "check_mask",
    "check_matching",
    "check_max_weight",
    "check_sampled_temperature",
    "check_temperature",
    "compute_dtype",
    "reject_old_logprob",
]

#: The aggregation modes accepted by :func:`lightning_kl.aggregate` (verl's names and semantics).
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the maths runs in: the inputs' promoted dtype, at least float32."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.promote_types(dtype, torch.float32)


def check_floating(name: str, x: object) -> Tensor:
    """``x`` if it is a floating point tensor; else ``TypeError`` naming ``name``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}.")
    if not x.is_floating_point():
        raise TypeError(f"`{name}` must be a floating point tensor, got dtype {x.dtype}.")
    return x


def check_matching(a_name: str, a: object, b_name: str, b: object) -> None:
    """Both floating point tensors of one shape on one device; the errors name both."""
    check_floating(a_name, a)
    check_floating(b_name, b)
    assert isinstance(a, Tensor) and isinstance(b, Tensor)
    if a.shape != b.shape:
        raise ValueError(
            f"`{a_name}` and `{b_name}` must have the same shape: got {a_name} "
            f"{tuple(a.shape)} and {b_name} {tuple(b.shape)}."
        )
    if a.device != b.device:
        raise ValueError(f"`{a_name}` is on {a.device} but `{b_name}` is on {b.device}.")


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


def check_full_inputs(logits: Any, ref_logits: Any, mask: Optional[Tensor]) -> Optional[Tensor]:
    """Check ``logits``, ``ref_logits`` ``[..., V]`` and ``mask`` ``[...]``; return the mask as bool.

    Raises:
        TypeError: for inputs that are not floating point tensors, or a mask that is not a tensor.
        ValueError: for shapes or devices that do not match (both are named).
    """
    check_matching("logits", logits, "ref_logits", ref_logits)
    assert isinstance(logits, Tensor)
    if logits.ndim == 0:
        raise ValueError("'full' takes logits `[..., V]` with a vocabulary dimension, got a scalar.")
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"`mask` must be a torch.Tensor or None, got {type(mask).__name__}.")
    if mask.shape != logits.shape[:-1]:
        raise ValueError(
            "`mask` must have the shape of `logits` without the vocabulary dimension: got mask "
            f"{tuple(mask.shape)} and logits {tuple(logits.shape)} (expected mask {tuple(logits.shape[:-1])})."
        )
    if mask.device != logits.device:
        raise ValueError(f"`mask` is on {mask.device} but `logits` is on {logits.device}.")
    return mask if mask.dtype == torch.bool else mask != 0


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


def check_temperature(temperature: Any) -> float:
    """Validate a sampling temperature: a finite number > 0. Returns it as a float."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise ValueError(f"`temperature` must be a finite number > 0, got {temperature!r}.")
    return float(temperature)


def check_sampled_temperature(temperature: object, estimator: str) -> None:
    """Sampled estimators take log-probs at the sampling temperature already: only T = 1 fits."""
    if temperature != 1.0 or isinstance(temperature, bool):
        raise ValueError(
            f"`temperature` applies to the 'full' estimator (logits) only, got {temperature!r} with "
            f"{estimator!r}: compute the sampled tokens' log-probs at the sampling temperature instead."
        )


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


def reject_old_logprob(old_logprob: Any) -> None:
    """``full`` takes no ``old_logprob``: raise ``ValueError`` if one is given.

    The exact KL sums over the whole vocabulary under the current policy; importance weights only
    correct the sampling distribution of sampled tokens.
    """
    if old_logprob is not None:
        raise ValueError(
            "`old_logprob` does not apply to the 'full' estimator: it sums over the whole vocabulary under "
            "the current policy, so it needs no importance weights (they correct sampled tokens drawn by an "
            "older policy). Drop `old_logprob`, or use a sampled estimator."
        )
