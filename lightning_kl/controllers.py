r"""KL coefficient controllers: the ``beta`` of ``rewards = scores - beta * kl``.

A controller is a tiny state machine: :attr:`~KLController.value` is the current coefficient,
:meth:`~KLController.update` is called once per (global) batch with that batch's KL, and
:meth:`~KLController.state_dict` / :meth:`~KLController.load_state_dict` carry everything needed
to resume. The base class lets a YAML file name either controller with ``class_path``.

Two ways to drive one, the same maths:

* with Python numbers (plain use, the doctests): ``update(3.0, n_steps=64)`` checks its input and
  raises at once on a non-finite KL;
* with tensors (what :class:`~lightning_kl.KLRewardCallback` does every step): ``update(kl, n)``
  with 0-d tensors keeps the coefficient on their device as a float64 tensor
  (:meth:`~KLController.value_tensor`) and never reads the device, so a GPU step does not wait
  for the host. An update that cannot be applied (a non-finite KL, or an adaptive factor
  ``<= 0``) then leaves the coefficient unchanged on the device and records the fault, which
  is raised where the host reads the coefficient anyway: :attr:`~KLController.value` and
  :meth:`~KLController.state_dict` (a checkpoint). A batch of ``n_steps = 0`` changes nothing.
"""

from __future__ import annotations

import math
from abc import ABC
from typing import Any, Optional, TypeVar, Union

import torch
from torch import Tensor

from lightning_kl.ground.checks import warn_user

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "KLSchedule",
    "SCHEDULE_KINDS",
    "TargetKLController",
    "adaptive_kl_factor",
    "check_number",
    "exp_float64",
    "schedule_scale",
    "target_kl_factor",
]

Number = TypeVar("Number", float, Tensor)

_NON_FINITE, _NON_POSITIVE = 1.0, 2.0  # fault codes recorded on the device


def exp_float64(x: Number) -> Number:
    """``exp`` of a float64 tensor, or of a Python float through the same torch kernel (a 0-d float64 CPU tensor).

    ``math.exp`` and ``torch.exp`` are different libraries and disagree by an ulp on some inputs (on some
    CPUs for about one input in 20): a controller's float path and its tensor path give the same bits on a
    CPU only if they share one ``exp``. (A tensor on an accelerator runs that device's ``exp``.)
    """
    if isinstance(x, Tensor):
        return x.exp()
    return float(torch.tensor(x, dtype=torch.float64).exp())


def check_number(name: str, value: Any, *, positive: bool) -> float:
    """A controller's setting: a finite real number (not a bool), > 0 if ``positive`` else >= 0, as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}.")
    if positive and not value > 0:
        raise ValueError(f"`{name}` must be > 0, got {value!r}.")
    if not positive and value < 0:
        raise ValueError(f"`{name}` must be >= 0, got {value!r}.")
    return float(value)


def adaptive_kl_factor(current_kl: Number, target_kl: float, n_steps: Number, horizon: float) -> Number:
    r"""The factor of one adaptive update: :math:`1 + \operatorname{clip}(\mathrm{KL}/\mathrm{KL}_{\mathrm{target}} - 1, \pm 0.2)\, n / \mathrm{horizon}`.

    On Python floats or on tensors (a clip and a multiply on the device, no host read); the same
    operations in the same order, so both give the same float64 number.

    Example:
        >>> adaptive_kl_factor(12.0, 6.0, 500, 10000.0)  # error clipped to 0.2
        1.01
        >>> adaptive_kl_factor(torch.tensor(5.7, dtype=torch.float64), 6.0, torch.tensor(100.0, dtype=torch.float64), 10000.0)
        tensor(0.9995, dtype=torch.float64)
    """
    ratio = current_kl / target_kl - 1.0
    error = ratio.clamp(-0.2, 0.2) if isinstance(ratio, Tensor) else min(max(ratio, -0.2), 0.2)
    return 1.0 + error * n_steps / horizon


class KLController(ABC):
    """Base class of the KL coefficient controllers.

    Subclasses set ``self.value`` in ``__init__``, implement :meth:`_factor` (the multiplicative
    update, ``None`` for none) and keep their configuration as attributes; the coefficient itself
    lives here, as a Python float or, once updated with tensors, as a float64 0-d tensor on the KL's
    device.
    """

    _value: Union[float, Tensor]
    _fault: Optional[Tensor] = None  # float64 [code, current_kl, n_steps] of the first unreported fault

    # ------------------------------------------------------------------------------------------
    # the coefficient

    @property
    def value(self) -> float:
        """The coefficient as a Python float (reads the device if it lives there).

        Raises:
            ValueError: if a tensor update since the last read could not be applied (then the
                coefficient is the one from before that update).
        """
        self._raise_fault()
        return self._value if isinstance(self._value, float) else float(self._value)

    @value.setter
    def value(self, value: float) -> None:
        self._value = float(value)
        self._fault = None

    def value_tensor(self, device: Optional[Union[torch.device, str]] = None) -> Tensor:
        """The coefficient as a float64 0-d tensor on ``device`` (default: where it lives, else CPU).

        No host read: the tensor stays where it is, or is filled on the device. The controller
        keeps it there from now on; later tensor updates replace it (never in place), so a tensor
        returned here keeps the coefficient of its time.
        """
        v = self._value
        if isinstance(v, Tensor):
            if device is None or v.device == torch.device(device):
                return v
            v = v.to(device)
        else:
            v = torch.full((), v, dtype=torch.float64, device=device)
        self._value = v
        return v

    # ------------------------------------------------------------------------------------------
    # updates

    def update(self, current_kl: Union[float, Tensor], n_steps: Union[int, Tensor]) -> None:
        """Observe the KL of a batch of ``n_steps`` sequences (after its rewards were shaped).

        Python numbers: checked, and a non-finite KL raises ``ValueError`` at once (coefficient
        unchanged). 0-d tensors: the update runs on their device without a host read (see the
        module's notes); ``n_steps = 0`` (no sequence) leaves the coefficient as it is.
        """
        if isinstance(current_kl, Tensor) or isinstance(n_steps, Tensor):
            self._update_on_device(current_kl, n_steps)
            return
        current_kl = self._check_update(current_kl, n_steps)
        factor = self._factor(current_kl, n_steps)
        if factor is None:
            return
        if factor <= 0:
            raise ValueError(self._non_positive_message(n_steps, factor))
        self.value = self._bounded(self.value * factor)

    def _factor(self, current_kl: Number, n_steps: Number) -> Optional[Number]:
        """The multiplicative update of the coefficient for this batch; ``None`` for a constant.

        A subclass implements this (on floats and on tensors), or overrides :meth:`update` itself
        (as controllers written for the earlier, float-only base class do: they then get tensors
        from the callback, which ``float()`` reads).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement `_factor` or `update`.")

    def _bounded(self, value: Number) -> Number:
        """The coefficient after an update, kept within the controller's bounds (none here)."""
        return value

    def _non_positive_message(self, n_steps: float, factor: float) -> str:
        return f"{type(self).__name__}: the update factor would be {factor:g} for a batch of {n_steps:g} sequences."

    def _check_update(self, current_kl: float, n_steps: int) -> float:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(self._non_finite_message(current_kl))
        if isinstance(n_steps, bool) or int(n_steps) != n_steps or n_steps < 1:
            raise ValueError(f"`n_steps` must be a positive integer, got {n_steps!r}.")
        return current_kl

    def _non_finite_message(self, current_kl: float) -> str:
        return (
            f"{type(self).__name__}.update got a non-finite KL ({current_kl}): the batch holds NaN or inf "
            "log-probs on valid tokens. The coefficient was not changed."
        )

    def _update_on_device(self, current_kl: Union[float, Tensor], n_steps: Union[int, Tensor]) -> None:
        device = next(t.device for t in (current_kl, n_steps) if isinstance(t, Tensor))
        value = self.value_tensor(device)
        kl = torch.as_tensor(current_kl, device=device).to(torch.float64).reshape(())
        n = torch.as_tensor(n_steps, device=device).to(torch.float64).reshape(())
        factor = self._factor(kl, n)
        observed = n >= 1
        non_finite = observed & ~torch.isfinite(kl)
        code = torch.where(non_finite, _NON_FINITE, 0.0)
        apply = observed & ~non_finite
        if factor is not None:
            non_positive = apply & ~(factor > 0)
            code = torch.where(non_positive, _NON_POSITIVE, code)
            apply = apply & ~non_positive
            # a new tensor, never in place: a coefficient handed out earlier keeps its value
            self._value = torch.where(apply, self._bounded(value * factor), value)
        fault = torch.stack([code.to(torch.float64), kl, n])
        if self._fault is None:
            self._fault = torch.zeros(3, dtype=torch.float64, device=device)
        self._fault = torch.where((self._fault[0] == 0) & (code > 0), fault, self._fault.to(device))

    def _raise_fault(self) -> None:
        if self._fault is None:
            return
        code, kl, n = self._fault.tolist()  # the host reads here anyway
        self._fault = None
        if code == _NON_FINITE:
            raise ValueError(self._non_finite_message(kl))
        if code == _NON_POSITIVE:
            raise ValueError(self._non_positive_message(n, float(self._factor(kl, n) or 0.0)) + " It was not changed.")

    # ------------------------------------------------------------------------------------------
    # state

    def state_dict(self) -> dict[str, Any]:
        """``{"value": float}`` (a checkpoint reads the coefficient, and raises a recorded fault)."""
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = float(state_dict["value"])

    def __repr__(self) -> str:
        value = self._value if isinstance(self._value, float) else self._value.detach().cpu().item()
        return f"{type(self).__name__}(value={value!r})"


class FixedKLController(KLController):
    """A constant coefficient.

    Args:
        kl_coef: the coefficient (``>= 0``).

    Example:
        >>> ctl = FixedKLController(kl_coef=0.05)
        >>> ctl.update(current_kl=3.0, n_steps=64); ctl.value
        0.05
    """

    def __init__(self, kl_coef: float = 0.001) -> None:
        self.value = check_number("kl_coef", kl_coef, positive=False)

    def _factor(self, current_kl: Number, n_steps: Number) -> None:
        return None


class AdaptiveKLController(KLController):
    r"""The adaptive coefficient of Ziegler et al. (2019), "Fine-Tuning Language Models from Human
    Preferences": a proportional controller that steers the KL toward ``target_kl``.

    .. math::
        e = \operatorname{clip}\!\Big(\frac{\mathrm{KL}}{\mathrm{KL}_{\mathrm{target}}} - 1,\ -0.2,\ 0.2\Big),
        \qquad \beta \leftarrow \beta \,\Big(1 + e \,\frac{n_{\mathrm{steps}}}{\mathrm{horizon}}\Big)

    ``n_steps`` is the number of sequences in the batch, so the rate of change does not depend on
    how the data is split into batches or processes.

    Args:
        init_kl_coef: the starting coefficient (``> 0``: a multiplicative update cannot leave 0).
        target_kl: the KL to steer toward (``> 0``).
        horizon: the number of sequences over which the coefficient changes by about ``e`` (``> 0``).

    Example:
        >>> ctl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
        >>> ctl.update(current_kl=12.0, n_steps=500)  # e = clip(1.0) = 0.2: beta *= 1.01
        >>> round(ctl.value, 6)
        0.202
        >>> kl, n = torch.tensor(3.0, dtype=torch.float64), torch.tensor(1000.0, dtype=torch.float64)
        >>> ctl.update(kl, n)  # on the tensors' device, no host read: e = -0.2, beta *= 0.98
        >>> ctl.value_tensor()
        tensor(0.1980, dtype=torch.float64)
    """

    def __init__(self, init_kl_coef: float = 0.2, target_kl: float = 6.0, horizon: int = 10000) -> None:
        self.value = check_number("init_kl_coef", init_kl_coef, positive=True)
        self.target_kl = check_number("target_kl", target_kl, positive=True)
        self.horizon = check_number("horizon", horizon, positive=True)

    def _factor(self, current_kl: Number, n_steps: Number) -> Number:
        return adaptive_kl_factor(current_kl, self.target_kl, n_steps, self.horizon)

    def _non_positive_message(self, n_steps: float, factor: float) -> str:
        return (
            f"AdaptiveKLController: a batch of {n_steps:g} sequences with horizon={self.horizon:g} would make the "
            f"coefficient non-positive (factor {factor:g}); use a horizon of at least {n_steps / 5:g} sequences."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # the coefficient is the state; target and horizon are configuration and stay as constructed
        self.value = float(state_dict["value"])


def target_kl_factor(current_kl: Number, target_kl: float, step_size: float) -> Number:
    r"""The factor of one target-KL (dual ascent) update: :math:`\exp(\eta\, \operatorname{clip}(\mathrm{KL}/\mathrm{KL}_{\mathrm{target}} - 1, \pm 1))`.

    One step of dual ascent on :math:`\log\beta` for the constraint :math:`\mathrm{KL} \le
    \mathrm{KL}_{\mathrm{target}}`, the violation measured relative to the budget (``step_size`` has
    no units) and clipped to ``[-1, 1]``: a KL of 0 lowers :math:`\log\beta` by :math:`\eta`, a KL of
    twice the budget or more raises it by :math:`\eta` (one noisy step cannot throw the coefficient
    far; a negative ``k1`` estimate counts as 0). On Python floats or on tensors, the same operations
    in the same order, with one ``exp`` (:func:`exp_float64`): on a CPU both paths give the same bits.

    Example:
        >>> math.isclose(target_kl_factor(2.0, 1.0, 0.1), math.exp(0.1), rel_tol=1e-15)  # twice the budget: log beta += 0.1
        True
        >>> target_kl_factor(50.0, 1.0, 0.1) == target_kl_factor(2.0, 1.0, 0.1)  # clipped
        True
        >>> target_kl_factor(torch.tensor(1.0, dtype=torch.float64), 1.0, 0.1)  # at the budget: unchanged
        tensor(1., dtype=torch.float64)
    """
    error = current_kl / target_kl - 1.0
    if isinstance(error, Tensor):
        return exp_float64(step_size * error.clamp(-1.0, 1.0))
    return exp_float64(step_size * min(max(error, -1.0), 1.0))


class TargetKLController(KLController):
    r"""A KL budget: the coefficient as a Lagrange multiplier, moved by dual ascent on its log.

    .. math::
        \log\beta \leftarrow \operatorname{clip}\!\Big(\log\beta + \eta\,\operatorname{clip}\!\Big(\frac{\mathrm{KL}}{\mathrm{KL}_{\mathrm{target}}} - 1,\ -1,\ 1\Big),\
        \log\beta_{\min},\ \log\beta_{\max}\Big)

    once per update (per optimizer step in :class:`~lightning_kl.KLPenaltyLoss`): a KL above the
    budget raises :math:`\beta`, below lowers it, at the budget leaves it. Unlike
    :class:`AdaptiveKLController` the step does not depend on the number of sequences (``n_steps``
    only needs to be ``>= 1``; a batch with no sequence changes nothing), and the relative error is
    clipped to ``[-1, 1]``, so that one step moves :math:`\log\beta` by at most ``step_size``: a KL of
    0 and a KL of twice the budget move it alike, down and up (:func:`target_kl_factor`).
    Constrained RLHF treats the coefficient this way (maximize the reward subject to a KL budget).
    The KL answers the coefficient with a delay (the policy drifts over several steps), so a large
    ``step_size`` overshoots and oscillates; 0.05 to 0.2 per optimizer step suits runs of a few
    hundred steps.

    **Units.** ``target_kl`` is in the units of the KL the controller is given. In
    :class:`~lightning_kl.KLPenaltyLoss` that is the loss's own KL, by its ``agg``: nats **per token**
    for ``token-mean`` and ``seq-mean-token-mean``, nats **per response** for ``seq-mean-token-sum``,
    ``seq-mean-token-sum-norm`` and ``token-sum``. In :class:`~lightning_kl.KLRewardCallback` it is
    the mean over sequences of each sequence's token-mean KL (per token).

    Args:
        target_kl: the KL budget (``> 0``).
        init_kl_coef: the starting coefficient, within the bounds.
        step_size: :math:`\eta > 0`, the largest change of :math:`\log\beta` in one update (for a KL
            of twice the budget or more, or of 0).
        min_kl_coef, max_kl_coef: the bounds, ``0 < min <= max`` (finite).

    Example:
        >>> ctl = TargetKLController(target_kl=1.0, init_kl_coef=0.1, step_size=0.5, max_kl_coef=1.0)
        >>> ctl.update(1.5, n_steps=8)  # KL 1.5x the budget: log beta += 0.5 * 0.5
        >>> round(ctl.value, 6)  # 0.1 * e ** 0.25
        0.128403
        >>> ctl.update(1.0, n_steps=8); round(ctl.value, 6)  # at the budget: unchanged
        0.128403
        >>> for _ in range(5): ctl.update(20.0, n_steps=8)  # far above: log beta += 0.5 a step, to the bound
        >>> ctl.value
        1.0
    """

    def __init__(
        self,
        target_kl: float = 1.0,
        init_kl_coef: float = 0.01,
        step_size: float = 0.1,
        min_kl_coef: float = 1e-6,
        max_kl_coef: float = 100.0,
    ) -> None:
        self.target_kl = check_number("target_kl", target_kl, positive=True)
        self.step_size = check_number("step_size", step_size, positive=True)
        self.min_kl_coef = check_number("min_kl_coef", min_kl_coef, positive=True)
        self.max_kl_coef = check_number("max_kl_coef", max_kl_coef, positive=True)
        if self.min_kl_coef > self.max_kl_coef:
            raise ValueError(
                f"`min_kl_coef` ({min_kl_coef!r}) must be <= `max_kl_coef` ({max_kl_coef!r})."
            )
        init = check_number("init_kl_coef", init_kl_coef, positive=True)
        if not self.min_kl_coef <= init <= self.max_kl_coef:
            raise ValueError(
                f"`init_kl_coef` must be within [min_kl_coef, max_kl_coef] = [{min_kl_coef!r}, {max_kl_coef!r}], "
                f"got {init_kl_coef!r}."
            )
        self.value = init

    def _factor(self, current_kl: Number, n_steps: Number) -> Number:
        return target_kl_factor(current_kl, self.target_kl, self.step_size)

    def _bounded(self, value: Number) -> Number:
        if isinstance(value, Tensor):
            return value.clamp(self.min_kl_coef, self.max_kl_coef)
        return min(max(value, self.min_kl_coef), self.max_kl_coef)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target_kl": self.target_kl, "step_size": self.step_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # the coefficient is the state; the budget, the step and the bounds stay as constructed
        self.value = float(state_dict["value"])


#: The shapes of :class:`KLSchedule` after its warm-up.
SCHEDULE_KINDS = ("constant", "linear", "cosine")


def schedule_scale(step: int, kind: str, warmup_steps: int, total_steps: Optional[int], final_scale: float) -> float:
    r"""The multiplier of a :class:`KLSchedule` after ``step`` updates (optimizer steps).

    Warm-up: ``step / warmup_steps`` for ``step < warmup_steps`` (0 at the first step). Then 1
    (``constant``), or from 1 at ``warmup_steps`` to ``final_scale`` at ``total_steps`` and after it,
    along a line (``linear``) or a half cosine (``cosine``,
    :math:`f + (1 - f)\,\tfrac12(1 + \cos \pi p)` with :math:`p` the progress in ``[0, 1]``).

    Example:
        >>> [schedule_scale(s, "linear", 2, 6, 0.0) for s in range(8)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
        >>> schedule_scale(4, "cosine", 0, 8, 0.0)  # half way down the cosine
        0.5
    """
    if step < warmup_steps:
        return step / warmup_steps
    if kind == "constant":
        return 1.0
    assert total_steps is not None
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if kind == "linear":
        return 1.0 + (final_scale - 1.0) * progress
    return final_scale + (1.0 - final_scale) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _check_steps(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"`{name}` must be an integer >= {least}, got {value!r}.")
    return value


class KLSchedule(KLController):
    r"""A coefficient schedule over steps: warm-up, then constant, linear or cosine, times a controller.

    The coefficient is ``controller.value * schedule_scale(step, ...)`` (see :func:`schedule_scale`),
    with ``step`` the number of updates so far: in :class:`~lightning_kl.KLPenaltyLoss` one per
    optimizer step, in :class:`~lightning_kl.KLRewardCallback` one per batch. Alone (``controller`` a
    number) it is a schedule of a fixed coefficient; with a controller it scales that controller's
    coefficient, which goes on observing every KL (an adaptive or target-KL coefficient with a
    warm-up, or decayed toward the end). The step count and the controller's state travel in
    :meth:`state_dict`.

    Args:
        controller: the coefficient to schedule: a number (``>= 0``, a fixed coefficient) or a
            :class:`KLController`.
        kind: one of :data:`SCHEDULE_KINDS`: ``"constant"`` (warm-up only), ``"linear"`` or ``"cosine"``.
        warmup_steps: steps of linear warm-up from 0 (``>= 0``; 0: none).
        total_steps: ``linear`` and ``cosine``: the step at which the scale reaches ``final_scale``
            (``> warmup_steps``); ``constant``: None.
        final_scale: ``linear`` and ``cosine``: the scale at ``total_steps`` and after (``>= 0``; 0 by
            default: the coefficient decays to 0).

    Setting :attr:`value` sets the controller's coefficient (the one before scaling).

    Example:
        >>> sched = KLSchedule(0.1, kind="cosine", warmup_steps=2, total_steps=6)
        >>> values = []
        >>> for _ in range(7):
        ...     values.append(round(sched.value, 4)); sched.update(0.5, n_steps=4)
        >>> values
        [0.0, 0.05, 0.1, 0.0854, 0.05, 0.0146, 0.0]
    """

    def __init__(
        self,
        controller: Union[float, KLController] = 0.001,
        kind: str = "constant",
        warmup_steps: int = 0,
        total_steps: Optional[int] = None,
        final_scale: float = 0.0,
    ) -> None:
        if isinstance(controller, KLController):
            self.controller = controller
        elif isinstance(controller, (int, float)) and not isinstance(controller, bool):
            self.controller = FixedKLController(check_number("controller", controller, positive=False))
        else:
            raise ValueError(f"`controller` must be a number >= 0 or a KLController, got {controller!r}.")
        if kind not in SCHEDULE_KINDS:
            raise ValueError(f"`kind` must be one of {', '.join(map(repr, SCHEDULE_KINDS))}, got {kind!r}.")
        self.kind = kind
        self.warmup_steps = _check_steps("warmup_steps", warmup_steps, 0)
        if kind == "constant":
            if total_steps is not None or final_scale != 0.0:
                raise ValueError(
                    "KLSchedule(kind='constant') takes no `total_steps` or `final_scale` (it keeps the scale at 1 "
                    f"after the warm-up), got total_steps={total_steps!r}, final_scale={final_scale!r}; use "
                    "kind='linear' or 'cosine' for a decay."
                )
        else:
            if total_steps is None:
                raise ValueError(f"KLSchedule(kind={kind!r}) needs `total_steps` (> warmup_steps={warmup_steps}).")
            _check_steps("total_steps", total_steps, self.warmup_steps + 1)
        self.total_steps = total_steps
        self.final_scale = check_number("final_scale", final_scale, positive=False)
        self.step = 0

    @property
    def scale(self) -> float:
        """The schedule's multiplier at the current step."""
        return schedule_scale(self.step, self.kind, self.warmup_steps, self.total_steps, self.final_scale)

    @property
    def value(self) -> float:  # type: ignore[override]
        """The scheduled coefficient as a Python float (reads the device; raises the controller's fault)."""
        return self.controller.value * self.scale

    @value.setter
    def value(self, value: float) -> None:
        self.controller.value = value

    def value_tensor(self, device: Optional[Union[torch.device, str]] = None) -> Tensor:
        """The scheduled coefficient as a float64 0-d tensor on ``device``: a new tensor, no host read."""
        return self.controller.value_tensor(device) * self.scale

    def update(self, current_kl: Union[float, Tensor], n_steps: Union[int, Tensor]) -> None:
        """Pass the KL to the controller and advance the schedule by one step."""
        self.controller.update(current_kl, n_steps)
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "controller_class": type(self.controller).__qualname__,
            "controller": self.controller.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The step, and the controller's state when it is of the controller's class: a state of another
        class warns and keeps the controller as constructed (as a module or callback does for a controller
        of another class)."""
        self.step = int(state_dict["step"])
        saved, mine = state_dict.get("controller_class"), type(self.controller).__qualname__
        if saved is not None and saved != mine:
            warn_user(
                f"KLSchedule: the state holds the state of a {saved} but this schedule wraps a {mine}; keeping the "
                f"{mine} as constructed (the schedule's step, {self.step}, is loaded).",
                rank_zero=True,
            )
            return
        self.controller.load_state_dict(state_dict["controller"])

    def __repr__(self) -> str:
        return (
            f"KLSchedule({self.controller!r}, kind={self.kind!r}, warmup_steps={self.warmup_steps}, "
            f"total_steps={self.total_steps}, final_scale={self.final_scale}, step={self.step})"
        )
