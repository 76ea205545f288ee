r"""``KLRewardCallback``: reward shaping with a KL penalty, before ``training_step`` sees the batch."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_kl.callbacks.faults import ControllerFaultCallback
from lightning_kl.controllers import FixedKLController, KLController
from lightning_kl.estimators import SAMPLED_ESTIMATORS, SampledEstimatorName, parse_estimator
from lightning_kl.compute import kl_penalty_compute
from lightning_kl.ground.checks import check_logprobs, check_mask, compute_dtype
from lightning_kl.inputs import check_pair
from lightning_kl.reduce import masked_row_sums
from lightning_kl.ground.parallel import check_parallel_args, data_parallel_group, sum_or_refuse

__all__ = ["KLRewardCallback"]


class KLRewardCallback(ControllerFaultCallback):
    r"""Shape the rewards of a rollout batch with a KL penalty and steer the coefficient.

    In ``on_train_batch_start`` (after the batch is on the device, before ``training_step``), for a
    batch that is a mapping holding ``[b, t]`` tensors:

    .. math::
        \texttt{rewards} = \texttt{scores} - \beta \cdot k(\texttt{logprobs} - \texttt{ref\_logprobs})

    with :math:`k` the estimator, 0 where ``mask`` is False (no penalty on padding). ``scores`` is
    either per token (``[b, t]``) or per sequence (``[b]``, added at each sequence's last valid
    token, as TRL and verl do). ``rewards`` is written into the batch, in float32 at least.

    Then the controller observes the KL of the *global* batch: the mean, over every sequence on every
    data parallel replica that has a valid token, of that sequence's token-mean KL, with ``n_steps``
    the global number of such sequences. The sum and the count are reduced with one ``all_reduce``
    over the data parallel group (given as ``process_group`` or
    ``device_mesh``, else the strategy's: ``ModelParallelStrategy``'s device mesh dimension
    ``"data_parallel"``, so that the tensor parallel ranks of a replica, which hold the same batch,
    count once; for DDP the world), so every process holds the same :math:`\beta`, and N replicas
    with batch ``b`` behave like one process with batch ``N * b``. The rewards of a batch use the coefficient
    from before that batch's update. A batch refused on one process (a missing key, log-probs above 0)
    is refused on every one (a ``None`` mask too: the reward needs one), with the same ``ValueError`` naming the rank that found it (on an
    accelerator the others stop on a device assertion), where they would wait in the ``all_reduce``.

    Logs ``{log_prefix}coef`` (the :math:`\beta` used for this batch), ``{log_prefix}value`` (the
    global KL; NaN for a global batch with no valid token, which leaves :math:`\beta` unchanged) and
    ``{log_prefix}empty_seqs`` (the global number of sequences with no valid token). The controller's
    state is saved in Lightning checkpoints.

    **A sequence with no valid token** (a truncated response dropped by zeroing its mask, as DAPO
    does) is a normal input: it gets no penalty, its per-sequence score is dropped with it (its
    rewards are all 0), it does not count in the KL, and it is counted in ``{log_prefix}empty_seqs``.

    No host synchronization per step: the coefficient, the reduced statistics and the controller's
    update stay on the device, and the logged values are tensors that Lightning reads when it logs.
    A fault found on the device (a non-finite global KL, which leaves :math:`\beta` unchanged) is
    raised as a ``ValueError`` where the host reads anyway: every ``trainer.log_every_n_steps`` batches, at the
    end of every training epoch, and when a checkpoint saves the callback's state.

    **The KL of whole responses.** With ``k1`` and a policy loss that credits each token with the
    rewards *from it on* (reward-to-go, :math:`G_t = \sum_{s \ge t} r_s`, as PPO with returns or
    GAE does), the penalty's expected gradient is :math:`-\beta\, E[\sum_t \nabla\log\pi_t
    \sum_{s \ge t} d_s] = -\beta\,\nabla \mathrm{KL}(\pi \,\|\, \pi_{\mathrm{ref}})` over whole
    responses: the sequence level of :mod:`lightning_kl.sequence`, with nothing more to do (the whole
    return on every token is exact too). A loss that credits each token with its own reward only
    gets the token level. Checked by enumeration in ``tests/test_sequence.py``.

    Args:
        estimator: one of :data:`lightning_kl.SAMPLED_ESTIMATORS` (``k1`` is the usual choice in the
            reward); ``full`` is rejected: the callback reads sampled-token log-probs, not logits.
        controller: a :class:`~lightning_kl.KLController`; default ``FixedKLController(0.001)``.
        scores_key, logprobs_key, ref_logprobs_key, mask_key: the batch keys read.
            ``logprobs`` are the behaviour policy's (the policy that sampled the batch).
        rewards_key: the batch key written.
        log_prefix: prefix of the logged names; give two callbacks different prefixes.
        process_group: the data parallel ``ProcessGroup``, for layouts the strategy does not describe;
            when given it is used as it is, in place of the strategy's.
        device_mesh: the same as a ``DeviceMesh``: 1-D, or with a ``"data_parallel"`` dimension.

    Raises:
        ValueError: at construction, for an unknown estimator or a bad argument; at a step, for a
            batch that is not a mapping, misses a key (named, with the keys it has), holds tensors
            whose shapes do not fit (named), or log-probs above 0 at valid positions (the loss's check).
    """

    def __init__(
        self,
        estimator: SampledEstimatorName = "k1",
        controller: Optional[KLController] = None,
        scores_key: str = "scores",
        logprobs_key: str = "logprobs",
        ref_logprobs_key: str = "ref_logprobs",
        mask_key: str = "mask",
        rewards_key: str = "rewards",
        log_prefix: str = "kl/",
        process_group: Any = None,
        device_mesh: Any = None,
    ) -> None:
        super().__init__()
        check_parallel_args(process_group, device_mesh)
        self.process_group = process_group
        self.device_mesh = device_mesh
        self.spec = parse_estimator(estimator)
        if self.spec.base == "full":
            valid = ", ".join(repr(n) for n in SAMPLED_ESTIMATORS)
            raise ValueError(
                "KLRewardCallback cannot use the 'full' estimator: it reads the sampled tokens' log-probs "
                f"(`{logprobs_key}`, `{ref_logprobs_key}`), while 'full' needs both models' logits over the "
                "vocabulary. Use 'full' in KLPenaltyLoss, or give the callback a sampled estimator: "
                f"{valid}."
            )
        if controller is None:
            controller = FixedKLController()
        if not isinstance(controller, KLController):
            raise ValueError(f"`controller` must be a KLController, got {type(controller).__name__}.")
        keys = {
            "scores_key": scores_key,
            "logprobs_key": logprobs_key,
            "ref_logprobs_key": ref_logprobs_key,
            "mask_key": mask_key,
            "rewards_key": rewards_key,
        }
        for arg, key in keys.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"`{arg}` must be a non-empty string, got {key!r}.")
        if rewards_key in (scores_key, logprobs_key, ref_logprobs_key, mask_key):
            raise ValueError(f"`rewards_key` {rewards_key!r} would overwrite an input of the callback.")
        if not isinstance(log_prefix, str):
            raise ValueError(f"`log_prefix` must be a string, got {log_prefix!r}.")
        self.controller = controller
        self.scores_key = scores_key
        self.logprobs_key = logprobs_key
        self.ref_logprobs_key = ref_logprobs_key
        self.mask_key = mask_key
        self.rewards_key = rewards_key
        self.log_prefix = log_prefix

    @property
    def estimator(self) -> str:
        return self.spec.name

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(estimator=self.spec.name, rewards_key=self.rewards_key, log_prefix=self.log_prefix)

    # -----------------------------------------------------------------------------------------
    # the per-batch work, callable without a Trainer

    def shape_rewards(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        """Write ``rewards`` into ``batch``; return it with the local KL sum over sequences and their count.

        The KL statistics are float64 0-d tensors: the sum of each valid sequence's token-mean KL and
        the number of sequences with at least one valid token.
        """
        if not isinstance(batch, MutableMapping):
            raise TypeError(
                f"KLRewardCallback needs a rollout batch that is a mutable mapping (a dict), got {type(batch).__name__}."
            )
        for key in (self.scores_key, self.logprobs_key, self.ref_logprobs_key, self.mask_key):
            if key not in batch:
                raise KeyError(
                    f"KLRewardCallback: the batch has no key {key!r}. Keys in the batch: {sorted(map(str, batch))}."
                )
        scores = batch[self.scores_key]
        logprobs = batch[self.logprobs_key]
        ref_logprobs = batch[self.ref_logprobs_key]
        check_pair(logprobs, ref_logprobs)
        if logprobs.ndim < 1:
            raise ValueError(f"`{self.logprobs_key}` must have a token dimension, got shape {tuple(logprobs.shape)}.")
        if batch[self.mask_key] is None:
            raise ValueError(
                f"KLRewardCallback: batch[{self.mask_key!r}] is None: the reward needs the response mask "
                f"`[..., t]`, True on the response's tokens (the last one takes a per-sequence score). When "
                f"every token is valid, pass `torch.ones_like({self.logprobs_key}, dtype=torch.bool)`."
            )
        mask = check_mask(batch[self.mask_key], logprobs, self.logprobs_key)
        if mask is None:  # not None: refused above
            raise ValueError(f"KLRewardCallback: batch[{self.mask_key!r}] is None.")
        check_logprobs({self.logprobs_key: logprobs, self.ref_logprobs_key: ref_logprobs}, mask)
        if not isinstance(scores, Tensor):
            raise TypeError(f"`{self.scores_key}` must be a tensor, got {type(scores).__name__}.")

        with torch.no_grad():
            kl = kl_penalty_compute(logprobs, ref_logprobs, self.spec, mask)
            dtype = compute_dtype(kl, scores) if scores.is_floating_point() else kl.dtype
            # the coefficient stays a device tensor: no host read; cast first, as a Python float would be
            coef = self.controller.value_tensor(kl.device).to(kl.dtype)
            penalty = (coef * kl).to(dtype)
            if scores.shape == kl.shape:
                rewards = scores.to(dtype) - penalty
            elif scores.shape == kl.shape[:-1]:
                rewards = self._add_at_last_token(-penalty, scores.to(dtype), mask)
            else:
                raise ValueError(
                    f"`{self.scores_key}` must be per token, shaped like `{self.logprobs_key}` "
                    f"{tuple(logprobs.shape)}, or per sequence {tuple(logprobs.shape[:-1])}; "
                    f"got {tuple(scores.shape)}."
                )
            batch[self.rewards_key] = rewards

            sums, counts = masked_row_sums(kl, mask)
            valid = counts > 0
            seq_kl = sums / counts.clamp(min=1)
            kl_sum = torch.where(valid, seq_kl, torch.zeros((), dtype=torch.float64, device=kl.device)).sum()
            n_seqs = valid.sum().to(torch.float64)
        return rewards, kl_sum, n_seqs

    def _add_at_last_token(self, rewards: Tensor, scores: Tensor, mask: Tensor) -> Tensor:
        t = mask.shape[-1]
        positions = torch.arange(t, device=mask.device).expand_as(mask)
        last = torch.where(mask, positions, -1).amax(-1)
        # a sequence with no valid token (dropped by zeroing its mask) has no place for its score:
        # dropped with it, never written on padding
        scores = torch.where(last < 0, torch.zeros((), dtype=scores.dtype, device=scores.device), scores)
        return rewards.scatter_add(-1, last.clamp(min=0).unsqueeze(-1), scores.unsqueeze(-1))

    def update_controller(self, kl_sum: float | Tensor, n_seqs: float | Tensor) -> Optional[float | Tensor]:
        """Update the controller with a global batch's statistics; return its KL.

        Python numbers: the KL as a float, or None for an empty batch (no update). 0-d tensors: the
        KL as a float64 tensor on their device (NaN for an empty batch, which changes nothing),
        with no host read.
        """
        if isinstance(kl_sum, Tensor) or isinstance(n_seqs, Tensor):
            kl_sum = torch.as_tensor(kl_sum, dtype=torch.float64)
            n_seqs = torch.as_tensor(n_seqs, dtype=torch.float64, device=kl_sum.device)
            current = kl_sum / n_seqs.clamp(min=1)
            self.controller.update(current, n_steps=n_seqs)
            return torch.where(n_seqs >= 1, current, float("nan"))
        n = int(round(n_seqs))
        if n == 0:
            return None
        current_kl = kl_sum / n
        self.controller.update(current_kl, n_steps=n)
        return current_kl

    def _raise_pending(self) -> None:
        """Raise a fault recorded on the device by the steps since the last check (reads the device)."""
        _ = self.controller.value  # reading it raises the controller's recorded fault (a non-finite KL)

    # -----------------------------------------------------------------------------------------
    # Lightning hooks

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        # everything stays on the device: the coefficient, the reduced statistics, the update and
        # the logged tensors (Lightning reads them when it logs); no host read in this hook
        coef = self.controller.value_tensor(pl_module.device)  # the one this batch's rewards use
        dp = data_parallel_group(self.process_group, self.device_mesh, strategy=trainer.strategy)
        try:
            rewards, kl_sum, n_seqs = self.shape_rewards(batch)
        except (TypeError, ValueError, KeyError) as err:
            if dp.size == 1:
                raise
            # the other processes are on their way to the all-reduce of the statistics: meet them there, so
            # that every process raises (the same ValueError where values are read on the host)
            sum_or_refuse(dp, None, str(err), pl_module.device, 3, "KLRewardCallback")
            raise
        n_rows = torch.full((), batch[self.mask_key].shape[:-1].numel(), dtype=torch.float64, device=kl_sum.device)
        stats = sum_or_refuse(dp, torch.stack([kl_sum, n_seqs, n_rows]), None, kl_sum.device, 3, "KLRewardCallback")
        current_kl = self.update_controller(stats[0], stats[1])
        batch_size = int(rewards.shape[0]) if rewards.ndim > 1 else 1
        pl_module.log(f"{self.log_prefix}coef", coef, on_step=True, on_epoch=False, batch_size=batch_size)
        pl_module.log(f"{self.log_prefix}value", current_kl, on_step=True, on_epoch=False, batch_size=batch_size)
        pl_module.log(f"{self.log_prefix}empty_seqs", stats[2] - stats[1], on_step=True, on_epoch=False, batch_size=batch_size)

    @override
    def state_dict(self) -> dict[str, Any]:
        self._raise_pending()  # a checkpoint reads the coefficient: a recorded fault surfaces here
        return {
            "controller_class": type(self.controller).__qualname__,
            "controller": self.controller.state_dict(),
            "estimator": self.spec.name,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_class = state_dict.get("controller_class")
        if saved_class != type(self.controller).__qualname__:
            rank_zero_warn(
                f"KLRewardCallback: the checkpoint holds a {saved_class} state but this callback has a "
                f"{type(self.controller).__qualname__}; keeping the configured controller as constructed."
            )
            return
        self.controller.load_state_dict(state_dict["controller"])
