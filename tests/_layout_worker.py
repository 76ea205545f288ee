"""Data parallel layouts and sharded references on 4 CPU processes (gloo): every rank decides alike.

``python tests/_layout_worker.py OUT_DIR`` spawns 4 processes (a file store in OUT_DIR: no port to
collide with another run; a 60 s collective timeout turns a hang into an error). Each runs every
check below in order, on float64 data, and writes ``OUT_DIR/rank{r}.json``:
``{"rank", "world_size", "values": {check: number or list}, "raised": {check: "Type: message"}}``.
``tests/test_layouts.py`` compares the values with one process over the same data (the functions
here build it) and asserts that every refusal is raised on every rank, with the same message.

The order matters: process groups outlive the checks that make them, so the layouts come in the
order in which discovery would see them (no mesh, plain groups, a hybrid-sharded mesh, a mesh with a
model parallel dimension, one with a ``"data_parallel"`` dimension).
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from _ddp import finish_worker

WORLD = 4
T = 6
F64 = torch.float64
#: valid tokens per row of each batch (index: the rank, or the data parallel replica): unequal counts
LENGTHS = [(6, 2), (0, 3), (5, 5), (1, 0)]
VOCAB, SPLIT = 10, (0, 3, 6, 9, 10)  # a vocabulary split unevenly over the 4 ranks (3, 3, 3, 1)


def batch(index: int) -> tuple[Tensor, Tensor, Tensor]:
    """The float64 log-probs, reference log-probs and mask of batch ``index``."""
    g = torch.Generator().manual_seed(1000 + index)
    lp = -torch.rand(2, T, generator=g, dtype=F64) * 3 - 0.05
    ref = -torch.rand(2, T, generator=g, dtype=F64) * 3 - 0.05
    mask = torch.arange(T).expand(2, T) < torch.tensor(LENGTHS[index]).unsqueeze(1)
    return lp, ref, mask


def k3(lp: Tensor, ref: Tensor) -> Tensor:
    """k3 per token from the formula: exp(ref - lp) - 1 - (ref - lp)."""
    d = ref - lp
    return torch.expm1(d) - d


def logits() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Float64 policy and reference logits ``[2, T, V]`` (row [0, 1] -inf everywhere), tokens, mask (False there)."""
    g = torch.Generator().manual_seed(7)
    z = torch.randn(2, T, VOCAB, generator=g, dtype=F64) * 2
    zr = torch.randn(2, T, VOCAB, generator=g, dtype=F64) * 2
    tokens = torch.tensor([[0, 2, 3, 5, 6, 9], [9, 8, 1, 3, 6, 2]])
    mask = torch.ones(2, T, dtype=torch.bool)
    return z, zr, tokens, mask


def with_inf_row(z: Tensor) -> tuple[Tensor, Tensor]:
    """``z`` with row [0, 1] -inf over the whole vocabulary (so on every rank's shard), and the mask without it."""
    z = z.clone()
    z[0, 1] = -float("inf")
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[0, 1] = False
    return z, mask


def models(seed: int) -> nn.Module:
    """A small model: an even first layer (8 rows over 4 ranks) and an uneven last one (5 rows: 2, 2, 1, 0)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 5)).to(F64)


class Holder(nn.Module):
    def __init__(self, policy: nn.Module, ref: nn.Module) -> None:
        super().__init__()
        self.policy, self.ref = policy, ref


def run_checks(rank: int, values: dict[str, Any], raised: dict[str, str]) -> None:
    import lightning_kl as lk
    from lightning_kl.ground.parallel import agree, data_parallel_group
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    world = dist.group.WORLD

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        try:
            values[name] = fn()
        except (ValueError, TypeError, RuntimeError) as err:
            raised[name] = f"{type(err).__name__}: {err}"

    def metric(data: tuple[Tensor, Tensor, Tensor], **kwargs: Any) -> list[float]:
        """compute() (its value and dtype) and the synced token count."""
        lp, ref, mask = data
        m = lk.KLMetric(**kwargs)
        m.update(k3(lp, ref), mask)
        value = m.compute()
        m.sync()
        count = int(m.count)
        m.unsync()
        return [float(value), str(value.dtype), count]

    def loss(data: tuple[Tensor, Tensor, Tensor], agg: str, **kwargs: Any) -> float:
        lp, ref, mask = data
        return float(lk.KLPenaltyLoss("k3", coef=1.0, agg=agg, global_batch=True, **kwargs)(lp, ref, mask))

    mine = batch(rank)

    # --- 1. plain DDP plus one group of the user's: ranks 0 and 1 hold it, ranks 2 and 3 do not
    dist.new_group([0, 1])
    attempt("ddp_extra_group_metric", lambda: metric(mine))
    attempt("ddp_extra_group_loss", lambda: loss(mine, "token-mean"))

    # --- 2. a data parallel group smaller than the world, given: {0, 1} and {2, 3}
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    half = halves[rank // 2]
    attempt("subgroup_metric", lambda: metric(mine, process_group=half))
    attempt("subgroup_loss_mean", lambda: loss(mine, "token-mean", process_group=half))
    attempt("subgroup_loss_sum", lambda: loss(mine, "token-sum", process_group=half))

    # --- 3. hybrid-sharded FSDP's mesh: every rank holds its own data
    init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("flat",))
    attempt("hsdp_metric_found", lambda: metric(mine))
    attempt("hsdp_metric_world", lambda: metric(mine, process_group=world))
    attempt("hsdp_metric_flat_mesh", lambda: metric(mine, device_mesh=flat))
    attempt("hsdp_loss_found", lambda: loss(mine, "token-mean"))
    attempt("hsdp_loss_world", lambda: loss(mine, "token-mean", process_group=world))
    attempt("hsdp_loss_flat_mesh", lambda: loss(mine, "token-mean", device_mesh=flat))

    # --- 4. a mesh with a tensor parallel dimension and no "data_parallel" one: found, it is refused
    # alike on every rank; given, the group wins
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    attempt("tp_mesh_metric_found", lambda: metric(mine))
    attempt("tp_mesh_loss_found", lambda: loss(mine, "token-sum"))
    attempt("tp_mesh_loss_given", lambda: loss(mine, "token-sum", device_mesh=tp_mesh["dp"]))

    # --- 5. Lightning's 2-D mesh: the tensor parallel ranks (same row) hold the same batch
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    replica = batch(mesh.get_local_rank("data_parallel"))
    attempt("dp_mesh_group", lambda: [data_parallel_group(device_mesh=mesh).size, dist.get_process_group_ranks(data_parallel_group(device_mesh=mesh).group)])
    attempt("dp_mesh_metric_given", lambda: metric(replica, device_mesh=mesh))
    attempt("dp_mesh_metric_found", lambda: metric(replica))
    attempt("dp_mesh_loss_given", lambda: loss(replica, "token-sum", device_mesh=mesh))
    attempt("dp_mesh_loss_found", lambda: loss(replica, "token-sum"))

    # --- 6. logits split over the vocabulary
    z, zr, tokens, mask = logits()
    lo, hi = SPLIT[rank], SPLIT[rank + 1]

    def shard(x: Tensor, group: Any, grad: bool = True) -> Any:
        return lk.VocabShard(x[..., lo:hi].detach().clone().requires_grad_(grad), group, lo)

    def none_and_world() -> list[Any]:
        pol, ref = shard(z, None), shard(zr, world, grad=False)
        kl = lk.full_kl(pol, ref, mask)
        kl.sum().backward()
        lp = lk.token_logprobs(shard(z, None), tokens)
        return [kl.tolist(), pol.local.grad.tolist(), lp.tolist()]

    attempt("vocab_none_and_world", none_and_world)

    def replicate_shard() -> list[Any]:
        # (Replicate(), Shard(-1)) on the 2-D mesh: the vocabulary over "tensor_parallel" (5 + 5)
        tp = mesh.get_local_rank("tensor_parallel")
        size, offset = Shard.local_shard_size_and_offset(VOCAB, 2, tp)
        local = z[..., offset : offset + size].detach().clone().requires_grad_()
        local_ref = zr[..., offset : offset + size].detach().clone()
        dz = DTensor.from_local(local, mesh, [Replicate(), Shard(-1)], run_check=False)
        dr = DTensor.from_local(local_ref, mesh, [Replicate(), Shard(-1)], run_check=False)
        lp = lk.token_logprobs(dz, tokens)
        kl = lk.full_kl(dz, dr, mask)
        (lp.sum() + kl.sum()).backward()
        return [lp.tolist(), kl.tolist(), offset, local.grad.tolist()]

    attempt("vocab_replicate_shard", replicate_shard)

    def inf_row() -> list[Any]:
        zi, mi = with_inf_row(z)
        pol = shard(zi, None)
        kl = lk.full_kl(pol, shard(zr, None, grad=False), mi)
        kl.sum().backward()
        lp = lk.token_logprobs(shard(zi, None), tokens)
        return [kl.tolist(), pol.local.grad.tolist(), [[None if v != v else v for v in row] for row in lp.tolist()]]

    attempt("vocab_inf_row", inf_row)
    attempt("vocab_split_reference_plain_policy", lambda: lk.full_kl(z, shard(zr, None, grad=False), mask).tolist())
    attempt("vocab_split_policy_plain_reference", lambda: lk.full_kl(shard(z, None), zr, mask).tolist())

    # --- 7. a refusal found on one rank only is raised on every rank
    attempt("agree_rank_1_only", lambda: agree("rank 1 found a problem" if rank == 1 else None))
    attempt("agree_none", lambda: agree(None))

    # --- 8. ReferenceRefresh with FSDP2-sharded models: the reference's shards on the policy's ranks
    ordered = DeviceMesh("cpu", [0, 1, 2, 3])
    same_ranks = DeviceMesh("cpu", [0, 1, 2, 3])  # another mesh object, the same processes
    other = DeviceMesh("cpu", [0, 2, 1, 3])  # same placements and local shapes of the even layer
    refresh = lk.ReferenceRefresh(every_n_steps=1, alpha=1.0)

    def sharded(mesh_policy: Any, mesh_ref: Any, layers: slice) -> Holder:
        policy, ref = models(1)[layers], models(2)[layers]
        fully_shard(policy, mesh=mesh_policy)
        fully_shard(ref, mesh=mesh_ref)
        return Holder(policy, ref)

    def refreshed(holder: Holder) -> float:
        refresh.refresh(holder)
        pol, ref = holder.policy.state_dict(), holder.ref.state_dict()
        return max(float((ref[k].full_tensor() - pol[k].full_tensor()).abs().max()) for k in pol)

    attempt("refresh_same_ranks", lambda: refreshed(sharded(ordered, same_ranks, slice(0, 2))))
    attempt("refresh_other_mesh_even", lambda: refreshed(sharded(ordered, other, slice(0, 1))))
    attempt("refresh_other_mesh_uneven", lambda: refreshed(sharded(ordered, other, slice(1, 2))))


def _main(rank: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    values: dict[str, Any] = {}
    raised: dict[str, str] = {}
    record: dict[str, Any] = {"rank": rank, "world_size": dist.get_world_size()}
    try:
        run_checks(rank, values, raised)
    except BaseException:
        record["failure"] = traceback.format_exc()
    record.update(values=values, raised=raised)
    Path(out, f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    finish_worker()


if __name__ == "__main__":
    torch.multiprocessing.spawn(_main, args=(sys.argv[1],), nprocs=WORLD, join=True)
