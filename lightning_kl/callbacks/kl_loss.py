r"""``KLLossCallback``: every :class:`~lightning_kl.KLPenaltyLoss` of a LightningModule learns its Trainer.

An ``nn.Module`` inside a ``LightningModule`` has no link to the Trainer, yet the loss needs the
Trainer's ``accumulate_grad_batches`` (Lightning divides each micro-batch's loss by it) and the end of
each optimizer step. This callback finds every ``KLPenaltyLoss`` in ``pl_module.modules()`` at
``setup``, and again at the start of each fit, validation, test or prediction (after ``configure_model``,
so that a loss built there is found too), and hands it the Trainer
(:meth:`~lightning_kl.KLPenaltyLoss.attach`): it works whatever the ``training_step``'s argument names,
wrappers or ``torch.compile``. Every :class:`~lightning_kl.EntropyBonus` is attached too (an attached
module does not warn about steps left unclosed). With no loss or bonus alive in the process it does nothing.

Installing lightning-kl registers a factory of this callback under Lightning's
``lightning.pytorch.callbacks_factory`` entry point (the top-level module ``_lightning_kl_entry``, which
imports nothing of the package): a ``Trainer`` built after ``import lightning_kl`` gets one by itself
(Lightning logs "Adding 1 callbacks from entry point 'lightning_kl'"); other Trainers get none. Passing
one in ``Trainer(callbacks=...)`` is harmless: only the first instance in the Trainer's list acts. Where
entry points are not read (the package used from a source tree) or under Fabric, a controlled loss that
runs with no step closed warns once, naming the fix.

When a fit starts and when it ends (normally or by an exception) it drops the KL sums of an optimizer step
left open (a fit stopped inside an accumulation window), so that the next fit's first coefficient update
sees its own micro-batches only.

It also closes the optimizer step of every loss whose ``coef`` is a controller
(:meth:`~lightning_kl.KLPenaltyLoss.update_coef`) in ``on_before_optimizer_step``: Lightning calls that
hook once per optimizer step, after the backward of the step's last micro-batch (under
``accumulate_grad_batches`` too, and in manual optimization at each ``optimizer.step()``), so the
step's gradient used the step's coefficient and the next step gets the updated one. Only the
Trainer's first optimizer closes steps. An :class:`~lightning_kl.EntropyBonus` whose ``coef`` is a
controller is closed the same way (logged under ``entropy/`` in place of ``kl/``). It logs ``kl/coef`` (the coefficient the step used) and
``kl/value`` (the step's global KL); with several controlled losses, or a
:class:`~lightning_kl.KLRewardCallback` logging under ``kl/`` too, the names end with the loss's name
in the module (``kl/coef/kl_loss``). A non-finite global KL leaves the coefficient unchanged and is
raised as a ``ValueError`` every ``log_every_n_steps`` batches and at the end of each epoch (where
the host reads the coefficient), as :class:`~lightning_kl.KLRewardCallback` does. At ``on_train_start`` it refuses one controller object shared by
two users (two losses, a loss and a bonus, or a loss and a ``KLRewardCallback``): each would update it with its
own measure (a loss's KL, a bonus's entropy, the reward's KL per batch), named in the error. Outside a Trainer
the loss or bonus that closes a step refuses a controller the other one moves in the same step.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from typing_extensions import override

from lightning_kl.callbacks.faults import ControllerFaultCallback
from lightning_kl.callbacks.kl_reward import KLRewardCallback
from lightning_kl.coefficient import ControllerState, controller_chain, live_controlled, shared_controller_message

__all__ = ["KLLossCallback", "attach_losses", "callbacks_factory"]


def attach_losses(trainer: Optional["pl.Trainer"], pl_module: "pl.LightningModule") -> list[ControllerState]:
    """Hand ``trainer`` (None: detach) to every :class:`~lightning_kl.KLPenaltyLoss` and
    :class:`~lightning_kl.EntropyBonus` in ``pl_module``; returns them.

    No walk over the module when none is alive in the process."""
    if not live_controlled():
        return []
    losses = [m for m in pl_module.modules() if isinstance(m, ControllerState)]
    for loss in losses:
        loss.attach(trainer)
    return losses


class KLLossCallback(ControllerFaultCallback):
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
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # after configure_model: a loss built there is attached too; a step left open by an earlier fit is dropped
        if self._acts(trainer):
            for loss in attach_losses(trainer, pl_module):
                loss.reset_step()

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._attach_outside_fit(trainer, pl_module)

    @override
    def on_test_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._attach_outside_fit(trainer, pl_module)

    @override
    def on_predict_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._attach_outside_fit(trainer, pl_module)

    def _attach_outside_fit(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # trainer.validate/test/predict: after configure_model too (inside a fit, on_fit_start did it)
        if self._acts(trainer) and not getattr(trainer.state, "fn", None) == "fit":
            attach_losses(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._reset_steps(trainer)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._reset_steps(trainer)

    def _reset_steps(self, trainer: "pl.Trainer") -> None:
        # a fit that ends inside an accumulation window leaves its KL sums: the next fit must not mix them in
        if self._acts(trainer):
            for _, loss in getattr(self, "_losses", ()):
                loss.reset_step()

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not self._acts(trainer):
            return
        # found once per fit (a walk over every module of a large model is not free at every step)
        # an EntropyBonus closes its steps the same way (its coefficient, logged under entropy/)
        self._losses = [(name, m) for name, m in pl_module.named_modules() if isinstance(m, ControllerState)]
        users: dict[int, list[tuple[str, str]]] = {}
        for name, loss in self._controlled():
            for ctl in controller_chain(loss.controller):
                users.setdefault(id(ctl), []).append((f"{type(loss).__name__} {name!r}", loss._coefficient.measure))
        for cb in trainer.callbacks:
            if isinstance(cb, KLRewardCallback):
                for ctl in controller_chain(cb.controller):
                    users.setdefault(id(ctl), []).append((f"KLRewardCallback {cb.state_key!r}", "its KL per batch"))
        shared = [found for found in users.values() if len(found) > 1]
        if shared:
            raise ValueError(shared_controller_message(shared[0]))

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any
    ) -> None:
        if not self._acts(trainer) or not trainer.optimizers or optimizer is not trainer.optimizers[0]:
            return
        controlled = self._controlled()
        if not controlled:
            return
        prefixes = [getattr(loss, "log_prefix", "kl/") for _, loss in controlled]
        rewards = any(isinstance(cb, KLRewardCallback) and cb.log_prefix == "kl/" for cb in trainer.callbacks)
        for (name, loss), prefix in zip(controlled, prefixes):
            used = loss.update_coef(trainer.strategy, pl_module.device)
            assert used is not None
            suffix = prefixes.count(prefix) > 1 or (rewards and prefix == "kl/")
            tail = f"/{name}" if suffix else ""
            pl_module.log(f"{prefix}coef{tail}", used[0], on_step=True, on_epoch=False, batch_size=1)
            pl_module.log(f"{prefix}value{tail}", used[1], on_step=True, on_epoch=False, batch_size=1)

    def _raise_pending(self) -> None:
        # reading a coefficient raises the fault its controller recorded on the device (a non-finite
        # global KL, the same on every rank, so every rank raises alike)
        for _, loss in self._controlled():
            _ = loss.coef

    def _controlled(self) -> list[tuple[str, Any]]:
        return [(name, m) for name, m in getattr(self, "_losses", ()) if m.controller is not None]

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self._acts(trainer):
            self._reset_steps(trainer)
            attach_losses(None, pl_module)
        self._losses = []


def callbacks_factory() -> list[Any]:
    """What the entry point gives a Trainer (see ``_lightning_kl_entry``): ``[KLLossCallback()]``."""
    return [KLLossCallback()]
