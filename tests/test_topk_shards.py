"""A teacher's top-k against a student whose vocabulary is split over 2 gloo processes: the ids spread over
the shards, each owned by one; values and gradients equal one process's on the gathered logits.

``python tests/test_topk_shards.py OUT_DIR`` spawns the 2 processes (a file store in OUT_DIR: no port);
each writes ``OUT_DIR/rank{r}.json`` with its errors against the single-process call (float64) and the
messages of the errors it raised. The test below launches it and reads the records.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from _ddp import run_ddp_worker

WORLD, B, T, V, K, D = 2, 3, 5, 11, 4, 6
CASES = [("reverse", None), ("forward", None), ("jsd", 0.3), ("mixed", 0.6)]


def _inputs() -> tuple[Any, ...]:
    import lightning_kl as lk

    g = torch.Generator().manual_seed(0)
    z = 2 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    h = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    W = torch.randn(V, D, generator=g, dtype=torch.float64)
    lq, ids = (2 * torch.randn(B, T, V, generator=g, dtype=torch.float64)).log_softmax(-1).topk(K, dim=-1)
    lq[0, 1, K - 1] = float("-inf")  # a shorter list
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 3:] = False
    z[2, 4] = float("nan")  # a masked row's logits
    return z, h, W, lk.TopK(ids, lq), mask


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def _main(rank: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import lightning_kl as lk

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    errors: dict[str, float] = {}
    raised: dict[str, str] = {}
    try:
        z, h, W, topk, mask = _inputs()
        split = [0, 4, V]  # an uneven custom split: 4 + 7
        lo, hi = split[rank], split[rank + 1]
        mesh = init_device_mesh("cpu", (WORLD,))
        for name, beta in CASES:
            tag = f"{name}_{beta}"
            zs = z.clone().requires_grad_()
            want = lk.full_kl(zs, topk, mask, divergence=name, beta=beta, sampling=lk.Sampling(temperature=0.7))
            fin = torch.isfinite(want) & mask
            gz, = torch.autograd.grad(want.masked_fill(~fin, 0).sum(), zs)
            # plain local shards (lk.VocabShard)
            local = z[..., lo:hi].clone().requires_grad_()
            got = lk.full_kl(lk.VocabShard(local, None, lo), topk, mask, divergence=name, beta=beta, sampling=lk.Sampling(temperature=0.7))
            errors[f"shard_value_{tag}"] = _err(got.masked_fill(~fin, 0), want.masked_fill(~fin, 0))
            g_local, = torch.autograd.grad(got.masked_fill(~fin, 0).sum(), local)
            errors[f"shard_grad_{tag}"] = _err(g_local, gz[..., lo:hi])
            # a DTensor Shard(-1) (torch's split: 6 + 5)
            dz = distribute_tensor(z.clone(), mesh, [Shard(-1)]).requires_grad_()
            got = lk.full_kl(dz, topk, mask, divergence=name, beta=beta, sampling=lk.Sampling(temperature=0.7))
            errors[f"dtensor_value_{tag}"] = _err(got.masked_fill(~fin, 0), want.masked_fill(~fin, 0))
            g_dt, = torch.autograd.grad(got.masked_fill(~fin, 0).sum(), dz)
            errors[f"dtensor_grad_{tag}"] = _err(g_dt.full_tensor(), gz)
            # a column-parallel head's rows
            hs, Ws = h.clone().requires_grad_(), W.clone().requires_grad_()
            want_h = lk.full_kl(lk.FromHidden(hs, Ws), topk, mask, divergence=name, beta=beta)
            gh, gW = torch.autograd.grad(want_h.sum(), (hs, Ws))
            hl, Wl = h.clone().requires_grad_(), W[lo:hi].clone().requires_grad_()
            got_h = lk.full_kl(lk.FromHidden(hl, lk.VocabShard(Wl, None, lo)), topk, mask, divergence=name, beta=beta)
            errors[f"head_value_{tag}"] = _err(got_h, want_h)
            ghl, gWl = torch.autograd.grad(got_h.sum(), (hl, Wl))
            errors[f"head_grad_h_{tag}"] = _err(ghl, gh)
            errors[f"head_grad_w_{tag}"] = _err(gWl, gW[lo:hi])
        # an id no shard owns: refused on every rank (after the ownership count's all-reduce)
        bad = lk.TopK(topk.ids.clone(), topk.logprobs)
        bad.ids[1, 2, 0] = V
        try:
            lk.full_kl(lk.VocabShard(z[..., lo:hi], None, lo), bad, mask)
        except ValueError as err:
            raised["unowned"] = str(err)
        # a payload error: every rank finds it alike, before any collective
        dup = lk.TopK(topk.ids.clone(), topk.logprobs)
        dup.ids[0, 0, 1] = dup.ids[0, 0, 0]
        try:
            lk.full_kl(lk.VocabShard(z[..., lo:hi], None, lo), dup, mask)
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
    found = run_ddp_worker(Path(__file__), tmp_path_factory.mktemp("topk_shards"), world=WORLD, timeout=240)
    for record in found:
        assert "failure" not in record, record["failure"]
    return found


def test_a_split_student_matches_one_process_in_value_and_gradient(records: list[dict[str, Any]]) -> None:
    for record in records:
        errors = record["errors"]
        assert len(errors) == 7 * len(CASES)
        bad = {k: v for k, v in errors.items() if not v <= 1e-12}
        assert not bad, (record["rank"], bad)


def test_every_rank_refuses_an_unowned_id_and_a_duplicate_alike(records: list[dict[str, Any]]) -> None:
    for record in records:
        assert "owned by 0 vocabulary shards" in record["raised"]["unowned"]
        assert "twice in the row at position (0, 0)" in record["raised"]["duplicate"]


if __name__ == "__main__":
    torch.multiprocessing.spawn(_main, args=(sys.argv[1],), nprocs=WORLD, join=True)
