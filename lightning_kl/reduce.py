r"""The reduce step: per-token values to the loss's scalar, and the sums every shell reads.

* :func:`masked_sums`, :func:`masked_row_sums`, :func:`mask_counts`: the one masked-sums helper (sums over
  the valid positions, in a given dtype, and the counts of valid tokens and sequences), used by the
  aggregation, the metric, the reward callback, the controller's KL and the step's totals.
* :func:`aggregate_checked`: :func:`~lightning_kl.aggregate`'s maths (verl's modes), of checked arguments.
* :func:`reduce_kl`: the reduction of :class:`~lightning_kl.KLPenaltyLoss` and
  :class:`~lightning_kl.EntropyBonus`: the aggregate (with the global batch's counts, one ``all_reduce``,
  and the factors of gradient accumulation and data parallel averaging), with the metric's and the
  controller's sums of the same values; :func:`refused_alike`, the refusal of one process's inputs
  on every process of the global batch.

Masking is done with :func:`torch.where`, never by multiplying: a NaN or inf at a padded position
would otherwise survive as ``nan = inf * 0`` in the result or in the gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, NamedTuple, Optional, Union

import torch
from torch import Tensor

from lightning_kl.ground.checks import compute_dtype
from lightning_kl.ground.checks import host_reads
from lightning_kl.ground.parallel import collective_device, release_warnings, sum_or_refuse

__all__ = [
    "AGG_MODES",
    "GLOBAL_TERMS",
    "COUNT_OF_MODE",
    "AggMode",
    "Reduced",
    "aggregate_checked",
    "aggregate_counts_checked",
    "check_agg_mode",
    "controlled_kl_statistics",
    "mask_counts",
    "masked_row_sums",
    "masked_sums",
    "reduce_kl",
    "refused_alike",
]

#: The aggregation modes accepted by :func:`aggregate` (verl's names and semantics).
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

#: The type of an ``agg`` argument: one of the modes of :func:`aggregate`, listed by LightningCLI's
#: ``--help``; any other string is refused when the object is built, by a message that lists the valid
#: modes. The modes: ``typing.get_args(typing.get_args(lk.AggMode)[0])``.
AggMode = Union[Literal[AGG_MODES], str]  # type: ignore[valid-type]


def check_agg_mode(mode: object) -> str:
    """Validate an aggregation mode name; raise ``ValueError`` listing the valid ones."""
    if not isinstance(mode, str) or mode not in AGG_MODES:
        valid = ", ".join(repr(m) for m in AGG_MODES)
        raise ValueError(f"Unknown aggregation mode {mode!r}. Valid modes: {valid}.")
    return mode


#: The length of the vector the loss sums over the data parallel group under ``global_batch=True`` (one
#: all-reduce): valid tokens, sequences, the processes that gave the step's total, the processes that held a
#: warning. A process that refused its inputs sends a vector of this length too (``sum_or_refuse``).
GLOBAL_TERMS = 4

# the count each aggregation mode divides by: 0 valid tokens, 1 sequences (the others divide by none)
COUNT_OF_MODE = {"token-mean": 0, "seq-mean-token-sum": 1, "seq-mean-token-mean": 1}
_WHOLE_SUM_MODES = ("token-sum", "token-mean", "seq-mean-token-sum-norm")


def masked_sums(values: Tensor, mask: Optional[Tensor], dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """The sum of ``values`` over the valid positions, in ``dtype`` (0-d), and their count (0-d int64; an int
    without a mask). A NaN or inf at a masked position never enters."""
    v = values.to(dtype)
    if mask is None:
        return v.sum(), v.numel()  # type: ignore[return-value]
    return torch.where(mask, v, torch.zeros((), dtype=dtype, device=v.device)).sum(), torch.count_nonzero(mask)


def masked_row_sums(values: Tensor, mask: Optional[Tensor], dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Each sequence's (row of the last dimension's) sum over its valid positions, in ``dtype``, and its count
    of valid tokens (int64): two ``[n]`` tensors, every leading dimension a sequence dimension."""
    t = values.shape[-1]
    v = values.to(dtype)
    if mask is not None:
        v = torch.where(mask, v, torch.zeros((), dtype=dtype, device=v.device))
    sums = v.reshape(-1, t).sum(-1)
    if mask is None:
        return sums, torch.full(sums.shape, t, dtype=torch.int64, device=sums.device)
    return sums, mask.reshape(-1, t).sum(-1)


def mask_counts(mask: Tensor) -> tuple[Tensor, Tensor]:
    """A bool mask's counts of valid tokens and of sequences with a valid token (0-d int64 tensors)."""
    return torch.count_nonzero(mask), torch.count_nonzero(mask.any(-1))


def aggregate_checked(
    values: Tensor,
    mask: Optional[Tensor],
    mode: str,
    norm: Optional[float] = None,
    num_tokens: Optional[Tensor | float] = None,
    num_seqs: Optional[Tensor | float] = None,
    world_size: int = 1,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """:func:`~lightning_kl.aggregate` of checked arguments (``mask`` bool or None): the maths, shared with the
    loss. ``dtype``: the compute dtype when the caller knows it (default: :func:`compute_dtype` of ``values``)."""
    if dtype is None:
        dtype = compute_dtype(values)
    if mode in _WHOLE_SUM_MODES:
        total, count = masked_sums(values, mask, dtype)
        if mode == "token-sum":
            return _times(total, world_size)
        if mode == "token-mean":
            return _times(total / _at_least_one(count if num_tokens is None else num_tokens, dtype, total.device), world_size)
        return _times(total / (values.shape[-1] if norm is None else norm), world_size)
    if values.numel() == 0:
        return values.to(dtype).sum()
    seq_sums, counts = masked_row_sums(values, mask, dtype)
    counts = counts.to(dtype)
    if num_seqs is None:
        num_seqs = (counts > 0).sum()
    n_seqs = _at_least_one(num_seqs, dtype, seq_sums.device)
    if mode == "seq-mean-token-sum":
        return _times(seq_sums.sum() / n_seqs, world_size)
    # seq-mean-token-mean: empty sequences contribute 0 to the sum and nothing to the count
    return _times((seq_sums / counts.clamp(min=1)).sum() / n_seqs, world_size)


def aggregate_counts_checked(values: Tensor, mask: Optional[Tensor]) -> Tensor:
    """:func:`aggregate_counts` of checked arguments (``mask`` bool or None)."""
    if mask is None:
        n_seqs = math.prod(values.shape[:-1]) if values.shape[-1] else 0
        return torch.tensor([values.numel(), n_seqs], dtype=torch.int64, device=values.device)
    return torch.stack(mask_counts(mask.detach())).to(torch.int64)


def _times(x: Tensor, world_size: int) -> Tensor:
    # multiply only when needed: one process keeps the plain graph
    return x if world_size == 1 else x * world_size


def _at_least_one(n: Tensor | int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.as_tensor(n, dtype=dtype, device=device).reshape(()).clamp(min=1)


def controlled_kl_statistics(kl: Tensor, mask: Optional[Tensor], agg: str) -> Tensor:
    """The KL sums a controller of the loss sees: float64 ``[sum, count, sequences]`` of a micro-batch.

    ``sum / count`` is the loss's KL in the units of ``agg``: per token (``token-mean``: over valid
    tokens; ``seq-mean-token-mean``: the mean of the sequences' token-means) or per response (the
    other modes: the mean of the non-empty sequences' sums). ``sequences`` counts the sequences with
    a valid token. Detached; masked positions never enter.
    """
    v = kl.detach()
    if v.ndim == 0:
        v = v.reshape(1, 1)
    m = None if mask is None else mask.reshape(v.shape)
    sums, tokens = masked_row_sums(v, m)
    valid = tokens > 0
    n_seqs = valid.sum().to(torch.float64)
    if agg == "token-mean":
        total, count = sums.sum(), tokens.sum().to(torch.float64)
    elif agg == "seq-mean-token-mean":
        means = sums / tokens.clamp(min=1)
        total, count = torch.where(valid, means, torch.zeros((), dtype=means.dtype, device=means.device)).sum(), n_seqs
    else:
        total, count = sums.sum(), n_seqs
    return torch.stack([total, count, n_seqs])


class Reduced(NamedTuple):
    """What the loss's reduce step gives back: the loss (before the coefficient), the metric's float64 sum and
    int64 count of the detached values, and the controller's sums (None unless asked for)."""

    loss: Tensor
    metric_sums: tuple[Tensor, Tensor]
    controller_stats: Optional[Tensor]


def _same_totals_everywhere(gave: Tensor, world: int, name: str, agg: str) -> None:
    # every process raises alike: the count of processes that gave the total is the same sum everywhere
    message = (
        f"KLPenaltyLoss(agg={agg!r}, global_batch=True): `{name}` (the step's total) was given on some data "
        f"parallel processes and not on others: give it on every process (each its own step's total, "
        f"`lk.step_totals`) or on none. A process without it would divide by its micro-batch's count among the "
        f"others' step totals, and every process's loss would be wrong."
    )
    if host_reads(gave.device):
        if 0 < float(gave) < world:
            raise ValueError(f"{message} (given on {int(gave)} of {world} processes)")
    else:
        torch._assert_async((gave == 0) | (gave == world), message)


def reduce_kl(
    kl: Tensor,
    mask: Optional[Tensor],
    agg: str,
    norm: Optional[float] = None,
    num_tokens: Any = None,
    num_seqs: Any = None,
    k: int = 1,
    dp: Any = None,
    controller_agg: Optional[str] = None,
    held: Optional[list[Any]] = None,
    who: str = "KLPenaltyLoss",
) -> Reduced:
    """The loss's reduce step: :func:`aggregate_checked` of ``kl`` with the step's totals and the global batch.

    ``num_tokens``/``num_seqs``: the step's totals (checked), or None. ``k``: Lightning's
    ``accumulate_grad_batches``. ``dp``: the data parallel group for the global batch (a
    :class:`~lightning_kl.ground.parallel.DataParallelGroup`), or None. DDP or FSDP averages over the data
    parallel replicas and Lightning divides by ``k``: both factors are undone here. Not ``k`` for a mode that
    divides by a count it was not given: each micro-batch then divides by its own count, and Lightning's
    average of the ``k`` micro-batch values is the nearest to the step's value (times ``k`` it would be ``k``
    times too large). ``controller_agg``: also the controller's sums (:func:`controlled_kl_statistics`).

    Under ``dp``, the step's total of the mode (``num_tokens`` for ``token-mean``, ``num_seqs`` for the
    ``seq-mean`` modes) must be given on every process or on none: given on some only, every process
    raises the same ``ValueError`` (a process without it would divide by its micro-batch count among the
    others' step totals, and every process's loss would be wrong). ``held``: the warnings the caller held
    before this collective (:func:`~lightning_kl.ground.parallel.held_warnings`), issued after it, alike on
    every process. ``who``: the module named when another process refused its inputs (:func:`refused_alike`).
    """
    given = (num_tokens, num_seqs)
    counts: dict[str, Any] = {}
    if num_tokens is not None or num_seqs is not None:
        counts["num_tokens"], counts["num_seqs"] = given
    needed = COUNT_OF_MODE.get(agg)
    world = 1
    if dp is not None and dp.size > 1:
        world = dp.size
        if needed is not None:
            counted = aggregate_counts_checked(kl, mask).to(torch.float64)
            local = torch.zeros(GLOBAL_TERMS, dtype=torch.float64, device=counted.device)
            local[:2] = counted
            if given[needed] is not None:
                # this process's step total in place of its micro-batch count
                local[needed] = torch.as_tensor(given[needed], dtype=torch.float64, device=local.device).reshape(())
            local[2] = float(given[needed] is not None)
            local[3] = float(bool(held))
            local = sum_or_refuse(dp, local, None, local.device, GLOBAL_TERMS, who)  # see refused_alike
            _same_totals_everywhere(local[2], dp.size, ("num_tokens", "num_seqs")[needed], agg)
            release_warnings(held, local[3], dp)
            counts["num_tokens"], counts["num_seqs"] = local[0], local[1]
    counts["world_size"] = world * (1 if needed is not None and given[needed] is None else k)
    loss = aggregate_checked(kl, mask, agg, norm, **counts, dtype=kl.dtype)  # kl: in the compute dtype already
    # times exactly 1 when the loss is finite, NaN when not: a NaN at a valid position then
    # also turns every gradient to NaN, where anomaly detection sees it, even for estimators
    # whose gradient ignores the value (k1's is 1 everywhere)
    loss = loss * (1 + 0 * loss.detach())
    detached = kl.detach()
    total, count = masked_sums(detached, mask)
    if mask is None:
        count = torch.tensor(count, dtype=torch.int64, device=detached.device)
    stats = None if controller_agg is None else controlled_kl_statistics(detached, mask, controller_agg)
    return Reduced(loss, (total, count), stats)


@contextmanager
def refused_alike(dp: Any, agg: str, x: Any, who: str, metric: Any = None) -> Iterator[None]:
    """Check inputs inside this block: an input refused on one process is refused on every one.

    The other processes are on their way to the first collective of the forward: under :func:`reduce_kl`'s
    global batch (``dp`` of more than one process, a mode that divides by a count) the all-reduce of the
    counts, else the per-call all-reduce of ``metric`` (a :class:`~lightning_kl.metric.DataParallelMetric`
    in training mode under DDP, see its ``step_group``). A ``TypeError`` or ``ValueError`` raised in the
    block meets them there (:func:`~lightning_kl.ground.parallel.sum_or_refuse`, with a flag), so that every
    process raises (the same error where values are read on the host; elsewhere the others stop on a
    device assertion naming ``who``) instead of waiting. ``x``: an input, for the collective's device.
    Without a collective to meet, the error is raised as it is.
    """
    try:
        yield
    except (TypeError, ValueError) as err:
        if dp is not None and dp.size > 1 and COUNT_OF_MODE.get(agg) is not None:
            sum_or_refuse(dp, None, str(err), collective_device(x, dp), GLOBAL_TERMS, who)
        elif metric is not None and (group := metric.step_group()) is not None:
            metric.refuse_step(str(err), collective_device(x, group), who)
        raise
