"""``MismatchMetric`` and ``RolloutCorrection``'s batch normalization under 2-process DDP equal one
process over the global batches (1e-12, float64) on ranks of unequal lengths; and how far the mean
of per-worker values (what verl, TRL and OpenRLHF log) is from it there, the figures that
``docs/mismatch.md`` quotes."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from _ddp import run_ddp_worker
from lightning_kl.mismatch import METRIC_KEYS

WORKER_PATH = Path(__file__).with_name("_mismatch_ddp_worker.py")
_spec = importlib.util.spec_from_file_location("_mismatch_ddp_worker", WORKER_PATH)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ddp_worker(WORKER_PATH, tmp_path_factory.mktemp("mismatch_ddp"), world=worker.WORLD)


def _global() -> dict[str, torch.Tensor]:
    batches = worker.global_batches()
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def test_the_metric_under_ddp_equals_one_process_on_unequal_lengths(ddp: list[dict[str, Any]]) -> None:
    g = _global()
    want = lk.mismatch_metrics(g["logprob"], g["rollout"], g["mask"])
    for record in ddp:
        for key in METRIC_KEYS:
            assert_close(torch.tensor(record["metrics"][key], dtype=torch.float64), want[key], rtol=1e-12, atol=1e-15,
                         msg=lambda m: f"rank {record['rank']} {key}: {m}")  # fmt: skip


def test_batch_normalization_under_ddp_divides_by_the_global_mean(ddp: list[dict[str, Any]]) -> None:
    one = lk.RolloutCorrection(**worker.CORRECTION)
    for step, batch in enumerate(worker.global_batches()):
        want = one(batch["logprob"], batch["rollout"], batch["mask"]).weights
        got = torch.cat([torch.tensor(r["weights"][step], dtype=torch.float64) for r in ddp])
        assert_close(got, want, rtol=1e-12, atol=0)


# one global batch (the first): its exact value, and the mean of the two workers' own values (docs/mismatch.md)
PER_WORKER_FIGURES = {
    "kl": (0.09807, 0.4564),
    "k3_kl": (0.04245, 0.1750),
    "token_mult_prob_error": (1.237, 1.859),
    "logp_abs_diff_mean": (0.1483, 0.4849),
    "log_ppl_diff": (0.4219, 0.4943),
}


def per_worker_mean(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """The mean over ranks of each rank's own metric over its shard: a per-worker ``.item()``
    averaged by a driver, as verl, TRL (``gather(...).mean()``) and OpenRLHF log it."""
    values = []
    for rank in range(worker.WORLD):
        s = worker.shard(batch, rank, worker.WORLD)
        values.append(lk.mismatch_metrics(s["logprob"], s["rollout"], s["mask"]))
    return {k: sum(float(v[k]) for v in values) / len(values) for k in METRIC_KEYS}


def test_the_mean_of_per_worker_values_is_off_by_the_documented_amount() -> None:
    batch = worker.global_batches()[0]
    exact = lk.mismatch_metrics(batch["logprob"], batch["rollout"], batch["mask"])
    averaged = per_worker_mean(batch)
    for key, (want_exact, want_averaged) in PER_WORKER_FIGURES.items():
        assert math.isclose(float(exact[key]), want_exact, rel_tol=5e-3), (key, float(exact[key]))
        assert math.isclose(averaged[key], want_averaged, rel_tol=5e-3), (key, averaged[key])
