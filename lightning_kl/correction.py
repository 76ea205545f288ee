r"""``RolloutCorrection``: importance weights and a kept mask for tokens sampled by another engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_kl.correction_config import (  # the constants: importable here as before
    OPENRLHF_DEFAULTS,
    TRL_DEFAULTS,
    TRL_MODES,
    VERL_ACTOR_DEFAULTS,
    VERL_DEFAULTS,
    VERL_LOSS_MODES,
    check_choice,
    check_number,
    openrlhf_arguments,
    trl_arguments,
    verl_arguments,
)
from lightning_kl.ground.checks import host_reads
from lightning_kl.ground.parallel import DataParallelGroup, check_parallel_args, collective_device, data_parallel_group, sum_or_refuse
from lightning_kl.mismatch import (
    REJECTION_OPTIONS,
    WEIGHT_LEVELS,
    WEIGHT_MODES,
    check_mismatch_inputs,
    dtype_of,
    importance_weights,
    log_ratio,
    mismatch_compute,
    mismatch_totals,
    normalize_weights,
    offpolicy_keep,
    parse_rejection,
    rejection_keep,
    weight_mean_terms,
    weight_metrics,
)
from lightning_kl.trust_region import TRUST_REGIONS, check_trust_threshold, trust_region_keep

__all__ = ["RolloutCorrection", "RolloutCorrectionResult"]

WeightLevel = Union[Literal[WEIGHT_LEVELS], None]  # type: ignore[valid-type]
WeightMode = Union[Literal[WEIGHT_MODES], str]  # type: ignore[valid-type]

@dataclass
class RolloutCorrectionResult:
    """What :class:`RolloutCorrection` returns.

    Attributes:
        weights: ``[..., t]`` the detached importance weights, 0 at padded positions, times the trust
            region's 0/1 gate when one is asked for (``trust_region``; the gate alone when no weight is
            returned); None when the correction returns neither.
        mask: ``[..., t]`` bool, the response mask after rejection: multiply nothing by it, aggregate
            with it.
        metrics: 0-d tensors: the mismatch diagnostics (:func:`lightning_kl.mismatch_metrics`) and the
            weights' and rejection's statistics under verl's names (``docs/mismatch.md``).
        old_logprob: ``[..., t]`` the log-probs of the policy ratio's denominator: the trainer's
            (``logprob``, detached) in the decoupled mode, the engine's (``rollout_logprob``) in the
            bypass mode.
    """

    weights: Optional[Tensor]
    mask: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    old_logprob: Optional[Tensor] = None


def _normalized(weights: Tensor, mask: Tensor, terms: Tensor) -> tuple[Tensor, Tensor]:
    """The weights divided by their global batch mean (verl's rule, :func:`normalize_weights`), and the factor.

    A mean that is NaN (a weight the mask keeps is NaN, on some process: ``terms`` are summed over the
    group, so every process sees it) makes the factor and every valid weight NaN on every process, where
    verl's rule (divide only when the mean exceeds 1e-8) would silently divide by 1 everywhere. A batch with
    no valid token anywhere (a count of 0: no mean, nothing lost) keeps verl's factor 1.
    """
    normalized, factor = normalize_weights(weights, terms)
    lost = terms[0].isnan()  # the weights' sum: NaN only from a kept NaN weight (0 / 0 is no data)
    nan = torch.full((), math.nan, dtype=factor.dtype, device=factor.device)
    factor = torch.where(lost, nan, factor)
    normalized = torch.where(lost & mask, nan.to(weights.dtype), normalized)
    return normalized, factor


class RolloutCorrection(nn.Module):
    r"""Importance weights and a rejection mask for responses sampled by a rollout engine.

    Notation: ``b`` batch, ``t`` response length; :math:`\ell_t = \log\pi(x_t) - \log\mu(x_t)` the
    log-ratio of the trainer's log-prob ``logprob`` to the engine's ``rollout_logprob``.

    Configured by names and numbers (a YAML file can hold it), validated here:

    * **weights** (``weights``, ``mode``, ``lower``, ``upper``, ``batch_normalize``): at the
      ``"token"`` level :math:`w_t = e^{\ell_t}`, at the ``"sequence"`` level
      :math:`w = e^{\sum_t \ell_t}` on every token, at the ``"geometric"`` level
      :math:`w = e^{\frac1n\sum_t \ell_t}` (log-weights clamped to :math:`\pm 20`); then clamped to
      ``[lower, upper]`` (``mode="truncate"``: TIS) or set to 0 outside it (``mode="mask"``:
      IcePop, MIS); a bound of None is no bound. ``batch_normalize`` divides them by their mean over
      the data parallel group's valid tokens (the sequence levels: its sequences), as verl. A weight
      that is not finite (a NaN log-prob) at a token the rejection (or the off-policy mask) drops is set
      to 0 and left out of that mean; one the mask keeps makes the mean NaN, and then every valid weight
      on every process is NaN (verl would divide by 1 everywhere, silently).
    * **rejection** (``rejection``, ``rejection_threshold``): verl's ``rollout_rs`` options and
      threshold syntax (:data:`lightning_kl.mismatch.REJECTION_OPTIONS`): a token, or every token of
      a sequence, leaves the mask when a divergence of the two log-probs exceeds its bound; every
      option must pass.
    * **offpolicy_mask_threshold**: DeepSeek-V3.2's off-policy sequence mask (TRL's
      ``off_policy_mask_threshold``): a sequence with a negative advantage whose mean
      :math:`\log\mu - \log\pi` exceeds it leaves the mask. Needs ``advantages``.
    * **trust_region** (``trust_region``, ``trust_region_threshold``): DPPO's binary trust region
      toward the sampler (:mod:`lightning_kl.trust_region`; ``"binary_tv"``: :math:`\pi - \mu`,
      ``"binary_kl"``: the KL between the two Bernoulli distributions of the token), on the sign of the
      advantage: a token outside it gets a weight of 0 (it stays in the mask, in the denominator, as
      a PPO-clipped token: verl's ``dppo_tv`` / ``dppo_kl`` and prime-rl's default loss). Its 0/1 gate
      multiplies the returned weights, or is the returned weights when there are none. Needs
      ``advantages``.
    * **bypass**: the engine's log-probs serve as the old log-probs (verl's ``bypass_mode``): the
      result's ``old_logprob`` is ``rollout_logprob``, and ``logprob`` is then the current policy's.
    * **return_weights=False**: the weights are measured (their statistics are in ``.metrics``) but
      not returned (``.weights`` is None), for a loss whose ratio already is the importance weight:
      verl's bypass ``ppo_clip``, where :math:`\pi_\theta/\mu` is the PPO ratio, and a weight applied on
      top of it would count it twice.

    Calling it returns a :class:`RolloutCorrectionResult`: ``.weights`` (detached; None when
    ``weights=None`` or ``return_weights=False``), ``.mask (the kept tokens), ``.metrics`` (0-d tensors, no host read),
    ``.old_logprob``. Into the loss (``docs/mismatch.md``)::

        fix = self.correction(old_logprob, batch["rollout_logprobs"], mask)     # in training_step
        w = 1.0 if fix.weights is None else fix.weights   # None: no weights asked for (rejection only)
        ratio = torch.exp(logprob - fix.old_logprob)
        pg = lk.aggregate(-w * ratio * advantages[:, None], fix.mask, "token-mean")

    Args:
        weights: one of :data:`lightning_kl.mismatch.WEIGHT_LEVELS`, or None (no weights).
        mode: one of :data:`lightning_kl.mismatch.WEIGHT_MODES`.
        lower: the lower bound of the weights, or None.
        upper: the upper bound of the weights, or None.
        batch_normalize: divide the weights by their batch mean (as verl's
            ``rollout_is_batch_normalize``).
        rejection: verl's ``rollout_rs``: option names, comma-separated or as a list, or None.
        rejection_threshold: verl's ``rollout_rs_threshold``: one shared threshold, or one per option;
            a ``k1`` option takes ``"lower_upper"`` ratio bounds.
        offpolicy_mask_threshold: the :math:`\delta` of DeepSeek-V3.2's off-policy sequence mask, or None.
        trust_region: one of :data:`lightning_kl.trust_region.TRUST_REGIONS`, or None.
        trust_region_threshold: its :math:`\delta`: one positive number, or ``(low, high)`` (verl's
            ``clip_ratio_low`` / ``clip_ratio_high``, prime-rl's ``dppo_mask_low`` / ``_high``).
        bypass: the engine's log-probs are the old log-probs.
        return_weights: False to measure the weights without returning them (``.weights`` None).
        process_group, device_mesh: the data parallel group of ``batch_normalize`` (default: found by
            itself, as :class:`~lightning_kl.KLMetric` does).

    Raises:
        ValueError, TypeError: for a bad name (the valid ones listed), a bound that is not positive,
            ``lower > upper``, a ``"mask"`` mode with no bound, ``batch_normalize`` without weights, a
            bad rejection option or threshold, a trust region without its threshold (or the reverse).

    Example:
        >>> fix = RolloutCorrection("token", upper=2.0)
        >>> out = fix(torch.tensor([[-1.0, -0.5, 0.0]]), torch.tensor([[-2.0, -0.5, 9.9]]),
        ...           torch.tensor([[True, True, False]]))
        >>> out.weights  # e^1 truncated at 2, e^0, padding
        tensor([[2., 1., 0.]])
        >>> RolloutCorrection("token", mode="mask", lower=0.5, upper=5.0)(
        ...     torch.tensor([[-1.0, -3.0]]), torch.tensor([[-2.0, -1.0]])).weights  # IcePop
        tensor([[2.7183, 0.0000]])
    """

    def __init__(
        self,
        weights: WeightLevel = "token",
        mode: WeightMode = "truncate",
        lower: Optional[float] = None,
        upper: Optional[float] = 2.0,
        batch_normalize: bool = False,
        rejection: Optional[Union[str, list[str]]] = None,
        rejection_threshold: Optional[Union[float, str, list[Union[float, str]]]] = None,
        offpolicy_mask_threshold: Optional[float] = None,
        bypass: bool = False,
        return_weights: bool = True,
        trust_region: Optional[str] = None,
        trust_region_threshold: Optional[Union[float, tuple[float, float]]] = None,
        process_group: Any = None,
        device_mesh: Any = None,
    ) -> None:
        super().__init__()
        self.weights = check_choice("weights", weights, (*WEIGHT_LEVELS, None))
        self.mode = check_choice("mode", mode, WEIGHT_MODES)
        self.lower = check_number("lower", lower)
        self.upper = check_number("upper", upper)
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise ValueError(f"`lower` ({self.lower}) must not exceed `upper` ({self.upper}).")
        if self.weights is not None and self.mode == "mask" and self.lower is None and self.upper is None:
            raise ValueError("mode='mask' zeroes the weights outside [lower, upper]: give `lower`, `upper` or both.")
        if not isinstance(batch_normalize, bool):
            raise TypeError(f"`batch_normalize` must be a bool, got {batch_normalize!r}.")
        if batch_normalize and self.weights is None:
            raise ValueError("`batch_normalize=True` normalizes the weights, but `weights` is None.")
        self.batch_normalize = batch_normalize
        self.rejection = None if rejection is None else parse_rejection(rejection, rejection_threshold)
        if rejection is None and rejection_threshold is not None:
            raise ValueError(
                f"`rejection_threshold` {rejection_threshold!r} given without `rejection`; valid options: "
                f"{', '.join(REJECTION_OPTIONS)}."
            )
        if offpolicy_mask_threshold is not None:
            if isinstance(offpolicy_mask_threshold, bool) or not isinstance(offpolicy_mask_threshold, (int, float)):
                raise TypeError(f"`offpolicy_mask_threshold` must be a number or None, got {offpolicy_mask_threshold!r}.")
            if not math.isfinite(offpolicy_mask_threshold):
                raise ValueError(f"`offpolicy_mask_threshold` must be finite, got {offpolicy_mask_threshold!r}.")
            offpolicy_mask_threshold = float(offpolicy_mask_threshold)
        self.offpolicy_mask_threshold = offpolicy_mask_threshold
        if not isinstance(bypass, bool):
            raise TypeError(f"`bypass` must be a bool, got {bypass!r}.")
        self.bypass = bypass
        if not isinstance(return_weights, bool):
            raise TypeError(f"`return_weights` must be a bool, got {return_weights!r}.")
        if not return_weights and self.weights is None:
            raise ValueError("`return_weights=False` measures the weights without returning them, but `weights` is None.")
        self.return_weights = return_weights
        self.trust_region = check_choice("trust_region", trust_region, (*TRUST_REGIONS, None))
        if trust_region is None and trust_region_threshold is not None:
            raise ValueError(
                f"`trust_region_threshold` {trust_region_threshold!r} given without `trust_region`; valid regions: "
                f"{', '.join(TRUST_REGIONS)}."
            )
        if trust_region is not None and trust_region_threshold is None:
            raise ValueError(
                f"`trust_region={trust_region!r}` needs `trust_region_threshold` (one number, or (low, high); "
                "verl's and prime-rl's default for binary_tv: 0.2)."
            )
        self.trust_threshold = None if trust_region is None else check_trust_threshold(trust_region_threshold)
        check_parallel_args(process_group, device_mesh)
        self.data_parallel = (process_group, device_mesh)

    def extra_repr(self) -> str:
        parts = [f"weights={self.weights!r}"]
        if self.weights is not None:
            parts += [f"mode={self.mode!r}", f"lower={self.lower}", f"upper={self.upper}"]
            if self.batch_normalize:
                parts.append("batch_normalize=True")
            if not self.return_weights:
                parts.append("return_weights=False")
        if self.rejection:
            parts.append(f"rejection={[o.name for o in self.rejection]}")
        if self.offpolicy_mask_threshold is not None:
            parts.append(f"offpolicy_mask_threshold={self.offpolicy_mask_threshold}")
        if self.trust_region is not None:
            assert self.trust_threshold is not None
            low, high = self.trust_threshold
            parts.append(f"trust_region={self.trust_region!r}, trust_region_threshold={low if low == high else (low, high)}")
        if self.bypass:
            parts.append("bypass=True")
        return ", ".join(parts)

    def forward(
        self,
        logprob: Tensor,
        rollout_logprob: Tensor,
        mask: Optional[Tensor] = None,
        advantages: Optional[Tensor] = None,
    ) -> RolloutCorrectionResult:
        """Weights, kept mask and metrics for one batch (see the class docstring).

        Args:
            logprob: ``[..., t]`` the trainer's log-probs of the sampled tokens: the old policy's
                (decoupled), or the current one's (``bypass``; detached here either way).
            rollout_logprob: ``[..., t]`` the engine's log-probs of the same tokens.
            mask: optional ``[..., t]`` mask, True on response tokens.
            advantages: ``[...]``, ``[..., 1]`` or ``[..., t]``; needed by ``offpolicy_mask_threshold``
                and ``trust_region``.

        Raises:
            TypeError, ValueError: for bad inputs. With ``batch_normalize`` on several processes, an
                input refused on one process is refused on every one, with the same ``ValueError``
                (naming the rank that found it), where the others would wait in the all-reduce.
        """
        dp = data_parallel_group(*self.data_parallel) if self.batch_normalize else None
        try:
            mask = self._check(logprob, rollout_logprob, mask, advantages)
        except (TypeError, ValueError) as err:
            if dp is None or dp.size == 1:
                raise
            # the other processes are on their way to the all-reduce of the mean weight: meet them there
            sum_or_refuse(dp, None, str(err), collective_device(logprob, dp), 2, "RolloutCorrection")
            raise  # the device form: the others stop on a device assertion
        m = torch.ones(logprob.shape, dtype=torch.bool, device=logprob.device) if mask is None else mask
        dtype = dtype_of(logprob, rollout_logprob)
        lr = log_ratio(logprob, rollout_logprob, m, dtype)
        metrics: dict[str, Tensor] = {}
        # the kept tokens first: a token the rejection drops never enters the weights' batch mean
        keep = m
        rs_metrics: dict[str, Tensor] = {}
        if self.rejection:
            keep, rs_metrics = rejection_keep(lr, m, self.rejection)
        if self.offpolicy_mask_threshold is not None:
            if advantages is None:  # checked in _check; never reached
                raise ValueError("`offpolicy_mask_threshold` is set: pass `advantages`.")
            kept = offpolicy_keep(lr, m, advantages, self.offpolicy_mask_threshold)
            dropped = (m & ~kept).any(-1)
            rs_metrics["offpolicy_seq_masked_fraction"] = dropped.sum().to(torch.float64) / m.any(-1).sum().to(torch.float64)
            keep = keep & kept
        weights = None
        if self.weights is not None:
            raw, weights = importance_weights(lr, m, self.weights, self.mode, self.lower, self.upper)
            metrics.update(weight_metrics(raw, weights, lr, m, self.weights, self.mode, self.lower, self.upper))
            # a weight that is not finite (a NaN log-prob) at a token the mask drops is junk: 0, and out of the mean
            junk = m & ~keep & ~weights.isfinite()
            weights = torch.where(junk, torch.zeros((), dtype=weights.dtype, device=weights.device), weights)
            if self.batch_normalize:
                if dp is None:  # set above whenever batch_normalize is
                    raise RuntimeError("RolloutCorrection: no data parallel group for batch_normalize")
                terms = weight_mean_terms(weights, m & ~junk, self.weights)
                terms = sum_or_refuse(dp, terms, None, weights.device, 2, "RolloutCorrection")
                weights, metrics["rollout_is_batch_norm_factor"] = _normalized(weights, m, terms)
        metrics.update(rs_metrics)
        gate = None
        if self.trust_region is not None:
            if advantages is None or self.trust_threshold is None:  # checked in _check and at construction; never reached
                raise ValueError("`trust_region` is set: pass `advantages`.")
            gate = trust_region_keep(logprob, rollout_logprob, advantages, m, self.trust_region, *self.trust_threshold, dtype)
            n = m.sum().to(torch.float64)
            metrics["trust_region_masked_fraction"] = (m & ~gate).sum().to(torch.float64) / n
        metrics.update(mismatch_compute(mismatch_totals(logprob, rollout_logprob, mask)))
        old = rollout_logprob if self.bypass else logprob.detach()
        if not self.return_weights:
            weights = None  # measured above, in the metrics, as verl's bypass ppo_clip
        if gate is not None:  # outside the trust region: a weight of 0, in the mask (the denominator) still
            weights = gate.to(dtype) if weights is None else weights * gate.to(weights.dtype)
        return RolloutCorrectionResult(weights=weights, mask=keep, metrics=metrics, old_logprob=old)

    def _check(
        self, logprob: Tensor, rollout_logprob: Tensor, mask: Optional[Tensor], advantages: Optional[Tensor]
    ) -> Optional[Tensor]:
        """The checked mask (bool, or None); raises for bad inputs."""
        mask = check_mismatch_inputs(logprob, rollout_logprob, mask)
        needs = "offpolicy_mask_threshold" if self.offpolicy_mask_threshold is not None else None
        needs = "trust_region" if needs is None and self.trust_region is not None else needs
        if needs is not None:
            shape = logprob.shape
            if not isinstance(advantages, Tensor):
                raise ValueError(f"`{needs}` is set: pass `advantages` (the sequences' or the tokens' advantages).")
            if advantages.shape not in (shape, shape[:-1], (*shape[:-1], 1)):
                raise ValueError(
                    f"`advantages` must be [...], [..., 1] or [..., t] for log-probs {tuple(shape)}, got "
                    f"{tuple(advantages.shape)}."
                )
        return mask

    # ------------------------------------------------------------------------------------------
    # each stack's own configuration, verbatim

    @classmethod
    def from_verl(cls, cfg: Any, actor: Any = None, **kwargs: Any) -> "RolloutCorrection":
        r"""From verl's ``algorithm.rollout_correction`` block (verl 0.9.1), a mapping or an object.

        ``rollout_is`` (None, ``"token"``, ``"sequence"``) with ``rollout_is_threshold`` (a number:
        TIS at that upper bound; ``"lower_upper"``: IcePop), ``rollout_is_batch_normalize``,
        ``rollout_rs`` and ``rollout_rs_threshold`` (rejection), ``bypass_mode``; ``loss_type``
        names verl's policy loss in bypass mode (``docs/mismatch.md`` has the recipe of each). With
        ``bypass_mode`` and ``loss_type="ppo_clip"`` verl measures the weights but does not apply them
        (its PPO ratio, the current policy's over the engine's, already is the importance weight): the
        result's ``weights`` is then None and their statistics are in ``metrics``
        (``return_weights=False``).
        Missing keys take verl's defaults. ``kwargs`` go to the constructor (``process_group``...).

        ``actor`` (optional) is verl's ``actor_rollout_ref.actor`` (a mapping or an object): its
        ``policy_loss.loss_mode``, ``clip_ratio``, ``clip_ratio_low`` / ``_high`` and ``clip_ratio_c``
        (missing ones: verl's ``ActorConfig`` defaults, 0.2 and 3.0). The DPPO loss modes map onto this
        class: verl's ``dppo_tv`` / ``dppo_kl`` loss is
        :math:`-A \cdot \min(e^{\ell}, c)\,\mathrm{sg} \cdot \log\pi \cdot \mathrm{gate}` with
        :math:`\ell` the log-ratio of the current policy to verl's old log-probs, which is this class in
        the bypass form (``weights="token"`` truncated at ``clip_ratio_c``, ``trust_region`` at
        ``(clip_ratio_low, clip_ratio_high)``, ``bypass=True``), called with the current log-probs and
        the old ones as ``rollout_logprob`` (the sampler's, for a trust region toward the sampler):
        ``-A * fix.weights * logprob``, aggregated with ``fix.mask``, is verl's loss. Refused (with
        the way out) where one correction cannot say what verl does: a DPPO mode with verl's
        ``bypass_mode`` (verl then replaces the loss mode by ``"bypass_mode"``: no DPPO gate), or with
        ``rollout_is`` / ``rollout_rs`` (verl multiplies two ratios, the old policy's to the sampler's
        and the current one's to the old: build one correction for each). Any other verl loss mode
        leaves the correction as the block says (the policy loss is the caller's; ``kl_cov`` and
        ``clip_cov`` select their tokens with :func:`lightning_kl.cov_select.covariance_mask`).

        Raises:
            ValueError: for an unknown key or value, with the valid ones.

        Example:
            >>> RolloutCorrection.from_verl({"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"})
            RolloutCorrection(weights='token', mode='mask', lower=0.5, upper=5.0)
        """
        return cls(**verl_arguments(cfg, actor), **kwargs)

    @classmethod
    def from_trl(cls, cfg: Any, **kwargs: Any) -> "RolloutCorrection":
        """From TRL's ``GRPOConfig`` (TRL 1.16) or a mapping of its fields; other fields are ignored.

        TRL corrects the mismatch only when vLLM generates (``use_vllm=True``; its default, False,
        samples with the trained model itself, and ``GRPOTrainer`` then computes no importance
        weight): there ``vllm_importance_sampling_mode`` (``{token,sequence}_{truncate,mask}``) with
        ``vllm_importance_sampling_clip_min`` / ``_clip_max`` (``_cap``, deprecated, is ``_clip_max``),
        and ``vllm_importance_sampling_correction=False`` for no weights. Without vLLM, or without the
        correction, ``weights`` is None. ``off_policy_mask_threshold`` applies either way, as in TRL.

        Example:
            >>> RolloutCorrection.from_trl({"use_vllm": True, "vllm_importance_sampling_mode": "token_truncate"})
            RolloutCorrection(weights='token', mode='truncate', lower=None, upper=3.0)
            >>> RolloutCorrection.from_trl({})  # GRPOConfig's defaults: no vLLM, no importance weights
            RolloutCorrection(weights=None)
        """
        return cls(**trl_arguments(cfg), **kwargs)

    @classmethod
    def from_openrlhf(cls, cfg: Any, **kwargs: Any) -> "RolloutCorrection":
        """From OpenRLHF's ``algo.advantage`` settings (OpenRLHF 0.11.2): a mapping, an object, or the
        parsed arguments (their ``algo.advantage``).

        ``is_correction_level`` (``off``, ``token``, ``seq``), ``is_correction_mode`` (``mask``,
        ``clip``), ``is_correction_threshold`` (``[low, high]``, or ``[high]`` for low 0), with
        ``is_correction_gating="ratio"``: ``token`` + ``clip`` is TIS (weights clamped to
        ``[low, high]``), ``token`` + ``mask`` IcePop, ``seq`` + ``mask`` (seq-mask-tis) keeps each
        token's untruncated weight and drops the sequences whose geometric mean ratio is outside
        ``[low, high]`` (verl's ``seq_mean_k1`` rejection at ``1/high_1/low``). The ``binary_kl`` and
        ``tv`` gatings are not implemented here (an error says so).

        Example:
            >>> RolloutCorrection.from_openrlhf({"is_correction_level": "token", "is_correction_mode": "clip"})
            RolloutCorrection(weights='token', mode='truncate', lower=0.5, upper=5.0)
        """
        return cls(**openrlhf_arguments(cfg), **kwargs)
