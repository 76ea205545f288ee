"""Hostile inputs on one of 2 gloo processes: each case must end alike on both, promptly, or give the
one-process answer on the global batch.

``python tests/_hostile_2_worker.py OUT_DIR`` spawns 2 processes (gloo, a file store in OUT_DIR: no port,
a process group timeout of :data:`PG_TIMEOUT_S`); each runs the cases of :func:`cases` in order and writes
``OUT_DIR/rank{r}.json``: per case, what it returned or the error it raised (type and message), the
warnings it recorded, and the seconds it took. ``tests/test_hostile_2.py`` reads the records.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import lightning_kl as lk
from _ddp import finish_worker

WORLD = 2
PG_TIMEOUT_S = 60  # a process left waiting in a collective would wait this long, then fail
NAN_AT = (1, 0, 1)  # (rank, row, column) of the NaN log-prob
REJECT = dict(rejection="token_k1", rejection_threshold="0.5_2.0")  # keeps 0.5 <= ratio <= 2: drops a NaN


def inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's trainer log-probs, engine log-probs and mask (float64; log-ratios within +-0.4)."""
    lp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.2, -0.1]], dtype=torch.float64) - 0.5 * rank
    ro = lp + torch.tensor([[0.2, -0.1, 0.0], [0.3, 0.0, -0.4]], dtype=torch.float64) * (1 + rank)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return lp, ro, mask


def with_nan(rank: int, lp: torch.Tensor) -> torch.Tensor:
    lp = lp.clone()
    if rank == NAN_AT[0]:
        lp[NAN_AT[1], NAN_AT[2]] = float("nan")
    return lp


#: entropies for ``high_entropy_mask``: rank 1's are float64, and its 0.5 + 1e-10 rounds to rank 0's 0.5 in
#: float32. At top=0.75 the threshold is exactly that value (rank 1 of 0..4 in 5 values), so rank 0's 0.5 is
#: below it in float64 (the one-process answer on the concatenation) and equal to it in float32.
ENTROPY = {0: ([0.5, 3.0], torch.float32), 1: ([0.5 + 1e-10, 2.0, 1.0], torch.float64)}


def cases(rank: int) -> dict[str, Callable[[], Any]]:
    lp, ro, mask = inputs(rank)
    fix = lk.RolloutCorrection("token", upper=2.0, batch_normalize=True, **REJECT)
    fix_no_rejection = lk.RolloutCorrection("token", upper=2.0, batch_normalize=True)
    kl = lk.KLPenaltyLoss("k3", agg="token-mean", global_batch=True)
    seq = lk.KLPenaltyLoss("k3", level="sequence", agg="token-mean", global_batch=True)
    callback = lk.KLRewardCallback("k3", process_group=dist.group.WORLD)

    class Module:  # what the hook uses of a LightningModule
        device = torch.device("cpu")
        logged: dict[str, float] = {}

        def log(self, name: str, value: Any, **_: Any) -> None:
            self.logged[name] = float(value)

    class Trainer:
        strategy = None

    def reward(mask_value: Any) -> float:
        batch = {"scores": torch.ones(2, dtype=lp.dtype), "logprobs": lp, "ref_logprobs": ro, "mask": mask_value}
        module = Module()
        callback.on_train_batch_start(Trainer(), module, batch, 0)  # type: ignore[arg-type]
        return module.logged["kl/value"]

    def corrected(module: lk.RolloutCorrection) -> dict[str, Any]:
        out = module(with_nan(rank, lp), ro, mask)
        return {"weights": out.weights.tolist(), "factor": float(out.metrics["rollout_is_batch_norm_factor"]),
                "kept": out.mask.tolist()}  # fmt: skip

    def strict(call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # pytest -W error, or a user's filter
                return call()

        return run

    old = lp + 0.1
    old_grad = old.clone().requires_grad_(rank == 1)  # on rank 1 only
    varying = mask.clone() if rank == 0 else torch.ones_like(mask)  # lengths 2 and 3 on rank 0; 3 and 3 on rank 1
    values, dtype = ENTROPY[rank]

    return {
        # A1: one NaN log-prob on rank 1
        "nan_dropped_by_rejection": lambda: corrected(fix),
        "nan_kept": lambda: corrected(fix_no_rejection),
        "clean_after": lambda: fix_no_rejection(lp, ro, mask).weights.tolist(),
        # A3: the step's total on rank 0 only
        "totals_on_rank0_only": lambda: kl(lp, ro, mask, num_tokens=9 if rank == 0 else None, accumulate_grad_batches=2).item(),
        "totals_on_every_rank": lambda: kl(lp, ro, mask, num_tokens=9, accumulate_grad_batches=2).item(),
        # A5: no mask on rank 1
        "reward_mask_none_on_rank1": lambda: reward(None if rank == 1 else mask),
        "reward_good_after": lambda: reward(mask),
        # A6: a warning on one process only, as an error
        "warn_old_logprob_grad_on_rank1": strict(lambda: kl(lp, ro, mask, old_logprob=old_grad).item()),
        "warn_lengths_vary_on_rank0": strict(lambda: seq(lp, ro, varying).item()),
        "warn_recorded": lambda: kl(lp, ro, mask, old_logprob=old_grad).item(),
        "kl_good_after": strict(lambda: kl(lp, ro, mask).item()),
        # A7: float64 entropies on rank 1, float32 on rank 0
        "entropy_mixed_dtypes": lambda: lk.high_entropy_mask(torch.tensor(values, dtype=dtype), top=0.75).tolist(),
    }


def _main(rank: int, out: str) -> None:
    os.environ["RANK"] = str(rank)  # as torchrun and Lightning set it: rank-zero warnings read it
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )  # fmt: skip
    torch.set_num_threads(1)
    record: dict[str, Any] = {"rank": rank, "world_size": dist.get_world_size(), "cases": {}}
    try:
        for name, call in cases(rank).items():
            start = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    result: dict[str, Any] = {"value": call()}
                except Exception as err:  # noqa: BLE001 - the record says which
                    result = {"error": type(err).__name__, "message": str(err)}
            result["warnings"] = [str(w.message) for w in caught]
            result["seconds"] = time.monotonic() - start
            record["cases"][name] = result
    except BaseException:
        record["failure"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    finish_worker()


if __name__ == "__main__":
    torch.multiprocessing.spawn(_main, args=(sys.argv[1],), nprocs=WORLD, join=True)
