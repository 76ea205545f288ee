r"""The checks of vocabulary-scale inputs: pairs of logits, hidden states and their LM heads, token ids
and chunk sizes, validated once at the entry of :func:`~lightning_kl.token_logprobs`,
:func:`~lightning_kl.full_kl`, :func:`~lightning_kl.token_entropy` and ``kl_penalty("full")``.
Errors name the shapes and values."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_kl.ground.checks import (
    check_floating,
    check_mask,
    check_matching,
    check_values,
    warn_if_reference_requires_grad,
)
from lightning_kl.ground.vocab_shards import VocabShard, check_split_alike, local_part

__all__ = [
    "check_chunk_size",
    "check_full_hidden_inputs",
    "check_full_inputs",
    "check_head",
    "check_not_sharded",
    "check_tokens",
]


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
