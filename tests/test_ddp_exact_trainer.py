"""A 2-process DDP Trainer (CPU, gloo) logs per step the ``train/kl`` and ``train/entropy`` of one process on the
same global batches, with and without an ``EntropyBonus``, with a process holding no valid token; so do the
controllers' ``kl/value`` and ``entropy/value``, and the policy ends where one process's does.

``tests/_ddp_exact_worker.py`` is a GRPO-like module (policy gradient, ``KLPenaltyLoss(global_batch=True)``
with a ``TargetKLController``, ``EntropyBonus(global_batch=True)`` with a ``TargetEntropyController``), run
here in a subprocess on 2 processes (timeout) and in this process on one device. Everything is float64: the
two runs differ by the order of a few sums (about 1e-15 a step).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from _ddp import run_ddp_worker

TESTS = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("_ddp_exact_worker", TESTS / "_ddp_exact_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


@pytest.fixture(scope="module", params=[False, True], ids=["without the bonus", "with the bonus"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[bool, list[dict], dict]:
    bonus = request.param
    out = tmp_path_factory.mktemp("ddp_exact_trainer")
    ddp = run_ddp_worker(TESTS / "_ddp_exact_worker.py", out, "1" if bonus else "0", world=worker.WORLD, timeout=300)
    one = worker.fit(str(tmp_path_factory.mktemp("one")), bonus, devices=1)
    return bonus, ddp, one


def _series(record: dict[str, Any], key: str) -> list[float]:
    return [step[key] for step in record["steps"] if key in step]


def test_a_rank_holds_no_token_at_some_steps() -> None:
    batches = worker.rollouts()
    for step in (0, 2):
        counts = [int(worker.shard(batches[step], r, worker.WORLD)["mask"].sum()) for r in range(worker.WORLD)]
        assert 0 in counts and sum(counts) > 0


def test_every_step_logs_the_one_process_values(runs) -> None:
    bonus, ddp, one = runs
    keys = ["train/kl", "kl/value", "kl/coef"] + (["train/entropy", "entropy/value", "entropy/coef"] if bonus else [])
    for key in keys:
        want = _series(one, key)
        assert len(want) == worker.STEPS and all(math.isfinite(v) for v in want), key
        for rec in ddp:  # every rank logs the global batch's value, the one process's
            assert _series(rec, key) == pytest.approx(want, rel=1e-12, abs=1e-14), (key, rec["rank"])
    if not bonus:
        assert not any("train/entropy" in step for step in one["steps"])


def test_the_policy_ends_where_one_process_ends(runs) -> None:
    _, ddp, one = runs
    want = torch.tensor(one["theta"], dtype=torch.float64)
    for rec in ddp:
        assert torch.allclose(torch.tensor(rec["theta"], dtype=torch.float64), want, rtol=1e-12, atol=1e-13)
    assert not torch.allclose(want, worker.GRPOLike(False).theta.detach())  # it moved


def test_the_logged_kl_is_the_global_token_mean_of_the_step(tmp_path: Path) -> None:
    # the one-process run is itself checked against the formula at step 0 (the policy's starting point)
    model = worker.GRPOLike(False)
    b = worker.rollouts()[0]
    m = b["mask"]
    z = torch.where(m[..., None], model.theta.detach() + b["noise"], 0.0)
    logp = z.log_softmax(-1).gather(-1, b["tokens"][..., None]).squeeze(-1)
    ref = (model.ref_theta + b["ref_noise"]).log_softmax(-1).gather(-1, b["tokens"][..., None]).squeeze(-1)
    r = ref - logp
    k3 = (r.exp() - 1 - r)[m].mean()
    one = worker.fit(str(tmp_path), False, devices=1)
    assert _series(one, "train/kl")[0] == pytest.approx(float(k3), rel=1e-12)
