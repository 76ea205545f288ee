"""A GRPO-like LightningModule (policy gradient + ``KLPenaltyLoss`` + optional ``EntropyBonus``, both with a
controller and ``global_batch=True``) on 2 DDP processes (CPU, gloo), or on one process over the same global
batches.

``python tests/_ddp_exact_worker.py OUT_DIR BONUS`` (BONUS ``1`` or ``0``) runs ``Trainer(devices=2,
strategy="ddp")`` (Lightning chooses a free port and re-launches this script for rank 1); each rank writes
``OUT_DIR/rank{r}.json``: every metric its logger received per step (``train/kl`` and ``train/entropy``
from ``self.log(name, metric)``, and ``kl/value``, ``entropy/value`` and the coefficients from
``KLLossCallback``) and the policy's parameters after the fit. :func:`fit` with ``devices=1`` is the
one-process run on the concatenated global batches that ``tests/test_ddp_exact_trainer.py`` compares with.

Rank 0 holds rows ``[0, 3)`` of every global batch and rank 1 rows ``[3, 6)``; at step 0 rank 1 holds no
valid token, at step 2 rank 0 holds none. The padding holds NaN noise.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from torch import Tensor, nn

import lightning_kl as lk
from _ddp import write_rank_record
from _trainers import make_quiet_trainer

WORLD, ROWS, T, V, STEPS = 2, 6, 5, 6, 4
LENGTHS = ((5, 3, 2, 0, 0, 0), (2, 0, 4, 5, 5, 1), (0, 0, 0, 3, 4, 2), (5, 4, 3, 1, 0, 2))


def initial_parameters() -> tuple[Tensor, Tensor]:
    """The policy's starting logits and the reference's, ``[T, V]`` float64."""
    g = torch.Generator().manual_seed(5)
    theta = torch.randn(T, V, generator=g, dtype=torch.float64)
    return theta, theta + 0.3 * torch.randn(T, V, generator=g, dtype=torch.float64)


def rollouts() -> list[dict[str, Tensor]]:
    """``STEPS`` global batches of ``ROWS`` responses sampled from the starting policy (float64), the same on
    every process."""
    g = torch.Generator().manual_seed(2026)
    theta, _ = initial_parameters()
    out = []
    for lengths in LENGTHS:
        mask = torch.arange(T).expand(ROWS, T) < torch.tensor(lengths)[:, None]
        noise = 0.5 * torch.randn(ROWS, T, V, generator=g, dtype=torch.float64)
        tokens = torch.multinomial((theta + noise).softmax(-1).reshape(-1, V), 1, generator=g).reshape(ROWS, T)
        out.append({
            "noise": torch.where(mask[..., None], noise, float("nan")),
            "ref_noise": noise,
            "tokens": tokens,
            "advantages": torch.randn(ROWS, generator=g, dtype=torch.float64),
            "mask": mask,
        })
    return out


def shard(batch: dict[str, Tensor], rank: int, world: int) -> dict[str, Tensor]:
    n = ROWS // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


class Recorder(Logger):
    """Keeps every metric dict the Trainer logs, on every rank (Lightning's own loggers write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.steps.append({k: float(v) for k, v in metrics.items()})


class GRPOLike(pl.LightningModule):
    def __init__(self, bonus: bool) -> None:
        super().__init__()
        theta, ref_theta = initial_parameters()
        self.theta = nn.Parameter(theta)
        self.register_buffer("ref_theta", ref_theta)
        self.kl = lk.KLPenaltyLoss("k3+", coef=lk.TargetKLController(0.05, 0.3, step_size=0.5), global_batch=True)
        self.bonus = None
        if bonus:
            ctl = lk.TargetEntropyController(1.6, init_coef=0.2, step_size=0.5)
            self.bonus = lk.EntropyBonus(coef=ctl, global_batch=True)

    def train_dataloader(self) -> Any:
        data = [shard(b, self.global_rank, self.trainer.world_size) for b in rollouts()]
        return torch.utils.data.DataLoader(data, batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        m = batch["mask"]
        z = torch.where(m[..., None], self.theta + batch["noise"], 0.0)
        logp = z.log_softmax(-1).gather(-1, batch["tokens"][..., None]).squeeze(-1)
        ref = (self.ref_theta + batch["ref_noise"]).log_softmax(-1).gather(-1, batch["tokens"][..., None]).squeeze(-1)
        # the policy gradient term divided by the global batch's token count (known here), times W for DDP's mean
        n_global = int(rollouts()[batch_idx]["mask"].sum())
        pg = -torch.where(m, batch["advantages"][:, None] * logp, 0.0).sum() / max(n_global, 1) * self.trainer.world_size
        loss = pg + self.kl(logp, ref, m)
        self.log("train/kl", self.kl.metric)
        if self.bonus is not None:
            loss = loss + self.bonus(z, m)
            self.log("train/entropy", self.bonus.metric)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit(out_dir: str, bonus: bool, devices: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, logger = GRPOLike(bonus), Recorder()
    extra = {"strategy": "ddp"} if devices > 1 else {}
    trainer = make_quiet_trainer(
        out_dir, devices=devices, max_steps=STEPS, logger=logger, log_every_n_steps=1,
        use_distributed_sampler=False, callbacks=[lk.KLLossCallback()], **extra,
    )
    trainer.fit(model)
    return {"steps": logger.steps, "theta": model.theta.detach().tolist(), "rank": trainer.global_rank,
            "world_size": trainer.world_size}


if __name__ == "__main__":
    write_rank_record(sys.argv[1], fit(sys.argv[1], sys.argv[2] == "1", devices=WORLD))
