"""Gradient accumulation gives the gradient of the optimizer step's whole batch, in every mode.

A real ``Trainer(accumulate_grad_batches=4)`` loop over uneven micro-batches (1 to 4 sequences,
3 to 12 valid tokens, an empty sequence, NaN padding) accumulates the gradient of ``KLPenaltyLoss``
given the step's totals; it must equal, to 1e-12 in float64, the gradient of one call over the
concatenated batch. The DDP version (2 processes, each accumulating) is in tests/test_distributed.py.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.functional import AGG_MODES

K = 4
T = 5
# rows of each micro-batch in the step's batch, and each row's valid-token count
MICRO_ROWS = ((0,), (1, 2, 3), (4, 5), (6, 7, 8, 9))
LENGTHS = (3, 5, 0, 2, 4, 1, 5, 5, 1, 1)  # micro-batch tokens: 3, 7, 5, 12; sequences: 1, 2, 2, 4
ESTIMATOR = "k3"


def step_data() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(7)
    b = len(LENGTHS)
    mask = torch.arange(T).expand(b, T) < torch.tensor(LENGTHS).unsqueeze(-1)
    logprob = -torch.rand(b, T, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(b, T, generator=g, dtype=torch.float64) * 3
    return {"logprob": logprob, "ref_logprob": torch.where(mask, ref, float("nan")), "mask": mask}


class Accumulator(pl.LightningModule):
    """One parameter per aggregation mode (the policy's log-probs of the step's batch); micro-batch
    ``j`` takes its rows. Records the accumulated gradient when the optimizer steps."""

    def __init__(self, with_totals: bool = True) -> None:
        super().__init__()
        self.data = step_data()
        self.with_totals = with_totals
        self.logprobs = nn.ParameterList([nn.Parameter(self.data["logprob"].clone()) for _ in AGG_MODES])
        self.losses = nn.ModuleList([lk.KLPenaltyLoss(ESTIMATOR, coef=0.5, agg=mode) for mode in AGG_MODES])
        self.grads: list[list[Tensor]] = []

    def train_dataloader(self) -> Any:
        masks = [self.data["mask"][list(rows)] for rows in MICRO_ROWS]
        totals = lk.step_totals(masks)
        micro = [{"rows": torch.tensor(rows), **totals} for rows in MICRO_ROWS]
        return torch.utils.data.DataLoader(micro, batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        rows = batch["rows"]
        kwargs: dict[str, Any] = {"accumulate_grad_batches": self.trainer.accumulate_grad_batches}
        if self.with_totals:
            kwargs.update(num_tokens=batch["num_tokens"], num_seqs=batch["num_seqs"])
        total = torch.zeros((), dtype=torch.float64)
        for param, loss_fn in zip(self.logprobs, self.losses):
            total = total + loss_fn(param[rows], self.data["ref_logprob"][rows], self.data["mask"][rows], **kwargs)
        return total

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append([p.grad.clone() for p in self.logprobs])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(model: pl.LightningModule, quiet_trainer: Any) -> None:
    quiet_trainer(max_epochs=1, accumulate_grad_batches=K).fit(model)


def big_batch_grads() -> list[Tensor]:
    data = step_data()
    grads = []
    for mode in AGG_MODES:
        logprob = data["logprob"].clone().requires_grad_()
        lk.KLPenaltyLoss(ESTIMATOR, coef=0.5, agg=mode)(logprob, data["ref_logprob"], data["mask"]).backward()
        grads.append(logprob.grad)
    return grads


def test_accumulated_gradient_is_the_big_batch_gradient_in_every_mode(quiet_trainer: Any) -> None:
    model = Accumulator()
    _fit(model, quiet_trainer)
    assert len(model.grads) == 1  # one optimizer step over the 4 micro-batches
    for mode, got, want in zip(AGG_MODES, model.grads[0], big_batch_grads()):
        assert_close(got, want, rtol=0, atol=1e-12, msg=lambda m, mode=mode: f"{mode}: {m}")
    # the metric fed by the losses is the token-mean of the step's batch, too
    data = step_data()
    d = (data["logprob"] - data["ref_logprob"])[data["mask"]]
    want_kl = (torch.expm1(-d) + d).mean()
    assert_close(model.losses[0].metric.compute(), want_kl)  # float64, the state's dtype


def test_without_totals_it_warns_once_and_weighs_micro_batches_equally(quiet_trainer: Any) -> None:
    model = Accumulator(with_totals=False)
    with pytest.warns(UserWarning, match="accumulating gradients over 4 micro-batches but got no `num_") as record:
        _fit(model, quiet_trainer)
    assert sum("num_tokens" in str(w.message) for w in record) == 1
    # and once for each of the two seq-mean modes, which need num_seqs
    assert sum("got no `num_seqs`" in str(w.message) for w in record) == 2
    # token-mean: the mean over micro-batches of each one's token-mean, not the big batch's
    token_mean = AGG_MODES.index("token-mean")
    assert not torch.allclose(model.grads[0][token_mean], big_batch_grads()[token_mean])


def test_step_totals_counts_tokens_and_non_empty_sequences() -> None:
    data = step_data()
    totals = lk.step_totals([data["mask"][list(rows)] for rows in MICRO_ROWS])
    assert totals["num_tokens"].item() == sum(LENGTHS) and totals["num_seqs"].item() == 9
    assert lk.step_totals(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))["num_seqs"].item() == 1  # 0/1 numbers


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: lk.step_totals([]), "at least one micro-batch"),
        (lambda: lk.step_totals([torch.tensor(True)]), "micro-batch 0's mask must be a"),
        (lambda: lk.KLPenaltyLoss()(torch.zeros(2), torch.zeros(2), accumulate_grad_batches=0), "positive integer"),
        (lambda: lk.KLPenaltyLoss()(torch.zeros(2), torch.zeros(2), num_tokens=-1), "num_tokens"),
    ],
)
def test_bad_accumulation_arguments_are_named(call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
