"""``RolloutCorrection(batch_normalize=True)`` and ``KLPenaltyLoss(global_batch=True)`` under 2 gloo
processes: an input refused on one process is refused on every process, promptly, instead of one raising
while the other waits in the all-reduce (of the mean weight, of the global batch's counts) until the
process group's timeout, or pairs it with the next call's (``tests/_correction_ddp_worker.py``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from _ddp import run_ddp_worker

WORKER_PATH = Path(__file__).with_name("_correction_ddp_worker.py")
_spec = importlib.util.spec_from_file_location("_correction_ddp_worker", WORKER_PATH)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

PROMPT_S = 20.0  # far below the process group's timeout (60 s): nobody waited for it


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = run_ddp_worker(WORKER_PATH, tmp_path_factory.mktemp("correction_ddp"), world=worker.WORLD, timeout=150)
    for r in out:
        assert "failure" not in r, r["failure"]
    return out


def _global_weights() -> list[list[list[float]]]:
    """Each rank's share of the weights normalized by the global mean (one process, both ranks' rows)."""
    rows = [worker._inputs(rank) for rank in range(worker.WORLD)]
    lp, ro, mask = (torch.cat([r[i] for r in rows]) for i in range(3))
    w = lk.RolloutCorrection("token", upper=2.0, batch_normalize=True)(lp, ro, mask).weights
    return [w[2 * rank : 2 * rank + 2].tolist() for rank in range(worker.WORLD)]


@pytest.mark.parametrize(
    "case,found_on,match",
    [
        ("mask_half_on_rank0", 0, r"`mask` must hold only 0 and 1 \(or be bool\), got 0\.5"),
        ("logprob_above_0_on_rank1", 1, r"`logprob` must hold log-probabilities \(<= 0\)"),
        ("not_a_tensor_on_rank1", 1, r"`logprob` must be a torch.Tensor, got list"),
        ("kl_logprob_above_0_on_rank1", 1, r"`logprob` must hold log-probabilities"),
        ("kl_mask_half_on_rank0", 0, r"`mask` must hold only 0 and 1 \(or be bool\), got 0\.5"),
        ("reward_logprob_above_0_on_rank1", 1, r"`logprobs` must hold log-probabilities"),
        ("reward_no_mask_key_on_rank0", 0, r"the batch has no key 'mask'"),
    ],
)
def test_an_input_refused_on_one_rank_raises_the_same_error_on_every_rank(
    records: list[dict[str, Any]], case: str, found_on: int, match: str
) -> None:
    results = [r["cases"][case] for r in records]
    for rank, result in enumerate(results):
        assert result.get("error") == "ValueError", (rank, result)
        assert result["seconds"] < PROMPT_S, (rank, result["seconds"])
    assert results[0]["message"] == results[1]["message"]
    assert f"(found on rank {found_on}; every rank raises this error)" in results[0]["message"]
    assert re.search(match, results[0]["message"]), results[0]["message"]


def test_the_device_form_stops_every_rank_without_a_host_read(records: list[dict[str, Any]]) -> None:
    # no host read per call (an accelerator's form): the rank that refused raises its own error, the
    # other stops on the device assertion (synchronous on CPU)
    r0, r1 = (r["cases"]["device_form_mask_half_on_rank0"] for r in records)
    assert r0["error"] == "ValueError" and "got 0.5" in r0["message"]
    assert r1["error"] == "RuntimeError" and "another data parallel process refused its inputs" in r1["message"]
    assert max(r0["seconds"], r1["seconds"]) < PROMPT_S


def test_good_steps_around_the_failures_normalize_by_the_global_mean(records: list[dict[str, Any]]) -> None:
    # the failures left no collective unmatched: the steps after them still pair up across ranks
    want = _global_weights()
    for rank, r in enumerate(records):
        for case in ("good", "good_after", "good_at_last"):
            assert_close(torch.tensor(r["cases"][case]["weights"]), torch.tensor(want[rank]), rtol=1e-12, atol=0)


def _global_kl() -> float:
    """The token-mean k3 loss of both ranks' rows in one process (the global batch)."""
    rows = [worker._inputs(rank) for rank in range(worker.WORLD)]
    lp, ro, mask = (torch.cat([r[i] for r in rows]) for i in range(3))
    return float(lk.KLPenaltyLoss("k3", agg="token-mean")(lp, ro, mask))


def test_the_global_batch_loss_around_the_failures_is_the_one_process_loss(records: list[dict[str, Any]]) -> None:
    # each rank's loss is its share of the global token mean (DDP averages the ranks' losses): the two
    # add up to the one-process loss of both ranks' rows before, between and after the refusals, so no
    # all-reduce was left unmatched or paired with the wrong call
    for case in ("kl_good", "kl_good_after", "kl_good_at_last"):
        losses = [r["cases"][case]["weights"] for r in records]
        assert_close(torch.tensor(sum(losses) / worker.WORLD), torch.tensor(_global_kl()), rtol=1e-12, atol=0)


def test_a_mode_without_a_count_collective_is_refused_on_every_process(records: list[dict[str, Any]]) -> None:
    # token-sum divides by no count, but the metric's per-step all-reduce (training mode) is met with a flag
    r0, r1 = (r["cases"]["kl_sum_mode_refused_on_rank1"] for r in records)
    assert r0["error"] == r1["error"] == "ValueError" and r0["message"] == r1["message"]
    assert "found on rank 1" in r0["message"]


def test_the_reward_callbacks_kl_around_the_failures_is_the_global_one(records: list[dict[str, Any]]) -> None:
    # the mean over both ranks' sequences of each one's token-mean k3, the same on every rank, before and after
    rows = [worker._inputs(rank) for rank in range(worker.WORLD)]
    lp, ro, mask = (torch.cat([r[i] for r in rows]) for i in range(3))
    per_token = lk.kl_penalty(lp, ro, "k3", mask=mask)
    want = float((per_token.sum(-1) / mask.sum(-1)).mean())
    for case in ("reward_good", "reward_good_after"):
        for r in records:
            assert abs(r["cases"][case]["weights"] - want) < 1e-12, (case, r["rank"], r["cases"][case])
