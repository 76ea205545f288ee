r"""The sampler's processing (temperature, top-k, top-p, min-p) and the log-probs it samples from.

Notation: ``n`` tokens (flattened leading dims), ``V`` the vocabulary, :math:`z` one token's logits,
:math:`T` the temperature. A sampler that processes the logits draws from

.. math::
    \tilde p_i = \frac{[i \in K]\, e^{z_i / T}}{\sum_{j \in K} e^{z_j / T}}, \qquad
    \log \tilde p_y = \frac{z_y}{T} - \operatorname{lse}_{j \in K}\Big(\frac{z_j}{T}\Big)

where the kept set :math:`K` is chosen by :func:`process_scores`, which applies the processors in
the order and with the tie rules of ``transformers``' ``generate`` (temperature, then top-k, then
top-p, then min-p; each one sees the scores the previous one left, with ``-inf`` on what it removed):

* top-k keeps every token whose score is ``>=`` the k-th largest (ties at the boundary are all kept);
* top-p sorts the scores ascending (``torch.sort``), and removes the tokens whose cumulative
  probability, summed from the least likely, is ``<= 1 - top_p``; the most likely token is always kept;
* min-p removes the tokens with probability ``< min_p`` times the largest probability.

The kept set is a selection: it does not move under a small change of the logits, so the gradient
flows through the kept tokens' logits and the normalizer only,

.. math::
    \frac{\partial \log \tilde p_y}{\partial z_i} = \frac{[i = y] - [i \in K]\, \tilde p_i}{T}.

The kept mass :math:`\log S = \operatorname{lse}_K(z / T) - \operatorname{lse}(z / T) \le 0` is the
log of the share of ``softmax(z / T)`` that the sampler keeps (a statistic, returned without grad).

Chunked as :mod:`lightning_kl.kernels.logprobs`: the forward keeps ``O(n)`` numbers (the kept
log-normalizer, and each row's kept set as a threshold on its scores), the backward reads each
chunk again, masks it by the threshold (rows whose kept set is not a threshold set, top-p splitting
tied scores, run the processing again: the same ops on the same numbers give the same set; off the
CPU, where finding those rows would be a host read, every chunk with top-p does) and
writes that chunk of the gradient once. A chunk holds a few ``[c, V]``
temporaries (the top-p sort's values and int64 indices among them). From hidden states, a chunk's
logits are made from the LM head (:class:`~lightning_kl.kernels.rows.LinearRows`) in forward and in
backward, and its gradient :math:`G` becomes :math:`G W` for the hidden states and adds
:math:`G^\top h` and :math:`\sum G` to the head's.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_kl.ground.checks import compute_dtype, host_reads
from lightning_kl.ground.sampler import Sampling
from lightning_kl.ground.chunks import run_chunks
from lightning_kl.kernels.rows import LinearRows, Rows

__all__ = ["CPU_CHUNK_ELEMENTS", "CUDA_CHUNK_ELEMENTS", "Processing", "check_processing", "process_scores", "processed_logprobs_kernel"]

# elements per chunk of rows: a chunk's temporaries (scores, the top-p sort's values, int64 indices,
# cumulative sums) are several [c, V] buffers, so chunks stay smaller than for the plain log-probs
CPU_CHUNK_ELEMENTS = 2**18
CUDA_CHUNK_ELEMENTS = 2**24
HIDDEN_MIN_CHUNK_ROWS = 16


#: The validated sampler (public as ``lk.Sampling``); the kernels' historical name for it.
Processing = Sampling


def check_processing(temperature: Any = 1.0, top_k: Any = None, top_p: Any = None, min_p: Any = None) -> Sampling:
    """Validate the sampler's processing, with ``generate``'s names and neutral values (see :class:`Sampling`).

    Raises:
        ValueError: naming the bad value and the valid range.
    """
    return Sampling(temperature, top_k, top_p, min_p)


def process_scores(scores: Tensor, proc: Processing) -> Tensor:
    """``generate``'s top-k, top-p and min-p on tempered scores ``[..., V]``: removed entries -> ``-inf``.

    The same ops as ``transformers``' ``TopKLogitsWarper``, ``TopPLogitsWarper`` and
    ``MinPLogitsWarper`` (``min_tokens_to_keep=1``, sampling without beams), in that order, so that
    on the same scores the same tokens are kept, ties and rounding included. Returns a new tensor.
    """
    ninf = float("-inf")
    if proc.top_k is not None:
        k = min(proc.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], ninf)
    if proc.top_p is not None:
        sorted_scores, order = torch.sort(scores, descending=False)
        remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - proc.top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(-1, order, remove), ninf)
    if proc.min_p is not None:
        probs = torch.softmax(scores, dim=-1)
        remove = probs < proc.min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        scores = scores.masked_fill(remove, ninf)
    return scores


def processed_logprobs_kernel(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    ids: Tensor,
    ignored: Optional[Tensor],
    proc: Processing,
    chunk_size: Optional[int],
    kept_from: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Processed log-probs of ``ids [n]`` (int64, in range), the kept log-mass and the outside flags.

    ``x`` is the logits ``[..., V]`` (``weight`` None) or the hidden states ``[..., d]`` with the head
    ``weight [V, d]`` and ``bias``. ``kept_from`` (logits ``[..., V]`` of another model, no gradient)
    chooses the kept set instead of ``x``: ``x``'s distribution renormalized on that set. Returns ``(logprobs, log_kept, outside)``, each ``[...]``:
    ``logprobs`` differentiable (``-inf`` with zero gradient where the token is outside the kept set),
    ``log_kept`` without grad, ``outside`` bool. Ignored tokens: 0, 0, False, zero gradient.
    """
    out, log_kept, outside = _ProcessedLogprobs.apply(x, weight, bias, ids, ignored, proc, chunk_size, kept_from)
    return out, log_kept, outside


def _reader(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Rows | LinearRows:
    return Rows(x) if weight is None else LinearRows(x, weight, bias)


def _items(src: Rows | LinearRows, n: int, chunk_size: int, device: torch.device) -> list[tuple[slice, slice | Tensor]]:
    pos = [slice(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]
    if src.flat is not None:
        return [(p, p) for p in pos]
    rows = torch.arange(n, device=device)
    return [(p, rows[p]) for p in pos]


def _scores(
    src: Rows | LinearRows, idx: slice | Tensor, dtype: torch.dtype, proc: Processing, kept_from: Optional[Rows]
) -> tuple[Tensor, Tensor]:
    """A chunk's tempered scores (a fresh tensor) and its processed scores (kept set from ``kept_from``)."""
    z = _tempered(src, idx, dtype, proc)
    if kept_from is None:
        return z, process_scores(z, proc)
    removed = process_scores(_tempered(kept_from, idx, dtype, proc), proc) == float("-inf")
    return z, z.masked_fill(removed, float("-inf"))


def _threshold(z: Tensor, kept: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's smallest kept score, and whether the kept set is exactly ``{z >= that score}``.

    Top-k, top-p and min-p each keep the scores above a cut, so the kept set is an upper set of the
    scores except where top-p's sort splits tied scores at its boundary: a removed score equal to
    the smallest kept one (``exact`` False; NaN scores too). The backward then masks the scores by
    the threshold instead of sorting every row again.
    """
    keep = kept != float("-inf")
    threshold = torch.where(keep, z, float("inf")).amin(dim=-1)
    tied = ((z == threshold.unsqueeze(1)) & ~keep).any(dim=-1)
    return threshold, ~tied & ~threshold.isnan()


def _tempered(src: Rows | LinearRows, idx: slice | Tensor, dtype: torch.dtype, proc: Processing) -> Tensor:
    chunk, _ = src.read(idx)
    z = chunk.to(dtype)
    # as generate: scores / temperature; a fresh tensor either way (the backward writes in it)
    return z / proc.temperature if proc.temperature != 1.0 else (z.clone() if z is chunk else z)


def _redo(exact: Tensor, n_chunks: int, chunk_size: int, proc: Processing, other_support: bool) -> set[int]:
    """The chunks whose backward runs the processing again, not the threshold mask (:func:`_threshold`).

    On the CPU: the chunks with a row whose kept set is not its threshold set (a host read of
    ``exact``). Elsewhere nothing is read: every chunk where such a row can occur, that is every
    chunk with top-p (ties split by its sort) or a kept set from another model. Without those,
    top-k and min-p keep upper sets of the scores, so only rows with NaN scores are not exact, and
    their gradient is NaN (0 where ignored) on either path.
    """
    if host_reads(exact.device):
        return set(torch.unique(torch.nonzero(~exact).squeeze(1) // chunk_size).tolist())
    return set(range(n_chunks)) if proc.top_p is not None or other_support else set()


class _ProcessedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        ids: Tensor,
        ignored: Optional[Tensor],
        proc: Processing,
        chunk_size: Optional[int],
        kept_from: Optional[Tensor],
    ) -> tuple[Tensor, Tensor, Tensor]:
        src = _reader(x, weight, bias)
        support = None if kept_from is None else Rows(kept_from)
        n, vocab, device = ids.numel(), src.vocab, x.device
        dtype = compute_dtype(x)
        if chunk_size is None:
            elements = CUDA_CHUNK_ELEMENTS if device.type != "cpu" else CPU_CHUNK_ELEMENTS
            chunk_size = max(1 if weight is None else HIDDEN_MIN_CHUNK_ROWS, elements // max(vocab, 1))
        lse_kept = torch.empty(n, dtype=dtype, device=device)
        log_kept = torch.empty(n, dtype=dtype, device=device)
        out = torch.empty(n, dtype=dtype, device=device)
        outside = torch.empty(n, dtype=torch.bool, device=device)
        # the kept set of each row as a threshold on its tempered scores, for the backward (see _kept)
        threshold = torch.empty(n, dtype=dtype, device=device)
        exact = torch.empty(n, dtype=torch.bool, device=device)

        def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
            pos, idx = item
            z, kept = _scores(src, idx, dtype, proc, support)
            y = ids[pos].unsqueeze(1)
            lse_kept[pos] = torch.logsumexp(kept, dim=-1)
            log_kept[pos] = lse_kept[pos] - torch.logsumexp(z, dim=-1)
            out[pos] = z.gather(1, y).squeeze(1) - lse_kept[pos]
            outside[pos] = kept.gather(1, y).squeeze(1) == float("-inf")
            threshold[pos], exact[pos] = _threshold(z, kept)

        run_chunks(work, _items(src, n, chunk_size, device), device)
        if ignored is not None:
            outside.masked_fill_(ignored, False)
            out.masked_fill_(ignored, 0)
            log_kept.masked_fill_(ignored, 0)
        out.masked_fill_(outside, float("-inf"))
        if kept_from is not None:
            exact.fill_(False)  # the kept set is another model's: no threshold on x's scores
        ctx.save_for_backward(x, weight, bias, ids, ignored, outside, lse_kept, kept_from, threshold, exact)  # [n] flat
        ctx.proc, ctx.chunk_size = proc, chunk_size
        lead = x.shape[:-1]
        log_kept, outside = log_kept.view(lead), outside.view(lead)
        ctx.mark_non_differentiable(log_kept, outside)
        return out.view(lead), log_kept, outside

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor, _g_kept: Any, _g_outside: Any) -> tuple[Optional[Tensor], ...]:
        x, weight, bias, ids, ignored, outside, lse_kept, kept_from, threshold, exact = ctx.saved_tensors
        proc: Processing = ctx.proc
        src = _reader(x, weight, bias)
        support = None if kept_from is None else Rows(kept_from)
        n, vocab, device, dtype = ids.numel(), src.vocab, x.device, lse_kept.dtype
        # s = dL/d(log-prob) / T, 0 on ignored tokens and on tokens outside the kept set (their
        # value is -inf whatever the logits: a constant)
        s = grad_out.reshape(-1).to(dtype) / proc.temperature
        s = s.masked_fill(outside, 0)
        if ignored is not None:
            s = s.masked_fill(ignored, 0)
        need_x, need_w, need_b = (bool(v) for v in ctx.needs_input_grad[:3])
        lock = threading.Lock()
        grad_x = torch.empty((n, vocab), dtype=x.dtype, device=device) if need_x and weight is None else None
        grad_h = torch.empty((n, x.shape[-1]), dtype=x.dtype, device=device) if need_x and weight is not None else None
        acc_w = torch.zeros(weight.shape, dtype=dtype, device=device) if need_w and weight is not None else None
        acc_b = torch.zeros(vocab, dtype=dtype, device=device) if need_b and bias is not None else None

        items = _items(src, n, ctx.chunk_size, device)
        redo = _redo(exact, len(items), ctx.chunk_size, proc, kept_from is not None)

        def work(k: int, state: Any) -> None:
            pos, idx = items[k]
            if k in redo:
                _, kept = _scores(src, idx, dtype, proc, support)
            else:
                z = _tempered(src, idx, dtype, proc)
                kept = z.masked_fill_(z < threshold[pos].unsqueeze(1), float("-inf"))
            sb = s[pos].unsqueeze(1)
            # dl/dz_i = s ([i = y] - [i in K] p~_i); exp(-inf - lse) = 0 off the kept set
            g = kept.sub_(lse_kept[pos].unsqueeze(1)).exp_().mul_(sb.neg())
            g.scatter_add_(1, ids[pos].unsqueeze(1), sb)
            if ignored is not None:
                g.masked_fill_(ignored[pos].unsqueeze(1), 0)  # NaN logits of ignored tokens stay out
            if grad_x is not None:
                grad_x[idx] = g.to(x.dtype)
                return
            assert isinstance(src, LinearRows) and weight is not None
            gm = g.to(weight.dtype)
            if grad_h is not None:
                grad_h[idx] = gm @ weight
            if acc_w is not None or acc_b is not None:
                h = src.hidden_rows(idx)
                if ignored is not None:
                    h = h.masked_fill(ignored[pos].unsqueeze(1), 0)
                part_w = None if acc_w is None else (gm.T @ h).to(dtype)
                part_b = None if acc_b is None else g.sum(0)
                with lock:
                    if part_w is not None:
                        acc_w.add_(part_w)
                    if part_b is not None:
                        acc_b.add_(part_b)

        run_chunks(work, range(len(items)), device)
        if weight is None:
            grad = None if grad_x is None else grad_x.view(x.shape)
            return grad, None, None, None, None, None, None, None
        return (
            None if grad_h is None else grad_h.view(x.shape),
            None if acc_w is None else acc_w.to(weight.dtype),
            None if acc_b is None else acc_b.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )
