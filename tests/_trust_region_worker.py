"""``RolloutCorrection(trust_region=..., batch_normalize=True)`` on W gloo processes (2 or
3), for ``tests/test_trust_region_ddp.py``.

``python tests/_trust_region_worker.py OUT_DIR [W]`` spawns W processes (default 2) (gloo, a file store in OUT_DIR: no
port; a process group timeout of :data:`PG_TIMEOUT_S`); each runs the cases of :func:`cases` in order and
writes ``OUT_DIR/rank{r}.json``: per case, the error it raised (type and message) or the weights, and the
seconds it took.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import lightning_kl as lk
from _ddp import finish_worker

WORLD = 2
PG_TIMEOUT_S = 60


def inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s log-probs, the sampler's, the mask and per-token advantages (unequal lengths)."""
    g = torch.Generator().manual_seed(rank)
    rows = 3 + 2 * rank
    ro = -torch.rand(rows, 7, generator=g, dtype=torch.float64) * 3
    lp = (ro + 0.5 * torch.randn(rows, 7, generator=g, dtype=torch.float64)).clamp(max=0.0)
    mask = torch.arange(7) < torch.randint(1, 8, (rows,), generator=g)[:, None]
    adv = torch.randn(rows, 7, generator=g, dtype=torch.float64)
    return lp, ro, mask, adv


def make() -> lk.RolloutCorrection:
    return lk.RolloutCorrection("token", upper=2.0, batch_normalize=True, trust_region="binary_tv", trust_region_threshold=0.1)


def cases(rank: int) -> dict[str, Callable[[], Any]]:
    fix = make()
    lp, ro, mask, adv = inputs(rank)
    return {
        "good": lambda: fix(lp, ro, mask, advantages=adv).weights.tolist(),
        "no_advantages_on_rank1": lambda: fix(lp, ro, mask, advantages=None if rank == 1 else adv).weights.tolist(),
        "bad_advantages_on_rank0": lambda: fix(lp, ro, mask, advantages=adv[:, :-1] if rank == 0 else adv).weights.tolist(),
        "good_after": lambda: fix(lp, ro, mask, advantages=adv).weights.tolist(),
    }


def _main(rank: int, out: str, world: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )  # fmt: skip
    torch.set_num_threads(1)
    record: dict[str, Any] = {"rank": rank, "world_size": dist.get_world_size(), "cases": {}}
    try:
        for name, call in cases(rank).items():
            start = time.monotonic()
            try:
                result: dict[str, Any] = {"weights": call()}
            except Exception as err:  # noqa: BLE001 - the record says which
                result = {"error": type(err).__name__, "message": str(err)}
            result["seconds"] = time.monotonic() - start
            record["cases"][name] = result
    except BaseException:
        record["failure"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    finish_worker()


if __name__ == "__main__":
    world = int(sys.argv[2]) if len(sys.argv) > 2 else WORLD  # 2 (the default) or 3
    torch.multiprocessing.spawn(_main, args=(sys.argv[1], world), nprocs=world, join=True)
