r"""The coefficient step of :class:`~lightning_kl.KLPenaltyLoss`: a number, or a KL controller stepped once per
optimizer step from the step's global KL.

:class:`Coefficient` holds what the loss multiplies by and the KL sums of the optimizer step in progress
(from :func:`~lightning_kl.reduce.controlled_kl_statistics`); :meth:`Coefficient.close_step` sums them over
the data parallel group and updates the controller (the maths of the controllers is in
:mod:`lightning_kl.controllers`). Kept apart from the loss so that the loss's forward stays a composition
of steps, and so that a step's pending sums can be dropped when a fit starts or ends
(:meth:`Coefficient.reset`), which :class:`~lightning_kl.KLLossCallback` does.

The same step serves :class:`~lightning_kl.EntropyBonus` (its coefficient moved by the step's token-mean
entropy): :class:`ControllerState` is the shell both inherit (``coef``, ``controller``, ``update_coef``,
``reset_step``, ``attach`` and the controller's ``state_dict`` entry).

A controller that never moves is a silent mistake (a plain loop that never calls ``update_coef()``, a
Trainer without :class:`~lightning_kl.KLLossCallback`): after :data:`UNSTEPPED_FORWARDS` training
forwards with no step closed, the loss or the bonus warns once, naming the fix. One controller object
moved by two of them (a loss and a bonus) is refused: in a Trainer by the callback before the fit, in a
loop when one of them closes a step while the other has training forwards of the same step
(:func:`shared_controller_message` words both).
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_kl.controllers import KLController
from lightning_kl.ground.checks import warn_user
from lightning_kl.ground.parallel import data_parallel_group

__all__ = [
    "UNSTEPPED_FORWARDS",
    "Coefficient",
    "ControllerState",
    "controller_chain",
    "live_controlled",
    "shared_controller_message",
]

#: Training forwards with a controller and no closed optimizer step after which the loss warns (once): more
#: micro-batches than an optimizer step accumulates in practice.
UNSTEPPED_FORWARDS = 64


#: The training forwards of an open step, by coefficient: a controller that two of them hold is shared.
_OPEN: "weakref.WeakSet[Coefficient]" = weakref.WeakSet()


def controller_chain(controller: Optional[KLController]) -> list[KLController]:
    """A controller and the ones it wraps (a KLSchedule's); ``[]`` for None."""
    out = [] if controller is None else [controller]
    while out and isinstance(getattr(out[-1], "controller", None), KLController):
        out.append(out[-1].controller)
    return out


def shared_controller_message(users: list[tuple[str, str]]) -> str:
    """The refusal of one controller object moved by several users: ``(who, what moves it)`` each."""
    names = " and ".join(who for who, _ in users)
    moves = "; ".join(f"{who} with {what}" for who, what in users)
    return (
        f"one KL controller object is used by {names}: each would update it once per step with its own measure "
        f"({moves}), so its coefficient would follow neither. Give each its own controller."
    )


class Coefficient:
    """A loss's or a bonus's coefficient: ``number`` (a float >= 0) or ``controller``, and the open step's sums.

    ``owner`` names the module in messages; ``measure`` says what moves the controller (the refusal of a
    shared controller); ``controllers`` lists the controllers ``coef`` takes (the refusal of a bad ``coef``).
    """

    def __init__(
        self,
        coef: Union[float, KLController],
        owner: str = "KLPenaltyLoss",
        measure: str = "its KL per optimizer step, in the units of its `agg`",
        controllers: str = "a KLController (FixedKLController, AdaptiveKLController, TargetKLController, KLSchedule)",
    ) -> None:
        if isinstance(coef, KLController):
            self.controller: Optional[KLController] = coef
            self.number = float("nan")
        elif isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
            raise ValueError(f"`coef` must be a finite number >= 0 or {controllers}, got {coef!r}.")
        else:
            self.controller, self.number = None, float(coef)
        self.owner, self.measure = owner, measure
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
            _OPEN.add(self)
            if self.forwards >= UNSTEPPED_FORWARDS and not attached and not self.warned_unstepped:
                self.warned_unstepped = True
                warn_user(
                    f"{self.owner}'s controller has not moved in {self.forwards} training forwards: nothing closed an "
                    "optimizer step (`update_coef()`), so its coefficient stays where it started and the step's "
                    "sums keep growing. In a Lightning Trainer add `lk.KLLossCallback()` to `Trainer(callbacks=...)` "
                    "(the installed package's entry point adds it to Trainers built after `import lightning_kl`; a "
                    f"source tree has no entry point); in a plain loop or under Fabric call the {self.owner}'s "
                    "`update_coef()` after `backward`, once per optimizer step.",
                    rank_zero=True,
                )
        # the step's coefficient, a device tensor (no host read), rounded to the loss's dtype as a float is
        return self.controller.value_tensor(loss.device).to(loss.dtype) * loss

    def close_step(self, dp: Any, device: Any = None) -> Optional[tuple[Tensor, Tensor]]:
        """Update the controller from the open step's global KL (one ``all_reduce`` over ``dp`` when it has
        more than one process); start the next step. ``(coef used, global KL)`` or None for a number."""
        if self.controller is None:
            return None
        self._refuse_if_shared()
        stats = self.pending
        self.pending, self.forwards = None, 0
        _OPEN.discard(self)
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
        _OPEN.discard(self)

    def _refuse_if_shared(self) -> None:
        # another coefficient with training forwards in this step moves one of the same controllers: the step
        # would be closed twice, from two measures. Host bookkeeping only: every process decides alike.
        mine = {id(c) for c in controller_chain(self.controller)}
        for other in list(_OPEN):
            if other is not self and mine & {id(c) for c in controller_chain(other.controller)}:
                other_name = f"{'another' if other.owner == self.owner else _article(other.owner)} {other.owner}"
                raise ValueError(
                    shared_controller_message([(f"this {self.owner}", self.measure), (other_name, other.measure)])
                    + " (Found at `update_coef()`: both ran training forwards in this step.)"
                )


def _article(word: str) -> str:
    return "an" if word[:1] in "AEIOU" else "a"


#: Every loss and bonus alive in the process, for KLLossCallback (which acts only when there is one).
_LIVE: "weakref.WeakSet[ControllerState]" = weakref.WeakSet()


def live_controlled() -> list["ControllerState"]:
    """The :class:`ControllerState` modules (losses, bonuses) alive in this process."""
    return list(_LIVE)


class ControllerState(nn.Module):
    """The shell of a module whose coefficient may be a controller (:class:`~lightning_kl.KLPenaltyLoss`,
    :class:`~lightning_kl.EntropyBonus`): ``coef`` and ``controller`` (a :class:`Coefficient` made by
    :meth:`_make_coefficient`), the step's close (:meth:`update_coef`, :meth:`reset_step`), the Trainer it
    is attached to (:meth:`attach`), and the controller's ``state_dict`` entry: the controller's state as
    ``_extra_state``, and only when it exists, so a strict load into a model without the module fits; a
    state_dict without the entry (0.2, or a number coef) loads as is.

    A subclass sets ``process_group`` and ``device_mesh`` (the data parallel group of the step's close).
    """

    _coefficient: Coefficient
    process_group: Any
    device_mesh: Any
    #: what the warnings call this module ("this loss has ...")
    kind = "module"

    def __init__(self) -> None:
        super().__init__()
        self._trainer_ref: Optional[weakref.ReferenceType] = None
        _LIVE.add(self)

    def _make_coefficient(self, coef: Union[float, KLController]) -> Coefficient:
        return Coefficient(coef)

    @property
    def coef(self) -> float:
        """The coefficient now, as a Python float: the number given, or the controller's current value
        (which reads the device, and raises a fault the controller recorded there).

        Setting it takes what ``coef`` takes in the constructor: a number or a controller.
        """
        c = self._coefficient
        return c.number if c.controller is None else c.controller.value

    @coef.setter
    def coef(self, coef: Union[float, KLController]) -> None:
        self._coefficient = self._make_coefficient(coef)

    @property
    def controller(self) -> Optional[KLController]:
        """The :class:`~lightning_kl.KLController` that moves the coefficient, or None for a number ``coef``."""
        return self._coefficient.controller

    def update_coef(self, strategy: Any = None, device: Any = None) -> Optional[tuple[Tensor, Tensor]]:
        """Close an optimizer step: update the controller from the step's global statistic; return what was used.

        Sums the statistics of every training forward since the last call over the data parallel group
        (every process must call this the same number of times: it runs one ``all_reduce`` when the
        group has more than one process) and gives them to the controller: for
        :class:`~lightning_kl.KLPenaltyLoss` the global KL in the units of its ``agg`` and the number of
        non-empty sequences (``n_steps``), for :class:`~lightning_kl.EntropyBonus` the global token-mean
        entropy and the number of valid tokens. Then starts the next step's sums. No host read. A step
        with no valid token anywhere leaves the coefficient unchanged. Done by
        :class:`~lightning_kl.KLLossCallback` in a Trainer; by hand elsewhere, after ``backward`` (the
        coefficient the step's gradient used is replaced, never changed in place). A controlled module
        that runs many training forwards with no step closed (:data:`lightning_kl.coefficient.
        UNSTEPPED_FORWARDS`) and no Trainer warns once, naming this call. One controller object moved by
        a loss and a bonus is refused here (``ValueError``, on every process alike) when the other
        one has training forwards in the step.

        Args:
            strategy: the Lightning strategy, when there is one (it names the data parallel group).
            device: where to make the step's sums if this process ran no forward in the step
                (default: where the coefficient is).

        Returns:
            None for a number ``coef``; else ``(coef, value)``: the coefficient this step used and the
            step's global KL or entropy (NaN for a step with no valid token), float64 0-d tensors on the
            device.
        """
        if self.controller is None:
            return None
        dp = data_parallel_group(self.process_group, self.device_mesh, strategy=strategy)
        return self._coefficient.close_step(dp, device)

    def reset_step(self) -> None:
        """Drop the sums of an optimizer step left open (a fit stopped inside an accumulation window):
        done by :class:`~lightning_kl.KLLossCallback` when a fit starts and ends."""
        self._coefficient.reset()

    def attach(self, trainer: Any) -> None:
        """Connect this module to the Trainer that fits its LightningModule (None: disconnect).

        Done by :class:`~lightning_kl.KLLossCallback` at ``setup``, which every Trainer gets
        by itself once lightning-kl is installed. A loss then reads the Trainer's
        ``accumulate_grad_batches`` while it trains; an attached module does not warn about steps
        left unclosed (the callback closes them). Kept by a weak reference; not copied by ``deepcopy``
        or pickling (a copy is attached by the Trainer that fits it).
        """
        self._trainer_ref = None if trainer is None else weakref.ref(trainer)

    def _attached(self) -> bool:
        return self._trainer_ref is not None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["_trainer_ref"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copy or an unpickled module (a spawned process's) is alive too: KLLossCallback must find it
        super().__setstate__(state)
        _LIVE.add(self)

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
