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
  top-p and min-p as ``generate`` applies them (:func:`~lightning_kl.ground.sampler.process_scores`),
  removed entries ``-inf``: the processed distribution :math:`\tilde p` on its kept set :math:`K`;
* a **quantity**: the row quantities, token log-prob and entropy (either or both from one read,
  :class:`_Rows`), or the exact KL to a second source (:class:`_FullKL`), or another divergence to it
  (forward, TRL's generalized JSD, a mix: an option of the same :class:`_FullKL`,
  :mod:`lightning_kl.kernels.divergence`).

**Exact at every temperature.** Nothing large is subtracted after the division by :math:`T`. Per row
(or per part of a row: a tile, a rank's shard), with :math:`m` the largest kept logit (exact in the
input dtype), the shifted scores and the log-sum

.. math::
    e_i = \frac{z_i - m}{T} \le 0, \qquad c = \log \sum_{i \in K} e^{e_i} \ge 0, \qquad
    \log \tilde p_i = e_i - c, \qquad H = c + A, \quad A = -\sum_{i \in K} \tilde p_i e_i \ge 0

(the entropy is a sum of two non-negative terms: it does not cancel, and a near tie at
:math:`T = 10^{-3}` keeps its digits). The log-sum-exp :math:`m / T + c` is never formed. With the
gradient :math:`g` coming in per row and :math:`u_i = e^{e_i}`, :math:`S = e^c`, the backward w.r.t.
the logits is, on the kept set (0 elsewhere; the kept set is a selection and does not move under a
small change):

.. math::
    \frac{\partial \log \tilde p_y}{\partial z_i} = \frac{[i = y] - u_i / S}{T}, \qquad
    \frac{\partial H}{\partial z_i} = -\frac{u_i (e_i + A)}{S\,T}, \qquad
    \frac{\partial\,\mathrm{KL}}{\partial z_i} = \frac{\tilde p_i (\log \tilde p_i - \log q_i - \mathrm{KL})}{T}, \qquad
    \frac{\partial\,\mathrm{KL}}{\partial z^{\mathrm{ref}}_i} = \frac{q_i - \tilde p_i}{T},

each from the saved :math:`(m, c)`, the same forms as the forward's. The KL is
:math:`\sum_i \tilde p_i (e^p_i - e^q_i) + (c_q - c_p)`.

Parts (tiles of a head's vocabulary, ranks of a split one) merge as pairs :math:`(m_k, c_k)`
(:func:`_merge`): :math:`m = \max_k m_k` (a ``MAX`` over the ranks), :math:`d_k = (m_k - m)/T \le 0`,
:math:`c = \log \sum_k e^{d_k + c_k}` (a ``SUM``), the parts' weights
:math:`w_k = e^{d_k + c_k - c}`; then :math:`A = \sum_k w_k (A_k - d_k)` and
:math:`\mathrm{KL} = \sum_k w^p_k (\mathrm{kl}_k + \log w^p_k - \log w^q_k)`, where :math:`A_k` and
:math:`\mathrm{kl}_k` are those of the part's own renormalized columns: ``O(n)`` numbers from the
calling thread, collectives only when the group has more than one rank. The backward needs no
collective (the global :math:`(m, c)` are saved) except the sum of the hidden states' gradient over
the group. The sampler's truncation needs whole rows: the entry points refuse it on a split vocabulary.

**Fused reads of whole rows.** torch's ``log_softmax`` forms :math:`(x_i - \max x) - \log S` per row
and ``softmax`` :math:`e^{x_i - \max x} / S`, each from one read of a row that stays in cache, with the
fastest ``exp`` torch has on the CPU. Given the shifted scores (:math:`\max e = 0`), ``log_softmax``
returns :math:`e_i - c` bitwise, and :math:`c` is minus its largest entry, exactly: the row quantities
take :math:`c` that way (per tile too), and the full KL between whole rows of one partition, with no
sampler, is :math:`\sum_i \tilde p_i (\log \tilde p_i - \log q_i)` of both models' ``log_softmax``, formed
again bitwise in backward. The backward of the row quantities over whole rows of one partition takes
:math:`u_i / S` from ``softmax``. At :math:`T = 1` without the entropy the logits themselves (a float32
copy of half ones) are read, the same bits. Masks over ``[c, V]`` are avoided: a comparison into bool is a scalar
loop on the CPU (8 to 20 times an arithmetic pass): a :math:`0 \cdot \infty` of a token off the support
(:math:`0 \log 0 = 0`) is a NaN that ``nan_to_num`` (or, on the CPU, a second sum of only the rows
whose sum is NaN) makes 0, NaN inputs reaching the row through another term; masked rows are zeroed by
index on the CPU.

The forward keeps ``O(n)`` numbers per row (log-sum-exps, the value); the backward reads each chunk
again and writes that chunk of the gradient once, through one writer for logits
(:class:`LogitsGrad`) and one for a head (:class:`HeadGrad`). Every row is computed, on every device:
invalid rows (masked, or an ignored token) get value 0 and exactly zero gradient, NaN logits or
hidden states there included, and nothing is read on the host per call off the CPU (on the CPU a
chunk's rows needing a second look are found by a host read).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_kl.ground.checks import check_values, compute_dtype, host_reads
from lightning_kl.ground.chunks import run_chunks
from lightning_kl.ground.kept import KeptSets
from lightning_kl.ground.sampler import Sampling, process_scores
from lightning_kl.kernels.divergence import check_divergence, kl_weights

__all__ = [
    "CPU_CHUNK_ELEMENTS",
    "CUDA_CHUNK_ELEMENTS",
    "HIDDEN_BLOCK_ROWS",
    "HIDDEN_CPU_CHUNK_ELEMENTS",
    "HIDDEN_CPU_TILE_ELEMENTS",
    "HIDDEN_MIN_CHUNK_ROWS",
    "PLAIN",
    "REFERENCES",
    "WHOLE",
    "Head",
    "Partition",
    "Source",
    "Tensors",
    "entropy_kernel",
    "full_kl_kernel",
    "token_logprobs_entropy_kernel",
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
# on CPU (16 MiB in float32), 2^25 on GPU: the head is read once per block. The full KL reads two models' logits per chunk: its
# CPU chunks hold half the elements (the same bytes in cache: in one A/B run at [1024, 32768] float32, 2^19 matched
# 452e35a's time and 2^20 took about 1.1x it).
CPU_CHUNK_ELEMENTS = 2**20
CUDA_CHUNK_ELEMENTS = 2**25
HIDDEN_CPU_CHUNK_ELEMENTS = 2**23
HIDDEN_MIN_CHUNK_ROWS = 16
HIDDEN_BLOCK_ROWS = 4096
HIDDEN_CPU_TILE_ELEMENTS = 2**22

#: The references a processed policy's KL can be taken against (see :func:`full_kl_kernel`).
REFERENCES = ("unprocessed", "processed", "policy_kept")

_NINF = float("-inf")
_INF = float("inf")
_MAX, _SUM = "max", "sum"


@dataclass(frozen=True)
class Head:
    r"""What a head does after its matmul :math:`a = h W^T + b`: the logits
    :math:`z = c \tanh(s a / c)` with the logit scale :math:`s` and the soft cap :math:`c` (Gemma 2/3's
    ``final_logit_softcapping``), or :math:`z = s a` without a cap (Cohere's ``logit_scale``).
    Checked by the entry points (:class:`~lightning_kl.FromHidden`): ``scale`` finite > 0, ``softcap``
    None or finite > 0."""

    scale: float = 1.0
    softcap: Optional[float] = None

    @property
    def plain(self) -> bool:
        """Whether the logits are the matmul itself."""
        return self.scale == 1.0 and self.softcap is None


#: The head of a plain ``nn.Linear``: :math:`z = a`.
PLAIN = Head()


class Tensors(NamedTuple):
    """A row source's tensors: logits ``x [..., V]`` (``weight`` None), or hidden states ``x [..., d]``
    with the head ``weight [V, d]``, ``bias [V]`` or None, and what the head does after its matmul."""

    x: Tensor
    weight: Optional[Tensor] = None
    bias: Optional[Tensor] = None
    head: Head = PLAIN


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

    def merge(self, m: Tensor, c: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The whole vocabulary's shift and log-sum from this rank's (:func:`_merge` over the ranks: a ``MAX``, then a ``SUM``)."""
        return _merge(m, c, temperature, self.reduce)

    def combine(self, lw: Tensor, value: Tensor) -> Tensor:
        """``sum_k w_k value_k`` over the ranks, with ``w_k = exp(lw_k)`` (0 where ``w_k = 0``)."""
        return _weighted(lw, value, self.reduce)


WHOLE = Partition()


def _over_tiles(x: Tensor, op: str) -> Tensor:
    return x.amax(0) if op == _MAX else x.sum(0)


def _finite(m: Tensor) -> Tensor:
    """A shift usable in a subtraction: 0 where the max is ``-inf`` (a row without mass stays ``-inf``, not NaN)."""
    return m.masked_fill(m == _NINF, 0)


def _merge(m: Tensor, c: Tensor, temperature: float, reduce: Callable[[Tensor, str], Tensor] = _over_tiles) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""Parts of a vocabulary (tiles, or ranks) merged: each part's log-sum-exp is :math:`m_k / T + c_k`,
    with :math:`m_k` its largest logit and :math:`c_k \ge 0` (``-inf`` for a part without mass).

    Returns :math:`m = \max_k m_k`, :math:`c = \log \sum_k e^{d_k + c_k}` with
    :math:`d_k = (m_k - m) / T \le 0`, the :math:`d_k` and the parts' log-weights
    :math:`\log w_k = d_k + c_k - c` (their shares of the mass). Nothing large is subtracted: the
    shifts are differences of logits before the division. ``reduce`` reduces over the first dim
    (tiles, the default) or over the ranks (an ``all_reduce``).
    """
    top = reduce(m.clone(), _MAX)
    d = m - _finite(top)
    if temperature != 1.0:
        d = d / temperature
    t = d + c
    total = reduce(torch.exp(t), _SUM).log_()
    return top, total, d, t - total


def _weighted(lw: Tensor, value: Tensor, reduce: Callable[[Tensor, str], Tensor] = _over_tiles) -> Tensor:
    """``sum_k w_k value_k`` with ``w_k = exp(lw_k)`` (0 where ``w_k = 0``), over tiles or ranks."""
    w = torch.exp(lw)
    return reduce(torch.where(w > 0, w * value, 0), _SUM)


class Source:
    r"""Rows of logits read by chunks: a ``[..., V]`` tensor in place, or ``hidden @ weight.T + bias``.

    A chunk of logits rows is a slice of the ``[n, V]`` view when the leading dims can be viewed as
    one, else it is gathered (``flat`` None: callers pass index tensors). From hidden states a chunk
    is always a fresh tensor, made in the head's dtype (as the model's own ``nn.Linear`` makes it);
    a head with a logit scale or a soft cap (:class:`Head`) applies them to that matmul in the compute
    dtype, at least float32. Its gradient's chain rule needs :math:`dz/da = s\,\mathrm{sech}^2(s a / c)`
    per logit: when a :class:`HeadGrad` asks (:meth:`keep_slopes`), each read in backward keeps that
    chunk's factor, computed from the pre-activation (no cancellation near the cap), for the
    :meth:`slope` that follows it (one chunk's worth per thread, never ``[n, V]``).
    """

    def __init__(self, t: Tensors) -> None:
        self.x, self.weight, self.bias, self.head = t
        self.slopes: Optional[threading.local] = None
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
            a = F.linear(self.rows(idx), self.weight[cols], None if self.bias is None else self.bias[cols])
            return (a if self.head.plain else self._transform(a, idx, cols)), True
        if self.flat is not None:
            return self.rows(idx), not isinstance(idx, slice)
        return self.x[torch.unravel_index(idx, self.lead)], True

    def _transform(self, a: Tensor, idx: slice | Tensor, cols: slice) -> Tensor:
        """The head's logits from its matmul ``a`` (fresh), in the compute dtype; keeps ``dz/da`` if asked."""
        scale, cap = self.head.scale, self.head.softcap
        u = a.to(torch.promote_types(a.dtype, torch.float32))  # a itself when it has that dtype: ours
        if scale != 1.0:
            u.mul_(scale)
        if cap is None:
            return u
        u.div_(cap)  # u = s a / c, as the models divide
        if self.slopes is not None:
            # dz/da = s sech^2(u), from u: 1 - tanh^2 would cancel near the cap (cosh -> inf gives 0)
            self.slopes.last = (idx, cols, torch.cosh(u).reciprocal_().square_().mul_(scale))
        return u.tanh_().mul_(cap)

    def keep_slopes(self) -> None:
        """Keep each read's ``dz/da`` for :meth:`slope` (a head with a soft cap, in backward)."""
        if self.head.softcap is not None and self.slopes is None:
            self.slopes = threading.local()

    def slope(self, idx: slice | Tensor, cols: slice) -> Tensor:
        """``dz/da`` of rows ``idx``, columns ``cols`` of a soft-capped head: the one kept by the read of
        that chunk, else made again from the pre-activation (one more matmul)."""
        last = getattr(self.slopes, "last", None)
        if last is not None:
            self.slopes.last = None  # type: ignore[union-attr]
            if _same(last[0], idx) and _same(last[1], cols):
                return last[2]
        assert self.weight is not None and self.head.softcap is not None
        a = F.linear(self.rows(idx), self.weight[cols], None if self.bias is None else self.bias[cols])
        u = a.to(torch.promote_types(a.dtype, torch.float32)).mul_(self.head.scale).div_(self.head.softcap)
        return torch.cosh(u).reciprocal_().square_().mul_(self.head.scale)

    def scores(self, idx: slice | Tensor, dtype: torch.dtype, temperature: float, cols: slice = slice(None)) -> Tensor:
        """``z / T`` of rows ``idx`` in the compute dtype, always a fresh tensor (as ``generate`` divides)."""
        chunk, fresh = self.read(idx, cols)
        z = chunk.to(dtype)
        own = fresh or z is not chunk
        if temperature != 1.0:
            return z.div_(temperature) if own else z / temperature
        return z if own else z.clone()

    def chunk_rows(self, chunk_size: Optional[int], tiled: bool = False, models: int = 1) -> int:
        """Rows per chunk: ``chunk_size``, or the device's default (the constants above); logits of
        ``models`` models read together share one CPU chunk's elements (the same bytes in cache)."""
        if chunk_size is not None:
            return chunk_size
        cpu = self.device.type == "cpu"
        if tiled and self.weight is not None:
            return HIDDEN_BLOCK_ROWS
        if self.weight is None:
            return max(1, (CPU_CHUNK_ELEMENTS // models if cpu else CUDA_CHUNK_ELEMENTS) // max(self.vocab, 1))
        return max(HIDDEN_MIN_CHUNK_ROWS, (HIDDEN_CPU_CHUNK_ELEMENTS if cpu else CUDA_CHUNK_ELEMENTS) // max(self.vocab, 1))


def _same(a: slice | Tensor, b: slice | Tensor) -> bool:
    """Whether two row (or column) selections are the same: equal slices, or one index tensor."""
    return a is b or (isinstance(a, slice) and isinstance(b, slice) and a == b)


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


def _scratch(state: dict[str, Tensor], shape: torch.Size, dtype: torch.dtype, device: torch.device, key: str = "buf") -> Tensor:
    """A reusable contiguous ``[rows, cols]`` buffer named ``key`` (grown on demand; chunks after the first are no larger)."""
    buf = state.get(key)
    if buf is None or buf.numel() < shape.numel():
        buf = state[key] = torch.empty(shape.numel(), dtype=dtype, device=device)
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

    ``G`` is first taken through the head's logit scale and soft cap (:class:`Head`):
    ``dL/da = G * s`` without a cap, ``G * s sech^2(s a / c)`` with one (the factor from
    :meth:`Source.slope`, chunk by chunk). Then ``dh = G W`` row by row (summed over the ranks of a split
    vocabulary: the hidden states feed every shard); ``dW = G^T h`` and ``db = sum G`` add up over the
    chunks in the compute dtype (a ``[V, d]`` buffer, float32 for half weights, so that each element
    is rounded once). Invalid rows' hidden states are zeroed for ``dW``: NaN there must stay out.
    """

    def __init__(self, src: Source, needs: tuple[bool, ...], dtype: torch.dtype, invalid: Optional[Tensor]) -> None:
        assert src.weight is not None and src.flat is not None
        self.src, self.dtype, self.invalid = src, dtype, invalid
        w = src.weight
        self.grad_h = torch.zeros(src.flat.shape, dtype=dtype, device=w.device) if needs[0] else None
        self.acc_w = torch.zeros(w.shape, dtype=dtype, device=w.device) if needs[1] else None
        self.acc_b = torch.zeros(w.shape[0], dtype=dtype, device=w.device) if needs[2] and src.bias is not None else None
        self.lock = threading.Lock()
        src.keep_slopes()

    def direct(self, pos: slice, dtype: torch.dtype) -> Optional[Tensor]:
        return None

    def put(self, pos: slice, idx: slice | Tensor, g: Tensor, cols: slice = slice(None)) -> None:
        """Add a chunk's (or a vocabulary tile's: columns ``cols``) share of the three gradients."""
        w, head = self.src.weight, self.src.head
        assert w is not None
        if not head.plain:  # dL/da = dL/dz dz/da, a new tensor (the caller's g stays as it was)
            g = g * head.scale if head.softcap is None else self.src.slope(idx, cols).mul_(g)
            if head.softcap is not None and self.invalid is not None:
                _zero_rows(g, self.invalid[pos])  # 0 * NaN: a NaN hidden state's slope
        if self.grad_h is not None:
            self.grad_h[pos] += torch.mm(g.to(w.dtype), w[cols])
        if self.acc_w is not None or self.acc_b is not None:
            h = self.src.rows(idx)
            if self.invalid is not None:
                h = _zero_rows(h.clone(), self.invalid[pos])
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
    """Which columns ``col [c, k]`` lie in the tile ``cols``, and their column there (clamped into it, ``[c, k]``)."""
    return (col >= cols.start) & (col < cols.stop), (col - cols.start).clamp_(0, cols.stop - cols.start - 1)


def _zero_rows(t: Tensor, rows: Tensor) -> Tensor:
    """``t [c, ...]`` with the rows where ``rows [c]`` (bool) is True set to exactly 0, in place.

    On the CPU the rows are found first and filled by index: a mask broadcast over ``[c, V]`` is a
    scalar loop there (8 to 20 times an arithmetic pass). Elsewhere one masked fill (no host read).
    """
    if host_reads(t.device) and not torch.compiler.is_compiling():
        hit = rows.nonzero().squeeze(1)
        return t.index_fill_(0, hit, 0) if hit.numel() else t
    return t.masked_fill_(rows.unsqueeze(1), 0)


def _zero_invalid(g: Tensor, invalid: Optional[Tensor], pos: slice) -> Tensor:
    """Invalid rows' gradient exactly 0 (their scale is 0, but 0 * NaN is NaN where their logits are NaN)."""
    return g if invalid is None else _zero_rows(g, invalid[pos])


def _row_sums(prod: Tensor) -> Tensor:
    r"""The row sums of a chunk of products ``p_i (a_i - b_i)``, an entry ``0 * inf = NaN`` counted as
    0 (:math:`0 \log 0 = 0`: a token off the policy's support). The callers carry NaN inputs into the
    row by another term. On the CPU only rows whose plain sum is NaN are summed again with that rule
    (a bool mask or ``nan_to_num`` over ``[c, V]`` is one more pass per chunk); elsewhere one
    ``nan_to_num`` (no host read).
    """
    if host_reads(prod.device) and not torch.compiler.is_compiling():
        out = prod.sum(dim=-1)
        redo = out.isnan().nonzero().squeeze(1)
        if redo.numel():
            out[redo] = prod[redo].nan_to_num_(nan=0.0, posinf=_INF, neginf=_NINF).sum(dim=-1)
        return out
    return prod.nan_to_num_(nan=0.0, posinf=_INF, neginf=_NINF).sum(dim=-1)


def _scaled(g: Tensor, scale: Tensor) -> Tensor:
    r"""``g * scale`` (``scale [c, 1]``) in place, every non-finite entry of ``g`` first made 0.

    The callers' unscaled gradients are non-finite only where a 0 weight meets an infinite log
    (:math:`0 \log 0`, a token outside a support: its gradient is 0), in a row of scale 0 (masked,
    or a +inf KL without a gradient) or in a row with NaN inputs, whose scale carries the NaN. One
    arithmetic pass instead of bool masks (which are scalar loops on the CPU).
    """
    return g.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).mul_(scale)


def _shifted(
    chunk: Tensor, fresh: bool, dtype: torch.dtype, temperature: float, state: dict[str, Tensor], key: str,
    m: Optional[Tensor] = None, out: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """A chunk's shifted scores ``e = (z - m) / T <= 0`` in the compute dtype, and ``m [c, 1]``.

    ``m`` is the rows' largest logit unless given (the global one, in backward): exact in the input
    dtype, so ``z - m`` is exact or rounded once before the division. ``e`` is written into ``out``,
    or into the chunk when it is a fresh one of the compute dtype, else into scratch ``key``: one op
    reads a half chunk and writes float32 differences.
    """
    if m is None:
        m = chunk.amax(dim=-1, keepdim=True).to(dtype)
    if out is None:
        out = chunk if fresh and chunk.dtype == dtype else _scratch(state, chunk.shape, dtype, chunk.device, key)
    e = torch.sub(chunk, _finite(m), out=out)
    return (e.div_(temperature) if temperature != 1.0 else e), m


def _softmax_input(
    chunk: Tensor, fresh: bool, dtype: torch.dtype, temperature: float, state: dict[str, Tensor], key: str, m: Optional[Tensor] = None
) -> Tensor:
    """What ``log_softmax`` or ``softmax`` reads for a chunk's shifted scores ``e = (z - m) / T``: at
    ``T = 1`` the logits themselves in the compute dtype (half ones cast into scratch ``key``), whose
    ``log_softmax`` and ``softmax`` are ``e``'s bitwise (both subtract the same, exact, max); else ``e``
    (:func:`_shifted`, with the shift ``m`` when given). Not ``e`` itself at ``T = 1``: callers that need
    ``e`` (the entropy) take :func:`_shifted`."""
    if temperature == 1.0:
        return chunk if chunk.dtype == dtype else _scratch(state, chunk.shape, dtype, chunk.device, key).copy_(chunk)
    return _shifted(chunk, fresh, dtype, temperature, state, key, m)[0]


def _log_probs(src: Source, idx: slice | Tensor, dtype: torch.dtype, temperature: float, state: dict[str, Tensor], key: str, out: Optional[Tensor] = None) -> Tensor:
    """A chunk's log-probs over the whole vocabulary, ``log_softmax(e)`` of its shifted scores
    ``e = (z - m) / T`` (read as :func:`_softmax_input` says), written into ``out`` or scratch ``key + "l"``.

    torch's CPU ``log_softmax`` forms ``(e - max e) - log S`` per row, so these are bitwise the
    shifted scores minus their log-sum, from one fused read of each row (its sum of exponentials
    is the fastest on the CPU): the rows' quantities without a separate ``exp`` and ``sum``.
    """
    chunk, fresh = src.read(idx)
    x = _softmax_input(chunk, fresh, dtype, temperature, state, key)
    if out is None:
        out = _scratch(state, x.shape, dtype, x.device, key + "l")
    return torch._log_softmax(x, -1, False, out=out)


# ---------------------------------------------------------------------------------------------
# the row quantities: the token log-prob and the entropy, one pass for either or both


def token_logprobs_kernel(
    src: Tensors,
    ids: Tensor,
    ignored: Optional[Tensor],
    sampling: Sampling,
    part: Partition = WHOLE,
    chunk_size: Optional[int] = None,
    kept_from: Optional[Tensor] = None,
    replay: Optional[KeptSets] = None,
    record: Optional[list[Any]] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Log-probs of ``ids [n]`` (int64; in ``[0, V)`` for the whole vocabulary, global ids on a split)
    under the processed distribution of a checked source, with the kept log-mass and the outside flags.

    ``ids`` may be ``[n, k]``: ``k`` ids per row (a teacher's top-k), from the same one pass (each row's
    normalizer once); ``logprobs`` and ``outside`` are then ``[..., k]``, and the gradient w.r.t. the
    logits is the sum of the ``k`` tokens' (:math:`\sum_j g_j [i = y_j] - \tilde p_i \sum_j g_j`).
    ``kept_from`` (logits ``[..., V]`` of another model, no gradient) chooses the kept set instead of
    ``src``; ``replay`` (checked :class:`~lightning_kl.ground.kept.KeptSets` of the ``n`` positions)
    gives it as recorded. ``record``: a list that receives the kept sets the processing chose
    (:class:`~lightning_kl.ground.kept.KeptSets` of ``[...]``, empty sets at ignored positions; whole
    vocabulary only). Returns ``(logprobs, log_kept, outside)``, each ``[...]``: ``logprobs`` differentiable
    (``-inf`` with zero gradient where the token is outside the kept set), ``log_kept`` without grad
    (0 without truncation), ``outside`` bool. Ignored tokens (``ignored [n]``, whole rows): 0, 0, False,
    zero gradient. On a split vocabulary each id must be owned by exactly one rank (checked, without a
    host read off the CPU).
    """
    lp, _, log_kept, outside = _Rows.apply(*src, kept_from, ids, ignored, sampling, part, chunk_size, True, False, replay, record)
    return lp, log_kept, outside


def entropy_kernel(
    src: Tensors, invalid: Optional[Tensor], sampling: Sampling, part: Partition = WHOLE, chunk_size: Optional[int] = None,
    replay: Optional[KeptSets] = None,
) -> Tensor:
    r"""Per-token entropy :math:`H = -\sum_i \tilde p_i \log \tilde p_i` ``[...]`` of the processed
    distribution of a checked source (``invalid``: None or ``[n]`` bool, value 0 and gradient 0 there),
    on the recorded kept sets with ``replay``."""
    return _Rows.apply(*src, None, None, invalid, sampling, part, chunk_size, False, True, replay, None)[1]


def token_logprobs_entropy_kernel(
    src: Tensors,
    ids: Tensor,
    ignored: Optional[Tensor],
    sampling: Sampling,
    part: Partition = WHOLE,
    chunk_size: Optional[int] = None,
    replay: Optional[KeptSets] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`token_logprobs_kernel` and :func:`entropy_kernel` from one read of the vocabulary per chunk:
    ``(logprobs, entropy, outside)``, the first two differentiable through one backward pass (one
    gradient writer). Ignored tokens: 0, 0, False, zero gradient. ``replay`` as :func:`token_logprobs_kernel`."""
    lp, ent, _, outside = _Rows.apply(*src, None, ids, ignored, sampling, part, chunk_size, True, True, replay, None)
    return lp, ent, outside


class _Recorded:
    """Recorded kept sets read by chunks of positions: each chunk's ``[c, V]`` mask of removed tokens from
    its own ids (bounds from the host copy of the offsets: no device sync)."""

    def __init__(self, kept: KeptSets) -> None:
        self.kept, self.rows = kept, kept._rows()

    def removed(self, pos: slice, vocab: int, offset: int = 0) -> Tensor:
        """``[c, vocab]`` True off the recorded sets of positions ``pos``, over columns ``[offset, offset + vocab)``
        (a vocabulary shard's: ids of other shards go to a spare column, dropped)."""
        a, b = self.kept.bounds(pos.start, pos.stop)
        ids = self.kept.ids[a:b].long()
        if offset:
            ids = ids - offset
        spare = offset != 0 or vocab != self.kept.vocab
        if spare:
            ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab)
        removed = torch.ones((pos.stop - pos.start, vocab + spare), dtype=torch.bool, device=self.rows.device)
        removed[self.rows[a:b] - pos.start, ids] = False
        return removed[:, :vocab] if spare else removed


def _assemble(chosen: dict[int, tuple[Tensor, Tensor]], lead: torch.Size, vocab: int, device: torch.device, temperature: float) -> KeptSets:
    """The recording's chunks (sizes and ids, by first position) as one :class:`KeptSets` of ``lead``."""
    keys = sorted(chosen)
    counts = torch.cat([chosen[k][0] for k in keys]) if keys else torch.zeros(0, dtype=torch.int64, device=device)
    ids = torch.cat([chosen[k][1] for k in keys]) if keys else torch.zeros(0, dtype=torch.int64, device=device)
    return KeptSets(ids, torch.cat([counts.new_zeros(1), counts.cumsum(0)]), lead, vocab, temperature)


# the rows of _Rows' per-row statistics: the shift m (largest kept logit), the log-sum c over the kept
# set, the log-sum over the whole vocabulary (truncation only), the target's logit, the spread A
_M, _C, _CALL, _ZY, _A = range(5)


class _Rows(torch.autograd.Function):
    r"""Per row, with :math:`e_i = (z_i - m) / T` and :math:`c = \log \sum_{i \in K} e^{e_i}`:
    :math:`\log \tilde p_y = e_y - c` and :math:`H = c + A`, :math:`A = -\sum_i \tilde p_i e_i \ge 0`
    (two terms >= 0: nothing cancels). Backward, with :math:`u_i = e^{e_i}` and :math:`1/S = e^{-c}`:
    :math:`\partial \log \tilde p_y / \partial z_i = ([i = y] - u_i / S) / T` and
    :math:`\partial H / \partial z_i = -u_i (e_i + A) / (S T)`, the sum of both when both have a
    gradient (one writer), ``u e = xlogy(u, u)`` (0 where ``u = 0``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        head: Head,
        kept_from: Optional[Tensor],
        ids: Optional[Tensor],
        ignored: Optional[Tensor],
        sampling: Sampling,
        part: Partition,
        chunk_size: Optional[int],
        want_lp: bool,
        want_ent: bool,
        replay: Optional[KeptSets],
        record: Optional[list[Any]],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        src = Source(Tensors(x, weight, bias, head))
        support = None if kept_from is None else Source(Tensors(kept_from))
        srcs = (src,) if support is None else (src, support)
        n, dtype, device, temp = src.n, compute_dtype(x), x.device, sampling.temperature
        truncated = sampling.truncates or support is not None or replay is not None
        recorded = _Recorded(replay) if replay is not None else None
        chosen: dict[int, tuple[Tensor, Tensor]] = {}  # the recording's chunks, by first position
        rows = src.chunk_rows(chunk_size, tiled=not truncated)
        col = owned = None
        k = 1 if ids is None or ids.dim() == 1 else ids.shape[1]  # ids [n], or k ids per row [n, k]
        if want_lp:
            assert ids is not None
            col = ids.view(n, k) - part.offset
            owned = (col >= 0) & (col < src.vocab)
            if ignored is not None:
                owned &= ~ignored.unsqueeze(1)
            col = col.clamp_(0, max(src.vocab - 1, 0))
        stats = torch.zeros((5, n), dtype=dtype, device=device)
        stats[:_ZY].fill_(_NINF)  # an empty shard holds no mass
        zy = torch.zeros((n, k), dtype=dtype, device=device)  # the targets' logits
        outside = torch.zeros((n, k), dtype=torch.bool, device=device)
        threshold = torch.zeros(n if truncated else 0, dtype=dtype, device=device)

        def whole(pos: slice, idx: slice | Tensor, state: dict[str, Tensor]) -> None:
            tiles = src.tiles(pos.stop - pos.start, True)
            one = len(tiles) == 1
            parts = torch.empty((len(tiles), 3, pos.stop - pos.start), dtype=dtype, device=device)
            for k, cols in enumerate(tiles):
                chunk, fresh = src.read(idx, cols)
                if want_lp and one:
                    zy[pos] = chunk.gather(1, col[pos])  # type: ignore[index]
                elif want_lp:  # each id lies in one tile, which gives its logit; the others add 0
                    here, c = _in_tile(col[pos], cols)  # type: ignore[index]
                    zy[pos] += torch.where(here, chunk.gather(1, c).to(dtype), 0)
                if temp == 1.0 and not want_ent:  # no shifted copy (the entropy needs e itself)
                    e = _softmax_input(chunk, fresh, dtype, temp, state, "e")
                    m = e.amax(dim=-1, keepdim=True)
                else:
                    e, m = _shifted(chunk, fresh, dtype, temp, state, "e")
                del chunk  # freed before the next tile's matmul
                # log_softmax(e) is e - log S bitwise (torch's CPU kernel; max e = 0): its max is -log S, from one
                # fused read of each row. A part without mass (m = -inf) keeps c = -inf (log_softmax gives NaN there)
                lsm = torch._log_softmax(e, -1, False, out=_scratch(state, e.shape, dtype, e.device, "l"))
                m = m.squeeze(1)
                parts[k, 0], parts[k, 1] = m, lsm.amax(dim=-1).neg_().masked_fill_(m == _NINF, _NINF)
                if want_ent:  # A = -sum_i p_i e_i, 0 log 0 = 0
                    parts[k, 2] = _row_sums(lsm.exp_().mul_(e)).neg_()
                del e, lsm
            if one:
                stats[_M, pos], stats[_C, pos], stats[_A, pos] = parts[0, 0], parts[0, 1], parts[0, 2]
                return
            stats[_M, pos], stats[_C, pos], d, lw = _merge(parts[:, 0], parts[:, 1], temp)  # tiles combine as ranks do
            if want_ent:
                stats[_A, pos] = _weighted(lw, parts[:, 2] - d)

        def kept(pos: slice, idx: slice | Tensor) -> None:
            z = src.scores(idx, dtype, 1.0)  # fresh logits in the compute dtype
            if recorded is not None:  # the recorded set, ties at its boundary included, not a recomputed one
                removed = recorded.removed(pos, src.vocab, part.offset)
            else:
                removed = process_scores(z / temp if support is None else support.scores(idx, dtype, temp), sampling) == _NINF
            if record is not None:  # what the processing kept (nothing at ignored positions)
                keep = ~removed if ignored is None else ~removed & ~ignored[pos].unsqueeze(1)
                chosen[pos.start] = keep.sum(dim=-1), keep.nonzero()[:, 1]
            if want_lp:
                zy[pos] = z.gather(1, col[pos])  # type: ignore[index]
                outside[pos] = removed.gather(1, col[pos]) & owned[pos]  # type: ignore[index]
            # the kept set as a threshold on the logits, for the backward: top-k and min-p keep upper sets of
            # z / T, which are upper sets of z (the rounded division is monotone)
            if recorded is None:  # (a record is read again in backward)
                threshold[pos] = torch.where(removed, float("inf"), z).amin(dim=-1)
            # the top is kept by generate's rules; another model's kept set, or a recorded one off-policy, may
            # leave it out (on-policy its largest kept logit is the top, bitwise: the same values follow)
            other = support is not None or recorded is not None
            m = z.masked_fill(removed, _NINF).amax(dim=-1, keepdim=True) if other else z.amax(dim=-1, keepdim=True)
            e = z.sub_(_finite(m))
            if temp != 1.0:
                e.div_(temp)
            if support is None:  # a record: the processing's own ops (on-policy the same bits by construction)
                if recorded is not None:  # off the record e may exceed 0 (exp overflows there, then is masked)
                    stats[_CALL, pos] = torch.logsumexp(e, dim=-1)
                u = e.exp_()
                if recorded is None:
                    stats[_CALL, pos] = u.sum(dim=-1).log_()
                u.masked_fill_(removed, 0)
            else:  # logits above the kept top: e > 0 there
                stats[_CALL, pos] = torch.logsumexp(e, dim=-1)
                u = e.masked_fill_(removed, _NINF).exp_()
            total = u.sum(dim=-1)
            stats[_M, pos], stats[_C, pos] = m.squeeze(1), total.log()
            if want_ent:
                stats[_A, pos] = u.xlogy_(u).sum(dim=-1).div_(total).neg_()

        def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
            pos, idx = item
            if truncated:
                kept(pos, idx)
            else:
                whole(pos, idx, state)

        _run(work, srcs, rows, state=True)
        if record is not None:
            record.append(_assemble(chosen, src.lead, src.vocab, device, temp) if truncated else None)
        m, c, spread = stats[_M], stats[_C], stats[_A]
        if ignored is not None:  # NaN logits of ignored rows stay out of the group's max and of the values
            m.masked_fill_(ignored, 0)
            c.masked_fill_(ignored, 0)
            spread.masked_fill_(ignored, 0)
        call = stats[_CALL]  # the whole vocabulary's log-sum, relative to the shift the chunks used
        if part.ranks > 1:
            shift = _finite(m)
            m, c, d, lw = part.merge(m, c, temp)
            if want_ent:
                spread = part.combine(lw, spread - d)
            if truncated:  # replay on shards: relative to the largest shift, then to the kept top m
                top, call, _, _ = part.merge(shift, call, temp)
                call = call + (top - _finite(m)) / temp
        out = torch.zeros(n, dtype=dtype, device=device)
        if want_lp:
            assert owned is not None and ids is not None
            zy = torch.where(owned, zy, 0)
            if part.split:  # outside (replay): the owner's flag, for every rank
                packed = part.reduce(torch.stack([zy, owned.to(dtype), outside.to(dtype)]), _SUM)
                zy, owners = packed[0], packed[1] if ignored is None else packed[1].masked_fill(ignored.unsqueeze(1), 1)
                outside = packed[2] > 0
                unowned = owners != 1
                check_values(
                    unowned,
                    lambda: ValueError(
                        f"token id {int(ids.view(n, k)[unowned][0])} is owned by {int(owners[unowned][0])} vocabulary shards, not 1: ids "
                        "must lie in [0, V) of the split vocabulary (or be `ignore_index`), and the shards' offsets must tile it."
                    ),
                    "every token id must be owned by exactly one vocabulary shard: ids in [0, V) (or ignore_index), shards that tile [0, V)",
                )
            out = zy - _finite(m).unsqueeze(1)
            if temp != 1.0:
                out.div_(temp)
            out.sub_(c.unsqueeze(1))
        else:
            out = torch.zeros((n, k), dtype=dtype, device=device)
        # a row without mass (every logit -inf) has no distribution: its entropy is NaN, as torch's
        ent = (c + spread).masked_fill_(c == _NINF, float("nan")) if want_ent else torch.zeros_like(c)
        log_kept = (c - call) if truncated else torch.zeros_like(c)
        if ignored is not None:
            out.masked_fill_(ignored.unsqueeze(1), 0)
            ent.masked_fill_(ignored, 0)
            log_kept.masked_fill_(ignored, 0)
            outside.masked_fill_(ignored.unsqueeze(1), False)
        out.masked_fill_(outside, _NINF)
        ctx.save_for_backward(x, weight, bias, kept_from)
        ctx.saved = (col, owned, ignored, outside, m, c, spread, threshold, recorded)
        ctx.sampling, ctx.part, ctx.rows, ctx.truncated, ctx.want = sampling, part, rows, truncated, (want_lp, want_ent)
        ctx.head = head
        lead = src.lead
        per = lead if ids is None or ids.dim() == 1 else (*lead, k)
        out, ent, log_kept, outside = out.view(per), ent.view(lead), log_kept.view(lead), outside.view(per)
        ctx.mark_non_differentiable(*(t for t, wanted in ((out, want_lp), (ent, want_ent), (log_kept, False), (outside, False)) if not wanted))
        return out, ent, log_kept, outside

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_lp: Optional[Tensor], g_ent: Optional[Tensor], _g_kept: Any, _g_outside: Any) -> tuple[Optional[Tensor], ...]:
        x, weight, bias, kept_from = ctx.saved_tensors
        col, owned, ignored, outside, m, c, spread, threshold, recorded = ctx.saved
        sampling, part, (want_lp, want_ent) = ctx.sampling, ctx.part, ctx.want
        nones = (None,) * 10
        src = Source(Tensors(x, weight, bias, ctx.head))
        support = None if kept_from is None else Source(Tensors(kept_from))
        dtype, temp = m.dtype, sampling.temperature
        lp_grad, ent_grad = want_lp and g_lp is not None, want_ent and g_ent is not None
        writer = _writer(src, ctx.needs_input_grad[:3], dtype, ignored) if lp_grad or ent_grad else None
        if writer is None:
            return (None, None, None, None, *nones)
        # the gradient w.r.t. the logits, u_i (alpha + beta e_i) + [i = y] hit: with inv = 1 / (S T),
        # alpha = -(g_lp + g_H A) inv, beta = -g_H inv, hit = g_lp / T (0 on ignored tokens and on tokens
        # outside the kept set: their value is -inf whatever the logits, a constant)
        # 1 / T multiplies both terms alike, so that a row whose kept set is its target alone (S = 1, c = 0)
        # gets exactly 0. Whole rows of one partition take p = softmax(e) = u / S from one fused read of
        # each row instead of u = exp(e): there the factors are 1 / T in place of inv
        a, b, hit = torch.zeros_like(c), None, None
        if lp_grad:
            assert g_lp is not None
            gl = g_lp.reshape(outside.shape).to(dtype).masked_fill(outside, 0)  # [n, k]
            if ignored is not None:
                gl = gl.masked_fill(ignored.unsqueeze(1), 0)
            hit = torch.where(owned, gl * (1.0 / temp), 0)
            a = -gl.sum(1) if gl.shape[1] > 1 else -gl.squeeze(1)
        if ent_grad:
            assert g_ent is not None
            gh = g_ent.reshape(-1).to(dtype)
            if ignored is not None:
                gh = gh.masked_fill(ignored, 0)
            b = -gh
            a = a + b * spread

        def times(norm: Tensor | float) -> tuple[Tensor, Optional[Tensor]]:  # (alpha, beta) as [n, 1]
            return (a * norm).unsqueeze(1), None if b is None else (b * norm).unsqueeze(1)

        factors = {False: times(torch.exp(-c).mul_(1.0 / temp)), True: times(1.0 / temp)}  # keyed by whole
        shift = m.unsqueeze(1)
        # top-p splits tied scores at its boundary, and another model's kept set is no threshold on
        # these logits: the processing runs again there (the same ops on the same numbers)
        redo = sampling.top_p is not None or support is not None or recorded is not None

        def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
            pos, idx = item
            assert writer is not None
            tiles = src.tiles(pos.stop - pos.start, not ctx.truncated)
            whole = not ctx.truncated and len(tiles) == 1 and part.ranks == 1
            alpha, beta = factors[whole]
            for cols in tiles:
                direct = writer.direct(pos, dtype)
                if whole:  # p = softmax(e) into the gradient's rows; e kept aside for the entropy
                    chunk, fresh = src.read(idx, cols)
                    if beta is None:
                        e = _softmax_input(chunk, fresh, dtype, temp, state, "e", shift[pos])
                    else:  # the entropy needs e itself
                        e, _ = _shifted(chunk, fresh, dtype, temp, state, "e", shift[pos])
                    u = torch._softmax(e, -1, False, out=_scratch(state, e.shape, dtype, e.device, "u") if direct is None else direct)
                    del chunk
                elif not ctx.truncated:
                    chunk, fresh = src.read(idx, cols)
                    e, _ = _shifted(chunk, fresh, dtype, temp, state, "e", shift[pos], direct)
                    del chunk
                else:
                    z = src.scores(idx, dtype, 1.0)
                    if recorded is not None:
                        removed = recorded.removed(pos, src.vocab, part.offset)
                    elif redo:
                        removed = process_scores(z / temp if support is None else support.scores(idx, dtype, temp), sampling) == _NINF
                    else:
                        removed = z < threshold[pos].unsqueeze(1)
                    e = z.sub_(_finite(shift[pos]))
                    if temp != 1.0:
                        e.div_(temp)
                    e.masked_fill_(removed, _NINF)
                if beta is None:
                    g = u.mul_(alpha[pos]) if whole else e.exp_().mul_(alpha[pos])
                else:  # u e as a product (0 where u = 0: e = -inf; xlogy would cost another exp's time), then + alpha u
                    if not whole:
                        u = torch.exp(e, out=_scratch(state, e.shape, dtype, e.device, "u"))
                    ue = e.mul_(u).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
                    # in the gradient's rows: u's when whole, else e's
                    g = u.mul_(alpha[pos]).addcmul_(ue, beta[pos]) if whole else ue.mul_(beta[pos]).addcmul_(u, alpha[pos])
                if hit is not None and cols.stop - cols.start == src.vocab:  # the whole vocabulary: every id is here
                    g.scatter_add_(1, col[pos], hit[pos])
                elif hit is not None:
                    here, cc = _in_tile(col[pos], cols)
                    g.scatter_add_(1, cc, torch.where(here, hit[pos], 0))
                writer.put(pos, idx, _zero_invalid(g, ignored, pos), cols)
                del e, g

        _run(work, (src,), ctx.rows, state=True)
        return (*_grads(writer, part), None, *nones)


# ---------------------------------------------------------------------------------------------
# the exact divergence to a second source


def full_kl_kernel(
    src: Tensors,
    ref: Tensors,
    invalid: Optional[Tensor],
    sampling: Sampling,
    reference: str = "unprocessed",
    part: Partition = WHOLE,
    chunk_size: Optional[int] = None,
    divergence: str = "reverse",
    beta: Optional[float] = None,
    replay: Optional[KeptSets] = None,
) -> Tensor:
    r"""Per-token divergence ``[...]`` between the policy's :math:`\tilde p` and the other model's :math:`q`,
    two checked sources (one partition): :math:`\mathrm{KL}(\tilde p \,\|\, q)` by default.

    ``invalid`` is None or ``[n]`` bool (masked rows: value 0, gradient exactly 0). :math:`\tilde p`
    is the policy's processed distribution; :math:`q` (``reference``, at the same temperature):
    ``"unprocessed"`` the reference's softmax, ``"processed"`` its own processed distribution (``+inf``
    where the policy keeps a token it removes; a backward through such a token raises),
    ``"policy_kept"`` its softmax renormalized on the policy's kept set. Without truncation the three
    are the plain KL of the two softmaxes. An entry with :math:`\tilde p_i = 0` adds nothing
    (:math:`0 \log 0 = 0`). ``divergence``, ``beta``: one of
    :data:`~lightning_kl.kernels.divergence.DIVERGENCES` (:mod:`lightning_kl.kernels.divergence`: its
    terms, its ends); a ``+inf`` value of any of them raises in backward when it gets a gradient.

    ``replay`` (checked :class:`~lightning_kl.ground.kept.KeptSets` of the ``n`` positions, a non-empty
    set at every valid one) gives the policy's kept set as recorded: :math:`\tilde p` is
    ``softmax(z / T)`` renormalized on it, and ``sampling``'s truncation is used only where
    ``reference="processed"`` processes the reference's own logits (whole rows: not on a split
    vocabulary); ``"policy_kept"`` renormalizes the reference on the recorded set. The recorded set is a
    selection like a processed one: on tiles of a head and on vocabulary shards as the plain softmax is
    (each part's columns of the record), the same ops as the processing's on-policy (the same bits where
    the parts are the same).
    """
    name, beta = check_divergence(divergence, beta)
    return _FullKL.apply(*src, *ref, invalid, sampling, reference, part, chunk_size, (name, beta), replay)


def _kl_shifted(
    src: Source, ref: Source, item: tuple[slice, slice | Tensor], dtype: torch.dtype, sampling: Sampling, reference: str, cols: slice,
    state: dict[str, Tensor], shifts: Optional[tuple[Tensor, Tensor]] = None, out: Optional[Tensor] = None,
    recorded: Optional[_Recorded] = None, offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A chunk's (or tile's) shifted scores of both models (:func:`_shifted`), ``-inf`` off each
    support, and their shifts ``[c, 1]``: the largest kept logits, or the global ones given. The
    policy's are written into ``out`` when given without a kept set (a gradient's own rows). ``item``:
    the chunk's output positions and rows; ``recorded``: the policy's recorded kept sets (replay), read
    over the columns ``cols`` of a part starting at the global column ``offset``."""
    temp = sampling.temperature
    pos, idx = item
    mp, mq = (None, None) if shifts is None else shifts
    if not sampling.truncates and recorded is None:
        z, fz = src.read(idx, cols)
        ep, mp = _shifted(z, fz, dtype, temp, state, "p", mp, out)
        del z
        r, fr = ref.read(idx, cols)
        eq, mq = _shifted(r, fr, dtype, temp, state, "q", mq)
        return ep, eq, mp, mq
    z, r = src.scores(idx, dtype, 1.0, cols), ref.scores(idx, dtype, 1.0, cols)  # fresh logits in the compute dtype
    if recorded is not None:  # the recorded set, ties at its boundary included, not a recomputed one
        removed = recorded.removed(pos, cols.stop - cols.start, offset + cols.start)
    else:
        removed = process_scores(z / temp, sampling) == _NINF
    removed_q = None
    if reference == "processed" and sampling.truncates:  # the reference's own processing (whole rows)
        removed_q = process_scores(r / temp, sampling) == _NINF
    elif reference == "policy_kept":
        removed_q = removed
    if mp is None:  # the top is kept by generate's rules; the policy's kept set may leave out the reference's
        # a record off-policy may leave out the current top (on-policy its largest kept logit is the top: the same bits)
        mp = (z if recorded is None else z.masked_fill(removed, _NINF)).amax(dim=-1, keepdim=True)
        mq = (r if reference != "policy_kept" else r.masked_fill(removed, _NINF)).amax(dim=-1, keepdim=True)
    assert mq is not None
    ep, eq = z.sub_(_finite(mp)), r.sub_(_finite(mq))
    if temp != 1.0:
        ep.div_(temp), eq.div_(temp)
    ep.masked_fill_(removed, _NINF)
    if removed_q is not None:
        eq.masked_fill_(removed_q, _NINF)
    return ep, eq, mp, mq


class _Div(NamedTuple):
    r"""A checked divergence as the engine sums it, from two row sums :math:`s_1, s_2`: a mix of the two
    KLs (``weights`` = (forward, reverse), ``beta`` None), :math:`s_1 = \mathrm{KL}(p \,\|\, q)`,
    :math:`s_2 = \mathrm{KL}(q \,\|\, p)`, :math:`D = w_r s_1 + w_f s_2`; or the JSD's interior
    (``weights`` None), :math:`s_1 = \mathrm{KL}(p \,\|\, m)`, :math:`s_2 = \mathrm{KL}(q \,\|\, m)`,
    :math:`D = (1 - \beta) s_1 + \beta s_2`. The gradients w.r.t. each side's logits then need no
    other row number (:meth:`_FullKL.backward`)."""

    name: str
    weights: Optional[tuple[float, float]]
    beta: Optional[float]

    @staticmethod
    def of(name: str, beta: Optional[float]) -> "_Div":
        weights = kl_weights(name, beta)
        return _Div(name, weights, beta if weights is None else None)

    @property
    def reverse(self) -> bool:
        """Whether this is :math:`\\mathrm{KL}(p \\,\\|\\, q)` alone (the reverse KL's own paths, bitwise)."""
        return self.weights == (0.0, 1.0)

    def value(self, s1: Tensor, s2: Tensor) -> Tensor:
        if self.weights is None:
            assert self.beta is not None
            return s1 * (1.0 - self.beta) + s2 * self.beta
        w_f, w_r = self.weights
        if not w_f:
            return s1 if w_r == 1.0 else s1 * w_r
        if not w_r:
            return s2 if w_f == 1.0 else s2 * w_f
        return s1 * w_r + s2 * w_f  # only where both are taken: 0 * inf would be NaN


def _log_mix(lp: Tensor, lq: Tensor, beta: float, state: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    r"""``(p, q, log m)`` of normalized log-probs, :math:`m = (1 - \beta) p + \beta q`, each in scratch.

    :math:`m` is clamped below at the smallest normal number, so that a tiny :math:`p > 0` whose share
    rounds to 0 never meets :math:`\log m = -\infty`; a term :math:`p \log(p / m)` moves by less than
    that number there, and :math:`m = 0` (both sides without mass) gives 0 terms as :math:`0 \log 0 = 0`."""
    dtype, dev = lp.dtype, lp.device
    p = torch.exp(lp, out=_scratch(state, lp.shape, dtype, dev, "u"))
    q = torch.exp(lq, out=_scratch(state, lq.shape, dtype, dev, "v"))
    m = torch.mul(p, 1.0 - beta, out=_scratch(state, lp.shape, dtype, dev, "m")).add_(q, alpha=beta)
    return p, q, m.clamp_min_(torch.finfo(dtype).tiny).log_()


def _kl_terms(d: Tensor, u: Optional[Tensor], v: Optional[Tensor], div: "_Div") -> tuple[Optional[Tensor], Optional[Tensor]]:
    r"""A mix of KLs' row sums :math:`\sum_i u_i d_i` (with a reverse weight) and :math:`-\sum_i v_i d_i`
    (with a forward weight) of :math:`d = \log p - \log q` (or the shifted scores' difference), ``u``,
    ``v`` each model's (unnormalized) probabilities; ``d`` and ``u`` are overwritten. An entry
    ``0 * inf`` counts 0 (:func:`_row_sums`); ``-sum v d`` is ``sum v (log q - log p)``, ``+inf`` where
    ``v > 0`` meets ``log p = -inf``."""
    assert div.weights is not None
    w_f, w_r = div.weights
    s1 = _row_sums(torch.mul(d, u, out=u)) if w_r else None  # type: ignore[arg-type]
    s2 = _row_sums(d.mul_(v)).neg_() if w_f else None  # type: ignore[arg-type]
    return s1, s2


def _row_terms(lp: Tensor, lq: Tensor, div: _Div, state: dict[str, Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The row sums ``(s1, s2)`` of :class:`_Div` (None: not taken) from a chunk's normalized log-probs of
    both models (whole rows, or a tile of rows with the global log-sums), which are overwritten."""
    dtype, dev = lp.dtype, lp.device
    if div.weights is None:
        assert div.beta is not None
        p, q, lm = _log_mix(lp, lq, div.beta, state)
        return _row_sums(lp.sub_(lm).mul_(p)), _row_sums(lq.sub_(lm).mul_(q))
    w_f, w_r = div.weights
    u = torch.exp(lp, out=_scratch(state, lp.shape, dtype, dev, "u")) if w_r else None
    v = torch.exp(lq, out=_scratch(state, lq.shape, dtype, dev, "v")) if w_f else None
    return _kl_terms(torch.sub(lp, lq, out=lq), u, v, div)


# the rows of _FullKL's per-row statistics: each model's shift and log-sum, the row sums s1 and s2 of
# _Div (the reverse KL: s1 alone)
_MP, _CP, _MQ, _CQ, _KL, _KL2 = range(6)


def _infinite_kl(reference: str, sampling: Sampling, select: bool) -> tuple[str, str]:
    """What a +inf KL was taken against, and why it is infinite, for ``reference`` (the backward's message;
    ``select``: the policy has a kept set, processed or recorded)."""
    if reference == "processed" and sampling.truncates:
        return "the reference's own processed distribution", (
            "(the policy keeps a token that the reference's processing removes): its gradient does not exist. "
            "Use reference='policy_kept' or 'unprocessed' to regularize, or mask those tokens"
        )
    kept = reference == "policy_kept" and select
    return "the reference renormalized on the policy's kept set" if kept else "the reference's softmax", (
        "(the policy gives mass to a token whose reference logit is -inf, a token the reference cannot emit): "
        "its gradient does not exist. Mask those tokens, or give the reference a finite logit there"
    )


class _FullKL(torch.autograd.Function):
    r"""Per row, with the shifted scores :math:`e^p, e^q` and log-sums :math:`c_p, c_q` of both models
    (as in :class:`_Rows`): :math:`\log \tilde p_i - \log q_i = (e^p_i - e^q_i) - (c_p - c_q)`, summed
    with the weights :math:`\tilde p_i = e^{e^p_i} / S_p` (the reverse KL; the forward one with
    :math:`q_i`, both for a mix: :class:`_Div`). Parts (tiles, ranks) merge their KLs with their
    weights; the JSD's interior, whose :math:`\log m_i` needs both global log-sums, reads the parts
    again once these are known (a head's tiles, a split vocabulary's shards: two reads in forward).

    Backward, per divergence (:class:`_Div`, the row sums saved), the policy's gradient
    :math:`(g_i - \tilde p_i \sum_j g_j) / T` with :math:`g = \partial D / \partial \log \tilde p`:
    :math:`w_r \tilde p_i (\log \tilde p_i - \log q_i - s_1) + w_f (\tilde p_i - q_i)` for a mix of KLs,
    :math:`(1 - \beta)\, \tilde p_i (\log \tilde p_i - \log m_i - s_1)` for the JSD; the other
    side's is the same with the roles swapped: :math:`w_f q_i (\log q_i - \log \tilde p_i - s_2) + w_r (q_i - \tilde p_i)`,
    :math:`\beta\, q_i (\log q_i - \log m_i - s_2)`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        head: Head,
        rx: Tensor,
        rweight: Optional[Tensor],
        rbias: Optional[Tensor],
        rhead: Head,
        invalid: Optional[Tensor],
        sampling: Sampling,
        reference: str,
        part: Partition,
        chunk_size: Optional[int],
        divergence: tuple[str, Optional[float]] = ("reverse", None),
        replay: Optional[KeptSets] = None,
    ) -> Tensor:
        src, ref = Source(Tensors(x, weight, bias, head)), Source(Tensors(rx, rweight, rbias, rhead))
        dtype, temp = compute_dtype(x, rx), sampling.temperature
        div = _Div.of(*divergence)
        recorded = None if replay is None else _Recorded(replay)
        # the sampler's processing needs whole rows (the policy's, or the reference's own with "processed"); a
        # recorded set is read by columns: a head's tiles and a vocabulary's shards take it as the softmax
        processes = sampling.truncates and (recorded is None or reference == "processed")
        tiled = not processes and weight is not None and rweight is not None  # two heads: tiles of both
        rows = src.chunk_rows(chunk_size, tiled, models=2)
        # whole rows of one partition: each model's normalized log-probs from one fused read (:func:`_log_probs`);
        # tiles and ranks need each part's shift and log-sum to merge
        whole = not sampling.truncates and recorded is None and not tiled and part.ranks == 1
        # the JSD's interior over parts: the terms in a second read, from the global log-sums
        again = div.weights is None and (tiled or part.ranks > 1)
        width = _KL + (1 if div.reverse else 2)  # the statistics' rows: the reverse KL needs no s2
        stats = torch.zeros((width, src.n), dtype=dtype, device=src.device)
        stats[:_KL].fill_(_NINF)  # an empty shard holds no mass

        def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
            pos, idx = item
            if whole:  # sum_i p_i (log p_i - log q_i), 0 log 0 = 0 as below
                logp, logq = _log_probs(src, idx, dtype, temp, state, "p"), _log_probs(ref, idx, dtype, temp, state, "q")
                # NaN or +inf among a row's logits makes its log_softmax wholly NaN: one entry per model carries it
                carry = torch.exp(logp[:, 0]).add_(torch.exp(logq[:, 0])).mul_(0)
                if div.reverse:
                    d = torch.sub(logp, logq, out=logq)
                    stats[_KL, pos] = _row_sums(d.mul_(logp.exp_())).add_(carry)
                    return
                s1, s2 = _row_terms(logp, logq, div, state)
                if s1 is not None:
                    stats[_KL, pos] = s1.add_(carry)
                if s2 is not None:
                    stats[_KL2, pos] = s2.add_(carry)
                return
            tiles = src.tiles(pos.stop - pos.start, tiled)
            parts = torch.zeros((len(tiles), width, pos.stop - pos.start), dtype=dtype, device=src.device)
            for k, cols in enumerate(tiles):
                ep, eq, mp, mq = _kl_shifted(src, ref, item, dtype, sampling, reference, cols, state, recorded=recorded, offset=part.offset)
                u = torch.exp(ep, out=_scratch(state, ep.shape, dtype, src.device, "u"))
                sp = u.sum(dim=-1)
                v = torch.exp(eq, out=_scratch(state, eq.shape, dtype, src.device, "v"))
                sq = v.sum(dim=-1)
                parts[k, _MP], parts[k, _CP], parts[k, _MQ], parts[k, _CQ] = mp.squeeze(1), sp.log(), mq.squeeze(1), sq.log()
                if div.reverse:
                    # sum_i p_i (e^p_i - e^q_i) + (c_q - c_p); p > 0 = q gives +inf; NaN inputs reach the row through sp
                    cross = _row_sums(torch.sub(ep, eq, out=eq).mul_(u)).div_(sp)
                    parts[k, _KL] = cross + (parts[k, _CQ] - parts[k, _CP])
                elif div.weights is not None:  # the same for each KL taken: each part's own, merged below
                    s1, s2 = _kl_terms(torch.sub(ep, eq, out=eq), u, v, div)
                    # a part where one side has no mass (a recorded set outside a tile or a shard) keeps its +inf term:
                    # that side's log-sum shifts nothing there (the part's weight carries it when merged)
                    if s1 is not None:
                        parts[k, _KL] = s1.div_(sp) + (_finite(parts[k, _CQ]) - parts[k, _CP])
                    if s2 is not None:
                        parts[k, _KL2] = s2.div_(sq) + (_finite(parts[k, _CP]) - parts[k, _CQ])
                elif not again:  # the JSD of whole rows (a sampler's): normalized here
                    s1, s2 = _row_terms(ep.sub_(parts[k, _CP].unsqueeze(1)), eq.sub_(parts[k, _CQ].unsqueeze(1)), div, state)
                    parts[k, _KL], parts[k, _KL2] = s1, s2  # NaN inputs reach the row below, through c_p and c_q
                del ep, eq, u, v
            if len(tiles) == 1:
                stats[:, pos] = parts[0]
                return
            stats[_MP, pos], stats[_CP, pos], _, lwp = _merge(parts[:, _MP], parts[:, _CP], temp)  # tiles combine as ranks do
            stats[_MQ, pos], stats[_CQ, pos], _, lwq = _merge(parts[:, _MQ], parts[:, _CQ], temp)
            if div.reverse or (div.weights is not None and div.weights[1]):
                stats[_KL, pos] = _weighted(lwp, parts[:, _KL] + lwp - lwq)
            if div.weights is not None and div.weights[0]:
                stats[_KL2, pos] = _weighted(lwq, parts[:, _KL2] + lwq - lwp)

        _run(work, (src, ref), rows, state=True)
        local = stats[:_KL] if invalid is None else stats[:_KL].masked_fill(invalid, 0)  # NaN padding stays out
        kl, kl2 = stats[_KL], stats[-1]
        if part.ranks > 1:
            mp, cp, _, lwp = part.merge(local[_MP], local[_CP], temp)
            mq, cq, _, lwq = part.merge(local[_MQ], local[_CQ], temp)
            if div.reverse or (div.weights is not None and div.weights[1]):
                kl = part.combine(lwp, kl + lwp - lwq)
            if div.weights is not None and div.weights[0]:
                kl2 = part.combine(lwq, kl2 + lwq - lwp)
            local = torch.stack([mp, cp, mq, cq])
        if again:
            kl, kl2 = _jsd_again(src, ref, local, div, sampling, reference, part, rows, tiled, dtype, recorded)
        if not div.reverse and div.weights is None and not whole:  # NaN inputs reach the JSD's row through c_p, c_q
            carry = (local[_CP] + local[_CQ]).mul_(0)
            kl, kl2 = kl + carry, kl2 + carry
        value = kl if div.reverse else div.value(kl, kl2)
        if invalid is not None:
            value = value.masked_fill(invalid, 0)
        ctx.save_for_backward(x, weight, bias, rx, rweight, rbias)
        ctx.saved = (invalid, local, value, kl, kl2, recorded)
        ctx.sampling, ctx.reference, ctx.part, ctx.rows, ctx.tiled, ctx.whole = sampling, reference, part, rows, tiled, whole
        ctx.heads, ctx.div = (head, rhead), div
        return value.view(src.lead)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight, bias, rx, rweight, rbias = ctx.saved_tensors
        invalid, glob, value, s1, s2, recorded = ctx.saved
        sampling, reference, temp, div = ctx.sampling, ctx.reference, ctx.sampling.temperature, ctx.div
        src, ref = Source(Tensors(x, weight, bias, ctx.heads[0])), Source(Tensors(rx, rweight, rbias, ctx.heads[1]))
        dtype = glob.dtype
        g_out = grad_out.reshape(-1).to(dtype)
        if invalid is not None:
            g_out = g_out.masked_fill(invalid, 0)
        infinite = (value == float("inf")) & (g_out != 0)
        if div.reverse:
            against, why = _infinite_kl(reference, sampling, sampling.truncates or recorded is not None)
            what = f"the KL against {against}"
        else:
            what = f"the {div.name!r} divergence"
            why = (
                "(the other model has mass where the policy has none: with a truncating sampler, its mass outside the "
                "policy's kept set, unless reference='policy_kept'): its gradient does not exist. Use "
                "reference='policy_kept', divergence='jsd' (finite for 0 < beta < 1), or mask those tokens"
            )
        check_values(
            infinite,
            lambda: ValueError(f"{what} is +inf at {int(infinite.sum())} token(s) {why}."),
            f"{what} is +inf {why}",
        )
        # rows of scale 0 (masked, or a +inf KL without a gradient) get 0; rows with NaN inputs carry it here
        scale = (g_out / sampling.temperature).masked_fill_(value.isnan(), float("nan")).unsqueeze(1)
        kl = value.unsqueeze(1)
        s1, s2 = s1.unsqueeze(1), s2.unsqueeze(1)
        mp, cp, mq, cq = (t.unsqueeze(1) for t in glob)
        needs = ctx.needs_input_grad
        w_z, w_ref = _writer(src, needs[:3], dtype, invalid), _writer(ref, needs[4:7], dtype, invalid)

        def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
            pos, idx = item
            for cols in src.tiles(pos.stop - pos.start, ctx.tiled):
                direct = None if w_z is None or not div.reverse else w_z.direct(pos, dtype)  # g is made in the gradient's rows
                if ctx.whole:  # the forward's log-probs again, bitwise
                    logp, logq = _log_probs(src, idx, dtype, temp, state, "p", direct), _log_probs(ref, idx, dtype, temp, state, "q")
                else:
                    ep, eq, _, _ = _kl_shifted(
                        src, ref, item, dtype, sampling, reference, cols, state, (mp[pos], mq[pos]), direct, recorded, ctx.part.offset
                    )
                    logp, logq = ep.sub_(cp[pos]), eq.sub_(cq[pos])
                if not div.reverse:
                    _other_grads(logp, logq, div, s1[pos], s2[pos], scale[pos], w_z, w_ref, pos, idx, cols, state)
                    continue
                p = torch.exp(logp, out=_scratch(state, logp.shape, dtype, src.device, "u"))
                if w_ref is not None:  # (q - p) / T
                    to = w_ref.direct(pos, dtype)
                    g_ref = torch.exp(logq, out=_scratch(state, logq.shape, dtype, src.device, "v") if to is None else to).sub_(p)
                    w_ref.put(pos, idx, _scaled(g_ref, scale[pos]), cols)
                if w_z is not None:  # p (log p - log q - KL) / T
                    g = logp.sub_(logq).sub_(kl[pos]).mul_(p)
                    w_z.put(pos, idx, _scaled(g, scale[pos]), cols)
                del logp, logq, p

        if w_z is not None or w_ref is not None:
            _run(work, (src, ref), ctx.rows, state=True)
        return (*_grads(w_z, ctx.part), None, *_grads(w_ref, ctx.part), None, None, None, None, None, None, None, None)


def _jsd_again(
    src: Source, ref: Source, glob: Tensor, div: _Div, sampling: Sampling, reference: str, part: Partition, rows: int, tiled: bool,
    dtype: torch.dtype, recorded: Optional[_Recorded] = None,
) -> tuple[Tensor, Tensor]:
    """The JSD's row sums ``(s1, s2)`` over a head's tiles or a split vocabulary's shards: each part read
    again, normalized by the global shifts and log-sums ``glob [4, n]`` (``m_p, c_p, m_q, c_q``), its
    terms summed over the tiles, then over the ranks (a ``SUM``)."""
    mp, cp, mq, cq = (t.unsqueeze(1) for t in glob)
    sums = torch.zeros((2, src.n), dtype=dtype, device=src.device)

    def work(item: tuple[slice, slice | Tensor], state: Any) -> None:
        pos, idx = item
        for cols in src.tiles(pos.stop - pos.start, tiled):
            ep, eq, _, _ = _kl_shifted(src, ref, item, dtype, sampling, reference, cols, state, (mp[pos], mq[pos]), None, recorded, part.offset)
            s1, s2 = _row_terms(ep.sub_(cp[pos]), eq.sub_(cq[pos]), div, state)
            sums[0, pos] += s1  # type: ignore[operator]
            sums[1, pos] += s2  # type: ignore[operator]
            del ep, eq

    _run(work, (src, ref), rows, state=True)
    sums = part.reduce(sums, _SUM)
    return sums[0], sums[1]


def _other_grads(
    logp: Tensor, logq: Tensor, div: _Div, s1: Tensor, s2: Tensor, scale: Tensor, w_z: Optional[LogitsGrad | HeadGrad],
    w_ref: Optional[LogitsGrad | HeadGrad], pos: slice, idx: slice | Tensor, cols: slice, state: dict[str, Tensor],
) -> None:
    """A chunk's (or tile's) gradients of a divergence other than the reverse KL (:class:`_FullKL`'s forms),
    from both models' normalized log-probs; each written by its writer, scaled by ``scale [c, 1]``."""
    dtype, dev = logp.dtype, logp.device

    def target(w: LogitsGrad | HeadGrad, key: str) -> Tensor:
        to = w.direct(pos, dtype)
        return _scratch(state, logp.shape, dtype, dev, key) if to is None else to

    if div.weights is None:  # (1 - beta) p (log p - log m - s1), beta q (log q - log m - s2)
        assert div.beta is not None
        p, q, lm = _log_mix(logp, logq, div.beta, state)
        if w_z is not None:
            g = torch.sub(logp, lm, out=target(w_z, "g")).sub_(s1).mul_(p).mul_(1.0 - div.beta)
            w_z.put(pos, idx, _scaled(g, scale), cols)
        if w_ref is not None:
            g = torch.sub(logq, lm, out=target(w_ref, "h")).sub_(s2).mul_(q).mul_(div.beta)
            w_ref.put(pos, idx, _scaled(g, scale), cols)
        return
    w_f, w_r = div.weights
    p = torch.exp(logp, out=_scratch(state, logp.shape, dtype, dev, "u"))
    q = torch.exp(logq, out=_scratch(state, logq.shape, dtype, dev, "v"))
    if w_z is not None:  # w_r p (log p - log q - s1) + w_f (p - q)
        g = target(w_z, "g")
        if w_r:
            torch.sub(logp, logq, out=g).sub_(s1).mul_(p)
            if w_r != 1.0:
                g.mul_(w_r)
            g.add_(p, alpha=w_f).sub_(q, alpha=w_f)
        else:
            torch.sub(p, q, out=g)
        w_z.put(pos, idx, _scaled(g, scale), cols)
    if w_ref is not None:  # w_f q (log q - log p - s2) + w_r (q - p)
        g = target(w_ref, "h")
        if w_f:
            torch.sub(logq, logp, out=g).sub_(s2).mul_(q)
            if w_f != 1.0:
                g.mul_(w_f)
            if w_r:
                g.add_(q, alpha=w_r).sub_(p, alpha=w_r)
        else:
            torch.sub(q, p, out=g)
        w_ref.put(pos, idx, _scaled(g, scale), cols)
