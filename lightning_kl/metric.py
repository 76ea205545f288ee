r"""``KLMetric``: the token-mean of per-token KL values, exact across processes."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_kl.ground.checks import check_floating, check_mask
from lightning_kl.ground.parallel import check_parallel_args, data_parallel_group
from lightning_kl.reduce import masked_sums

__all__ = ["DataParallelMetric", "KLMetric"]


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


class DataParallelMetric(Metric):
    """A torchmetrics ``Metric`` whose state is reduced over the data parallel group, not the world.

    ``process_group`` or ``device_mesh`` when given (checked here), else the group found by
    :func:`~lightning_kl.ground.parallel.data_parallel_group` when the state is synced. The base of
    :class:`KLMetric` and :class:`~lightning_kl.MismatchMetric`.
    """

    def __init__(self, process_group: Any = None, device_mesh: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_parallel_args(process_group, device_mesh)
        self.data_parallel = (process_group, device_mesh)

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
        kwargs: torchmetrics' ``Metric`` arguments.

    **No data is NaN**: with no valid token since the last reset (an empty or fully masked batch,
    when logged per step) the result is NaN, as ``KLRewardCallback`` logs for a global batch with no
    valid token; a KL of 0 would read as "the policy is the reference". The loss itself is 0 there.

    Log it from a ``LightningModule`` by calling it, then passing the metric object to ``self.log``:
    the call returns the batch's value (logged per step) and accumulates (logged per epoch, and
    reduced across processes). ``update`` alone accumulates but gives nothing to log per step::

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

    def compute(self) -> Tensor:
        return _kl_metric_compute(self.total, self.count)
