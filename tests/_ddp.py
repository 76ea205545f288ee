"""Running a 2-process DDP worker script (``Trainer(devices=2, strategy="ddp")`` on CPU) from a test.

A worker writes one ``rank{r}.json`` record per process into its output folder; :func:`run_ddp_worker`
launches it and returns the records, in rank order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_ddp_worker(worker: Path, out: Path, *args: str, world: int = 2, timeout: float = 180) -> list[dict[str, Any]]:
    """Run ``python worker out *args`` and return each rank's record; fail the test on error or timeout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # the worker (and rank 1, which Lightning launches with this environment) must import this
    # checkout's lightning_kl, not whichever one is installed: `python tests/<worker>.py` puts
    # tests/ first on the path, not the repository root
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for var in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
        env.pop(var, None)  # let Lightning choose a free port and launch rank 1 itself
    try:
        proc = subprocess.run(
            [sys.executable, str(worker), str(out), *args], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the {world}-process DDP run did not finish in {err.timeout} s:\n{err.stderr}")
    records = []
    for rank in range(world):
        path = out / f"rank{rank}.json"
        assert proc.returncode == 0 and path.exists(), (
            f"DDP worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
        records.append(json.loads(path.read_text()))
    assert [r["rank"] for r in records] == list(range(world)) and {r["world_size"] for r in records} == {world}
    return records


def write_rank_record(out_dir: str, record: dict[str, Any]) -> None:
    """In a worker, as its last step: write this rank's ``rank{r}.json``, then :func:`finish_worker`."""
    with open(os.path.join(out_dir, f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)
    finish_worker()


def finish_worker() -> None:
    """End a worker process once its record is written: wait for every rank's, tear the process group
    down and leave with exit status 0 without the interpreter's shutdown.

    Left to interpreter shutdown, gloo's C++ threads sometimes abort the process after its work is done
    ("terminate called without an active exception", exit -6: about 1 run in 5 under load), even after
    ``destroy_process_group``; the barrier keeps rank 0 (the launcher's process) from leaving before
    the others have written their records.
    """
    import torch.distributed

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
