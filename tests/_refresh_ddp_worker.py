"""A 2-process run with ``lk.ReferenceRefresh`` (CPU, gloo): DDP, or FSDP2 through ``ModelParallelStrategy``.

``python tests/_refresh_ddp_worker.py OUT_DIR`` runs both, one after the other in one launch; each rank
writes ``OUT_DIR/rank{r}.json`` with, for each, its refresh steps and its reference and policy tensors (full tensors: the FSDP2 shards are
gathered *after* training, for the record only). The ranks see different data, and they log
different KLs (rank 0: 2.0, 1.0, 2.0 at steps 1, 2, 3; rank 1: 0.0), whose mean over the ranks
(1.0, 0.5, 1.0) crosses the threshold 0.5 at steps 1 and 3 only: a decision taken on one rank's view
would refresh rank 0 only, one on the ranks' sum (1.0 > 0.5) or with ``>=`` at step 2 too (the mean
there is exactly the threshold).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

import lightning_kl as lk
from _ddp import write_rank_record
from _trainers import make_quiet_trainer
from test_refresh import PolicyAndRef, Recorder, tokens_of_step

WORLD, STEPS = 2, 3


class RankData(PolicyAndRef):
    def setup(self, stage: str) -> None:
        self.kl_log = [2.0, 1.0, 2.0] if self.global_rank == 0 else [0.0, 0.0, 0.0]

    def train_dataloader(self) -> Any:
        data = [tokens_of_step(1000 * self.global_rank + i) for i in range(self.steps)]
        return torch.utils.data.DataLoader(data, batch_size=None)


class ShardedRankData(RankData):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for model in (self.policy, self.ref):  # both sharded alike; the reference is frozen
            fully_shard(model, mesh=mesh)


def _full(t: torch.Tensor) -> list[Any]:
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).tolist()


def fit(out_dir: str, mode: str) -> dict[str, Any]:
    """One run under ``mode`` (``ddp`` or ``fsdp2``); this rank's record."""
    refresh = lk.ReferenceRefresh(alpha=0.5, kl_threshold=0.5, kl_window=1, kl_metric="my/kl")
    recorder = Recorder()
    if mode == "ddp":
        module, strategy = RankData(steps=STEPS), "ddp"
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        module, strategy = ShardedRankData(steps=STEPS), ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    trainer = make_quiet_trainer(
        out_dir, max_epochs=1, devices=WORLD, strategy=strategy, callbacks=[refresh, recorder], use_distributed_sampler=False
    )
    initial = {k: torch.tensor(_full(v), dtype=torch.float64) for k, v in RankData(steps=STEPS).ref.state_dict().items()}
    trainer.fit(module)
    # float64 maths of the formula from the policy after each refresh's optimizer step
    want = initial
    for row in recorder.rows:
        if row["last_step"] == row["step"]:
            want = {k: 0.5 * torch.tensor(_full(row["policy"][k]), dtype=torch.float64) + 0.5 * v for k, v in want.items()}
    ref = {k: torch.tensor(_full(v), dtype=torch.float64) for k, v in module.ref.state_dict().items()}
    record = {
        "ema_error": max(float((ref[k] - want[k]).abs().max()) for k in want if k != "calls"),
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "last_steps": [r["last_step"] for r in recorder.rows],
        "ref": {k: _full(v) for k, v in module.ref.state_dict().items()},
        "policy": {k: _full(v) for k, v in module.policy.state_dict().items()},
        "sharded": [type(p).__name__ for p in module.ref.parameters()],
    }
    return record


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    # both runs in one launch (the second reuses the process group): one subprocess start in all
    records = {mode: fit(out_dir, mode) for mode in ("ddp", "fsdp2")}
    rank = records["ddp"]["rank"]
    write_rank_record(out_dir, {"rank": rank, "world_size": WORLD, **records})


if __name__ == "__main__":
    main(sys.argv[1])
