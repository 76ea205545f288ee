r"""KL coefficient controllers: the ``beta`` of ``rewards = scores - beta * kl``.

A controller is a tiny state machine: :attr:`~KLController.value` is the current coefficient,
:meth:`~KLController.update` is called once per (global) batch with that batch's KL, and
:meth:`~KLController.state_dict` / :meth:`~KLController.load_state_dict` carry everything needed
to resume. The base class lets a YAML file name either controller with ``class_path``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

__all__ = ["AdaptiveKLController", "FixedKLController", "KLController"]


def _check_number(name: str, value: Any, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}.")
    if positive and not value > 0:
        raise ValueError(f"`{name}` must be > 0, got {value!r}.")
    if not positive and value < 0:
        raise ValueError(f"`{name}` must be >= 0, got {value!r}.")
    return float(value)


class KLController(ABC):
    """Base class of the KL coefficient controllers."""

    value: float

    @abstractmethod
    def update(self, current_kl: float, n_steps: int) -> None:
        """Observe the KL of a batch of ``n_steps`` sequences (after its rewards were shaped)."""

    def _check_update(self, current_kl: float, n_steps: int) -> float:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(
                f"{type(self).__name__}.update got a non-finite KL ({current_kl}): the batch holds NaN or inf "
                "log-probs on valid tokens. The coefficient was not changed."
            )
        if isinstance(n_steps, bool) or int(n_steps) != n_steps or n_steps < 1:
            raise ValueError(f"`n_steps` must be a positive integer, got {n_steps!r}.")
        return current_kl

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = float(state_dict["value"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(value={self.value!r})"


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

    def update(self, current_kl: float, n_steps: int) -> None:
        self._check_update(current_kl, n_steps)


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
    """

    def __init__(self, init_kl_coef: float = 0.2, target_kl: float = 6.0, horizon: int = 10000) -> None:
        self.value = _check_number("init_kl_coef", init_kl_coef, positive=True)
        self.target_kl = _check_number("target_kl", target_kl, positive=True)
        self.horizon = _check_number("horizon", horizon, positive=True)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = self._check_update(current_kl, n_steps)
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        factor = 1.0 + error * n_steps / self.horizon
        if factor <= 0:
            raise ValueError(
                f"AdaptiveKLController: a batch of {n_steps} sequences with horizon={self.horizon:g} would make the "
                f"coefficient non-positive (factor {factor:g}); use a horizon of at least {n_steps / 5:g} sequences."
            )
        self.value *= factor

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # the coefficient is the state; target and horizon are configuration and stay as constructed
        self.value = float(state_dict["value"])
