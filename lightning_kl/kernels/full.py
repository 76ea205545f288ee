r"""The exact KL over the whole vocabulary (the estimator ``full``), in bounded memory.

Notation: ``n`` tokens (any number of leading dims, ``[...]``), ``V`` the vocabulary. For logits
:math:`z` of the policy and :math:`z^{\mathrm{ref}}` of the reference, both ``[..., V]``, and the
sampling temperature :math:`T`:

.. math::
    p = \operatorname{softmax}(z / T), \qquad q = \operatorname{softmax}(z^{\mathrm{ref}} / T), \qquad
    \mathrm{KL} = \sum_i p_i (\log p_i - \log q_i)

    \frac{\partial\,\mathrm{KL}}{\partial z_i} = \frac{p_i (\log p_i - \log q_i - \mathrm{KL})}{T}, \qquad
    \frac{\partial\,\mathrm{KL}}{\partial z^{\mathrm{ref}}_i} = \frac{q_i - p_i}{T}

The exact value has no sampling noise and its gradient is the exact gradient of the KL, so there is
no ``full+``. The plain composition (``log_softmax`` of both, ``exp``, multiply, sum, then autograd)
keeps four or five ``[n, V]`` tensors alive between forward and backward and creates more in
backward. Here the work runs over chunks of rows: the forward keeps only the per-token KL, and the
backward recomputes each chunk's log-probabilities from the inputs and writes that chunk of the
gradient. Beyond the inputs and the gradients, forward and backward hold a few ``chunk x V``
temporaries (the chunk is sized to stay in cache; on CPU, a few per torch thread: the chunks run
concurrently on the package's chunk runner, :mod:`lightning_kl.ground.chunks`) and ``O(n)`` numbers.

:func:`full_kl_from_hidden` runs the same chunks with the logits made from hidden states and LM heads
(:class:`~lightning_kl.kernels.rows.LinearRows`), in forward and again in backward, so the ``[n, V]``
logits never exist; each chunk's logits gradient :math:`G` then becomes :math:`G W` for the hidden
states, and adds :math:`G^\top h` and :math:`\sum G` to the head's gradients.

Conventions:

* The maths runs in the inputs' promoted dtype, at least float32 (bf16/fp16 logits are read chunk
  by chunk into float32); the gradients come back in each input's own dtype.
* Masked tokens (``mask`` False) are never read: their value is 0 and their gradient exactly 0, even
  if the logits hold NaN or inf there. They cost no compute either.
* A vocabulary entry with :math:`p_i = 0` (logit ``-inf`` in the policy, e.g. a padded vocabulary)
  adds nothing (:math:`0 \log 0 = 0`), whatever the reference holds; an entry with
  :math:`p_i > 0 = q_i` makes the KL ``+inf``, as it should. NaN in a valid token's logits gives NaN.
* The values are not clamped at 0: a KL that is 0 in exact arithmetic may come out as ``-1e-8``.
* First-order gradients only (no double backward).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_kl.ground.checks import check_chunk_size, check_full_hidden_inputs, check_full_inputs, check_temperature, compute_dtype, host_reads
from lightning_kl.ground.chunks import run_chunks
from lightning_kl.ground.vocab_shards import VocabShard, is_vocab_parallel
from lightning_kl.kernels.rows import LinearRows, Rows
from lightning_kl.kernels.vocab_parallel import vocab_parallel_full_kl, vocab_parallel_full_kl_from_hidden

__all__ = ["full_kl", "full_kl_compute", "full_kl_from_hidden", "full_kl_from_hidden_compute"]

# Elements per chunk (rows = elements // V). On CPU a chunk's float32 temporaries stay in cache,
# so only the inputs and the gradients travel through main memory: at 2048 x 32768 on one thread,
# chunks of 2 ... 64 rows all ran about 3x faster than the plain composition. With several torch
# threads the chunks are spread over a pool of Python threads that each run single-threaded ops
# (lightning_kl.ground.chunks), 2^19 elements (2 MiB per float32 buffer) per chunk and thread. Without
# the pool (CPU_THREAD_POOL = False there) each chunk is a dozen short *parallel* ops, so chunks are
# larger. On GPU a chunk only has to be
# large enough to fill the device: 2^25 elements, 128 MiB per float32 buffer, a few of them per
# chunk (well under 1 GiB: small next to any training GPU's memory), and enough work per chunk
# (220 rows at V = 151,936) that the host queues the next chunk's kernels before the device is
# done with this one. There is no thread pool on GPU (lightning_kl.ground.chunks says why).
CPU_CHUNK_ELEMENTS = 2**19
CPU_SERIAL_CHUNK_ELEMENTS = 2**20  # CPU without the pool: fewer, larger parallel ops
CUDA_CHUNK_ELEMENTS = 2**25

# From hidden states a chunk's logits are a matmul that reads the whole head: it needs enough rows
# to be compute bound rather than a re-read of [V, d] per few tokens. 2^23 elements is 55 rows at
# V = 151,936 (32 MiB per float32 buffer, a few per CPU worker thread). On GPU, 2^25 elements are
# 220 rows: a [220, d] x [d, V] matmul does ~220 flops per byte of a bf16 head, about the ridge
# point of a current GPU; benchmarks/gpu.py measures 2^23 and 2^27 against it.
HIDDEN_CPU_CHUNK_ELEMENTS = 2**23
HIDDEN_CUDA_CHUNK_ELEMENTS = 2**25
HIDDEN_MIN_CHUNK_ROWS = 16



def full_kl(
    logits: Tensor,
    ref_logits: Tensor,
    mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
) -> Tensor:
    r"""Exact per-token :math:`\mathrm{KL}(\pi \,\|\, \pi_{\mathrm{ref}})` over the vocabulary.

    ``lk.kl_penalty(logits, ref_logits, "full")`` calls this (and casts the result back to half
    precision for half inputs); call it directly to choose ``chunk_size``.

    Args:
        logits: ``[..., V]`` policy logits (any layout: non-contiguous slices such as
            ``logits[:, :-1]`` are read in place, never copied whole). Or logits split over the
            vocabulary across a tensor parallel group, never gathered (both models split the same
            way): DTensors with ``Shard(-1)`` or :class:`~lightning_kl.VocabShard` (see
            :mod:`lightning_kl.kernels.vocab_parallel`).
        ref_logits: ``[..., V]`` reference logits.
        mask: optional ``[...]`` mask, True on valid tokens; 0 value and exactly 0 gradient elsewhere.
        temperature: :math:`T` in ``softmax(logits / T)``, the policy's sampling temperature (> 0).
        chunk_size: tokens per chunk (default: :data:`CPU_CHUNK_ELEMENTS` or
            :data:`CUDA_CHUNK_ELEMENTS` divided by ``V``). The memory beyond the inputs and the
            gradients is a few ``chunk_size x V`` temporaries.

    Returns:
        ``[...]`` KL per token, in the compute dtype (the promoted input dtype, at least float32),
        differentiable w.r.t. both logits.

    Raises:
        ValueError: for shapes that do not match (named), a bad temperature or chunk size.
        TypeError: for inputs that are not floating point tensors.

    Example:
        >>> z = torch.tensor([[0.0, 0.0], [2.0, -1.0]], requires_grad=True)
        >>> ref = torch.tensor([[1.0, -1.0], [2.0, -1.0]])
        >>> kl = full_kl(z, ref)
        >>> kl  # row 0: 0.5 log(0.5/0.8808) + 0.5 log(0.5/0.1192); row 1: identical distributions
        tensor([0.4338, 0.0000], grad_fn=<_FullKLBackward>)
        >>> kl.sum().backward(); z.grad  # p (log p - log q - KL): 0.5 (-0.5662 - 0.4338), ...
        tensor([[-0.5000,  0.5000],
                [ 0.0000,  0.0000]])
    """
    mask = check_full_inputs(logits, ref_logits, mask)
    return full_kl_compute(logits, ref_logits, mask, temperature, chunk_size)


def full_kl_compute(
    logits: Tensor,
    ref_logits: Tensor,
    mask: Optional[Tensor],
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """:func:`full_kl` on checked inputs (``mask`` bool or None): the dispatch target of every caller."""
    temperature = check_temperature(temperature)
    check_chunk_size(chunk_size)
    if is_vocab_parallel(logits) or is_vocab_parallel(ref_logits):  # split over the vocabulary: never gathered
        return vocab_parallel_full_kl(logits, ref_logits, mask, temperature, chunk_size)
    mask_flat = None if mask is None else mask.reshape(-1)
    return _FullKL.apply(logits, ref_logits, mask_flat, temperature, chunk_size)


def full_kl_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    mask: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
) -> Tensor:
    r""":func:`full_kl` of the logits ``hidden @ weight.T + bias`` and ``ref_hidden @ ref_weight.T + ref_bias``.

    The same chunked maths, with each chunk of both models' logits made from the hidden states and
    the LM heads (in the heads' dtype, as the models make them), in forward and again in backward:
    the ``[..., V]`` logits never exist. Gradients w.r.t. every input that requires one (typically
    the policy's hidden states and head; the reference needs none and costs only its matmuls).

    Args:
        hidden: ``[..., d]`` the policy's last hidden states; ``weight`` ``[V, d]`` its LM head, or a
            :class:`~lightning_kl.VocabShard` of this rank's rows of a column-parallel head (both
            heads then split the same way; biases are this rank's slices).
        ref_hidden: ``[..., d']`` the reference's; ``ref_weight`` ``[V, d']`` its head.
        mask: optional ``[...]`` mask, True on valid tokens; 0 value and exactly 0 gradient elsewhere
            (masked tokens are never computed).
        bias, ref_bias: optional ``[V]`` head biases.
        temperature: :math:`T > 0`, the policy's sampling temperature.
        chunk_size: tokens per chunk (default: about :math:`2^{23}` logits per chunk on CPU,
            :math:`2^{25}` on GPU, at least 16 tokens: a chunk's matmul reads the whole head).
            The weight gradient adds up over chunks in a ``[V, d]`` buffer of the compute dtype.

    Returns:
        ``[...]`` KL per token, in the compute dtype (at least float32).

    Raises:
        ValueError: for shapes, dtypes or devices that do not match (named), a bad temperature or chunk size.
        TypeError: for inputs that are not floating point tensors.

    Example:
        >>> h = torch.tensor([[1.0, 0.0], [0.0, 0.0]], requires_grad=True)
        >>> w = torch.eye(2, requires_grad=True)
        >>> kl = full_kl_from_hidden(h, w, torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.eye(2))
        >>> kl  # row 0: logits [1, 0] against [0, 1]: p = (0.7311, 0.2689), KL = (0.7311 - 0.2689) * 1
        tensor([0.4621, 0.0000], grad_fn=<_FullKLFromHiddenBackward>)
    """
    mask = check_full_hidden_inputs(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, mask)
    return full_kl_from_hidden_compute(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, mask, temperature, chunk_size)


def full_kl_from_hidden_compute(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    ref_hidden: Tensor,
    ref_weight: Tensor,
    ref_bias: Optional[Tensor],
    mask: Optional[Tensor],
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """:func:`full_kl_from_hidden` on checked inputs (``mask`` bool or None)."""
    temperature = check_temperature(temperature)
    check_chunk_size(chunk_size)
    if isinstance(weight, VocabShard) or isinstance(ref_weight, VocabShard):  # column-parallel heads
        return vocab_parallel_full_kl_from_hidden(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, mask, temperature, chunk_size)
    mask_flat = None if mask is None else mask.reshape(-1)
    return _FullKLFromHidden.apply(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, mask_flat, temperature, chunk_size)



# ---------------------------------------------------------------------------------------------
# the chunked maths
#
# Every chunk's temporaries are consumed in place, so a chunk costs two or three [c, V] buffers in
# the compute dtype. The fast path computes d = log p - log q and multiplies by p; where a policy
# logit is -inf that is 0 * (-inf or NaN) = NaN, so rows whose KL comes out NaN are done again on
# the safe path, which sets 0 log 0 = 0 (two more passes per chunk, paid only by those rows).


def _chunks(rows: Optional[Tensor], n_work: int, chunk_size: int) -> Iterator[tuple[slice, slice | Tensor]]:
    """``(positions in the work list, row indices)`` per chunk; ``rows`` None: all rows in order."""
    for start in range(0, n_work, chunk_size):
        pos = slice(start, min(start + chunk_size, n_work))
        yield pos, (pos if rows is None else rows[pos])


def _log_probs(src: Rows | LinearRows, idx: slice | Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    chunk, fresh = src.read(idx)
    z = chunk.to(dtype)
    if temperature != 1.0:
        # in place only on a buffer of our own (a gathered or up-cast chunk), never on the input
        z = z.div_(temperature) if (fresh or z is not chunk) else z / temperature
    return torch.log_softmax(z, dim=-1)


def _chunk_kl(logp: Tensor, logq: Tensor, safe: bool) -> Tensor:
    """Per-row KL of a chunk; consumes (overwrites) both arguments."""
    d = torch.sub(logp, logq, out=logq)
    p = logp.exp_()
    d.mul_(p)
    if safe:
        # 0 log 0 = 0 where p is 0; masked_fill on p == 0 keeps a NaN that comes from NaN logits
        d.masked_fill_(p == 0, 0)
    return d.sum(-1)


def _chunk_grads(
    logp: Tensor,
    logq: Tensor,
    kl: Tensor,
    scale: Tensor,
    need_z: bool,
    need_ref: bool,
    safe: bool,
    out_z: Optional[Tensor],
    out_ref: Optional[Tensor],
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``scale * p (log p - log q - KL)`` and ``scale * (q - p)`` for a chunk, written into ``out_*``
    when given; consumes both log-prob arguments. ``kl`` and ``scale`` are ``[c, 1]``."""
    q = logq.exp() if need_ref else None
    d = torch.sub(logp, logq, out=logq) if need_z else None
    p = logp.exp_()
    grad_ref = grad_z = None
    if q is not None:
        grad_ref = torch.mul(q.sub_(p), scale, out=q if out_ref is None else out_ref)
    if d is not None:
        d.sub_(kl)
        if safe:
            # 0 log 0 = 0 where p is 0, as in the forward
            d.mul_(p).masked_fill_(p == 0, 0)
            grad_z = torch.mul(d, scale, out=d if out_z is None else out_z)
        else:
            grad_z = torch.mul(d, p.mul_(scale), out=d if out_z is None else out_z)
    return grad_z, grad_ref


def _for_each(fn: Callable[[Any], None], items: list, device: torch.device) -> None:
    """``fn(item)`` for every chunk, through the package's chunk runner."""
    run_chunks(lambda item, _state: fn(item), items, device)


class _FullKL(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        ref_logits: Tensor,
        mask_flat: Optional[Tensor],
        temperature: float,
        chunk_size: Optional[int],
    ) -> Tensor:
        dtype = compute_dtype(logits, ref_logits)
        if chunk_size is None:
            chunk_size = max(1, _chunk_elements(logits.device) // max(logits.shape[-1], 1))
        out, saved = _forward(Rows(logits), Rows(ref_logits), mask_flat, dtype, temperature, chunk_size)
        ctx.save_for_backward(logits, ref_logits, mask_flat, *saved)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return out.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        logits, ref_logits, mask_flat, *saved = ctx.saved_tensors
        need_z, need_ref = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
        rows = saved[0]
        sink_z = _LogitsGrad(logits, mask_flat, rows) if need_z else None
        sink_ref = _LogitsGrad(ref_logits, mask_flat, rows) if need_ref else None
        _backward(Rows(logits), Rows(ref_logits), mask_flat, sink_z, sink_ref, saved, grad_out, ctx.temperature, ctx.chunk_size, ctx.dtype)
        return (
            None if sink_z is None else sink_z.result()[0],
            None if sink_ref is None else sink_ref.result()[0],
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
    ) -> Tensor:
        dtype = compute_dtype(hidden, ref_hidden)
        if chunk_size is None:
            chunk_size = max(HIDDEN_MIN_CHUNK_ROWS, _hidden_chunk_elements(hidden.device) // max(weight.shape[0], 1))
        src, ref = LinearRows(hidden, weight, bias), LinearRows(ref_hidden, ref_weight, ref_bias)
        out, saved = _forward(src, ref, mask_flat, dtype, temperature, chunk_size)
        ctx.save_for_backward(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, mask_flat, *saved)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return out.view(hidden.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        hidden, weight, bias, ref_hidden, ref_weight, ref_bias, mask_flat, *saved = ctx.saved_tensors
        need = [bool(x) for x in ctx.needs_input_grad[:6]]
        if mask_flat is not None and not host_reads(hidden.device):
            # padding is computed too off the CPU: its hidden states (NaN, say) must stay out of dW
            keep = mask_flat.view(*hidden.shape[:-1], 1)
            hidden, ref_hidden = hidden.masked_fill(~keep, 0), ref_hidden.masked_fill(~keep, 0)
        src, ref = LinearRows(hidden, weight, bias), LinearRows(ref_hidden, ref_weight, ref_bias)
        sink_z = _HeadGrad(src, *need[:3], ctx.dtype) if any(need[:3]) else None
        sink_ref = _HeadGrad(ref, *need[3:], ctx.dtype) if any(need[3:]) else None
        _backward(src, ref, mask_flat, sink_z, sink_ref, saved, grad_out, ctx.temperature, ctx.chunk_size, ctx.dtype)
        grads_z = (None, None, None) if sink_z is None else sink_z.result()
        grads_ref = (None, None, None) if sink_ref is None else sink_ref.result()
        return (*grads_z, *grads_ref, None, None, None)


def _forward(
    src: Rows | LinearRows,
    ref: Rows | LinearRows,
    mask_flat: Optional[Tensor],
    dtype: torch.dtype,
    temperature: float,
    chunk_size: int,
) -> tuple[Tensor, tuple[Optional[Tensor], Tensor, Tensor, Tensor]]:
    """The flat per-token KL, and ``(rows, kl, redo, redo_rows)`` for :func:`_backward`."""
    n = math.prod(src.lead)
    device = mask_flat.device if mask_flat is not None else (src.flat if src.flat is not None else src.x).device

    # the work list: the valid tokens (padding is never read), None for all of them in order. Off
    # the CPU no index list (a host sync): every row is computed, on the safe path, and padding zeroed
    host = host_reads(device)
    rows: Optional[Tensor] = None
    if mask_flat is not None and host:
        rows = mask_flat.nonzero().squeeze(-1)
    elif src.flat is None or ref.flat is None:
        rows = torch.arange(n, device=device)
    n_work = n if rows is None else rows.numel()

    kl = torch.empty(n_work, dtype=dtype, device=device)

    def fast(chunk: tuple[slice, slice | Tensor]) -> None:
        pos, idx = chunk
        logp = _log_probs(src, idx, dtype, temperature)
        kl[pos] = _chunk_kl(logp, _log_probs(ref, idx, dtype, temperature), safe=not host)

    _for_each(fast, list(_chunks(rows, n_work, chunk_size)), device)
    if not host and mask_flat is not None:
        kl.masked_fill_(~mask_flat, 0)
    # rows to redo on the safe path (a -inf policy logit, or NaN logits, which stay NaN)
    redo = kl.isnan().nonzero().squeeze(-1) if host else kl.new_empty(0, dtype=torch.long)
    redo_rows = redo if rows is None else rows[redo]
    for pos, idx in _chunks(redo_rows, redo.numel(), chunk_size):
        logp = _log_probs(src, idx, dtype, temperature)
        kl[redo[pos]] = _chunk_kl(logp, _log_probs(ref, idx, dtype, temperature), safe=True)

    out = kl if n_work == n else torch.zeros(n, dtype=dtype, device=device).index_copy_(0, rows, kl)
    return out, (rows, kl, redo, redo_rows)


def _backward(
    src: Rows | LinearRows,
    ref: Rows | LinearRows,
    mask_flat: Optional[Tensor],
    sink_z: Optional[_LogitsGrad | _HeadGrad],
    sink_ref: Optional[_LogitsGrad | _HeadGrad],
    saved: list[Tensor],
    grad_out: Tensor,
    temperature: float,
    chunk_size: int,
    dtype: torch.dtype,
) -> None:
    """Every chunk's logits gradients, handed to the sinks (which turn them into the inputs' gradients)."""
    rows, kl, redo, redo_rows = saved
    device = grad_out.device
    # without index lists (off the CPU) padding is computed too: its gradients are zeroed per chunk
    skip = None if host_reads(device) or mask_flat is None else ~mask_flat.unsqueeze(1)
    n_work = kl.numel()
    # d(loss)/d(KL) of each processed token, over T: the common factor of both formulas
    g = grad_out.reshape(-1).to(dtype)
    if rows is not None:
        g = g.index_select(0, rows)
    scale = (g / temperature).unsqueeze(-1)
    kl = kl.unsqueeze(-1)

    def chunk_grads(at: slice | Tensor, idx: slice | Tensor, safe: bool) -> None:
        out_z = None if sink_z is None else sink_z.direct(idx, dtype)
        out_ref = None if sink_ref is None else sink_ref.direct(idx, dtype)
        gz, gr = _chunk_grads(
            _log_probs(src, idx, dtype, temperature),
            _log_probs(ref, idx, dtype, temperature),
            kl[at],
            scale[at],
            sink_z is not None,
            sink_ref is not None,
            safe,
            out_z,
            out_ref,
        )
        if skip is not None:  # NaN padding: 0 * NaN
            gz = None if gz is None else gz.masked_fill_(skip[at], 0)
            gr = None if gr is None else gr.masked_fill_(skip[at], 0)
        # each chunk writes its own rows: chunks may run concurrently (_for_each)
        if sink_z is not None and out_z is None:
            sink_z.put(idx, gz)
        if sink_ref is not None and out_ref is None:
            sink_ref.put(idx, gr)

    # the fast pass over every row, then the safe pass over the rows the forward redid
    safe = not host_reads(device)  # as in the forward
    _for_each(lambda c: chunk_grads(c[0], c[1], safe), list(_chunks(rows, n_work, chunk_size)), device)
    redone = [(redo[pos], idx) for pos, idx in _chunks(redo_rows, redo.numel(), chunk_size)]
    _for_each(lambda c: chunk_grads(c[0], c[1], True), redone, device)


class _LogitsGrad:
    """The gradient of a ``[..., V]`` logits input, written chunk by chunk."""

    def __init__(self, x: Tensor, mask_flat: Optional[Tensor], rows: Optional[Tensor]) -> None:
        self.shape = x.shape
        self.grad = _new_grad(x, mask_flat, rows)

    def direct(self, idx: slice | Tensor, dtype: torch.dtype) -> Optional[Tensor]:
        return _direct(self.grad, idx, dtype)

    def put(self, idx: slice | Tensor, chunk: Optional[Tensor]) -> None:
        _write(self.grad, idx, chunk)

    def result(self) -> tuple[Tensor]:
        return (self.grad.view(self.shape),)


class _HeadGrad:
    """The gradients of ``hidden``, ``weight`` and ``bias`` from chunks ``G`` of the logits' gradient.

    ``dh = G W`` row by row; ``dW = G^T h`` and ``db = sum G`` add up over the chunks in the compute
    dtype (a ``[V, d]`` buffer, float32 for half weights, so that each element is rounded once).
    """

    def __init__(self, src: LinearRows, need_h: bool, need_w: bool, need_b: bool, dtype: torch.dtype) -> None:
        self.src, self.dtype = src, dtype
        w, device = src.weight, src.weight.device
        self.grad_h = torch.zeros(src.flat.shape, dtype=src.dtype, device=device) if need_h else None
        self.acc_w = torch.zeros(w.shape, dtype=dtype, device=device) if need_w else None
        self.acc_b = torch.zeros(w.shape[0], dtype=dtype, device=device) if need_b else None
        self.lock = threading.Lock()

    def direct(self, idx: slice | Tensor, dtype: torch.dtype) -> Optional[Tensor]:
        return None

    def put(self, idx: slice | Tensor, g: Optional[Tensor]) -> None:
        assert g is not None
        if self.grad_h is not None:
            part = torch.mm(g.to(self.src.weight.dtype), self.src.weight)
            if isinstance(idx, slice):
                self.grad_h[idx] = part
            else:
                self.grad_h.index_copy_(0, idx, part)
        if self.acc_w is not None or self.acc_b is not None:
            h = self.src.hidden_rows(idx).to(self.dtype)
            with self.lock:  # chunks run concurrently and all add to the same [V, d]
                if self.acc_w is not None:
                    torch.addmm(self.acc_w, g.T, h, out=self.acc_w)
                if self.acc_b is not None:
                    self.acc_b += g.sum(0)

    def result(self) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        grad_h = None if self.grad_h is None else self.grad_h.view(self.src.hidden.shape)
        grad_w = None if self.acc_w is None else self.acc_w.to(self.src.weight.dtype)
        grad_b = None if self.acc_b is None else self.acc_b.to(self.src.weight.dtype)
        return grad_h, grad_w, grad_b


def _hidden_chunk_elements(device: torch.device) -> int:
    return HIDDEN_CUDA_CHUNK_ELEMENTS if device.type != "cpu" else HIDDEN_CPU_CHUNK_ELEMENTS


def _chunk_elements(device: torch.device) -> int:
    if device.type != "cpu":
        return CUDA_CHUNK_ELEMENTS
    return CPU_SERIAL_CHUNK_ELEMENTS  # the chunks run in order with torch's threads (ground/chunks.py)


def _new_grad(x: Tensor, mask_flat: Optional[Tensor], rows: Optional[Tensor]) -> Tensor:
    """A ``[n, V]`` gradient buffer in ``x``'s dtype; rows that are never processed hold 0."""
    n = math.prod(x.shape[:-1])
    grad = torch.empty((n, x.shape[-1]), dtype=x.dtype, device=x.device)
    if mask_flat is not None and rows is not None and rows.numel() < n:
        grad.index_fill_(0, (~mask_flat).nonzero().squeeze(-1), 0)
    return grad


def _direct(grad: Optional[Tensor], idx: slice | Tensor, dtype: torch.dtype) -> Optional[Tensor]:
    """The slice of ``grad`` a chunk can be computed straight into (same dtype, contiguous rows)."""
    if grad is None or not isinstance(idx, slice) or grad.dtype != dtype:
        return None
    return grad[idx]


def _write(grad: Tensor, idx: slice | Tensor, chunk: Optional[Tensor]) -> None:
    assert chunk is not None
    if isinstance(idx, slice):
        grad[idx].copy_(chunk)
    else:
        grad.index_copy_(0, idx, chunk.to(grad.dtype))
