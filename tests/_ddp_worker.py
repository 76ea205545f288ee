"""One small Lightning training run, either as 2 DDP processes (CPU, gloo) or as 1 process.

``python tests/_ddp_worker.py OUT_DIR`` runs ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``
(Lightning re-launches this script for rank 1) and each rank writes ``OUT_DIR/rank{r}.json``.
``tests/test_distributed.py`` runs it in a subprocess with a timeout, runs :func:`fit` in its own
process with ``devices=1`` over the same global batches, and compares the records.

The data is fixed and known: global batch ``g`` has ``GLOBAL_B`` sequences; rank ``r`` of ``W``
holds rows ``[r * GLOBAL_B / W, (r + 1) * GLOBAL_B / W)``. The ranks hold different numbers of
valid tokens and of non-empty sequences (a fully padded row sits on rank 1), and the padding holds
NaN and inf, so that a wrong reduction or a leak of the padding shows up.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

import lightning_kl as lk
from lightning_kl.functional import AGG_MODES
from _trainers import make_quiet_trainer
from _ddp import write_rank_record

WORLD = 2
GLOBAL_B = 6  # sequences per global batch
T = 5  # response length
STEPS = 4
# valid-token counts per row; rank 0 holds rows 0-2 and rank 1 rows 3-5 with 2 processes
UNEQUAL_LENGTHS = (5, 3, 1, 0, 4, 2)  # rank 0: 9 tokens, 3 sequences; rank 1: 6 tokens, 2 sequences
EQUAL_LENGTHS = (5, 3, 1, 2, 2, 5)  # rank 0 and rank 1: 9 tokens, 3 non-empty sequences each
GRAD_ESTIMATOR = "k3"
GRAD_COEF = 0.5
# the k1 KL of each step's global batch is near these, so that some updates fall inside the clip
STEP_KL = (0.4, 0.55, 0.8, 0.35)
CONTROLLER = {"init_kl_coef": 0.2, "target_kl": 0.6, "horizon": 40}


def _mask(lengths: tuple[int, ...]) -> Tensor:
    return torch.arange(T).expand(len(lengths), T) < torch.tensor(lengths).unsqueeze(-1)


def _junk_padding(x: Tensor, mask: Tensor, junk: float) -> Tensor:
    return torch.where(mask, x, torch.full_like(x, junk))


def rollouts() -> list[dict[str, Tensor]]:
    """``STEPS`` global rollout batches (float64), with a KL that varies around the target."""
    g = torch.Generator().manual_seed(1234)
    mask = _mask(UNEQUAL_LENGTHS)
    out = []
    for step in range(STEPS):
        logprobs = -torch.rand(GLOBAL_B, T, generator=g, dtype=torch.float64) * 3
        # per-sequence drift: sequence means of d scatter around the target KL of the controller
        d = STEP_KL[step] + 0.4 * (torch.rand(GLOBAL_B, 1, generator=g, dtype=torch.float64) - 0.5)
        d = d + 0.2 * torch.randn(GLOBAL_B, T, generator=g, dtype=torch.float64)
        d[GLOBAL_B // 2 :] += 0.4  # the second half (rank 1's shard) drifted further
        out.append(
            {
                "scores": torch.randn(GLOBAL_B, T, generator=g, dtype=torch.float64),
                "logprobs": _junk_padding(logprobs, mask, float("nan")),
                "ref_logprobs": _junk_padding(logprobs - d, mask, float("-inf")),
                "mask": mask.clone(),
            }
        )
    return out


def grad_data() -> dict[str, dict[str, Tensor]]:
    """Fixed global ``[GLOBAL_B, T]`` logprob / ref_logprob / mask sets for the gradient checks."""
    g = torch.Generator().manual_seed(99)
    out = {}
    for name, lengths in (("unequal", UNEQUAL_LENGTHS), ("equal", EQUAL_LENGTHS)):
        mask = _mask(lengths)
        logprob = -torch.rand(GLOBAL_B, T, generator=g, dtype=torch.float64) * 4
        ref = -torch.rand(GLOBAL_B, T, generator=g, dtype=torch.float64) * 4
        out[name] = {"logprob": logprob, "ref_logprob": _junk_padding(ref, mask, float("nan")), "mask": mask}
    return out


def grad_configs() -> list[tuple[str, str, bool]]:
    """(data set, aggregation mode, global_batch) for every gradient the run records."""
    configs = [("unequal", mode, flag) for mode in AGG_MODES for flag in (False, True)]
    configs += [("equal", mode, False) for mode in AGG_MODES]
    return configs


def config_key(data: str, mode: str, flag: bool) -> str:
    return f"{data}|{mode}|{'global' if flag else 'local'}"


def shard(batch: dict[str, Tensor], rank: int, world: int) -> dict[str, Tensor]:
    b = GLOBAL_B // world
    return {k: v[rank * b : (rank + 1) * b].clone() for k, v in batch.items()}


class DDPProbe(pl.LightningModule):
    """Records, on its rank, what the tests compare: the coefficient after every step, the rewards,
    the synced :class:`~lightning_kl.KLMetric`, and DDP-averaged gradients of the KL loss modes."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_sets = grad_data()
        self.configs = grad_configs()
        # one parameter (the policy's logprobs of the global batch) per configuration, so that one
        # backward through DDP averages the gradients of every configuration at once
        self.logprobs = nn.ParameterList(
            [nn.Parameter(self.grad_sets[data]["logprob"].clone()) for data, _, _ in self.configs]
        )
        self.losses = nn.ModuleList(
            [lk.KLPenaltyLoss(GRAD_ESTIMATOR, coef=GRAD_COEF, agg=mode, global_batch=flag) for _, mode, flag in self.configs]
        )
        self.kl_metric = lk.KLMetric()
        self.record: dict[str, Any] = {"coef": [], "rewards": [], "grads": {}, "losses": {}}

    def _rows(self) -> slice:
        b = GLOBAL_B // self.trainer.world_size
        return slice(self.global_rank * b, (self.global_rank + 1) * b)

    def train_dataloader(self) -> Any:
        data = [shard(batch, self.global_rank, self.trainer.world_size) for batch in rollouts()]
        return torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.record["rewards"].append(batch["rewards"].tolist())
        kl = lk.kl_penalty(batch["logprobs"], batch["ref_logprobs"], "k1", mask=batch["mask"])
        self.kl_metric.update(kl, batch["mask"])
        rows = self._rows()
        total = torch.zeros((), dtype=torch.float64)
        for config, param, loss_fn in zip(self.configs, self.logprobs, self.losses):
            s = self.grad_sets[config[0]]
            loss = loss_fn(param[rows], s["ref_logprob"][rows], s["mask"][rows])
            if batch_idx == 0:
                self.record["losses"][config_key(*config)] = loss.item()
            total = total + loss
        return total

    def on_after_backward(self) -> None:
        # DDP has averaged the gradients over the processes when backward returns
        if self.global_step == 0:
            for config, param in zip(self.configs, self.logprobs):
                self.record["grads"][config_key(*config)] = param.grad.tolist()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        (callback,) = [c for c in self.trainer.callbacks if isinstance(c, lk.KLRewardCallback)]
        self.record["coef"].append(callback.controller.value)

    def on_train_end(self) -> None:
        self.record["metric"] = float(self.kl_metric.compute())  # synced over processes by torchmetrics
        self.record["rank"] = self.global_rank
        self.record["world_size"] = self.trainer.world_size

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # lr 0: every step sees the same parameters, only the rollout batches change
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(root: str, **trainer_kwargs: Any) -> dict[str, Any]:
    """Train :class:`DDPProbe` for ``STEPS`` steps; return this process's record."""
    model = DDPProbe()
    callback = lk.KLRewardCallback("k1", controller=lk.AdaptiveKLController(**CONTROLLER))
    trainer = make_quiet_trainer(
        root, max_steps=STEPS, callbacks=[callback], use_distributed_sampler=False, **trainer_kwargs
    )
    trainer.fit(model)
    return model.record


# gradient accumulation under DDP: each rank accumulates ACCUM micro-batches of uneven sizes and
# token counts (rows of one step's batch of len(ACCUM_LENGTHS) sequences), given its own step totals
ACCUM = 4
ACCUM_LENGTHS = (3, 5, 0, 2, 4, 1, 5, 5, 1, 1, 2, 0, 4, 4, 3, 5, 1)  # row -> valid tokens
ACCUM_ROWS = (
    ((0,), (1, 2, 3), (4, 5), (6, 7, 8, 9)),  # rank 0: 3 + 7 + 5 + 12 = 27 tokens in 9 sequences
    ((10, 11), (12,), (13, 14, 15), (16,)),  # rank 1: 2 + 4 + 12 + 1 = 19 tokens in 6 sequences
)


def accum_data() -> dict[str, Tensor]:
    """The optimizer step's whole batch (float64), NaN in the padding of the reference."""
    g = torch.Generator().manual_seed(5)
    b = len(ACCUM_LENGTHS)
    mask = torch.arange(T).expand(b, T) < torch.tensor(ACCUM_LENGTHS).unsqueeze(-1)
    logprob = -torch.rand(b, T, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(b, T, generator=g, dtype=torch.float64) * 3
    return {"logprob": logprob, "ref_logprob": _junk_padding(ref, mask, float("nan")), "mask": mask}


class AccumProbe(pl.LightningModule):
    """One parameter per aggregation mode (the log-probs of the whole step's batch); each micro-batch
    takes its rows. Records the gradient DDP averaged over the ranks' accumulated ones, and the
    synced metric of the first loss."""

    def __init__(self) -> None:
        super().__init__()
        self.data = accum_data()
        self.logprobs = nn.ParameterList([nn.Parameter(self.data["logprob"].clone()) for _ in AGG_MODES])
        self.losses = nn.ModuleList(
            [lk.KLPenaltyLoss(GRAD_ESTIMATOR, coef=GRAD_COEF, agg=mode, global_batch=True) for mode in AGG_MODES]
        )
        self.record: dict[str, Any] = {"grads": []}

    def train_dataloader(self) -> Any:
        rows = ACCUM_ROWS[self.global_rank] if self.trainer.world_size > 1 else sum(ACCUM_ROWS, ())
        totals = lk.step_totals([self.data["mask"][list(r)] for r in rows])  # this rank's
        return torch.utils.data.DataLoader([{"rows": torch.tensor(r), **totals} for r in rows], batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        rows, total = batch["rows"], torch.zeros((), dtype=torch.float64)
        for param, loss_fn in zip(self.logprobs, self.losses):
            total = total + loss_fn(
                param[rows],
                self.data["ref_logprob"][rows],
                self.data["mask"][rows],
                num_tokens=batch["num_tokens"],
                num_seqs=batch["num_seqs"],
                accumulate_grad_batches=self.trainer.accumulate_grad_batches,
            )
        return total

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.record["grads"].append([p.grad.tolist() for p in self.logprobs])

    def on_train_end(self) -> None:
        self.record["metric"] = float(self.losses[0].metric.compute())  # synced over processes

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit_accumulation(root: str, **trainer_kwargs: Any) -> dict[str, Any]:
    """One optimizer step of :class:`AccumProbe` over ``ACCUM`` micro-batches per rank."""
    model = AccumProbe()
    trainer = make_quiet_trainer(
        root, max_epochs=1, accumulate_grad_batches=ACCUM, use_distributed_sampler=False, **trainer_kwargs
    )
    trainer.fit(model)
    return model.record


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    record = fit(out_dir, devices=WORLD, strategy="ddp")
    # a second fit in the same launch (the process group is reused): one subprocess start in all
    record["accumulation"] = fit_accumulation(out_dir, devices=WORLD, strategy="ddp")
    write_rank_record(out_dir, record)


if __name__ == "__main__":
    main(sys.argv[1])
