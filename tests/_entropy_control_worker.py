"""2 DDP processes (CPU, gloo) train with an ``EntropyBonus`` whose coefficient is a ``TargetEntropyController``.

``python tests/_entropy_control_worker.py OUT_DIR``: ``Trainer(devices=2, strategy="ddp",
accumulate_grad_batches=2)``; rank 1's logits are sharper (lower entropy) than rank 0's and it holds
fewer valid tokens. Each rank writes ``OUT_DIR/rank{r}.json``: the coefficient each optimizer step used,
its own float64 entropy sums per step, the final coefficient. ``tests/test_entropy.py`` checks that the
ranks agree and follow the rule from the global token-mean entropy.
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

STEPS, ACCUM, T, V = 4, 2, 5, 7
INIT, TARGET, STEP_SIZE = 0.3, 1.2, 0.5
LENGTHS = {0: (5, 4, 5), 1: (2, 0)}


def micro_batch(rank: int, step: int, j: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + j)
    lengths = torch.tensor(LENGTHS[rank])
    scale = 1.0 + 3.0 * rank  # rank 1: sharper logits, lower entropy
    return {"noise": scale * torch.randn(len(lengths), T, V, generator=g),
            "mask": torch.arange(T).expand(len(lengths), T) < lengths[:, None]}


def entropy64(z: Tensor) -> Tensor:
    logp = z.double().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


class Probe(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(T, V))
        self.entropy = lk.EntropyBonus(coef=lk.TargetEntropyController(TARGET, INIT, step_size=STEP_SIZE))
        self.record: dict[str, Any] = {"coefs": [], "stats": []}

    def train_dataloader(self) -> Any:
        data = [micro_batch(self.global_rank, s, j) for s in range(STEPS) for j in range(ACCUM)]
        return torch.utils.data.DataLoader(data, batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        z, m = self.logits + batch["noise"], batch["mask"]
        if batch_idx % ACCUM == 0:
            self.record["coefs"].append(self.entropy.coef)
            self.record["stats"].append([0.0, 0.0])
        self.record["stats"][-1][0] += float(entropy64(z.detach())[m].sum())
        self.record["stats"][-1][1] += float(m.sum())
        sharpen = -(z.log_softmax(-1)[..., 0] * m).sum() / m.sum().clamp(min=1)
        return sharpen + self.entropy(z, m)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    model = Probe()
    trainer = make_quiet_trainer(
        out_dir, devices=2, strategy="ddp", max_steps=STEPS, accumulate_grad_batches=ACCUM, use_distributed_sampler=False
    )
    trainer.fit(model)
    record = {**model.record, "final": model.entropy.coef, "rank": trainer.global_rank, "world_size": trainer.world_size}
    write_rank_record(out_dir, record)


if __name__ == "__main__":
    main(sys.argv[1])
