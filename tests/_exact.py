"""Float64 maths written from the formulas, the plain float32 compositions, and ranks as threads.

Shared by tests/test_temperature.py and tests/test_logprobs_entropy.py.

* the reference: the quantity in float64 from the inputs, on the kept set that the float32 scores
  choose (the kept set is a selection, not a precision matter: the same selection is given to all
  three computations). From a head, the logits are the model's, ``h W^T + b`` made by ``F.linear`` in
  the head's dtype (the rounding of that matmul belongs to the model and is shared by the engine and
  the plain composition; at ``T = 1e-3`` it moves the KL by more than either's own error), with the
  gradients carried to ``h``, ``W`` and ``b`` in float64.
* ``plain_*``: what a user writes in float32: ``log_softmax(z.float() / T)`` (logits of a head made by
  ``F.linear`` in the head's dtype, as the model's own layer makes them).
* :class:`ThreadPartition`: a vocabulary split over "ranks" that are threads of this process, whose
  collectives are a stack and a max or a sum: the engine's own merge code, without processes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

import lightning_kl as lk
from lightning_kl.kernels import engine
from lightning_kl.ground.sampler import process_scores

NINF = float("-inf")


def _linear(h: Tensor, w: Tensor, b: Optional[Tensor], rows: int = 8) -> Tensor:
    # by blocks of 8 rows, as the engine's chunks make them (a half-precision matmul rounds by its shape,
    # and a truncating sampler's kept set follows those roundings)
    return torch.cat([F.linear(h[i : i + rows], w, b) for i in range(0, h.shape[0], rows)])


def logits_of(x: Any, dtype: torch.dtype) -> Tensor:
    """Logits ``[n, V]`` from logits or an ``lk.FromHidden``, as a model makes them in ``dtype``; float64
    leaves give those values with float64 gradients."""
    if isinstance(x, lk.FromHidden):  # plain heads (no logit scale, no soft cap: tests/test_heads.py has those)
        hwb = (x.hidden, x.weight, x.bias)
        if x.hidden.dtype != torch.float64:
            return _linear(*hwb)
        made = _linear(*(None if t is None else t.detach().to(dtype) for t in hwb))
        exact = F.linear(*hwb)
        return exact + (made.double() - exact).detach()
    return x


def removed_sets(z: Tensor, r: Optional[Tensor], sampling: lk.Sampling, reference: str) -> tuple[Tensor, Tensor]:
    """The kept sets (as ``removed`` masks) of the policy and of the reference, from float32 scores."""
    t = sampling.temperature
    if not sampling.truncates:
        off = torch.zeros(z.shape, dtype=torch.bool)
        return off, off
    rp = process_scores(z.float() / t, sampling) == NINF
    if r is None or reference == "unprocessed":
        return rp, torch.zeros_like(rp)
    if reference == "processed":
        return rp, process_scores(r.float() / t, sampling) == NINF
    return rp, rp  # policy_kept


def _log_probs(z: Tensor, removed: Tensor, t: float) -> Tensor:
    return torch.log_softmax((z / t).masked_fill(removed, NINF), dim=-1)


def quantities(z: Tensor, tokens: Tensor, sampling: lk.Sampling, removed: Tensor) -> tuple[Tensor, Tensor]:
    """Token log-probs and entropy of ``softmax(z / T)`` on the kept set, in ``z``'s dtype (autograd)."""
    logp = _log_probs(z, removed, sampling.temperature)
    p = logp.exp()
    lp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent = -(p * logp.masked_fill(p == 0, 0)).sum(-1)
    return lp, ent


def kl(z: Tensor, r: Tensor, sampling: lk.Sampling, removed: tuple[Tensor, Tensor]) -> Tensor:
    """The KL of the processed policy to the reference (``removed``: both kept sets), in ``z``'s dtype."""
    logp, logq = _log_probs(z, removed[0], sampling.temperature), _log_probs(r, removed[1], sampling.temperature)
    p = logp.exp()
    return (p * (logp - logq).masked_fill(p == 0, 0)).sum(-1)


def leaf(t: Optional[Tensor], dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    return None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True)


def max_error(got: Tensor, want: Tensor) -> float:
    """The largest absolute difference where the reference is finite (and the same infinities elsewhere)."""
    got, want = got.detach().double(), want.detach().double()
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin) or not fin.all(), "infinite where the reference is finite"
    return float((got[fin] - want[fin]).abs().max()) if fin.any() else 0.0


def floor(want: Tensor, dtype: torch.dtype = torch.float32) -> float:
    """Half an ulp of ``dtype`` (the result's) at the largest value, or half its smallest subnormal:
    no computation that rounds its result to ``dtype`` does better."""
    fin = want[torch.isfinite(want)]
    info = torch.finfo(dtype)
    return max(info.eps / 2 * (float(fin.abs().max()) if fin.numel() else 0.0), info.smallest_normal * info.eps / 2)


# ---------------------------------------------------------------------------------------------
# ranks as threads


class Exchange:
    """The collectives of ``world`` thread-ranks: each puts its tensor, all read the max or the sum."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[Optional[Tensor]] = [None] * world
        self.barrier = threading.Barrier(world, timeout=120)

    def all_reduce(self, rank: int, x: Tensor, op: str) -> Tensor:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        stacked = torch.stack(self.slots)  # type: ignore[arg-type]
        out = stacked.amax(0) if op == "max" else stacked.sum(0)
        self.barrier.wait()
        return x.copy_(out)


@dataclass(frozen=True)
class ThreadPartition(engine.Partition):
    """A split vocabulary whose ranks are threads (see :class:`Exchange`)."""

    exchange: Any = None
    rank: int = 0

    def reduce(self, x: Tensor, op: str) -> Tensor:
        return self.exchange.all_reduce(self.rank, x, op)


def on_thread_ranks(bounds: list[int], job: Callable[[int, slice, engine.Partition], Any]) -> list[Any]:
    """``job(rank, columns, partition)`` on one thread per shard ``[bounds[k], bounds[k+1])``; their results."""
    world = len(bounds) - 1
    ex = Exchange(world)
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            part = ThreadPartition(None, bounds[rank], world, True, ex, rank)
            out[rank] = job(rank, slice(bounds[rank], bounds[rank + 1]), part)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            ex.barrier.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return out


# ---------------------------------------------------------------------------------------------
# float64 values and gradients from the formulas (autograd through a float64 composition is not
# exact either: at T = 1e-3 it rounds 1 - p to 0 where the formula keeps it)


def formula_rows(z: Tensor, tokens: Tensor, t: float, removed: Tensor, g_lp: Optional[Tensor], g_ent: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Float64 token log-probs, entropies and the gradient w.r.t. ``z`` of ``sum(g_lp lp + g_ent H)``:
    ``([i = y] - p_i) / T`` and ``-p_i (log p_i + H) / T`` on the kept set."""
    z = z.detach().double()
    logp = _log_probs(z, removed, t)
    p = logp.exp()
    lp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent = -(p * logp.masked_fill(p == 0, 0)).sum(-1)
    grad = torch.zeros_like(z)
    if g_lp is not None:
        onehot = torch.zeros_like(z).scatter_(-1, tokens.unsqueeze(-1), 1.0)
        grad += g_lp.double().unsqueeze(-1) * (onehot - p) / t
    if g_ent is not None:
        grad += g_ent.double().unsqueeze(-1) * (-(p * (logp.masked_fill(p == 0, 0) + ent.unsqueeze(-1)))) / t
    return lp, ent, grad


def formula_kl(z: Tensor, r: Tensor, t: float, removed: tuple[Tensor, Tensor], g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Float64 KL and its gradients w.r.t. both logits: ``p_i (log p_i - log q_i - KL) / T`` and ``(q_i - p_i) / T``."""
    z, r = z.detach().double(), r.detach().double()
    logp, logq = _log_probs(z, removed[0], t), _log_probs(r, removed[1], t)
    p, q = logp.exp(), logq.exp()
    diff = (logp - logq).masked_fill(p == 0, 0)
    value = (p * diff).sum(-1)
    gz = g.double().unsqueeze(-1) * p * (diff - value.unsqueeze(-1)) / t
    gr = g.double().unsqueeze(-1) * (q - p) / t
    return value, gz, gr


def chain_head(grad_logits: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> list[Tensor]:
    """Gradients w.r.t. ``hidden``, ``weight`` (and ``bias``) of logits ``h W^T + b``, in float64."""
    h, w = hidden.detach().double(), weight.detach().double()
    out = [grad_logits @ w, grad_logits.T @ h]
    return out + ([grad_logits.sum(0)] if bias is not None else [])
