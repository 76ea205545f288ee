"""Two DDP processes (CPU, gloo) agree with each other and with one process over the global batch.

One real run of ``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` (tests/_ddp_worker.py, in a
subprocess with a timeout, a few seconds) records on each rank the ``KLRewardCallback``
coefficient after every step, the shaped rewards, the synced ``KLMetric`` and the DDP-averaged
gradients of ``KLPenaltyLoss`` in every aggregation mode. The same module then runs here in one
process over the concatenated data, and float64 maths written from the estimator table checks the
controller's trajectory independently of both.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.functional import AGG_MODES
from _ddp import run_ddp_worker

WORKER_PATH = Path(__file__).with_name("_ddp_worker.py")
_spec = importlib.util.spec_from_file_location("_ddp_worker", WORKER_PATH)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

# modes whose per-process normalizer is a count of the process's own data
COUNT_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
# modes that sum over the batch: DDP's averaging divides them by the world size
SUM_MODES = ("token-sum", "seq-mean-token-sum-norm")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp")
    return run_ddp_worker(WORKER_PATH, out, world=worker.WORLD)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return worker.fit(str(tmp_path_factory.mktemp("single")), devices=1)


def reference_trajectory() -> list[float]:
    """The AdaptiveKLController trajectory over the global batches, in float64 from the formula.

    Global KL of a batch: the mean over sequences with a valid token of each sequence's token-mean
    k1 (``logprob - ref_logprob``); ``n_steps``: the number of those sequences.
    """
    cfg = worker.CONTROLLER
    value, out = cfg["init_kl_coef"], []
    for batch in worker.rollouts():
        seq_kls = []
        for lp, ref, m in zip(batch["logprobs"].tolist(), batch["ref_logprobs"].tolist(), batch["mask"].tolist()):
            ds = [a - b for a, b, keep in zip(lp, ref, m) if keep]
            if ds:
                seq_kls.append(sum(ds) / len(ds))
        kl, n = sum(seq_kls) / len(seq_kls), len(seq_kls)
        err = min(max(kl / cfg["target_kl"] - 1, -0.2), 0.2)
        value *= 1 + err * n / cfg["horizon"]
        out.append(value)
    return out


def test_data_is_split_unevenly() -> None:
    # the checks below can only fail if the ranks' shards differ in tokens and in sequences
    m = worker.rollouts()[0]["mask"]
    shards = [worker.shard({"m": m}, r, worker.WORLD)["m"] for r in range(worker.WORLD)]
    assert [int(s.sum()) for s in shards] == [9, 6]
    assert [int(s.any(-1).sum()) for s in shards] == [3, 2]


def test_coefficient_identical_on_every_rank_after_every_step(ddp: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["coef"] for r in ddp)
    assert len(rank0) == worker.STEPS
    assert rank0 == rank1  # bitwise: every rank updated with the same all-reduced statistics
    assert len(set(rank0)) == worker.STEPS  # the coefficient moved at every step


def test_two_ranks_follow_the_one_process_trajectory(ddp: list[dict[str, Any]], single: dict[str, Any]) -> None:
    expected = torch.tensor(reference_trajectory(), dtype=torch.float64)
    # the trajectory is not trivially clipped: some steps' errors fall inside (-0.2, 0.2)
    ratios = expected / torch.cat([torch.tensor([worker.CONTROLLER["init_kl_coef"]]), expected[:-1]])
    assert ((ratios - 1).abs() < 0.2 * 5 / worker.CONTROLLER["horizon"] - 1e-6).sum() >= 2
    assert_close(torch.tensor(single["coef"], dtype=torch.float64), expected, rtol=1e-13, atol=0)
    assert_close(torch.tensor(ddp[0]["coef"], dtype=torch.float64), expected, rtol=1e-13, atol=0)


def test_rewards_match_one_process_and_ignore_junk_padding(ddp: list[dict[str, Any]], single: dict[str, Any]) -> None:
    # each rank shapes its own rows with the shared coefficient: the concatenation is the global batch's
    ddp_rewards = torch.cat([torch.tensor(r["rewards"], dtype=torch.float64) for r in ddp], dim=1)
    single_rewards = torch.tensor(single["rewards"], dtype=torch.float64)
    assert torch.isfinite(ddp_rewards).all()  # NaN / -inf padding never reached the rewards
    assert_close(ddp_rewards, single_rewards, rtol=1e-13, atol=1e-15)
    for step, batch in enumerate(worker.rollouts()):
        padded = ~batch["mask"]
        assert torch.equal(ddp_rewards[step][padded], batch["scores"][padded])  # no penalty on padding


def test_metric_is_the_token_mean_of_the_concatenated_data(ddp: list[dict[str, Any]], single: dict[str, Any]) -> None:
    total, count, local = 0.0, 0, [[0.0, 0] for _ in range(worker.WORLD)]
    for batch in worker.rollouts():
        d = torch.where(batch["mask"], batch["logprobs"] - batch["ref_logprobs"], 0.0)
        total, count = total + float(d.sum()), count + int(batch["mask"].sum())
        for r in range(worker.WORLD):
            s = worker.shard({"d": d, "m": batch["mask"]}, r, worker.WORLD)
            local[r][0] += float(s["d"].sum())
            local[r][1] += int(s["m"].sum())
    expected = torch.tensor(total / count, dtype=torch.float32)
    assert ddp[0]["metric"] == ddp[1]["metric"]
    assert_close(torch.tensor(ddp[0]["metric"], dtype=torch.float32), expected)
    assert_close(torch.tensor(single["metric"], dtype=torch.float32), expected)
    # without the sum-reduction each rank would report its own token-mean, which is far off here
    for local_total, local_count in local:
        assert abs(local_total / local_count - total / count) > 1e-3


def _grad(record: dict[str, Any], data: str, mode: str, flag: bool) -> torch.Tensor:
    return torch.tensor(record["grads"][worker.config_key(data, mode, flag)], dtype=torch.float64)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_global_batch_makes_every_mode_exact_under_ddp(
    ddp: list[dict[str, Any]], single: dict[str, Any], mode: str
) -> None:
    # uneven shards (9 vs 6 tokens, 3 vs 2 non-empty sequences): still the global batch's gradient
    expected = _grad(single, "unequal", mode, True)
    assert torch.equal(_grad(single, "unequal", mode, True), _grad(single, "unequal", mode, False))  # 1 process
    assert expected.abs().sum() > 0
    for record in ddp:
        assert_close(_grad(record, "unequal", mode, True), expected, rtol=1e-12, atol=1e-15)
    # each rank's loss is W times its share: their mean is the global batch's loss
    key = worker.config_key("unequal", mode, True)
    mean_loss = sum(r["losses"][key] for r in ddp) / len(ddp)
    assert mean_loss == pytest.approx(single["losses"][key], rel=1e-12)


@pytest.mark.parametrize("mode", COUNT_MODES)
def test_count_modes_exact_under_ddp_only_with_equal_counts(
    ddp: list[dict[str, Any]], single: dict[str, Any], mode: str
) -> None:
    # equal counts on every rank (9 tokens, 3 non-empty sequences each): DDP's mean is the global mean
    for record in ddp:
        assert_close(_grad(record, "equal", mode, False), _grad(single, "equal", mode, False), rtol=1e-12, atol=1e-15)
    # unequal counts: each rank divides by its own count, and the averaged gradient is off
    expected = _grad(single, "unequal", mode, False)
    got = _grad(ddp[0], "unequal", mode, False)
    assert (got - expected).abs().max() > 1e-3 * expected.abs().max()


@pytest.mark.parametrize("mode", SUM_MODES)
def test_sum_modes_are_scaled_by_one_over_world_size_without_global_batch(
    ddp: list[dict[str, Any]], single: dict[str, Any], mode: str
) -> None:
    for data in ("equal", "unequal"):
        expected = _grad(single, data, mode, False) / worker.WORLD
        for record in ddp:
            assert_close(_grad(record, data, mode, False), expected, rtol=1e-12, atol=1e-15)


def test_global_batch_outside_distributed_changes_nothing() -> None:
    g = torch.Generator().manual_seed(3)
    logprob = -3 * torch.rand(4, 6, generator=g, dtype=torch.float64)
    ref = -3 * torch.rand(4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) > 0.4
    for mode in AGG_MODES:
        plain = lk.KLPenaltyLoss("k3", coef=0.3, agg=mode)(logprob, ref, mask)
        glob = lk.KLPenaltyLoss("k3", coef=0.3, agg=mode, global_batch=True)(logprob, ref, mask)
        assert torch.equal(plain, glob)
    with pytest.raises(ValueError, match="global_batch.*'yes'"):
        lk.KLPenaltyLoss(global_batch="yes")  # type: ignore[arg-type]


def test_aggregate_global_normalizers_written_out() -> None:
    # aggregate's explicit normalizers: what one rank computes with the all-reduced counts
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0]], dtype=torch.float64)
    m = torch.tensor([[True, True, True], [True, False, False]])
    assert lk.aggregate(v, m, "token-mean", num_tokens=8, world_size=2).item() == 2 * 10 / 8
    assert lk.aggregate(v, m, "token-sum", world_size=3).item() == 30
    assert lk.aggregate(v, m, "seq-mean-token-sum", num_seqs=5, world_size=2).item() == 2 * 10 / 5
    assert lk.aggregate(v, m, "seq-mean-token-mean", num_seqs=torch.tensor(4), world_size=2).item() == 2 * (2 + 4) / 4
    assert lk.aggregate(v, m, "seq-mean-token-sum-norm", world_size=2).item() == 2 * 10 / 3
    # a global batch with no valid token anywhere: 0, as locally
    assert lk.aggregate(v, torch.zeros_like(m), "token-mean", num_tokens=0, world_size=2).item() == 0
    from lightning_kl.functional import aggregate_counts

    assert aggregate_counts(v, m).tolist() == [4, 2]
    assert aggregate_counts(v).tolist() == [6, 2]
    for bad in ({"world_size": 0}, {"world_size": 1.5}, {"num_tokens": -1}, {"num_seqs": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            lk.aggregate(v, m, **bad)


def test_accumulation_under_ddp_gives_the_step_batch_gradient(ddp: list[dict[str, Any]]) -> None:
    # 2 ranks x 4 uneven micro-batches (27 vs 19 tokens, 9 vs 6 sequences, one empty): DDP's average of
    # the accumulated gradients is the gradient of one call over the step's 17 sequences, in every mode
    data = worker.accum_data()
    masks = [[data["mask"][list(r)] for r in rows] for rows in worker.ACCUM_ROWS]
    assert [int(lk.step_totals(m)["num_tokens"]) for m in masks] == [27, 19]
    for mode_index, mode in enumerate(AGG_MODES):
        logprob = data["logprob"].clone().requires_grad_()
        loss_fn = lk.KLPenaltyLoss(worker.GRAD_ESTIMATOR, coef=worker.GRAD_COEF, agg=mode)
        loss_fn(logprob, data["ref_logprob"], data["mask"]).backward()
        assert logprob.grad.abs().sum() > 0
        for record in ddp:
            (step,) = record["accumulation"]["grads"]  # one optimizer step
            got = torch.tensor(step[mode_index], dtype=torch.float64)
            assert_close(got, logprob.grad, rtol=0, atol=1e-12, msg=lambda m, mode=mode: f"{mode}: {m}")
    # the loss's metric, synced over the ranks, is the token-mean k3 of the step's batch
    d = (data["logprob"] - data["ref_logprob"])[data["mask"]]
    expected = (torch.expm1(-d) + d).mean().to(torch.float32)
    for record in ddp:
        assert_close(torch.tensor(record["accumulation"]["metric"], dtype=torch.float32), expected)
