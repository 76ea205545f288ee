r"""``ReferenceRefresh``: move the reference toward the policy during training (hard reset or EMA)."""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_kl.callbacks.kl_reward import KLRewardCallback
from lightning_kl.refresh.mixing import check_alpha, check_foldable, check_mixable, fold_adapters_, mix_modules_

__all__ = ["ReferenceRefresh"]


def _check_every(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be None or a positive integer, got {value!r}.")
    return value


class ReferenceRefresh(Callback):
    r"""Refresh the reference model from the policy: hard reset or EMA, on a schedule or a KL trigger.

    At a refresh, every parameter of the reference moves toward the policy's:

    .. math::
        \theta_{\mathrm{ref}} \leftarrow \alpha\, \theta + (1 - \alpha)\, \theta_{\mathrm{ref}},
        \qquad 0 < \alpha \le 1

    ``alpha=1.0`` is a **hard reset** (reference := policy, as iterative GRPO and ProRL do: Liu et
    al. 2025, "ProRL: Prolonged Reinforcement Learning Expands Reasoning Boundaries in Large Language
    Models"); ``alpha < 1`` is the **soft update** of TR-DPO (Gorbatovski et al. 2024, "Learn Your
    Reference Model for Real Good Alignment"), an exponential moving average of the policy when
    repeated. Right after a hard reset the reference *is* the policy (bitwise, for a separate
    reference of the same dtype), so the KL is exactly 0.

    **When.** Every ``every_n_steps`` optimizer steps (``trainer.global_step``), every
    ``every_n_epochs`` epochs, and/or when the KL stays above ``kl_threshold`` for ``kl_window``
    optimizer steps in a row (nobody has to watch the run). Steps are counted at the end of each
    batch that made one or more optimizer steps (gradient accumulation counts once; a manual
    optimization batch that makes several crosses every multiple of ``every_n_steps`` it passes).
    The KL is a metric the run logs, read from ``trainer.callback_metrics`` at those batch ends,
    named by ``kl_metric``: the
    default ``"kl/value"`` is the global KL that :class:`~lightning_kl.KLRewardCallback` logs
    (``{log_prefix}value``; passing the callback itself says the same), or any name the
    LightningModule logs, such as ``self.log("train/kl", self.kl.metric)`` for a
    :class:`~lightning_kl.KLPenaltyLoss`'s metric. The value is averaged over processes
    (``trainer.strategy.reduce``) so every process takes the same decision; the trigger reads it on
    the host once per batch. The window restarts after each refresh.

    **Which reference.** ``policy`` and ``reference`` name LightningModule attributes (dotted paths
    allowed). With a separate reference model (full fine-tuning), each parameter and floating
    buffer is mixed in place, matched by name (:func:`lightning_kl.refresh.mixing.mix_modules_`); under
    DDP every process computes the same reference from the same policy, and under FSDP2
    (``ModelParallelStrategy``) each process updates its own ``DTensor`` shards: no collective, no
    gather. ``reference=None`` says **the reference is the policy with its LoRA adapters off**
    (``peft``; :func:`lightning_kl.hf.reference_logprobs`): a refresh then folds the share ``alpha``
    of each active adapter into its base weight and keeps ``1 - alpha`` of it in the adapter
    (:func:`lightning_kl.refresh.mixing.fold_adapters_`: ``W += alpha * s * B @ A``, ``B *= 1 - alpha``).
    The policy is unchanged (up to the rounding of the sum), the adapters-off model becomes
    ``alpha * policy + (1 - alpha) * reference`` exactly, and the memory stays that of one model
    and one adapter; ``alpha=1`` merges the adapters and restarts them at ``B = 0`` (``A`` keeps its
    values). Layers whose fold would not be exact (DoRA, LoRA biases, embedding or convolution
    adapters, quantized bases, sharded adapters) are refused at ``on_fit_start``.

    **What else.** ``reset_optimizer=True`` clears every optimizer's state at a refresh (Adam's
    moments restart, as in ProRL; learning-rate schedules go on); ``reset_controller=True`` puts the
    coefficient of every :class:`~lightning_kl.KLRewardCallback` in the Trainer back to its value at
    the start of training. Logs ``{log_prefix}refreshes`` (the count) and ``{log_prefix}last_step``
    (the optimizer step of the last refresh, -1 before any) at every optimizer step. Its state
    (count, last step, trigger window, initial coefficients) travels in checkpoints under
    :attr:`state_key`; the reference itself travels as part of the LightningModule's state, so it
    must be a submodule (or part of the policy, with adapters) for a resume to restore it.

    Args:
        every_n_steps: refresh when the optimizer step count reaches a multiple of ``n``, or None.
        alpha: the policy's share in the new reference, in ``(0, 1]``; 1.0 is a hard reset.
        policy: the LightningModule attribute holding the policy.
        reference: the attribute holding the separate reference model, or None for the policy with
            its adapters off.
        every_n_epochs: refresh at the end of every ``n``-th training epoch, or None.
        kl_threshold: refresh when the KL exceeds this (``> 0``) for ``kl_window`` steps in a row,
            or None.
        kl_window: the number of optimizer steps in a row (``>= 1``).
        kl_metric: the logged KL the trigger reads: a name in ``trainer.callback_metrics`` or a
            :class:`~lightning_kl.KLRewardCallback` (its ``{log_prefix}value``).
        reset_optimizer: clear the optimizers' state at each refresh.
        reset_controller: restore the KL coefficients of the Trainer's ``KLRewardCallback`` s.
        buffers: mix the floating buffers too (separate reference only).
        log_prefix: prefix of the logged names.

    Raises:
        ValueError: at construction, for ``alpha`` outside ``(0, 1]``, no trigger at all, a
            ``kl_threshold`` that is not > 0, or another bad argument; at ``on_fit_start``
            (before the first step), for attributes that do not exist, models that cannot be
            mixed (named), adapters that cannot be folded exactly, or the default ``kl_metric``
            ``"kl/value"`` with no KLRewardCallback to log it. Any other ``kl_metric`` must appear in
            ``trainer.callback_metrics`` after the first optimizer step, or the run stops there.

    Example:
        >>> refresh = ReferenceRefresh(every_n_steps=100, alpha=0.5)   # TR-DPO's soft update
        >>> refresh = ReferenceRefresh(kl_threshold=0.1, kl_window=20, reset_optimizer=True)  # ProRL-like
        >>> ReferenceRefresh(alpha=1.5, every_n_steps=10)
        Traceback (most recent call last):
        ...
        ValueError: `alpha` must be a number in (0, 1] (1.0: hard reset, reference := policy; below 1: reference := alpha * policy + (1 - alpha) * reference), got 1.5.
    """

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        alpha: float = 1.0,
        policy: str = "policy",
        reference: Optional[str] = "ref",
        every_n_epochs: Optional[int] = None,
        kl_threshold: Optional[float] = None,
        kl_window: int = 1,
        kl_metric: Union[str, KLRewardCallback] = "kl/value",
        reset_optimizer: bool = False,
        reset_controller: bool = False,
        buffers: bool = True,
        log_prefix: str = "ref/",
    ) -> None:
        super().__init__()
        self.alpha = check_alpha(alpha)
        self.every_n_steps = _check_every("every_n_steps", every_n_steps)
        self.every_n_epochs = _check_every("every_n_epochs", every_n_epochs)
        if kl_threshold is not None and (
            isinstance(kl_threshold, bool) or not isinstance(kl_threshold, (int, float)) or not math.isfinite(kl_threshold) or kl_threshold <= 0
        ):
            raise ValueError(f"`kl_threshold` must be None or a finite number > 0 (nats per token), got {kl_threshold!r}.")
        self.kl_threshold = None if kl_threshold is None else float(kl_threshold)
        if isinstance(kl_window, bool) or not isinstance(kl_window, int) or kl_window < 1:
            raise ValueError(f"`kl_window` must be a positive integer (optimizer steps in a row), got {kl_window!r}.")
        self.kl_window = kl_window
        if isinstance(kl_metric, KLRewardCallback):
            kl_metric = f"{kl_metric.log_prefix}value"
        if not isinstance(kl_metric, str) or not kl_metric:
            raise ValueError(
                f"`kl_metric` must be a logged metric's name or a KLRewardCallback, got {kl_metric!r}."
            )
        self.kl_metric = kl_metric
        if self.every_n_steps is None and self.every_n_epochs is None and self.kl_threshold is None:
            raise ValueError(
                "ReferenceRefresh needs a trigger: set `every_n_steps` (optimizer steps), `every_n_epochs`, "
                "or `kl_threshold` (with `kl_window` and `kl_metric`)."
            )
        for name, value in (("policy", policy), ("reference", reference)):
            if value is None and name == "reference":
                continue
            if not isinstance(value, str) or not value:
                raise ValueError(f"`{name}` must be the name of a LightningModule attribute, got {value!r}.")
        if reference is not None and reference == policy:
            raise ValueError(
                f"`reference` and `policy` are both {policy!r}; for a LoRA policy whose reference is the model "
                "with its adapters off, set reference=None."
            )
        for name, value in (("reset_optimizer", reset_optimizer), ("reset_controller", reset_controller), ("buffers", buffers)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False, got {value!r}.")
        if not isinstance(log_prefix, str):
            raise ValueError(f"`log_prefix` must be a string, got {log_prefix!r}.")
        self.policy = policy
        self.reference = reference
        self.reset_optimizer = reset_optimizer
        self.reset_controller = reset_controller
        self.buffers = buffers
        self.log_prefix = log_prefix
        # the state that travels in checkpoints
        self.refreshes = 0
        self.last_step = -1
        self.steps_above = 0
        self.initial_coefs: dict[str, float] = {}
        self._seen_step = 0

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(policy=self.policy, reference=self.reference, log_prefix=self.log_prefix)

    # -----------------------------------------------------------------------------------------
    # the models and the refresh itself, callable without a Trainer

    @staticmethod
    def _attribute(module: nn.Module, path: str) -> Any:
        try:
            return functools.reduce(getattr, path.split("."), module)
        except AttributeError:
            raise ValueError(
                f"ReferenceRefresh: {type(module).__name__} has no attribute {path!r}; set `policy` / `reference` "
                "to the attributes that hold the two models (reference=None: the policy with its adapters off)."
            ) from None

    def models(self, pl_module: nn.Module) -> tuple[nn.Module, Optional[nn.Module]]:
        """The policy and the separate reference (None with ``reference=None``), checked for a refresh."""
        policy = self._attribute(pl_module, self.policy)
        if not isinstance(policy, nn.Module):
            raise ValueError(f"ReferenceRefresh: `{self.policy}` is a {type(policy).__name__}, not an nn.Module.")
        if self.reference is None:
            check_foldable(policy)
            return policy, None
        reference = self._attribute(pl_module, self.reference)
        if not isinstance(reference, nn.Module):
            raise ValueError(f"ReferenceRefresh: `{self.reference}` is a {type(reference).__name__}, not an nn.Module.")
        check_mixable(reference, policy, self.buffers)
        return policy, reference

    def refresh(self, pl_module: nn.Module) -> None:
        """Move the reference toward the policy now (no count, no log, no optimizer or controller reset)."""
        policy, reference = self.models(pl_module)
        if reference is None:
            fold_adapters_(policy, self.alpha)
        else:
            mix_modules_(reference, policy, self.alpha, self.buffers)

    def kl_triggers(self, kl: float) -> bool:
        """Count one optimizer step's KL into the window; True when it has been above the threshold long enough.

        A KL that is not above the threshold (NaN included) restarts the window.
        """
        if self.kl_threshold is None:
            return False
        self.steps_above = self.steps_above + 1 if kl > self.kl_threshold else 0
        return self.steps_above >= self.kl_window

    # -----------------------------------------------------------------------------------------
    # Lightning hooks

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        # the coefficients as constructed, before a checkpoint's state replaces them
        self.initial_coefs = {
            cb.state_key: cb.controller.value for cb in trainer.callbacks if isinstance(cb, KLRewardCallback)
        }

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.models(pl_module)  # every check of the models before the first step
        if self.kl_threshold is not None and self.kl_metric == "kl/value":
            logged = sorted(f"{cb.log_prefix}value" for cb in trainer.callbacks if isinstance(cb, KLRewardCallback))
            if self.kl_metric not in logged:
                raise ValueError(
                    "ReferenceRefresh: `kl_threshold` reads `kl_metric` 'kl/value', the KL that a KLRewardCallback "
                    f"logs, but no KLRewardCallback in this Trainer logs it (they log {logged}). Add the callback, "
                    "or set `kl_metric` to one of those or to the name under which the LightningModule logs its KL."
                )

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._seen_step = trainer.global_step  # after a checkpoint's loops were restored

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, previous = trainer.global_step, self._seen_step
        if step == previous:
            return  # no optimizer step in this batch (gradient accumulation)
        self._seen_step = step
        # a multiple of n crossed since the last batch (a manual-optimization batch may take several steps)
        n = self.every_n_steps
        due = n is not None and step // n > previous // n
        if self.kl_threshold is not None:
            due = self.kl_triggers(self._read_kl(trainer, pl_module)) or due
        if due:
            self._do_refresh(trainer, pl_module)
        self._log(pl_module)

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        n = self.every_n_epochs
        if n is not None and (trainer.current_epoch + 1) % n == 0 and self.last_step != trainer.global_step:
            self._do_refresh(trainer, pl_module)

    def _read_kl(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> float:
        metrics = trainer.callback_metrics
        if self.kl_metric not in metrics:
            raise ValueError(
                f"ReferenceRefresh: `kl_metric` {self.kl_metric!r} was not logged by the first optimizer step; the run "
                f"logs {sorted(metrics)}. Log the KL under that name on every step (self.log(..., on_step=True)) "
                "or set `kl_metric` to one of these."
            )
        value = torch.as_tensor(metrics[self.kl_metric], dtype=torch.float64, device=pl_module.device).detach()
        # every process decides alike: the mean over processes (a no-op on one)
        return float(trainer.strategy.reduce(value, reduce_op="mean"))

    def _do_refresh(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.refresh(pl_module)
        self.refreshes += 1
        self.last_step = trainer.global_step
        self.steps_above = 0
        done = ["reference refreshed" + (" (hard reset)" if self.alpha == 1.0 else f" (alpha={self.alpha:g})")]
        if self.reset_optimizer:
            for optimizer in trainer.optimizers:
                optimizer.state.clear()
            done.append("optimizer state cleared")
        if self.reset_controller:
            for cb in trainer.callbacks:
                if isinstance(cb, KLRewardCallback) and cb.state_key in self.initial_coefs:
                    cb.controller.value = self.initial_coefs[cb.state_key]
            done.append("KL coefficients restored")
        rank_zero_info(f"ReferenceRefresh at step {trainer.global_step}: {', '.join(done)} ({self.refreshes} so far).")

    def _log(self, pl_module: "pl.LightningModule") -> None:
        for name, value in (("refreshes", self.refreshes), ("last_step", self.last_step)):
            pl_module.log(f"{self.log_prefix}{name}", float(value), on_step=True, on_epoch=False, batch_size=1)

    # -----------------------------------------------------------------------------------------
    # state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "refreshes": self.refreshes,
            "last_step": self.last_step,
            "steps_above": self.steps_above,
            "initial_coefs": dict(self.initial_coefs),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.refreshes = int(state_dict["refreshes"])
        self.last_step = int(state_dict["last_step"])
        self.steps_above = int(state_dict["steps_above"])
        self.initial_coefs = {k: float(v) for k, v in state_dict["initial_coefs"].items()}
