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
from torch import Tensor, nn

from lightning_kl.controllers import KLController
from lightning_kl.ground.checks import warn_user

__all__ = ["UNSTEPPED_FORWARDS", "Coefficient", "ControllerState"]

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


class ControllerState(nn.Module):
    """The ``state_dict`` entry of a module whose coefficient may be a controller (``self.controller``, None
    for a number): the controller's state as ``_extra_state``, and only when it exists, so a strict load into
    a model without the module fits; a state_dict without the entry (0.2, or a number coef) loads as is."""

    controller: Optional[KLController]
    #: what the warnings call this module ("this loss has ...")
    kind = "module"

    def get_extra_state(self) -> dict[str, Any]:
        """The controller's state (``{}`` for a number ``coef``, which ``state_dict`` then leaves out)."""
        if self.controller is None:
            return {}
        return {"controller_class": type(self.controller).__qualname__, "controller": self.controller.state_dict()}

    def set_extra_state(self, state: Any) -> None:
        saved = state.get("controller_class") if isinstance(state, dict) else None
        mine = None if self.controller is None else type(self.controller).__qualname__
        if saved != mine:
            warn_user(
                f"{type(self).__name__}: the state_dict holds the state of {saved or 'a number coef'} but this {self.kind} "
                f"has {mine or 'a number coef'}; keeping the coefficient as constructed.",
                rank_zero=True,
            )
            return
        if self.controller is not None:
            self.controller.load_state_dict(state["controller"])

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        # only state that exists: a number coef has none, so a strict load into a model without this module fits
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.controller is None:
            destination.pop(prefix + "_extra_state", None)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # no entry: a number coef's state_dict, or one saved before the controller's state was kept in it
        # (0.2). It loads, strict or not; into a controller with a warning, as the other direction warns
        key = prefix + "_extra_state"
        had = key in state_dict
        super()._load_from_state_dict(state_dict, prefix, *args)
        missing_keys = args[2]
        if not had and key in missing_keys:
            missing_keys.remove(key)
        if not had and self.controller is not None:
            mine = type(self.controller).__qualname__
            warn_user(
                f"{type(self).__name__}: the state_dict holds no controller state (a number coef's, or one saved by "
                f"lightning-kl 0.2) but this {self.kind} has {mine}; keeping the coefficient as constructed"
                + (" (the schedule restarts from step 0, its warm-up included)." if mine == "KLSchedule" else "."),
                rank_zero=True,
            )
