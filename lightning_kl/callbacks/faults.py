r"""``ControllerFaultCallback``: the base of the callbacks that step KL controllers on the device, raising
their recorded faults where the host reads anyway."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["ControllerFaultCallback"]


class ControllerFaultCallback(Callback):
    """A callback whose KL controllers record faults on the device (a non-finite global KL) without a host
    read per step: :meth:`_raise_pending` reads them, and so raises them, every ``log_every_n_steps``
    batches (as often as Lightning's loggers read the logged values) and at the end of each epoch. The base
    of :class:`KLRewardCallback` and :class:`~lightning_kl.KLLossCallback`."""

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (batch_idx + 1) % max(1, trainer.log_every_n_steps) == 0:
            self._raise_pending()  # as often as Lightning's loggers read the logged values

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._raise_pending()

    def _raise_pending(self) -> None:
        raise NotImplementedError
