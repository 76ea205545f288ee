r"""``KLLossCallback``: every :class:`~lightning_kl.KLPenaltyLoss` of a LightningModule learns its Trainer.

An ``nn.Module`` inside a ``LightningModule`` has no link to the Trainer, yet the loss needs the
Trainer's ``accumulate_grad_batches`` (Lightning divides each micro-batch's loss by it) and the end of
each optimizer step. This callback finds every ``KLPenaltyLoss`` in ``pl_module.modules()`` at
``setup`` and hands it the Trainer (:meth:`~lightning_kl.KLPenaltyLoss.attach`): it works whatever the
``training_step``'s argument names, wrappers or ``torch.compile``.

Installing lightning-kl registers a factory of this callback under Lightning's
``lightning.pytorch.callbacks_factory`` entry point, so every ``Trainer`` gets one by itself (Lightning
logs "Adding 1 callbacks from entry point 'lightning_kl'"). Passing one in ``Trainer(callbacks=...)``
is harmless: only the first instance in the Trainer's list acts.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_kl.loss import KLPenaltyLoss

__all__ = ["KLLossCallback", "attach_losses", "callbacks_factory"]


def attach_losses(trainer: Optional["pl.Trainer"], pl_module: "pl.LightningModule") -> list[KLPenaltyLoss]:
    """Hand ``trainer`` (None: detach) to every :class:`KLPenaltyLoss` in ``pl_module``; returns them."""
    losses = [m for m in pl_module.modules() if isinstance(m, KLPenaltyLoss)]
    for loss in losses:
        loss.attach(trainer)
    return losses


class KLLossCallback(Callback):
    """Connects every :class:`~lightning_kl.KLPenaltyLoss` of the fitted LightningModule to the Trainer.

    Added to every Trainer by itself once lightning-kl is installed (an entry point); add it by hand only
    where entry points are not read (the package used from a source tree without being installed).
    """

    def _acts(self, trainer: "pl.Trainer") -> bool:
        # the first instance in the Trainer's list acts; a second one (the entry point's and the user's) is idle
        first = next(cb for cb in trainer.callbacks if isinstance(cb, KLLossCallback))
        return first is self

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self._acts(trainer):
            attach_losses(trainer, pl_module)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self._acts(trainer):
            attach_losses(None, pl_module)


def callbacks_factory() -> list[Any]:
    """The entry point Lightning calls for every new Trainer (``lightning.pytorch.callbacks_factory``)."""
    return [KLLossCallback()]
