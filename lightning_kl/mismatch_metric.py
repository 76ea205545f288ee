r"""``MismatchMetric``: the rollout/trainer mismatch diagnostics, exact across processes."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_kl.metric import DataParallelMetric
from lightning_kl.mismatch import TOTALS_REDUCTIONS, check_mismatch_inputs, mismatch_compute, mismatch_totals

__all__ = ["MismatchMetric"]


class MismatchMetric(DataParallelMetric):
    r""":func:`~lightning_kl.mismatch_metrics` over every batch seen since the last reset, on every process.

    The state is the float64 sums, int64 token and sequence counts, maxima and minima of
    :func:`lightning_kl.mismatch.mismatch_totals`, reduced by sum, max or min over the data parallel
    group, so that ``compute()`` equals :func:`~lightning_kl.mismatch_metrics` of the concatenated
    batches of every replica: each token mean divides by the global token count, each sequence
    mean by the global count of sequences with a valid token (not a mean of per-process means, as
    a stack that averages each worker's value logs: ``docs/mismatch.md`` measures the difference).
    The group is found as :class:`~lightning_kl.KLMetric` finds it (``process_group`` or
    ``device_mesh`` when given).

    ``compute()`` and a call return a dict of 0-d float64 tensors (NaN where no data; a call's, that of
    the batch of every data parallel process, as :class:`~lightning_kl.KLMetric`'s); log it with
    ``self.log_dict``, then ``reset()``: the state is every batch since the last reset, so an epoch's
    value without one includes every earlier epoch. Nothing is read on the host by ``update``::

        self.mismatch.update(logprob, batch["rollout_logprobs"], mask)          # in training_step

        def on_train_epoch_end(self):
            self.log_dict({f"mismatch/{k}": v for k, v in self.mismatch.compute().items()})
            self.mismatch.reset()                                               # the next epoch starts empty

    ``update(logprob, rollout_logprob, mask=None)``: ``[..., t]`` floating tensors and an optional
    ``[..., t]`` mask; padded positions may hold anything.

    Example:
        >>> metric = MismatchMetric()
        >>> metric.update(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]]))
        >>> metric.update(torch.tensor([[-0.5, 7.0]]), torch.tensor([[-0.5, 7.0]]), torch.tensor([[True, False]]))
        >>> metric.compute()["kl"]  # -(0.5 + 0 + 0) / 3
        tensor(-0.1667, dtype=torch.float64)
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, process_group: Any = None, device_mesh: Any = None, **kwargs: Any) -> None:
        super().__init__(process_group, device_mesh, **kwargs)
        for name, how in TOTALS_REDUCTIONS.items():
            if name in ("tokens", "sequences"):
                default = torch.tensor(0, dtype=torch.int64)
            elif how == "sum":
                default = torch.tensor(0.0, dtype=torch.float64)
            else:
                default = torch.tensor(-math.inf if how == "max" else math.inf, dtype=torch.float64)
            self.add_state(name, default=default, dist_reduce_fx=how)

    def update(self, logprob: Tensor, rollout_logprob: Tensor, mask: Optional[Tensor] = None) -> None:
        mask = check_mismatch_inputs(logprob, rollout_logprob, mask)
        for name, value in mismatch_totals(logprob, rollout_logprob, mask).items():
            how = TOTALS_REDUCTIONS[name]
            state = getattr(self, name)
            if how == "sum":
                setattr(self, name, state + value)
            elif how == "max":
                setattr(self, name, torch.maximum(state, value))
            else:
                setattr(self, name, torch.minimum(state, value))

    def compute_states(self, states: dict[str, Tensor]) -> dict[str, Tensor]:
        return mismatch_compute(states)
