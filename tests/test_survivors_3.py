"""Wrong implementations of the rollout correction and the KL controllers that an earlier test suite let
through, each caught here at the edge where right and wrong differ; and the stacks' mappings and value
checks that differed from the code they copy.

Every expectation is derived by hand in a comment (log-ratios :math:`\\ell = \\log\\pi - \\log\\mu`
chosen so that the arithmetic is exact or the margin wide). Each test names the wrong implementation it
catches. None needs the other stacks installed (``tests/test_mismatch_stacks.py`` compares with their
code where they are).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

import lightning_kl as lk

F64 = torch.float64


def _pair(ells: list[list[float]], base: float = -3.0) -> tuple[Tensor, Tensor]:
    """Log-probs ``logprob`` and ``rollout_logprob`` (both <= 0) whose difference is ``ells`` exactly
    enough: ``rollout = base``, ``logprob = base + ell``."""
    ell = torch.tensor(ells, dtype=F64)
    return base + ell, torch.full_like(ell, base)


# =================================================================================================
# 1. weight_metrics: with no `lower`, the low fraction counts raw weights below 1 / upper


def test_ratio_fraction_low_defaults_to_one_over_upper_at_token_and_sequence_level() -> None:
    # catches: `ratio_fraction_low` with no default lower bound (always 0)
    # raw token weights e^l = 0.25, 1, 1, 0.5 with upper 2: low bound 1/2, and only 0.25 < 0.5
    # (0.5 is not below it): 1 of 4 tokens; high fraction: none above 2
    lp = torch.tensor([[math.log(0.25), 0.0, 0.0, -math.log(2.0)]], dtype=F64)
    ro = torch.zeros_like(lp)
    m = lk.RolloutCorrection("token", upper=2.0)(lp, ro).metrics
    assert m["rollout_is_ratio_fraction_low"].item() == 0.25
    assert m["rollout_is_ratio_fraction_high"].item() == 0.0
    # sequence level: sequence weights e^(sum l) = 0.25 and 1: one sequence of two below 1/2
    lp, ro = _pair([[math.log(0.5), math.log(0.5)], [0.3, -0.3]])
    m = lk.RolloutCorrection("sequence", upper=2.0)(lp, ro).metrics
    assert m["rollout_is_ratio_fraction_low"].item() == 0.5


# =================================================================================================
# 2. normalize_weights: a batch with no valid token keeps its zero weights (factor 1, never 0 / 0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_an_all_masked_batch_normalizes_to_zero_weights_with_factor_one(level: str) -> None:
    # catches: a fallback factor of 0 when the batch mean is 0 / 0 (NaN weights)
    # no valid token: the mean is 0 / 0 = NaN, not > 1e-8, so the factor falls back to 1 and the
    # weights, all 0 on padding, stay 0
    lp, ro = _pair([[0.5, -0.2], [0.1, 0.0]])
    out = lk.RolloutCorrection(level, upper=2.0, batch_normalize=True)(lp, ro, torch.zeros(2, 2, dtype=torch.bool))
    assert out.weights is not None
    assert out.weights.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert out.metrics["rollout_is_batch_norm_factor"].item() == 1.0


# =================================================================================================
# 3. parse_rejection: one k1 threshold u means the ratio bounds [1/u, u]


def test_a_single_k1_threshold_bounds_the_ratio_by_its_reciprocal_from_below() -> None:
    # catches: lower = 1 / u^2 for a single k1 threshold u
    # token_k1 keeps log(1/2) <= -l <= log 2: l = 1 gives -1 < -0.693 (rejected; with the wrong
    # lower 1/4, -1 >= log(1/4) = -1.386 would keep it); l = -1 gives 1 > 0.693 (rejected);
    # l = 0.5 gives -0.5 within (kept)
    fix = lk.RolloutCorrection(None, rejection="token_k1", rejection_threshold=2.0)
    assert fix.rejection is not None and (fix.rejection[0].lower, fix.rejection[0].upper) == (0.5, 2.0)
    lp, ro = _pair([[1.0, -1.0, 0.5]])
    assert fix(lp, ro).mask.tolist() == [[False, False, True]]


# =================================================================================================
# 4. rejection_keep: the k1 bounds are compared in logs


def test_k1_upper_bound_is_compared_as_a_log_ratio() -> None:
    # catches: the k1 upper bound compared without its log (a bound of 2 acting as e^2 = 7.4)
    # "0.5_2.0" keeps -log 2 <= -l <= log 2. l = -1: -l = 1 > 0.693, rejected (1 <= 2 would keep it).
    # l = -log 2 exactly (lp = -log 2, ro = 0): -l = log 2, at the bound, kept. l = -2.5: rejected
    # either way
    lp = torch.tensor([[-3.0, -math.log(2.0), -3.0]], dtype=F64)
    ro = torch.tensor([[-2.0, 0.0, -0.5]], dtype=F64)
    out = lk.RolloutCorrection(None, rejection="token_k1", rejection_threshold="0.5_2.0")(lp, ro)
    assert out.mask.tolist() == [[False, True, False]]
    assert out.metrics["rollout_rs_token_k1_max"].item() == 2.5  # the statistic is -l: 1, log 2, 2.5


# =================================================================================================
# 5. _rejection_statistic: verl's divergences are of -l (log mu / pi), not of l


def test_asymmetric_rejection_rejects_the_side_verl_rejects() -> None:
    # catches: the estimator taken of l instead of -l (symmetric data cannot tell them apart)
    # token_k3 (verl: e^l - 1 - l), bound 0.5: l = 1 gives e - 2 = 0.718 (rejected), l = -1 gives
    # e^-1 = 0.368 (kept); the wrong sign swaps the two values, and the two verdicts
    lp, ro = _pair([[1.0, -1.0]])
    out = lk.RolloutCorrection(None, rejection="token_k3", rejection_threshold=0.5)(lp, ro)
    assert out.mask.tolist() == [[False, True]]
    assert_close(out.metrics["rollout_rs_token_k3_max"], torch.tensor(math.e - 2.0, dtype=F64))
    assert_close(out.metrics["rollout_rs_token_k3_min"], torch.tensor(math.exp(-1.0), dtype=F64))
    # token_k1 with bounds "0.5_4.0": log 0.5 <= -l <= log 4. l = 1: -1 < -0.693 (rejected); l = -1.2:
    # 1.2 <= 1.386 (kept). Of l instead: 1 would pass and -1.2 < -0.693 would not
    lp, ro = _pair([[1.0, -1.2]])
    out = lk.RolloutCorrection(None, rejection="token_k1", rejection_threshold="0.5_4.0")(lp, ro)
    assert out.mask.tolist() == [[False, True]]


# =================================================================================================
# 6. seq_mean: a sequence's mean over its valid tokens only


@pytest.mark.parametrize("option,threshold", [("seq_mean_k2", 0.3), ("seq_mean_k1", "0.5_2.0")])
def test_a_short_sequence_does_not_escape_a_sequence_mean_rejection(option: str, threshold: object) -> None:
    # catches: the mean over t counting padding as 0
    # row 0: one valid token of l = 1 among t = 4. k2 = 1/2 > 0.3 (rejected; over t, 0.125 would
    # pass). k1: mean -l = -1 < log(1/2) = -0.693 (rejected; over t, -0.25 would pass).
    # row 1: l = 0.1 at every token: k2 0.005, k1 -0.1, kept
    lp, ro = _pair([[1.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1]])
    mask = torch.tensor([[True, False, False, False], [True, True, True, True]])
    out = lk.RolloutCorrection(None, rejection=option, rejection_threshold=threshold)(lp, ro, mask)
    assert out.mask.tolist() == [[False, False, False, False], [True, True, True, True]]


# =================================================================================================
# 7. offpolicy_keep: an advantage of exactly 0 is kept


def test_the_offpolicy_mask_keeps_a_sequence_whose_advantage_is_exactly_zero() -> None:
    # catches: `adv > 0` in place of `adv >= 0` (GRPO gives advantage 0 to every sequence of a group
    # with equal rewards)
    # every sequence has mean log(mu / pi) = -l = 1 > 0.1; kept where A >= 0: A = 0 and A = 1 kept,
    # A = -0.001 dropped
    lp, ro = _pair([[-1.0, -1.0]] * 3)
    fix = lk.RolloutCorrection(None, offpolicy_mask_threshold=0.1)
    out = fix(lp, ro, advantages=torch.tensor([0.0, -1e-3, 1.0], dtype=F64))
    assert out.mask.tolist() == [[True, True], [False, False], [True, True]]
    assert out.metrics["offpolicy_seq_masked_fraction"].item() == pytest.approx(1 / 3, rel=1e-15)


# =================================================================================================
# 8. from_openrlhf: one threshold value is the upper bound


@pytest.mark.parametrize("mode,ours", [("mask", "mask"), ("clip", "truncate")])
def test_a_one_value_openrlhf_threshold_is_an_upper_bound_only(mode: str, ours: str) -> None:
    # catches: [5.0] read as [5.0, 0] (then lower > upper, refused)
    cfg = {"is_correction_level": "token", "is_correction_mode": mode, "is_correction_threshold": [5.0]}
    fix = lk.RolloutCorrection.from_openrlhf(cfg)
    assert (fix.weights, fix.mode, fix.lower, fix.upper) == ("token", ours, None, 5.0)
    # ratios 0.1 (no lower bound: kept as it is) and e^2 = 7.39 > 5 (masked to 0, or clamped to 5)
    lp, ro = _pair([[math.log(0.1), 2.0]])
    w = fix(lp, ro).weights
    assert w is not None
    assert_close(w, torch.tensor([[0.1, 0.0 if mode == "mask" else 5.0]], dtype=F64), rtol=1e-12, atol=0)


# =================================================================================================
# 9-11. TargetKLController on tensors (the path training takes: the loss and the callback update it
# with device tensors) equals the float path


def _tensor(x: float) -> Tensor:
    return torch.tensor(x, dtype=F64)


def test_a_negative_kl_estimate_moves_the_target_coefficient_as_a_kl_of_zero_on_tensors() -> None:
    # catches: the relative error not clipped at -1 on the tensor path of target_kl_factor
    # KL -3 (a k1 estimate can be negative), target 1: error -4 clipped to -1, log beta -= 0.5:
    # beta = e^-0.5 = 0.6065 (unclipped: e^-2 = 0.135)
    for kl in (-3.0, _tensor(-3.0)):
        ctl = lk.TargetKLController(target_kl=1.0, init_kl_coef=1.0, step_size=0.5)
        ctl.update(kl, n_steps=_tensor(8.0) if isinstance(kl, Tensor) else 8)
        assert ctl.value == pytest.approx(math.exp(-0.5), rel=1e-15)


def test_the_target_coefficient_stops_at_min_kl_coef_on_tensors() -> None:
    # catches: TargetKLController._bounded not applying min_kl_coef to a tensor
    # at the lower bound 0.01, a KL of 0 asks log beta -= 0.5: 0.01 * e^-0.5 = 0.0061, held at 0.01
    ctl = lk.TargetKLController(target_kl=1.0, init_kl_coef=0.01, step_size=0.5, min_kl_coef=0.01, max_kl_coef=1.0)
    ctl.update(_tensor(0.0), _tensor(8.0))
    assert isinstance(ctl.value_tensor(), Tensor) and ctl.value_tensor().item() == 0.01


@pytest.mark.parametrize("start,kl,want", [(1.0, 5.0, 1.0), (0.01, 0.0, 0.01), (0.1, 5.0, 0.1 * math.exp(0.5))])
def test_the_device_update_keeps_the_coefficient_within_its_bounds(start: float, kl: float, want: float) -> None:
    # catches: _update_on_device leaving out the bounds
    # bounds [0.01, 1]: at 1, KL 5 (error 4, clipped to 1) asks beta * e^0.5 = 1.65: held at 1; at
    # 0.01, KL 0 asks 0.0061: held at 0.01; inside, 0.1 * e^0.5 = 0.165 is reached
    ctl = lk.TargetKLController(target_kl=1.0, init_kl_coef=start, step_size=0.5, min_kl_coef=0.01, max_kl_coef=1.0)
    ctl.update(_tensor(kl), _tensor(4.0))
    assert ctl.value_tensor().item() == pytest.approx(want, rel=1e-15)


# =================================================================================================
# 12. KLSchedule.value_tensor: the scale, so that the loss follows warm-up and decay


def test_the_loss_follows_the_schedule_that_value_reports() -> None:
    # catches: KLSchedule.value_tensor without the scale (the loss then ignores warm-up and decay
    # while .value reports them)
    # warm-up over 2 steps of 0.1: 0, 0.05, then 0.1. k1 of d = (0.4, 0.2), token-mean 0.3: the loss
    # is coef * 0.3 = 0, 0.015, 0.03
    sched = lk.KLSchedule(0.1, warmup_steps=2)
    loss = lk.KLPenaltyLoss("k1", coef=sched)
    lp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    ref = lp - torch.tensor([[0.4, 0.2]], dtype=F64)
    for want_coef in (0.0, 0.05, 0.1):
        assert sched.value == pytest.approx(want_coef, rel=1e-15)
        assert sched.value_tensor().item() == pytest.approx(want_coef, rel=1e-15)
        assert loss(lp, ref).item() == pytest.approx(want_coef * 0.3, rel=1e-12, abs=1e-300)
        sched.update(0.3, n_steps=1)


# =================================================================================================
# the stacks' mappings (S4, S5), without the stacks


def test_verl_bypass_ppo_clip_measures_the_weights_and_returns_none() -> None:
    # verl 0.9.1, compute_policy_loss_bypass_mode: ppo_clip passes rollout_is_weights=None to its loss
    # (the ratio pi_theta / mu is the importance weight), reinforce passes the weights
    lp, ro = _pair([[0.5, -0.2, 0.0]])
    clip = lk.RolloutCorrection.from_verl({"rollout_is": "token", "bypass_mode": True, "loss_type": "ppo_clip"})
    out = clip(lp, ro)
    assert out.weights is None and out.old_logprob is ro
    # the weights' statistics are still measured: token mean of min(e^l, 2) = (e^0.5 + e^-0.2 + 1) / 3
    want = (math.exp(0.5) + math.exp(-0.2) + 1.0) / 3
    assert out.metrics["rollout_is_mean"].item() == pytest.approx(want, rel=1e-12)
    assert "return_weights=False" in repr(clip)
    pg = lk.RolloutCorrection.from_verl({"rollout_is": "token", "bypass_mode": True, "loss_type": "reinforce"})
    w = pg(lp, ro).weights
    assert w is not None
    assert_close(w, torch.tensor([[math.exp(0.5), math.exp(-0.2), 1.0]], dtype=F64), rtol=1e-12, atol=0)
    # decoupled mode applies the weights whatever loss_type says
    assert lk.RolloutCorrection.from_verl({"rollout_is": "token", "loss_type": "ppo_clip"})(lp, ro).weights is not None
    with pytest.raises(ValueError, match=r"`return_weights=False` measures the weights .*but `weights` is None"):
        lk.RolloutCorrection(None, return_weights=False)
    with pytest.raises(TypeError, match="`return_weights` must be a bool, got 'no'"):
        lk.RolloutCorrection("token", return_weights="no")  # type: ignore[arg-type]


def test_trl_defaults_without_vllm_give_no_weights() -> None:
    # TRL 1.16's GRPOConfig: use_vllm=False by default, and GRPOTrainer weights only under
    # `self.use_vllm and self.vllm_importance_sampling_correction`
    assert lk.RolloutCorrection.from_trl({}).weights is None
    fix = lk.RolloutCorrection.from_trl({"use_vllm": True})
    assert (fix.weights, fix.mode, fix.upper) == ("sequence", "mask", 3.0)


@pytest.mark.parametrize("which", ["logprob", "rollout_logprob"])
def test_mismatch_inputs_above_zero_are_refused_as_the_loss_refuses_them(which: str) -> None:
    # a +3 shift of one side (logits gathered in place of log-probs, say) gave a mean weight of 1.73
    lp, ro = _pair([[-0.5, -1.0, -2.0]], base=-1.0)
    mask = torch.tensor([[True, True, False]])
    args = {"logprob": lp, "rollout_logprob": ro}
    args[which] = args[which] + 3.0  # 1.5 at the first (valid) position
    with pytest.raises(ValueError) as loss_error:
        lk.KLPenaltyLoss("k1")(args[which], torch.full_like(lp, -1.0), mask)
    rule = str(loss_error.value).replace("`logprob`", f"`{which}`")  # the loss's message, for this argument
    for call in (
        lambda: lk.mismatch_metrics(args["logprob"], args["rollout_logprob"], mask),
        lambda: lk.MismatchMetric().update(args["logprob"], args["rollout_logprob"], mask),
        lambda: lk.RolloutCorrection("token")(args["logprob"], args["rollout_logprob"], mask),
    ):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == rule
    # above 0 at a padded position only: nothing to refuse (the last position is padding)
    args[which] = torch.where(mask, args[which] - 3.0, 5.0)
    assert lk.mismatch_metrics(args["logprob"], args["rollout_logprob"], mask)["kl"].isfinite()


# =================================================================================================
# KLRewardCallback runs the loss's log-prob value check


@pytest.mark.parametrize("key", ["logprobs", "ref_logprobs"])
def test_the_reward_callback_refuses_log_probs_above_zero(key: str) -> None:
    mask = torch.tensor([[True, True, False]])
    batch = {
        "scores": torch.tensor([1.0]),
        "logprobs": torch.tensor([[-0.5, -1.0, 7.0]]),  # 7 on padding: never read
        "ref_logprobs": torch.tensor([[-0.7, -0.9, 7.0]]),
        "mask": mask,
    }
    callback = lk.KLRewardCallback("k1")
    rewards, _, _ = callback.shape_rewards(dict(batch))
    # k1 = (0.2, -0.1) on the valid tokens, beta 0.001, the score 1 at the last valid token
    assert_close(rewards, torch.tensor([[-0.0002, 1.0001, 0.0]]))
    batch[key] = batch[key] + torch.tensor([[0.0, 2.5, 0.0]])  # 1.5 or 1.6 at a valid position
    with pytest.raises(ValueError, match=rf"`{key}` must hold log-probabilities \(<= 0\).* Got 1\.[56]"):
        callback.shape_rewards(batch)
