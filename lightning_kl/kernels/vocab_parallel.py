r"""Token log-probs and the exact KL from logits split over the vocabulary across a tensor parallel group.

Notation: ``n`` rows (tokens, the flattened leading dims), rank :math:`k` of the group holds the
columns :math:`[o_k, o_k + V_k)` of the logits :math:`z` (and :math:`z^{\mathrm{ref}}`), :math:`T`
is the temperature. The vocabulary is never gathered: each rank works on its own columns, by chunks
of rows (:func:`lightning_kl.ground.chunks.run_chunks`), and only a few numbers per row cross the
group:

.. math::
    \mathrm{lse} = M + \log \sum_k e^{\mathrm{lse}_k - M}, \qquad M = \max_k \mathrm{lse}_k, \qquad
    \mathrm{lse}_k = \log \sum_{i = o_k}^{o_k + V_k - 1} e^{z_i / T}

    \ell = \frac{z_y}{T} - \mathrm{lse} \quad (z_y \text{ from the rank that owns } y, \ 0 \text{ from the others, summed}),
    \qquad \mathrm{KL} = \sum_k \sum_{i = o_k}^{o_k + V_k - 1} p_i (\log p_i - \log q_i)

Collectives per call, each one ``all_reduce`` issued from the calling thread once the chunk runner
has made every row's local statistics (never from its worker threads):

* token log-probs: ``MAX`` of ``[n]`` and ``SUM`` of ``[3, n]`` (the sums of exponentials, the
  target logit, the number of ranks that own the id, which must be 1: out-of-range ids and shards
  that overlap or leave gaps are caught there);
* full KL: ``MAX`` of ``[2, n]``, ``SUM`` of ``[2, n]``, ``SUM`` of ``[n]``.

So ``O(n)`` numbers cross the group, not ``O(n V)``. The backward needs no collective: with the
global ``lse`` and KL saved, the gradients of a shard's logits are its own,

.. math::
    \frac{\partial \ell}{\partial z_i} = \frac{[i = y] - p_i}{T}, \qquad
    \frac{\partial\,\mathrm{KL}}{\partial z_i} = \frac{p_i (\log p_i - \log q_i - \mathrm{KL})}{T}, \qquad
    \frac{\partial\,\mathrm{KL}}{\partial z^{\mathrm{ref}}_i} = \frac{q_i - p_i}{T},

exact when the gradient coming into the (replicated) results is the same on every rank of the group,
that is, when every rank computes the same loss from them, as tensor parallel training does.

From hidden states with a column-parallel LM head (each rank holds the rows ``[V_k, d]`` of the head
and the same hidden states ``[n, d]``), chunks of the shard's logits are made from the hidden states
in forward and again in backward (:class:`~lightning_kl.kernels.rows.LinearRows`), and never exist
whole; each chunk's logits gradient :math:`G` gives the head's rows :math:`G^\top h` and
:math:`\sum G` locally, and this rank's share :math:`G W_k` of the hidden states' gradient, which one
more ``SUM`` of ``[n, d]`` over the group completes in backward (the hidden states feed every shard).

No host synchronization: masked and ignored rows are computed with the others and zeroed (no index
lists), and the ownership check runs on the device off the CPU (:func:`~lightning_kl.ground.checks.check_values`).
Masked rows, and ignored tokens, get value 0 and exactly zero gradient, even where their logits hold
NaN; an entry with :math:`p_i = 0` adds nothing to the KL (:math:`0 \log 0 = 0`).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_kl.ground.checks import check_tokens, check_values, compute_dtype
from lightning_kl.ground.chunks import run_chunks
from lightning_kl.ground.vocab_shards import VocabShard, as_vocab_shard
from lightning_kl.kernels.logprobs import CPU_CHUNK_ELEMENTS, CUDA_CHUNK_ELEMENTS
from lightning_kl.kernels.rows import LinearRows, Rows

__all__ = [
    "HIDDEN_CHUNK_ELEMENTS",
    "all_reduce",
    "vocab_parallel_full_kl",
    "vocab_parallel_full_kl_from_hidden",
    "vocab_parallel_token_logprobs",
    "vocab_parallel_token_logprobs_from_hidden",
]

# From hidden states a chunk's logits are a matmul that reads the head's whole shard: about this many
# logits a chunk (at least 16 rows), so that the head is read once per many rows
HIDDEN_CHUNK_ELEMENTS = 2**23


def all_reduce(x: Tensor, op: Any, group: Any) -> Tensor:
    """``torch.distributed.all_reduce`` of ``x`` in place over ``group``: the only collective here."""
    torch.distributed.all_reduce(x, op=op, group=group)
    return x


def vocab_parallel_token_logprobs(
    logits: VocabShard | Tensor,
    tokens: Tensor,
    temperature: float,
    ignore_index: Optional[int],
    chunk_size: Optional[int],
) -> Tensor:
    """:func:`lightning_kl.token_logprobs` of a :class:`VocabShard` or a vocabulary-sharded DTensor.

    ``temperature`` and ``chunk_size`` checked by the caller; ``tokens`` are global ids ``[...]``.
    Returns ``[...]`` log-probs, the same on every rank of the group, differentiable w.r.t. the shard.
    """
    shard = as_vocab_shard(logits, "logits")
    local = shard.local
    ids, ignored = check_tokens(tokens, local.shape[:-1], None, local.device, "logits", ignore_index)
    return _TokenLogprobs.apply(local, ids, ignored, temperature, chunk_size, shard.group, shard.offset)


def vocab_parallel_token_logprobs_from_hidden(
    hidden: Tensor,
    weight: VocabShard,
    bias: Optional[Tensor],
    tokens: Tensor,
    temperature: float,
    ignore_index: Optional[int],
    chunk_size: Optional[int],
) -> Tensor:
    """:func:`lightning_kl.token_logprobs_from_hidden` with this rank's rows of a column-parallel head.

    ``hidden [..., d]`` (the same on every rank), ``weight`` a :class:`VocabShard` of the head's rows
    ``[V_local, d]``, ``bias`` its ``[V_local]`` slice or None; checked by the caller (:func:`check_head`
    on the local rows). ``chunk_size``: rows per chunk (default: about :math:`2^{23}` logits).
    """
    shard = as_vocab_shard(weight, "weight")
    ids, ignored = check_tokens(tokens, hidden.shape[:-1], None, hidden.device, "hidden", ignore_index)
    return _TokenLogprobsFromHidden.apply(hidden, shard.local, bias, ids, ignored, temperature, chunk_size, shard.group, shard.offset)


def vocab_parallel_full_kl(
    logits: VocabShard | Tensor,
    ref_logits: VocabShard | Tensor,
    mask: Optional[Tensor],
    temperature: float,
    chunk_size: Optional[int],
) -> Tensor:
    """:func:`lightning_kl.full_kl` of two shards split the same way (``mask`` bool or None, checked).

    Returns ``[...]`` KL per token, the same on every rank, differentiable w.r.t. both shards.

    Raises:
        TypeError: when only one of the two is split over the vocabulary.
        ValueError: when the two are split over different groups or at different offsets.
    """
    pol, ref = _same_split(("logits", logits), ("ref_logits", ref_logits))
    mask_flat = None if mask is None else mask.reshape(-1)
    return _FullKL.apply(pol.local, ref.local, mask_flat, temperature, chunk_size, pol.group)


def vocab_parallel_full_kl_from_hidden(
    hidden: Tensor,
    weight: VocabShard | Tensor,
    bias: Optional[Tensor],
    ref_hidden: Tensor,
    ref_weight: VocabShard | Tensor,
    ref_bias: Optional[Tensor],
    mask: Optional[Tensor],
    temperature: float,
    chunk_size: Optional[int],
) -> Tensor:
    """:func:`lightning_kl.full_kl_from_hidden` with both heads' rows split the same way (checked inputs).

    Returns ``[...]`` KL per token, the same on every rank; gradients w.r.t. every input that needs one
    (the hidden states' summed over the group).
    """
    pol, ref = _same_split(("weight", weight), ("ref_weight", ref_weight))
    mask_flat = None if mask is None else mask.reshape(-1)
    return _FullKLFromHidden.apply(hidden, pol.local, bias, ref_hidden, ref.local, ref_bias, mask_flat, temperature, chunk_size, pol.group)


def _same_split(*named: tuple[str, object]) -> list[VocabShard]:
    shards = []
    for name, x in named:
        if isinstance(x, Tensor) and not _is_dtensor(x):
            raise TypeError(
                f"`{name}` is a plain tensor while the other model's is split over the vocabulary: split the "
                "policy's and the reference's the same way (both DTensors with Shard(-1) on one mesh, or "
                "both lk.VocabShard with one group and offset)."
            )
        shards.append(as_vocab_shard(x, name))
    pol, ref = shards
    if pol.group is not ref.group or pol.offset != ref.offset:
        groups = "one group" if pol.group is ref.group else "two different groups"
        raise ValueError(
            f"`{named[0][0]}` and `{named[1][0]}` must be split the same way (one group, one offset): got offsets "
            f"{pol.offset} and {ref.offset} on {groups}."
        )
    return shards


def _is_dtensor(x: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(x, DTensor)


# ---------------------------------------------------------------------------------------------
# the chunked local maths, over a reader of the shard's logits (Rows, or LinearRows from hidden
# states), handing each chunk's logits gradient to a sink


def _chunk_items(srcs: tuple[Rows | LinearRows, ...], n: int, chunk_size: int, device: torch.device) -> list[tuple[slice, slice | Tensor]]:
    """``(output positions, row indices)`` per chunk: slices, or index tensors when a reader's ``flat`` is None."""
    pos = [slice(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]
    if all(src.flat is not None for src in srcs):
        return [(p, p) for p in pos]
    rows = torch.arange(n, device=device)
    return [(p, rows[p]) for p in pos]


def _rows_per_chunk(chunk_size: Optional[int], vocab: int, device: torch.device, buffers: int, hidden: bool = False) -> int:
    if chunk_size is not None:
        return chunk_size
    elements = CUDA_CHUNK_ELEMENTS if device.type != "cpu" else CPU_CHUNK_ELEMENTS
    if hidden:  # a chunk's logits are a matmul that reads the whole head's shard: many rows per chunk
        return max(16, HIDDEN_CHUNK_ELEMENTS // max(vocab, 1))
    return max(1, elements // (buffers * max(vocab, 1)))


def _scaled(chunk: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """``z / T`` of a chunk in the compute dtype (a fresh tensor only when needed)."""
    z = chunk.to(dtype)
    return z / temperature if temperature != 1.0 else z


def _log_probs(chunk: Tensor, lse: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """``z / T - lse`` (fresh, ours to overwrite): the global log-probs of the shard's entries."""
    return torch.sub(_scaled(chunk, dtype, temperature), lse.unsqueeze(1))


def _global_lse(local_lse: Tensor, group: Any) -> Tensor:
    """``lse`` over the group from each rank's ``[..., n]`` local ones: a MAX, then a SUM of exponentials."""
    m = all_reduce(local_lse.clone(), torch.distributed.ReduceOp.MAX, group)
    # a row whose logits are all -inf (on every rank) keeps lse = -inf, not NaN
    m = m.masked_fill_(m == float("-inf"), 0)
    total = all_reduce(torch.exp(local_lse - m), torch.distributed.ReduceOp.SUM, group)
    return total.log_().add_(m)


class _LogitsSink:
    """The gradient of a ``[..., V_local]`` logits shard, written chunk by chunk."""

    def __init__(self, x: Tensor) -> None:
        self.shape = x.shape
        self.grad = torch.empty((math.prod(x.shape[:-1]), x.shape[-1]), dtype=x.dtype, device=x.device)

    def put(self, pos: slice, idx: slice | Tensor, g: Tensor) -> None:
        self.grad[pos] = g

    def result(self, group: Any) -> tuple[Tensor]:
        return (self.grad.view(self.shape),)


class _HeadSink:
    """The gradients of ``hidden``, the head's rows and their bias from chunks ``G`` of the logits' gradient.

    ``dW = G^T h`` and ``db = sum G`` add up over the chunks (in the compute dtype, rounded once); this
    rank's ``dh = G W_k`` is summed over the group in :meth:`result`, from the calling thread.
    """

    def __init__(self, src: LinearRows, need: tuple[bool, bool, bool], dtype: torch.dtype) -> None:
        self.src, self.dtype = src, dtype
        w, device = src.weight, src.weight.device
        self.grad_h = torch.zeros(src.flat.shape, dtype=dtype, device=device) if need[0] else None
        self.acc_w = torch.zeros(w.shape, dtype=dtype, device=device) if need[1] else None
        self.acc_b = torch.zeros(w.shape[0], dtype=dtype, device=device) if need[2] else None
        self.lock = threading.Lock()

    def put(self, pos: slice, idx: slice | Tensor, g: Tensor) -> None:
        if self.grad_h is not None:
            self.grad_h[pos] = torch.mm(g.to(self.src.weight.dtype), self.src.weight).to(self.dtype)
        if self.acc_w is not None or self.acc_b is not None:
            h = self.src.hidden_rows(idx).to(self.dtype)
            with self.lock:  # chunks run concurrently and all add to the same [V_local, d]
                if self.acc_w is not None:
                    torch.addmm(self.acc_w, g.T, h, out=self.acc_w)
                if self.acc_b is not None:
                    self.acc_b += g.sum(0)

    def result(self, group: Any) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        src, grad_h = self.src, self.grad_h
        if grad_h is not None:  # the hidden states feed every shard: their gradient is the sum
            grad_h = all_reduce(grad_h, torch.distributed.ReduceOp.SUM, group).to(src.dtype).view(src.hidden.shape)
        grad_w = None if self.acc_w is None else self.acc_w.to(src.weight.dtype)
        grad_b = None if self.acc_b is None else self.acc_b.to(src.weight.dtype)
        return grad_h, grad_w, grad_b


def _logprobs_forward(
    ctx: Any,
    src: Rows | LinearRows,
    ids: Tensor,
    ignored: Optional[Tensor],
    temperature: float,
    chunk_size: int,
    group: Any,
    offset: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """The flat log-probs; ``(col, owned, lse)`` kept on ``ctx`` for :func:`_logprobs_backward`."""
    n, vocab = ids.numel(), src.vocab
    col = ids - offset
    owned = (col >= 0) & (col < vocab)
    if ignored is not None:
        owned &= ~ignored
    col = col.clamp_(0, max(vocab - 1, 0)).unsqueeze(1)
    # per row: this shard's lse, the target logit if this shard owns it, whether it does
    stats = torch.zeros((3, n), dtype=dtype, device=device)

    def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
        pos, idx = item
        chunk, _ = src.read(idx)
        stats[0, pos] = torch.logsumexp(_scaled(chunk, dtype, temperature), dim=-1)
        if vocab > 0:
            stats[1, pos] = chunk.gather(1, col[pos]).squeeze(1).to(dtype) / temperature

    run_chunks(work, _chunk_items((src,), n, chunk_size, device), device)
    if ignored is not None:
        stats[0].masked_fill_(ignored, 0)  # NaN logits of ignored rows stay out of the group's max
    stats[1] = torch.where(owned, stats[1], 0)
    stats[2] = owned.to(dtype)
    m = all_reduce(stats[0].clone(), torch.distributed.ReduceOp.MAX, group)
    m = m.masked_fill_(m == float("-inf"), 0)
    stats[0] = torch.exp(stats[0] - m)
    all_reduce(stats, torch.distributed.ReduceOp.SUM, group)  # one collective for the three rows
    lse = stats[0].log().add_(m)
    owners = stats[2] if ignored is None else stats[2].masked_fill(ignored, 1)
    unowned = owners != 1
    check_values(
        unowned,
        lambda: ValueError(
            f"token id {int(ids[unowned][0])} is owned by {int(owners[unowned][0])} vocabulary shards, not 1: ids must lie "
            "in [0, V) of the split vocabulary (or be `ignore_index`), and the shards' offsets must tile it."
        ),
        "every token id must be owned by exactly one vocabulary shard: ids in [0, V) (or ignore_index), shards that tile [0, V)",
    )
    out = stats[1] - lse
    if ignored is not None:
        out = out.masked_fill_(ignored, 0)
    ctx.vp_saved = (col, owned, ignored, lse)
    ctx.temperature, ctx.chunk_size = temperature, chunk_size
    return out


def _logprobs_backward(ctx: Any, src: Rows | LinearRows, grad_out: Tensor, sink: _LogitsSink | _HeadSink) -> None:
    col, owned, ignored, lse = ctx.vp_saved
    temperature, n = ctx.temperature, col.shape[0]
    dtype, device = lse.dtype, lse.device
    # dl/dz_i = s ([i = y] - p_i), s = d(loss)/d(log-prob) / T; 0 on ignored rows
    s = (grad_out.reshape(-1).to(dtype) / temperature).unsqueeze(1)
    if ignored is not None:
        s = s.masked_fill(ignored.unsqueeze(1), 0)
    hit = torch.where(owned.unsqueeze(1), s, 0)

    def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
        pos, idx = item
        chunk, _ = src.read(idx)
        g = _log_probs(chunk, lse[pos], dtype, temperature).exp_().mul_(s[pos].neg())
        g.scatter_add_(1, col[pos], hit[pos])
        if ignored is not None:
            g.masked_fill_(ignored[pos].unsqueeze(1), 0)  # NaN logits there: 0 * NaN
        sink.put(pos, idx, g)

    if src.vocab > 0:
        run_chunks(work, _chunk_items((src,), n, ctx.chunk_size, device), device)


def _kl_forward(
    ctx: Any,
    src: Rows | LinearRows,
    ref: Rows | LinearRows,
    mask_flat: Optional[Tensor],
    temperature: float,
    chunk_size: int,
    group: Any,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """The flat per-token KL; ``(lse, kl)`` kept on ``ctx`` for :func:`_kl_backward`."""
    n, vocab = math.prod(src.lead), src.vocab
    items = _chunk_items((src, ref), n, chunk_size, device)
    local_lse = torch.empty((2, n), dtype=dtype, device=device)

    def lse_work(item: tuple[slice, slice | Tensor], state: Any) -> None:
        pos, idx = item
        local_lse[0, pos] = torch.logsumexp(_scaled(src.read(idx)[0], dtype, temperature), dim=-1)
        local_lse[1, pos] = torch.logsumexp(_scaled(ref.read(idx)[0], dtype, temperature), dim=-1)

    run_chunks(lse_work, items, device)
    if mask_flat is not None:
        local_lse.masked_fill_(~mask_flat, 0)  # NaN padding stays out of the group's max
    lse = _global_lse(local_lse, group)
    part = torch.zeros(n, dtype=dtype, device=device)

    def kl_work(item: tuple[slice, slice | Tensor], state: Any) -> None:
        pos, idx = item
        logp = _log_probs(src.read(idx)[0], lse[0, pos], dtype, temperature)
        d = torch.sub(logp, _log_probs(ref.read(idx)[0], lse[1, pos], dtype, temperature))
        p = logp.exp_()
        # 0 log 0 = 0 where p is 0 (a -inf policy logit), whatever the reference holds
        part[pos] = d.mul_(p).masked_fill_(p == 0, 0).sum(-1)

    if vocab > 0:
        run_chunks(kl_work, items, device)
    if mask_flat is not None:
        part.masked_fill_(~mask_flat, 0)
    kl = all_reduce(part, torch.distributed.ReduceOp.SUM, group)
    ctx.vp_saved = (mask_flat, lse, kl)
    ctx.temperature, ctx.chunk_size = temperature, chunk_size
    return kl


def _kl_backward(
    ctx: Any,
    src: Rows | LinearRows,
    ref: Rows | LinearRows,
    grad_out: Tensor,
    sink_z: Optional[_LogitsSink | _HeadSink],
    sink_ref: Optional[_LogitsSink | _HeadSink],
) -> None:
    mask_flat, lse, kl = ctx.vp_saved
    temperature, n = ctx.temperature, kl.numel()
    dtype, device = lse.dtype, lse.device
    scale = (grad_out.reshape(-1).to(dtype) / temperature).unsqueeze(1)
    skip = None if mask_flat is None else ~mask_flat.unsqueeze(1)
    kl_col = kl.unsqueeze(1)

    def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
        pos, idx = item
        logp = _log_probs(src.read(idx)[0], lse[0, pos], dtype, temperature)
        logq = _log_probs(ref.read(idx)[0], lse[1, pos], dtype, temperature)
        p = logp.exp()
        if sink_ref is not None:
            g = logq.exp().sub_(p).mul_(scale[pos])  # (q - p) / T
            sink_ref.put(pos, idx, g if skip is None else g.masked_fill_(skip[pos], 0))
        if sink_z is not None:
            g = logp.sub_(logq).sub_(kl_col[pos]).mul_(p).masked_fill_(p == 0, 0).mul_(scale[pos])
            sink_z.put(pos, idx, g if skip is None else g.masked_fill_(skip[pos], 0))

    if src.vocab > 0:
        run_chunks(work, _chunk_items((src, ref), n, ctx.chunk_size, device), device)


def _masked_hidden(hidden: Tensor, mask_flat: Optional[Tensor]) -> Tensor:
    """Padding rows of the hidden states zeroed: they are computed too, and NaN there must stay out of dW."""
    return hidden if mask_flat is None else hidden.masked_fill(~mask_flat.view(*hidden.shape[:-1], 1), 0)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        ids: Tensor,
        ignored: Optional[Tensor],
        temperature: float,
        chunk_size: Optional[int],
        group: Any,
        offset: int,
    ) -> Tensor:
        dtype, device = compute_dtype(logits), logits.device
        chunk_size = _rows_per_chunk(chunk_size, logits.shape[-1], device, 1)
        out = _logprobs_forward(ctx, Rows(logits), ids, ignored, temperature, chunk_size, group, offset, dtype, device)
        ctx.save_for_backward(logits)
        ctx.group = group
        return out.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        (logits,) = ctx.saved_tensors
        sink = _LogitsSink(logits)
        _logprobs_backward(ctx, Rows(logits), grad_out, sink)
        return (*sink.result(ctx.group), None, None, None, None, None, None)


class _TokenLogprobsFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        ids: Tensor,
        ignored: Optional[Tensor],
        temperature: float,
        chunk_size: Optional[int],
        group: Any,
        offset: int,
    ) -> Tensor:
        dtype, device = compute_dtype(hidden), hidden.device
        chunk_size = _rows_per_chunk(chunk_size, weight.shape[0], device, 1, hidden=True)
        src = LinearRows(hidden, weight, bias)
        out = _logprobs_forward(ctx, src, ids, ignored, temperature, chunk_size, group, offset, dtype, device)
        ctx.save_for_backward(hidden, weight, bias)
        ctx.group = group
        return out.view(hidden.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        hidden, weight, bias = ctx.saved_tensors
        need = tuple(bool(x) for x in ctx.needs_input_grad[:3])
        ignored = ctx.vp_saved[2]
        if ignored is not None and need[1]:
            hidden = _masked_hidden(hidden, ~ignored)  # NaN hidden states of ignored tokens stay out of dW
        src = LinearRows(hidden, weight, bias)
        sink = _HeadSink(src, need, ctx.vp_saved[3].dtype)
        _logprobs_backward(ctx, src, grad_out, sink)
        return (*sink.result(ctx.group), None, None, None, None, None, None)


class _FullKL(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        ref_logits: Tensor,
        mask_flat: Optional[Tensor],
        temperature: float,
        chunk_size: Optional[int],
        group: Any,
    ) -> Tensor:
        dtype, device = compute_dtype(logits, ref_logits), logits.device
        chunk_size = _rows_per_chunk(chunk_size, logits.shape[-1], device, 4)
        kl = _kl_forward(ctx, Rows(logits), Rows(ref_logits), mask_flat, temperature, chunk_size, group, dtype, device)
        ctx.save_for_backward(logits, ref_logits)
        ctx.group = group
        return kl.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        logits, ref_logits = ctx.saved_tensors
        sink_z = _LogitsSink(logits) if ctx.needs_input_grad[0] else None
        sink_ref = _LogitsSink(ref_logits) if ctx.needs_input_grad[1] else None
        _kl_backward(ctx, Rows(logits), Rows(ref_logits), grad_out, sink_z, sink_ref)
        return (
            None if sink_z is None else sink_z.result(ctx.group)[0],
            None if sink_ref is None else sink_ref.result(ctx.group)[0],
            None,
            None,
            None,
            None,
        )


class _FullKLFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        ref_hidden: Tensor,
        ref_weight: Tensor,
        ref_bias: Optional[Tensor],
        mask_flat: Optional[Tensor],
        temperature: float,
        chunk_size: Optional[int],
        group: Any,
    ) -> Tensor:
        dtype, device = compute_dtype(hidden, ref_hidden), hidden.device
        chunk_size = _rows_per_chunk(chunk_size, weight.shape[0], device, 4, hidden=True)
        src, ref = LinearRows(hidden, weight, bias), LinearRows(ref_hidden, ref_weight, ref_bias)
        kl = _kl_forward(ctx, src, ref, mask_flat, temperature, chunk_size, group, dtype, device)
        ctx.save_for_backward(hidden, weight, bias, ref_hidden, ref_weight, ref_bias)
        ctx.group = group
        return kl.view(hidden.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        hidden, weight, bias, ref_hidden, ref_weight, ref_bias = ctx.saved_tensors
        need = tuple(bool(x) for x in ctx.needs_input_grad[:6])
        mask_flat, lse = ctx.vp_saved[0], ctx.vp_saved[1]
        hidden, ref_hidden = _masked_hidden(hidden, mask_flat), _masked_hidden(ref_hidden, mask_flat)
        src, ref = LinearRows(hidden, weight, bias), LinearRows(ref_hidden, ref_weight, ref_bias)
        sink_z = _HeadSink(src, need[:3], lse.dtype) if any(need[:3]) else None
        sink_ref = _HeadSink(ref, need[3:], lse.dtype) if any(need[3:]) else None
        _kl_backward(ctx, src, ref, grad_out, sink_z, sink_ref)
        grads_z = (None, None, None) if sink_z is None else sink_z.result(ctx.group)
        grads_ref = (None, None, None) if sink_ref is None else sink_ref.result(ctx.group)
        return (*grads_z, *grads_ref, None, None, None, None)
