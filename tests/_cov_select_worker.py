"""``covariance_mask`` (``lightning_kl.cov_select``) on W gloo processes (W = 2 or 3), for ``tests/test_cov_select.py``.

``python tests/_cov_select_worker.py OUT_DIR W`` spawns W processes (a file store in OUT_DIR: no port;
a process group timeout of :data:`PG_TIMEOUT_S`); rank ``r`` holds :func:`rank_data` ``(W, r, kind)``
(its own number of rows and of valid tokens; in ``empty_rank`` rank 1 holds none, in ``empty_all`` no
rank does, in ``ties`` covariances tie across the ranks' boundary) and writes ``OUT_DIR/rank{r}.json``
with its mask for every case of :data:`CASES`. Rank 0 seeds torch's global generator with
:data:`SEED`, the others with other seeds: Clip-Cov's permutation is rank 0's. Then the last rank
passes advantages of a wrong shape: every rank must raise, and a good call after it must still pair up.
Last, Clip-Cov over an explicit sub-group (:data:`GROUPS`): the group given wins over the world.
"""

from __future__ import annotations

import datetime
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

from lightning_kl.cov_select import covariance_mask
from _ddp import write_rank_record

T = 10
SEED = 1234
PG_TIMEOUT_S = 60
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "unequal, kl_cov 0.01": ("unequal", {"loss_mode": "kl_cov", "fraction": 0.01}),
    "unequal, kl_cov 0.3": ("unequal", {"loss_mode": "kl_cov", "fraction": 0.3}),
    "unequal, clip_cov 0.05": ("unequal", {"loss_mode": "clip_cov", "fraction": 0.05, "window": (0.5, 5.0)}),
    "unequal, clip_cov 1": ("unequal", {"loss_mode": "clip_cov", "fraction": 1.0, "window": (0.5, 5.0)}),
    "empty rank, kl_cov": ("empty_rank", {"loss_mode": "kl_cov", "fraction": 0.05}),
    "empty rank, clip_cov": ("empty_rank", {"loss_mode": "clip_cov", "fraction": 0.1, "window": (0.5, 5.0)}),
    "empty all, kl_cov": ("empty_all", {"loss_mode": "kl_cov", "fraction": 0.5}),
    "ties, kl_cov": ("ties", {"loss_mode": "kl_cov", "fraction": 0.5}),
}


#: the explicit sub-groups of the last case, by world size
GROUPS = {2: [[1], [0]], 3: [[1, 2], [0]]}
EXPLICIT = {"loss_mode": "clip_cov", "fraction": 0.05, "window": (0.5, 5.0)}


def seed(rank: int) -> int:
    """Each rank's seed of torch's global generator: only the group's first process's draws count."""
    return SEED if rank == 0 else SEED + 1 + rank


def rank_data(world: int, rank: int, kind: str) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s ``lp``, ``old``, ``adv`` ``[2 + 2 rank, T]`` and ``mask`` (padding holds NaN)."""
    g = torch.Generator().manual_seed(100 * world + rank)
    rows = 2 + 2 * rank
    lp = -torch.rand(rows, T, generator=g) * 6
    old = (lp + 0.3 * torch.randn(rows, T, generator=g)).clamp(max=0.0)
    adv = (2 * torch.randn(rows, 1, generator=g)).expand(rows, T) + 0.5 * torch.randn(rows, T, generator=g)
    lengths = torch.randint(1, T + 1, (rows,), generator=g)
    if kind == "empty_all" or (kind == "empty_rank" and rank == 1):
        lengths = torch.zeros(rows, dtype=torch.int64)
    if kind == "ties":  # dyadic: exact means; c = 1 on every token, all tied
        lp = torch.where(torch.arange(T) % 2 == 0, -1.0, -3.0).expand(rows, T).clone()
        adv = torch.where(torch.arange(T) % 2 == 0, 1.0, -1.0).expand(rows, T).clone()
        lengths = torch.full((rows,), T)
    mask = torch.arange(T) < lengths[:, None]
    nan = torch.tensor(float("nan"))
    return {"lp": torch.where(mask, lp, nan), "old": old, "adv": adv.contiguous(), "mask": mask}


def select(d: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> torch.Tensor:
    extra = {"old_logprob": d["old"]} if kwargs["loss_mode"] == "clip_cov" else {}
    return covariance_mask(d["lp"], d["adv"], d["mask"], **kwargs, **extra)


def _main(rank: int, out: str, world: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )  # fmt: skip
    torch.set_num_threads(1)
    record: dict[str, Any] = {"rank": rank, "world_size": world, "masks": {}}
    try:
        for case, (kind, kwargs) in CASES.items():
            torch.manual_seed(seed(rank))
            record["masks"][case] = select(rank_data(world, rank, kind), kwargs).tolist()
        # an explicit group wins over the world; for W = 3 the group {1, 2} draws on global rank 1
        groups = [dist.new_group(g) for g in GROUPS[world]]  # every rank makes every group, in the same order
        mine = next(i for i, g in enumerate(GROUPS[world]) if rank in g)
        torch.manual_seed(seed(rank))
        record["explicit"] = select(rank_data(world, rank, "unequal"), dict(EXPLICIT, process_group=groups[mine])).tolist()
        d = rank_data(world, rank, "unequal")
        bad = d["adv"][:, :-1] if rank == world - 1 else d["adv"]
        try:
            covariance_mask(d["lp"], bad, d["mask"], loss_mode="kl_cov")
            record["raised"] = None
        except ValueError as err:
            record["raised"] = str(err)
        after = select(d, {"loss_mode": "kl_cov", "fraction": 0.01})
        record["after"] = record["masks"]["unequal, kl_cov 0.01"] == after.tolist()
    except BaseException:
        record["failure"] = traceback.format_exc()
    write_rank_record(out, record)


if __name__ == "__main__":
    world = int(sys.argv[2])
    torch.multiprocessing.spawn(_main, args=(sys.argv[1], world), nprocs=world, join=True)
