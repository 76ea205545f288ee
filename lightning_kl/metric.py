r"""``KLMetric``: the token-mean of per-token KL values, exact across processes, per step and per epoch."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

from lightning_kl.ground.checks import check_floating, check_mask
from lightning_kl.ground.parallel import check_parallel_args, data_parallel_group, sum_or_refuse
from lightning_kl.reduce import masked_sums

__all__ = ["DataParallelMetric", "KLMetric", "all_reduce_states"]


def _kl_metric_update(values: Tensor, mask: Optional[Tensor], checked: bool = False) -> tuple[Tensor, Tensor]:
    """Masked sum (float64) and valid-token count (int64) of a batch of per-token values."""
    if not checked:
        check_floating("values", values)
        mask = check_mask(mask, values, "values")
    total, count = masked_sums(values.detach(), mask)
    if mask is None:
        return total, torch.tensor(count, dtype=torch.int64, device=total.device)
    return total, count


def _kl_metric_compute(total: Tensor, count: Tensor) -> Tensor:
    """Token-mean in the state's dtype (float64 unless the metric was cast); NaN when no token was seen (no data, not a KL of 0)."""
    return (total / count).to(total.dtype)


def all_reduce_states(
    states: dict[str, Tensor], reductions: dict[str, str], dp: Any, who: str = "a metric"
) -> dict[str, Tensor]:
    """0-d metric states reduced over ``dp`` (a :class:`~lightning_kl.ground.parallel.DataParallelGroup`) by
    their ``"sum"``, ``"max"`` or ``"min"``: every sum in one float64 ``all_reduce`` with a refusal flag
    (:func:`~lightning_kl.ground.parallel.sum_or_refuse`: a process that refused its inputs meets the
    others there, see :meth:`DataParallelMetric.refuse_step`; int64 counts are exact below 2**53), every
    maximum and minimum in one more (a minimum as the maximum of its negation). New tensors in the
    states' dtypes; the states are not changed. No host read off the CPU."""
    sums = [n for n in states if reductions[n] == "sum"]
    terms = torch.stack([states[n].detach().to(torch.float64).reshape(()) for n in sums])
    summed = sum_or_refuse(dp, terms, None, terms.device, len(sums), who)
    out = {n: summed[i].to(states[n].dtype) for i, n in enumerate(sums)}
    extremes = [n for n in states if reductions[n] != "sum"]
    if extremes:
        signs = [-1.0 if reductions[n] == "min" else 1.0 for n in extremes]
        packed = torch.stack([sign * states[n].detach().to(torch.float64).reshape(()) for n, sign in zip(extremes, signs)])
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=dp.group)
        out.update({n: (sign * packed[i]).to(states[n].dtype) for i, (n, sign) in enumerate(zip(extremes, signs))})
    return out


class DataParallelMetric(Metric):
    """A torchmetrics ``Metric`` whose state is reduced over the data parallel group, not the world.

    ``process_group`` or ``device_mesh`` when given (checked here), else the group found by
    :func:`~lightning_kl.ground.parallel.data_parallel_group` when the state is synced. The base of
    :class:`KLMetric` and :class:`~lightning_kl.MismatchMetric`. Its states are 0-d tensors reduced by
    ``"sum"``, ``"max"`` or ``"min"``; a subclass computes its value from them in :meth:`compute_states`.

    **Per step.** A call (``forward``, the value Lightning logs per step for ``self.log(name, metric)``)
    returns the value of the batch of every data parallel process, not this process's: the batch's states
    are reduced over the group in one ``all_reduce`` (of every sum; one more for maxima and minima), on the
    device, before the value is computed, while the accumulated state stays this process's (synced when
    computed, as torchmetrics does). Every process of the group must then call it alike, as every rank's
    ``training_step`` does. In ``eval()`` mode (a metric inside a LightningModule while it validates: a
    validation loop may run a different number of batches on each process, and Lightning logs it per
    epoch, synced when computed) a call keeps this process's value. ``dist_sync_on_step=False`` (torchmetrics' name; its default is False, here
    True, and torchmetrics' own gathering of every state is replaced by the all-reduce) keeps this
    process's batch value, for a call made on some processes only. ``update`` accumulates without a
    collective.
    """

    def __init__(self, process_group: Any = None, device_mesh: Any = None, **kwargs: Any) -> None:
        sync_on_step = kwargs.pop("dist_sync_on_step", True)
        if not isinstance(sync_on_step, bool):
            raise ValueError(f"`dist_sync_on_step` must be True or False, got {sync_on_step!r}.")
        super().__init__(**kwargs)  # torchmetrics' dist_sync_on_step stays False: its per-state gather is not used
        check_parallel_args(process_group, device_mesh)
        self.data_parallel = (process_group, device_mesh)
        self.sync_on_step = sync_on_step
        self._state_reductions: dict[str, str] = {}
        self._step_group: Any = None  # the data parallel group while a call computes the batch's value

    def add_state(self, name: str, default: Any, dist_reduce_fx: Any = None, persistent: bool = False) -> None:
        if dist_reduce_fx not in ("sum", "max", "min") or not isinstance(default, Tensor) or default.ndim != 0:
            raise TypeError(f"{type(self).__name__}: a state is a 0-d tensor reduced by 'sum', 'max' or 'min'; {name!r} is not.")
        self._state_reductions[name] = dist_reduce_fx
        super().add_state(name, default, dist_reduce_fx=dist_reduce_fx, persistent=persistent)

    def step_group(self) -> Any:
        """The data parallel group a call reduces the batch's states over now, or None (one process,
        ``dist_sync_on_step=False``, or ``eval()`` mode)."""
        # in training mode only: a validation loop (eval() mode, Lightning logs it per epoch, synced at compute)
        # may run a different number of batches on each process
        # (ground/parallel.distributed()'s predicate, inline: the forward goes down the layers once, test_loss_path)
        if not (self.sync_on_step and self.training) or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return None  # (no process group: one process, nothing to ask the ground floor)
        dp = data_parallel_group(*self.data_parallel)
        return dp if dp.size > 1 else None

    def refuse_step(self, problem: str, device: Any, who: str) -> None:
        """In place of a call, on a process that refused its inputs (``problem``): meet the other processes in
        the all-reduce of their call (:meth:`step_group`), so that every process raises (the same
        ``ValueError`` where values are read on the host; elsewhere the others stop on a device assertion
        naming ``who``); the caller then raises its own error. Nothing to do without a step group."""
        dp = self.step_group()
        if dp is not None:
            n_sums = sum(how == "sum" for how in self._state_reductions.values())
            sum_or_refuse(dp, None, problem, device, n_sums, who)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._step_group = self.step_group()
        try:
            return super().forward(*args, **kwargs)  # torchmetrics: the batch's states, then compute(), then accumulate
        finally:
            self._step_group = None

    def compute(self) -> Any:
        states = {name: getattr(self, name) for name in self._state_reductions}
        if self._step_group is not None:  # inside a call: the batch's states, reduced over the group
            states = all_reduce_states(states, self._state_reductions, self._step_group, type(self).__name__)
        return self.compute_states(states)

    def compute_states(self, states: dict[str, Tensor]) -> Any:
        """The metric's value from its states (this process's, or reduced over the group)."""
        raise NotImplementedError

    def sync(
        self,
        dist_sync_fn: Optional[Callable] = None,
        process_group: Optional[Any] = None,
        should_sync: bool = True,
        distributed_available: Optional[Callable] = None,
    ) -> None:
        # torchmetrics syncs over the world by default; here over the data parallel group
        if should_sync and process_group is None:
            dp = data_parallel_group(*self.data_parallel)
            should_sync, process_group = dp.size > 1, dp.group
        super().sync(dist_sync_fn, process_group, should_sync, distributed_available)


class KLMetric(DataParallelMetric):
    r"""Token-mean of per-token KL values over every valid token seen since the last reset.

    .. math::
        \mathrm{KL} = \frac{\sum_{\text{updates}} \sum_t m_t v_t}{\sum_{\text{updates}} \sum_t m_t}

    The state is a float64 masked sum and an int64 token count, both reduced by sum over the data
    parallel group; ``compute()`` returns the token-mean of the concatenated data of every data
    parallel replica, in the state's dtype (float64). The group is ``process_group`` or ``device_mesh`` when given, else found by
    itself when the state is synced: under Lightning's ``ModelParallelStrategy`` its device mesh's
    ``"data_parallel"`` dimension (tensor parallel ranks, which hold the same batch, count once; a
    data parallel size of 1 syncs nothing), under DDP the world. Positions where the mask is False
    never reach the state, even if they hold NaN or inf.

    Args:
        process_group: the data parallel ``ProcessGroup``; default: found by itself.
        device_mesh: the same as a ``DeviceMesh``: 1-D, or with a ``"data_parallel"`` dimension.
        kwargs: torchmetrics' ``Metric`` arguments; ``dist_sync_on_step`` (default True here): a call
            returns the batch of every data parallel process (see below), False: this process's.

    **No data is NaN**: with no valid token since the last reset (an empty or fully masked batch on
    every process, when logged per step) the result is NaN, as ``KLRewardCallback`` logs for a global batch with no
    valid token; a KL of 0 would read as "the policy is the reference". The loss itself is 0 there.

    Log it from a ``LightningModule`` by calling it, then passing the metric object to ``self.log``:
    the call returns the batch's value (logged per step) and accumulates (logged per epoch, and
    reduced across processes). Under DDP the call's value is the global batch's, the token-mean over
    the batch of every data parallel process (one ``all_reduce`` of the batch's sum and count, on the
    device, see :class:`DataParallelMetric`): every process calls it alike, as every rank's
    ``training_step`` does. ``update`` alone accumulates but gives nothing to log per step::

        self.metric(values, mask)
        self.log("train/kl", self.metric)

    :class:`~lightning_kl.KLPenaltyLoss` calls its own :attr:`~lightning_kl.KLPenaltyLoss.metric`
    in forward: log it with ``self.log("train/kl", self.kl.metric)``.

    ``update(values, mask=None)``: ``values`` is ``[..., t]`` (any floating dtype, detached here),
    ``mask`` the same shape (bool, or 0/1 numbers).

    Example:
        >>> metric = KLMetric()
        >>> metric.update(torch.tensor([[0.5, 1.5, 9.0]]), torch.tensor([[True, True, False]]))
        >>> metric.update(torch.tensor([2.0]))
        >>> metric.compute()  # (0.5 + 1.5 + 2.0) / 3, in the state's dtype
        tensor(1.3333, dtype=torch.float64)
        >>> metric(torch.tensor([1.0, 4.0]), torch.tensor([False, True]))  # this batch: 4.0; accumulates
        tensor(4., dtype=torch.float64)
        >>> metric(torch.tensor([1.0]), torch.tensor([False]))  # a batch with no valid token: no data
        tensor(nan, dtype=torch.float64)
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    total: Tensor
    count: Tensor

    def __init__(self, process_group: Any = None, device_mesh: Any = None, **kwargs: Any) -> None:
        super().__init__(process_group, device_mesh, **kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(
        self, values: Tensor, mask: Optional[Tensor] = None, *, checked: bool = False, sums: Optional[tuple[Tensor, Tensor]] = None
    ) -> None:
        # checked=True: a caller that checked both already (a floating tensor, a bool mask of its shape); sums: the
        # float64 sum and int64 count of these values that the caller made already (KLPenaltyLoss's reduce step)
        total, count = _kl_metric_update(values, mask, checked) if sums is None else sums
        self.total += total
        self.count += count

    def compute_states(self, states: dict[str, Tensor]) -> Tensor:
        return _kl_metric_compute(states["total"], states["count"])
