r"""Every per-call input check of the loss and the functions, in one module: each call's tensors are checked
here once, at its entry, and handed on as checked inputs (:class:`KLInputs`) that nothing checks again.

Covered: ``kl_penalty`` and ``KLPenaltyLoss.forward`` (log-probs, logits or hidden states, the mask,
``old_logprob``, ``sampled_logprob``, the step's totals and ``accumulate_grad_batches``), ``aggregate``, the
vocabulary functions (``token_logprobs``, ``full_kl``, ``token_entropy``: pairs of logits, hidden states and
their LM heads, token ids, chunk sizes) and the reward callback's pair. Generic primitives (a floating tensor, a
mask of a shape, values checked without a host read, the log-prob rule, the warning at the user's line) are on
the ground floor (:mod:`lightning_kl.ground.checks`). Settings given once at construction are checked beside
their owner (``parse_estimator``, ``check_agg_mode``, ``check_level``, ``check_max_weight``). Errors name the
argument, the shapes and what fits.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_kl.estimators import EstimatorSpec
from lightning_kl.ground.checks import (
    check_floating,
    check_lead_shape,
    check_logprobs,
    check_mask,
    check_matching,
    check_temperature,
    check_values,
    warn_if_reference_requires_grad,
    warn_user,
)
from lightning_kl.ground.sampler import Sampling
from lightning_kl.ground.vocab_shards import VocabShard, check_split_alike, is_vocab_parallel, local_part, sampled_locals

__all__ = [
    "KLInputs",
    "check_accumulate_grad_batches",
    "check_aggregate_args",
    "check_chunk_size",
    "check_count",
    "check_full_hidden_inputs",
    "check_full_inputs",
    "check_head",
    "check_kl_inputs",
    "check_logit_transform",
    "check_logprob_values",
    "check_not_sharded",
    "check_pair",
    "check_sampled_logprob",
    "check_tokens",
    "resolve_sampling",
]

#: The log-prob rule of :func:`check_kl_inputs` (a ground primitive, named here for the callers of 0.2).
check_logprob_values = check_logprobs


class KLInputs(NamedTuple):
    """The checked inputs of one :func:`~lightning_kl.kl_penalty` or :class:`~lightning_kl.KLPenaltyLoss` call.

    Each tensor checked once (:func:`check_kl_inputs`): the mask as bool, a DTensor of sampled log-probs as its
    local part, ``old_logprob`` detached; ``dtype`` the compute dtype (the inputs' promoted, at least float32);
    the step's totals and ``k`` checked (None when not given).
    """

    logprob: Any
    ref_logprob: Any
    mask: Optional[Tensor]
    old_logprob: Optional[Tensor]
    sampled_logprob: Optional[Tensor]
    dtype: torch.dtype = torch.float32
    num_tokens: Any = None
    num_seqs: Any = None
    accumulate_grad_batches: Optional[int] = None


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


def check_accumulate_grad_batches(k: object) -> int:
    """Validate the number of micro-batches Lightning divides the loss by: a positive integer."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(
            f"`accumulate_grad_batches` must be a positive integer (the Trainer's accumulate_grad_batches), got {k!r}."
        )
    return k


def resolve_sampling(sampling: Any, temperature: Any, estimator: str, where: str) -> Sampling:
    """The sampler of an entry point from ``sampling=`` and the deprecated ``temperature=`` (None: not given).

    ``temperature=T`` warns (``DeprecationWarning`` naming ``sampling=lk.Sampling(temperature=T)``) and is
    read as that. A sampler that changes the distribution belongs to ``"full"`` only: sampled estimators take
    log-probs that were computed under it already.

    Raises:
        ValueError: for both given, a ``sampling`` that is not an ``lk.Sampling``, or a non-neutral sampler
            with a sampled estimator (saying where it belongs).
    """
    if temperature is not None:
        warn_user(
            f"`{where}(temperature=...)` is deprecated: pass `sampling=lk.Sampling(temperature={temperature!r})`, "
            "the same object that configures the sampler and the scorer.",
            DeprecationWarning,
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


def check_kl_inputs(
    logprob: Any,
    ref_logprob: Any,
    spec: EstimatorSpec,
    mask: Any,
    old_logprob: Any,
    sampled_logprob: Any,
    level: str,
    sampling: Optional[Sampling] = None,
    num_tokens: Any = None,
    num_seqs: Any = None,
    accumulate_grad_batches: Any = None,
) -> KLInputs:
    """Check the tensors of one :func:`~lightning_kl.kl_penalty` or :class:`~lightning_kl.KLPenaltyLoss` call, once.

    The configuration (``spec``, ``level``, ``sampling``) is checked by the caller, at construction. Returns
    the inputs to compute with (:class:`KLInputs`). Warnings point at the user's line.

    Raises:
        TypeError, ValueError: naming the argument, the shapes, and what fits.
    """
    check_count("num_tokens", num_tokens)
    check_count("num_seqs", num_seqs)
    k = None if accumulate_grad_batches is None else check_accumulate_grad_batches(accumulate_grad_batches)
    counts = (num_tokens, num_seqs, k)
    if spec.base == "full":
        return _check_full(logprob, ref_logprob, spec, mask, old_logprob, sampled_logprob, level == "sequence", sampling, counts)
    if any(is_from_hidden(x) for x in (logprob, ref_logprob)):
        raise TypeError(
            f"`lk.FromHidden` inputs take the 'full' estimator with one for each model, got {spec.name!r} with "
            f"{type(logprob).__name__} and {type(ref_logprob).__name__}; for a sampled estimator compute the log-probs "
            "with `lk.token_logprobs(lk.FromHidden(hidden, weight), tokens)`."
        )
    _sampled_logprob_given(sampled_logprob, False)
    # the calls below go to the ground floor only, each file once (the path of a forward goes down)
    logprob, ref_logprob, old_logprob = sampled_locals(logprob, ref_logprob, old_logprob)  # loss_parallel's DTensors
    if level == "sequence" and isinstance(logprob, Tensor) and logprob.ndim == 0:
        raise ValueError("level='sequence' needs a token dimension (the last one), got a scalar `logprob`.")
    check_matching("logprob", logprob, "ref_logprob", ref_logprob)
    warn_if_reference_requires_grad("ref_logprob", ref_logprob)
    if old_logprob is not None:
        check_matching("old_logprob", old_logprob, "logprob", logprob)
        if old_logprob.requires_grad:
            warn_user(
                "`old_logprob` requires grad: it is the sampling policy's log-probs, a constant of the importance "
                "weight pi / pi_old; its gradient would change the estimator's (k3's by about half). It is detached "
                "here; pass `old_logprob.detach()` (or compute it under `torch.no_grad()`)."
            )
            old_logprob = old_logprob.detach()
    mask = check_mask(mask, logprob, "logprob")
    check_logprobs({"logprob": logprob, "ref_logprob": ref_logprob, "old_logprob": old_logprob}, mask)
    dtype = torch.promote_types(torch.promote_types(logprob.dtype, ref_logprob.dtype), torch.float32)  # compute_dtype's rule
    return KLInputs(logprob, ref_logprob, mask, old_logprob, None, dtype, *counts)


def _check_full(
    x: Any, ref_x: Any, spec: EstimatorSpec, mask: Any, old_logprob: Any, sampled_logprob: Any, sequence: bool,
    sampling: Optional[Sampling], counts: tuple[Any, Any, Any],
) -> KLInputs:
    if old_logprob is not None:
        raise ValueError(
            "`old_logprob` does not apply to the 'full' estimator: it sums over the whole vocabulary under "
            "the current policy, so it needs no importance weights (they correct sampled tokens drawn by an "
            "older policy). Drop `old_logprob`, or use a sampled estimator."
        )
    hidden = is_from_hidden(x), is_from_hidden(ref_x)
    if any(hidden) and not all(hidden):
        raise TypeError(
            f"`lk.FromHidden` inputs take the 'full' estimator with one for each model, got {spec.name!r} with "
            f"{type(x).__name__} and {type(ref_x).__name__}."
        )
    _sampled_logprob_given(sampled_logprob, sequence)
    if all(hidden):
        mask = check_full_hidden_inputs(
            x.hidden, x.weight, x.bias, ref_x.hidden, ref_x.weight, ref_x.bias, mask, sampling=sampling
        )
        like, what = x.hidden, "hidden"
        dtype = torch.promote_types(torch.promote_types(x.weight.dtype, ref_x.weight.dtype), torch.float32)
    else:
        mask, like, ref_like = _check_logits(x, ref_x, mask, sampling)
        what = "logits"
        dtype = torch.promote_types(torch.promote_types(like.dtype, ref_like.dtype), torch.float32)
    if mask is None and like.ndim < 3:
        raise ValueError(
            f"'full' takes the {what} of every position `[b, t, {'d' if what == 'hidden' else 'V'}]` and a mask "
            f"`[b, t]`; got {what} {tuple(like.shape)} and no mask: a `[b, t]` tensor of log-probs here would "
            "be read as b rows of a vocabulary of t. Pass both models' logits (or `lk.FromHidden`) with the "
            "mask; for flat rows `[n, V]` pass `mask=torch.ones(n, dtype=torch.bool)`."
        )
    if sequence:
        check_lead_shape("sampled_logprob", sampled_logprob, "logits", like if all(hidden) else x)
        check_logprobs({"sampled_logprob": sampled_logprob}, mask)
    return KLInputs(x, ref_x, mask, None, sampled_logprob, dtype, *counts)


def check_sampled_logprob(sampled_logprob: object, logits: Any, full_sequence: bool) -> Optional[Tensor]:
    """``sampled_logprob`` is needed by ``full`` at the sequence level, and only there; shape ``logits[..., 0]``.

    Raises:
        ValueError: when it is missing for ``full`` at ``level="sequence"`` (saying why), given anywhere
            else, or of the wrong shape or device (both are named).
        TypeError: when it is not a floating point tensor.
    """
    _sampled_logprob_given(sampled_logprob, full_sequence)
    if not full_sequence:
        return None
    check_lead_shape("sampled_logprob", sampled_logprob, "logits", logits)
    return sampled_logprob  # type: ignore[return-value]


def _sampled_logprob_given(sampled_logprob: object, full_sequence: bool) -> None:
    if not full_sequence:
        if sampled_logprob is not None:
            raise ValueError(
                "`sampled_logprob` is for estimator='full' at level='sequence' only (the score of the sampled "
                "tokens for the KL-to-go term); sampled estimators read it from `logprob` already."
            )
    elif sampled_logprob is None:
        raise ValueError(
            "estimator='full' at level='sequence' needs `sampled_logprob`, the policy's log-probs of the sampled "
            "tokens `[..., t]` (differentiable, at the sampling temperature; e.g. log_softmax(logits / T) gathered "
            "at the tokens): the exact per-position KL gives the local gradient, but the KL-to-go term is carried "
            "by the score grad log pi(y_t | y_<t) of the sampled tokens, which the logits alone do not give."
        )


def check_pair(logprob: object, ref_logprob: object) -> None:
    """``logprob`` and ``ref_logprob``: floating tensors of one shape on one device; warns if the reference requires grad."""
    check_matching("logprob", logprob, "ref_logprob", ref_logprob)
    warn_if_reference_requires_grad("ref_logprob", ref_logprob)


def check_aggregate_args(
    values: Any, mask: Any, norm: Any, num_tokens: Any, num_seqs: Any, world_size: Any
) -> Optional[Tensor]:
    """The tensors and numbers of one :func:`~lightning_kl.aggregate` call; returns the mask as bool."""
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
    return mask


def _refuse_split_truncation(sampling: Optional[Sampling], x: Any, ref_x: Any) -> None:
    # a truncating sampler's kept set is a selection across the ranks of a vocabulary split: not built
    if sampling is not None and sampling.truncates and (is_vocab_parallel(x) or is_vocab_parallel(ref_x)):
        raise ValueError(
            f"The exact KL of a truncating sampler ({sampling!r}) is not available on a vocabulary split over "
            "processes (top-k, top-p and min-p select across the shards): pass the whole logits of both models, "
            "or a sampling with the temperature alone."
        )


def check_logit_transform(logit_scale: Any, softcap: Any) -> tuple[float, Optional[float]]:
    """A head's logit scale (a finite number > 0) and soft cap (None, or a finite number > 0), as floats.

    A scale of 0 would make every distribution uniform and a negative one would reverse it: no model
    has either, so both are refused as mistakes. A soft cap of 0 or below, or infinite, is no cap
    (``None`` is).

    Raises:
        TypeError: for a value that is not a real number (``bool`` included), naming it.
        ValueError: for a value out of range, naming it and the range.
    """
    for name, value in (("logit_scale", logit_scale), ("softcap", softcap)):
        if name == "softcap" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            none = " or None" if name == "softcap" else ""
            raise TypeError(f"`{name}` must be a real number{none}, got {type(value).__name__} {value!r}.")
        if not (math.isfinite(value) and value > 0):
            none = " or None (no cap)" if name == "softcap" else ""
            raise ValueError(f"`{name}` must be a finite number > 0{none}, got {value!r}.")
    return float(logit_scale), None if softcap is None else float(softcap)


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


def check_full_inputs(
    logits: Any, ref_logits: Any, mask: Optional[Tensor], sampling: Optional[Sampling] = None
) -> Optional[Tensor]:
    """Check ``logits``, ``ref_logits`` ``[..., V]`` and ``mask`` ``[...]``; return the mask as bool.

    With ``sampling``, a truncating one on a vocabulary split over processes is refused.

    Raises:
        TypeError: for inputs that are not floating point tensors, or a mask that is not a tensor.
        ValueError: for shapes or devices that do not match (both are named), or a truncating sampler on a split.
    """
    return _check_logits(logits, ref_logits, mask, sampling)[0]


def _check_logits(logits: Any, ref_logits: Any, mask: Any, sampling: Optional[Sampling]) -> tuple[Optional[Tensor], Tensor, Tensor]:
    # the mask as bool and both local parts; the sampler's rule, the split, then the ground's checks
    _refuse_split_truncation(sampling, logits, ref_logits)
    check_split_alike("logits", logits, "ref_logits", ref_logits)
    logits, ref_logits = local_part(logits), local_part(ref_logits)  # a vocabulary shard: its local part
    check_matching("logits", logits, "ref_logits", ref_logits)
    warn_if_reference_requires_grad("ref_logits", ref_logits)
    assert isinstance(logits, Tensor)
    if logits.ndim == 0:
        raise ValueError("'full' takes logits `[..., V]` with a vocabulary dimension, got a scalar.")
    return check_mask(mask, logits, "logits", without="the vocabulary dimension"), logits, ref_logits


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
    sampling: Optional[Sampling] = None,
) -> Optional[Tensor]:
    """Check both heads (:func:`check_head`), that they make logits of one shape, and ``mask [...]``.

    Returns the mask as bool (or None). With ``sampling``, a truncating one on a split head is refused.

    Raises:
        TypeError: for inputs that are not floating point tensors, or a mask that is not a tensor.
        ValueError: for shapes, dtypes or devices that do not match (named).
    """
    _refuse_split_truncation(sampling, weight, ref_weight)
    check_head(hidden, weight, bias)
    check_head(ref_hidden, ref_weight, ref_bias, prefix="ref_")
    warn_if_reference_requires_grad("ref_hidden", ref_hidden)
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



def is_from_hidden(x: object) -> bool:
    # lk.FromHidden is defined in logprobs (same layer, which imports this module): recognized by its fields
    return isinstance(x, tuple) and getattr(type(x), "_fields", ())[:3] == ("hidden", "weight", "bias")
