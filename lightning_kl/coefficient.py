r"""The coefficient step of :class:`~lightning_kl.KLPenaltyLoss`: a number, or a KL controller stepped once per
optimizer step from the step's global KL.

:class:`Coefficient` holds what the loss multiplies by and the KL sums of the optimizer step in progress
(from :func:`~lightning_kl.reduce.controlled_kl_statistics`); :meth:`Coefficient.close_step` sums them over
the data parallel group and updates the controller (the maths of the controllers is in
:mod:`lightning_kl.controllers`). Kept apart from the loss so that the loss's forward stays a composition
of steps, and so that a step's pending sums can be dropped when a fit starts or ends
(:meth:`Coefficient.reset`), which :class:`~lightning_kl.KLLossCallback` does.

A controller that never moves is a silent mistake (a plain loop that never calls ``update_coef()``, a
Trainer without :class:`~lightning_kl.KLLossCallback`): after :data:`UNSTEPPED_FORWARDS` training
forwards with no step closed, the loss warns once, naming the fix.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_kl.controllers import KLController
from lightning_kl.ground.checks import warn_user

__all__ = ["UNSTEPPED_FORWARDS", "Coefficient"]

#: Training forwards with a controller and no closed optimizer step after which the loss warns (once): more
#: micro-batches than an optimizer step accumulates in practice.
UNSTEPPED_FORWARDS = 64


class Coefficient:
    """A loss's coefficient: ``number`` (a float >= 0) or ``controller``, and the open step's KL sums."""

    def __init__(self, coef: Union[float, KLController]) -> None:
        if isinstance(coef, KLController):
            self.controller: Optional[KLController] = coef
            self.number = float("nan")
        elif isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
            raise ValueError(
                f"`coef` must be a finite number >= 0 or a KLController (FixedKLController, AdaptiveKLController, "
                f"TargetKLController, KLSchedule), got {coef!r}."
            )
        else:
            self.controller, self.number = None, float(coef)
        self.pending: Optional[Tensor] = None
        self.forwards = 0  # training forwards since the last closed step
        self.warned_unstepped = False

    def apply(self, loss: Tensor, stats: Optional[Tensor], attached: bool) -> Tensor:
        """``coef * loss``; a training forward's KL sums (``stats``, None otherwise) join the open step's."""
        if self.controller is None:
            return self.number * loss
        if stats is not None:
            self.pending = stats if self.pending is None else self.pending + stats
            self.forwards += 1
            if self.forwards >= UNSTEPPED_FORWARDS and not attached and not self.warned_unstepped:
                self.warned_unstepped = True
                warn_user(
                    f"KLPenaltyLoss's controller has not moved in {self.forwards} training forwards: nothing closed an "
                    "optimizer step (`update_coef()`), so its coefficient stays where it started and the step's KL "
                    "sums keep growing. In a Lightning Trainer add `lk.KLLossCallback()` to `Trainer(callbacks=...)` "
                    "(the installed package's entry point adds it to Trainers built after `import lightning_kl`; a "
                    "source tree has no entry point); in a plain loop or under Fabric call `loss.update_coef()` "
                    "after `backward`, once per optimizer step.",
                    rank_zero=True,
                )
        # the step's coefficient, a device tensor (no host read), rounded to the loss's dtype as a float is
        return self.controller.value_tensor(loss.device).to(loss.dtype) * loss

    def close_step(self, dp: Any, device: Any = None) -> Optional[tuple[Tensor, Tensor]]:
        """Update the controller from the open step's global KL (one ``all_reduce`` over ``dp`` when it has
        more than one process); start the next step. ``(coef used, global KL)`` or None for a number."""
        if self.controller is None:
            return None
        stats = self.pending
        self.pending, self.forwards = None, 0
        if stats is None:
            where = device if device is not None else self.controller.value_tensor().device
            stats = torch.zeros(3, dtype=torch.float64, device=where)
        coef = self.controller.value_tensor(stats.device)
        if dp.size > 1:
            stats = dp.all_reduce_sum(stats.clone())
        kl, n_seqs = stats[0] / stats[1], stats[2]
        self.controller.update(kl, n_seqs)
        return coef, torch.where(n_seqs >= 1, kl, float("nan"))

    def reset(self) -> None:
        """Drop the open step's sums (a fit that ended inside an accumulation window leaves them)."""
        self.pending, self.forwards = None, 0
