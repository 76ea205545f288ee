"""``RolloutCorrection(batch_normalize=True)`` and ``KLPenaltyLoss(global_batch=True)`` on 2 gloo processes
when one process's inputs are refused.

``python tests/_correction_ddp_worker.py OUT_DIR`` spawns 2 processes (gloo, a file store in OUT_DIR, a
process group timeout of :data:`PG_TIMEOUT_S`); each runs the cases of :func:`cases` in order and
writes ``OUT_DIR/rank{r}.json``: per case, the error it raised (type and message) or the weights,
and the seconds it took. ``tests/test_correction_ddp.py`` reads the records.
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
import lightning_kl.ground.checks as ground_checks
from _ddp import finish_worker

WORLD = 2
PG_TIMEOUT_S = 60  # a process left waiting in the all-reduce would wait this long, then fail


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.2, -0.1]], dtype=torch.float64) - rank
    ro = lp + torch.tensor([[0.2, -0.1, 0.0], [0.3, 0.0, -0.4]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return lp, ro, mask


def cases(rank: int) -> dict[str, Callable[[], Any]]:
    fix = lk.RolloutCorrection("token", upper=2.0, batch_normalize=True)
    kl = lk.KLPenaltyLoss("k3", agg="token-mean", global_batch=True)
    kl_sum = lk.KLPenaltyLoss("k3", agg="token-sum", global_batch=True)
    callback = lk.KLRewardCallback("k3", process_group=dist.group.WORLD)  # an explicit group: no strategy needed

    class Module:  # what the hook uses of a LightningModule
        device = torch.device("cpu")
        logged: dict[str, float] = {}

        def log(self, name: str, value: Any, **_: Any) -> None:
            self.logged[name] = float(value)

    class Trainer:
        strategy = None

    def reward(lp: torch.Tensor, ro: torch.Tensor, mask: torch.Tensor, drop: Any = None) -> float:
        batch = {"scores": torch.ones(lp.shape[0], dtype=lp.dtype), "logprobs": lp, "ref_logprobs": ro, "mask": mask}
        batch.pop(drop, None)
        module = Module()
        callback.on_train_batch_start(Trainer(), module, batch, 0)  # type: ignore[arg-type]
        return module.logged["kl/value"]
    lp, ro, mask = _inputs(rank)
    half = mask.double()
    if rank == 0:
        half[0, 1] = 0.5  # a mask that is not a mask, on rank 0 only

    def device_form() -> Any:
        saved = ground_checks.HOST_READ_DEVICES
        ground_checks.HOST_READ_DEVICES = frozenset()  # no host read per call: the accelerators' form, on CPU
        try:
            return fix(lp, ro, half).weights.tolist()
        finally:
            ground_checks.HOST_READ_DEVICES = saved

    return {
        "good": lambda: fix(lp, ro, mask).weights.tolist(),
        "mask_half_on_rank0": lambda: fix(lp, ro, half).weights.tolist(),
        "logprob_above_0_on_rank1": lambda: fix(lp + 3.0 * rank, ro, mask).weights.tolist(),
        "not_a_tensor_on_rank1": lambda: fix(lp.tolist() if rank == 1 else lp, ro, mask).weights.tolist(),
        "good_after": lambda: fix(lp, ro, mask).weights.tolist(),
        "device_form_mask_half_on_rank0": device_form,
        "good_at_last": lambda: fix(lp, ro, mask).weights.tolist(),
        # the loss's global batch: token-mean divides by the valid tokens of every process (one all-reduce)
        "kl_good": lambda: kl(lp, ro, mask).item(),
        "kl_logprob_above_0_on_rank1": lambda: kl(lp + 3.0 * rank, ro, mask).item(),
        "kl_mask_half_on_rank0": lambda: kl(lp, ro, half).item(),
        "kl_good_after": lambda: kl(lp, ro, mask).item(),
        "kl_sum_mode_refused_on_rank1": lambda: kl_sum(lp + 3.0 * rank, ro, mask).item(),  # met in the metric's all-reduce
        "kl_good_at_last": lambda: kl(lp, ro, mask).item(),
        # KLRewardCallback: the rollout's statistics are summed over the processes (one all-reduce)
        "reward_good": lambda: reward(lp, ro, mask),
        "reward_logprob_above_0_on_rank1": lambda: reward(lp + 3.0 * rank, ro, mask),
        "reward_no_mask_key_on_rank0": lambda: reward(lp, ro, mask, drop="mask" if rank == 0 else None),
        "reward_good_after": lambda: reward(lp, ro, mask),
    }


def _main(rank: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD,
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
    torch.multiprocessing.spawn(_main, args=(sys.argv[1],), nprocs=WORLD, join=True)
