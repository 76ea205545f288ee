r"""``TargetEntropyController``: the entropy bonus's coefficient, steered toward a target entropy.

The mirror of :class:`~lightning_kl.TargetKLController`: the coefficient rises while the policy's
entropy is under the target and falls while it is above, within bounds, once per update (per
optimizer step in :class:`~lightning_kl.EntropyBonus`). Two rules, by name:

* ``"dual"`` (default): dual ascent on the log of the coefficient, the entropy constraint
  :math:`H \ge H_{\mathrm{target}}` as a Lagrange multiplier (:func:`target_entropy_factor`);
* ``"additive"``: TRL's ``use_adaptive_entropy`` (Skywork-OR1): plus ``coef_delta`` when the
  step's entropy is at or below the target, minus it above, clipped to the bounds; and the
  coefficient is *applied* only while the last step's entropy was at or below the target (0
  before the first update and after a step above the target), as TRL's trainer applies it.

It is a :class:`~lightning_kl.KLController` (the base of every coefficient controller), so that
:class:`~lightning_kl.KLSchedule` wraps it (a warm-up, a decay) and a YAML file names it by
``class_path`` wherever a controller is taken; the "KL" it is given is the entropy.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_kl.controllers import KLController, Number, check_number, exp_float64

__all__ = ["ENTROPY_RULES", "TargetEntropyController", "target_entropy_factor"]

#: The rules of :class:`TargetEntropyController`.
ENTROPY_RULES = ("dual", "additive")


def target_entropy_factor(entropy: Number, target_entropy: float, step_size: float) -> Number:
    r"""The factor of one ``"dual"`` update: :math:`\exp\big(\eta \operatorname{clip}(1 - H / H_{\mathrm{target}}, -1, 1)\big)`.

    Above 1 while the entropy is under the target (up to :math:`e^{\eta}` at :math:`H = 0`), 1 at
    the target, below 1 above it (down to :math:`e^{-\eta}` at twice the target and beyond). On
    Python floats or float64 tensors (no host read), the same operations in the same order, with one
    ``exp`` (:func:`~lightning_kl.controllers.exp_float64`): on a CPU both paths give the same bits.

    Example:
        >>> math.isclose(target_entropy_factor(0.0, 0.5, 0.1), math.exp(0.1), rel_tol=1e-15)  # collapsed: the largest rise
        True
        >>> target_entropy_factor(torch.tensor(0.5, dtype=torch.float64), 0.5, 0.1)  # at the target
        tensor(1., dtype=torch.float64)
    """
    error = 1.0 - entropy / target_entropy
    if isinstance(error, Tensor):
        return exp_float64(step_size * error.clamp(-1.0, 1.0))
    return exp_float64(step_size * min(max(error, -1.0), 1.0))


class TargetEntropyController(KLController):
    r"""The entropy bonus's coefficient, moved toward a target entropy once per optimizer step.

    ``rule="dual"``:

    .. math::
        \log c \leftarrow \operatorname{clip}\!\Big(\log c + \eta\,\operatorname{clip}\!\Big(1 - \frac{H}{H_{\mathrm{target}}},\ -1,\ 1\Big),\
        \log c_{\min},\ \log c_{\max}\Big)

    ``rule="additive"`` (TRL's ``use_adaptive_entropy``, exactly):

    .. math::
        c \leftarrow \begin{cases} \min(c + \delta,\ c_{\max}) & H \le H_{\mathrm{target}} \\
        \max(c - \delta,\ c_{\min}) & H > H_{\mathrm{target}} \end{cases}
        \qquad \text{applied: } c \,[H_{\text{last}} \le H_{\mathrm{target}}]

    with :math:`H` the step's token-mean entropy (nats per token) over every valid token of every
    process (:class:`~lightning_kl.EntropyBonus` sums it over the data parallel group, so every
    process moves alike) and :math:`H_{\text{last}}` the last update's (``+inf`` before the first:
    TRL applies no bonus until its first step). :attr:`value` is the coefficient *applied* (the
    gated one for ``"additive"``); :attr:`coef` the one the rule moves. A step with no valid token
    changes nothing (TRL's would read an entropy of 0 and raise the coefficient); a non-finite
    entropy changes nothing and is raised where the host reads the coefficient
    (:class:`~lightning_kl.KLController`'s notes).

    Args:
        target_entropy: :math:`H_{\mathrm{target}}`, nats per token (``> 0``). TRL's ``entropy_target``.
        init_coef: the starting coefficient, within the bounds. TRL's ``entropy_coef``.
        rule: one of :data:`ENTROPY_RULES`: ``"dual"`` or ``"additive"``.
        step_size: ``"dual"``: :math:`\eta > 0`, the largest change of :math:`\log c` in one step.
        coef_delta: ``"additive"``: :math:`\delta > 0`. TRL's ``entropy_coef_delta``.
        coef_min: the lower bound (``"dual"``: ``> 0``, default ``1e-6``; ``"additive"``: ``>= 0``,
            default 0). TRL's ``entropy_coef_min``.
        coef_max: the upper bound (``>= coef_min``). TRL's ``entropy_coef_max``.

    Raises:
        ValueError: at construction, for an unknown rule (the rules listed) or a bad number (named).

    Example:
        >>> ctl = TargetEntropyController(target_entropy=0.5, init_coef=0.01, step_size=0.2)
        >>> ctl.update(0.25, n_steps=100)  # half the target: log c += 0.2 * 0.5
        >>> round(ctl.value, 6)  # 0.01 * e ** 0.1
        0.011052
        >>> trl = TargetEntropyController(0.5, init_coef=0.0, rule="additive", coef_delta=0.005)
        >>> trl.value  # no step yet: TRL applies nothing
        0.0
        >>> trl.update(0.3, n_steps=100); trl.value, trl.coef  # under the target: up, and applied
        (0.005, 0.005)
        >>> trl.update(0.7, n_steps=100); trl.value, trl.coef  # above: down, and not applied
        (0.0, 0.0)
    """

    def __init__(
        self,
        target_entropy: float = 0.2,
        init_coef: float = 0.001,
        rule: str = "dual",
        step_size: float = 0.1,
        coef_delta: float = 0.005,
        coef_min: Optional[float] = None,
        coef_max: float = 1.0,
    ) -> None:
        if rule not in ENTROPY_RULES:
            raise ValueError(f"Unknown entropy rule {rule!r}. Valid rules: {', '.join(map(repr, ENTROPY_RULES))}.")
        self.rule = rule
        dual = rule == "dual"
        self.target_entropy = check_number("target_entropy", target_entropy, positive=True)
        self.step_size = check_number("step_size", step_size, positive=True)
        self.coef_delta = check_number("coef_delta", coef_delta, positive=True)
        if coef_min is None:
            coef_min = 1e-6 if dual else 0.0
        self.coef_min = check_number("coef_min", coef_min, positive=dual)
        self.coef_max = check_number("coef_max", coef_max, positive=dual)
        if self.coef_min > self.coef_max:
            raise ValueError(f"`coef_min` ({coef_min!r}) must be <= `coef_max` ({coef_max!r}).")
        init = check_number("init_coef", init_coef, positive=dual)
        if not self.coef_min <= init <= self.coef_max:
            raise ValueError(
                f"`init_coef` must be within [coef_min, coef_max] = [{self.coef_min!r}, {self.coef_max!r}], "
                f"got {init_coef!r}."
            )
        self._last: Union[float, Tensor] = math.inf  # the last update's entropy ("additive"'s gate)
        self.value = init

    # ------------------------------------------------------------------------------------------
    # the coefficient: `coef` is the rule's, `value` the applied one

    @property
    def coef(self) -> float:
        """The coefficient the rule moves, before ``"additive"``'s gate (a host read)."""
        return KLController.value.fget(self)  # type: ignore[attr-defined]

    @property
    def value(self) -> float:  # type: ignore[override]
        """The coefficient applied now, as a Python float (a host read; raises a recorded fault)."""
        coef = self.coef
        return coef if self._gate_open() else 0.0

    @value.setter
    def value(self, value: float) -> None:
        KLController.value.fset(self, value)  # type: ignore[attr-defined]

    def value_tensor(self, device: Optional[Union[torch.device, str]] = None) -> Tensor:
        """The coefficient applied, a float64 0-d tensor on ``device``; no host read."""
        coef = super().value_tensor(device)
        if self.rule == "dual":
            return coef
        last = torch.as_tensor(self._last, dtype=torch.float64, device=coef.device)
        return torch.where(last <= self.target_entropy, coef, torch.zeros((), dtype=coef.dtype, device=coef.device))

    def _gate_open(self) -> bool:
        return self.rule == "dual" or float(self._last) <= self.target_entropy

    # ------------------------------------------------------------------------------------------
    # updates

    def update(self, current_entropy: Union[float, Tensor], n_steps: Union[int, Tensor]) -> None:
        """Observe the token-mean entropy of a step of ``n_steps`` valid tokens (see the class)."""
        super().update(current_entropy, n_steps)  # "dual": the update; "additive": the checks and faults only
        if self.rule == "dual":
            return
        if isinstance(current_entropy, Tensor) or isinstance(n_steps, Tensor):
            coef = super().value_tensor()
            device = coef.device
            h = torch.as_tensor(current_entropy, device=device).to(torch.float64).reshape(())
            n = torch.as_tensor(n_steps, device=device).to(torch.float64).reshape(())
            apply = (n >= 1) & torch.isfinite(h)
            moved = torch.where(
                h <= self.target_entropy, (coef + self.coef_delta).clamp(max=self.coef_max),
                (coef - self.coef_delta).clamp(min=self.coef_min),
            )
            self._value = torch.where(apply, moved, coef)
            last = torch.as_tensor(self._last, dtype=torch.float64, device=device)
            self._last = torch.where(apply, h, last)
            return
        h = float(current_entropy)  # checked by the base class
        coef = KLController.value.fget(self)  # type: ignore[attr-defined]
        if h <= self.target_entropy:
            self.value = min(coef + self.coef_delta, self.coef_max)
        else:
            self.value = max(coef - self.coef_delta, self.coef_min)
        self._last = h

    def _factor(self, current_kl: Number, n_steps: Number) -> Optional[Number]:
        if self.rule == "dual":
            return target_entropy_factor(current_kl, self.target_entropy, self.step_size)
        return None

    def _bounded(self, value: Number) -> Number:
        if isinstance(value, Tensor):
            return value.clamp(self.coef_min, self.coef_max)
        return min(max(value, self.coef_min), self.coef_max)

    def _non_finite_message(self, current_kl: float) -> str:
        return (
            f"{type(self).__name__}.update got a non-finite entropy ({current_kl}): the step's entropies hold NaN "
            "or inf on valid tokens. The coefficient was not changed."
        )

    # ------------------------------------------------------------------------------------------
    # state

    def state_dict(self) -> dict[str, Any]:
        """The coefficient the rule moves and the last entropy (float64 numbers: a resume is exact)."""
        return {"value": self.coef, "last_entropy": float(self._last), "rule": self.rule}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # the state is the coefficient and the gate's entropy; the target, rule and bounds stay as constructed
        self.value = float(state_dict["value"])
        self._last = float(state_dict.get("last_entropy", math.inf))

    def __repr__(self) -> str:
        coef = self._value if isinstance(self._value, float) else self._value.detach().cpu().item()
        return f"TargetEntropyController(target_entropy={self.target_entropy}, rule={self.rule!r}, coef={coef!r})"
