"""KLMetric under update/compute/reset and pickling; the controllers' updates and state."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk


def test_metric_is_token_mean_over_updates():
    metric = lk.KLMetric()
    metric.update(torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 5.0]]),
                  torch.tensor([[True, True, False], [True, False, True]]))
    metric.update(torch.tensor([10.0, 20.0]))
    # (1 + 2 + 3 + 5 + 10 + 20) / 6
    assert_close(metric.compute(), torch.tensor(41.0 / 6, dtype=torch.float64))
    metric.reset()
    with pytest.warns(UserWarning, match="called before the ``update`` method"):
        assert math.isnan(metric.compute().item())  # nothing seen: no data (NaN), not a KL of 0
    metric.update(torch.tensor([4.0]))
    assert_close(metric.compute(), torch.tensor(4.0, dtype=torch.float64))


def test_metric_forward_returns_batch_value_and_accumulates():
    metric = lk.KLMetric()
    f64 = torch.float64  # the result is in the state's dtype
    assert_close(metric(torch.tensor([1.0, 3.0])), torch.tensor(2.0, dtype=f64))
    assert_close(metric(torch.tensor([5.0, 9.0]), torch.tensor([True, False])), torch.tensor(5.0, dtype=f64))
    assert_close(metric.compute(), torch.tensor(3.0, dtype=f64))


def test_metric_accumulates_in_float64():
    metric = lk.KLMetric()
    for _ in range(100):
        metric.update(torch.full((10_000,), 1e-3 + 1e-9, dtype=torch.float32))
    # a float32 running sum of 1e6 terms of 1e-3 drifts by ~1e-4 relative; float64 does not
    assert abs(metric.compute().item() - float(torch.tensor(1e-3 + 1e-9, dtype=torch.float32))) < 1e-9
    assert metric.compute().dtype == torch.float64  # the state's dtype, not float32


def test_metric_pickles_with_state():
    metric = lk.KLMetric()
    metric.update(torch.tensor([1.0, 2.0]))
    clone = pickle.loads(pickle.dumps(metric))
    assert_close(clone.compute(), torch.tensor(1.5, dtype=torch.float64))
    assert_close(copy.deepcopy(metric).compute(), torch.tensor(1.5, dtype=torch.float64))


def test_loss_feeds_its_metric_with_forward_values():
    loss_fn = lk.KLPenaltyLoss("k3+", coef=2.0)
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, -3.0]])
    mask = torch.tensor([[True, True, False]])
    loss = loss_fn(lp, ref, mask)
    k3 = lk.kl_penalty(lp, ref, "k3")[mask]
    assert_close(loss, 2.0 * k3.mean())
    assert_close(loss_fn.metric.compute(), k3.mean().double())


def test_adaptive_controller_follows_ziegler_update():
    ctl = lk.AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10_000)
    expected = 0.2
    for kl, n in [(6.0, 64), (12.0, 64), (0.0, 128), (6.6, 32), (7.5, 16)]:
        ctl.update(kl, n)
        err = min(max(kl / 6.0 - 1, -0.2), 0.2)
        expected *= 1 + err * n / 10_000
        assert ctl.value == pytest.approx(expected, rel=1e-15)


def test_controller_state_round_trip():
    ctl = lk.AdaptiveKLController(0.1, 1.0, 100)
    ctl.update(3.0, 10)
    other = lk.AdaptiveKLController(0.1, 1.0, 100)
    other.load_state_dict(pickle.loads(pickle.dumps(ctl.state_dict())))
    assert other.value == ctl.value
    fixed = lk.FixedKLController(0.3)
    fixed.update(100.0, 5)
    assert fixed.value == 0.3
    assert pickle.loads(pickle.dumps(ctl)).value == ctl.value


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: lk.FixedKLController(-0.1), "kl_coef"),
        (lambda: lk.FixedKLController(math.nan), "kl_coef"),
        (lambda: lk.AdaptiveKLController(init_kl_coef=0.0), "init_kl_coef"),
        (lambda: lk.AdaptiveKLController(target_kl=0.0), "target_kl"),
        (lambda: lk.AdaptiveKLController(target_kl=-1.0), "target_kl"),
        (lambda: lk.AdaptiveKLController(horizon=0), "horizon"),
        (lambda: lk.AdaptiveKLController(horizon=-5), "horizon"),
        (lambda: lk.AdaptiveKLController(horizon=math.inf), "horizon"),
        (lambda: lk.KLPenaltyLoss("k3", coef=-1.0), "coef"),
    ],
)
def test_nonsense_configuration_fails_at_construction(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_controller_refuses_non_finite_kl():
    ctl = lk.AdaptiveKLController()
    with pytest.raises(ValueError, match="non-finite KL"):
        ctl.update(float("nan"), 8)
    assert ctl.value == 0.2
    with pytest.raises(ValueError, match="n_steps"):
        ctl.update(1.0, 0)
