"""lightning-kl: KL regularization toward a reference model for RL fine-tuning, as Lightning parts."""

from lightning_kl.accumulation import step_totals
from lightning_kl.callback import KLRewardCallback
from lightning_kl.controllers import AdaptiveKLController, FixedKLController, KLController
from lightning_kl.estimators import (
    BASE_ESTIMATORS,
    ESTIMATORS,
    SAMPLED_ESTIMATORS,
    EstimatorName,
    EstimatorSpec,
    SampledEstimatorName,
    parse_estimator,
)
from lightning_kl import hf  # imports neither transformers nor peft
from lightning_kl.ground.sampler import Sampling
from lightning_kl.ground.vocab_shards import VocabShard
from lightning_kl.functional import AGG_MODES, aggregate, kl_penalty
from lightning_kl.ground.checks import AggMode
from lightning_kl.logprobs import FromHidden, full_kl, token_entropy, token_logprobs
from lightning_kl.loss import KLPenaltyLoss
from lightning_kl.metric import KLMetric
from lightning_kl.refresh import ReferenceRefresh
from lightning_kl.rollouts import OnPolicyRollouts
from lightning_kl.logprobs import OUTSIDE_MODES, REFERENCES
from lightning_kl.sequence import LEVELS, Level

__version__ = "0.2.0"

__all__ = [
    "AGG_MODES",
    "BASE_ESTIMATORS",
    "ESTIMATORS",
    "AdaptiveKLController",
    "AggMode",
    "EstimatorName",
    "EstimatorSpec",
    "FixedKLController",
    "FromHidden",
    "KLController",
    "KLMetric",
    "KLPenaltyLoss",
    "KLRewardCallback",
    "LEVELS",
    "Level",
    "OUTSIDE_MODES",
    "OnPolicyRollouts",
    "REFERENCES",
    "ReferenceRefresh",
    "SAMPLED_ESTIMATORS",
    "SampledEstimatorName",
    "VocabShard",
    "Sampling",
    "aggregate",
    "full_kl",
    "hf",
    "kl_penalty",
    "parse_estimator",
    "step_totals",
    "token_entropy",
    "token_logprobs",
]


# Deprecated for one minor version (each warns when called, naming its replacement): out of
# ``__all__``, still reachable as ``lk.name``.
_DEPRECATED = {
    "full_kl_from_hidden": "lightning_kl.logprobs",
    "token_logprobs_from_hidden": "lightning_kl.logprobs",
    "processed_logprobs": "lightning_kl.sampling",
    "processed_logprobs_from_hidden": "lightning_kl.sampling",
    "processed_full_kl": "lightning_kl.sampling",
    "SampledLogprobs": "lightning_kl.sampling",
}


def __getattr__(name: str) -> object:
    if name in _DEPRECATED:
        import importlib

        return getattr(importlib.import_module(_DEPRECATED[name]), name)
    raise AttributeError(f"module 'lightning_kl' has no attribute {name!r}")
