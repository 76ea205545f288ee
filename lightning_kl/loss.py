r"""``KLPenaltyLoss``: the KL term of an RL loss, as an ``nn.Module``."""

from __future__ import annotations

from contextlib import nullcontext

import math
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_kl.coefficient import ControllerState, live_controlled
from lightning_kl.compute import check_max_weight, kl_penalty_values
from lightning_kl.controllers import KLController
from lightning_kl.distill.inputs import check_topk_inputs
from lightning_kl.distill.topk import TopK
from lightning_kl.estimators import EstimatorName, parse_estimator
from lightning_kl.ground.checks import warn_user
from lightning_kl.ground.parallel import check_parallel_args, data_parallel_group, held_warnings
from lightning_kl.ground.sampler import Sampling
from lightning_kl.inputs import check_kl_inputs, resolve_sampling
from lightning_kl.kept_inputs import check_loss_kept
from lightning_kl.kernels.divergence import Divergence, check_divergence, kl_weights
from lightning_kl.logprobs import FromHidden
from lightning_kl.metric import KLMetric
from lightning_kl.reduce import COUNT_OF_MODE, AggMode, check_agg_mode, controlled_kl_statistics, reduce_kl, refused_alike
from lightning_kl.sequence import Level, check_kl_to_go, check_level, check_sequence_agg

__all__ = ["KLPenaltyLoss", "controlled_kl_statistics", "live_losses"]


def live_losses() -> list["KLPenaltyLoss"]:
    """The :class:`KLPenaltyLoss` objects alive in this process."""
    return [m for m in live_controlled() if isinstance(m, KLPenaltyLoss)]


class KLPenaltyLoss(ControllerState):
    r"""``coef * aggregate(kl_penalty(logprob, ref_logprob, estimator), mask, agg)``.

    A thin shell over the functions users call. Forward goes down the layers once, one call a step, each
    into a module that does not call back up: validate (:func:`lightning_kl.inputs.check_kl_inputs`, the
    inputs checked once) -> compute (:mod:`lightning_kl.compute`: the estimators, the sequence level or the
    vocabulary engine, as :func:`~lightning_kl.kl_penalty`) -> reduce (:func:`lightning_kl.reduce.reduce_kl`:
    the aggregate as :func:`~lightning_kl.aggregate`, the global batch, and the sums of the metric and of the
    controller) -> metric (:attr:`metric`) -> coefficient (:mod:`lightning_kl.coefficient`).

    Notation: ``b`` batch, ``t`` response length.

    .. math::
        \mathcal{L}_{\mathrm{KL}} = \mathrm{coef} \cdot \mathrm{agg}_{m}\big(k(\log\pi - \log\pi_{\mathrm{ref}})\big)

    Every forward call also feeds the detached per-token values (over valid tokens) to
    :attr:`metric`, a :class:`~lightning_kl.KLMetric`, so that a LightningModule can log it with
    ``self.log("train/kl", self.kl.metric)``.

    Args:
        estimator: one of the names of :data:`lightning_kl.EstimatorName`; ``+`` names carry the k2
            gradient, the unbiased gradient of the KL for on-policy samples. Validated here.
        coef: the loss coefficient: a number (``>= 0``), or a :class:`~lightning_kl.KLController` that
            moves it once per optimizer step from the KL of that step (see "KL control" below).
        agg: one of the modes of :data:`lightning_kl.AggMode`; ``None`` (the default) is ``"token-mean"``,
            with a warning at ``level="sequence"``, where that mode is exact only for a fixed token count
            (an explicit ``"token-mean"`` there warns once, at the first batch whose lengths differ).
        agg_norm: the constant divisor of ``seq-mean-token-sum-norm`` (default: the padded length).
        global_batch: normalize as one process over the global batch of every data parallel
            replica. When ``torch.distributed`` is initialized, forward sums the (detached) counts
            of valid tokens and of non-empty sequences over the data parallel group (one
            ``all_reduce`` of two numbers), divides by those and multiplies by the group's size
            ``W``, so that the gradient *averaging* of DDP or FSDP yields exactly the global batch's
            gradient in every ``agg`` mode; each replica's loss is then ``W`` times its share, and
            their mean over replicas is the global batch's loss. Every process must then call
            forward the same number of times. An input refused on one process is refused on every
            one (the same ``ValueError``, naming the rank that found it), where the others would
            wait in the ``all_reduce``. The group is ``process_group`` or ``device_mesh``
            when given, else found by itself: under Lightning's ``ModelParallelStrategy`` its
            device mesh's ``"data_parallel"`` dimension (the tensor parallel ranks of a replica,
            which hold the same batch, count once), under DDP the world (see
            :func:`lightning_kl.ground.parallel.data_parallel_group`). Outside distributed training
            it changes nothing. Without it (the default), under DDP: ``token-mean`` is exact only when every process holds the same
            number of valid tokens, ``seq-mean-token-sum`` and ``seq-mean-token-mean`` only when
            every process holds the same number of non-empty sequences, and ``token-sum`` and
            ``seq-mean-token-sum-norm`` give ``1 / W`` of the global gradient.
        max_weight: ``None``, or the cap ``c >= 1`` of the importance weights when forward gets
            ``old_logprob`` (truncated importance sampling, ``w -> min(w, c)``): less variance
            for a bias that :func:`~lightning_kl.functional.importance_weight` states exactly.
        temperature: deprecated: ``sampling=lk.Sampling(temperature=T)`` (a ``DeprecationWarning``).
        sampling: ``estimator="full"`` only: the sampler, an :class:`~lightning_kl.Sampling`
            (temperature, top-k, top-p, min-p; default: the plain softmax). The KL is that of the
            distribution the sampler draws from, ``softmax(logits / T)`` truncated and renormalized, to
            the reference's ``softmax(ref_logits / T)`` (unprocessed, at the same temperature), exact at
            both levels. Any other sampler than the default with a sampled estimator is an error: their
            log-probs carry the sampler already, and **both models' log-probs must then come from the
            same** ``Sampling`` (``lk.token_logprobs(..., sampling=sampling)``): a reference scored at
            ``T = 1`` against a policy at ``T = 0.7`` cannot be seen in log-probs, and biases the KL.
            Rollouts reused under truncation: forward's ``kept=`` replays the kept sets the sampler used.
        level: ``"token"`` (default) or ``"sequence"``: the KL of whole responses along the last
            dimension. Same values on-policy (per-decision weights ``rho_{1:t}`` off-policy), plus
            the KL-to-go gradient term ``grad log pi_t * sum_{s > t} d_s`` for every valid token,
            weighted like token ``t`` by ``agg``: the expected gradient is then that of the
            responses' KL for ``k2`` and every ``+`` name (``k1``, ``k3`` too with
            ``old_logprob``). ``agg="seq-mean-token-mean"`` (a length-normalized objective) is
            rejected here; ``token-mean`` is exact when the number of valid tokens per batch is
            fixed. ``full`` then needs ``sampled_logprob`` in forward: the policy's log-prob of the sampled
            token under the *processed* distribution of ``sampling`` (the score of what the sampler
            drew). See :mod:`lightning_kl.sequence`.
        divergence, beta: ``estimator="full"`` at ``level="token"`` only: which divergence between the
            policy and the other model (the reference, a teacher) each token gets, one of
            :data:`~lightning_kl.kernels.divergence.DIVERGENCES`: ``"reverse"`` (default)
            :math:`\mathrm{KL}(\tilde\pi \,\|\, \pi_{\mathrm{ref}})`, ``"forward"``
            :math:`\mathrm{KL}(\pi_{\mathrm{ref}} \,\|\, \tilde\pi)`, ``"jsd"`` (TRL's generalized JSD) and
            ``"mixed"`` with ``beta`` in [0, 1] (default 0.5; 0 the forward KL, 1 the reverse KL), as
            :func:`~lightning_kl.full_kl` computes them (there: the formulas). The metric and a controller
            then see that divergence. Any other value, a ``beta`` for the two KLs, a direction other
            than ``"reverse"`` with a sampled estimator or at ``level="sequence"``, or one that holds the
            forward KL (``"forward"``, ``"mixed"`` with ``beta < 1``, ``"jsd"`` at ``beta = 0``) with a
            truncating ``sampling`` (``+inf`` at every token: the reference is unprocessed) is refused here.
        kl_to_go: sampled estimators at ``level="sequence"``: ``"k1"`` (default, the sum of the later
            log-ratios) or ``"k3"`` (the sum of their ``k3`` values: the same expectation, less noise).
        process_group: the data parallel ``ProcessGroup`` (for ``global_batch`` and :attr:`metric`), for
            loops and layouts that Lightning does not describe; default: found by itself.
        device_mesh: the same as a ``DeviceMesh``: 1-D, or with a ``"data_parallel"`` dimension.

    With ``estimator="full"``, ``forward(logits, ref_logits, mask)`` takes both models' logits
    ``[b, t, V]`` and a ``[b, t]`` mask, and aggregates the exact per-token KL over the vocabulary
    (:mod:`lightning_kl.kernels.full`, chunked: no ``[b, t, V]`` temporaries) exactly as above; the metric
    gets those values. ``old_logprob`` is an error there: the exact KL needs no importance weights.
    In place of the logits it also takes one :class:`~lightning_kl.FromHidden` per model (the last
    hidden states and the LM head): the logits are then made chunk by chunk and never held whole
    (:func:`~lightning_kl.full_kl`),
    ``self.kl(lk.FromHidden(hidden, lm_head.weight), lk.FromHidden(ref_hidden, ref_head.weight), mask)``,
    with any ``sampling``; on a vocabulary split over processes, a truncating ``sampling`` (top-k, top-p,
    min-p: a selection across the shards) is refused by name. ``[b, t]`` inputs
    without a mask are refused there: log-probs where logits belong.

    The other side may also be a served teacher's top-k log-probs, :class:`~lightning_kl.TopK` ``[b, t, k]``
    (on-policy distillation), beside the student's logits, vocabulary shard or ``FromHidden``:
    ``self.kl(logits, lk.TopK(ids, logprobs), mask)`` is ``coef * aggregate(lk.full_kl(logits, topk, mask,
    sampling=sampling, divergence=divergence, beta=beta), mask, agg)``, the divergence coarsened onto the
    teacher's ids and one tail cell per model (:mod:`lightning_kl.distill.topk`: never negative, at most the
    full divergence), in every ``agg`` and with ``global_batch``; the payload is checked as there, a bad one
    refused on every process alike. At ``level="token"`` only; a ``TopK`` with a sampled estimator is refused
    (they take the teacher's log-probs of the sampled tokens). The loss returns no tails: log them from
    ``lk.full_kl(..., return_tails=True)``.

    Log-probs are checked to be ``<= 0`` at valid positions (beyond rounding): logits gathered at the
    tokens are refused, on the CPU by a ``ValueError`` naming the value, on an accelerator by a
    device-side assertion (no host read). ``old_logprob`` is the sampler's, a constant: one that
    requires grad is detached, with a warning.

    **Gradient accumulation and the Trainer.** Lightning divides each micro-batch's loss by the
    Trainer's ``accumulate_grad_batches`` (``k``); with the step's totals (``num_tokens``, ``num_seqs``)
    the loss multiplies by ``k`` back. It learns ``k`` from the Trainer that fits its LightningModule,
    handed over by :class:`~lightning_kl.KLLossCallback` at ``setup`` (every Trainer
    gets one), never from the call stack: any ``training_step`` (argument names, wrappers,
    ``torch.compile``) works. ``k`` is read only while that Trainer trains; while it validates, tests
    or predicts nothing accumulates and ``k`` is 1. A ``deepcopy`` or a pickle of the loss is attached
    to no Trainer. Where the loss cannot know ``k`` (attached to no Trainer, and forward given the
    step's totals but no ``accumulate_grad_batches``) it assumes 1 and says so, once.

    Shapes in ``forward``: ``logprob``, ``ref_logprob`` and ``mask`` are ``[b, t]`` (any shape,
    the same for all three). Half precision inputs are computed and reduced in float32; the loss is
    float32 and the gradients come back in the inputs' dtype.

    Junk at masked positions (NaN, inf, ``-1e10`` padding) never reaches the loss or the
    gradients. A NaN at a *valid* position is never dropped: the loss is NaN, and so is the
    gradient at every other valid position, whatever the estimator (even ``k1``, whose gradient
    ignores the value, and ``k3``, whose clamp gives the NaN's own position a zero gradient), so
    that ``Trainer(detect_anomaly=True)`` stops at it.

    **KL control.** With ``coef`` a controller (:class:`~lightning_kl.TargetKLController`,
    :class:`~lightning_kl.AdaptiveKLController`, :class:`~lightning_kl.FixedKLController`, a
    :class:`~lightning_kl.KLSchedule`; in YAML by ``class_path``), every forward multiplies by the
    controller's coefficient, a float64 0-d tensor on the loss's device (no host read), and adds the
    detached KL of its micro-batch to the step's sums (in training mode only: a validation forward,
    in ``eval()`` mode, adds nothing). :meth:`update_coef` closes the optimizer step:
    it sums those over the data parallel group (one ``all_reduce`` of three numbers, the group found
    as for ``global_batch``), so that every process gets the same global KL, and updates the
    controller with it. In a Lightning ``Trainer`` the :class:`~lightning_kl.KLLossCallback`
    every Trainer gets does it in ``on_before_optimizer_step`` (after the backward of the step's last
    micro-batch: once per optimizer step under ``accumulate_grad_batches``, every micro-batch of a step
    weighed by the same coefficient) and logs ``kl/coef`` and ``kl/value``; elsewhere call it after
    ``backward``, before or after ``optimizer.step()``. The KL the controller sees is in the units of
    ``agg``: the token-mean over the step's valid tokens (``token-mean``), the mean over sequences of
    their token-means (``seq-mean-token-mean``), both per token; the mean over non-empty sequences of
    their sums (``seq-mean-token-sum``, ``seq-mean-token-sum-norm``, ``token-sum``), per response.
    ``n_steps`` is the step's number of sequences with a valid token. The controller's state is in
    the module's ``state_dict`` (``kl._extra_state``), so a Lightning checkpoint restores it exactly.

    Raises:
        ValueError: at construction, for an unknown estimator, mode, level or divergence, a bad ``coef``,
            ``max_weight`` or ``beta``, or a mode or divergence that does not fit ``level="sequence"``; in forward,
            for shapes that do not match (both are named), a bad ``TopK`` payload (the position named) or a ``TopK``
            at ``level="sequence"``.
        TypeError: in forward, for a ``TopK`` with a sampled estimator or in the student's place.

    Example:
        >>> import torch
        >>> loss_fn = KLPenaltyLoss("k3+", coef=0.5)
        >>> logprob = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
        >>> ref = torch.tensor([[-1.5, -1.0, float("nan")]])
        >>> mask = torch.tensor([[True, True, False]])
        >>> loss = loss_fn(logprob, ref, mask)  # 0.5 * (0.1065 + 0.7183) / 2
        >>> loss
        tensor(0.2062, grad_fn=<MulBackward0>)
        >>> loss.backward(); logprob.grad  # 0.5 * d / 2 on valid tokens, exactly 0 on padding
        tensor([[ 0.1250, -0.2500,  0.0000]])
    """

    kind = "loss"

    def __init__(
        self,
        estimator: EstimatorName = "k3+",
        coef: Union[float, KLController] = 0.001,
        agg: Optional[AggMode] = None,
        agg_norm: Optional[float] = None,
        global_batch: bool = False,
        max_weight: Optional[float] = None,
        temperature: Optional[float] = None,
        level: Level = "token",
        kl_to_go: str = "k1",
        process_group: Any = None,
        device_mesh: Any = None,
        sampling: Optional[Sampling] = None,
        divergence: Divergence = "reverse",
        beta: Optional[float] = None,
    ) -> None:
        super().__init__()
        check_parallel_args(process_group, device_mesh)
        self.process_group = process_group
        self.device_mesh = device_mesh
        self.spec = parse_estimator(estimator)
        self.agg = check_agg_mode("token-mean" if agg is None else agg)
        self.coef = coef  # a number or a controller, checked by the setter
        if agg_norm is not None and not (isinstance(agg_norm, (int, float)) and agg_norm > 0):
            raise ValueError(f"`agg_norm` must be a positive number or None, got {agg_norm!r}.")
        self.agg_norm = agg_norm
        if not isinstance(global_batch, bool):
            raise ValueError(f"`global_batch` must be True or False, got {global_batch!r}.")
        self.global_batch = global_batch
        self.max_weight = check_max_weight(max_weight)
        self.sampling = resolve_sampling(sampling, temperature, self.spec.name, "KLPenaltyLoss")
        self.level = check_level(level)
        if self.level == "sequence":
            check_sequence_agg(self.agg)
            if agg is None:
                warn_user(
                    "KLPenaltyLoss(level='sequence') without `agg` uses agg='token-mean', which is exact at the "
                    "sequence level only when every batch holds the same number of valid tokens. Pass "
                    "agg='seq-mean-token-sum' (the mean KL per response), 'token-sum' or 'seq-mean-token-sum-norm' "
                    "for responses of any length, or agg='token-mean' explicitly for a fixed token count.",
                    rank_zero=True,
                )
        self.kl_to_go = check_kl_to_go(kl_to_go, self.level, self.spec.base == "full")
        self.divergence, self.beta = check_divergence(divergence, beta)
        if self.divergence != "reverse" and self.spec.base != "full":
            raise ValueError(
                f"divergence={self.divergence!r} needs estimator='full' (both models' logits or lk.FromHidden): the sampled "
                f"estimators ({self.spec.name!r}) estimate the reverse KL from the policy's own samples. Valid with "
                f"{self.spec.name!r}: divergence='reverse'."
            )
        weights = kl_weights(self.divergence, self.beta)
        if weights is not None and weights[0] > 0 and self.sampling.truncates:
            raise ValueError(
                f"divergence={self.divergence!r} with beta={self.beta!r} holds the forward KL KL(ref || policy), +inf at "
                f"every token under the truncating {self.sampling!r}: the reference (unprocessed) has mass outside the "
                "policy's kept set. Valid with a truncating sampler: divergence='reverse', or 'jsd' with 0 < beta < 1 "
                "(finite); or lk.full_kl(..., reference='policy_kept') for the forward KL on the kept set."
            )
        if self.divergence != "reverse" and self.level == "sequence":
            raise ValueError(
                f"divergence={self.divergence!r} takes level='token' only: the sequence level's KL-to-go term is the score "
                "function gradient of the responses' reverse KL, under the policy's own samples. Valid at level='sequence': "
                "divergence='reverse'."
            )
        self.metric = KLMetric(process_group=process_group, device_mesh=device_mesh)
        self._warned_micro_counts = False
        self._warned_unknown_k = False
        self._warned_lengths = agg is None  # the default agg at level="sequence" warned above already

    @property
    def estimator(self) -> str:
        """The estimator name as configured."""
        return self.spec.name

    @property
    def temperature(self) -> float:
        """The sampler's temperature (``self.sampling.temperature``)."""
        return self.sampling.temperature

    def forward(
        self,
        logprob: Tensor | FromHidden,
        ref_logprob: Tensor | FromHidden,
        mask: Optional[Tensor] = None,
        old_logprob: Optional[Tensor] = None,
        *,
        num_tokens: Optional[Tensor | float] = None,
        num_seqs: Optional[Tensor | float] = None,
        accumulate_grad_batches: Optional[int] = None,
        sampled_logprob: Optional[Tensor] = None,
        kept: Any = None,
    ) -> Tensor:
        """The scalar KL loss; ``old_logprob`` (the sampling policy's) importance weights it.

        For ``full``, ``logprob`` and ``ref_logprob`` are the logits ``[..., V]``, or one
        :class:`~lightning_kl.FromHidden` each (hidden states and LM head), or ``ref_logprob`` a teacher's
        :class:`~lightning_kl.TopK` ``[..., k]`` beside either; ``mask`` is ``[...]``;
        at ``level="sequence"`` it also needs ``sampled_logprob`` ``[...]``, the policy's
        (differentiable) log-probs of the sampled tokens (see :mod:`lightning_kl.sequence`).

        ``kept`` (``full`` only): replay, the kept sets the rollout's sampler drew from, recorded with
        ``return_kept=True`` (:class:`~lightning_kl.ground.kept.KeptSets` of the ``[...]`` positions, or an
        engine's ``(ids, offsets)``), a per-batch tensor like the mask: the policy is ``softmax(logits / T)``
        renormalized on each position's recorded set instead of its own kept set now (PPO epochs > 1, stale
        rollouts), against the unprocessed reference, as ``lk.full_kl(..., kept=kept)``. On-policy the same
        value and gradient as without it. Refused with a sampled estimator (replay their log-probs with
        ``lk.token_logprobs(..., kept=)``), with a divergence that holds the forward KL, for a record of
        other positions, vocabulary, device or temperature, and for an empty set at a valid position.

        Gradient accumulation (``Trainer(accumulate_grad_batches=k)``): give the optimizer step's
        totals over its ``k`` micro-batches, ``num_tokens`` (valid tokens) and ``num_seqs``
        (sequences with a valid token), e.g. from :func:`~lightning_kl.step_totals`. The loss then divides by
        the step's totals instead of the micro-batch's and is multiplied by ``k``, which Lightning
        divides back out, so that the accumulated gradient is that of one batch holding the ``k``
        micro-batches, in every ``agg`` mode. With ``global_batch=True`` the totals are this
        process's and are summed over processes (as the micro-batch counts are otherwise). With
        ``k > 1`` and no total for a mode that divides by one, a warning is given once, and that mode's
        loss is not multiplied by ``k``: the accumulated gradient is then the average of the
        micro-batches' own (each divided by its own count), as without this library.

        ``accumulate_grad_batches`` defaults to the Trainer's while a Trainer trains the
        ``LightningModule`` holding this loss (see :meth:`attach`), so that forgetting the totals is
        warned about; 1 while it validates or predicts. Attached to no Trainer it is 1, said once when
        the step's totals are given (they suggest accumulation); pass it to override.
        """
        # down the layers once: validate -> compute -> reduce (with the metric's and the controller's sums)
        # -> metric -> coefficient; each step one call into a module that does not call back up
        if accumulate_grad_batches is None:
            accumulate_grad_batches = self._trainer_accumulation()
        dp = data_parallel_group(self.process_group, self.device_mesh) if self.global_batch else None
        collective = dp is not None and dp.size > 1 and COUNT_OF_MODE.get(self.agg) is not None
        # a warning before the global batch's all-reduce is held and issued after it, alike on every process
        # (raised as an error on one process only, it would leave the others waiting there)
        with held_warnings(True) if collective else nullcontext() as held:  # (one process: no ground floor on the way)
            # an input refused here meets the other processes in the counts' or the metric's all-reduce
            # ground/parallel.distributed()'s predicate, inline: the forward goes down the layers once (test_loss_path)
            spread = torch.distributed.is_available() and torch.distributed.is_initialized()
            with refused_alike(dp, self.agg, logprob, "KLPenaltyLoss", self.metric) if spread else nullcontext():
                # a record replaces the sampler's truncation (allowed on a split vocabulary then)
                topk = isinstance(logprob, TopK) or isinstance(ref_logprob, TopK)  # a teacher's lk.TopK: its own checks
                check = check_topk_inputs if topk else check_kl_inputs
                inputs = check(
                    logprob, ref_logprob, self.spec, mask, old_logprob, sampled_logprob, self.level,
                    self.sampling if kept is None else Sampling(self.sampling.temperature), num_tokens, num_seqs, accumulate_grad_batches,
                )
                if kept is not None:  # replay: checked beside the other inputs, alike on every process
                    forward_kl = (kl_weights(self.divergence, self.beta) or (0.0,))[0] > 0
                    kept = check_loss_kept(kept, inputs, self.spec, forward_kl, self.sampling.temperature)
                # in the block too: a teacher's lk.TopK payload is checked with the student, at the compute step
                kl = kl_penalty_values(
                    inputs, self.spec, self.max_weight, self.level, self.kl_to_go, self.sampling, (self.divergence, self.beta), kept
                )
            k = self._accumulation(inputs)
            given = (inputs.num_tokens, inputs.num_seqs)
            self._warn_if_micro_batch_counts(k, given)
            self._warn_if_lengths_vary(inputs.mask, inputs.num_tokens)
        controlled = self._coefficient.controller is not None and self.training  # an eval() forward is no part of a step
        reduced = reduce_kl(kl, inputs.mask, self.agg, self.agg_norm, *given, k, dp, self.agg if controlled else None, held=held)
        self.metric(kl.detach(), inputs.mask, sums=reduced.metric_sums)
        return self._coefficient.apply(reduced.loss, reduced.controller_stats, self._attached())

    def _trainer_accumulation(self) -> Optional[int]:
        # the Trainer's accumulate_grad_batches while it trains the LightningModule holding this loss;
        # 1 while it validates, tests or predicts (nothing accumulates); None when attached to none
        trainer = None if self._trainer_ref is None else self._trainer_ref()
        if trainer is None:
            return None
        if not getattr(trainer, "training", False):
            return 1
        return getattr(trainer, "accumulate_grad_batches", 1)

    def _accumulation(self, inputs: Any) -> int:
        # k: the argument's or the Trainer's (checked with the inputs), else 1, said once when the totals suggest k
        if inputs.accumulate_grad_batches is not None:
            return inputs.accumulate_grad_batches
        if (inputs.num_tokens is not None or inputs.num_seqs is not None) and not self._warned_unknown_k:
            self._warned_unknown_k = True
            warn_user(
                "KLPenaltyLoss got the step's totals (`num_tokens`/`num_seqs`) but knows no `accumulate_grad_batches`: "
                "it is attached to no Trainer (KLLossCallback attaches it at `setup` of `Trainer.fit`), so it "
                "assumes 1. Under gradient accumulation pass `accumulate_grad_batches=k` to forward (or "
                "`loss.attach(trainer)`), else the accumulated gradient is k times too small.",
                rank_zero=True,
            )
        return 1

    def _warn_if_lengths_vary(self, mask: Optional[Tensor], num_tokens: Any) -> None:
        # an explicit agg="token-mean" at level="sequence" is exact only for a fixed token count per batch;
        # reads the mask's values: on the CPU until it warns, on an accelerator at the first call only
        if self._warned_lengths or self.level != "sequence" or self.agg != "token-mean":
            return
        if mask is None or mask.ndim < 2 or isinstance(num_tokens, (int, float)):
            return
        if mask.device.type != "cpu":
            self._warned_lengths = True  # one host read, this once
        lengths = mask.reshape(-1, mask.shape[-1]).sum(-1)
        if bool((lengths != lengths[0]).any()):
            self._warned_lengths = True
            warn_user(
                "KLPenaltyLoss(level='sequence', agg='token-mean') got responses of different lengths: 'token-mean' "
                "divides by the batch's token count, which then varies with the samples, and the gradient is not the "
                "responses' KL's (a length-normalized objective instead). Use agg='seq-mean-token-sum' (the mean KL "
                "per response), 'token-sum' or 'seq-mean-token-sum-norm', or pass a fixed `num_tokens`.",
                rank_zero=True,
            )

    def _warn_if_micro_batch_counts(self, k: int, given: tuple[Any, Any]) -> None:
        needed = COUNT_OF_MODE.get(self.agg)
        if k == 1 or needed is None or given[needed] is not None or self._warned_micro_counts:
            return
        self._warned_micro_counts = True
        name = ("num_tokens", "num_seqs")[needed]
        warn_user(
            f"KLPenaltyLoss(agg={self.agg!r}) is accumulating gradients over {k} micro-batches but got no "
            f"`{name}`: each micro-batch divides by its own count, so the accumulated gradient (the average of "
            f"the micro-batches' values) weighs the micro-batches equally instead of every "
            f"{'token' if needed == 0 else 'sequence'} of the optimizer step. Pass the step's totals: `{name}=lk.step_totals(masks)[{name!r}]` (see the docs, "
            "'Running at scale', gradient accumulation).",
            rank_zero=True,
        )

    def extra_repr(self) -> str:
        extra = ", global_batch=True" if self.global_batch else ""
        if self.max_weight is not None:
            extra += f", max_weight={self.max_weight}"
        if self.sampling != Sampling():
            extra += f", sampling={self.sampling!r}"
        if self.level != "token":
            extra += f", level={self.level!r}"
        if self.kl_to_go != "k1":
            extra += f", kl_to_go={self.kl_to_go!r}"
        if self.divergence != "reverse":
            extra += f", divergence={self.divergence!r}, beta={self.beta!r}"
        coef = self._coefficient.number if self.controller is None else self.controller
        return f"estimator={self.spec.name!r}, coef={coef!r}, agg={self.agg!r}{extra}"
