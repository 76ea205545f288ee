"""How the loss learns the Trainer's ``accumulate_grad_batches`` (``k``): through ``KLLossCallback``, never the stack.

* ``def training_step(s, batch, i)`` (any names), plain or ``torch.compile``d, under
  ``accumulate_grad_batches=2`` with the step's totals: the one-big-batch gradient from the formula,
  in every mode that divides by a count (and the two that do not);
* the Trainer's ``k`` is not read while it validates or predicts;
* a deep copy (or a pickle) of an attached loss is not attached to the original's Trainer;
* where the loss cannot know ``k`` (attached to no Trainer, step totals given) it says so, once.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _reference import weights
from torch import Tensor, nn
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.functional import AGG_MODES

F64 = torch.float64
K = 2
T = 4
LENGTHS = (3, 0, 4, 1, 2, 4, 1)  # micro-batch 0: rows 0-2 (7 tokens, 2 sequences); 1: rows 3-6 (8 tokens, 4)
MICRO_ROWS = ((0, 1, 2), (3, 4, 5, 6))
COEF = 0.5


def _data() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(11)
    b = len(LENGTHS)
    mask = torch.arange(T).expand(b, T) < torch.tensor(LENGTHS).unsqueeze(-1)
    lp = -torch.rand(b, T, generator=g, dtype=F64) * 3
    ref = -torch.rand(b, T, generator=g, dtype=F64) * 3
    return {"logprob": lp, "ref_logprob": torch.where(mask, ref, float("nan")), "mask": mask}


def _formula_grad(mode: str) -> Tensor:
    # k3's gradient w.r.t. logprob, 1 - exp(-d), weighted by the mode over the step's whole batch
    data = _data()
    d = torch.where(data["mask"], data["logprob"] - data["ref_logprob"], 0.0)
    return COEF * weights(data["mask"], mode) * -torch.expm1(-d)


class _Module(pl.LightningModule):
    """One parameter and one loss per mode; ``training_step`` is written with other argument names."""

    def __init__(self, compiled: bool = False) -> None:
        super().__init__()
        self.data = _data()
        self.logprobs = nn.ParameterList([nn.Parameter(self.data["logprob"].clone()) for _ in AGG_MODES])
        self.losses = nn.ModuleList([lk.KLPenaltyLoss("k3", coef=COEF, agg=mode) for mode in AGG_MODES])
        self.grads: list[list[Tensor]] = []
        self.val_values: list[Tensor] = []
        if compiled:
            self.training_step = torch.compile(self.step, backend="eager")  # type: ignore[method-assign]

    def step(s, batch: dict[str, Tensor], i: int) -> Tensor:  # noqa: N805 - `s`, not `self`: nothing reads names
        rows = batch["rows"]
        total = torch.zeros((), dtype=F64)
        for param, loss_fn in zip(s.logprobs, s.losses):
            total = total + loss_fn(
                param[rows], s.data["ref_logprob"][rows], s.data["mask"][rows],
                num_tokens=batch["num_tokens"], num_seqs=batch["num_seqs"],
            )
        return total

    def training_step(s, batch: dict[str, Tensor], i: int) -> Tensor:  # noqa: N805
        return s.step(batch, i)

    def validation_step(s, batch: dict[str, Tensor], i: int) -> None:  # noqa: N805
        rows = batch["rows"]
        # the step's totals given while validating: nothing accumulates, so no factor k
        s.val_values.append(torch.stack([
            loss_fn(s.data["logprob"][rows], s.data["ref_logprob"][rows], s.data["mask"][rows],
                    num_tokens=batch["num_tokens"], num_seqs=batch["num_seqs"]).detach()
            for loss_fn in s.losses
        ]))

    def predict_step(s, batch: dict[str, Tensor], i: int) -> Tensor:  # noqa: N805
        rows = batch["rows"]
        return s.losses[0](s.data["logprob"][rows], s.data["ref_logprob"][rows], s.data["mask"][rows],
                           num_tokens=batch["num_tokens"]).detach()

    def _loader(self) -> Any:
        totals = lk.step_totals([self.data["mask"][list(rows)] for rows in MICRO_ROWS])
        return torch.utils.data.DataLoader([{"rows": torch.tensor(r), **totals} for r in MICRO_ROWS], batch_size=None)

    train_dataloader = val_dataloader = predict_dataloader = _loader

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append([p.grad.clone() for p in self.logprobs])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(model: _Module, quiet_trainer: Any, **kwargs: Any) -> pl.Trainer:
    trainer = quiet_trainer(max_epochs=1, accumulate_grad_batches=K, num_sanity_val_steps=0, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="KLPenaltyLoss")  # k is known, the totals are given: no warning
        trainer.fit(model)
    return trainer


@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
def test_any_training_step_gives_the_one_big_batch_gradient_in_every_mode(compiled: bool, quiet_trainer: Any) -> None:
    model = _Module(compiled=compiled)
    _fit(model, quiet_trainer, limit_val_batches=0)
    assert len(model.grads) == 1  # one optimizer step over the 2 micro-batches
    for mode, got in zip(AGG_MODES, model.grads[0]):
        assert_close(got, _formula_grad(mode), rtol=0, atol=1e-12, msg=lambda m, mode=mode: f"{mode}: {m}")


def test_the_trainers_k_is_not_read_while_it_validates_or_predicts(quiet_trainer: Any) -> None:
    model = _Module()
    trainer = _fit(model, quiet_trainer)
    data = _data()
    totals = lk.step_totals([data["mask"][list(rows)] for rows in MICRO_ROWS])
    assert len(model.val_values) == 2
    for rows, got in zip(MICRO_ROWS, model.val_values):
        r = list(rows)
        d = torch.where(data["mask"][r], data["logprob"][r] - data["ref_logprob"][r], 0.0)
        k3 = torch.expm1(-d) + d
        n_tok, n_seq = float(totals["num_tokens"]), float(totals["num_seqs"])
        lengths = data["mask"][r].sum(-1, keepdim=True).double()
        want = {
            "token-mean": k3.sum() / n_tok,
            "token-sum": k3.sum(),
            "seq-mean-token-sum": k3.sum() / n_seq,
            "seq-mean-token-mean": (k3 / lengths.clamp(min=1)).sum() / n_seq,
            "seq-mean-token-sum-norm": k3.sum() / T,
        }
        assert_close(got, COEF * torch.stack([want[m] for m in AGG_MODES]), rtol=1e-12, atol=1e-14)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="KLPenaltyLoss")
        predicted = trainer.predict(model, model.predict_dataloader())
    assert_close(predicted[0], model.val_values[0][AGG_MODES.index("token-mean")], rtol=1e-12, atol=1e-14)


class _FakeTrainer:
    training = True
    accumulate_grad_batches = 3


def _args() -> tuple[Tensor, Tensor, Tensor]:
    lp = -torch.ones(2, 3, dtype=F64)
    return lp, lp + 1, torch.ones(2, 3, dtype=torch.bool)


def test_a_deep_copy_or_a_pickle_does_not_read_the_originals_trainer() -> None:
    loss = lk.KLPenaltyLoss("k3", agg="token-mean")
    trainer = _FakeTrainer()
    loss.attach(trainer)
    one = lk.KLPenaltyLoss("k3", agg="token-mean")(*_args(), num_tokens=6, accumulate_grad_batches=1)
    assert_close(loss(*_args(), num_tokens=6), 3 * one)  # attached: the Trainer's k = 3
    for clone in (copy.deepcopy(loss), pickle.loads(pickle.dumps(loss))):
        with pytest.warns(UserWarning, match="knows no `accumulate_grad_batches`"):
            assert_close(clone(*_args(), num_tokens=6), one)  # its own: no Trainer, so 1, said once
        other = _FakeTrainer()  # the loss keeps a weak reference: the Trainer must live
        clone.attach(other)
        assert_close(clone(*_args(), num_tokens=6), 3 * one)
    assert_close(loss(*_args(), num_tokens=6), 3 * one)  # the original is still attached
    trainer.training = False
    assert_close(loss(*_args(), num_tokens=6), one)  # its Trainer not training: 1


def test_where_k_is_unknown_the_loss_says_so_once() -> None:
    loss = lk.KLPenaltyLoss("k3", agg="seq-mean-token-sum")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss(*_args())  # no totals: nothing to scale, nothing to say
        loss(*_args(), num_seqs=2, accumulate_grad_batches=1)  # k given
    with pytest.warns(UserWarning, match=r"got the step's totals .* but knows no `accumulate_grad_batches`: it is attached to no Trainer") as record:
        for _ in range(3):
            loss(*_args(), num_seqs=2)
    assert sum("knows no" in str(w.message) for w in record) == 1
    trainer = _FakeTrainer()
    fresh = lk.KLPenaltyLoss("k3", agg="seq-mean-token-sum")
    fresh.attach(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh(*_args(), num_seqs=2)  # attached: k known
        trainer.training = False
        fresh(*_args(), num_seqs=2)  # attached, validating: k = 1, known
