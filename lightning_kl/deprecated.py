r"""Deprecated names of the sampler's log-probs and KL: each warns and calls its replacement.

The sampler's distribution is now an argument of every function over the vocabulary
(``sampling=lk.Sampling(temperature, top_k, top_p, min_p)``, :mod:`lightning_kl.logprobs`):

=====================================================  ===================================================================
deprecated                                             replacement
=====================================================  ===================================================================
``processed_logprobs(logits, tokens, T, k, p, m)``     ``token_logprobs(logits, tokens, sampling=Sampling(T, k, p, m), return_log_kept=True)``
``processed_logprobs_from_hidden(h, w, tokens, b...)``  ``token_logprobs(FromHidden(h, w, b), tokens, sampling=..., return_log_kept=True)``
``processed_full_kl(logits, ref, mask, top_k=...)``    ``full_kl(logits, ref, mask, sampling=Sampling(...), reference=...)``
=====================================================  ===================================================================
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from torch import Tensor

from lightning_kl.ground.checks import warn_user
from lightning_kl.ground.sampler import Sampling
from lightning_kl.ground.vocab_shards import VocabShard
from lightning_kl.divergences import full_kl
from lightning_kl.inputs import check_chunk_size
from lightning_kl.logprobs import OUTSIDE_MODES, REFERENCES, FromHidden, token_logprobs

__all__ = ["OUTSIDE_MODES", "REFERENCES", "SampledLogprobs", "full_kl_from_hidden", "processed_full_kl", "processed_logprobs"]
__all__ += ["processed_logprobs_from_hidden", "token_logprobs_from_hidden"]


class SampledLogprobs(NamedTuple):
    r"""What the deprecated :func:`processed_logprobs` returns: log-probs and the log of the kept mass.

    Attributes:
        logprobs: ``[...]`` :math:`\log \tilde p_y`, differentiable.
        log_kept: ``[...]`` :math:`\log S \le 0`, the log of the share of the softmax the sampler keeps (no grad).
    """

    logprobs: Tensor
    log_kept: Tensor


def _warn(old: str, new: str) -> None:
    warn_user(f"lk.{old} is deprecated: use {new}.", DeprecationWarning)


def processed_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    ignore_index: Optional[int] = None,
    *,
    outside: str = "raise",
    kept_from: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
) -> SampledLogprobs:
    """Deprecated: ``lk.token_logprobs(logits, tokens, sampling=lk.Sampling(...), return_log_kept=True)``."""
    _warn("processed_logprobs", "lk.token_logprobs(logits, tokens, sampling=lk.Sampling(...), return_log_kept=True)")
    lp, log_kept = token_logprobs(
        logits,
        tokens,
        sampling=Sampling(temperature, top_k, top_p, min_p),
        ignore_index=ignore_index,
        outside=outside,
        kept_from=kept_from,
        return_log_kept=True,
        chunk_size=chunk_size,
    )
    return SampledLogprobs(lp, log_kept)


def processed_logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    ignore_index: Optional[int] = None,
    *,
    outside: str = "raise",
    chunk_size: Optional[int] = None,
) -> SampledLogprobs:
    """Deprecated: ``lk.token_logprobs(lk.FromHidden(hidden, weight, bias), tokens, sampling=..., return_log_kept=True)``."""
    _warn(
        "processed_logprobs_from_hidden",
        "lk.token_logprobs(lk.FromHidden(hidden, weight, bias), tokens, sampling=lk.Sampling(...), return_log_kept=True)",
    )
    lp, log_kept = token_logprobs(
        FromHidden(hidden, weight, bias),
        tokens,
        sampling=Sampling(temperature, top_k, top_p, min_p),
        ignore_index=ignore_index,
        outside=outside,
        return_log_kept=True,
        chunk_size=chunk_size,
    )
    return SampledLogprobs(lp, log_kept)


def processed_full_kl(
    logits: Tensor,
    ref_logits: Tensor,
    mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    reference: str = "unprocessed",
    chunk_size: Optional[int] = None,
) -> Tensor:
    """Deprecated: ``lk.full_kl(logits, ref_logits, mask, sampling=lk.Sampling(...), reference=...)``."""
    _warn("processed_full_kl", "lk.full_kl(logits, ref_logits, mask, sampling=lk.Sampling(...), reference=...)")
    return full_kl(logits, ref_logits, mask, sampling=Sampling(temperature, top_k, top_p, min_p), reference=reference, chunk_size=chunk_size)


def token_logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor | VocabShard,
    tokens: Tensor,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    *,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
) -> Tensor:
    """Deprecated: ``lk.token_logprobs(lk.FromHidden(hidden, weight, bias), tokens, sampling=lk.Sampling(...))``.

    ``vocab_chunk_size`` is checked and no longer used (the engine's chunks are rows over the whole vocabulary).
    """
    _warn("token_logprobs_from_hidden", "lk.token_logprobs(lk.FromHidden(hidden, weight, bias), tokens, sampling=lk.Sampling(...))")
    check_chunk_size(vocab_chunk_size, "vocab_chunk_size")
    sampling = Sampling(temperature, top_k, top_p, min_p)
    return token_logprobs(FromHidden(hidden, weight, bias), tokens, sampling=sampling, ignore_index=ignore_index, chunk_size=chunk_size)


def full_kl_from_hidden(
    hidden: Tensor,
    weight: Tensor | VocabShard,
    ref_hidden: Tensor,
    ref_weight: Tensor | VocabShard,
    mask: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """Deprecated: ``lk.full_kl(lk.FromHidden(hidden, weight, bias), lk.FromHidden(ref_hidden, ref_weight, ref_bias), mask)``."""
    _warn("full_kl_from_hidden", "lk.full_kl(lk.FromHidden(hidden, weight, bias), lk.FromHidden(ref_hidden, ref_weight, ref_bias), mask)")
    return full_kl(
        FromHidden(hidden, weight, bias), FromHidden(ref_hidden, ref_weight, ref_bias), mask, sampling=Sampling(temperature), chunk_size=chunk_size
    )
