r"""Input checks and dtype rules shared by every layer.

Each check either returns a normalized value or raises an error that names the argument, the value
or shapes it got and what it accepts. Checks read shapes, dtypes and devices only, never tensor
values (that would synchronize with the device), except where a value check is their point.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor


__all__ = [
    "DEFAULT_LOGPROB_SLACK",
    "HOST_READ_DEVICES",
    "LOGPROB_SLACK",
    "check_logprobs",
    "check_floating",
    "check_lead_shape",
    "check_mask",
    "check_mask_values",
    "check_matching",
    "check_temperature",
    "check_values",
    "compute_dtype",
    "host_reads",
    "warn_if_reference_requires_grad",
    "warn_user",
]

#: How far above 0 a log-prob may be before it is refused: rounding of a log-softmax in the input's
#: dtype (a gathered logit, the usual mistake, is off by its log-sum-exp, often several nats).
LOGPROB_SLACK: dict[torch.dtype, float] = {torch.float16: 0.0625, torch.bfloat16: 0.25}
DEFAULT_LOGPROB_SLACK = 1e-3

# frames that are no user's line: this package's, and the machinery that calls a module or a hook
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PLUMBING = (os.sep + os.path.join("torch", "nn", "modules", "module.py"),)


def warn_user(message: str, category: type[Warning] = UserWarning, *, rank_zero: bool = False) -> None:
    """Warn at the user's line: the first frame outside this package (and outside ``nn.Module``'s call frames).

    The one way the package aims its warnings, so that no caller counts ``stacklevel`` by hand; Python's
    default filter then shows a warning once per user line. ``rank_zero``: only on the process of global rank
    0 (as Lightning's ``rank_zero_warn``), for a warning every rank would give alike.
    """
    if rank_zero and _global_rank() != 0:
        return
    frame, level = sys._getframe(1), 1
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIR) or frame.f_code.co_filename.endswith(_PLUMBING)
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


def _global_rank() -> int:
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0

#: Device types on which the package reads tensor values on the host, where that waits for nothing
#: (CPU): value checks (token ids in range) then name the bad value, and ``full_kl`` skips masked
#: rows by an index list. On other devices nothing is read on the host per call: checks run on the
#: device (``torch._assert_async``; a failed one stops the run with a device-side assertion naming
#: the rule, not the value) and masked rows are computed and zeroed. Tests set it empty to run the
#: device form on CPU.
HOST_READ_DEVICES: frozenset[str] = frozenset({"cpu"})


def host_reads(device: torch.device) -> bool:
    """Whether values on ``device`` may be read on the host per call (:data:`HOST_READ_DEVICES`)."""
    return device.type in HOST_READ_DEVICES


def check_values(bad: Tensor, host_error: Callable[[], Exception], rule: str) -> None:
    """Fail if any element of the bool tensor ``bad`` is True, without a host read off the CPU.

    On :data:`HOST_READ_DEVICES` raises ``host_error()`` (an error that names the value); elsewhere, and
    inside ``torch.compile`` (where a host read would break the graph), asserts ``not bad.any()`` on the
    device with the message ``rule`` (a ``RuntimeError`` on CPU).
    """
    if host_reads(bad.device) and not torch.compiler.is_compiling():
        if bad.any():
            raise host_error()
    else:
        torch._assert_async(~bad.any(), rule)


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the maths runs in: the inputs' promoted dtype, at least float32."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.promote_types(dtype, torch.float32)


def check_floating(name: str, x: object) -> Tensor:
    """``x`` if it is a floating point tensor; else ``TypeError`` naming ``name``."""
    if not isinstance(x, Tensor):
        hint = ""
        if isinstance(x, tuple) and hasattr(x, "hidden"):  # an lk.FromHidden, which this layer does not import
            hint = (
                " Hidden states and an LM head (`lk.FromHidden`) go to `lk.full_kl(lk.FromHidden(hidden, weight), "
                "lk.FromHidden(ref_hidden, ref_weight), mask)`, `lk.token_logprobs(lk.FromHidden(...), tokens)`, or "
                "`KLPenaltyLoss('full')` as one `lk.FromHidden` per model."
            )
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}.{hint}")
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


def check_mask(
    mask: Optional[Tensor], like: Tensor, like_name: str, without: Optional[str] = None
) -> Optional[Tensor]:
    """Return ``mask`` as a bool tensor of ``like``'s shape, or raise an error naming both shapes.

    With ``without`` (e.g. ``"the vocabulary dimension"``) the mask has ``like``'s shape less its
    last dimension, and the error says so and gives the expected shape. A bool mask is used as is;
    an integer or floating mask must hold only 0 and 1 (:func:`check_mask_values`) and is read as
    ``mask != 0``. A ``like`` with one more dimension than the mask looks like logits ``[..., V]``
    where log-probs belong: the error says so.
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"`mask` must be a torch.Tensor or None, got {type(mask).__name__}.")
    expected = like.shape if without is None else like.shape[:-1]
    if mask.shape != expected:
        what = f"`{like_name}`" if without is None else f"`{like_name}` without {without}"
        hint = "" if without is None else f" (expected mask {tuple(expected)})"
        if without is None and like.ndim == mask.ndim + 1 and like.shape[:-1] == mask.shape:
            hint = (
                f": `{like_name}` {tuple(like.shape)} looks like logits `[..., V]` where the sampled tokens' "
                "log-probs `[..., t]` belong; compute those with `lk.token_logprobs(logits, tokens)`, or pass "
                "the logits of both models to the 'full' estimator (`lk.full_kl`, `KLPenaltyLoss('full')`)"
            )
        raise ValueError(
            f"`mask` must have the shape of {what}: got mask {tuple(mask.shape)} "
            f"and {like_name} {tuple(like.shape)}{hint}."
        )
    if mask.device != like.device:
        raise ValueError(f"`mask` is on {mask.device} but `{like_name}` is on {like.device}.")
    return mask if mask.dtype == torch.bool else check_mask_values(mask)


_first_accelerator_mask = [True]  # on an accelerator, only the first non-bool mask is read (see below)


def check_mask_values(mask: Tensor) -> Tensor:
    """A non-bool mask as bool, after checking that it holds only 0 and 1: a mask is not a weight.

    A mask of 0.5, 2 or -1 would otherwise be read as ``mask != 0``, silently. The check reads the
    mask's values: on the CPU always (no device to wait for); on an accelerator it would make the
    host wait for the device at every step, so there only the process's first non-bool mask is
    checked (one host read, once). Bool masks (``lk.hf.response_mask``'s, ``mask.bool()``) skip it
    and cost nothing.

    Raises:
        ValueError: naming a bad value and the mask's dtype.
    """
    accelerator = mask.device.type != "cpu"
    if not accelerator or _first_accelerator_mask[0]:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            value = mask[bad][0].item()
            raise ValueError(
                f"`mask` must hold only 0 and 1 (or be bool), got {value!r} in a {mask.dtype} mask: a mask "
                "says which tokens count, it is not a weight. Pass `mask.bool()` for a 0/1 mask; to weight "
                "tokens, multiply the per-token values before `lk.aggregate`."
            )
        if accelerator:
            _first_accelerator_mask[0] = False
    return mask != 0


def warn_if_reference_requires_grad(name: str, reference: object) -> None:
    """Warn if the reference carries a graph (at the user's line, :func:`warn_user`).

    A ``ref_logprob`` that requires grad makes the KL term train the reference, or whatever computed
    it (forgotten ``torch.no_grad()``, the adapters left on), and keeps its graph in memory. Where that is intended: ``warnings.filterwarnings("ignore", message="`ref_logprob` requires grad")`` (or
    ``ref_logits``, ``ref_hidden``).
    """
    if isinstance(reference, Tensor) and reference.requires_grad:
        warn_user(
            f"`{name}` requires grad: the KL term would train the reference (or the model that computed it) "
            f"toward the policy, and keep its graph. Compute `{name}` under `torch.no_grad()` or pass "
            f"`{name}.detach()`; if the reference is meant to train, silence this with "
            f"`warnings.filterwarnings('ignore', message='`{name}` requires grad')`."
        )


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




def check_logprobs(named: dict[str, Optional[Tensor]], mask: Optional[Tensor]) -> None:
    """Refuse a log-prob above 0 (beyond rounding: :data:`LOGPROB_SLACK`) at a valid position, in each
    tensor of ``named`` (``{name: tensor or None}``; ``mask`` bool or None).

    The usual cause: logits gathered at the tokens (``logits.gather(-1, tokens)``) passed as log-probs.
    On the CPU the error names the value; on an accelerator the check runs on the device, with no host
    read (:func:`check_values`). NaN and ``-inf`` pass (handled downstream).
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


def check_lead_shape(name: str, x: object, like_name: str, like: Tensor) -> Tensor:
    """``x``: a floating point tensor shaped like ``like`` without its last dimension, with a dimension left,
    on ``like``'s device; the errors name both."""
    check_floating(name, x)
    assert isinstance(x, Tensor)
    if like.ndim < 2 or x.shape != like.shape[:-1]:
        raise ValueError(
            f"`{name}` must have the shape of `{like_name}` without the vocabulary dimension, with a token "
            f"dimension: got {name} {tuple(x.shape)} and {like_name} {tuple(like.shape)}."
        )
    if x.device != like.device:
        raise ValueError(f"`{name}` is on {x.device} but `{like_name}` is on {like.device}.")
    return x
