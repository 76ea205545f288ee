"""Behaviours that a mutation run (one planted bug at a time) found untested, one test each.

Each test names the wrong implementation it catches; the expectations are float64 maths written from
the formula, or exact values by enumeration.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from _vocab import kl_from_hidden
from lightning_kl.accumulation import check_accumulate_grad_batches
from lightning_kl.functional import aggregate_counts
from lightning_kl.kernels.engine import Source, Tensors

# gradients toward the reference are checked here on purpose: its warning is expected
pytestmark = pytest.mark.filterwarnings("ignore:`ref_[a-z]*` requires grad")

F64 = torch.float64


def test_off_policy_k3plus_gradients_are_the_detached_weight_times_d() -> None:
    # k3+ with old_logprob: value w * k3(d) with w = pi / pi_old detached, gradient w * d toward
    # logprob and -w * d toward ref_logprob. Catches k3+ taking k3's cancellation-free product-rule
    # path, whose ref gradient is the product rule's (-0.481, 2.833 here instead of -0.611, 1.649).
    lp = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], dtype=F64, requires_grad=True)
    old = torch.tensor([-1.2, -2.5], dtype=F64)
    value = lk.kl_penalty(lp, ref, "k3+", old_logprob=old)
    g_lp, g_ref = torch.autograd.grad(value.sum(), [lp, ref])
    d = [0.5, -1.0]
    w = [math.exp(0.2), math.exp(0.5)]
    want_value = torch.tensor([wi * (math.exp(-di) + di - 1) for wi, di in zip(w, d)], dtype=F64)
    assert_close(value.detach(), want_value, rtol=1e-14, atol=0)
    assert_close(g_lp, torch.tensor([wi * di for wi, di in zip(w, d)], dtype=F64), rtol=1e-14, atol=0)
    assert_close(g_ref, torch.tensor([-wi * di for wi, di in zip(w, d)], dtype=F64), rtol=1e-14, atol=0)
    # a reference with no mass on the token: every + name is NaN there (k3's path gives 20.998)
    no_mass = lk.kl_penalty(lp.detach(), torch.tensor([-math.inf, -1.0], dtype=F64), "k3+", old_logprob=old)
    assert math.isnan(no_mass[0].item()) and no_mass[1].item() == pytest.approx(want_value[1].item(), rel=1e-14)


def test_counts_of_an_empty_token_dimension_are_zero() -> None:
    # catches rows of zero tokens counted as sequences (phantom sequences in the DDP num_seqs)
    for mask in (None, torch.zeros(4, 0, dtype=torch.bool)):
        counts = aggregate_counts(torch.zeros(4, 0), mask)
        assert counts.tolist() == [0, 0] and counts.dtype == torch.int64


def test_sequence_level_refuses_a_scalar_and_sampled_estimators_refuse_sampled_logprob() -> None:
    # catches the scalar check removed (0.3679 returned silently) and sampled_logprob ignored
    with pytest.raises(ValueError, match=r"level='sequence' needs a token dimension"):
        lk.kl_penalty(torch.tensor(-1.0), torch.tensor(0.0), "k3", level="sequence")
    lp = torch.tensor([[-1.0, -2.0]])
    with pytest.raises(ValueError, match=r"`sampled_logprob` is for estimator='full' at level='sequence' only"):
        lk.kl_penalty(lp, lp - 1, "k3+", sampled_logprob=lp)
    with pytest.raises(ValueError, match=r"`sampled_logprob` is for estimator='full' at level='sequence' only"):
        lk.kl_penalty(lp, lp - 1, "k3+", level="sequence", sampled_logprob=lp)


def test_num_tokens_alone_is_the_token_mean_divisor() -> None:
    # catches `any` -> `all` over the given totals: num_tokens without num_seqs was then ignored
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, -4.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -2.0], [-0.5, -2.0, -1.0]], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss = lk.KLPenaltyLoss("k1", coef=0.5, agg="token-mean")(lp, ref, mask, num_tokens=20, accumulate_grad_batches=1)
    # k1 = d on the valid tokens: 0.5 - 1 + 0 + 1 - 3 = -2.5; 0.5 * -2.5 / 20
    assert loss.item() == pytest.approx(0.5 * -2.5 / 20, rel=1e-14)
    loss = lk.KLPenaltyLoss("k1", coef=0.5, agg="seq-mean-token-sum")(lp, ref, mask, num_seqs=5, accumulate_grad_batches=1)
    assert loss.item() == pytest.approx(0.5 * -2.5 / 5, rel=1e-14)


def test_the_loss_refuses_an_old_logprob_that_would_broadcast() -> None:
    # catches the old_logprob check removed from forward: (3,) against (2, 3) broadcast silently
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"`old_logprob` and `logprob` must have the same shape: got old_logprob \(3,\) and logprob \(2, 3\)"):
        lk.KLPenaltyLoss("k3")(lp, lp - 1, old_logprob=torch.zeros(3))


def test_zero_micro_batches_is_refused_by_name() -> None:
    # catches `k < 1` -> `k < 0`: 0 then failed later, with a message about `world_size`
    for k in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"^`accumulate_grad_batches` must be a positive integer"):
            check_accumulate_grad_batches(k)
    with pytest.raises(ValueError, match=r"^`accumulate_grad_batches` must be a positive integer.*got 0\.$"):
        lk.KLPenaltyLoss("k3")(-torch.ones(2, 3), torch.zeros(2, 3), accumulate_grad_batches=0)


def test_metric_sums_each_batch_in_float64() -> None:
    # 2**24 + 1 + 1 + 1 is exact in float64 and 2**24 in float32: catches a per-batch float32 sum
    metric = lk.KLMetric()
    metric.update(torch.tensor([16777216.0, 1.0, 1.0, 1.0]))
    assert metric.total.item() == 16777219.0
    assert metric.compute().item() == 16777219 / 4  # and computed in the state's float64


def test_controller_state_is_python_floats_and_raises_a_recorded_fault() -> None:
    ctl = lk.AdaptiveKLController(0.2, target_kl=6.0, horizon=1000)
    ctl.update(torch.tensor(3.0, dtype=F64), torch.tensor(10.0, dtype=F64))
    state = ctl.state_dict()
    # catches the device tensor returned as is (a GPU tensor in every checkpoint)
    assert type(state["value"]) is float and state["value"] == pytest.approx(0.2 * (1 - 0.2 * 10 / 1000), rel=1e-15)
    ctl.update(torch.tensor(math.nan, dtype=F64), torch.tensor(10.0, dtype=F64))
    with pytest.raises(ValueError, match="non-finite KL"):
        ctl.state_dict()  # catches a checkpoint that reads the coefficient without raising the fault


def test_a_non_positive_adaptive_factor_is_refused_on_floats_and_on_the_device() -> None:
    # e = clip(0 / 6 - 1) = -0.2; factor 1 - 0.2 * 100 / 10 = -1: the coefficient would become -0.2
    ctl = lk.AdaptiveKLController(0.2, target_kl=6.0, horizon=10)
    with pytest.raises(ValueError, match=r"non-positive \(factor -1\)"):
        ctl.update(0.0, n_steps=100)
    assert ctl.value == 0.2
    ctl.update(torch.tensor(0.0, dtype=F64), torch.tensor(100.0, dtype=F64))
    assert ctl.value_tensor().item() == 0.2  # skipped on the device...
    with pytest.raises(ValueError, match=r"non-positive \(factor -1\).*It was not changed"):
        ctl.value  # ...and raised where the host reads it (catches the fault code removed)
    assert ctl.value == 0.2


def test_a_fixed_coefficient_of_zero_switches_the_penalty_off() -> None:
    # catches `value < 0` -> `value <= 0`: FixedKLController(0.0) refused
    callback = lk.KLRewardCallback("k1", lk.FixedKLController(0.0))
    scores = torch.tensor([[1.0, 2.0, 3.0]], dtype=F64)
    batch = {"scores": scores, "logprobs": torch.zeros(1, 3), "ref_logprobs": torch.full((1, 3), -5.0),
             "mask": torch.ones(1, 3, dtype=torch.bool)}
    rewards, _, _ = callback.shape_rewards(batch)
    assert torch.equal(rewards, scores)
    with pytest.raises(ValueError, match=r"`kl_coef` must be >= 0, got -0.1"):
        lk.FixedKLController(-0.1)


def test_the_global_kl_of_a_batch_with_no_valid_token_is_nan() -> None:
    # catches `kl/value` logged as 0.0 (a KL of zero) for a global batch with nothing in it
    callback = lk.KLRewardCallback("k1", lk.AdaptiveKLController(0.2, target_kl=1.0, horizon=10))
    current = callback.update_controller(torch.tensor(0.0, dtype=F64), torch.tensor(0.0, dtype=F64))
    assert math.isnan(current.item()) and callback.controller.value == 0.2
    assert callback.update_controller(0.0, 0.0) is None


def test_rewards_are_promoted_to_float64_scores() -> None:
    # catches rewards computed in the KL's float32: 1 + 2**-40 is lost there
    scores = torch.tensor([1.0 + 2.0**-40, 2.0], dtype=F64)
    batch = {"scores": scores, "logprobs": torch.zeros(2, 2), "ref_logprobs": torch.full((2, 2), -0.5),
             "mask": torch.ones(2, 2, dtype=torch.bool)}
    rewards, _, _ = lk.KLRewardCallback("k1", lk.FixedKLController(0.5)).shape_rewards(batch)
    assert rewards.dtype == F64
    # -0.5 * 0.5 at every token, the score added at the last one
    want = torch.tensor([[-0.25, 1.0 + 2.0**-40 - 0.25], [-0.25, 1.75]], dtype=F64)
    assert torch.equal(rewards, want)


def test_rows_of_a_sliced_tensor_are_gathered_by_chunk_never_copied_whole() -> None:
    # catches `view` -> `reshape`: logits[:, :-1] was copied whole, the memory the kernels exist to save
    x = torch.randn(4, 5, 7)
    assert Source(Tensors(x[:, :-1])).flat is None
    rows, fresh = Source(Tensors(x[:, :-1])).read(torch.tensor([0, 5]))
    assert fresh and torch.equal(rows, torch.stack([x[0, 0], x[1, 1]]))
    whole = Source(Tensors(x))
    assert whole.flat is not None and whole.flat.data_ptr() == x.data_ptr()  # a view, read in place
    chunk, fresh = whole.read(slice(2, 6))
    assert not fresh and chunk.data_ptr() == x[0, 2].data_ptr()


def test_infinite_num_tokens_is_refused() -> None:
    # catches inf accepted as a divisor (loss 0, gradient 0)
    v = torch.ones(2, 3)
    for name in ("num_tokens", "num_seqs"):
        with pytest.raises(ValueError, match=rf"`{name}` must be a finite number >= 0 or a tensor, got inf"):
            lk.aggregate(v, **{name: math.inf})
    with pytest.raises(ValueError, match=r"`num_tokens` must be a finite number >= 0 or a tensor, got inf"):
        lk.KLPenaltyLoss("k3")(-v, -v, num_tokens=math.inf)


def test_full_from_hidden_refuses_reference_rows_in_another_layout() -> None:
    # catches the leading-shape check removed: [2, 3, d] against [3, 2, d] pairs the wrong rows
    w = torch.randn(11, 4)
    with pytest.raises(ValueError, match=r"logits of one shape.*hidden \(2, 3, 4\).*ref_hidden \(3, 2, 4\)"):
        kl_from_hidden(torch.randn(2, 3, 4), w, torch.randn(3, 2, 4), w)
    loss = lk.KLPenaltyLoss("full")
    with pytest.raises(ValueError, match=r"logits of one shape.*hidden \(2, 3, 4\).*ref_hidden \(3, 2, 4\)"):
        loss(lk.FromHidden(torch.randn(2, 3, 4), w), lk.FromHidden(torch.randn(3, 2, 4), w))
