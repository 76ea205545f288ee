"""``KLPenaltyLoss("full")`` with a served teacher's top-k (``lk.TopK``) as the other side: its value and gradient
are ``coef * lk.aggregate(lk.full_kl(x, topk, mask, divergence=..., beta=...), mask, agg)``'s in every ``agg`` mode,
that in turn the k + 1 cells written out in float64 (tests/test_topk.py's enumeration); the metric gets those
values; the errors; and ``global_batch=True`` on 2 gloo processes equal to one process on the concatenated batch.

``python tests/test_topk_loss.py OUT_DIR`` spawns the 2 processes (a file store in OUT_DIR: no port); each writes
``OUT_DIR/rank{r}.json`` with its errors against the one-process loss (float64) and the message of the error that a
bad payload on rank 1 alone raised on both ranks. The tests below launch it and read the records.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from _ddp import run_ddp_worker

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum", "seq-mean-token-sum-norm"]
DIRECTIONS = [("reverse", None), ("forward", None), ("jsd", 0.3), ("mixed", 0.6)]
WORLD, B, T, V, K, D = 2, 4, 5, 11, 4, 6
NINF = float("-inf")


def _inputs(seed: int = 0) -> dict[str, Any]:
    """float64 student (logits, and a head with a soft cap and a logit scale), a teacher's top-k padded in places,
    and a mask with an empty sequence and NaN logits at masked rows."""
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    h = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    W = torch.randn(V, D, generator=g, dtype=torch.float64)
    lq, ids = (2 * torch.randn(B, T, V, generator=g, dtype=torch.float64)).log_softmax(-1).topk(K, dim=-1)
    lq[0, 1, K - 1] = NINF  # a shorter list
    ids[0, 1, K - 1] = -3  # its id is not read
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    mask[3] = False  # an empty sequence: 0 to every mode, one sequence fewer to the seq-mean modes
    z = z.masked_fill(~mask.unsqueeze(-1), float("nan"))
    h = h.masked_fill(~mask.unsqueeze(-1), float("nan"))
    return {"z": z, "h": h, "W": W, "ids": ids, "lq": lq, "mask": mask}


def _student(x: dict[str, Any], source: str, rows: slice = slice(None)) -> tuple[Any, tuple[torch.Tensor, ...]]:
    if source == "logits":
        z = x["z"][rows].clone().requires_grad_()
        return z, (z,)
    h, W = x["h"][rows].clone().requires_grad_(), x["W"].clone().requires_grad_()
    return lk.FromHidden(h, W, softcap=4.0, logit_scale=0.8), (h, W)


def _sampling(name: str) -> lk.Sampling:
    # a truncating sampler where the direction is finite under it (the loss refuses the forward KL's +inf)
    return lk.Sampling(0.8, top_k=7) if name in ("reverse", "jsd") else lk.Sampling(0.8)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name,beta", DIRECTIONS)
@pytest.mark.parametrize("source", ["logits", "hidden"])
def test_the_loss_is_the_aggregate_of_full_kl_in_value_and_gradient(source: str, name: str, beta: Optional[float], agg: str) -> None:
    x = _inputs()
    mask, topk = x["mask"], lk.TopK(x["ids"], x["lq"])
    s = _sampling(name)
    loss_fn = lk.KLPenaltyLoss("full", coef=0.5, agg=agg, sampling=s, divergence=name, beta=beta)
    student, leaves = _student(x, source)
    loss = loss_fn(student, topk, mask)
    ref_student, ref_leaves = _student(x, source)
    values = lk.full_kl(ref_student, topk, mask, sampling=s, divergence=name, beta=beta)
    want = 0.5 * lk.aggregate(values, mask, agg)
    assert loss.dtype == torch.float64 and torch.isfinite(want) and want > 0
    assert_close(loss, want, rtol=1e-12, atol=1e-14)
    for a, e in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(want, ref_leaves)):
        assert torch.isfinite(a).all()
        assert_close(a, e, rtol=1e-10, atol=1e-13)
    # the metric sees the divergence itself (per token, over the valid tokens), not the loss
    assert_close(loss_fn.metric.compute(), values.detach()[mask].mean(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name,beta", DIRECTIONS)
def test_the_loss_is_the_token_mean_of_the_cells_written_out(name: str, beta: Optional[float]) -> None:
    """Independent of full_kl: the k + 1 cells by enumeration in float64 (tests/test_topk.py's formula)."""
    from test_topk import _cells, _div, _torch_reference

    x = _inputs(1)
    mask, topk = x["mask"], lk.TopK(x["ids"], x["lq"])
    z = x["z"].nan_to_num(0.0).requires_grad_()
    s = lk.Sampling(0.8)
    loss = lk.KLPenaltyLoss("full", coef=0.25, sampling=s, divergence=name, beta=beta)(z, topk, mask)
    lp = (z / 0.8).log_softmax(-1)
    p = lp.detach().exp()
    per_row = [
        _div(*_cells(p[b, t].tolist(), x["ids"][b, t].tolist(), x["lq"][b, t].tolist()), name, beta)
        for b in range(B) for t in range(T) if mask[b, t]
    ]
    assert loss.item() == pytest.approx(0.25 * sum(per_row) / len(per_row), rel=1e-11)
    want = 0.25 * _torch_reference(lp, x["ids"], x["lq"], name, beta)[mask].mean()
    assert_close(torch.autograd.grad(loss, z)[0], torch.autograd.grad(want, z)[0], rtol=1e-9, atol=1e-13)


def test_the_function_takes_it_too() -> None:
    # lk.kl_penalty(..., "full") shares the loss's checks and compute step
    x = _inputs()
    topk = lk.TopK(x["ids"], x["lq"])
    got = lk.kl_penalty(x["z"], topk, "full", mask=x["mask"])
    assert_close(got, lk.full_kl(x["z"], topk, x["mask"]), rtol=0, atol=0)


def test_the_errors_name_what_fits() -> None:
    x = _inputs()
    mask, topk = x["mask"], lk.TopK(x["ids"], x["lq"])
    lp = x["z"].nan_to_num(0.0).log_softmax(-1)[..., 0]
    with pytest.raises(TypeError, match=r"other side of the 'full' estimator, got 'k3'.*estimator='full'"):
        lk.KLPenaltyLoss("k3")(lp, topk, mask)
    with pytest.raises(TypeError, match=r"other side of the 'full' estimator, got 'k1'"):
        lk.kl_penalty(lp, topk, "k1", mask=mask)
    with pytest.raises(TypeError, match="the second argument"):
        lk.KLPenaltyLoss("full")(topk, x["z"], mask)
    with pytest.raises(ValueError, match="level='token' only"):
        lk.KLPenaltyLoss("full", level="sequence", agg="token-sum")(x["z"], topk, mask, sampled_logprob=lp)
    with pytest.raises(ValueError, match=r"mask \(3, 5\)"):
        lk.KLPenaltyLoss("full")(x["z"], topk, mask[:3])
    with pytest.raises(ValueError, match=r"TopK must be \[\.\.\., k\] over the student's positions"):
        lk.KLPenaltyLoss("full")(x["z"][:, :3], lk.TopK(x["ids"], x["lq"]), mask[:, :3])
    dup = x["ids"].clone()
    dup[2, 4, 1] = dup[2, 4, 0]
    with pytest.raises(ValueError, match=r"twice in the row at position \(2, 4\)"):
        lk.KLPenaltyLoss("full", divergence="forward")(x["z"], lk.TopK(dup, x["lq"]), mask)
    with pytest.raises(ValueError, match="old_logprob"):
        lk.KLPenaltyLoss("full")(x["z"], topk, mask, lp)


# ---------------------------------------------------------------------------------------------
# global_batch=True on 2 gloo processes: each rank holds rows 0-1 or 2-3 (rank 1: an empty sequence, fewer tokens)

CASES = [("reverse", None), ("jsd", 0.3)]


def _main(rank: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    errors: dict[str, float] = {}
    raised: dict[str, str] = {}
    try:
        x = _inputs()
        rows = slice(rank * B // WORLD, (rank + 1) * B // WORLD)
        topk, mask = lk.TopK(x["ids"], x["lq"]), x["mask"]
        mine = lk.TopK(x["ids"][rows], x["lq"][rows])
        for source in ("logits", "hidden"):
            for name, beta in CASES:
                for agg in AGGS:
                    tag = f"{source}_{name}_{agg}"
                    make = lambda: lk.KLPenaltyLoss("full", coef=0.5, agg=agg, global_batch=True, divergence=name, beta=beta)  # noqa: E731
                    student, leaves = _student(x, source, rows)
                    loss = make()(student, mine, mask[rows])
                    grads = torch.autograd.grad(loss, leaves)
                    one, one_leaves = _student(x, source)  # one process on the concatenated batch: no collective
                    want = 0.5 * lk.aggregate(lk.full_kl(one, topk, mask, divergence=name, beta=beta), mask, agg)
                    one_grads = torch.autograd.grad(want, one_leaves)
                    mean_loss = loss.detach().clone()
                    dist.all_reduce(mean_loss)
                    errors[f"{tag}_loss"] = abs(float(mean_loss) / WORLD - want.item())
                    # DDP averages the gradients: the rows' over 1 process each, the shared head's over both
                    g0 = grads[0] / WORLD
                    errors[f"{tag}_grad_rows"] = float((g0 - one_grads[0][rows]).nan_to_num(0.0).abs().max())
                    if source == "hidden":
                        gW = grads[1].clone()
                        dist.all_reduce(gW)
                        errors[f"{tag}_grad_head"] = float((gW / WORLD - one_grads[1]).abs().max())
        bad = x["ids"][rows].clone()
        if rank == 1:
            bad[0, 0, 1] = bad[0, 0, 0]  # a duplicate id on rank 1 alone
        try:
            lk.KLPenaltyLoss("full", global_batch=True)(x["z"][rows], lk.TopK(bad, x["lq"][rows]), mask[rows])
        except ValueError as err:
            raised["duplicate"] = str(err)
        record: dict[str, Any] = {"rank": rank, "world_size": WORLD, "errors": errors, "raised": raised}
    except Exception:  # the record says what failed; the test shows it
        record = {"rank": rank, "world_size": WORLD, "failure": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _ddp import finish_worker

    finish_worker()


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # this file is its own worker (its __main__), launched as every gloo worker is (tests/_ddp.py)
    found = run_ddp_worker(Path(__file__), tmp_path_factory.mktemp("topk_loss"), world=WORLD, timeout=240)
    for record in found:
        assert "failure" not in record, record["failure"]
    return found


def test_the_global_batch_on_two_processes_is_one_process_on_the_concatenated_batch(records: list[dict[str, Any]]) -> None:
    for record in records:
        errors = record["errors"]
        assert len(errors) == len(CASES) * len(AGGS) * (2 + 3)  # logits: loss, rows; hidden: loss, rows, head
        bad = {k: v for k, v in errors.items() if not v <= 1e-12}
        assert not bad, (record["rank"], bad)


def test_a_bad_payload_on_one_rank_is_refused_on_both(records: list[dict[str, Any]]) -> None:
    for record in records:
        assert "twice in the row at position (0, 0)" in record["raised"]["duplicate"], record
        assert "found on rank 1; every rank raises this error" in record["raised"]["duplicate"]


if __name__ == "__main__":
    torch.multiprocessing.spawn(_main, args=(sys.argv[1],), nprocs=WORLD, join=True)
