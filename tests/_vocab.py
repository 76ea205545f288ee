"""The old positional call shapes of the hidden-state functions, spelled with the new surface.

Many tests were written against ``token_logprobs_from_hidden(hidden, weight, tokens, bias, temperature,
ignore_index)`` and ``full_kl_from_hidden(hidden, weight, ref_hidden, ref_weight, mask, ...)``: these
helpers keep their bodies readable while calling ``lk.token_logprobs(lk.FromHidden(...), ...)`` and
``lk.full_kl(lk.FromHidden(...), lk.FromHidden(...), ...)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from torch import Tensor

import lightning_kl as lk


def logprobs_from_hidden(
    hidden: Tensor,
    weight: Any,
    tokens: Tensor,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    *,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    **sampler: Any,
) -> Tensor:
    """``lk.token_logprobs(lk.FromHidden(hidden, weight, bias), tokens, sampling=lk.Sampling(temperature, ...))``."""
    del vocab_chunk_size  # the engine's chunks are rows over the whole vocabulary
    return lk.token_logprobs(
        lk.FromHidden(hidden, weight, bias), tokens, sampling=lk.Sampling(temperature, **sampler), ignore_index=ignore_index, chunk_size=chunk_size
    )


def kl_from_hidden(
    hidden: Tensor,
    weight: Any,
    ref_hidden: Tensor,
    ref_weight: Any,
    mask: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """``lk.full_kl(lk.FromHidden(hidden, weight, bias), lk.FromHidden(ref_hidden, ref_weight, ref_bias), mask, ...)``."""
    return lk.full_kl(
        lk.FromHidden(hidden, weight, bias),
        lk.FromHidden(ref_hidden, ref_weight, ref_bias),
        mask,
        sampling=lk.Sampling(temperature),
        chunk_size=chunk_size,
    )


class Processed(NamedTuple):
    """Log-probs under the processed distribution and the log of the kept mass (``return_log_kept=True``)."""

    logprobs: Tensor
    log_kept: Tensor


def processed(
    logits: Any,
    tokens: Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    ignore_index: Optional[int] = None,
    **kw: Any,
) -> Processed:
    """``lk.token_logprobs(logits, tokens, sampling=lk.Sampling(...), return_log_kept=True, ...)``."""
    sampling = lk.Sampling(temperature, top_k, top_p, min_p)
    return Processed(*lk.token_logprobs(logits, tokens, sampling=sampling, ignore_index=ignore_index, return_log_kept=True, **kw))


def processed_from_hidden(
    hidden: Tensor,
    weight: Any,
    tokens: Tensor,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    ignore_index: Optional[int] = None,
    **kw: Any,
) -> Processed:
    """:func:`processed` of ``lk.FromHidden(hidden, weight, bias)``."""
    return processed(lk.FromHidden(hidden, weight, bias), tokens, temperature, top_k, top_p, min_p, ignore_index, **kw)


def processed_kl(
    logits: Any,
    ref_logits: Any,
    mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    **kw: Any,
) -> Tensor:
    """``lk.full_kl(logits, ref_logits, mask, sampling=lk.Sampling(...), **kw)``."""
    return lk.full_kl(logits, ref_logits, mask, sampling=lk.Sampling(temperature, top_k, top_p, min_p), **kw)
