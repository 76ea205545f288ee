r"""Fused kernels for every estimator and its ``+`` variant: the physical floor on memory traffic.

The plain composition in :func:`lightning_kl.estimators.estimator_value` (cast, subtract, mask,
clamp, exp, add, then ``k2 - k2.detach() + value.detach()``) makes about a dozen passes over memory
and keeps several full-size temporaries alive until backward. Here one
:class:`torch.autograd.Function` per call

* walks the inputs in chunks (:data:`CHUNK` elements on CPU), does every step of a chunk in place in
  a few chunk-sized scratch buffers, and writes the value once; the chunks go to the package's chunk
  runner (:mod:`lightning_kl.ground.chunks`: on CPU a pool of threads, each running single-threaded
  ops on its chunks with scratch buffers of its own);
* saves only ``logprob``, ``ref_logprob`` and the mask (tensors the caller holds anyway), and in
  backward recomputes what the gradient needs chunk by chunk, reading the incoming gradient once and
  writing ``grad_logprob`` (and ``grad_ref = -grad_logprob``, only when ``ref_logprob`` requires a
  gradient) once, each in its input's dtype;
* is skipped altogether when no input requires a gradient (the callback's ``no_grad`` path): the
  chunked forward runs with no autograd bookkeeping.

Inputs of fewer than :data:`MIN_ELEMENTS` elements (on CPU) keep the composition (:func:`use_fused`):
they sit in cache either way, and a dozen plain ops cost less Python than the fused set-up. On other devices the
whole tensor is one chunk (one kernel per step, in place); that path has not been timed on a GPU.

Semantics are those of the composition, term for term (the estimator table of the docs): ``k3`` is the k3 of ``d``
clamped to ``[-20, 20]`` with a zero gradient outside, ``low_var_kl`` clamps that to ``[-10, 10]``
with a zero gradient where clamped (both ends inclusive, as :func:`torch.clamp`'s gradient), ``abs``
has gradient ``sign(d)`` (0 at 0), ``NAME+`` has the value of ``NAME`` and gradient ``d`` (and the
value NaN where ``d`` is not finite, as the composition's ``k2 - k2.detach()`` gives: see
:mod:`lightning_kl.estimators`); where the mask is False the value is 0 and both gradients are
exactly 0 whatever the inputs hold (NaN, inf).
Forward values are bitwise those of the composition (same operations in the same order).

Half precision inputs are read chunk by chunk into float32 scratch, so nothing full-size is ever
cast. Non-contiguous inputs (and a broadcast incoming gradient, as ``out.sum().backward()`` gives)
are walked by views along their logical shape, never copied. Shapes must already be equal (no
broadcasting; the callers check).

Double backward (``create_graph=True``) works but is not fused: the backward then recomputes the
composition's graph from the saved inputs and differentiates it, so the gradient is itself
differentiable. Under ``torch.compile`` the composition is used instead (the compiler fuses it
itself; a Python chunk loop would be unrolled into the graph).

Why no compiled kernel: measured on the project's 2-core CPU machine, ``torch.compile`` of the
``k3+`` composition runs 8M float32 tokens forward+backward in 60 ms against 70 ms here, but its
first call compiles for 16 s, again for every estimator, dtype and (until it goes dynamic) shape,
and it needs a C++ toolchain at run time; the test suite would pay that for every estimator. The
chunked eager kernels below need neither (``benchmarks/bench_estimators.py --compile``).
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_kl.estimators import K3_CLAMP, LOW_VAR_KL_CLAMP, EstimatorSpec, estimator_value
from lightning_kl.ground.chunks import run_chunks

__all__ = ["CHUNK", "ENABLED", "FUSED_BASES", "MIN_ELEMENTS", "fused_kl_value", "use_fused"]

#: Elements per chunk on CPU: 2^20, each chunk's two or three float32 scratch buffers 4 MiB (one set
#: per worker of the chunk runner's pool). Measured on the project's 2-core machine under a load of
#: 10-16 (other processes), the pool on: k3+ at [1024, 8192] forward+backward took 0.97x the
#: composition's time in chunks of 2^20, 1.25x-1.6x in chunks of 2^15 to 2^18 (each chunk's Python
#: holds the GIL between ops, and a worker preempted while holding it stalls the other); at a
#: load of about 5, ``benchmarks/compare.py`` gave 0.33x (0.26x at 452e35a). Other devices take the whole tensor as one chunk (one
#: kernel launch per step: the in-place work and the saved-nothing backward still apply); its two or
#: three float32 scratch buffers are the size of the value (``[b, t]``: 32 MiB each at 8M tokens).
CHUNK = 1 << 20

#: Inputs of fewer elements take the composition on CPU (:func:`use_fused`): at 32768 (``[8, 4096]``) the
#: fused kernel was 1.45x-1.7x faster, at 1K-2K elements the composition up to 2x.
MIN_ELEMENTS = 1 << 15

#: Set to False to route :func:`lightning_kl.functional.kl_penalty_compute` through the plain
#: composition (the benchmark and the tests compare both).
ENABLED = True

#: The base estimators with a fused kernel (every sampled-token estimator).
FUSED_BASES: frozenset[str] = frozenset(("k1", "abs", "k2", "k3", "low_var_kl"))


def use_fused(spec: EstimatorSpec, logprob: Tensor) -> bool:
    """Whether :func:`fused_kl_value` serves ``spec`` on ``logprob`` (else the caller composes the maths).

    Inputs of fewer than :data:`MIN_ELEMENTS` elements (on CPU) take the composition: they fit in cache
    whichever way, and its dozen ops cost less Python than the fused path's set-up (up to 2x faster
    at 1K-2K tokens; from 32768, ``[8, 4096]``, the fused path is faster:
    ``benchmarks/bench_cpu_machinery.py``).
    """
    return (
        ENABLED
        and spec.base in FUSED_BASES
        and (logprob.numel() >= MIN_ELEMENTS or logprob.device.type != "cpu")
        and not torch.compiler.is_compiling()
    )


def fused_kl_value(
    logprob: Tensor,
    ref_logprob: Tensor,
    spec: EstimatorSpec,
    mask: Optional[Tensor],
    dtype: torch.dtype,
    chunk: Optional[int] = None,
) -> Tensor:
    """``estimator_value(spec, where(mask, logprob - ref_logprob, 0))`` in ``dtype``, fused.

    Args:
        logprob, ref_logprob: ``[...]`` floating tensors of the same shape and device (any dtypes,
            any strides).
        spec: the parsed estimator.
        mask: ``None`` or a bool tensor of the same shape, True on valid tokens.
        dtype: the compute dtype (the result's), at least float32.
        chunk: elements per chunk (default: :data:`CHUNK` on CPU, the whole tensor elsewhere).

    Returns:
        A new contiguous tensor of the inputs' shape in ``dtype``, differentiable w.r.t. whichever
        input requires a gradient (twice too, through the composition: see the module's notes).
    """
    if chunk is None:
        chunk = CHUNK if logprob.device.type == "cpu" else max(1, logprob.numel())
    if torch.is_grad_enabled() and (logprob.requires_grad or ref_logprob.requires_grad):
        return FusedKLPenalty.apply(logprob, ref_logprob, mask, spec, dtype, chunk)
    return _forward(logprob, ref_logprob, mask, spec.base, spec.straight_through, dtype, chunk)


class FusedKLPenalty(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logprob: Tensor,
        ref_logprob: Tensor,
        mask: Optional[Tensor],
        spec: EstimatorSpec,
        dtype: torch.dtype,
        chunk: int,
    ) -> Tensor:
        # the inputs themselves, not d: no full-size temporary outlives the forward
        ctx.save_for_backward(logprob, ref_logprob, mask)
        ctx.spec, ctx.dtype, ctx.chunk = spec, dtype, chunk
        return _forward(logprob, ref_logprob, mask, spec.base, spec.straight_through, dtype, chunk)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        logprob, ref_logprob, mask = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():
            # create_graph=True: the gradient must itself be differentiable, so take it through the
            # composition's graph (the slow path, used only for double backward)
            grads = _composed_backward(grad, logprob, ref_logprob, mask, ctx.spec, ctx.dtype, need)
        else:
            grads = _backward(
                grad, logprob, ref_logprob, mask, ctx.spec.base, ctx.spec.straight_through, ctx.dtype, ctx.chunk, *need
            )
        return grads[0], grads[1], None, None, None, None


def _composed_backward(
    grad: Tensor,
    logprob: Tensor,
    ref_logprob: Tensor,
    mask: Optional[Tensor],
    spec: EstimatorSpec,
    dtype: torch.dtype,
    need: tuple[bool, bool],
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    d = logprob.to(dtype) - ref_logprob.to(dtype)
    if mask is not None:
        d = torch.where(mask, d, torch.zeros((), dtype=dtype, device=d.device))
    value = estimator_value(spec, d)
    inputs = [t for t, n in zip((logprob, ref_logprob), need) if n]
    found = iter(torch.autograd.grad(value, inputs, grad, create_graph=True, allow_unused=True))
    return tuple(next(found) if n else None for n in need)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# chunking


def _chunk_index(shape: tuple[int, ...], chunk: int) -> list[tuple]:
    """Index tuples that cut a tensor of ``shape`` into row-major blocks of at most ~``chunk`` elements.

    The blocks depend on the shape alone, so every tensor of that shape is cut the same way,
    whatever its strides. Cuts go along the outermost dimension whose inner block fits the chunk.
    """
    if any(s == 0 for s in shape):
        return []
    k, inner = len(shape) - 1, 1
    while k > 0 and inner * shape[k] <= chunk:
        inner *= shape[k]
        k -= 1
    step = max(1, chunk // inner)
    return [
        outer + (slice(j, j + step),)
        for outer in itertools.product(*(range(s) for s in shape[:k]))
        for j in range(0, shape[k], step)
    ]


def _chunks(chunk: int, *tensors: Optional[Tensor]) -> list[tuple[Optional[Tensor], ...]]:
    """Aligned chunk views of same-shaped tensors (``None`` stays ``None``), without copies."""
    present = [t for t in tensors if t is not None]
    if present[0].numel() <= chunk:
        return [tensors]  # one chunk: the tensors themselves, whatever their strides
    if all(t.is_contiguous() for t in present):
        flat = [None if t is None else t.view(-1) for t in tensors]  # a 0-d tensor becomes [1]
        n = present[0].numel()
        return [tuple(None if t is None else t[i : i + chunk] for t in flat) for i in range(0, n, chunk)]
    index = _chunk_index(tuple(present[0].shape), chunk)
    return [tuple(None if t is None else t[i] for t in tensors) for i in index]


def _scratch(buf: Tensor, like: Tensor) -> Tensor:
    """A scratch buffer (shaped like the first chunk) viewed as a chunk shaped like ``like``."""
    if buf.shape == like.shape:
        return buf
    return buf.view(-1)[: like.numel()].view(like.shape)


def _d_into(out: Tensor, logprob: Tensor, ref_logprob: Tensor) -> None:
    """``out = logprob - ref_logprob`` computed in ``out``'s dtype (never in a half dtype)."""
    if torch.promote_types(logprob.dtype, ref_logprob.dtype) == out.dtype:
        torch.sub(logprob, ref_logprob, out=out)
    else:
        # torch.sub(out=float32) of two half tensors would subtract in the half dtype
        out.copy_(logprob)
        out.sub_(ref_logprob)


# ---------------------------------------------------------------------------------------------
# the chunk loop: the package's one runner, with scratch buffers reused by every chunk


def _run(
    chunks: list, work: Callable[[tuple, list[Tensor]], None], n_scratch: int, like: Tensor, dtype: torch.dtype
) -> None:
    """``work(chunk, scratch)`` for every chunk, through :func:`~lightning_kl.ground.chunks.run_chunks`.

    ``n_scratch`` buffers, shaped like the first (a largest) chunk, serve every chunk.
    """
    shape = chunks[0][0].shape if chunks else (0,)

    def scratch() -> list[Tensor]:
        return [torch.empty(shape, dtype=dtype, device=like.device) for _ in range(n_scratch)]

    run_chunks(work, chunks, like.device, scratch)


# ---------------------------------------------------------------------------------------------
# forward: the value


def _bits(x: Tensor) -> Tensor:
    """``x`` viewed as signed integers of its width: float bit patterns to mask with ``&``."""
    return x.view(_INT_OF[x.dtype])


_INT_OF = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _mask_bits(out: Tensor, mask: Tensor) -> Tensor:
    """``out`` (a float scratch chunk) as integers: all ones where ``mask``, 0 elsewhere."""
    bits = _bits(out)
    bits.copy_(mask)  # 1 / 0
    return bits.neg_()  # -1 (every bit set) / 0


def _ones_to_bits(x: Tensor) -> Tensor:
    """A float chunk holding 1.0 / 0.0 (an in-place comparison's result) as all-ones / 0 integers."""
    bits = _bits(x)
    # 1.0 is 0b0011 1111 1...: its top three bits are 001, so a right shift by (width - 3) leaves 1
    return bits.bitwise_right_shift_(8 * x.element_size() - 3).neg_()


# Masking is done on bit patterns (``value_bits &= keep_bits``): an exact +0.0 wherever the mask is
# off whatever the value held (NaN, inf), like torch.where, but with vectorized integer ops: this
# torch's CPU kernels for bool tensors (where, comparisons into bool, logical_and) are scalar loops,
# 5-10x slower than the rest of a chunk's work together.


def _forward(
    logprob: Tensor,
    ref_logprob: Tensor,
    mask: Optional[Tensor],
    base: str,
    straight_through: bool,
    dtype: torch.dtype,
    chunk: int,
) -> Tensor:
    out = torch.empty(logprob.shape, dtype=dtype, device=logprob.device)
    if out.numel() == 0:
        return out
    k3 = base in ("k3", "low_var_kl")

    def work(c: tuple, scratch: list[Tensor]) -> None:
        o, lp, ref, m = c
        _d_into(o, lp, ref)
        if m is not None:
            _bits(o).bitwise_and_(_mask_bits(_scratch(scratch[0], o), m))
        if straight_through:
            # the composition's straight-through term k2 - k2.detach(): +0.0 where d is finite, NaN
            # where it is not (inf - inf), so that a '+' name's value is NaN at a valid non-finite d
            poison = _scratch(scratch[1], o)
            torch.mul(o, o, out=poison)
            poison.sub_(poison)
        if base == "abs":
            o.abs_()
        elif base == "k2":
            o.square_().mul_(0.5)
        elif k3:
            # the composition's k3 = expm1(-c) + c of c = clamp(d), step for step
            t = _scratch(scratch[0], o)
            o.clamp_(-K3_CLAMP, K3_CLAMP)
            torch.neg(o, out=t)
            t.expm1_()
            o.add_(t)
            if base == "low_var_kl":
                o.clamp_(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
        if straight_through:
            o.add_(poison)

    n_scratch = 2 if straight_through else 1 if k3 or mask is not None else 0
    _run(_chunks(chunk, out, logprob, ref_logprob, mask), work, n_scratch, out, dtype)
    return out


# ---------------------------------------------------------------------------------------------
# backward: the gradient, recomputed chunk by chunk


def _backward(
    grad: Tensor,
    logprob: Tensor,
    ref_logprob: Tensor,
    mask: Optional[Tensor],
    base: str,
    straight_through: bool,
    dtype: torch.dtype,
    chunk: int,
    need_logprob: bool,
    need_ref: bool,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    device = logprob.device
    grad_logprob = torch.empty(logprob.shape, dtype=logprob.dtype, device=device) if need_logprob else None
    grad_ref = torch.empty(ref_logprob.shape, dtype=ref_logprob.dtype, device=device) if need_ref else None
    if logprob.numel() == 0 or not (need_logprob or need_ref):
        return grad_logprob, grad_ref
    # the gradient w.r.t. logprob is computed straight into grad_logprob when that is the only
    # output and already in the compute dtype; otherwise in a float scratch chunk, then written out
    direct = grad_logprob is not None and grad_ref is None and grad_logprob.dtype == dtype
    kind = "d" if straight_through or base == "k2" else base
    k3 = kind in ("k3", "low_var_kl")

    def work(chunk_views: tuple, scratch: list[Tensor]) -> None:
        g, lp, ref, m, glp, gref = chunk_views
        w = glp if direct else _scratch(scratch[2], lp)
        keep = None  # bits: all ones where the gradient may be nonzero
        if kind == "d":  # k2 and every '+': d * g
            _d_into(w, lp, ref)
            w.mul_(g)
        elif kind == "k1":
            w.copy_(g)
        elif kind == "abs":
            _d_into(w, lp, ref)
            w.sign_()
            w.mul_(g)
        else:  # k3 / low_var_kl: (1 - exp(-c)) * g where -20 <= d <= 20 (and k3 within the clamp)
            k, c = _scratch(scratch[0], lp), _scratch(scratch[1], lp)
            _d_into(k, lp, ref)
            torch.clamp(k, -K3_CLAMP, K3_CLAMP, out=c)
            keep = _ones_to_bits(k.eq_(c))  # 0 outside the clamp and at NaN, as clamp's gradient
            torch.neg(c, out=w)
            w.expm1_()  # w = expm1(-c); the gradient factor is -w = 1 - exp(-c)
            if kind == "low_var_kl":
                c.add_(w)  # c = k3 (the composition's order: expm1(-c) + c)
                keep.bitwise_and_(_ones_to_bits(c.abs_().le_(LOW_VAR_KL_CLAMP)))
            w.mul_(g).neg_()
        if m is not None:
            mask_bits = _mask_bits(_scratch(scratch[1], lp), m)
            keep = mask_bits if keep is None else keep.bitwise_and_(mask_bits)
        if keep is not None:
            _bits(w).bitwise_and_(keep)
        if not direct:
            if glp is not None:
                glp.copy_(w)
            if gref is not None:
                if gref.dtype == dtype:
                    torch.neg(w, out=gref)
                else:
                    gref.copy_(w.neg_())

    # scratch: [0] keep bits (k3), [1] the clamp (k3) then the mask bits, [2] the gradient if not direct
    n_scratch = 3 if not direct else 2 if k3 or mask is not None else 0
    chunks = _chunks(chunk, grad, logprob, ref_logprob, mask, grad_logprob, grad_ref)
    _run(chunks, work, n_scratch, logprob, dtype)
    return grad_logprob, grad_ref
