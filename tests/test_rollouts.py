"""lk.OnPolicyRollouts: every batch is sampled after the previous update, in a real Trainer loop."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import lightning_kl as lk

pytestmark = pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")


class _StepRecorder(pl.LightningModule):
    """Each batch carries the optimizer steps taken when it was sampled; training_step records both."""

    def __init__(self, dataset_of) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.dataset_of = dataset_of
        self.seen: list[tuple[int, int]] = []

    def sample(self) -> dict[str, int]:
        return {"sampled_at": self.global_step}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset_of(self.sample, 4), batch_size=None, num_workers=0)

    def training_step(self, batch, batch_idx):
        self.seen.append((batch["sampled_at"], self.global_step))
        return (self.w - 1.0) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _NoLength(IterableDataset):
    """The same stream without ``__len__``: what the length is there to prevent."""

    def __init__(self, sample, n_rollouts: int) -> None:
        self.sample, self.n_rollouts = sample, n_rollouts

    def __iter__(self):
        for _ in range(self.n_rollouts):
            yield self.sample()


def test_each_batch_is_sampled_after_the_previous_update(quiet_trainer):
    module = _StepRecorder(lk.OnPolicyRollouts)
    quiet_trainer(max_epochs=1).fit(module)
    assert module.seen == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_without_a_length_lightning_samples_one_batch_ahead(quiet_trainer):
    # the contrast that shows the test above can fail: rollout k + 1 is sampled before update k
    module = _StepRecorder(_NoLength)
    quiet_trainer(max_epochs=1).fit(module)
    assert [s for s, _ in module.seen] != [t for _, t in module.seen]


def test_sample_is_called_only_when_a_batch_is_fetched():
    calls = []
    rollouts = lk.OnPolicyRollouts(lambda: calls.append(1) or len(calls), n_rollouts=2)
    assert len(rollouts) == 2 and calls == []
    assert list(rollouts) == [1, 2] and list(rollouts) == [3, 4]  # a fresh sample every epoch


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "3"])
def test_a_bad_count_fails_naming_it(n):
    with pytest.raises(ValueError, match=f"`n_rollouts` must be an integer >= 1, got {n!r}"):
        lk.OnPolicyRollouts(lambda: None, n)


def test_a_sampler_that_is_not_callable_fails():
    with pytest.raises(TypeError, match="`sample` must be callable"):
        lk.OnPolicyRollouts([1, 2], 2)
