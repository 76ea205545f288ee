"""2 DDP processes (CPU, gloo) train a loss with a ``TargetKLController`` on unequal data.

``python tests/_kl_control_worker.py OUT_DIR``: ``Trainer(devices=2, strategy="ddp",
accumulate_grad_batches=2)``; rank 1 holds fewer valid tokens than rank 0 and a fully padded row.
Each rank writes ``OUT_DIR/rank{r}.json``: the coefficient every optimizer step used (read in the
step's first micro-batch), this rank's KL sums per step (float64, from the formula) and its tokens.
``tests/test_kl_control.py`` checks that the ranks agree and follow the rule from the global KL.
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

STEPS, ACCUM, T = 4, 2, 5
INIT, TARGET, STEP_SIZE = 0.3, 0.04, 0.6
# rows' valid tokens per micro-batch: rank 0 holds 2x more than rank 1, and one empty row
LENGTHS = {0: ((5, 5, 4), (5, 3, 5)), 1: ((2, 0), (1,))}


def micro_batch(rank: int, step: int, j: int) -> dict[str, Tensor]:
    lengths = LENGTHS[rank][j]
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + j)
    mask = torch.arange(T).expand(len(lengths), T) < torch.tensor(lengths)[:, None]
    logprob = -torch.rand(len(lengths), T, generator=g) * 3
    # rank 1 drifted further from the reference: its local KL differs from the global one
    ref = (logprob - (0.2 + 0.4 * rank) * torch.randn(len(lengths), T, generator=g)).clamp(max=0.0)
    return {"logprob": logprob, "ref": torch.where(mask, ref, float("nan")), "mask": mask}


class Probe(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(T))
        self.kl = lk.KLPenaltyLoss("k3+", coef=lk.TargetKLController(TARGET, INIT, STEP_SIZE), agg="token-mean")
        self.record: dict[str, Any] = {"coefs": [], "stats": [], "tokens": 0}

    def train_dataloader(self) -> Any:
        data = []
        for s in range(STEPS):
            step = [micro_batch(self.global_rank, s, j) for j in range(ACCUM)]
            data += [{**b, **lk.step_totals([m["mask"] for m in step])} for b in step]
        return torch.utils.data.DataLoader(data, batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logprob = (batch["logprob"] + self.shift).clamp(max=0.0)  # log-probs stay <= 0
        mask = batch["mask"]
        if batch_idx % ACCUM == 0:
            self.record["coefs"].append(self.kl.coef)
            self.record["stats"].append([0.0, 0.0])
        r = batch["ref"].double() - logprob.detach().double()
        k3 = torch.where(mask, torch.expm1(r) - r, 0.0)
        self.record["stats"][-1][0] += float(k3.sum())
        self.record["stats"][-1][1] += float(mask.sum())
        self.record["tokens"] += int(mask.sum())
        pull = -(logprob * mask).sum() / mask.sum().clamp(min=1)
        return 0.5 * pull + self.kl(logprob, batch["ref"], mask, num_tokens=batch["num_tokens"], num_seqs=batch["num_seqs"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    model = Probe()
    trainer = make_quiet_trainer(
        out_dir, devices=2, strategy="ddp", max_steps=STEPS, accumulate_grad_batches=ACCUM, use_distributed_sampler=False
    )
    trainer.fit(model)
    record = {**model.record, "final": model.kl.coef, "rank": trainer.global_rank, "world_size": trainer.world_size}
    write_rank_record(out_dir, record)


if __name__ == "__main__":
    main(sys.argv[1])
