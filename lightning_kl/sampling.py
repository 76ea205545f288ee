r"""Log-probs of the distribution a sampler actually draws from: temperature, top-k, top-p, min-p.

Shapes: ``...`` any leading dims (``[b, t]``), ``V`` the vocabulary, ``d`` the hidden size.

A sampler that truncates (top-k, top-p, min-p) and renormalizes draws token :math:`y` with
probability :math:`\tilde p_y = [y \in K]\, e^{z_y / T} / \sum_{j \in K} e^{z_j / T}`, not
``softmax(z / T)[y]``. Scoring the sampled tokens with the full softmax makes the "on-policy" ratio
off by the kept mass :math:`S = \sum_{j \in K} \mathrm{softmax}(z / T)_j`. :func:`processed_logprobs`
returns :math:`\log \tilde p_y` and :math:`\log S` per token; ``lk.token_logprobs(..., top_k=, top_p=,
min_p=)`` returns the first. The kept set :math:`K` is chosen as ``transformers``' ``generate`` chooses
it (:mod:`lightning_kl.kernels.processing`: order, ties and rounding).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_kl.ground.checks import check_chunk_size, check_floating, check_full_inputs, check_head, check_matching, check_tokens, check_values
from lightning_kl.kernels.logprobs import token_logprobs_from_hidden_kernel, token_logprobs_kernel
from lightning_kl.kernels.processed_full import REFERENCES, processed_full_kl_kernel
from lightning_kl.kernels.processing import Processing, check_processing, processed_logprobs_kernel

__all__ = [
    "OUTSIDE_MODES",
    "REFERENCES",
    "SampledLogprobs",
    "processed_full_kl",
    "processed_logprobs",
    "processed_logprobs_from_hidden",
]

#: What to do with a token outside the kept set: ``"raise"`` (the sampler and the scorer disagree)
#: or ``"-inf"`` (its processed log-prob, e.g. a reference's own processed distribution).
OUTSIDE_MODES = ("raise", "-inf")


class SampledLogprobs(NamedTuple):
    r"""Log-probs under the processed distribution, and the log of the mass it keeps.

    Attributes:
        logprobs: ``[...]`` :math:`\log \tilde p_y`, differentiable.
        log_kept: ``[...]`` :math:`\log S = \log \sum_{j \in K} \mathrm{softmax}(z / T)_j \le 0`, the
            log of the share of the softmax that the sampler keeps, without grad (0 where nothing is
            truncated, and on ignored tokens). ``logprobs - log_kept`` is the full-softmax log-prob.
    """

    logprobs: Tensor
    log_kept: Tensor


def _check_outside(outside: Any) -> str:
    if outside not in OUTSIDE_MODES:
        raise ValueError(f"`outside` must be one of {OUTSIDE_MODES}, got {outside!r}.")
    return outside


def _report_outside(outside: Tensor, tokens: Tensor, proc: Processing) -> None:
    """Fail on a sampled token outside the kept set; no host read off the CPU (:func:`check_values`)."""

    def named() -> ValueError:
        where = outside.nonzero()[0].tolist()
        return ValueError(
            f"{int(outside.sum())} sampled token(s) lie outside the kept set of the processing {proc.as_dict()}, "
            f"the first at position {tuple(where)} (id {int(tokens[tuple(where)])}): the sampler and the scorer "
            "disagree (another processing, e.g. generate's default top_k=50, or other logits). Pass the "
            "sampler's exact processing, or outside='-inf' to score them as log 0 = -inf."
        )

    rule = (
        f"sampled tokens must lie in the kept set of the processing {proc.as_dict()} (the sampler's exact "
        "processing, or outside='-inf' to score them as log 0 = -inf)"
    )
    check_values(outside, named, rule)


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
    r"""Log-probs of ``tokens`` under the processed sampling distribution, and the kept mass.

    .. math::
        \log \tilde p_y = \frac{z_y}{T} - \operatorname{lse}_{j \in K}\Big(\frac{z_j}{T}\Big), \qquad
        \log S = \operatorname{lse}_{j \in K}\Big(\frac{z_j}{T}\Big) - \operatorname{lse}_j\Big(\frac{z_j}{T}\Big)

    ``generate``'s order: temperature, top-k, top-p, min-p, each on what the previous one kept. The
    gradient is exact: :math:`([i = y] - [i \in K] \tilde p_i) / T` (the kept set is a selection).
    Chunked as :func:`lightning_kl.token_logprobs`: no ``[..., V]`` float32 copy.

    Args:
        logits: ``[..., V]`` floating point, any layout.
        tokens: ``[...]`` integer ids in ``[0, V)``.
        temperature: :math:`T > 0`.
        top_k: keep the ``top_k`` highest scores (and every tie of the last); None or 0: off.
        top_p: keep the smallest set of most likely tokens whose mass reaches ``top_p``, in ``[0, 1]``;
            None or 1: off.
        min_p: keep the tokens with probability ``>= min_p`` times the largest, in ``[0, 1]``; None or 0: off.
        ignore_index: an id whose positions get 0 (both outputs) and exactly zero gradient.
        outside: a token outside the kept set: ``"raise"`` (default; the error names it) or ``"-inf"``
            (log-prob ``-inf``, zero gradient).
        kept_from: optional ``[..., V]`` logits of another model (the policy's) whose processing
            chooses the kept set: ``logits``' distribution (the reference's) renormalized on the
            policy's kept set, the sampled reference of ``processed_full_kl(reference="policy_kept")``.
            No gradient flows into it.
        chunk_size: rows per chunk.

    Returns:
        :class:`SampledLogprobs` ``(logprobs, log_kept)``, each ``[...]``, float32 (float64 for float64 logits).

    Raises:
        TypeError: for logits that are not floating point, or tokens that are not integers.
        ValueError: for a processing value out of range (named, with the valid range), shapes that do
            not match, an id out of range, a bad ``outside``, or (``outside="raise"``) a token outside
            the kept set (its count, first position and id named, on the CPU; elsewhere a device-side
            assertion, a ``RuntimeError`` naming the rule, without a host sync).

    Example:
        >>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], requires_grad=True)
        >>> lp, log_kept = processed_logprobs(logits, torch.tensor([1]), top_k=2)
        >>> lp  # log(e / (e^2 + e)) = -log(1 + e)
        tensor([-1.3133], grad_fn=<_ProcessedLogprobsBackward>)
        >>> log_kept  # log((e^2 + e) / (e^2 + e + 1 + 1/e))
        tensor([-0.1269])
        >>> lp.sum().backward(); logits.grad + 0.0  # one-hot minus p~ on the kept set, 0 elsewhere
        tensor([[-0.7311,  0.7311,  0.0000,  0.0000]])
    """
    check_floating("logits", logits)
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise ValueError(f"`logits` must be `[..., V]` with a vocabulary of V >= 1 entries, got shape {tuple(logits.shape)}.")
    proc = check_processing(temperature, top_k, top_p, min_p)
    outside = _check_outside(outside)
    check_chunk_size(chunk_size)
    ids, ignored = check_tokens(tokens, logits.shape[:-1], logits.shape[-1], logits.device, "logits", ignore_index)
    if kept_from is not None:
        check_matching("logits", logits, "kept_from", kept_from)
        kept_from = kept_from.detach()
    if not proc.truncates:
        lp = token_logprobs_kernel(logits, ids, ignored, proc.temperature, chunk_size)
        return SampledLogprobs(lp, torch.zeros_like(lp).detach())
    lp, log_kept, out = processed_logprobs_kernel(logits, None, None, ids, ignored, proc, chunk_size, kept_from)
    if outside == "raise":
        _report_outside(out, tokens, proc)
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
    r""":func:`processed_logprobs` of the logits ``hidden @ weight.T + bias``, never made whole.

    Chunks of rows: each chunk's logits are made from the head in forward and again in backward,
    with exact gradients w.r.t. ``hidden``, ``weight`` and ``bias``.

    Args:
        hidden: ``[..., d]`` the last hidden states; ``weight`` ``[V, d]`` the LM head; ``bias`` ``[V]`` or None.
        tokens: ``[...]`` integer ids in ``[0, V)``.
        temperature, top_k, top_p, min_p, ignore_index, outside: as :func:`processed_logprobs`.
        chunk_size: rows per chunk (default: about :math:`2^{18}` logits per chunk on CPU, at least 16 rows).

    Returns:
        :class:`SampledLogprobs` ``(logprobs, log_kept)``, each ``[...]``.

    Raises:
        TypeError, ValueError: as :func:`processed_logprobs` (and for heads that do not match, named).

    Example:
        >>> hidden, weight = torch.tensor([[2.0, 1.0]]), torch.eye(2)
        >>> processed_logprobs_from_hidden(hidden, weight, torch.tensor([0]), top_k=1).logprobs
        tensor([0.])
    """
    check_head(hidden, weight, bias)
    proc = check_processing(temperature, top_k, top_p, min_p)
    outside = _check_outside(outside)
    check_chunk_size(chunk_size)
    ids, ignored = check_tokens(tokens, hidden.shape[:-1], weight.shape[0], hidden.device, "hidden", ignore_index)
    if not proc.truncates:
        lp = token_logprobs_from_hidden_kernel(hidden, weight, bias, ids, ignored, proc.temperature, chunk_size, None)
        return SampledLogprobs(lp, torch.zeros_like(lp).detach())
    lp, log_kept, out = processed_logprobs_kernel(hidden, weight, bias, ids, ignored, proc, chunk_size)
    if outside == "raise":
        _report_outside(out, tokens, proc)
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
    r"""Exact per-token :math:`\mathrm{KL}(\tilde\pi \,\|\, \pi_{\mathrm{ref}})` of the processed policy.

    .. math::
        \mathrm{KL} = \sum_{i \in K} \tilde p_i (\log \tilde p_i - \log q_i)

    :math:`\tilde p`: the policy's processed distribution (:func:`processed_logprobs`), kept set
    :math:`K`. The reference :math:`q` (``reference=``), always at the same temperature:

    * ``"unprocessed"`` (default): ``softmax(ref_logits / T)``, the whole vocabulary; finite;
      :math:`\mathrm{KL} = \mathrm{KL}_{\texttt{policy\_kept}} - \log S^{\mathrm{ref}}_K` where
      :math:`S^{\mathrm{ref}}_K` is the reference's mass on the policy's kept set :math:`K`.
    * ``"policy_kept"``: the reference renormalized on the policy's kept set: the two models compared
      among the tokens the sampler can draw; finite, but blind to which tokens are kept (0 whenever
      :math:`K` is a single token).
    * ``"processed"``: the reference processed by the same rule on its own logits. ``+inf`` where
      the policy keeps a token the reference removes; a backward through such a token raises.

    Gradients are exact w.r.t. both logits (the kept sets are selections). Chunked like
    :func:`lightning_kl.full_kl`; masked tokens get value 0 and gradient exactly 0.

    Args:
        logits: ``[..., V]`` policy logits; ``ref_logits`` ``[..., V]`` the reference's.
        mask: optional ``[...]``, True on valid tokens (value 0 and gradient exactly 0 elsewhere).
        temperature, top_k, top_p, min_p: the sampler's processing (:func:`processed_logprobs`).
        reference: one of :data:`REFERENCES`.
        chunk_size: tokens per chunk.

    Returns:
        ``[...]`` KL per token, float32 (float64 for float64 inputs), differentiable w.r.t. both logits.

    Raises:
        ValueError: for a bad processing value, reference or chunk size (named, with the valid ones),
            shapes that do not match; in backward, for a ``+inf`` KL (``"processed"``) with a gradient.
        TypeError: for inputs that are not floating point tensors.

    Example:
        >>> z = torch.tensor([[2.0, 1.0, 0.0]])
        >>> ref = torch.tensor([[0.0, 1.0, 2.0]])
        >>> processed_full_kl(z, ref, top_k=2, reference="policy_kept")  # (e, 1)/(e+1) vs (1, e)/(1+e): (p0 - p1) log e
        tensor([0.4621])
        >>> processed_full_kl(z, ref, top_k=2, reference="processed")  # token 0 kept, removed by the reference's top-2
        tensor([inf])
    """
    mask = check_full_inputs(logits, ref_logits, mask)
    proc = check_processing(temperature, top_k, top_p, min_p)
    if reference not in REFERENCES:
        raise ValueError(f"`reference` must be one of {REFERENCES}, got {reference!r}.")
    check_chunk_size(chunk_size)
    mask_flat = None if mask is None else mask.reshape(-1)
    return processed_full_kl_kernel(logits, ref_logits, mask_flat, proc, reference, chunk_size)

