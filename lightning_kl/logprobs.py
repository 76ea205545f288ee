r"""Functions over the whole vocabulary: token log-probs, the token entropy (and the log-probs with the entropy,
in one pass); the exact divergence to another model is :mod:`lightning_kl.divergences`, on the same inputs.

Shapes: ``...`` any leading dims (``[b, t]`` for a batch of sequences), ``V`` the vocabulary, ``d``
the hidden size. Each function takes its model's output as ``x``, in any of four forms:

* logits ``[..., V]`` (any layout: ``logits[:, :-1]`` is read in place, never copied whole);
* a vocabulary-sharded DTensor (``Shard(-1)``) or an :class:`~lightning_kl.VocabShard`: this rank's
  columns of logits split over a tensor parallel group, never gathered (``docs/vocabulary.md``);
* an :class:`FromHidden` ``(hidden, weight, bias, logit_scale=, softcap=)``: the logits
  ``hidden @ weight.T + bias`` (scaled and soft-capped as the model does) made chunk by chunk,
  never whole (``weight`` may be a :class:`~lightning_kl.VocabShard` of a column-parallel head's rows).

and an optional sampler, ``sampling=lk.Sampling(temperature, top_k, top_p, min_p)``: the
distribution is then the one the sampler draws from (``generate``'s order and ties). Every function
validates its inputs once and hands them to one chunked engine (:mod:`lightning_kl.kernels.engine`):
float32 maths (float64 for float64 inputs), exact gradients in each input's dtype, no ``[..., V]``
float32 copy, ``O(n)`` numbers kept between forward and backward. The sampler's truncation (top-k,
top-p, min-p) needs whole rows: on a vocabulary split over ranks it is refused with an error naming
the combination (pass the temperature alone, or gather those rows); a recorded kept set
(``kept=``, replay) works there.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_kl.ground.checks import (
    check_floating,
    check_mask,
    check_matching,
    check_values,
)
from lightning_kl.inputs import check_chunk_size, check_head, check_logit_transform, check_tokens
from lightning_kl.ground.kept import KeptSets, as_kept_sets, check_nonempty, report_missing
from lightning_kl.ground.sampler import Sampling, process_scores
from lightning_kl.ground.vocab_shards import VocabShard, is_vocab_parallel
from lightning_kl.kernels.engine import REFERENCES, Head, Partition, Tensors, entropy_kernel, token_logprobs_kernel
from lightning_kl.kernels.engine import token_logprobs_entropy_kernel
from lightning_kl.kernels.full import head_source, logits_source

__all__ = ["OUTSIDE_MODES", "REFERENCES", "FromHidden", "sampler_of", "source_of", "token_entropy", "token_logprobs"]
__all__ += ["token_logprobs_and_entropy"]

#: What to do with a sampled token outside the sampler's kept set: ``"raise"`` (the default: on-policy
#: the sampler and the scorer disagree), ``"-inf"`` (its processed log-prob: importance weight 0), or
#: ``"extend"`` (rollouts reused off-policy: the log-prob on the kept set extended by the sampled token;
#: ``docs/sampling.md``, "Reusing rollouts with a truncating sampler").
OUTSIDE_MODES = ("raise", "-inf", "extend")


class _FromHiddenFields(NamedTuple):
    hidden: Tensor
    weight: Tensor | VocabShard
    bias: Optional[Tensor] = None
    logit_scale: float = 1.0
    softcap: Optional[float] = None


class FromHidden(_FromHiddenFields):
    r"""Logits given as the last hidden states and the LM head, with the head's logit scale and soft cap.

    .. math::
        a = h W^T + b, \qquad z = c \tanh\Big(\frac{s\,a}{c}\Big) \quad (z = s\,a \text{ without a cap})

    :math:`s` = ``logit_scale`` (Cohere's ``logit_scale``, which multiplies the logits), :math:`c` =
    ``softcap`` (Gemma 2/3's ``final_logit_softcapping``); the defaults give ``hidden @ weight.T + bias``.
    A sampler's temperature then divides :math:`z`, as ``generate`` does. :func:`lightning_kl.hf.from_hidden`
    reads both from a ``transformers`` model's config.

    Pass one in place of logits to :func:`~lightning_kl.token_logprobs`, :func:`~lightning_kl.full_kl`,
    :func:`~lightning_kl.token_entropy` or ``KLPenaltyLoss("full")``: the ``[..., V]`` logits are made
    chunk by chunk, in forward and again in backward, and never exist whole; the gradients w.r.t.
    ``hidden``, ``weight`` and ``bias`` go through the scale and the cap exactly
    (:math:`dz/da = s\,\mathrm{sech}^2(s a / c)`, from the pre-activation, chunk by chunk)::

        kl = lk.full_kl(lk.FromHidden(hidden, self.policy.lm_head.weight),
                        lk.FromHidden(ref_hidden, self.ref.lm_head.weight), mask)

    Attributes:
        hidden: ``[..., d]`` the last hidden states (after the final norm).
        weight: ``[V, d]`` the LM head, or a :class:`~lightning_kl.VocabShard` of this rank's rows
            ``[V_local, d]`` of a column-parallel head (the hidden states' gradient is summed over its group).
        bias: optional ``[V]`` head bias (``[V_local]``, this rank's slice, for a shard).
        logit_scale: keyword only: a finite number > 0 that multiplies the logits (default 1).
        softcap: keyword only: None (no cap, the default) or a finite number > 0, the cap :math:`c`.

    Raises:
        TypeError: for a ``logit_scale`` or ``softcap`` that is not a real number (named).
        ValueError: for one out of range (named, with the range).

    Example:
        >>> h, w = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 0.0], [0.0, 1.0]])
        >>> token_logprobs(FromHidden(h, w, softcap=2.0), torch.tensor([0]))  # z = 2 tanh([3, 2] / 2)
        tensor([-0.5599])
    """

    __slots__ = ()

    def __new__(
        cls, hidden: Tensor, weight: Tensor | VocabShard, bias: Optional[Tensor] = None, *, logit_scale: float = 1.0, softcap: Optional[float] = None
    ) -> "FromHidden":
        logit_scale, softcap = check_logit_transform(logit_scale, softcap)
        return super().__new__(cls, hidden, weight, bias, logit_scale, softcap)

    def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:  # pickle and copy: the keywords by name
        return (self.hidden, self.weight, self.bias), {"logit_scale": self.logit_scale, "softcap": self.softcap}

    @classmethod
    def _make(cls, iterable: Any) -> "FromHidden":  # _replace goes through here: checked too
        hidden, weight, bias, logit_scale, softcap = iterable
        return cls(hidden, weight, bias, logit_scale=logit_scale, softcap=softcap)


def _head(x: FromHidden) -> Head:
    """What ``x``'s head does after its matmul, for the engine."""
    return Head(x.logit_scale, x.softcap)


_LEGACY = ("temperature", "top_k", "top_p", "min_p")


def sampler_of(sampling: Any, legacy: dict[str, Any], call: str, warn: bool = True) -> Sampling:
    """The validated sampler from ``sampling=``, or (deprecated, with a warning) from the old keywords."""
    unknown = sorted(set(legacy) - set(_LEGACY))
    if unknown:
        raise TypeError(f"{call}() got unexpected keyword argument(s) {unknown}.")
    if legacy:
        if sampling is not None:
            raise TypeError(f"pass the sampler as `sampling=` only, not with {sorted(legacy)}.")
        if warn:  # (a positional temperature is warned about by the caller, once)
            new = ", ".join(f"{k}={v!r}" for k, v in legacy.items())
            warnings.warn(
                f"{call}({', '.join(f'{k}=' for k in legacy)}...) is deprecated: pass sampling=lk.Sampling({new}).",
                DeprecationWarning,
                stacklevel=3,
            )
        return Sampling(**legacy)
    if sampling is None:
        return Sampling()
    if not isinstance(sampling, Sampling):
        raise TypeError(f"`sampling` must be an lk.Sampling or None, got {type(sampling).__name__}.")
    return sampling


def source_of(x: Any, name: str, sampling: Sampling) -> tuple[Tensors, Partition, Tensor]:
    """One model's output as the engine's source and partition, checked; and a tensor with its leading dims."""
    hidden = isinstance(x, FromHidden)
    if sampling.truncates and (isinstance(x.weight, VocabShard) if hidden else is_vocab_parallel(x)):
        raise ValueError(
            f"sampling={sampling} truncates, which is not supported on logits or heads split over the vocabulary "
            f"(`{name}`): the kept set needs a selection across the shards. Pass the temperature alone, or gather "
            "the logits of these rows (`logits.full_tensor()`) to score a truncating sampler."
        )
    if hidden:
        check_head(x.hidden, x.weight, x.bias, prefix="" if name == "x" else "ref_")
        src, part = head_source(x.hidden, x.weight, x.bias, "weight" if name == "x" else "ref_weight", _head(x))
    else:
        if not is_vocab_parallel(x):
            check_floating(name, x)
            if x.ndim == 0 or x.shape[-1] == 0:
                raise ValueError(f"`{name}` must be `[..., V]` with a vocabulary of V >= 1 entries, got shape {tuple(x.shape)}.")
        src, part = logits_source(x, name)
    return src, part, src.x


def _check_outside(outside: Any) -> str:
    if outside not in OUTSIDE_MODES:
        raise ValueError(f"`outside` must be one of {OUTSIDE_MODES}, got {outside!r}.")
    return outside


#: what to do about a sampled token outside the kept set, in the error's words (one text for both forms)
_OUTSIDE_CAUSES = (
    "Two causes. (1) On-policy, the sampler and the scorer disagree (another processing, e.g. generate's default "
    "top_k=50, or other logits): pass the sampler's exact processing. (2) Rollouts reused off-policy (PPO epochs > 1, "
    "mini-batches, stale or asynchronous rollouts): the policy moved since the rollout and the token left its kept "
    "set, nothing is misconfigured: pass outside='extend' (the log-prob on the kept set extended by the sampled "
    "token: finite, the processed log-prob wherever the token is still kept), or outside='-inf' and drop those "
    "tokens from the mask (their importance weight is 0). See docs/sampling.md, 'Reusing rollouts with a truncating "
    "sampler'. If the position is padding after EOS (never sampled), give it `ignore_index` "
    "(tokens.masked_fill(~mask, -100), ignore_index=-100)."
)


def _report_outside(outside: Tensor, tokens: Tensor, sampling: Sampling) -> None:
    """Fail on a sampled token outside the kept set; no host read off the CPU (:func:`check_values`)."""

    def named() -> ValueError:
        where = outside.nonzero()[0].tolist()
        return ValueError(
            f"{int(outside.sum())} sampled token(s) lie outside the kept set of the processing {sampling.as_dict()}, "
            f"the first at position {tuple(where)} (id {int(tokens[tuple(where)])}): the sampler and the scorer "
            f"disagree, or the policy moved since the rollout. {_OUTSIDE_CAUSES}"
        )

    rule = f"sampled tokens must lie in the kept set of the processing {sampling.as_dict()}. {_OUTSIDE_CAUSES}"
    check_values(outside, named, rule)


def _extend_outside(x: Any, ids: Tensor, lp: Tensor, outside: Tensor, proc: Sampling, kept_from: Optional[Tensor]) -> Tensor:
    r"""``outside="extend"``: at each token outside the kept set :math:`K`, the log-prob on :math:`K \cup \{y\}`.

    :math:`z_y / T - \operatorname{lse}_{j \in K \cup \{y\}}(z_j / T)`, with its exact gradient
    :math:`([i = y] - [i \in K \cup \{y\}]\, p'_i) / T` (autograd through the rows' logits, made again
    in the compute dtype: one host read finds the rows, ``[r, V]`` temporaries for those ``r`` rows only).
    The other tokens keep the engine's value, bitwise."""
    rows = outside.reshape(-1).nonzero().squeeze(1)
    if rows.numel() == 0:
        return lp
    if lp.dim() == 0:  # one token: as a row of one
        one = x._replace(hidden=x.hidden[None]) if isinstance(x, FromHidden) else x[None]
        return _extend_outside(one, ids, lp[None], outside[None], proc, None if kept_from is None else kept_from[None])[0]
    dtype, where = lp.dtype, torch.unravel_index(rows, lp.shape)  # those rows only (no copy of a strided input)
    if isinstance(x, FromHidden):
        a = torch.nn.functional.linear(x.hidden[where], x.weight, x.bias)
        z = a.to(dtype) * x.logit_scale
        if x.softcap is not None:
            z = torch.tanh(z / x.softcap) * x.softcap
    else:
        z = x[where].to(dtype)
    e = z / proc.temperature
    chooser = e.detach() if kept_from is None else kept_from[where].to(dtype) / proc.temperature
    y = ids.index_select(0, rows).unsqueeze(1)
    keep = (process_scores(chooser, proc) != float("-inf")).scatter_(1, y, True)
    value = torch.log_softmax(e.masked_fill(~keep, float("-inf")), -1).gather(1, y).squeeze(1)
    return lp.reshape(-1).index_put((rows,), value).view(lp.shape)


def token_logprobs(
    x: Tensor | VocabShard | FromHidden,
    tokens: Tensor,
    *legacy_args: Any,
    sampling: Optional[Sampling] = None,
    ignore_index: Optional[int] = None,
    outside: str = "raise",
    kept_from: Optional[Tensor] = None,
    return_log_kept: bool = False,
    chunk_size: Optional[int] = None,
    kept: Any = None,
    return_kept: bool = False,
    **legacy: Any,
) -> Any:
    r"""Log-probabilities of ``tokens`` under ``softmax(z / T)``, or under the sampler's processed distribution.

    .. math::
        \log \tilde p_y = \frac{z_y}{T} - \operatorname{lse}_{j \in K}\Big(\frac{z_j}{T}\Big), \qquad
        \log S = \operatorname{lse}_{j \in K}\Big(\frac{z_j}{T}\Big) - \operatorname{lse}_j\Big(\frac{z_j}{T}\Big)

    :math:`K` the sampler's kept set (the whole vocabulary without truncation), :math:`S` the share of
    ``softmax(z / T)`` it keeps. Exact gradients: :math:`([i = y] - [i \in K] \tilde p_i) / T` w.r.t. the
    logits (the kept set is a selection), and through them w.r.t. hidden states and head.

    Args:
        x: ``[..., V]`` logits, a vocabulary shard (DTensor ``Shard(-1)`` or :class:`~lightning_kl.VocabShard`),
            or :class:`FromHidden`.
        tokens: ``[...]`` integer ids in ``[0, V)`` (global ids for a shard).
        sampling: the sampler (:class:`~lightning_kl.Sampling`); None: ``softmax(z)``. Truncation is
            refused on a split vocabulary.
        ignore_index: an id whose positions get 0 (every output) and exactly zero gradient (``-100``),
            even where the logits hold NaN.
        outside: a token outside the kept set: ``"raise"`` (default; the error names it), ``"-inf"``
            (log-prob ``-inf``, zero gradient: its importance weight is 0; drop it from the mask before a
            sampled KL estimator), or ``"extend"`` for rollouts reused off-policy: the log-prob on the kept
            set extended by the token, :math:`z_y / T - \operatorname{lse}_{j \in K \cup \{y\}}(z_j / T)`,
            finite, with its exact gradient, bitwise the processed log-prob wherever the token is kept
            (one host read finds the rows outside, which are made again: ``[r, V]`` for those ``r`` rows).
        kept_from: optional ``[..., V]`` logits of another model (the policy's) whose processing chooses
            the kept set: ``x``'s distribution renormalized on that set (no gradient flows into it;
            logits ``x`` only).
        return_log_kept: also return :math:`\log S` per token (without grad; 0 without truncation).
        chunk_size: rows per chunk (default: about :math:`2^{19}` logits per chunk on CPU, :math:`2^{25}`
            on GPU; from hidden states :math:`2^{23}` on CPU and at least 16 rows).
        kept: replay: the kept sets recorded when the tokens were sampled (``return_kept=True`` at rollout
            time, or an inference engine's record: :class:`~lightning_kl.ground.kept.KeptSets`, or the
            pair ``(ids, offsets)`` shaped like ``tokens``). The distribution is ``softmax(z / T)``
            renormalized on each position's recorded set, ties at its boundary included; the sampler's
            top-k, top-p and min-p are not applied again. On-policy this is the processed log-prob
            bitwise; off-policy it is finite for every sampled token, with the gradient
            :math:`([j = y] - [j \in K] \tilde p_j) / T`. A sampled token missing from its own set
            fails (position named, whatever ``outside`` says), and so does a record made at another
            temperature than ``sampling``'s. Logits, :class:`FromHidden` and vocabulary shards (there a
            :class:`~lightning_kl.ground.kept.KeptSets`, the same on every rank); not with ``kept_from``.
        return_kept: also return the kept set of every position
            (:class:`~lightning_kl.ground.kept.KeptSets` shaped like ``tokens``, empty at ignored
            positions; None when the sampler keeps the whole vocabulary), to replay later with
            ``kept=``. Recording reads the sets' sizes on the host (one sync per chunk off the CPU).

    The deprecated ``temperature``, ``top_k``, ``top_p``, ``min_p`` keywords (and a positional
    temperature and ignore_index) still work, with a ``DeprecationWarning``: pass ``sampling=``.

    Returns:
        ``[...]`` log-probs, float32 (float64 for float64 inputs); with ``return_log_kept`` and
        ``return_kept``, a tuple ``(logprobs, log_kept, kept)`` of those asked for, in that order.

    Raises:
        TypeError: for inputs that are not floating point, tokens that are not integers, a bad ``sampling``.
        ValueError: for shapes or devices that do not match (named), an id outside ``[0, V)`` that is not
            ``ignore_index`` (named), a bad ``outside`` or chunk size, truncation on a split vocabulary,
            or (``outside="raise"``) a token outside the kept set (on the CPU its count, first position and
            id named; elsewhere a device-side assertion naming the rule, without a host sync).

    Example:
        >>> logits = torch.tensor([[0.0, 0.0], [2.0, 1.0]], requires_grad=True)
        >>> lp = token_logprobs(logits, torch.tensor([1, -100]), ignore_index=-100)
        >>> lp  # log(1/2); the ignored token gives 0
        tensor([-0.6931,  0.0000], grad_fn=<_RowsBackward>)
        >>> lp.sum().backward(); logits.grad[0]  # one-hot minus softmax
        tensor([-0.5000,  0.5000])
        >>> z = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
        >>> token_logprobs(z, torch.tensor([1]), sampling=Sampling(top_k=2), return_log_kept=True)
        (tensor([-1.3133]), tensor([-0.1269]))
        >>> lp, kept = token_logprobs(z, torch.tensor([1]), sampling=Sampling(top_k=2), return_kept=True)
        >>> kept.to_mask()  # the rollout's kept set, recorded
        tensor([[ True,  True, False, False]])
        >>> later = torch.tensor([[0.0, 1.0, 2.0, -1.0]])  # the policy moved: token 1 left its top-2
        >>> token_logprobs(later, torch.tensor([1]), sampling=Sampling(top_k=2), kept=kept)  # renormalized on {0, 1}
        tensor([-0.3133])
    """
    if legacy_args:
        if len(legacy_args) > 2:
            raise TypeError(f"token_logprobs() takes x, tokens and keywords, got {2 + len(legacy_args)} positional arguments.")
        warnings.warn(
            "token_logprobs(x, tokens, temperature, ignore_index) positionally is deprecated: pass "
            "sampling=lk.Sampling(temperature=...) and ignore_index=... by keyword.",
            DeprecationWarning,
            stacklevel=2,
        )
        legacy = {"temperature": legacy_args[0], **legacy}
        if len(legacy_args) == 2:
            ignore_index = legacy_args[1]
    proc = sampler_of(sampling, legacy, "token_logprobs", warn=not legacy_args)
    return _token_logprobs(x, tokens, proc, ignore_index, outside, kept_from, return_log_kept, chunk_size, kept, return_kept)


def _token_logprobs(
    x: Any, tokens: Tensor, proc: Sampling, ignore_index: Any, outside: Any, kept_from: Any, return_log_kept: bool, chunk_size: Any,
    kept: Any = None, return_kept: bool = False,
) -> Any:
    if kept is not None:  # the record replaces the sampler's truncation: its temperature only
        proc = Sampling(proc.temperature)
    src, part, lead = source_of(x, "x" if isinstance(x, FromHidden) else "logits", proc)
    outside = _check_outside(outside)
    check_chunk_size(chunk_size)
    vocab = None if part.split else (src.x.shape[-1] if src.weight is None else src.weight.shape[0])
    ids, ignored = check_tokens(tokens, lead.shape[:-1], vocab, lead.device, "hidden" if src.weight is not None else "logits", ignore_index)
    if kept_from is not None:
        if src.weight is not None or part.split:
            raise ValueError("`kept_from` takes whole logits `x` (not lk.FromHidden nor a vocabulary shard).")
        check_matching("logits", src.x, "kept_from", kept_from)
        kept_from = kept_from.detach()
    if kept is not None:
        kept = _replayed(kept, kept_from, part, tokens.shape, src, lead.device, proc.temperature)
    record: Optional[list[Any]] = [] if return_kept and kept is None else None  # a replay returns its own record
    lp, log_kept, out = token_logprobs_kernel(src, ids, ignored, proc, part, chunk_size, kept_from, kept, record)
    if kept is not None:
        report_missing(out, tokens)
    elif (proc.truncates or kept_from is not None) and outside == "raise":
        _report_outside(out, tokens, proc)
    elif (proc.truncates or kept_from is not None) and outside == "extend":
        lp = _extend_outside(x, ids, lp, out, proc, kept_from)
    if not (return_log_kept or return_kept):
        return lp
    return (lp,) + ((log_kept,) if return_log_kept else ()) + ((kept if record is None else record[0],) if return_kept else ())


def _replayed(
    kept: Any, kept_from: Any, part: Partition, shape: torch.Size, src: Tensors, device: torch.device, temperature: float
) -> KeptSets:
    """``kept=`` checked for replay on this source (no ``kept_from``; on a vocabulary shard a
    :class:`KeptSets`, whose vocabulary the shards are not checked against)."""
    if kept_from is not None:
        raise ValueError("`kept` (replay) and `kept_from` choose the kept set each: pass one.")
    if part.split:
        if not isinstance(kept, KeptSets):
            raise TypeError("on a vocabulary shard `kept` must be a KeptSets (lightning_kl.ground.kept), which names the vocabulary size.")
        return as_kept_sets(kept, shape, kept.vocab, device, temperature)
    return as_kept_sets(kept, shape, src.x.shape[-1] if src.weight is None else src.weight.shape[0], device, temperature)


def token_entropy(
    x: Tensor | VocabShard | FromHidden,
    mask: Optional[Tensor] = None,
    *,
    sampling: Optional[Sampling] = None,
    chunk_size: Optional[int] = None,
    kept: Any = None,
) -> Tensor:
    r"""Per-token entropy :math:`H = -\sum_i \tilde p_i \log \tilde p_i` of the (processed) distribution.

    The quantity RL runs log every step, computed chunk by chunk with the memory of
    :func:`token_logprobs` (no ``[..., V]`` float32 copy), exact, with gradients
    :math:`-\tilde p_i (\log \tilde p_i + H) / T` w.r.t. the logits.

    Args:
        x: ``[..., V]`` logits, a vocabulary shard, or :class:`FromHidden` (as :func:`token_logprobs`).
        mask: optional ``[...]``, True on valid tokens (value 0 and gradient exactly 0 elsewhere).
        sampling: the sampler (None: ``softmax(z)``); truncation is refused on a split vocabulary.
        chunk_size: rows per chunk.
        kept: replay (as :func:`token_logprobs`): the entropy of ``softmax(z / T)`` renormalized on each
            position's recorded kept set; every valid position's set must hold a token (named otherwise).

    Returns:
        ``[...]`` entropy per token (nats), float32 (float64 for float64 inputs).

    Example:
        >>> token_entropy(torch.zeros(1, 4))  # uniform over 4: log 4
        tensor([1.3863])
        >>> token_entropy(torch.tensor([[3.0, 2.0, 0.0, 0.0]]), sampling=Sampling(top_k=1))  # one token kept
        tensor([0.])
    """
    proc = sampler_of(sampling, {}, "token_entropy")
    if kept is not None:  # the record replaces the sampler's truncation
        proc = Sampling(proc.temperature)
    src, part, lead = source_of(x, "x" if isinstance(x, FromHidden) else "logits", proc)
    check_chunk_size(chunk_size)
    mask = check_mask(mask, lead, "hidden" if src.weight is not None else "logits", without="the last dimension")
    if kept is not None:
        kept = _replayed(kept, None, part, lead.shape[:-1], src, lead.device, proc.temperature)
        check_nonempty(kept, mask)
    return entropy_kernel(src, None if mask is None else ~mask.reshape(-1), proc, part, chunk_size, kept)


def token_logprobs_and_entropy(
    x: Tensor | VocabShard | FromHidden,
    tokens: Tensor,
    *,
    sampling: Optional[Sampling] = None,
    ignore_index: Optional[int] = None,
    outside: str = "raise",
    chunk_size: Optional[int] = None,
    kept: Any = None,
) -> tuple[Tensor, Tensor]:
    r""":func:`token_logprobs` and :func:`token_entropy` from one read of the vocabulary per chunk.

    One forward and one backward for both: the backward writes the sum of both gradients,
    :math:`(g_{\log p}([i = y] - \tilde p_i) - g_H \tilde p_i (\log \tilde p_i + H)) / T`, through one
    writer (from a head: one float32 ``[V, d]`` accumulator, not two). The values equal the two calls';
    the entropy is that of the distribution the log-probs are taken under (the sampler's processed one).
    ``x``, ``tokens``, ``sampling``, ``ignore_index`` (0 in both outputs, zero gradient), ``outside``
    (the log-prob; the entropy is the row's), ``chunk_size`` and ``kept`` (replay) as :func:`token_logprobs`,
    whose errors it raises.

    Returns:
        ``(logprobs, entropy)``, each ``[...]``, float32 (float64 for float64 inputs).

    Example:
        >>> logits = torch.tensor([[0.0, 0.0], [2.0, 1.0]], requires_grad=True)
        >>> lp, ent = token_logprobs_and_entropy(logits, torch.tensor([1, -100]), ignore_index=-100)
        >>> lp, ent  # log(1/2) and log 2; the ignored token gives 0 and 0
        (tensor([-0.6931,  0.0000], grad_fn=<_RowsBackward>), tensor([0.6931, 0.0000], grad_fn=<_RowsBackward>))
        >>> (lp + ent).sum().backward(); logits.grad[0]  # one-hot minus softmax; H is flat at the uniform
        tensor([-0.5000,  0.5000])
    """
    proc = sampler_of(sampling, {}, "token_logprobs_and_entropy")
    if kept is not None:  # the record replaces the sampler's truncation
        proc = Sampling(proc.temperature)
    src, part, lead = source_of(x, "x" if isinstance(x, FromHidden) else "logits", proc)
    outside = _check_outside(outside)
    check_chunk_size(chunk_size)
    vocab = None if part.split else (src.x.shape[-1] if src.weight is None else src.weight.shape[0])
    ids, ignored = check_tokens(tokens, lead.shape[:-1], vocab, lead.device, "hidden" if src.weight is not None else "logits", ignore_index)
    if kept is not None:
        kept = _replayed(kept, None, part, tokens.shape, src, lead.device, proc.temperature)
    lp, ent, out = token_logprobs_entropy_kernel(src, ids, ignored, proc, part, chunk_size, kept)
    if kept is not None:
        report_missing(out, tokens)
    elif proc.truncates and outside == "raise":
        _report_outside(out, tokens, proc)
    elif proc.truncates and outside == "extend":
        lp = _extend_outside(x, ids, lp, out, proc, None)
    return lp, ent
