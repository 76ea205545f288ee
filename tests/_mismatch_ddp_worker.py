"""``MismatchMetric`` and ``RolloutCorrection(batch_normalize=True)`` under 2-process DDP (CPU, gloo).

``python tests/_mismatch_ddp_worker.py OUT_DIR`` runs ``Trainer(accelerator="cpu", devices=2,
strategy="ddp")`` (Lightning re-launches this script for rank 1); each rank writes
``OUT_DIR/rank{r}.json``. ``tests/test_mismatch_ddp.py`` compares the records with one process over
the same global batches. The ranks hold unequal data: rank 0 long responses close to the engine,
rank 1 short ones (and an empty row) that drifted further, so that a mean of per-process means is
not the global mean.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

import lightning_kl as lk
from _ddp import write_rank_record
from _trainers import make_quiet_trainer

WORLD = 2
STEPS = 3
GLOBAL_B = 8
T = 12
# rank 0 holds rows 0-3 (long responses), rank 1 rows 4-7 (short ones, one empty)
LENGTHS = (12, 11, 10, 12, 2, 3, 0, 1)
CORRECTION = dict(weights="token", upper=2.0, batch_normalize=True)


def global_batches() -> list[dict[str, Tensor]]:
    """``STEPS`` global batches (float64); NaN and inf at padded positions."""
    g = torch.Generator().manual_seed(2027)
    mask = torch.arange(T) < torch.tensor(LENGTHS)[:, None]
    out = []
    for _ in range(STEPS):
        ro = -2.0 * torch.rand(GLOBAL_B, T, generator=g, dtype=torch.float64)
        scale = torch.tensor([0.05] * 4 + [0.6] * 4, dtype=torch.float64)[:, None]  # rank 1 drifted further
        lp = -(ro + scale * torch.randn(GLOBAL_B, T, generator=g, dtype=torch.float64) - scale**2 / 2).abs()  # <= 0
        out.append({
            "logprob": torch.where(mask, lp, float("nan")),
            "rollout": torch.where(mask, ro, float("inf")),
            "mask": mask,
        })  # fmt: skip
    return out


def shard(batch: dict[str, Tensor], rank: int, world: int) -> dict[str, Tensor]:
    b = GLOBAL_B // world
    return {k: v[rank * b : (rank + 1) * b] for k, v in batch.items()}


class Probe(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
        self.mismatch = lk.MismatchMetric()
        self.correction = lk.RolloutCorrection(**CORRECTION)
        self.record: dict[str, Any] = {"weights": []}

    def train_dataloader(self) -> Any:
        world = self.trainer.world_size
        data = [shard(b, self.global_rank, world) for b in global_batches()]
        return torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.mismatch.update(batch["logprob"], batch["rollout"], batch["mask"])
        fix = self.correction(batch["logprob"], batch["rollout"], batch["mask"])
        self.record["weights"].append(fix.weights.tolist())
        return self.w * 0.0

    def on_train_end(self) -> None:
        self.record["metrics"] = {k: float(v) for k, v in self.mismatch.compute().items()}  # synced
        self.record["rank"] = self.global_rank
        self.record["world_size"] = self.trainer.world_size

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(root: str, **trainer_kwargs: Any) -> dict[str, Any]:
    model = Probe()
    trainer = make_quiet_trainer(root, max_epochs=1, use_distributed_sampler=False, **trainer_kwargs)
    trainer.fit(model)
    return model.record


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    write_rank_record(out_dir, fit(out_dir, devices=WORLD, strategy="ddp"))


if __name__ == "__main__":
    main(sys.argv[1])
