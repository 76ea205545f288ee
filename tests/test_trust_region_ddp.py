"""``RolloutCorrection(trust_region=..., batch_normalize=True)`` on 2 and on 3 gloo processes
(``tests/_trust_region_worker.py``): the gated weights are each rank's share of one process's on the
concatenated batch (the mean weight is the group's), and missing or misshaped advantages on one rank are
refused on every rank, promptly, with the collectives still paired after."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from _ddp import run_ddp_worker

WORKER_PATH = Path(__file__).with_name("_trust_region_worker.py")
_spec = importlib.util.spec_from_file_location("_trust_region_worker", WORKER_PATH)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

PROMPT_S = 20.0  # far below the process group's timeout (60 s)


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def records(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    world = request.param
    out = run_ddp_worker(WORKER_PATH, tmp_path_factory.mktemp(f"trust_region_ddp_{world}"), str(world), world=world, timeout=200)
    for r in out:
        assert "failure" not in r, r["failure"]
    return out


def test_the_gated_weights_are_one_processs_on_the_concatenated_batch(records: list[dict[str, Any]]) -> None:
    parts = [worker.inputs(rank) for rank in range(len(records))]
    lp, ro, mask, adv = (torch.cat([p[i] for p in parts]) for i in range(4))
    out = worker.make()(lp, ro, mask, advantages=adv)
    assert ((out.weights == 0) & mask).any() and (out.weights > 0).any()  # the gate bites, some pass
    rows = 0
    for r in records:
        for case in ("good", "good_after"):
            got = torch.tensor(r["cases"][case]["weights"], dtype=torch.float64)
            assert_close(got, out.weights[rows : rows + got.shape[0]], rtol=1e-12, atol=0)
        rows += got.shape[0]


@pytest.mark.parametrize(
    "case,found_on,match",
    [("no_advantages_on_rank1", 1, "`trust_region` is set: pass `advantages`"),
     ("bad_advantages_on_rank0", 0, r"`advantages` must be \[...\], \[..., 1\] or \[..., t\]")],
)  # fmt: skip
def test_a_refusal_on_one_rank_is_raised_on_every_rank(records: list[dict[str, Any]], case: str, found_on: int, match: str) -> None:
    results = [r["cases"][case] for r in records]
    for rank, result in enumerate(results):
        assert result.get("error") == "ValueError", (rank, result)
        assert result["seconds"] < PROMPT_S
    assert all(result["message"] == results[0]["message"] for result in results)
    assert f"(found on rank {found_on}; every rank raises this error)" in results[0]["message"]
    assert re.search(match, results[0]["message"])
