"""Exact under DDP: the entropy bonus's gradient (``global_batch=True``) and the per-call values of the metrics
are those of the global batch, on 2 gloo processes, a process holding no valid token included.

``tests/_ddp_exact_worker_plain.py`` runs without a Trainer (a file store: no port); it is compared here with
one process on the concatenated batch. (The Trainer's per-step logs: ``tests/test_ddp_exact_trainer.py``.)
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_kl as lk
from lightning_kl.reduce import AGG_MODES
from _ddp import run_ddp_worker

TESTS = Path(__file__).parent
WORLD = 2
_spec = importlib.util.spec_from_file_location("_ddp_exact_worker_plain", TESTS / "_ddp_exact_worker_plain.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp_exact_plain")
    return run_ddp_worker(TESTS / "_ddp_exact_worker_plain.py", out, str(WORLD), world=WORLD, timeout=300)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_the_cases_hold_what_they_say() -> None:
    _, _, mask, _ = worker.global_batch("12 and 24 tokens", torch.float64)
    assert [int(mask[worker.rank_rows(WORLD, r)].sum()) for r in range(WORLD)] == [12, 24]
    _, _, mask, _ = worker.global_batch("a rank with no token", torch.float64)
    assert int(mask[worker.rank_rows(WORLD, 0)].sum()) == 0 < int(mask[worker.rank_rows(WORLD, 1)].sum())


@pytest.mark.parametrize("case", list(worker.CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_the_bonus_gradient_with_global_batch_is_the_global_batch_gradient(records, case, dtype, agg) -> None:
    theta, noise, mask, _ = worker.global_batch(case, dtype)
    _, one = worker.bonus_grad(theta, noise, mask, agg, False)  # one process, the whole batch
    one = one.double()
    # float32: the sums of 2 shards against one sum, and the logits' own rounding: the relative error is
    # a few float32 ulps of the largest entry (about 1e-7); float64: about 1e-16
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    for rec in records:  # every rank holds the same averaged gradient
        got = torch.tensor(rec["grads"][f"{case}|{dtype}|{agg}|True"], dtype=torch.float64)
        assert _rel(got, one) < tol, (case, dtype, agg, _rel(got, one))


@pytest.mark.parametrize("case", list(worker.CASES))
def test_without_global_batch_each_process_weighs_its_own_tokens(records, case) -> None:
    # what global_batch repairs (the 0.139 with 12 and 24 tokens): off for the count modes, 1 / W for the sums
    theta, noise, mask, _ = worker.global_batch(case, torch.float64)
    for agg in AGG_MODES:
        one = worker.bonus_grad(theta, noise, mask, agg, False)[1]
        got = torch.tensor(records[0]["grads"][f"{case}|{torch.float64}|{agg}|False"], dtype=torch.float64)
        if agg in ("token-sum", "seq-mean-token-sum-norm"):
            assert _rel(got, one / WORLD) < 1e-13
        else:
            assert _rel(got, one) > 0.05, (case, agg)


def _entropy64(theta: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    z = torch.where(mask[..., None], theta + noise, 0.0).double()
    logp = z.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def test_a_call_of_a_metric_returns_the_global_batch_value(records) -> None:
    theta, noise, mask, kl = worker.global_batch("a rank with no token", torch.float64)
    h = _entropy64(theta, noise, mask)[mask].mean().item()
    k = kl[mask].mean().item()
    local = [kl[worker.rank_rows(WORLD, r)][mask[worker.rank_rows(WORLD, r)]].mean().item() for r in range(WORLD)]
    assert math.isnan(local[0])  # rank 0 holds no token: its own value is no data
    for rank, rec in enumerate(records):
        calls = rec["calls"]
        assert calls["bonus.metric"] == pytest.approx([h, h], rel=1e-13)
        glob, own, again, epoch = calls["KLMetric"]
        assert glob == pytest.approx(k, rel=1e-13) and again == pytest.approx(k, rel=1e-13)
        assert epoch == pytest.approx(k, rel=1e-13)  # the accumulated state stays each process's: synced once
        assert own == pytest.approx(local[rank], rel=1e-13, nan_ok=True)  # dist_sync_on_step=False
        if rank == WORLD - 1:  # eval() mode, called on this rank only: its own value, no collective to wait in
            assert calls["eval"] == pytest.approx([local[rank]], rel=1e-13)
        assert calls["KLPenaltyLoss.metric"] == pytest.approx([-k], rel=1e-13)
        want = lk.mismatch_metrics(-kl, -kl.flip(-1), mask)
        for got in calls["MismatchMetric"]:  # the call's value and compute()
            assert got.keys() == want.keys()
            for key, value in want.items():
                assert got[key] == pytest.approx(float(value), rel=1e-12, abs=1e-15, nan_ok=True), key


@pytest.mark.parametrize("key", ["raised", "raised_local"], ids=["global_batch", "the metric's all-reduce"])
def test_an_input_refused_on_one_process_is_refused_on_every_one(records, key) -> None:
    messages = [rec[key] for rec in records]
    assert messages[0] is not None and len(set(messages)) == 1
    assert f"found on rank {WORLD - 1}" in messages[0] and "mask" in messages[0]


def test_dist_sync_on_step_is_checked() -> None:
    with pytest.raises(ValueError, match="`dist_sync_on_step` must be True or False, got 1"):
        lk.KLMetric(dist_sync_on_step=1)
    assert lk.KLMetric().sync_on_step and not lk.MismatchMetric(dist_sync_on_step=False).sync_on_step


def test_global_batch_is_checked_and_shown() -> None:
    with pytest.raises(ValueError, match="`global_batch` must be True or False, got 'yes'"):
        lk.EntropyBonus(global_batch="yes")
    assert "global_batch=True" in repr(lk.EntropyBonus(global_batch=True))
    assert "global_batch" not in repr(lk.EntropyBonus())
