r"""The other side as served top-k log-probs: the exact divergence between two distributions coarsened
onto the teacher's ``k`` ids and one tail cell.

An inference server (vLLM, SGLang: ``prompt_logprobs=k``) returns per position the ``k`` most likely
token ids of the teacher and their log-probs, :class:`TopK`. Per row, with :math:`I` those ids,
:math:`\tilde p` the student's distribution (the sampler's processed one) and :math:`q` the teacher's,
the ``k + 1`` cells are the ids and the rest of the vocabulary:

.. math::
    P = (\tilde p_{i_1}, \dots, \tilde p_{i_k},\; 1 - \textstyle\sum_{i \in I} \tilde p_i), \qquad
    Q = (q_{i_1}, \dots, q_{i_k},\; 1 - \textstyle\sum_{i \in I} q_i),
    \qquad D_I = D(P, Q)

with :math:`D` any divergence of :mod:`lightning_kl.kernels.divergence` (``"reverse"``
:math:`\mathrm{KL}(P \,\|\, Q)`, ``"forward"``, ``"jsd"``, ``"mixed"``). Each tail cell holds the rest
of its own model's mass: the student's is :math:`1 - \sum_{i \in I} \tilde p_i` of the student's
log-probs at the ids, the teacher's :math:`1 - \sum_{i \in I} e^{\ell_i}` of the served log-probs
:math:`\ell`, both as :math:`\log(1 - e^{a})` of the log-sum-exp :math:`a` of the ``k`` log-probs
(``log(-expm1(a))`` near 0, ``log1p(-exp(a))`` below :math:`-\log 2`).

* :math:`D_I` is a divergence of two distributions: never negative, 0 when they agree on the cells.
* :math:`P, Q` are the images of :math:`\tilde p, q` under one map of the vocabulary onto ``k + 1``
  cells, so by the data-processing inequality :math:`D_I \le D(\tilde p, q)`: a lower bound of the
  full divergence, its bias :math:`D - D_I \ge 0` (0 at ``k = V``, where the cells are the vocabulary).
* Its gradient w.r.t. the student is exact for :math:`D_I`: the student's log-probs at the ids come
  from the engine in one chunked pass (differentiable, no ``[n, V]`` buffer; logits,
  :class:`~lightning_kl.FromHidden`, vocabulary shards), and autograd forms the ``k + 1`` cells.

**A sampler on the student's side.** :math:`\tilde p` is the student's processed distribution (the
temperature, then top-k / top-p / min-p as ``generate`` applies them): it has no mass outside its kept
set :math:`K`. An id of the teacher's list outside :math:`K` keeps its own cell with student mass 0
(never merged into the tail); the student's tail is the kept mass outside the ids,
:math:`\tilde p(K \setminus I)`. The teacher is taken as served (its unprocessed distribution, at
whatever temperature the server scored): the coarsening of ``lk.full_kl(..., reference="unprocessed")``,
the finest partition the payload allows, so the tightest lower bound of that full divergence. Hence
``"reverse"`` and ``"jsd"`` (``0 < beta < 1``) are finite, while ``"forward"`` and ``"mixed"``
(``beta < 1``) are ``+inf`` on a row where the teacher has mass on an id outside :math:`K`, a cell the
student cannot sample: the full forward KL is infinite there too.
A backward through an infinite value raises (as ``reference="processed"`` does). The references
``"processed"`` and ``"policy_kept"`` need the teacher's whole row: refused with a truncating sampler.

**Neutral entries.** A ``-inf`` log-prob is padding (a shorter list): the entry is no cell, its id is
not read (any value). Rows where ``mask`` is False get 0 and exactly zero gradient, and their payload
is not checked.

**The tails' resolution.** A tail is a difference :math:`1 - \sum`: the cells' maths runs in float64,
so it is known to about the rounding of the log-probs it is summed from, whatever its size. A tail of
at most ``32`` units in the last place of its log-probs' dtype (the student's compute dtype: 3.8e-6 in
float32, 7.1e-15 in float64; the served log-probs' dtype, at most :attr:`TopK.tolerance`) is not
resolved: where both tails are, both are 0 (the cells hold all the mass: ``k = V``, or a kept set among
the ids against a teacher whose list holds all of its mass); where one is, it counts as its floor (it
lies in ``[0, floor]``; 0 would make a ``log 0`` of the rounding). So the value is exact up to what a
change of a tail by its floor moves it, and a student tail that is exactly 0 (a kept set among the ids)
against a teacher's resolved tail gives the forward directions a large finite value, not ``+inf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_kl.ground.checks import check_mask, check_values, compute_dtype
from lightning_kl.kernels.divergence import check_divergence, pointwise
from lightning_kl.kernels.engine import REFERENCES, token_logprobs_kernel
from lightning_kl.ground.sampler import Sampling
from lightning_kl.kept_inputs import check_kept
from lightning_kl.logprobs import FromHidden, sampler_of, source_of

__all__ = ["TopK", "TopKDivergence", "topk_divergence"]

_NINF = float("-inf")
_LN2 = math.log(2.0)
_ULPS = 32  # the tails' resolution, in units in the last place of the log-probs' dtype (see the module's docs)


@dataclass(frozen=True, eq=False)
class TopK:
    r"""A teacher's top-k log-probs per position, as inference servers return them: the other side of
    :func:`lightning_kl.full_kl` (``lk.full_kl(x, lk.TopK(ids, logprobs), mask, divergence=...)``).

    The divergence is then the exact one between the student's and the teacher's distributions
    coarsened onto the ``k`` ids and one tail cell (:mod:`lightning_kl.distill.topk`): never negative,
    at most the full divergence (the data-processing inequality), equal to it at ``k = V``.

    Attributes:
        ids: ``[..., k]`` integer token ids (the student's leading dims, then ``k``), distinct in a row;
            the sampled token's own may be among them.
        logprobs: ``[..., k]`` the teacher's log-probs of those ids, ``<= 0``; ``-inf`` marks padding
            of a shorter list (that entry's id is not read).

    Checked here: the types, the shapes (equal, with a last dimension ``k >= 1``) and the device. Checked
    with the student, on the rows its ``mask`` keeps (each error names the first position): ids in
    ``[0, V)``, no duplicate id in a row, no NaN, log-probs at most :attr:`tolerance` above 0 (those
    within it count as 0), and a row's top-k mass :math:`\sum e^{\ell}` at most ``1 + tolerance``
    (a tail below what it resolves then: see the tails' resolution in :mod:`lightning_kl.distill.topk`).

    Example:
        >>> teacher = TopK(torch.tensor([[2, 0]]), torch.tensor([[-0.2, -2.0]]))  # q = 0.819, 0.135; tail 0.046
        >>> topk_divergence(torch.tensor([[0.0, 0.0, 1.0]]), teacher, return_tails=True)  # p = 0.576, 0.212; tail 0.212
        TopKDivergence(value=tensor([0.2167]), student_tail=tensor([0.2119]), teacher_tail=tensor([0.0459]))
    """

    ids: Tensor
    logprobs: Tensor

    #: How far a served log-prob may lie above 0, and a row's top-k mass above 1, before it is refused:
    #: a float32 log-softmax's rounding, with room (vLLM's top log-prob of a near-certain token is a few
    #: 1e-7 above 0 at times).
    tolerance: ClassVar[float] = 1e-4

    def __post_init__(self) -> None:
        ids, lp = self.ids, self.logprobs
        if not isinstance(ids, Tensor) or not isinstance(lp, Tensor):
            raise TypeError(f"TopK takes two tensors (ids, logprobs), got {type(ids).__name__} and {type(lp).__name__}.")
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"TopK `ids` must be an integer tensor of token ids, got dtype {ids.dtype}.")
        if not lp.is_floating_point():
            raise TypeError(f"TopK `logprobs` must be a floating point tensor, got dtype {lp.dtype}.")
        if ids.shape != lp.shape or ids.ndim == 0 or ids.shape[-1] == 0:
            raise ValueError(
                f"TopK `ids` and `logprobs` must have one shape [..., k] with k >= 1: got ids {tuple(ids.shape)} "
                f"and logprobs {tuple(lp.shape)}."
            )
        if ids.device != lp.device:
            raise ValueError(f"TopK `ids` is on {ids.device} but `logprobs` is on {lp.device}.")

    @property
    def k(self) -> int:
        """The number of entries per position."""
        return self.ids.shape[-1]

    def __repr__(self) -> str:
        return f"TopK(ids={tuple(self.ids.shape)} {self.ids.dtype}, logprobs={tuple(self.logprobs.shape)} {self.logprobs.dtype})"


class TopKDivergence(NamedTuple):
    """:func:`topk_divergence`'s result with ``return_tails=True``: the divergence, and each row's tail
    mass for both models (without grad; 0 on masked rows), each ``[...]``."""

    value: Tensor
    student_tail: Tensor
    teacher_tail: Tensor


def _where(lead: torch.Size, row: int, slot: Optional[int] = None) -> tuple[int, ...]:
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(row), lead)) if len(lead) else ()
    return pos if slot is None else (*pos, slot)


def _refuse(bad: Tensor, lead: torch.Size, what: Any, rule: str) -> None:
    """Fail where ``bad [n, k]`` (or ``[n]``) holds True; ``what(row, slot)`` words the error at the first one."""

    def named() -> ValueError:
        first = bad.nonzero()[0].tolist()
        return ValueError(f"{what(*first)} ({int(bad.sum())} in all): {rule}.")

    check_values(bad, named, rule)


def _checked(topk: TopK, lead: torch.Size, vocab: Optional[int], valid: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The payload's ids ``[n, k]`` (int64, padding and masked rows' read as 0) and log-probs ``[n, k]`` in
    ``dtype`` (``-inf`` on padding and masked rows, at most 0), after the value checks on the kept rows."""
    n, k = valid.shape[0], topk.k
    ids = topk.ids.reshape(n, k).long()
    raw = topk.logprobs.reshape(n, k)
    live = valid.unsqueeze(1) & (raw != _NINF)  # the entries that are cells
    tol = TopK.tolerance

    def at(r: int, j: Optional[int] = None) -> str:
        return f"position {_where(lead, r, j)}"

    nan = live & raw.isnan()
    _refuse(nan, lead, lambda r, j: f"TopK log-prob NaN at {at(r, j)}", "served log-probs must be <= 0, or -inf for padding")
    high = live & (raw > tol)
    _refuse(
        high, lead, lambda r, j: f"TopK log-prob {float(raw[r, j]):.6g} above 0 at {at(r, j)}",
        f"served log-probs must be <= 0 (up to a rounding of {tol}), or -inf for padding; a logit or a score is no log-prob",
    )
    if vocab is not None:
        out = live & ((ids < 0) | (ids >= vocab))
        _refuse(
            out, lead, lambda r, j: f"TopK id {int(ids[r, j])} out of range at {at(r, j)}",
            f"ids must lie in [0, V) of the student's vocabulary, V={vocab}",
        )
    key = torch.where(live, ids, -1 - torch.arange(k, device=ids.device))  # padding: distinct negatives
    ordered = key.sort(dim=-1).values
    dup = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)

    def duplicate(r: int, j: int) -> str:
        value = int(ordered[r, j])
        slots = (live[r] & (ids[r] == value)).nonzero().squeeze(1).tolist()
        return f"TopK id {value} twice in the row at {at(r)} (entries {slots})"

    _refuse(dup, lead, duplicate, "a row's ids must be distinct (one cell each)")
    lq = torch.where(live, raw.to(dtype), _NINF).clamp_(max=0.0)
    mass = torch.logsumexp(lq, dim=-1)
    over = valid & (mass > math.log1p(tol))
    _refuse(
        over, lead, lambda r: f"TopK mass {math.exp(float(mass[r])):.6g} above 1 at {at(r)}",
        f"a row's top-k probabilities must sum to at most 1 (up to a rounding of {tol})",
    )
    return ids.masked_fill(~live, 0), lq


def _log_tail(lp: Tensor) -> Tensor:
    r""":math:`\log(1 - \sum_j e^{lp_j})` per row, differentiable, ``-inf`` at or below 0; no NaN in the
    gradient where the cells hold all the mass or none."""
    top = lp.detach().amax(dim=-1, keepdim=True)
    top = torch.where(top == _NINF, 0.0, top)
    s = torch.exp(lp - top).sum(dim=-1)
    has = s > 0
    a = torch.where(has, top.squeeze(-1) + torch.log(torch.where(has, s, 1.0)), _NINF)  # log-sum-exp, -inf when empty
    near = a > -_LN2  # log(-expm1(a)) there, log1p(-exp(a)) below: each branch on its own safe input
    a_near = torch.where(near & (a < 0), a, -1.0)
    a_far = torch.where(near, -1.0, a)
    lt = torch.where(near, torch.log(-torch.expm1(a_near)), torch.log1p(-torch.exp(a_far)))
    return torch.where(a < 0, lt, _NINF)


def _floor(dtype: torch.dtype, cap: float = 1.0) -> float:
    """The smallest tail a ``1 - sum`` of log-probs of ``dtype`` resolves: the sum is known to a few ulps."""
    return min(_ULPS * torch.finfo(dtype).eps, cap)


def _resolved(lt_p: Tensor, floor_p: float, lt_q: Tensor, floor_q: float) -> tuple[Tensor, Tensor]:
    """Tails below their floor: both 0 where both are (the cells hold all the mass), else the floor."""
    low_p, low_q = lt_p <= math.log(floor_p), lt_q <= math.log(floor_q)
    both = low_p & low_q
    lt_p = torch.where(both, _NINF, torch.where(low_p, math.log(floor_p), lt_p))
    return lt_p, torch.where(both, _NINF, torch.where(low_q, math.log(floor_q), lt_q))


def topk_divergence(
    x: Any,
    topk: TopK,
    mask: Optional[Tensor] = None,
    *,
    sampling: Any = None,
    divergence: str = "reverse",
    beta: Optional[float] = None,
    reference: str = "unprocessed",
    chunk_size: Optional[int] = None,
    return_tails: bool = False,
    kept: Any = None,
) -> Tensor | TopKDivergence:
    r"""Per-token divergence between the student ``x`` and a teacher's top-k log-probs, coarsened onto the
    ``k`` ids and a tail (:mod:`lightning_kl.distill.topk`); what ``lk.full_kl(x, lk.TopK(...), mask)`` computes.

    Args:
        x: the student: ``[..., V]`` logits, a vocabulary shard (DTensor ``Shard(-1)`` or
            :class:`~lightning_kl.VocabShard`: each id is owned by one shard), or :class:`~lightning_kl.FromHidden`.
        topk: the teacher's :class:`TopK`, ``[..., k]``.
        mask: optional ``[...]``, True on valid tokens (value 0, gradient exactly 0 and no payload check elsewhere).
        sampling: the student's sampler (:class:`~lightning_kl.Sampling`); truncation refused on a split vocabulary.
        divergence, beta: as :mod:`lightning_kl.kernels.divergence` (default ``"reverse"``).
        reference: ``"unprocessed"``; the other references need the teacher's whole row (refused under truncation).
        chunk_size: rows per chunk of the engine's pass.
        return_tails: also return each row's tail mass for both models (:class:`TopKDivergence`).
        kept: replay (as ``lk.full_kl``'s ``kept=``): the student's recorded kept sets in place of its
            sampler's (``reference="unprocessed"`` only); an id outside a position's set keeps its cell with
            student mass 0, as under truncation.

    Returns:
        ``[...]`` the divergence per token (float32; float64 for float64 inputs), differentiable w.r.t. the student.

    Raises:
        TypeError: for a student that is not logits, a shard or ``lk.FromHidden``; a bad ``sampling``.
        ValueError: for shapes or devices that do not match (named), a bad divergence or ``beta``, a bad payload
            (:class:`TopK`, the position named), a reference that needs the teacher's whole row; in backward, for a
            ``+inf`` value with a gradient.
    """
    name, beta = check_divergence(divergence, beta)
    if not isinstance(topk, TopK):
        raise TypeError(f"`topk` must be an lk.TopK, got {type(topk).__name__}.")
    proc = sampler_of(sampling, {}, "full_kl")
    if reference not in REFERENCES:
        raise ValueError(f"`reference` must be one of {REFERENCES}, got {reference!r}.")
    if (proc.truncates or kept is not None) and reference != "unprocessed":
        raise ValueError(
            f"reference={reference!r} with a truncating sampler (or a replayed kept set) needs the teacher's whole row (its own processing, or "
            "its mass on the student's kept set); a top-k payload has k entries: use reference='unprocessed' (the "
            "teacher as served; an id outside the student's kept set keeps its cell with student mass 0)."
        )
    if not isinstance(return_tails, bool):
        raise TypeError(f"`return_tails` must be a bool, got {return_tails!r}.")
    hidden = isinstance(x, FromHidden)
    like = "hidden" if hidden else "logits"
    if kept is not None:  # the record replaces the sampler's truncation: its temperature only
        proc = Sampling(proc.temperature)
    src, part, lead_t = source_of(x, "x" if hidden else "logits", proc)
    lead = lead_t.shape[:-1]
    if topk.ids.shape[:-1] != lead:
        raise ValueError(
            f"TopK must be [..., k] over the student's positions: got ids {tuple(topk.ids.shape)} and {like} "
            f"{tuple(lead_t.shape)} (expected ids {(*tuple(lead), topk.k)})."
        )
    if topk.ids.device != lead_t.device:
        raise ValueError(f"TopK is on {topk.ids.device} but `{like}` is on {lead_t.device}.")
    mask = check_mask(mask, lead_t, like, without="the last dimension")
    if kept is not None:
        kept = check_kept(kept, x, mask, proc.temperature)
    n, k = lead.numel(), topk.k
    valid = torch.ones(n, dtype=torch.bool, device=lead_t.device) if mask is None else mask.reshape(-1)
    vocab = None if part.split else (src.x.shape[-1] if src.weight is None else src.weight.shape[0])
    out_dtype = compute_dtype(src.x, topk.logprobs)
    ids, lq = _checked(topk, lead, vocab, valid, torch.float64)  # the k + 1 cells' maths in float64: [n, k + 1]
    lp, _, _ = token_logprobs_kernel(src, ids, None if mask is None else ~valid, proc, part, chunk_size, replay=kept)
    lp = torch.where(lq == _NINF, _NINF, lp.reshape(n, k).to(torch.float64))  # padding and masked rows: no cell
    with torch.no_grad():
        lt_q = _log_tail(lq)
    lt_p, lt_q = _resolved(_log_tail(lp), _floor(compute_dtype(src.x)), lt_q, _floor(topk.logprobs.dtype, TopK.tolerance))
    cells_p = torch.cat([lp, lt_p.unsqueeze(1)], dim=1)
    cells_q = torch.cat([lq, lt_q.unsqueeze(1)], dim=1)
    value = torch.where(valid, pointwise(cells_p, cells_q, name, beta)[0].sum(-1), 0.0).to(out_dtype)
    if value.requires_grad:
        value.register_hook(_refuse_infinite(value.detach(), lead))
    value = value.view(lead)
    if not return_tails:
        return value
    with torch.no_grad():
        tails = [torch.where(valid, t.exp(), 0.0).to(out_dtype).view(lead) for t in (lt_p, lt_q)]
    return TopKDivergence(value, *tails)


def _refuse_infinite(value: Tensor, lead: torch.Size) -> Any:
    """A hook on the divergence's gradient: a backward through a ``+inf`` value raises (it has no gradient)."""

    def hook(grad: Tensor) -> None:
        bad = torch.isinf(value) & (grad != 0)
        why = (
            "the teacher has mass in a cell the student cannot sample (an id outside the sampler's kept set): its "
            "gradient does not exist. Use divergence='reverse' or 'jsd', the temperature alone, or mask those tokens"
        )
        _refuse(bad, lead, lambda r: f"the top-k divergence is +inf at position {_where(lead, r)}", why)

    return hook
