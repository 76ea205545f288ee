"""Behaviours that a mutation run of the library (one deliberate bug at a time) found untested.

Each test names the wrong implementation it catches: a per-sequence score at ``mask.sum(-1) - 1``
instead of the last valid position, a ``state_key`` from the estimator alone, a controller resume
that overwrites its configuration, and the documented defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.testing import assert_close

import lightning_kl as lk


def test_per_sequence_score_goes_to_the_last_valid_token_with_holes_and_left_padding() -> None:
    # masks that are not left-aligned prefixes: the last valid position is not mask.sum(-1) - 1
    mask = torch.tensor(
        [
            [False, False, True, True, False],  # left padding: last valid 3, sum - 1 = 1
            [True, False, True, False, False],  # a hole: last valid 2, sum - 1 = 1
            [False, False, False, False, True],  # last valid 4, sum - 1 = 0
            [True, True, True, True, True],  # last valid 4
        ]
    )
    logprobs = -torch.arange(20, dtype=torch.float64).reshape(4, 5) / 10
    ref = logprobs - 0.5
    scores = torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=torch.float64)
    batch = {"scores": scores, "logprobs": logprobs, "ref_logprobs": torch.where(mask, ref, float("nan")), "mask": mask}
    callback = lk.KLRewardCallback("k1", lk.FixedKLController(0.1))
    rewards, kl_sum, n = callback.shape_rewards(batch)
    # enumerated: -0.1 * 0.5 at every valid token, the score added at (row, last valid position)
    want = torch.where(mask, torch.tensor(-0.05, dtype=torch.float64), 0.0)
    for row, last in enumerate((3, 2, 4, 4)):
        want[row, last] += scores[row]
    assert_close(rewards, want, rtol=0, atol=1e-14)
    assert kl_sum.item() == pytest.approx(4 * 0.5) and n.item() == 4


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        lp = -torch.rand(2, 3, 4, generator=g)
        data = [{"scores": torch.zeros(3), "logprobs": lp[i], "ref_logprobs": lp[i] - 1.0, "mask": torch.ones(3, 4, dtype=torch.bool)} for i in range(2)]
        return torch.utils.data.DataLoader(data, batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.w * (batch["rewards"].sum() + batch["rewards_b"].sum())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_two_callbacks_with_one_estimator_keep_separate_states(quiet_trainer: Any, tmp_path: Path) -> None:
    # one estimator, different rewards keys and log prefixes: a state_key from the estimator alone
    # would store one state in the checkpoint and load it into both
    def pair(a: float, b: float) -> list[lk.KLRewardCallback]:
        return [
            lk.KLRewardCallback("k1", lk.AdaptiveKLController(a, target_kl=0.1, horizon=10)),
            lk.KLRewardCallback("k1", lk.AdaptiveKLController(b, target_kl=5.0, horizon=10), rewards_key="rewards_b", log_prefix="b/"),
        ]

    first = pair(0.2, 0.7)
    assert first[0].state_key != first[1].state_key
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="last")
    quiet_trainer(max_epochs=1, callbacks=[*first, ckpt], enable_checkpointing=True).fit(_Module())
    values = [cb.controller.value for cb in first]
    assert values[0] > 0.2 and values[1] < 0.7  # one went up, the other down
    second = pair(0.5, 0.5)
    for cb in second:
        cb.load_state_dict(torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"][cb.state_key])
    assert [cb.controller.value for cb in second] == values


def test_adaptive_controller_resume_keeps_its_configured_target_and_horizon() -> None:
    ctl = lk.AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    ctl.load_state_dict({"value": 0.5, "target_kl": 1.0, "horizon": 5})
    assert (ctl.value, ctl.target_kl, ctl.horizon) == (0.5, 6.0, 10000.0)
    ctl.update(12.0, n_steps=500)  # with target 6 and horizon 10000: e = 0.2, beta *= 1.01
    assert ctl.value == pytest.approx(0.505, rel=1e-15)


def test_documented_defaults() -> None:
    # the public API: KLRewardCallback(estimator="k1", controller=None) -> FixedKLController(0.001);
    # kl_penalty(..., estimator="k3+"); KLPenaltyLoss(estimator="k3+", coef=0.001, agg="token-mean")
    callback = lk.KLRewardCallback()
    assert callback.estimator == "k1"
    assert type(callback.controller) is lk.FixedKLController and callback.controller.value == 0.001
    assert lk.FixedKLController().value == 0.001
    adaptive = lk.AdaptiveKLController()
    assert (adaptive.value, adaptive.target_kl, adaptive.horizon) == (0.2, 6.0, 10000.0)
    # k3+: the value of k3 (not k1's, k2's) and the gradient d (not k3's 1 - e^-d)
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -3.0], dtype=torch.float64)
    value = lk.kl_penalty(lp, ref)
    (grad,) = torch.autograd.grad(value.sum(), lp)
    d = lp.detach() - ref
    assert_close(value.detach(), torch.expm1(-d) + d, rtol=1e-15, atol=0)
    assert_close(grad, d, rtol=0, atol=0)
    loss = lk.KLPenaltyLoss()
    assert (loss.estimator, loss.coef, loss.agg) == ("k3+", 0.001, "token-mean")


def test_a_controller_written_for_floats_still_drives_the_callback() -> None:
    # a user subclass of the earlier base class: update() with float maths, no _factor
    class Halving(lk.KLController):
        def __init__(self) -> None:
            self.value = 1.0

        def update(self, current_kl: Any, n_steps: Any) -> None:
            self.value = self.value / 2 if float(current_kl) > 0 else self.value

    callback = lk.KLRewardCallback("k1", Halving())
    lp = torch.zeros(2, 3)
    for _ in range(3):
        batch = {"scores": torch.zeros(2), "logprobs": lp, "ref_logprobs": lp - 1.0, "mask": torch.ones(2, 3, dtype=torch.bool)}
        _, kl_sum, n = callback.shape_rewards(batch)
        callback.update_controller(kl_sum, n)
    assert callback.controller.value == 0.125
    assert_close(batch["rewards"], torch.full((2, 3), -0.25))  # the third batch used beta = 0.25
    with pytest.raises(NotImplementedError, match="_factor"):

        class Nothing(lk.KLController):
            def __init__(self) -> None:
                self.value = 1.0

        Nothing().update(1.0, 2)
