"""Every divergence on a vocabulary split over 2 CPU processes (gloo), against one process on the gathered inputs.

``python tests/_divergence_parallel_worker.py OUT_DIR`` spawns 2 processes (a file store in OUT_DIR: no
port); each builds the same float64 global inputs, takes its shard of the vocabulary and writes
``OUT_DIR/rank{r}.json``: ``{"rank", "errors": {check: max abs error}}`` (``inf`` where the NaN or the
infinite entries differ). The sources: DTensor ``Shard(-1)`` logits (uneven, 11 = 6 + 5) with NaN
padding and ``-inf`` policy entries on both ranks; ``lk.VocabShard`` logits where rank 1 holds no
vocabulary (11 + 0); a column-parallel head (``lk.VocabShard`` of its rows) with a logit scale and a
soft cap, and a bias. The divergences: forward, the JSD inside (0, 1) (its second read of each shard,
with the global log-sums) and the mixture, at two temperatures and chunk sizes; values and the
gradients of both sides (hidden states summed over the group), and ``KLPenaltyLoss("full",
divergence=...)``. The one-process side is itself tested against float64 formulas
(``tests/test_divergence_engine.py``).
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from _ddp import finish_worker

WORLD = 2
B, T, V, D = 3, 7, 11, 4
CASES = [("forward", None), ("jsd", 0.3), ("mixed", 0.6)]


def _close(errors: dict[str, float], name: str, got: Tensor, want: Tensor) -> None:
    got, want = got.detach().to(torch.float64), want.detach().to(torch.float64)
    assert got.shape == want.shape, (name, tuple(got.shape), tuple(want.shape))
    same_nan = bool((got.isnan() == want.isnan()).all())
    inf_ok = bool((got.isinf() == want.isinf()).all()) and bool((got[got.isinf()] == want[want.isinf()]).all())
    diff = (got - want).nan_to_num(0.0, posinf=0.0, neginf=0.0).abs()
    errors[name] = (float(diff.max()) if diff.numel() else 0.0) if same_nan and inf_ok else float("inf")


def run_checks(rank: int, errors: dict[str, float]) -> None:
    import lightning_kl as lk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    warnings.simplefilter("ignore")  # the other side requires grad on purpose
    mesh = init_device_mesh("cpu", (WORLD,))
    group = mesh.get_group(0)
    g = torch.Generator().manual_seed(11)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    zr = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    weights = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.arange(T).expand(B, T) < torch.tensor([7, 4, 0]).unsqueeze(1)
    zp = torch.where(mask.unsqueeze(-1), z, float("nan"))
    zp[0, 1, 2] = zp[0, 1, 8] = float("-inf")  # p = 0 on both ranks, q > 0: the forward KL is +inf there
    size, offset = Shard.local_shard_size_and_offset(V, WORLD, rank)

    def shard(x: Tensor, start: int, stop: int) -> Tensor:
        return x[..., start:stop].detach().clone().requires_grad_()

    def finite(v: Tensor) -> Tensor:
        return torch.where(v.isfinite(), v, 0.0) * weights

    for name, beta in CASES:
        for temperature, chunk in ((1.0, None), (0.7, 4)):
            s = lk.Sampling(temperature)
            tag = f"{name}_T{temperature}_chunk{chunk}"
            # DTensor logits, both sides with a gradient
            loc, loc_ref = shard(zp, offset, offset + size), shard(zr, offset, offset + size)
            dz = DTensor.from_local(loc, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
            dr = DTensor.from_local(loc_ref, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
            got = lk.full_kl(dz, dr, mask, sampling=s, divergence=name, beta=beta, chunk_size=chunk)
            finite(got).sum().backward()
            one_z, one_r = zp.clone().requires_grad_(), zr.clone().requires_grad_()
            want = lk.full_kl(one_z, one_r, mask, sampling=s, divergence=name, beta=beta)
            finite(want).sum().backward()
            _close(errors, f"dtensor_{tag}_value", got, want)
            _close(errors, f"dtensor_{tag}_grad", loc.grad, one_z.grad[..., offset : offset + size])
            _close(errors, f"dtensor_{tag}_grad_ref", loc_ref.grad, one_r.grad[..., offset : offset + size])
            # VocabShard logits, rank 1 without vocabulary (11 + 0), and the loss
            start, stop = (0, V) if rank == 0 else (V, V)
            loc, loc_ref = shard(z, start, stop), shard(zr, start, stop)
            loss_fn = lk.KLPenaltyLoss("full", coef=0.5, sampling=s, divergence=name, beta=beta)
            loss = loss_fn(lk.VocabShard(loc, group, start), lk.VocabShard(loc_ref, group, start), mask)
            loss.backward()
            one_z, one_r = z.clone().requires_grad_(), zr.clone().requires_grad_()
            one_fn = lk.KLPenaltyLoss("full", coef=0.5, sampling=s, divergence=name, beta=beta)
            one_loss = one_fn(one_z, one_r, mask)
            one_loss.backward()
            _close(errors, f"empty_shard_{tag}_loss", loss, one_loss)
            _close(errors, f"empty_shard_{tag}_grad", loc.grad, one_z.grad[..., start:stop])
            _close(errors, f"empty_shard_{tag}_grad_ref", loc_ref.grad, one_r.grad[..., start:stop])
            # a column-parallel head with a logit scale, a soft cap and a bias; NaN hidden states in the padding
            h = torch.where(mask.unsqueeze(-1), torch.randn(B, T, D, generator=g, dtype=torch.float64), float("nan"))
            hr = torch.randn(B, T, D, generator=g, dtype=torch.float64)
            w, wr = torch.randn(V, D, generator=g, dtype=torch.float64) * 2, torch.randn(V, D, generator=g, dtype=torch.float64) * 2
            bias = torch.randn(V, generator=g, dtype=torch.float64)
            rows = slice(offset, offset + size)
            head = dict(logit_scale=0.9, softcap=4.0)
            leaves = [x.clone().requires_grad_() for x in (h, w[rows], bias[rows], hr, wr[rows])]
            got = lk.full_kl(
                lk.FromHidden(leaves[0], lk.VocabShard(leaves[1], group, offset), leaves[2], **head),
                lk.FromHidden(leaves[3], lk.VocabShard(leaves[4], group, offset), **head),
                mask, sampling=s, divergence=name, beta=beta, chunk_size=chunk,
            )
            finite(got).sum().backward()
            one = [x.clone().requires_grad_() for x in (h, w, bias, hr, wr)]
            want = lk.full_kl(lk.FromHidden(one[0], one[1], one[2], **head), lk.FromHidden(one[3], one[4], **head), mask, sampling=s, divergence=name, beta=beta)
            finite(want).sum().backward()
            _close(errors, f"head_{tag}_value", got, want)
            for i, what in enumerate(("hidden", "weight", "bias", "ref_hidden", "ref_weight")):
                expect = one[i].grad if what in ("hidden", "ref_hidden") else one[i].grad[rows]
                _close(errors, f"head_{tag}_grad_{what}", leaves[i].grad, expect)


def _main(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    errors: dict[str, float] = {}
    record: dict[str, Any] = {"rank": rank}
    try:
        run_checks(rank, errors)
    except BaseException:
        record["failure"] = traceback.format_exc()
    record["errors"] = errors
    Path(out, f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    finish_worker()


if __name__ == "__main__":
    torch.multiprocessing.spawn(_main, args=(sys.argv[1],), nprocs=WORLD, join=True)
