"""lightning-kl: KL regularization toward a reference model for RL fine-tuning, as Lightning parts."""

from __future__ import annotations

import importlib
from typing import Any, Optional

from lightning_kl.ground.vector_math import settle_vector_math

settle_vector_math()  # first of all: oneMKL picks its exp/log kernels at this call, in this thread (see there)

from lightning_kl.accumulation import step_totals
from lightning_kl.callbacks.kl_reward import KLRewardCallback
from lightning_kl.controllers import AdaptiveKLController, FixedKLController, KLController, KLSchedule, TargetKLController
from lightning_kl.correction import RolloutCorrection
from lightning_kl.entropy import EntropyBonus
from lightning_kl.entropy_controller import TargetEntropyController
from lightning_kl.estimators import EstimatorName
from lightning_kl import hf  # imports neither transformers nor peft
from lightning_kl.ground.sampler import Sampling
from lightning_kl.ground.vocab_shards import VocabShard
from lightning_kl.functional import AggMode, aggregate, kl_penalty
from lightning_kl.ground.checks import warn_user
from lightning_kl.high_entropy import high_entropy_mask
from lightning_kl.divergences import full_kl
from lightning_kl.logprobs import FromHidden, token_entropy, token_logprobs, token_logprobs_and_entropy
from lightning_kl.distill.topk import TopK
from lightning_kl.loss import KLPenaltyLoss
from lightning_kl.metric import KLMetric
from lightning_kl.mismatch import mismatch_metrics
from lightning_kl.mismatch_metric import MismatchMetric
from lightning_kl.refresh import ReferenceRefresh
from lightning_kl.rollouts import OnPolicyRollouts
from lightning_kl.sequence import Level
from lightning_kl.callbacks.kl_loss import KLLossCallback

__version__ = "0.2.0"

__all__ = [
    "AdaptiveKLController",
    "AggMode",
    "EntropyBonus",
    "EstimatorName",
    "FixedKLController",
    "FromHidden",
    "KLController",
    "KLLossCallback",
    "KLMetric",
    "KLPenaltyLoss",
    "KLRewardCallback",
    "KLSchedule",
    "MismatchMetric",
    "Level",
    "OnPolicyRollouts",
    "ReferenceRefresh",
    "RolloutCorrection",
    "VocabShard",
    "TargetEntropyController",
    "TargetKLController",
    "TopK",
    "Sampling",
    "aggregate",
    "full_kl",
    "high_entropy_mask",
    "hf",
    "kl_penalty",
    "mismatch_metrics",
    "step_totals",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
]

#: Names that left ``__all__``, reachable as ``lk.NAME`` for one more minor version with a
#: ``DeprecationWarning``: ``NAME: (module, attribute, what to use instead)``. One line per name.
_DEPRECATED: dict[str, tuple[str, str, Optional[str]]] = {
    "ESTIMATORS": ("lightning_kl.estimators", "ESTIMATORS", "typing.get_args(typing.get_args(lk.EstimatorName)[0])"),
    "BASE_ESTIMATORS": ("lightning_kl.estimators", "BASE_ESTIMATORS", "lk.EstimatorName (the names without '+')"),
    "SAMPLED_ESTIMATORS": ("lightning_kl.estimators", "SAMPLED_ESTIMATORS", "lk.EstimatorName (every name but 'full')"),
    "SampledEstimatorName": ("lightning_kl.estimators", "SampledEstimatorName", "lk.EstimatorName"),
    "EstimatorSpec": ("lightning_kl.estimators", "EstimatorSpec", "the estimator's name (lk.EstimatorName)"),
    "parse_estimator": ("lightning_kl.estimators", "parse_estimator", "the estimator's name: every entry point checks it"),
    "AGG_MODES": ("lightning_kl.functional", "AGG_MODES", "typing.get_args(typing.get_args(lk.AggMode)[0])"),
    "LEVELS": ("lightning_kl.sequence", "LEVELS", "typing.get_args(typing.get_args(lk.Level)[0])"),
    "OUTSIDE_MODES": ("lightning_kl.logprobs", "OUTSIDE_MODES", "the strings 'raise' and '-inf' (lightning_kl.logprobs.OUTSIDE_MODES)"),
    "REFERENCES": ("lightning_kl.logprobs", "REFERENCES", "the strings 'unprocessed', 'processed', 'policy_kept' (lightning_kl.logprobs.REFERENCES)"),
    # functions and a type that warn themselves when called (naming the new call): no second warning here
    "token_logprobs_from_hidden": ("lightning_kl.deprecated", "token_logprobs_from_hidden", None),
    "full_kl_from_hidden": ("lightning_kl.deprecated", "full_kl_from_hidden", None),
    "processed_logprobs": ("lightning_kl.deprecated", "processed_logprobs", None),
    "processed_logprobs_from_hidden": ("lightning_kl.deprecated", "processed_logprobs_from_hidden", None),
    "processed_full_kl": ("lightning_kl.deprecated", "processed_full_kl", None),
    "SampledLogprobs": ("lightning_kl.deprecated", "SampledLogprobs", "lk.token_logprobs(..., sampling=, return_log_kept=True)"),
}


def __getattr__(name: str) -> Any:
    # PEP 562: a name of _DEPRECATED, with its warning; anything else is missing
    if name in _DEPRECATED:
        module, attribute, instead = _DEPRECATED[name]
        if instead is not None:
            warn_user(f"`lightning_kl.{name}` is deprecated and leaves in the next minor version: use {instead}.", DeprecationWarning)
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'lightning_kl' has no attribute {name!r}")
