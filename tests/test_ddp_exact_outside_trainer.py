"""An ``EntropyBonus`` controller outside a Trainer: it warns when never closed (as ``KLPenaltyLoss`` does), and
one controller shared by a loss and a bonus is refused at the step's close, naming what moves each."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

import lightning_kl as lk
from lightning_kl.coefficient import UNSTEPPED_FORWARDS


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 4, 5, generator=g), torch.tensor([[True, True, True, False], [True, False, False, False]])


def _unstepped(forwards: int, module: Any, close: bool = False) -> list[str]:
    logits, mask = _batch()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(forwards):
            module(logits, mask)
            if close:
                module.update_coef()
    return [str(w.message) for w in record if "has not moved" in str(w.message)]


def test_a_bonus_controller_never_closed_warns_once_after_64_forwards_naming_the_fix() -> None:
    assert not _unstepped(UNSTEPPED_FORWARDS - 1, lk.EntropyBonus(coef=lk.TargetEntropyController(1.0)))  # < 64: quiet
    mine = _unstepped(UNSTEPPED_FORWARDS + 10, lk.EntropyBonus(coef=lk.TargetEntropyController(1.0)))
    assert len(mine) == 1  # at the 64th, once
    assert mine[0].startswith("EntropyBonus's controller has not moved in 64 training forwards")
    assert "EntropyBonus's `update_coef()`" in mine[0] and "KLLossCallback" in mine[0]
    # a loop that closes its steps, an eval() bonus, a number coef, an attached bonus: never told
    assert not _unstepped(UNSTEPPED_FORWARDS + 10, lk.EntropyBonus(coef=lk.TargetEntropyController(1.0)), close=True)
    assert not _unstepped(UNSTEPPED_FORWARDS + 10, lk.EntropyBonus(coef=lk.TargetEntropyController(1.0)).eval())
    assert not _unstepped(UNSTEPPED_FORWARDS + 10, lk.EntropyBonus(coef=0.1))
    attached = lk.EntropyBonus(coef=lk.TargetEntropyController(1.0))
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False)
    attached.attach(trainer)
    assert not _unstepped(UNSTEPPED_FORWARDS + 10, attached)
    # the loss's own warning still names the loss
    loss = lk.KLPenaltyLoss("k1", coef=lk.TargetKLController())
    lp = torch.full((2, 3), -1.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(UNSTEPPED_FORWARDS):
            loss(lp, lp - 0.1)
    assert [str(w.message) for w in record if "has not moved" in str(w.message)][0].startswith("KLPenaltyLoss's controller")


def test_a_bonus_in_a_trainer_is_attached_and_closed(tmp_path: Any) -> None:
    # the callback attaches the bonus (no warning however many micro-batches a step accumulates)
    class Bonused(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.theta = torch.nn.Parameter(torch.zeros(4, 5))
            self.bonus = lk.EntropyBonus(coef=lk.TargetEntropyController(1.0, init_coef=0.2))
            self.attached: list[bool] = []

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader([_batch()] * (UNSTEPPED_FORWARDS + 2), batch_size=None)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.attached.append(self.bonus._attached())
            return self.bonus(self.theta + batch[0], batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Bonused()
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, default_root_dir=tmp_path, max_steps=1,
                         accumulate_grad_batches=UNSTEPPED_FORWARDS + 2, callbacks=[lk.KLLossCallback()])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert not [w for w in record if "has not moved" in str(w.message)]
    assert all(model.attached) and not model.bonus._attached()  # detached at teardown
    assert model.bonus.coef != 0.2  # closed


def _loop_step(loss: lk.KLPenaltyLoss, bonus: lk.EntropyBonus) -> None:
    logits, mask = _batch()
    logits.requires_grad_(True)
    lp = logits.log_softmax(-1)[..., 0]
    (loss(lp, lp.detach() - 0.1, mask) + bonus(logits, mask)).backward()


@pytest.mark.parametrize("first", ["loss", "bonus"])
@pytest.mark.parametrize("wrapped", [False, True])
def test_one_controller_for_a_loss_and_a_bonus_is_refused_at_the_close_of_the_step(first: str, wrapped: bool) -> None:
    ctl = lk.TargetEntropyController(1.0, init_coef=0.2)
    loss = lk.KLPenaltyLoss("k1", coef=lk.KLSchedule(ctl, warmup_steps=2) if wrapped else ctl)
    bonus = lk.EntropyBonus(coef=ctl)
    _loop_step(loss, bonus)
    closing, other = (loss, bonus) if first == "loss" else (bonus, loss)
    with pytest.raises(ValueError) as err:
        closing.update_coef()
    msg = str(err.value)
    assert "one KL controller object is used by this " + type(closing).__name__ in msg
    assert "its KL per optimizer step" in msg and "the policy's token-mean entropy per optimizer step" in msg
    assert "own KL" not in msg
    assert ctl.value == 0.2  # refused before anything moved


def test_separate_controllers_and_a_moved_controller_are_not_refused() -> None:
    loss = lk.KLPenaltyLoss("k1", coef=lk.TargetKLController(init_kl_coef=0.3))
    bonus = lk.EntropyBonus(coef=lk.TargetEntropyController(1.0, init_coef=0.2))
    for _ in range(2):
        _loop_step(loss, bonus)
        loss.update_coef()
        bonus.update_coef()
    # a controller handed from one loss to a new one (the old one no longer runs): not shared
    old = lk.KLPenaltyLoss("k1", coef=lk.TargetKLController(init_kl_coef=0.3))
    _loop_step(old, bonus)
    old.update_coef()
    new = lk.KLPenaltyLoss("k1", coef=old.controller)
    _loop_step(new, bonus)
    new.update_coef()
    # a step left open and dropped (reset_step) no longer counts
    ctl = lk.TargetEntropyController(1.0, init_coef=0.2)
    a, b = lk.EntropyBonus(coef=ctl), lk.EntropyBonus(coef=ctl)
    logits, mask = _batch()
    a(logits, mask)
    a.reset_step()
    b(logits, mask)
    b.update_coef()


def test_the_callbacks_refusal_names_the_bonus_entropy(tmp_path: Any) -> None:
    class Both(pl.LightningModule):
        def __init__(self, ctl: Any) -> None:
            super().__init__()
            self.theta = torch.nn.Parameter(torch.zeros(4, 5))
            self.kl, self.entropy = lk.KLPenaltyLoss("k1", coef=ctl), lk.EntropyBonus(coef=ctl)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader([_batch()], batch_size=None)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.entropy(self.theta + batch[0], batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, default_root_dir=tmp_path, max_steps=1, callbacks=[lk.KLLossCallback()])
    with pytest.raises(ValueError) as err:
        trainer.fit(Both(lk.TargetEntropyController(1.0)))
    msg = str(err.value)
    assert "used by KLPenaltyLoss 'kl' and EntropyBonus 'entropy'" in msg
    assert "EntropyBonus 'entropy' with the policy's token-mean entropy per optimizer step" in msg
    assert "KLPenaltyLoss 'kl' with its KL per optimizer step" in msg and "own KL" not in msg
