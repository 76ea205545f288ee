"""``lk.high_entropy_mask`` on W gloo processes (W = 2 or 3): each rank's mask for every case of
:data:`MASK_CASES`, and the same with an explicit sub-group.

``python tests/_entropy_mask_worker.py OUT_DIR W`` spawns W processes (a file store in OUT_DIR: no
port); rank ``r`` holds :func:`rank_data` ``(W, r, kind)`` (its own number of rows and of valid tokens;
in ``empty_rank`` rank 1 holds none, in ``all_empty`` no rank does) and writes ``OUT_DIR/rank{r}.json``
with its masks. ``tests/test_entropy.py`` compares them with one process on the concatenated batch.
With an explicit ``process_group`` (ranks ``{0, 2}`` and ``{1}`` for W = 3, each rank alone for W = 2)
the group given wins over the world: the mask is then the sub-group's concatenation's.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import lightning_kl as lk
from _ddp import write_rank_record

T = 6
MASK_CASES = {
    "unequal, top 0.2": ("unequal", 0.2),
    "unequal, top 1": ("unequal", 1.0),
    "unequal, top 1e-9": ("unequal", 1e-9),
    "ties, top 0.37": ("ties", 0.37),
    "a rank with no valid token": ("empty_rank", 0.2),
    "no valid token anywhere": ("all_empty", 0.5),
}


def rank_data(world: int, rank: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s entropies ``[1 + rank, T]`` and mask (padding holds NaN)."""
    g = torch.Generator().manual_seed(10 * world + rank)
    rows = 1 + rank
    h = torch.rand(rows, T, generator=g) * 3
    if kind == "ties":
        h = (h * 2).round() / 2
    lengths = torch.randint(1, T + 1, (rows,), generator=g)
    if kind == "all_empty" or (kind == "empty_rank" and rank == 1):
        lengths = torch.zeros(rows, dtype=torch.int64)
    mask = torch.arange(T).expand(rows, T) < lengths[:, None]
    return torch.where(mask, h, torch.tensor(float("nan"))), mask


def _main(rank: int, out: str, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    torch.set_num_threads(1)
    masks = {}
    for case, (kind, top) in MASK_CASES.items():
        h, m = rank_data(world, rank, kind)
        masks[case] = lk.high_entropy_mask(h, m, top=top).tolist()
    # an explicit group wins over the world
    members = [[0, 2], [1]] if world == 3 else [[0], [1]]
    groups = [dist.new_group(g) for g in members]  # every rank makes every group, in the same order
    mine = next(i for i, g in enumerate(members) if rank in g)
    parts = [rank_data(world, r, "unequal") for r in members[mine]]
    h, m = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    valid = h[m].double()
    expected = m & (h.double() >= torch.quantile(valid, 1 - 0.3))
    rows = sum(p[0].shape[0] for p in parts[: members[mine].index(rank)])
    got = lk.high_entropy_mask(*rank_data(world, rank, "unequal"), top=0.3, process_group=groups[mine])
    # a mask of the wrong shape on the last rank: every rank raises its error, none waits
    h, m = rank_data(world, rank, "unequal")
    try:
        lk.high_entropy_mask(h, m[:, :-1] if rank == world - 1 else m, top=0.2)
        raised = None
    except ValueError as err:
        raised = str(err)
    record = {"rank": rank, "world_size": world, "masks": masks, "raised": raised,
              "explicit_group": torch.equal(got, expected[rows:rows + got.shape[0]])}
    write_rank_record(out, record)


if __name__ == "__main__":
    world = int(sys.argv[2])
    torch.multiprocessing.spawn(_main, args=(sys.argv[1], world), nprocs=world, join=True)
