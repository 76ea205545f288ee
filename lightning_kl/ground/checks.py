r"""Input checks and dtype rules shared by every layer.

Each check either returns a normalized value or raises an error that names the argument, the value
or shapes it got and what it accepts. Checks read shapes, dtypes and devices only, never tensor
values (that would synchronize with the device), except where a value check is their point.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_kl.ground.vocab_shards import VocabShard, check_split_alike, local_part

__all__ = [
    "HOST_READ_DEVICES",
    "check_chunk_size",
    "check_floating",
    "check_full_hidden_inputs",
    "check_full_inputs",
    "check_head",
    "check_mask",
    "check_mask_values",
    "check_matching",
    "check_not_sharded",
    "check_temperature",
    "check_tokens",
    "check_values",
    "compute_dtype",
    "host_reads",
    "warn_if_reference_requires_grad",
]

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


def warn_if_reference_requires_grad(name: str, reference: object, stacklevel: int = 4) -> None:
    """Warn if the reference carries a graph (Python's default filter shows it once per calling line).

    A ``ref_logprob`` that requires grad makes the KL term train the reference, or whatever computed
    it (forgotten ``torch.no_grad()``, the adapters left on), and keeps its graph in memory. ``stacklevel``
    (Python's, counted from this function) points the warning at the user's call. Where that is intended: ``warnings.filterwarnings("ignore", message="`ref_logprob` requires grad")`` (or
    ``ref_logits``, ``ref_hidden``).
    """
    if isinstance(reference, Tensor) and reference.requires_grad:
        warnings.warn(
            f"`{name}` requires grad: the KL term would train the reference (or the model that computed it) "
            f"toward the policy, and keep its graph. Compute `{name}` under `torch.no_grad()` or pass "
            f"`{name}.detach()`; if the reference is meant to train, silence this with "
            f"`warnings.filterwarnings('ignore', message='`{name}` requires grad')`.",
            UserWarning,
            stacklevel=stacklevel,
        )


def check_full_inputs(logits: Any, ref_logits: Any, mask: Optional[Tensor], stacklevel: int = 4) -> Optional[Tensor]:
    """Check ``logits``, ``ref_logits`` ``[..., V]`` and ``mask`` ``[...]``; return the mask as bool.

    Raises:
        TypeError: for inputs that are not floating point tensors, or a mask that is not a tensor.
        ValueError: for shapes or devices that do not match (both are named).
    """
    check_split_alike("logits", logits, "ref_logits", ref_logits)
    logits, ref_logits = local_part(logits), local_part(ref_logits)  # a vocabulary shard: its local part
    check_matching("logits", logits, "ref_logits", ref_logits)
    warn_if_reference_requires_grad("ref_logits", ref_logits, stacklevel)
    assert isinstance(logits, Tensor)
    if logits.ndim == 0:
        raise ValueError("'full' takes logits `[..., V]` with a vocabulary dimension, got a scalar.")
    return check_mask(mask, logits, "logits", without="the vocabulary dimension")


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


def check_tokens(
    tokens: Any, lead: torch.Size, vocab: Optional[int], device: torch.device, like: str, ignore_index: Any
) -> tuple[Tensor, Optional[Tensor]]:
    """Check ``tokens`` (integer ids of shape ``lead``) against a vocabulary of ``vocab`` entries.

    Returns the flat ``int64`` ids (ignored ones replaced by 0, so that they index safely) and the
    flat bool mask of ignored tokens (None without ``ignore_index``). The range check is skipped for
    ``vocab`` None (a vocabulary split over ranks: the kernel checks that one rank owns each id) and
    never waits for the device (:func:`check_values`).

    Raises:
        TypeError: for ``tokens`` that are not an integer tensor, or a bad ``ignore_index``.
        ValueError: for a shape or device that does not match ``like`` (both named), or an id
            outside ``[0, vocab)`` that is not ``ignore_index`` (the id and ``V`` named).
    """
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"`ignore_index` must be an int or None, got {ignore_index!r}.")
    if not isinstance(tokens, Tensor):
        raise TypeError(f"`tokens` must be a torch.Tensor of token ids, got {type(tokens).__name__}.")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise TypeError(f"`tokens` must be an integer tensor of token ids, got dtype {tokens.dtype}.")
    if tokens.shape != lead:
        raise ValueError(
            f"`tokens` must have the shape of `{like}` without its last dimension: got tokens "
            f"{tuple(tokens.shape)} and {like} {tuple(lead) + ('...',)} (expected tokens {tuple(lead)})."
        )
    if tokens.device != device:
        raise ValueError(f"`tokens` is on {tokens.device} but `{like}` is on {device}.")
    ids = tokens.reshape(-1).long()
    ignored = None
    if ignore_index is not None:
        ignored = ids == ignore_index
        ids = ids.masked_fill(ignored, 0)
    if vocab is not None and ids.numel() > 0:
        out = (ids < 0) | (ids >= vocab)
        hint = f" or `ignore_index` ({ignore_index})" if ignore_index is not None else " (set `ignore_index` for label padding such as -100)"
        rule = f"token ids must be in [0, {vocab}){hint}"
        check_values(out, lambda: ValueError(f"token id {int(ids[out][0])} is out of range for a vocabulary of V={vocab}: {rule}."), rule)
    return ids, ignored


def check_not_sharded(name: str, x: Tensor) -> None:
    """Refuse a head parameter that is a DTensor (sharded by FSDP2): ``TypeError`` naming the recipe.

    The head's weight of a module that FSDP2 has resharded is a ``Shard(0)`` DTensor. The
    recipe is to unshard it through its FSDP module and pass the unsharded weight, leaving the reshard
    to FSDP after backward; ``weight.full_tensor()`` instead gives the right values and a wrong
    gradient: it goes back to each rank's shard from that rank's rows only, never reduce-scattered.
    """
    placements = getattr(x, "placements", None)
    if placements is None or not callable(getattr(x, "full_tensor", None)):
        return
    raise TypeError(
        f"`{name}` is a DTensor with placements {tuple(placements)}: a head sharded by FSDP2 (fully_shard). "
        "Unshard it through the FSDP module that holds it, e.g. `model.lm_head.unshard()` (or the module "
        "fully_shard wrapped), then pass `model.lm_head.weight`, the unsharded parameter; FSDP reshards it "
        "and reduce-scatters its gradient after backward. Never pass `weight.full_tensor()`: its gradient "
        "goes back to each rank's shard from that rank's rows only, and FSDP never reduce-scatters it."
    )


def check_head(hidden: Any, weight: Any, bias: Any, prefix: str = "") -> None:
    """Check ``hidden [..., d]``, ``weight [V, d]`` and ``bias [V]`` (or None): one dtype, one device.

    ``prefix`` names a second head in messages (``"ref_"`` gives ``ref_hidden``...).

    Raises:
        TypeError: for inputs that are not floating point tensors, or a head sharded by FSDP2 (a
            DTensor; the message gives the recipe, :func:`check_not_sharded`).
        ValueError: for shapes, dtypes or devices that do not match (all named).
    """
    hn, wn, bn = f"{prefix}hidden", f"{prefix}weight", f"{prefix}bias"
    if isinstance(weight, VocabShard):  # a column-parallel head: this rank's rows (and bias slice)
        weight = weight.local
    check_floating(hn, hidden)
    check_floating(wn, weight)
    check_not_sharded(wn, weight)
    if bias is not None:
        check_not_sharded(bn, bias)
    if hidden.ndim == 0:
        raise ValueError(f"`{hn}` must be `[..., d]` with a hidden dimension, got a scalar.")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"`{wn}` must be the LM head `[V, d]` with V >= 1 and d = {hn}.shape[-1]: got {wn} {tuple(weight.shape)} "
            f"and {hn} {tuple(hidden.shape)}."
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"`{hn}` and `{wn}` must have one dtype: got {hidden.dtype} and {weight.dtype}.")
    if weight.device != hidden.device:
        raise ValueError(f"`{hn}` is on {hidden.device} but `{wn}` is on {weight.device}.")
    if bias is not None:
        check_floating(bn, bias)
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"`{bn}` must be `[V]` = ({weight.shape[0]},) for {wn} {tuple(weight.shape)}, got {tuple(bias.shape)}.")
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise ValueError(
                f"`{bn}` must have the dtype and device of `{wn}`: got {bias.dtype} on {bias.device} and "
                f"{weight.dtype} on {weight.device}."
            )


def check_full_hidden_inputs(
    hidden: Any,
    weight: Any,
    bias: Any,
    ref_hidden: Any,
    ref_weight: Any,
    ref_bias: Any,
    mask: Optional[Tensor],
    stacklevel: int = 4,
) -> Optional[Tensor]:
    """Check both heads (:func:`check_head`), that they make logits of one shape, and ``mask [...]``.

    Returns the mask as bool (or None).

    Raises:
        TypeError: for inputs that are not floating point tensors, or a mask that is not a tensor.
        ValueError: for shapes, dtypes or devices that do not match (named).
    """
    check_head(hidden, weight, bias)
    check_head(ref_hidden, ref_weight, ref_bias, prefix="ref_")
    warn_if_reference_requires_grad("ref_hidden", ref_hidden, stacklevel)
    lead, vocab = hidden.shape[:-1], weight.shape[0]
    if ref_hidden.shape[:-1] != lead or ref_weight.shape[0] != vocab:
        raise ValueError(
            "the policy and the reference must make logits of one shape `[..., V]`: got hidden "
            f"{tuple(hidden.shape)} with weight {tuple(weight.shape)} and ref_hidden {tuple(ref_hidden.shape)} "
            f"with ref_weight {tuple(ref_weight.shape)}."
        )
    if ref_hidden.device != hidden.device:
        raise ValueError(f"`hidden` is on {hidden.device} but `ref_hidden` is on {ref_hidden.device}.")
    return check_mask(mask, hidden, "hidden", without="the hidden dimension")


def check_chunk_size(value: Any, name: str = "chunk_size") -> Optional[int]:
    """A chunk size (rows, or vocabulary entries): a positive integer, or None for the kernel's default.

    Raises:
        ValueError: naming ``name`` and the bad value.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"`{name}` must be a positive integer or None, got {value!r}.")
    return value
