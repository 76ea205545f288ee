r"""The vocabulary engine: one chunked path for every source, partition, sampler and quantity.

Notation: ``n`` rows (tokens, the flattened leading dims), ``V`` the vocabulary, :math:`z` a row's
logits, :math:`T` the temperature. Four parts:

* a **row source** (:class:`Source`): logits ``[..., V]`` read by chunks of rows in place, or hidden
  states ``[..., d]`` times an LM head ``[V, d]`` (plus a bias), each chunk's logits made by a matmul
  in forward and again in backward, so that the ``[n, V]`` logits never exist; without truncation a
  head's chunk is a block of rows walked by vocabulary tiles, combined as the ranks are (below);
* a **vocabulary partition** (:class:`Partition`): the whole vocabulary, or this rank's columns
  ``[o_k, o_k + V_k)`` of a vocabulary split over a process group. Each rank reduces its own columns
  to a few numbers per row and these are combined over the ranks (a ``MAX``, then a ``SUM`` of
  exponentials for the log-sum-exp, then a ``SUM``), ``O(n)`` numbers, from the calling thread, and
  only when the group has more than one rank;
* an optional **sampler** (:class:`~lightning_kl.Sampling`): the scores :math:`z / T`, then top-k,
  top-p and min-p as ``generate`` applies them (:func:`~lightning_kl.kernels.processing.process_scores`),
  removed entries ``-inf``: the processed distribution :math:`\tilde p` on its kept set :math:`K`;
* a **quantity**, one :class:`torch.autograd.Function` each: the token log-prob, the exact KL to a
  second source, the token entropy.

With :math:`\log \tilde p_i = s_i - \operatorname{lse}(s)` over the processed scores :math:`s` and the
gradient coming in :math:`g` per row, the backward of each quantity w.r.t. the logits is, on the
kept set (0 elsewhere; the kept set is a selection and does not move under a small change):

.. math::
    \frac{\partial \log \tilde p_y}{\partial z_i} = \frac{[i = y] - \tilde p_i}{T}, \qquad
    \frac{\partial\,\mathrm{KL}}{\partial z_i} = \frac{\tilde p_i (\log \tilde p_i - \log q_i - \mathrm{KL})}{T}, \qquad
    \frac{\partial\,\mathrm{KL}}{\partial z^{\mathrm{ref}}_i} = \frac{q_i - \tilde p_i}{T}, \qquad
    \frac{\partial H}{\partial z_i} = -\frac{\tilde p_i (\log \tilde p_i + H)}{T}.

Over a partition, with the local log-sum-exp :math:`l_k` of rank :math:`k`, the global one :math:`l`
and :math:`w_k = e^{l_k - l}`, the per-rank sums combine exactly:
:math:`H = \sum_k w_k (h_k + l - l_k)` and
:math:`\mathrm{KL} = \sum_k w_k (\mathrm{kl}_k + (l^p_k - l^p) - (l^q_k - l^q))`, where :math:`h_k`
and :math:`\mathrm{kl}_k` are the entropy and the KL of the rank's own renormalized columns; the
backward needs no collective (the global statistics are saved) except the sum of the hidden states'
gradient over the group. The sampler's truncation needs whole rows: the entry points refuse it on a
split vocabulary.

The forward keeps ``O(n)`` numbers per row (log-sum-exps, the value); the backward reads each chunk
again and writes that chunk of the gradient once, through one writer for logits
(:class:`LogitsGrad`) and one for a head (:class:`HeadGrad`). Every row is computed, on every device:
invalid rows (masked, or an ignored token) get value 0 and exactly zero gradient, NaN logits or
hidden states there included, and nothing is read on the host per call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_kl.ground.checks import check_values, compute_dtype
from lightning_kl.ground.chunks import run_chunks
from lightning_kl.ground.sampler import Sampling
from lightning_kl.kernels.processing import process_scores

__all__ = [
    "CPU_CHUNK_ELEMENTS",
    "CUDA_CHUNK_ELEMENTS",
    "HIDDEN_BLOCK_ROWS",
    "HIDDEN_CPU_CHUNK_ELEMENTS",
    "HIDDEN_CPU_TILE_ELEMENTS",
    "HIDDEN_MIN_CHUNK_ROWS",
    "REFERENCES",
    "WHOLE",
    "Partition",
    "Source",
    "Tensors",
    "entropy_kernel",
    "full_kl_kernel",
    "token_logprobs_kernel",
]

# Elements per chunk of rows (rows = elements // V, at least 1). On CPU a chunk's float32 temporaries
# stay in cache (4 MiB each, a few per worker of the chunk runner's pool: within a 32 MiB L3), so only
# the inputs and the gradients go through main memory; fewer, larger chunks also mean fewer hand-offs
# of the GIL between the pool's workers, which cost most on oversubscribed cores: at a load of 15-17
# on 2 cores, token log-probs from bf16 logits [1024, 151936] fwd+bwd took 16x, 4.7x, 3.6x and 2.1x
# the plain composition's time in chunks of 2^18, 2^19, 2^20 and 2^21 elements. On GPU a chunk only has
# to fill the device while the host queues the next one: 2^25 elements are 220 rows at V = 151,936,
# 128 MiB per float32 temporary (a few per chunk; the sampler's sort adds its values and int64
# indices). From hidden states a chunk's logits are a matmul that reads the whole head: it needs
# enough rows to be compute bound (2^23 elements on CPU: 55 rows at V = 151,936; at least 16 rows).
# Without truncation a head's chunk is a block of 4096 rows walked by vocabulary tiles of 2^22 elements
# on CPU (16 MiB in float32), 2^25 on GPU: the head is read once per block.
CPU_CHUNK_ELEMENTS = 2**20
CUDA_CHUNK_ELEMENTS = 2**25
HIDDEN_CPU_CHUNK_ELEMENTS = 2**23
HIDDEN_MIN_CHUNK_ROWS = 16
HIDDEN_BLOCK_ROWS = 4096
HIDDEN_CPU_TILE_ELEMENTS = 2**22

#: The references a processed policy's KL can be taken against (see :func:`full_kl_kernel`).
REFERENCES = ("unprocessed", "processed", "policy_kept")

_NINF = float("-inf")
_MAX, _SUM = "max", "sum"


class Tensors(NamedTuple):
    """A row source's tensors: logits ``x [..., V]`` (``weight`` None), or hidden states ``x [..., d]``
    with the head ``weight [V, d]`` and ``bias [V]`` or None."""

    x: Tensor
    weight: Optional[Tensor] = None
    bias: Optional[Tensor] = None


@dataclass(frozen=True)
class Partition:
    """The vocabulary a source covers: the whole one, or this rank's columns from ``offset`` of a split
    over ``group`` (``ranks`` ranks; the collectives run only for ``ranks > 1``)."""

    group: Any = None
    offset: int = 0
    ranks: int = 1
    split: bool = False

    def reduce(self, x: Tensor, op: str) -> Tensor:
        """``x`` reduced over the ranks in place (``"max"`` or ``"sum"``): an ``all_reduce`` if ``ranks > 1``."""
        if self.ranks > 1:
            red = torch.distributed.ReduceOp.MAX if op == _MAX else torch.distributed.ReduceOp.SUM
            torch.distributed.all_reduce(x, op=red, group=self.group)
        return x

    def lse(self, local: Tensor) -> Tensor:
        """The log-sum-exp over the ranks from each rank's ``[..., n]``: a ``MAX``, then a ``SUM`` of exponentials."""
        return local if self.ranks == 1 else _merge_lse(local, self.reduce)

    def combine(self, local: Tensor, glob: Tensor, value: Tensor) -> Tensor:
        """``sum_k w_k value_k`` with ``w_k = exp(local_k - glob)`` (0 where ``w_k = 0``): the per-rank parts."""
        return value if self.ranks == 1 else _merge_parts(local, glob, value, self.reduce)


WHOLE = Partition()


def _over_tiles(x: Tensor, op: str) -> Tensor:
    return x.amax(0) if op == _MAX else x.sum(0)


def _merge_lse(local: Tensor, reduce: Callable[[Tensor, str], Tensor] = _over_tiles) -> Tensor:
    """The log-sum-exp of parts' log-sum-exps: a max, then a sum of exponentials, either over the
    ranks (``reduce`` an ``all_reduce``) or over the first dim, vocabulary tiles (the default)."""
    m = reduce(local.clone(), _MAX)
    m = m.masked_fill_(m == _NINF, 0)  # a row that is -inf everywhere keeps lse = -inf, not NaN
    return reduce(torch.exp(local - m), _SUM).log_().add_(m)


def _merge_parts(local: Tensor, glob: Tensor, value: Tensor, reduce: Callable[[Tensor, str], Tensor] = _over_tiles) -> Tensor:
    """``sum_k w_k value_k`` with ``w_k = exp(local_k - glob)`` (0 where ``w_k = 0``), over ranks or tiles."""
    w = torch.exp(local - glob)
    return reduce(torch.where(w > 0, w * value, 0), _SUM)


class Source:
    """Rows of logits read by chunks: a ``[..., V]`` tensor in place, or ``hidden @ weight.T + bias``.

    A chunk of logits rows is a slice of the ``[n, V]`` view when the leading dims can be viewed as
    one, else it is gathered (``flat`` None: callers pass index tensors). From hidden states a chunk
    is always a fresh tensor, made in the head's dtype (as the model's own ``nn.Linear`` makes it).
    """

    def __init__(self, t: Tensors) -> None:
        self.x, self.weight, self.bias = t
        self.lead = self.x.shape[:-1]
        self.n = self.lead.numel()
        self.vocab = self.x.shape[-1] if self.weight is None else self.weight.shape[0]
        self.dtype, self.device = self.x.dtype, self.x.device
        self.flat: Optional[Tensor]
        if self.weight is not None:
            self.flat = self.x.reshape(-1, self.x.shape[-1])
        else:
            try:
                self.flat = self.x.view(-1, self.vocab)
            except RuntimeError:
                self.flat = None

    def rows(self, idx: slice | Tensor) -> Tensor:
        """Rows ``idx`` of the flat input (logits, or hidden states)."""
        assert self.flat is not None
        return self.flat[idx] if isinstance(idx, slice) else self.flat.index_select(0, idx)

    def tiles(self, rows: int, tiled: bool) -> list[slice]:
        """The vocabulary tiles of a chunk of ``rows`` rows: the whole vocabulary unless ``tiled`` and from a head."""
        if not tiled or self.weight is None:
            return [slice(0, self.vocab)]
        width = max(1, (HIDDEN_CPU_TILE_ELEMENTS if self.device.type == "cpu" else CUDA_CHUNK_ELEMENTS) // max(rows, 1))
        return [slice(c, min(c + width, self.vocab)) for c in range(0, self.vocab, width)]

    def read(self, idx: slice | Tensor, cols: slice = slice(None)) -> tuple[Tensor, bool]:
        """The logits of rows ``idx`` (columns ``cols`` of a head), and whether that is a fresh tensor (ours to overwrite)."""
        if self.weight is not None:
            return F.linear(self.rows(idx), self.weight[cols], None if self.bias is None else self.bias[cols]), True
        if self.flat is not None:
            return self.rows(idx), not isinstance(idx, slice)
        return self.x[torch.unravel_index(idx, self.lead)], True

    def scores(self, idx: slice | Tensor, dtype: torch.dtype, temperature: float, cols: slice = slice(None)) -> Tensor:
        """``z / T`` of rows ``idx`` in the compute dtype, always a fresh tensor (as ``generate`` divides)."""
        chunk, fresh = self.read(idx, cols)
        z = chunk.to(dtype)
        own = fresh or z is not chunk
        if temperature != 1.0:
            return z.div_(temperature) if own else z / temperature
        return z if own else z.clone()

    def chunk_rows(self, chunk_size: Optional[int], tiled: bool = False) -> int:
        """Rows per chunk: ``chunk_size``, or the device's default (the constants above)."""
        if chunk_size is not None:
            return chunk_size
        cpu = self.device.type == "cpu"
        if tiled and self.weight is not None:
            return HIDDEN_BLOCK_ROWS
        if self.weight is None:
            return max(1, (CPU_CHUNK_ELEMENTS if cpu else CUDA_CHUNK_ELEMENTS) // max(self.vocab, 1))
        return max(HIDDEN_MIN_CHUNK_ROWS, (HIDDEN_CPU_CHUNK_ELEMENTS if cpu else CUDA_CHUNK_ELEMENTS) // max(self.vocab, 1))


def _chunks(srcs: tuple[Source, ...], rows: int) -> list[tuple[slice, slice | Tensor]]:
    """The one chunk iterator: ``(output positions, row indices)`` per chunk, index tensors when a
    source cannot be viewed flat."""
    n = srcs[0].n
    pos = [slice(s, min(s + rows, n)) for s in range(0, n, rows)]
    if all(s.flat is not None for s in srcs):
        return [(p, p) for p in pos]
    every = torch.arange(n, device=srcs[0].device)
    return [(p, every[p]) for p in pos]


def _run(work: Callable[[tuple[slice, slice | Tensor], Any], None], srcs: tuple[Source, ...], rows: int, state: bool = False) -> None:
    if srcs[0].vocab > 0:  # an empty vocabulary shard has nothing to read
        run_chunks(work, _chunks(srcs, rows), srcs[0].device, make_state=dict if state else None)


def _scratch(state: dict[str, Tensor], shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A reusable contiguous ``[rows, cols]`` buffer (grown on demand; chunks after the first are no larger)."""
    buf = state.get("buf")
    if buf is None or buf.numel() < shape.numel():
        buf = state["buf"] = torch.empty(shape.numel(), dtype=dtype, device=device)
    return buf[: shape.numel()].view(shape)


class LogitsGrad:
    """The gradient of a ``[..., V]`` logits input, written chunk by chunk (each chunk its own rows)."""

    def __init__(self, src: Source) -> None:
        self.shape = src.x.shape
        self.grad = torch.empty((src.n, src.vocab), dtype=src.dtype, device=src.device)

    def direct(self, pos: slice, dtype: torch.dtype) -> Optional[Tensor]:
        """The rows a chunk's gradient can be computed in directly (same dtype), else None."""
        return self.grad[pos] if self.grad.dtype == dtype else None

    def put(self, pos: slice, idx: slice | Tensor, g: Tensor, cols: slice = slice(None)) -> None:
        dst = self.grad[pos]  # logits come by whole rows
        if dst.data_ptr() != g.data_ptr():
            dst.copy_(g)

    def result(self, part: Partition) -> tuple[Tensor, ...]:
        return (self.grad.view(self.shape),)


class HeadGrad:
    """The gradients of ``hidden``, ``weight`` and ``bias`` from chunks ``G`` of the logits' gradient.

    ``dh = G W`` row by row (summed over the ranks of a split vocabulary: the hidden states feed every
    shard); ``dW = G^T h`` and ``db = sum G`` add up over the chunks in the compute dtype (a ``[V, d]``
    buffer, float32 for half weights, so that each element is rounded once). Invalid rows' hidden
    states are zeroed for ``dW``: NaN there must stay out.
    """

    def __init__(self, src: Source, needs: tuple[bool, ...], dtype: torch.dtype, invalid: Optional[Tensor]) -> None:
        assert src.weight is not None and src.flat is not None
        self.src, self.dtype, self.invalid = src, dtype, invalid
        w = src.weight
        self.grad_h = torch.zeros(src.flat.shape, dtype=dtype, device=w.device) if needs[0] else None
        self.acc_w = torch.zeros(w.shape, dtype=dtype, device=w.device) if needs[1] else None
        self.acc_b = torch.zeros(w.shape[0], dtype=dtype, device=w.device) if needs[2] and src.bias is not None else None
        self.lock = threading.Lock()

    def direct(self, pos: slice, dtype: torch.dtype) -> Optional[Tensor]:
        return None

    def put(self, pos: slice, idx: slice | Tensor, g: Tensor, cols: slice = slice(None)) -> None:
        """Add a chunk's (or a vocabulary tile's: columns ``cols``) share of the three gradients."""
        w = self.src.weight
        assert w is not None
        if self.grad_h is not None:
            self.grad_h[pos] += torch.mm(g.to(w.dtype), w[cols])
        if self.acc_w is not None or self.acc_b is not None:
            h = self.src.rows(idx)
            if self.invalid is not None:
                h = h.masked_fill(self.invalid[pos].unsqueeze(1), 0)
            h = h.to(self.dtype)
            with self.lock:  # chunks run concurrently and all add to the same [V, d]
                if self.acc_w is not None:
                    torch.addmm(self.acc_w[cols], g.T, h, out=self.acc_w[cols])
                if self.acc_b is not None:
                    self.acc_b[cols] += g.sum(0)

    def result(self, part: Partition) -> tuple[Optional[Tensor], ...]:
        src, w = self.src, self.src.weight
        assert w is not None
        grad_h = None if self.grad_h is None else part.reduce(self.grad_h, _SUM).to(src.dtype).view(src.x.shape)
        grad_w = None if self.acc_w is None else self.acc_w.to(w.dtype)
        grad_b = None if self.acc_b is None else self.acc_b.to(w.dtype)
        return grad_h, grad_w, grad_b


def _writer(src: Source, needs: tuple[bool, ...], dtype: torch.dtype, invalid: Optional[Tensor]) -> Optional[LogitsGrad | HeadGrad]:
    """The gradient writer of a source, or None when none of its tensors needs a gradient."""
    if not any(needs[: 1 if src.weight is None else 3]):
        return None
    return LogitsGrad(src) if src.weight is None else HeadGrad(src, needs, dtype, invalid)


def _grads(writer: Optional[LogitsGrad | HeadGrad], part: Partition) -> tuple[Optional[Tensor], ...]:
    return (None, None, None) if writer is None else (*writer.result(part), None, None)[:3]


def _in_tile(col: Tensor, cols: slice) -> tuple[Tensor, Tensor]:
    """Which columns ``col [c, 1]`` lie in the tile ``cols``, and their column there (clamped into it, ``[c, 1]``)."""
    col = col.squeeze(1)
    return (col >= cols.start) & (col < cols.stop), (col - cols.start).clamp_(0, cols.stop - cols.start - 1).unsqueeze(1)


def _zero_invalid(g: Tensor, invalid: Optional[Tensor], pos: slice) -> Tensor:
    """Invalid rows' gradient exactly 0 (their scale is 0, but 0 * NaN is NaN where their logits are NaN)."""
    return g if invalid is None else g.masked_fill_(invalid[pos].unsqueeze(1), 0)


# ---------------------------------------------------------------------------------------------
# the token log-prob


def token_logprobs_kernel(
    src: Tensors,
    ids: Tensor,
    ignored: Optional[Tensor],
    sampling: Sampling,
    part: Partition = WHOLE,
    chunk_size: Optional[int] = None,
    kept_from: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probs of ``ids [n]`` (int64; in ``[0, V)`` for the whole vocabulary, global ids on a split)
    under the processed distribution of a checked source, with the kept log-mass and the outside flags.

    ``kept_from`` (logits ``[..., V]`` of another model, no gradient) chooses the kept set instead of
    ``src``. Returns ``(logprobs, log_kept, outside)``, each ``[...]``: ``logprobs`` differentiable
    (``-inf`` with zero gradient where the token is outside the kept set), ``log_kept`` without grad
    (0 without truncation), ``outside`` bool. Ignored tokens: 0, 0, False, zero gradient. On a split
    vocabulary each id must be owned by exactly one rank (checked, without a host read off the CPU).
    """
    return _LogProb.apply(*src, kept_from, ids, ignored, sampling, part, chunk_size)


class _LogProb(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        kept_from: Optional[Tensor],
        ids: Tensor,
        ignored: Optional[Tensor],
        sampling: Sampling,
        part: Partition,
        chunk_size: Optional[int],
    ) -> tuple[Tensor, Tensor, Tensor]:
        src = Source(Tensors(x, weight, bias))
        support = None if kept_from is None else Source(Tensors(kept_from))
        srcs = (src,) if support is None else (src, support)
        n, dtype, device, temp = src.n, compute_dtype(x), x.device, sampling.temperature
        truncated = sampling.truncates or support is not None
        rows = src.chunk_rows(chunk_size, tiled=not truncated)
        col = ids - part.offset
        owned = (col >= 0) & (col < src.vocab)
        if ignored is not None:
            owned &= ~ignored
        col = col.clamp_(0, max(src.vocab - 1, 0)).unsqueeze(1)
        # per row: the (kept) local log-sum-exp, the target's score, the whole local log-sum-exp
        stats = torch.zeros((3, n), dtype=dtype, device=device)
        stats[0].fill_(_NINF)
        outside = torch.zeros(n, dtype=torch.bool, device=device)
        threshold = torch.zeros(n if truncated else 0, dtype=dtype, device=device)

        def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
            pos, idx = item
            if not truncated:
                tiles = src.tiles(pos.stop - pos.start, True)
                part_lse = torch.empty((len(tiles), pos.stop - pos.start), dtype=dtype, device=device)
                for k, cols in enumerate(tiles):
                    chunk, fresh = src.read(idx, cols)
                    # each id lies in one tile, which gives its score; the others add 0
                    here, c = _in_tile(col[pos], cols)
                    stats[1, pos] += torch.where(here, chunk.gather(1, c).squeeze(1).to(dtype) / temp, 0)
                    # lse(z / T) = m / T + log sum exp((z - m) / T): the max is exact in the input dtype,
                    # and one op reads the half chunk and writes the float32 differences into scratch
                    # (or into the chunk itself when it is a fresh one of the compute dtype: a head's)
                    m = chunk.amax(dim=-1, keepdim=True).to(dtype)
                    own = fresh and chunk.dtype == dtype
                    e = torch.sub(chunk, m, out=chunk if own else _scratch(state, chunk.shape, dtype, device))
                    if temp != 1.0:
                        e.div_(temp)
                    part_lse[k] = e.exp_().sum(dim=-1).log_().add_(m.squeeze(1) / temp)
                    del chunk, e  # freed before the next tile's matmul
                stats[0, pos] = part_lse[0] if len(tiles) == 1 else _merge_lse(part_lse)
                return
            z = src.scores(idx, dtype, temp)
            removed = process_scores(z if support is None else support.scores(idx, dtype, temp), sampling) == _NINF
            stats[2, pos] = torch.logsumexp(z, dim=-1)
            stats[1, pos] = z.gather(1, col[pos]).squeeze(1)
            outside[pos] = removed.gather(1, col[pos]).squeeze(1)
            # the kept set as a threshold on the scores, for the backward (top-k and min-p keep upper sets)
            threshold[pos] = torch.where(removed, float("inf"), z).amin(dim=-1)
            stats[0, pos] = torch.logsumexp(z.masked_fill_(removed, _NINF), dim=-1)

        _run(work, srcs, rows, state=True)
        zy = torch.where(owned, stats[1], 0)
        if part.split:
            if ignored is not None:
                stats[0].masked_fill_(ignored, 0)  # NaN logits of ignored rows stay out of the group's max
            lse = part.lse(stats[0])
            packed = part.reduce(torch.stack([zy, owned.to(dtype)]), _SUM)
            zy, owners = packed[0], packed[1] if ignored is None else packed[1].masked_fill(ignored, 1)
            unowned = owners != 1
            check_values(
                unowned,
                lambda: ValueError(
                    f"token id {int(ids[unowned][0])} is owned by {int(owners[unowned][0])} vocabulary shards, not 1: ids "
                    "must lie in [0, V) of the split vocabulary (or be `ignore_index`), and the shards' offsets must tile it."
                ),
                "every token id must be owned by exactly one vocabulary shard: ids in [0, V) (or ignore_index), shards that tile [0, V)",
            )
        else:
            lse = stats[0]
        out = zy - lse
        log_kept = (lse - stats[2]) if truncated else torch.zeros_like(out)
        if ignored is not None:
            out.masked_fill_(ignored, 0)
            log_kept.masked_fill_(ignored, 0)
            outside.masked_fill_(ignored, False)
        out.masked_fill_(outside, _NINF)
        ctx.save_for_backward(x, weight, bias, kept_from)
        ctx.saved = (col, owned, ignored, outside, lse, threshold)
        ctx.sampling, ctx.part, ctx.rows, ctx.truncated = sampling, part, rows, truncated
        lead = src.lead
        log_kept, outside = log_kept.view(lead), outside.view(lead)
        ctx.mark_non_differentiable(log_kept, outside)
        return out.view(lead), log_kept, outside

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor, _g_kept: Any, _g_outside: Any) -> tuple[Optional[Tensor], ...]:
        x, weight, bias, kept_from = ctx.saved_tensors
        col, owned, ignored, outside, lse, threshold = ctx.saved
        sampling, part = ctx.sampling, ctx.part
        src = Source(Tensors(x, weight, bias))
        support = None if kept_from is None else Source(Tensors(kept_from))
        dtype, temp = lse.dtype, sampling.temperature
        # s = dL/d(log-prob) / T: dl/dz_i = s ([i = y] - [i in K] p~_i); 0 on ignored tokens and on
        # tokens outside the kept set (their value is -inf whatever the logits: a constant)
        s = (grad_out.reshape(-1).to(dtype) / temp).masked_fill(outside, 0)
        if ignored is not None:
            s = s.masked_fill(ignored, 0)
        hit, s, lse_t = torch.where(owned, s, 0).unsqueeze(1), s.unsqueeze(1), (lse * temp).unsqueeze(1)
        writer = _writer(src, ctx.needs_input_grad[:3], dtype, ignored)
        # top-p splits tied scores at its boundary, and another model's kept set is no threshold on
        # these scores: the processing runs again there (the same ops on the same numbers)
        redo = sampling.top_p is not None or support is not None

        def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
            pos, idx = item
            assert writer is not None
            for cols in src.tiles(pos.stop - pos.start, not ctx.truncated):
                if not ctx.truncated:
                    chunk, fresh = src.read(idx, cols)
                    # p = exp(z / T - lse) = exp((z - T lse) / T), computed in the gradient itself when it
                    # has the compute dtype (or in a fresh chunk of it), else in a scratch buffer
                    p = writer.direct(pos, dtype)
                    if p is None:
                        p = chunk if fresh and chunk.dtype == dtype else _scratch(state, chunk.shape, dtype, src.device)
                    p = torch.sub(chunk, lse_t[pos], out=p)
                    del chunk
                    if temp != 1.0:
                        p.div_(temp)
                else:
                    p = src.scores(idx, dtype, temp)
                    if redo:
                        p.masked_fill_(process_scores(p if support is None else support.scores(idx, dtype, temp), sampling) == _NINF, _NINF)
                    else:
                        p.masked_fill_(p < threshold[pos].unsqueeze(1), _NINF)
                    p.sub_(lse[pos].unsqueeze(1))
                here, c = _in_tile(col[pos], cols)
                g = p.exp_().mul_(s[pos].neg()).scatter_add_(1, c, torch.where(here.unsqueeze(1), hit[pos], 0))
                writer.put(pos, idx, _zero_invalid(g, ignored, pos), cols)
                del p, g

        if writer is not None:
            _run(work, (src,), ctx.rows, state=True)
        return (*_grads(writer, part), None, None, None, None, None, None)


# ---------------------------------------------------------------------------------------------
# the exact KL to a second source


def full_kl_kernel(
    src: Tensors,
    ref: Tensors,
    invalid: Optional[Tensor],
    sampling: Sampling,
    reference: str = "unprocessed",
    part: Partition = WHOLE,
    chunk_size: Optional[int] = None,
) -> Tensor:
    r"""Per-token :math:`\mathrm{KL}(\tilde p \,\|\, q)` ``[...]`` of two checked sources (one partition).

    ``invalid`` is None or ``[n]`` bool (masked rows: value 0, gradient exactly 0). :math:`\tilde p`
    is the policy's processed distribution; :math:`q` (``reference``, at the same temperature):
    ``"unprocessed"`` the reference's softmax, ``"processed"`` its own processed distribution (``+inf``
    where the policy keeps a token it removes; a backward through such a token raises),
    ``"policy_kept"`` its softmax renormalized on the policy's kept set. Without truncation the three
    are the plain KL of the two softmaxes. An entry with :math:`\tilde p_i = 0` adds nothing
    (:math:`0 \log 0 = 0`).
    """
    return _FullKL.apply(*src, *ref, invalid, sampling, reference, part, chunk_size)


def _log_pair(
    src: Source, ref: Source, idx: slice | Tensor, dtype: torch.dtype, sampling: Sampling, reference: str, lse: Optional[Tensor], cols: slice,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A chunk's (or tile's) ``log p~``, ``log q`` (``-inf`` off each support) and the log-sum-exps used:
    the chunk's own when ``lse`` (``[2, c]``) is None, else the global ones given (tiles, a split)."""
    z, zr = src.scores(idx, dtype, sampling.temperature, cols), ref.scores(idx, dtype, sampling.temperature, cols)
    if sampling.truncates:
        z = process_scores(z, sampling)
        if reference == "processed":
            zr = process_scores(zr, sampling)
        elif reference == "policy_kept":
            zr = zr.masked_fill_(z == _NINF, _NINF)
    if lse is None:  # log_softmax: z - max - log sum, more precise than z - lse in float32
        return torch.log_softmax(z, dim=-1), torch.log_softmax(zr, dim=-1), torch.logsumexp(z, dim=-1), torch.logsumexp(zr, dim=-1)
    return z.sub_(lse[0].unsqueeze(1)), zr.sub_(lse[1].unsqueeze(1)), lse[0], lse[1]


class _FullKL(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        rx: Tensor,
        rweight: Optional[Tensor],
        rbias: Optional[Tensor],
        invalid: Optional[Tensor],
        sampling: Sampling,
        reference: str,
        part: Partition,
        chunk_size: Optional[int],
    ) -> Tensor:
        src, ref = Source(Tensors(x, weight, bias)), Source(Tensors(rx, rweight, rbias))
        dtype = compute_dtype(x, rx)
        tiled = not sampling.truncates and weight is not None and rweight is not None  # two heads: tiles of both
        rows = src.chunk_rows(chunk_size, tiled)
        # per row: the policy's and the reference's local log-sum-exps, the local KL
        stats = torch.zeros((3, src.n), dtype=dtype, device=src.device)
        stats[:2].fill_(_NINF)

        def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
            pos, idx = item
            tiles = src.tiles(pos.stop - pos.start, tiled)
            parts = torch.empty((len(tiles), 3, pos.stop - pos.start), dtype=dtype, device=src.device)
            for k, cols in enumerate(tiles):
                logp, logq, parts[k, 0], parts[k, 1] = _log_pair(src, ref, idx, dtype, sampling, reference, None, cols)
                p = logp.exp()
                # 0 log 0 = 0 off the policy's support; p > 0 = q gives +inf
                parts[k, 2] = torch.sub(logp, logq, out=logq).mul_(p).masked_fill_(p == 0, 0).sum(-1)
                del logp, logq, p
            many = len(tiles) > 1  # the tiles combine as the ranks do (see Partition)
            stats[:2, pos] = lse = _merge_lse(parts[:, :2]) if many else parts[0, :2]
            kl = parts[:, 2] + (parts[:, 0] - lse[0]) - (parts[:, 1] - lse[1]) if many else parts[0, 2]
            stats[2, pos] = _merge_parts(parts[:, 0], lse[0], kl) if many else kl

        _run(work, (src, ref), rows)
        local = stats[:2] if invalid is None else stats[:2].masked_fill(invalid, 0)  # NaN padding stays out
        lse = part.lse(local)
        kl = part.combine(local[0], lse[0], stats[2] + (local[0] - lse[0]) - (local[1] - lse[1]))
        if invalid is not None:
            kl = kl.masked_fill(invalid, 0)
        ctx.save_for_backward(x, weight, bias, rx, rweight, rbias)
        ctx.saved = (invalid, lse, kl)
        ctx.sampling, ctx.reference, ctx.part, ctx.rows, ctx.tiled = sampling, reference, part, rows, tiled
        return kl.view(src.lead)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight, bias, rx, rweight, rbias = ctx.saved_tensors
        invalid, lse, kl = ctx.saved
        sampling, reference = ctx.sampling, ctx.reference
        src, ref = Source(Tensors(x, weight, bias)), Source(Tensors(rx, rweight, rbias))
        dtype = lse.dtype
        g_out = grad_out.reshape(-1).to(dtype)
        if invalid is not None:
            g_out = g_out.masked_fill(invalid, 0)
        infinite = (kl == float("inf")) & (g_out != 0)
        why = (
            "(the policy keeps a token that the reference's processing removes): its gradient does not exist. "
            "Use reference='policy_kept' or 'unprocessed' to regularize, or mask those tokens"
        )
        check_values(
            infinite,
            lambda: ValueError(f"the KL against the reference's own processed distribution is +inf at {int(infinite.sum())} token(s) {why}."),
            f"the KL against the reference's own processed distribution is +inf {why}",
        )
        scale = (g_out / sampling.temperature).unsqueeze(1)
        infinite_rows = (kl == float("inf")).unsqueeze(1)  # their scale is 0 here, but 0 * inf is NaN
        finite_kl = kl.masked_fill(infinite_rows.squeeze(1), 0).unsqueeze(1)
        needs = ctx.needs_input_grad
        w_z, w_ref = _writer(src, needs[:3], dtype, invalid), _writer(ref, needs[3:6], dtype, invalid)

        def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
            pos, idx = item
            given = lse[:, pos] if ctx.part.split or ctx.tiled else None
            for cols in src.tiles(pos.stop - pos.start, ctx.tiled):
                logp, logq, _, _ = _log_pair(src, ref, idx, dtype, sampling, reference, given, cols)
                p = logp.exp()
                if w_ref is not None:
                    w_ref.put(pos, idx, _zero_invalid(logq.exp().sub_(p).mul_(scale[pos]), invalid, pos), cols)  # (q - p) / T
                if w_z is not None:
                    g = logp.sub_(logq).sub_(finite_kl[pos]).mul_(p).masked_fill_(p == 0, 0)
                    g = g.masked_fill_(infinite_rows[pos], 0).mul_(scale[pos])
                    w_z.put(pos, idx, _zero_invalid(g, invalid, pos), cols)
                del logp, logq, p

        if w_z is not None or w_ref is not None:
            _run(work, (src, ref), ctx.rows)
        return (*_grads(w_z, ctx.part), *_grads(w_ref, ctx.part), None, None, None, None, None)


# ---------------------------------------------------------------------------------------------
# the token entropy


def entropy_kernel(
    src: Tensors, invalid: Optional[Tensor], sampling: Sampling, part: Partition = WHOLE, chunk_size: Optional[int] = None
) -> Tensor:
    r"""Per-token entropy :math:`H = -\sum_i \tilde p_i \log \tilde p_i` ``[...]`` of the processed
    distribution of a checked source (``invalid``: None or ``[n]`` bool, value 0 and gradient 0 there)."""
    return _Entropy.apply(*src, invalid, sampling, part, chunk_size)


def _log_probs(
    src: Source, idx: slice | Tensor, dtype: torch.dtype, sampling: Sampling, lse: Optional[Tensor], cols: slice
) -> tuple[Tensor, Tensor]:
    """A chunk's (or tile's) processed ``log p~`` and the log-sum-exp used (the chunk's own when ``lse`` is None)."""
    z = src.scores(idx, dtype, sampling.temperature, cols)
    if sampling.truncates:
        z = process_scores(z, sampling)
    if lse is None:  # as in _log_pair
        return torch.log_softmax(z, dim=-1), torch.logsumexp(z, dim=-1)
    return z.sub_(lse.unsqueeze(1)), lse


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        invalid: Optional[Tensor],
        sampling: Sampling,
        part: Partition,
        chunk_size: Optional[int],
    ) -> Tensor:
        src = Source(Tensors(x, weight, bias))
        tiled = not sampling.truncates and weight is not None
        dtype, rows = compute_dtype(x), src.chunk_rows(chunk_size, tiled)
        stats = torch.zeros((2, src.n), dtype=dtype, device=src.device)  # local lse, local entropy
        stats[0].fill_(_NINF)

        def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
            pos, idx = item
            tiles = src.tiles(pos.stop - pos.start, tiled)
            parts = torch.empty((len(tiles), 2, pos.stop - pos.start), dtype=dtype, device=src.device)
            for k, cols in enumerate(tiles):
                logp, parts[k, 0] = _log_probs(src, idx, dtype, sampling, None, cols)
                parts[k, 1] = logp.exp().mul_(logp).masked_fill_(logp == _NINF, 0).sum(-1).neg_()
                del logp
            many = len(tiles) > 1  # the tiles combine as the ranks do (see Partition)
            stats[0, pos] = lse = _merge_lse(parts[:, 0]) if many else parts[0, 0]
            stats[1, pos] = _merge_parts(parts[:, 0], lse, parts[:, 1] + lse - parts[:, 0]) if many else parts[0, 1]

        _run(work, (src,), rows)
        local = stats[0] if invalid is None else stats[0].masked_fill(invalid, 0)
        lse = part.lse(local)
        ent = part.combine(local, lse, stats[1] + lse - local)
        if invalid is not None:
            ent = ent.masked_fill(invalid, 0)
        ctx.save_for_backward(x, weight, bias)
        ctx.saved = (invalid, lse, ent)
        ctx.sampling, ctx.part, ctx.rows, ctx.tiled = sampling, part, rows, tiled
        return ent.view(src.lead)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight, bias = ctx.saved_tensors
        invalid, lse, ent = ctx.saved
        src, dtype = Source(Tensors(x, weight, bias)), lse.dtype
        g_out = grad_out.reshape(-1).to(dtype)
        if invalid is not None:
            g_out = g_out.masked_fill(invalid, 0)
        scale, ent = (g_out / ctx.sampling.temperature).neg_().unsqueeze(1), ent.unsqueeze(1)
        writer = _writer(src, ctx.needs_input_grad[:3], dtype, invalid)

        def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
            pos, idx = item
            assert writer is not None
            for cols in src.tiles(pos.stop - pos.start, ctx.tiled):
                logp, _ = _log_probs(src, idx, dtype, ctx.sampling, lse[pos] if ctx.part.split or ctx.tiled else None, cols)
                p = logp.exp()
                g = logp.add_(ent[pos]).mul_(p).masked_fill_(p == 0, 0).mul_(scale[pos])  # -p (log p + H) / T
                writer.put(pos, idx, _zero_invalid(g, invalid, pos), cols)
                del logp, p, g

        if writer is not None:
            _run(work, (src,), ctx.rows)
        return (*_grads(writer, ctx.part), None, None, None, None)
