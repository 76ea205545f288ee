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

__all__ = ["AdaptiveKLController", "FixedKLController", "KLController", "adaptive_kl_factor"]

Number = TypeVar("Number", float, Tensor)

_NON_FINITE, _NON_POSITIVE = 1.0, 2.0  # fault codes recorded on the device


def _check_number(name: str, value: Any, *, positive: bool) -> float:
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
        self.value = self.value * factor

    def _factor(self, current_kl: Number, n_steps: Number) -> Optional[Number]:
        """The multiplicative update of the coefficient for this batch; ``None`` for a constant.

        A subclass implements this (on floats and on tensors), or overrides :meth:`update` itself
        (as controllers written for the earlier, float-only base class do: they then get tensors
        from the callback, which ``float()`` reads).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement `_factor` or `update`.")

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
            self._value = torch.where(apply, value * factor, value)
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
        self.value = _check_number("kl_coef", kl_coef, positive=False)

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
        self.value = _check_number("init_kl_coef", init_kl_coef, positive=True)
        self.target_kl = _check_number("target_kl", target_kl, positive=True)
        self.horizon = _check_number("horizon", horizon, positive=True)

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
