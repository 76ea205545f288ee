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

from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_kl.coefficient import Coefficient, ControllerState
from lightning_kl.controllers import KLController
from lightning_kl.reduce import AggMode, check_agg_mode, reduce_kl, refused_alike
from lightning_kl.ground.checks import check_floating, check_mask, compute_dtype
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
        process_group: the data parallel ``ProcessGroup`` (for ``global_batch``, :attr:`metric` and the
            controller's statistics); default: found by itself.
        device_mesh: the same as a ``DeviceMesh``.
        global_batch: normalize as one process over the global batch of every data parallel replica,
            as :class:`~lightning_kl.KLPenaltyLoss`'s ``global_batch`` does (the same reduce step): forward
            sums the counts of valid tokens and of non-empty sequences over the data parallel group (one
            ``all_reduce`` of two numbers), divides by those and multiplies by the group's size ``W``, so
            that the gradient averaging of DDP or FSDP yields exactly the global batch's gradient in every
            ``agg`` mode, a process holding no valid token included. Every process must then call forward
            the same number of times; an input refused on one process is refused on every one. Outside
            distributed training it changes nothing. Without it (the default, as the loss's), each
            process aggregates its own tokens: under DDP ``token-mean`` is then exact only when every
            process holds the same number of valid tokens. Set it as the loss's: the terms of one
            objective should be normalized alike.

    Shapes in ``forward(x, mask=None, *, entropy=None)``: ``x`` is ``[b, t, V]`` logits, an
    :class:`~lightning_kl.FromHidden` (hidden ``[b, t, d]`` and the head), an
    :class:`~lightning_kl.VocabShard` or a vocabulary-sharded DTensor (as
    :func:`~lightning_kl.token_entropy`); ``mask`` ``[b, t]``; or ``entropy`` ``[b, t]`` in place of
    ``x``. Returns a float32 scalar (float64 for float64 inputs). Padding never reaches the loss or
    the gradient.

    **Gradient accumulation.** Each micro-batch's bonus is aggregated over that micro-batch (as TRL
    does; over the micro-batch of every process with ``global_batch``), and Lightning averages the
    micro-batches; the controller sees the step's exact token-mean (the sums of every micro-batch, in
    training mode only).

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
        global_batch: bool = False,
    ) -> None:
        super().__init__()
        check_parallel_args(process_group, device_mesh)
        self.process_group, self.device_mesh = process_group, device_mesh
        self.agg = check_agg_mode(agg)
        if not isinstance(global_batch, bool):
            raise ValueError(f"`global_batch` must be True or False, got {global_batch!r}.")
        self.global_batch = global_batch
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
        dp = data_parallel_group(self.process_group, self.device_mesh) if self.global_batch else None
        with refused_alike(dp, self.agg, entropy if entropy is not None else x, "EntropyBonus", self.metric):
            entropy, mask = self._entropy(x, mask, entropy)
        # KLPenaltyLoss's reduce step: the aggregate (the global batch's under global_batch), the metric's sums
        values = entropy.to(compute_dtype(entropy))
        reduced = reduce_kl(values, mask, self.agg, dp=dp, who="EntropyBonus")
        self.metric(values.detach(), mask, sums=reduced.metric_sums)
        stats = None
        if self.controller is not None and self.training:  # a validation forward adds nothing to the step
            total, count = reduced.metric_sums  # the controller: the token-mean entropy, n_steps the valid tokens
            stats = torch.stack([total, count.to(torch.float64), count.to(torch.float64)])
        return self._coefficient.apply(-reduced.loss, stats, self._attached())

    def _entropy(self, x: Any, mask: Optional[Tensor], entropy: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        # the per-token entropies (from x, or checked) and the checked mask
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
        return entropy, check_mask(mask, entropy, "entropy")

    def _make_coefficient(self, coef: Union[float, KLController]) -> Coefficient:
        return Coefficient(
            coef, "EntropyBonus", "the policy's token-mean entropy per optimizer step",
            "a controller (TargetEntropyController, KLSchedule)",
        )

    def extra_repr(self) -> str:
        coef = self._coefficient.number if self.controller is None else self.controller
        extra = "" if self.sampling == Sampling() else f", sampling={self.sampling!r}"
        if self.global_batch:
            extra += ", global_batch=True"
        return f"coef={coef!r}, agg={self.agg!r}{extra}"
