"""The entropy bonus's gradient and the metrics' per-call values on W gloo processes, without a Trainer.

``python tests/_ddp_exact_worker_plain.py OUT_DIR W`` spawns W processes (a file store in OUT_DIR: no
port). Rank ``r`` holds rows :func:`rank_rows` of every case of :data:`CASES` (the global batch, cut in
W shards of unequal token counts; one case gives a rank no valid token). For each case, ``agg`` mode and
dtype it computes ``EntropyBonus(global_batch=...)``'s gradient of a shared parameter, averaged over the
ranks as DDP averages it, and records it with the per-call values of ``bonus.metric``, ``KLMetric`` and
``MismatchMetric`` (the batch of every process, or with ``dist_sync_on_step=False`` or in ``eval()`` mode
this process's).
It also records the error each rank raised when the last rank alone gives a mask of the wrong shape, with
``global_batch=True`` (met in the counts' all-reduce) and without (met in the metric's).
``tests/test_ddp_exact.py`` compares all of it with one process on the concatenated batch.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import Tensor

import lightning_kl as lk
from lightning_kl.reduce import AGG_MODES
from _ddp import write_rank_record

T, V = 6, 5
#: valid tokens per row of the global batch; rank r of W holds rows rank_rows(case, W, r)
CASES = {
    "12 and 24 tokens": (6, 6, 0, 4, 6, 6, 4, 4),  # W = 2: rank 0 rows 0-2 (12 tokens), rank 1 rows 3-7 (24)
    "a rank with no token": (0, 0, 0, 4, 6, 6, 4, 4),  # W = 2: rank 0 holds none
}
SPLIT = {2: (0, 3, 8), 3: (0, 3, 5, 8)}


def rank_rows(world: int, rank: int) -> slice:
    return slice(SPLIT[world][rank], SPLIT[world][rank + 1])


def global_batch(case: str, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The shared parameter ``[T, V]``, each row's logit noise ``[B, T, V]`` (NaN in the padding), the mask
    ``[B, T]`` and per-token KL values ``[B, T]`` (for KLMetric), the same on every rank."""
    lengths = torch.tensor(CASES[case])
    g = torch.Generator().manual_seed(7)
    theta = torch.randn(T, V, generator=g, dtype=torch.float64)
    noise = 2.0 * torch.randn(len(lengths), T, V, generator=g, dtype=torch.float64)
    mask = torch.arange(T).expand(len(lengths), T) < lengths[:, None]
    noise = torch.where(mask[..., None], noise, float("nan"))  # padding never reaches the gradient
    kl = torch.rand(len(lengths), T, generator=g, dtype=torch.float64) * torch.arange(1, len(lengths) + 1)[:, None]
    return theta.to(dtype), noise.to(dtype), mask, kl


def bonus_grad(theta: Tensor, noise: Tensor, mask: Tensor, agg: str, global_batch: bool) -> tuple[Tensor, Tensor]:
    """The bonus's value and its gradient of ``theta`` on these rows (one process's)."""
    theta = theta.clone().requires_grad_(True)
    bonus = lk.EntropyBonus(coef=0.5, agg=agg, global_batch=global_batch)
    z = torch.where(mask[..., None], theta + noise, 0.0)
    value = bonus(z, mask)
    value.backward()
    return value.detach(), theta.grad


def _main(rank: int, out: str, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    torch.set_num_threads(1)
    rows = rank_rows(world, rank)
    grads: dict[str, list] = {}
    for case in CASES:
        for dtype in (torch.float32, torch.float64):
            theta, noise, mask, _ = global_batch(case, dtype)
            for agg in AGG_MODES:
                for flag in (True, False):
                    _, grad = bonus_grad(theta, noise[rows], mask[rows], agg, flag)
                    dist.all_reduce(grad)  # DDP's average of the ranks' gradients
                    grads[f"{case}|{dtype}|{agg}|{flag}"] = (grad / world).double().tolist()
    # the per-call (per-step) values of the metrics: the batch of every process
    calls: dict[str, list] = {}
    theta, noise, mask, kl = global_batch("a rank with no token", torch.float64)
    m, z = mask[rows], torch.where(mask[rows][..., None], theta + noise[rows], 0.0)
    bonus = lk.EntropyBonus(coef=0.1)
    bonus(z, m)
    calls["bonus.metric"] = [float(bonus.metric._forward_cache), float(bonus.metric.compute())]
    metric, local = lk.KLMetric(), lk.KLMetric(dist_sync_on_step=False)
    calls["KLMetric"] = [float(metric(kl[rows], m)), float(local(kl[rows], m)), float(metric(kl[rows], m)),
                         float(metric.compute())]
    if rank == world - 1:  # in eval() mode a call is this process's and no collective: called on one rank only
        calls["eval"] = [float(lk.KLMetric().eval()(kl[rows], m))]
    loss = lk.KLPenaltyLoss("k1", coef=1.0)
    loss(-kl[rows], torch.zeros_like(kl[rows]), m)
    calls["KLPenaltyLoss.metric"] = [float(loss.metric._forward_cache)]
    mm = lk.MismatchMetric()
    lp, ro = -kl[rows], -kl[rows].flip(-1)
    calls["MismatchMetric"] = [{k: float(v) for k, v in mm(lp, ro, m).items()},
                               {k: float(v) for k, v in mm.compute().items()}]
    # one rank's mask of the wrong shape under global_batch: every rank raises its error, none waits
    try:
        lk.EntropyBonus(coef=0.1, global_batch=True)(z, m[:, :-1] if rank == world - 1 else m)
        raised = None
    except ValueError as err:
        raised = str(err)
    # without global_batch (no count to sum) the metric's per-step all-reduce is met by the refusing rank
    try:
        lk.EntropyBonus(coef=0.1)(z, m[:, :-1] if rank == world - 1 else m)
        raised_local = None
    except ValueError as err:
        raised_local = str(err)
    write_rank_record(out, {"rank": rank, "world_size": world, "grads": grads, "calls": calls, "raised": raised,
                            "raised_local": raised_local})


if __name__ == "__main__":
    world = int(sys.argv[2])
    torch.multiprocessing.spawn(_main, args=(sys.argv[1], world), nprocs=world, join=True)
