"""Hostile inputs on one of 2 gloo processes (``tests/_hostile_2_worker.py``): each ends alike on every
process, promptly, with a clear error, or gives the one-process answer on the global batch.

* a NaN log-prob on one process under ``RolloutCorrection(batch_normalize=True)``: a token the rejection
  drops leaves the global mean (which stays verl's over the other valid tokens); one that is kept makes
  every process's weights NaN, where the normalization was silently turned off on every process;
* ``KLPenaltyLoss(global_batch=True)`` given the step's ``num_tokens`` on one process only: refused on
  every process, where every process's loss was silently wrong;
* ``KLRewardCallback`` given ``batch["mask"] = None`` on one process: the same ``ValueError`` on every
  process, where that one raised a bare ``AssertionError`` and the other waited;
* a warning on one process only, made an error by a filter (``-W error``), before the loss's all-reduce:
  raised on every process, where the others waited;
* ``high_entropy_mask`` with float64 entropies on one process and float32 on the other: the one-process
  mask of the concatenation (float64), where gloo aborted.
"""

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

WORKER_PATH = Path(__file__).with_name("_hostile_2_worker.py")
_spec = importlib.util.spec_from_file_location("_hostile_2_worker", WORKER_PATH)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

PROMPT_S = 20.0  # far below the process group's timeout (60 s): nobody waited for it


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = run_ddp_worker(WORKER_PATH, tmp_path_factory.mktemp("hostile_2"), world=worker.WORLD, timeout=240)
    for r in out:
        assert "failure" not in r, r["failure"]
    return out


def _case(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    results = [r["cases"][name] for r in records]
    for rank, result in enumerate(results):
        assert result["seconds"] < PROMPT_S, (name, rank, result["seconds"])
    return results


def _expected_weights(nan_dropped: bool) -> tuple[list[list[list[float]]], float]:
    """Each rank's weights from the formula, in float64: ``w = min(e^(lp - ro), 2)`` on the valid tokens, over
    the mean of every rank's valid tokens but the NaN one (which the rejection drops: weight 0)."""
    rows = [worker.inputs(rank) for rank in range(worker.WORLD)]
    rank_nan, row_nan, col_nan = worker.NAN_AT
    raw: list[list[list[float]]] = []
    counted: list[float] = []
    for rank, (lp, ro, mask) in enumerate(rows):
        out = []
        for i in range(lp.shape[0]):
            line = []
            for j in range(lp.shape[1]):
                if not mask[i, j]:
                    line.append(0.0)
                elif nan_dropped and (rank, i, j) == (rank_nan, row_nan, col_nan):
                    line.append(0.0)
                else:
                    w = min(math.exp(float(lp[i, j]) - float(ro[i, j])), 2.0)
                    line.append(w)
                    counted.append(w)
            out.append(line)
        raw.append(out)
    mean = math.fsum(counted) / len(counted)
    return [[[w / mean for w in line] for line in out] for out in raw], mean


def test_a_nan_log_prob_the_rejection_drops_leaves_the_global_mean(records: list[dict[str, Any]]) -> None:
    want, mean = _expected_weights(nan_dropped=True)
    for rank, result in enumerate(_case(records, "nan_dropped_by_rejection")):
        assert "error" not in result, result
        assert result["value"]["factor"] == pytest.approx(mean, rel=1e-12)  # was 1.0: normalization off everywhere
        got = torch.tensor(result["value"]["weights"], dtype=torch.float64)
        assert_close(got, torch.tensor(want[rank], dtype=torch.float64), rtol=1e-12, atol=0)
    # the NaN token is out of rank 1's mask; a finite token the rejection drops still counts in verl's mean
    assert records[1]["cases"]["nan_dropped_by_rejection"]["value"]["kept"][0][1] is False


def test_a_nan_log_prob_that_is_kept_makes_every_process_s_weights_nan(records: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(_case(records, "nan_kept")):
        assert math.isnan(result["value"]["factor"]), (rank, result)
        _, _, mask = worker.inputs(rank)
        weights = torch.tensor(result["value"]["weights"], dtype=torch.float64)
        assert weights[mask].isnan().all() and (weights[~mask] == 0).all(), (rank, weights)
    want, _ = _expected_weights(nan_dropped=False)  # the next clean batch is normalized as ever
    for rank, result in enumerate(_case(records, "clean_after")):
        assert_close(torch.tensor(result["value"], dtype=torch.float64), torch.tensor(want[rank], dtype=torch.float64), rtol=1e-12, atol=0)


def test_the_step_total_given_on_one_process_only_is_refused_on_every_process(records: list[dict[str, Any]]) -> None:
    r0, r1 = _case(records, "totals_on_rank0_only")
    assert r0.get("error") == r1.get("error") == "ValueError", (r0, r1)
    assert r0["message"] == r1["message"]
    assert "`num_tokens` (the step's total) was given on some data parallel processes" in r0["message"]
    assert "(given on 1 of 2 processes)" in r0["message"]
    # given on both: each rank's loss is coef (0.001, the default) times its k3 sum over the 18 tokens of the
    # step, times k=2 and 2 replicas (Lightning and DDP divide them back out)
    for rank, result in enumerate(_case(records, "totals_on_every_rank")):
        lp, ro, mask = worker.inputs(rank)
        d = (ro - lp)[mask]
        k3 = math.fsum(float(x) for x in torch.exp(d) - d - 1)
        assert result["value"] == pytest.approx(0.001 * k3 / 18 * 2 * 2, rel=1e-6)


def test_a_none_mask_on_one_process_is_the_same_clear_error_on_every_process(records: list[dict[str, Any]]) -> None:
    r0, r1 = _case(records, "reward_mask_none_on_rank1")
    assert r0.get("error") == r1.get("error") == "ValueError", (r0, r1)
    assert r0["message"] == r1["message"]
    assert "batch['mask'] is None" in r0["message"] and "(found on rank 1; every rank raises this error)" in r0["message"]
    g0, g1 = _case(records, "reward_good_after")
    assert g0["value"] == g1["value"]


@pytest.mark.parametrize(
    "case,match",
    [
        ("warn_old_logprob_grad_on_rank1", "`old_logprob` requires grad"),
        ("warn_lengths_vary_on_rank0", "got responses of different lengths"),
    ],
)
def test_a_warning_made_an_error_on_one_process_is_raised_on_every_process(
    records: list[dict[str, Any]], case: str, match: str
) -> None:
    r0, r1 = _case(records, case)
    assert r0.get("error") == r1.get("error") == "UserWarning", (r0, r1)
    assert r0["message"] == r1["message"] and match in r0["message"]


def test_a_warning_held_before_the_all_reduce_is_shown_on_every_process(records: list[dict[str, Any]]) -> None:
    for result in _case(records, "warn_recorded"):
        assert "error" not in result, result
        assert [w for w in result["warnings"] if "`old_logprob` requires grad" in w] != [], result
    for result in _case(records, "kl_good_after"):
        assert "error" not in result and result["warnings"] == [], result


def test_entropies_float64_on_one_process_and_float32_on_another_give_the_one_process_mask(records: list[dict[str, Any]]) -> None:
    parts = [torch.tensor(values, dtype=dtype) for values, dtype in (worker.ENTROPY[r] for r in range(worker.WORLD))]
    whole = lk.high_entropy_mask(torch.cat(parts), top=0.75)  # torch.cat promotes to float64
    want = whole.split([p.numel() for p in parts])
    for rank, result in enumerate(_case(records, "entropy_mixed_dtypes")):
        assert result.get("value") == want[rank].tolist(), (rank, result)
    assert want[0].tolist() == [False, True]  # rank 0's 0.5 is below the float64 threshold 0.5 + 1e-10


# ---------------------------------------------------------------------------------------------
# one process


def test_one_process_a_nan_the_rejection_drops_leaves_the_mean_and_gets_weight_0() -> None:
    lp = torch.tensor([[-1.0, -0.5, float("nan")], [-0.3, -0.2, -0.1]], dtype=torch.float64)
    ro = lp + 0.1
    ro[0, 2] = -1.0
    out = lk.RolloutCorrection("token", upper=2.0, batch_normalize=True, **worker.REJECT)(lp, ro)
    assert out.mask.tolist() == [[True, True, False], [True, True, True]]
    assert float(out.metrics["rollout_is_batch_norm_factor"]) == pytest.approx(math.exp(-0.1), rel=1e-12)
    assert_close(out.weights, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64))
    kept = lk.RolloutCorrection("token", upper=2.0, batch_normalize=True)(lp, ro)
    assert kept.weights.isnan().all() and math.isnan(float(kept.metrics["rollout_is_batch_norm_factor"]))


def test_one_process_a_none_mask_is_a_clear_value_error() -> None:
    lp = -torch.rand(2, 3, dtype=torch.float64)
    batch = {"scores": torch.ones(2, dtype=torch.float64), "logprobs": lp, "ref_logprobs": lp - 0.1, "mask": None}
    with pytest.raises(ValueError, match=r"batch\['mask'\] is None: the reward needs the response mask"):
        lk.KLRewardCallback("k3").shape_rewards(batch)
