r"""``EntropyBonus``: the entropy term of an RL loss, as an ``nn.Module``.

``loss = policy_loss + bonus(x, mask)`` with ``bonus(x, mask) = -coef * aggregate(H, mask, agg)``
raises the policy's entropy :math:`H` (the entropy of the distribution the sampler draws from, from
logits, hidden states and an LM head, or vocabulary shards: :func:`~lightning_kl.token_entropy`).
The coefficient is a number or a controller (:class:`~lightning_kl.TargetEntropyController`, a
:class:`~lightning_kl.KLSchedule` of one), closed once per optimizer step by the
:class:`~lightning_kl.KLLossCallback` every Trainer gets, as for
:class:`~lightning_kl.KLPenaltyLoss`.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_kl.coefficient import ControllerState
from lightning_kl.controllers import KLController
from lightning_kl.reduce import AggMode, aggregate_checked, check_agg_mode
from lightning_kl.ground.checks import check_floating, check_mask
from lightning_kl.ground.parallel import check_parallel_args, data_parallel_group
from lightning_kl.ground.sampler import Sampling
from lightning_kl.logprobs import FromHidden, token_entropy
from lightning_kl.metric import KLMetric

__all__ = ["EntropyBonus", "EntropyMetric"]


class EntropyMetric(KLMetric):
    r"""Token-mean entropy over every valid token seen since the last reset, exact across processes.

    :class:`~lightning_kl.KLMetric`'s state and sync (a float64 sum and an int64 count, reduced over
    the data parallel group), for entropies: NaN when no valid token was seen.

    Example:
        >>> metric = EntropyMetric()
        >>> metric(torch.tensor([[0.5, 1.5, 9.0]]), torch.tensor([[True, True, False]]))
        tensor(1., dtype=torch.float64)
    """

    higher_is_better = None  # neither: the entropy is a diagnostic (collapse below, noise above)


class EntropyBonus(ControllerState):
    r"""``-coef * aggregate(token_entropy(x, mask, sampling=sampling), mask, agg)``: add it to the loss.

    Notation: ``b`` batch, ``t`` response length, ``V`` vocabulary.

    .. math::
        \mathcal{L}_{H} = -\mathrm{coef} \cdot \mathrm{agg}_{m}\big(H_t\big),\qquad
        H_t = -\sum_i \tilde p_{t,i} \log \tilde p_{t,i}

    with :math:`\tilde p` the distribution the sampler draws from (``softmax(z / T)``, truncated
    and renormalized by top-k, top-p, min-p). Minimizing the loss raises the entropy. Every forward
    feeds the detached per-token entropies (valid tokens only) to :attr:`metric`, an
    :class:`EntropyMetric`: log it with ``self.log("train/entropy", self.entropy.metric)``.

    **One pass with the log-probs.** A step that needs the sampled tokens' log-probs too reads the
    vocabulary once for both with ``lk.token_logprobs_and_entropy(x, tokens, sampling=...)`` and
    gives the entropy here: ``bonus(entropy=entropy, mask=mask)`` (differentiable; it must come from
    the same ``sampling`` as this module's, which cannot be checked from the entropies). With
    :func:`~lightning_kl.token_entropy` and :func:`~lightning_kl.token_logprobs` apart, the chunked
    engine walks the vocabulary twice (for a head, the logits are made twice).

    Args:
        coef: the coefficient: a number (``>= 0``) or a controller
            (:class:`~lightning_kl.TargetEntropyController`, or any
            :class:`~lightning_kl.KLController`, e.g. a :class:`~lightning_kl.KLSchedule`), moved once per
            optimizer step from the step's token-mean entropy over every valid token of every data
            parallel process (``n_steps``: the step's valid tokens). TRL's ``entropy_coef``, verl's
            ``entropy_coeff``, OpenRLHF's ``entropy_loss_coef``.
        agg: one of :data:`lightning_kl.AggMode` (default ``"token-mean"``: the mean entropy per token,
            TRL's bonus; verl aggregates by its ``loss_agg_mode``).
        sampling: the sampler (an :class:`~lightning_kl.Sampling`; default: the plain softmax).
        process_group: the data parallel ``ProcessGroup`` (for :attr:`metric` and the controller's
            statistics); default: found by itself.
        device_mesh: the same as a ``DeviceMesh``.

    Shapes in ``forward(x, mask=None, *, entropy=None)``: ``x`` is ``[b, t, V]`` logits, an
    :class:`~lightning_kl.FromHidden` (hidden ``[b, t, d]`` and the head), an
    :class:`~lightning_kl.VocabShard` or a vocabulary-sharded DTensor (as
    :func:`~lightning_kl.token_entropy`); ``mask`` ``[b, t]``; or ``entropy`` ``[b, t]`` in place of
    ``x``. Returns a float32 scalar (float64 for float64 inputs). Padding never reaches the loss or
    the gradient.

    **Gradient accumulation.** Each micro-batch's bonus is aggregated over that micro-batch (as TRL
    does), and Lightning averages the micro-batches; the controller sees the step's exact token-mean
    (the sums of every micro-batch, in training mode only).

    **Control.** As for :class:`~lightning_kl.KLPenaltyLoss`: the controller's coefficient is a
    float64 tensor on the device (no host read); :meth:`update_coef` closes the step (one
    ``all_reduce`` of three numbers over the data parallel group); the Trainer's
    :class:`~lightning_kl.KLLossCallback` calls it in ``on_before_optimizer_step`` and
    logs ``entropy/coef`` (the coefficient the step used) and ``entropy/value`` (the step's global
    entropy). The controller's state is in the module's ``state_dict`` (a checkpoint resumes it
    exactly).

    Raises:
        ValueError: at construction for a bad ``coef`` or ``agg`` (named, with what is allowed); in
            forward for shapes that do not match (named), or both or neither of ``x`` and ``entropy``.

    Example:
        >>> bonus = EntropyBonus(coef=0.1)
        >>> logits = torch.zeros(1, 2, 4, requires_grad=True)  # uniform over 4: H = log 4
        >>> bonus(logits, torch.tensor([[True, False]]))  # -0.1 * log 4
        tensor(-0.1386, grad_fn=<MulBackward0>)
        >>> bonus.metric.compute()
        tensor(1.3863, dtype=torch.float64)
    """

    kind = "bonus"

    log_prefix = "entropy/"  # where KLLossCallback logs the coefficient and the step's value

    def __init__(
        self,
        coef: Union[float, KLController] = 0.001,
        agg: AggMode = "token-mean",
        sampling: Optional[Sampling] = None,
        process_group: Any = None,
        device_mesh: Any = None,
    ) -> None:
        super().__init__()
        check_parallel_args(process_group, device_mesh)
        self.process_group, self.device_mesh = process_group, device_mesh
        self.agg = check_agg_mode(agg)
        if sampling is not None and not isinstance(sampling, Sampling):
            raise ValueError(f"`sampling` must be an lk.Sampling or None, got {type(sampling).__name__}.")
        self.sampling = Sampling() if sampling is None else sampling
        self.coef = coef
        self.metric = EntropyMetric(process_group=process_group, device_mesh=device_mesh)

    def forward(
        self,
        x: Optional[Tensor | FromHidden] = None,
        mask: Optional[Tensor] = None,
        *,
        entropy: Optional[Tensor] = None,
    ) -> Tensor:
        """The scalar bonus ``-coef * aggregate(H, mask, agg)``, from ``x`` (what
        :func:`~lightning_kl.token_entropy` takes) or from precomputed per-token ``entropy``."""
        if (x is None) == (entropy is None):
            raise ValueError(
                "EntropyBonus takes `x` (logits, lk.FromHidden, lk.VocabShard) or `entropy=` (per-token "
                f"entropies, e.g. from lk.token_logprobs_and_entropy), exactly one; got x={'a value' if x is not None else None}, "
                f"entropy={'a value' if entropy is not None else None}."
            )
        if entropy is None:
            entropy = token_entropy(x, mask, sampling=self.sampling)
        else:
            check_floating("entropy", entropy)
            if entropy.ndim == 0:
                raise ValueError("`entropy` must hold one value per token ([b, t]), got a 0-d tensor.")
        mask = check_mask(mask, entropy, "entropy")
        self.metric(entropy.detach(), mask, checked=True)
        agg = aggregate_checked(entropy, mask, self.agg)
        return -self._coef_tensor(entropy, mask, agg) * agg

    # ------------------------------------------------------------------------------------------
    # the coefficient (as in KLPenaltyLoss)

    @property
    def coef(self) -> float:
        """The coefficient now, a Python float (the controller's: a host read, raising a recorded fault)."""
        return self._coef if self.controller is None else self.controller.value

    @coef.setter
    def coef(self, coef: Union[float, KLController]) -> None:
        if isinstance(coef, KLController):
            self.controller: Optional[KLController] = coef
            self._coef = math.nan
        elif isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
            raise ValueError(
                f"`coef` must be a finite number >= 0 or a controller (TargetEntropyController, KLSchedule), got {coef!r}."
            )
        else:
            self.controller, self._coef = None, float(coef)
        self._step_stats: Optional[Tensor] = None

    def _coef_tensor(self, entropy: Tensor, mask: Optional[Tensor], agg: Tensor) -> Union[float, Tensor]:
        if self.controller is None:
            return self._coef
        if self.training:  # a validation forward adds nothing to the step
            v = entropy.detach().to(torch.float64)
            m = torch.ones_like(v, dtype=torch.bool) if mask is None else mask
            zero = torch.zeros((), dtype=v.dtype, device=v.device)
            stats = torch.stack([torch.where(m, v, zero).sum(), m.sum().to(torch.float64)])
            self._step_stats = stats if self._step_stats is None else self._step_stats + stats
        return self.controller.value_tensor(agg.device).to(agg.dtype)

    def update_coef(self, strategy: Any = None, device: Any = None) -> Optional[tuple[Tensor, Tensor]]:
        """Close an optimizer step: update the controller from the step's global token-mean entropy.

        Sums the entropy and the valid tokens of every training forward since the last call over the
        data parallel group (every process must call it alike: one ``all_reduce``), gives the
        controller ``(entropy, n_tokens)`` and starts the next step's sums; no host read. Returns
        None for a number ``coef``, else ``(coef, entropy)``: the coefficient the step used and the
        step's global entropy (NaN with no valid token), float64 0-d tensors.
        """
        if self.controller is None:
            return None
        stats, self._step_stats = self._step_stats, None
        if stats is None:
            where = device if device is not None else self.controller.value_tensor().device
            stats = torch.zeros(2, dtype=torch.float64, device=where)
        coef = self.controller.value_tensor(stats.device)
        dp = data_parallel_group(self.process_group, self.device_mesh, strategy=strategy)
        if dp.size > 1:
            stats = dp.all_reduce_sum(stats.clone())
        entropy, n = stats[0] / stats[1], stats[1]
        self.controller.update(entropy, n)
        return coef, torch.where(n >= 1, entropy, float("nan"))

    def reset_step(self) -> None:
        """Drop the sums of an optimizer step left open (a fit stopped inside an accumulation window): done by
        :class:`~lightning_kl.KLLossCallback` when a fit starts and ends, as for ``KLPenaltyLoss``."""
        self._step_stats = None

    def extra_repr(self) -> str:
        coef = self._coef if self.controller is None else self.controller
        extra = "" if self.sampling == Sampling() else f", sampling={self.sampling!r}"
        return f"coef={coef!r}, agg={self.agg!r}{extra}"
