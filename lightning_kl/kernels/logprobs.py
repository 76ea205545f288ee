r"""Token log-probabilities at vocabulary scale, exact, without ``[n, V]`` float32 copies.

Notation: ``n`` tokens (flattened leading dims), ``V`` the vocabulary, ``d`` the hidden size. For
logits :math:`z \in \mathbb{R}^V` of one token, its target id :math:`y` and the temperature :math:`T`:

.. math::
    \ell = \frac{z_y}{T} - \operatorname{lse}\Big(\frac{z}{T}\Big), \qquad
    \frac{\partial \ell}{\partial z_i} = \frac{[i = y] - p_i}{T}, \quad p = \operatorname{softmax}(z / T)

and from hidden states :math:`h \in \mathbb{R}^d` and the head :math:`z = W h + b` (``W`` ``[V, d]``),
with :math:`G = \partial\mathcal{L}/\partial z` (``[n, V]``, never held whole):
:math:`\partial\mathcal{L}/\partial h = G W`, :math:`\partial\mathcal{L}/\partial W = G^\top h`,
:math:`\partial\mathcal{L}/\partial b = \sum_{\text{rows}} G`.

* From logits (:func:`token_logprobs_kernel`): chunks of rows. The forward keeps only the per-row
  log-sum-exp (float32, or float64 for float64 logits); the backward reads each chunk again,
  recomputes its softmax and writes that chunk of the gradient once, in the logits' dtype.
* From hidden states (:func:`token_logprobs_from_hidden_kernel`): blocks of rows times tiles of the
  vocabulary, so that a tile's matmul has many rows (the head is read once per block, not once
  per few rows) and its ``[rows, tile]`` logits stay small. The forward combines the tiles'
  log-sum-exps; the backward recomputes each tile's logits and turns them into the three
  gradients: a tile owns its rows of ``dW`` and ``db``, and adds its share of ``dh``.

Ignored tokens (``ignored`` True) have value 0 and exactly zero gradient, even if their logits hold
NaN. Ids are checked by the caller.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_kl.ground.checks import compute_dtype
from lightning_kl.ground.chunks import run_chunks
from lightning_kl.kernels.rows import Rows

__all__ = [
    "CPU_CHUNK_ELEMENTS",
    "CUDA_CHUNK_ELEMENTS",
    "HIDDEN_BLOCK_ROWS",
    "HIDDEN_CPU_TILE_ELEMENTS",
    "HIDDEN_CUDA_TILE_ELEMENTS",
    "token_logprobs_from_hidden_kernel",
    "token_logprobs_kernel",
]

# From logits: elements per chunk of rows (rows = elements // V, at least 1). On CPU a chunk's
# float32 temporaries stay in cache, so only the logits and their gradient go through main memory;
# on GPU a chunk only has to fill the device. There the limit is the host: it queues a chunk's
# eight or so kernels (~10 us each in eager mode) while the device runs the previous chunk, so a
# chunk must keep the device busy longer than that. 2^25 elements are 220 rows at V = 151,936, one
# 128 MiB float32 scratch buffer (the only chunk-sized temporary), and ~0.6 GB of memory traffic per
# chunk: ~0.2 ms at 3 TB/s, against ~0.1 ms of queueing. `benchmarks/gpu.py` measures 2^23 and
# 2^27 against it (group "chunks").
CPU_CHUNK_ELEMENTS = 2**19
CUDA_CHUNK_ELEMENTS = 2**25

# From hidden states: rows per block (the head is read once per block and per pass) and elements
# per [rows, vocab tile] of logits: 2^22 float32 logits are 16 MiB per CPU worker thread. On GPU a
# tile of 4096 rows x 16384 entries (2^26: 256 MiB in float32, plus its half-precision matmul
# output) is a matmul large enough to run near the device's peak.
HIDDEN_BLOCK_ROWS = 4096
HIDDEN_CPU_TILE_ELEMENTS = 2**22
HIDDEN_CUDA_TILE_ELEMENTS = 2**26


def _slices(n: int, size: int) -> list[slice]:
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


# ---------------------------------------------------------------------------------------------
# from logits


def token_logprobs_kernel(
    logits: Tensor,
    ids: Tensor,
    ignored: Optional[Tensor],
    temperature: float,
    chunk_size: Optional[int],
) -> Tensor:
    """Log-probs of ``ids [n]`` (int64, in range) under ``logits [..., V]``, shaped ``[...]``; checked inputs.

    ``ignored`` is None or ``[n]`` bool; ``chunk_size`` rows per chunk or None for the default.
    """
    return _TokenLogprobs.apply(logits, ids, ignored, temperature, chunk_size)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        ids: Tensor,
        ignored: Optional[Tensor],
        temperature: float,
        chunk_size: Optional[int],
    ) -> Tensor:
        src = Rows(logits)
        vocab = logits.shape[-1]
        n = ids.numel()
        dtype = compute_dtype(logits)
        device = logits.device
        if chunk_size is None:
            elements = CUDA_CHUNK_ELEMENTS if device.type != "cpu" else CPU_CHUNK_ELEMENTS
            chunk_size = max(1, elements // max(vocab, 1))
        items = _items(src, n, chunk_size, device)
        lse = torch.empty(n, dtype=dtype, device=device)
        out = torch.empty(n, dtype=dtype, device=device)

        def work(item: tuple[slice, slice | Tensor], state: dict[str, Tensor]) -> None:
            pos, idx = item
            chunk, _ = src.read(idx)
            # lse(z / T) = m / T + log sum exp((z - m) / T): the max is exact in the input dtype,
            # and one op reads the half chunk and writes the float32 differences into scratch
            # (m in the compute dtype: a half - half op would compute in half)
            m = chunk.amax(dim=-1, keepdim=True).to(dtype)
            e = torch.sub(chunk, m, out=_scratch(state, chunk.shape, dtype, device))
            if temperature != 1.0:
                e.div_(temperature)
            lse[pos] = e.exp_().sum(dim=-1).log_().add_(m.squeeze(1) / temperature)
            out[pos] = chunk.gather(1, ids[pos].unsqueeze(1)).squeeze(1).to(dtype) / temperature - lse[pos]

        run_chunks(work, items, device, make_state=dict)
        if ignored is not None:
            out = out.masked_fill_(ignored, 0)
        ctx.save_for_backward(logits, ids, ignored, lse)
        out = out.view(logits.shape[:-1])
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        logits, ids, ignored, lse = ctx.saved_tensors
        temperature = ctx.temperature
        src = Rows(logits)
        n, vocab = ids.numel(), logits.shape[-1]
        dtype, device = lse.dtype, logits.device
        # d(loss)/d(log-prob) over T, 0 on ignored tokens: dl/dz_i = s ([i = y] - p_i)
        s = (grad_out.reshape(-1).to(dtype) / temperature).unsqueeze(1)
        if ignored is not None:
            s = s.masked_fill(ignored.unsqueeze(1), 0)
        lse_t = (lse * temperature).unsqueeze(1)
        grad = torch.empty((n, vocab), dtype=logits.dtype, device=device)
        # ignored rows whose lse is not finite (NaN or inf logits), zeroed chunk by chunk: no index list
        junk = None if ignored is None else ignored & ~lse.isfinite()

        def work(item: tuple[slice, slice | Tensor], state: dict[str, Tensor]) -> None:
            pos, idx = item
            chunk, _ = src.read(idx)
            # float32 gradients are computed in place in the gradient; half ones in scratch, then
            # written once. p = exp(z / T - lse) = exp((z - T lse) / T)
            p = grad[pos] if grad.dtype == dtype else _scratch(state, chunk.shape, dtype, device)
            torch.sub(chunk, lse_t[pos], out=p)
            if temperature != 1.0:
                p.div_(temperature)
            p.exp_().mul_(s[pos].neg())
            p.scatter_add_(1, ids[pos].unsqueeze(1), s[pos])
            if junk is not None:  # s = 0 there, but 0 * p is NaN where the logits hold NaN or inf
                p.masked_fill_(junk[pos].unsqueeze(1), 0)
            if grad.dtype != dtype:
                grad[pos] = p

        run_chunks(work, _items(src, n, ctx.chunk_size, device), device, make_state=dict)
        return grad.view(logits.shape), None, None, None, None


def _scratch(state: dict[str, Tensor], shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A worker's reusable ``[rows, V]`` buffer (grown on demand; chunks after the first are no larger)."""
    buf = state.get("buf")
    if buf is None or buf.shape[0] < shape[0] or buf.shape[1] != shape[1]:
        buf = state["buf"] = torch.empty(tuple(shape), dtype=dtype, device=device)
    return buf[: shape[0]]


def _items(src: Rows, n: int, chunk_size: int, device: torch.device) -> list[tuple[slice, slice | Tensor]]:
    """``(output positions, row indices)`` per chunk: slices, or index tensors when ``src.flat`` is None."""
    if src.flat is not None:
        return [(pos, pos) for pos in _slices(n, chunk_size)]
    rows = torch.arange(n, device=device)
    return [(pos, rows[pos]) for pos in _slices(n, chunk_size)]


# ---------------------------------------------------------------------------------------------
# from hidden states


def token_logprobs_from_hidden_kernel(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    ids: Tensor,
    ignored: Optional[Tensor],
    temperature: float,
    chunk_size: Optional[int],
    vocab_chunk_size: Optional[int],
) -> Tensor:
    """Log-probs of ``ids [n]`` under ``hidden [..., d] @ weight.T + bias``, shaped ``[...]``; checked inputs.

    ``chunk_size`` rows per block, ``vocab_chunk_size`` vocabulary entries per tile (None: defaults).
    """
    return _TokenLogprobsFromHidden.apply(hidden, weight, bias, ids, ignored, temperature, chunk_size, vocab_chunk_size)


def _blocks(n: int, vocab: int, device: torch.device, rows: Optional[int], tile: Optional[int]) -> list[tuple[slice, list[slice]]]:
    """``(row block, vocabulary tiles)`` for every block of rows."""
    rows = rows or HIDDEN_BLOCK_ROWS
    elements = HIDDEN_CUDA_TILE_ELEMENTS if device.type != "cpu" else HIDDEN_CPU_TILE_ELEMENTS
    out = []
    for block in _slices(n, rows):
        width = tile or max(1, elements // (block.stop - block.start))
        out.append((block, _slices(vocab, width)))
    return out


def _in_tile(y: Tensor, cols: slice) -> tuple[Tensor, Tensor]:
    """Which ids ``y`` lie in the tile ``cols``, and their column there (clamped into it, ``[r, 1]``)."""
    here = (y >= cols.start) & (y < cols.stop)
    return here, (y - cols.start).clamp_(0, cols.stop - cols.start - 1).unsqueeze(1)


def _tile_logits(h: Tensor, weight: Tensor, bias: Optional[Tensor], cols: slice, dtype: torch.dtype, temperature: float) -> Tensor:
    # the head's own dtype for the matmul (the model's logits), then the compute dtype
    z = F.linear(h, weight[cols], None if bias is None else bias[cols])
    z = z.to(dtype)
    return z.div_(temperature) if temperature != 1.0 else z


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
        vocab_chunk_size: Optional[int],
    ) -> Tensor:
        h2 = hidden.reshape(-1, hidden.shape[-1])
        n, vocab = h2.shape[0], weight.shape[0]
        dtype, device = compute_dtype(hidden), hidden.device
        lse = torch.empty(n, dtype=dtype, device=device)
        selected = torch.empty(n, dtype=dtype, device=device)
        for block, tiles in _blocks(n, vocab, device, chunk_size, vocab_chunk_size):
            h, y = h2[block], ids[block]
            tile_lse = torch.empty((len(tiles), h.shape[0]), dtype=dtype, device=device)
            tile_sel = torch.empty((len(tiles), h.shape[0]), dtype=dtype, device=device)

            def work(item: tuple[int, slice], state: Any) -> None:
                k, cols = item
                z = _tile_logits(h, weight, bias, cols, dtype, temperature)
                tile_lse[k] = torch.logsumexp(z, dim=-1)
                # each row's id lies in exactly one tile, which gives its logit; the others give 0
                # (no index lists: nonzero() would wait for the device once per tile)
                here, col = _in_tile(y, cols)
                tile_sel[k] = torch.where(here, z.gather(1, col).squeeze(1), 0)

            run_chunks(work, list(enumerate(tiles)), device)
            lse[block] = torch.logsumexp(tile_lse, dim=0)
            selected[block] = tile_sel.sum(dim=0)  # one logit and zeros: exact
        out = selected - lse
        if ignored is not None:
            out = out.masked_fill_(ignored, 0)
        ctx.save_for_backward(hidden, weight, bias, ids, ignored, lse)
        ctx.temperature, ctx.chunk_size, ctx.vocab_chunk_size = temperature, chunk_size, vocab_chunk_size
        return out.view(hidden.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        hidden, weight, bias, ids, ignored, lse = ctx.saved_tensors
        need_h, need_w, need_b = (bool(x) for x in ctx.needs_input_grad[:3])
        temperature = ctx.temperature
        h2 = hidden.reshape(-1, hidden.shape[-1])
        n, vocab = h2.shape[0], weight.shape[0]
        dtype, device = lse.dtype, hidden.device
        s = grad_out.reshape(-1).to(dtype) / temperature
        if ignored is not None:
            s = s.masked_fill(ignored, 0)
        blocks = _blocks(n, vocab, device, ctx.chunk_size, ctx.vocab_chunk_size)
        # dW and db: one block writes them at once; several add up, in float32 for half weights
        # (a [V, d] float32 buffer) so that each element is rounded once, as in one big matmul
        one_block = len(blocks) == 1
        grad_w = grad_b = acc_w = acc_b = None
        if need_w:
            grad_w = (torch.empty_like if one_block else torch.zeros_like)(weight, memory_format=torch.contiguous_format)
            acc_w = grad_w if one_block or weight.dtype == dtype else torch.zeros(weight.shape, dtype=dtype, device=device)
        if need_b:
            assert bias is not None
            acc_b = torch.zeros(vocab, dtype=dtype, device=device)
        grad_h = torch.empty_like(h2, memory_format=torch.contiguous_format) if need_h else None
        lock = threading.Lock()

        for block, tiles in blocks:
            h, y, sb, lb = h2[block], ids[block], s[block].unsqueeze(1), lse[block].unsqueeze(1)
            ign = None if ignored is None else ignored[block].unsqueeze(1)
            if ign is not None and need_w:
                h = h.masked_fill(ign, 0)  # so that NaN hidden states of ignored tokens stay out of dW
            acc_h = torch.zeros(h.shape, dtype=dtype, device=device) if need_h else None

            def work(cols: slice, state: Any) -> None:
                g = _tile_logits(h, weight, bias, cols, dtype, temperature)
                g = g.sub_(lb).exp_().mul_(sb.neg())
                here, col = _in_tile(y, cols)
                g.scatter_add_(1, col, torch.where(here.unsqueeze(1), sb, 0))
                if ign is not None:
                    g.masked_fill_(ign, 0)
                gm = g.to(weight.dtype)  # the matmuls in the head's dtype, as autograd would
                if acc_h is not None:
                    part = torch.mm(gm, weight[cols])
                    with lock:
                        acc_h.add_(part)
                if acc_w is not None:
                    rows_w = acc_w[cols]
                    if one_block:
                        torch.mm(gm.T, h, out=rows_w)
                    elif acc_w.dtype == gm.dtype:
                        torch.addmm(rows_w, gm.T, h, out=rows_w)
                    else:
                        rows_w += torch.mm(gm.T, h)
                if acc_b is not None:
                    acc_b[cols] += g.sum(0)

            run_chunks(work, tiles, device)
            if grad_h is not None and acc_h is not None:
                grad_h[block] = acc_h
        if grad_w is not None and acc_w is not grad_w:
            grad_w.copy_(acc_w)
        return (
            None if grad_h is None else grad_h.view(hidden.shape),
            grad_w,
            None if acc_b is None else acc_b.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )
