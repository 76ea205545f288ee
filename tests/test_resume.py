"""A resumed run continues the uninterrupted one exactly; callbacks, controllers and metrics travel.

The uninterrupted run saves a checkpoint at the end of every epoch (``ModelCheckpoint``); a fresh
Trainer with freshly built callbacks resumes from the first one with ``ckpt_path=`` and must
reproduce the rest of the uninterrupted run's coefficient trajectory bit for bit. Each epoch draws
different rollouts (seeded by the epoch), so resuming with the wrong epoch counter or the wrong
controller state shows up in the trajectory.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn

import lightning_kl as lk
from _trainers import make_quiet_trainer

B, T, BATCHES_PER_EPOCH, EPOCHS = 4, 6, 3, 3


def rollout(epoch: int, index: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1000 * epoch + index)
    lengths = torch.randint(1, T + 1, (B, 1), generator=g)
    mask = torch.arange(T).expand(B, T) < lengths
    logprobs = -torch.rand(B, T, generator=g) * 3
    ref = logprobs - (0.2 + 0.8 * torch.rand(B, T, generator=g))
    return {
        "scores": torch.randn(B, generator=g),  # per sequence: added at the last valid token
        "logprobs": torch.where(mask, logprobs, float("nan")),
        "ref_logprobs": ref,
        "mask": mask,
    }


class RolloutModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def train_dataloader(self) -> Any:
        # reloaded every epoch: epoch e sees its own rollouts, as an RL loop that samples anew
        data = [rollout(self.current_epoch, i) for i in range(BATCHES_PER_EPOCH)]
        return torch.utils.data.DataLoader(data, batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return (self.w * batch["rewards"].mean()) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder(Callback):
    """After every step: (epoch, global_step, each KL callback's coefficient)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, tuple[float, ...]]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        coefs = tuple(c.controller.value for c in trainer.callbacks if isinstance(c, lk.KLRewardCallback))
        self.rows.append((trainer.current_epoch, trainer.global_step, coefs))


def kl_callbacks(init: float = 0.2) -> list[lk.KLRewardCallback]:
    # two callbacks in one Trainer: different estimators, targets, rewards keys and log prefixes
    return [
        lk.KLRewardCallback("k1", lk.AdaptiveKLController(init, target_kl=0.5, horizon=50)),
        lk.KLRewardCallback(
            "k3",
            lk.AdaptiveKLController(init, target_kl=0.05, horizon=30),
            rewards_key="rewards_k3",
            log_prefix="kl_k3/",
        ),
    ]


def make_trainer(root: Path, callbacks: list[Callback], **kwargs: Any) -> pl.Trainer:
    # the quiet Trainer of conftest.py, with checkpoints unless a test turns them off
    kwargs = {"enable_checkpointing": True, **kwargs}
    return make_quiet_trainer(root, max_epochs=EPOCHS, callbacks=callbacks, reload_dataloaders_every_n_epochs=1, **kwargs)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Recorder, Path, list[lk.KLRewardCallback]]:
    root = tmp_path_factory.mktemp("uninterrupted")
    recorder, callbacks = Recorder(), kl_callbacks()
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    torch.manual_seed(0)
    make_trainer(root, [*callbacks, recorder, ckpt]).fit(RolloutModule())
    return recorder, root / "ckpt" / "epoch=0.ckpt", callbacks


def test_two_callbacks_keep_separate_state(uninterrupted: tuple[Recorder, Path, list[lk.KLRewardCallback]]) -> None:
    recorder, ckpt_path, callbacks = uninterrupted
    assert len(recorder.rows) == EPOCHS * BATCHES_PER_EPOCH
    k1_coefs, k3_coefs = zip(*(coefs for _, _, coefs in recorder.rows))
    assert len(set(k1_coefs)) == len(k1_coefs) and len(set(k3_coefs)) == len(k3_coefs)  # both moved every step
    assert k1_coefs != k3_coefs
    saved = torch.load(ckpt_path, weights_only=False)["callbacks"]
    states = {key: state for key, state in saved.items() if key.startswith("KLRewardCallback")}
    assert set(states) == {cb.state_key for cb in callbacks} and len(states) == 2
    # the epoch-0 checkpoint holds each controller's value after the last step of epoch 0
    after_epoch0 = recorder.rows[BATCHES_PER_EPOCH - 1][2]
    for cb, value in zip(callbacks, after_epoch0):
        assert states[cb.state_key]["controller"]["value"] == value


# the callbacks are rebuilt on purpose (the checkpoint's state must win): Lightning's reminder is expected
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_reproduces_the_uninterrupted_trajectory(
    uninterrupted: tuple[Recorder, Path, list[lk.KLRewardCallback]], tmp_path: Path
) -> None:
    recorder, ckpt_path, _ = uninterrupted
    resumed = Recorder()
    # fresh callbacks, in the other order and with another starting coefficient: the checkpoint's
    # state must win, matched to each callback by its state_key, not by position
    callbacks = kl_callbacks(init=0.9)[::-1]
    make_trainer(tmp_path, [*callbacks, resumed], enable_checkpointing=False).fit(
        RolloutModule(), ckpt_path=str(ckpt_path)
    )
    expected = recorder.rows[BATCHES_PER_EPOCH:]
    got = [(epoch, step, coefs[::-1]) for epoch, step, coefs in resumed.rows]
    assert got == expected  # exact: epochs, step counters and both coefficients, bit for bit


class ResumableRollouts:
    """An epoch's rollouts that Lightning can checkpoint mid-epoch (``state_dict``/``load_state_dict``)."""

    def __init__(self, epoch: int) -> None:
        self.epoch, self.start, self.pos = epoch, 0, 0

    def __iter__(self) -> Any:
        start, self.start = self.start, 0
        for i in range(start, BATCHES_PER_EPOCH):
            self.pos = i + 1
            yield rollout(self.epoch, i)

    def __len__(self) -> int:
        return BATCHES_PER_EPOCH

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = self.pos = state["pos"]


class ResumableModule(RolloutModule):
    def train_dataloader(self) -> Any:
        return ResumableRollouts(self.current_epoch)


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_mid_epoch_resume_with_a_resumable_loader_is_exact(tmp_path: Path) -> None:
    recorder = Recorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", save_top_k=-1, every_n_train_steps=1)
    make_trainer(tmp_path, [*kl_callbacks(), recorder, ckpt]).fit(ResumableModule())
    assert len(recorder.rows) == EPOCHS * BATCHES_PER_EPOCH
    for step in (1, 4, 8):  # inside epochs 0, 1 and 2
        resumed = Recorder()
        make_trainer(tmp_path / str(step), [*kl_callbacks(init=0.5), resumed], enable_checkpointing=False).fit(
            ResumableModule(), ckpt_path=str(tmp_path / "ckpt" / f"step={step}.ckpt")
        )
        assert len(resumed.rows) == EPOCHS * BATCHES_PER_EPOCH - step
        assert resumed.rows == recorder.rows[step:]  # epochs, steps and both coefficients, exactly


def test_resume_into_another_controller_class_keeps_the_configured_one(
    uninterrupted: tuple[Recorder, Path, list[lk.KLRewardCallback]],
) -> None:
    _, ckpt_path, callbacks = uninterrupted
    state = torch.load(ckpt_path, weights_only=False)["callbacks"][callbacks[0].state_key]
    fixed = lk.KLRewardCallback("k1", lk.FixedKLController(0.3))
    with pytest.warns(UserWarning, match="AdaptiveKLController.*FixedKLController"):
        fixed.load_state_dict(state)
    assert fixed.controller.value == 0.3


def _used_callback() -> lk.KLRewardCallback:
    cb = lk.KLRewardCallback("k3+", lk.AdaptiveKLController(0.2, target_kl=0.1, horizon=20), log_prefix="a/")
    _, kl_sum, n = cb.shape_rewards(rollout(0, 0))
    cb.update_controller(float(kl_sum), float(n))
    return cb


def _used_metric() -> lk.KLMetric:
    metric = lk.KLMetric()
    batch = rollout(0, 1)
    metric.update(lk.kl_penalty(batch["logprobs"], batch["ref_logprobs"], "k1", mask=batch["mask"]), batch["mask"])
    return metric


@pytest.mark.parametrize("clone", [lambda x: pickle.loads(pickle.dumps(x)), copy.deepcopy], ids=["pickle", "deepcopy"])
def test_parts_pickle_and_deepcopy_with_their_state(clone: Any) -> None:
    cb = _used_callback()
    cb2 = clone(cb)
    assert cb2.controller.value == cb.controller.value != 0.2
    assert (cb2.estimator, cb2.log_prefix, cb2.state_key) == (cb.estimator, cb.log_prefix, cb.state_key)
    assert cb2.controller.state_dict() == cb.controller.state_dict()
    # the copy is independent and behaves the same
    _, kl_sum, n = cb2.shape_rewards(rollout(0, 2))
    cb2.update_controller(float(kl_sum), float(n))
    assert cb2.controller.value != cb.controller.value
    _, kl_sum, n = cb.shape_rewards(rollout(0, 2))
    cb.update_controller(float(kl_sum), float(n))
    assert cb2.controller.value == cb.controller.value

    for ctl in (lk.FixedKLController(0.05), lk.AdaptiveKLController(0.3, target_kl=2.0, horizon=100)):
        ctl2 = clone(ctl)
        assert type(ctl2) is type(ctl) and vars(ctl2) == vars(ctl)

    metric = _used_metric()
    metric2 = clone(metric)
    assert torch.equal(metric2.compute(), metric.compute()) and int(metric2.count) == int(metric.count) > 0

    loss = lk.KLPenaltyLoss("low_var_kl+", coef=0.2, agg="seq-mean-token-mean", global_batch=True)
    batch = rollout(0, 0)
    value = loss(batch["logprobs"], batch["ref_logprobs"], batch["mask"])
    loss2 = clone(loss)
    assert (loss2.estimator, loss2.coef, loss2.agg, loss2.global_batch) == ("low_var_kl+", 0.2, "seq-mean-token-mean", True)
    assert torch.equal(loss2(batch["logprobs"], batch["ref_logprobs"], batch["mask"]), value)
    # the copy's metric kept the first batch: it has now seen that batch twice, the original once
    assert int(loss2.metric.count) == 2 * int(loss.metric.count)
    assert torch.equal(loss2.metric.compute(), loss.metric.compute())


def test_checkpoints_carry_no_metric_state() -> None:
    # torchmetrics states are not persistent: a resumed KLMetric starts from an empty sum and count
    loss = lk.KLPenaltyLoss("k3+")
    batch = rollout(0, 0)
    loss(batch["logprobs"], batch["ref_logprobs"], batch["mask"])
    assert int(loss.metric.count) > 0
    assert not [k for k in loss.state_dict() if k.startswith("metric.")] and lk.KLMetric().state_dict() == {}


def test_controller_state_dict_round_trip() -> None:
    ctl = lk.AdaptiveKLController(0.2, target_kl=1.0, horizon=10)
    ctl.update(3.0, n_steps=4)
    other = lk.AdaptiveKLController(0.7, target_kl=1.0, horizon=10)
    other.load_state_dict(ctl.state_dict())
    assert other.value == ctl.value
    ctl.update(0.1, n_steps=4)
    other.update(0.1, n_steps=4)
    assert other.value == ctl.value
