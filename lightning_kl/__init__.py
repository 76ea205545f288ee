"""lightning-kl: KL regularization toward a reference model for RL fine-tuning, as Lightning parts."""

from lightning_kl.ground.vector_math import settle_vector_math

settle_vector_math()  # first of all: oneMKL picks its exp/log kernels at this call, in this thread (see there)

from lightning_kl.accumulation import step_totals
from lightning_kl.callback import KLRewardCallback
from lightning_kl.controllers import AdaptiveKLController, FixedKLController, KLController, KLSchedule, TargetKLController
from lightning_kl.correction import RolloutCorrection
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
from lightning_kl.kernels.full import full_kl, full_kl_from_hidden
from lightning_kl.logprobs import FromHidden, token_logprobs, token_logprobs_from_hidden
from lightning_kl.loss import KLPenaltyLoss
from lightning_kl.metric import KLMetric
from lightning_kl.mismatch import mismatch_metrics
from lightning_kl.mismatch_metric import MismatchMetric
from lightning_kl.refresh import ReferenceRefresh
from lightning_kl.rollouts import OnPolicyRollouts
from lightning_kl.sampling import (
    OUTSIDE_MODES,
    REFERENCES,
    SampledLogprobs,
    processed_full_kl,
    processed_logprobs,
    processed_logprobs_from_hidden,
)
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
    "KLSchedule",
    "MismatchMetric",
    "LEVELS",
    "Level",
    "OUTSIDE_MODES",
    "OnPolicyRollouts",
    "REFERENCES",
    "ReferenceRefresh",
    "RolloutCorrection",
    "SAMPLED_ESTIMATORS",
    "SampledEstimatorName",
    "VocabShard",
    "SampledLogprobs",
    "TargetKLController",
    "Sampling",
    "aggregate",
    "full_kl",
    "full_kl_from_hidden",
    "hf",
    "kl_penalty",
    "mismatch_metrics",
    "parse_estimator",
    "processed_full_kl",
    "processed_logprobs",
    "processed_logprobs_from_hidden",
    "step_totals",
    "token_logprobs",
    "token_logprobs_from_hidden",
]
