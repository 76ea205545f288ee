"""Replay on a vocabulary split over 2 CPU processes (gloo), against one process on the whole logits.

``python tests/_replay_shard_worker.py OUT_DIR`` spawns 2 processes (a file store in OUT_DIR: no port);
each builds the same float64 logits, records the kept sets of a top-p rollout on the whole logits, moves
the policy, and replays the record on its shard of the new logits (``lk.VocabShard``: splits 6 + 5,
3 + 8 and 11 + 0) and of a column-parallel head, for the token log-probs, the entropy and the exact divergences
(``lk.full_kl(..., kept=)``, ``KLPenaltyLoss("full")(..., kept=)``); it writes ``OUT_DIR/rank{r}.json``:
``{"rank", "errors": {check: max abs error against one process}, "raised": {check: message}}``.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from _ddp import finish_worker

WORLD = 2
B, T, V, D = 3, 7, 11, 5


def _err(errors: dict[str, float], name: str, got: Tensor, want: Tensor) -> None:
    got, want = got.detach().double(), want.detach().double()
    same = bool((got.isfinite() == want.isfinite()).all())
    diff = (got - want).nan_to_num(0.0).abs()
    errors[name] = (float(diff.max()) if diff.numel() else 0.0) if same else float("inf")


def run_checks(rank: int, errors: dict[str, float], raised: dict[str, str]) -> None:
    import lightning_kl as lk
    from lightning_kl.ground.kept import KeptSets
    from lightning_kl.ground.sampler import process_scores

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(3)
    s = lk.Sampling(0.8, top_p=0.7)
    old = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    probs = torch.softmax(process_scores(old / 0.8, s), -1).view(-1, V)
    y = torch.multinomial(probs, 1, generator=g).view(B, T)
    y[2, 5] = -100
    _, kept = lk.token_logprobs(old, y, sampling=s, ignore_index=-100, return_kept=True)
    new = old + torch.randn(B, T, V, generator=g, dtype=torch.float64) - 20  # kept logits < 0: a shard with none in a row shifts by 0, not by them
    gout = torch.randn(B, T, generator=g, dtype=torch.float64)
    whole = new.clone().requires_grad_()
    want, want_kept = lk.token_logprobs(whole, y, sampling=s, ignore_index=-100, kept=kept, return_log_kept=True, chunk_size=4)
    (want * gout).sum().backward()
    want_h = lk.token_entropy(new, y != -100, sampling=s, kept=kept)
    errors["finite_off_policy"] = 0.0 if bool(want.isfinite().all()) else float("inf")
    for split in (6, 3, 11):
        start, stop = (0, split) if rank == 0 else (split, V)
        loc = new[..., start:stop].clone().requires_grad_()
        lp, log_kept = lk.token_logprobs(lk.VocabShard(loc, group, start), y, sampling=s, ignore_index=-100, kept=kept,
                                         return_log_kept=True, chunk_size=4)
        (lp * gout).sum().backward()
        _err(errors, f"logprobs_{split}", lp, want)
        _err(errors, f"log_kept_{split}", log_kept, want_kept)
        _err(errors, f"grad_{split}", loc.grad, whole.grad[..., start:stop])
        h = lk.token_entropy(lk.VocabShard(new[..., start:stop], group, start), y != -100, sampling=s, kept=kept)
        _err(errors, f"entropy_{split}", h, want_h)
    # a column-parallel head (rows 0..5 and 6..10 of the head), its gradients against one process
    hid = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * 2
    leaves = [hid.clone().requires_grad_(), w.clone().requires_grad_()]
    ref = lk.token_logprobs(lk.FromHidden(*leaves), y, sampling=s, ignore_index=-100, kept=kept)
    (ref * gout).sum().backward()
    start, stop = (0, 6) if rank == 0 else (6, V)
    mine = [hid.clone().requires_grad_(), w[start:stop].clone().requires_grad_()]
    lp = lk.token_logprobs(lk.FromHidden(mine[0], lk.VocabShard(mine[1], group, start)), y, sampling=s, ignore_index=-100, kept=kept)
    (lp * gout).sum().backward()
    _err(errors, "head_logprobs", lp, ref)
    _err(errors, "head_grad_hidden", mine[0].grad, leaves[0].grad)
    _err(errors, "head_grad_weight", mine[1].grad, leaves[1].grad[start:stop])
    # the exact divergences on the replayed sets (full_kl's engine): each split's values and both sides' gradients
    ref_new = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    valid = y != -100
    for reference, name, beta in (("unprocessed", "reverse", None), ("policy_kept", "forward", None), ("unprocessed", "jsd", 0.3)):
        a, b = new.clone().requires_grad_(), ref_new.clone().requires_grad_()
        want = lk.full_kl(a, b, valid, sampling=s, reference=reference, divergence=name, beta=beta, kept=kept, chunk_size=4)
        (want * gout).sum().backward()
        for split in (6, 3, 11):
            start, stop = (0, split) if rank == 0 else (split, V)
            la, lb = new[..., start:stop].clone().requires_grad_(), ref_new[..., start:stop].clone().requires_grad_()
            got = lk.full_kl(lk.VocabShard(la, group, start), lk.VocabShard(lb, group, start), valid, sampling=s, reference=reference,
                             divergence=name, beta=beta, kept=kept, chunk_size=4)
            (got * gout).sum().backward()
            _err(errors, f"full_{name}_{split}", got, want)
            _err(errors, f"full_{name}_grad_{split}", la.grad, a.grad[..., start:stop])
            _err(errors, f"full_{name}_ref_grad_{split}", lb.grad, b.grad[..., start:stop])
    # KLPenaltyLoss("full") with the record on a split (a truncating sampler is refused there without one)
    loss = lk.KLPenaltyLoss("full", coef=1.0, sampling=s)
    start, stop = (0, 6) if rank == 0 else (6, V)
    _err(errors, "loss_split", loss(lk.VocabShard(new[..., start:stop], group, start), lk.VocabShard(ref_new[..., start:stop], group, start),
                                    valid, kept=kept), loss(new, ref_new, valid, kept=kept))
    # a column-parallel head for both models (a recorded set is read by each shard's columns)
    rhid = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    rw = torch.randn(V, D, generator=g, dtype=torch.float64) * 2
    whole = [hid.clone().requires_grad_(), w.clone().requires_grad_()]
    want = lk.full_kl(lk.FromHidden(*whole), lk.FromHidden(rhid, rw), valid, sampling=s, reference="policy_kept", kept=kept)
    (want * gout).sum().backward()
    mine = [hid.clone().requires_grad_(), w[start:stop].clone().requires_grad_()]
    got = lk.full_kl(lk.FromHidden(mine[0], lk.VocabShard(mine[1], group, start)), lk.FromHidden(rhid, lk.VocabShard(rw[start:stop], group, start)),
                     valid, sampling=s, reference="policy_kept", kept=kept)
    (got * gout).sum().backward()
    _err(errors, "full_head", got, want)
    _err(errors, "full_head_grad_hidden", mine[0].grad, whole[0].grad)
    _err(errors, "full_head_grad_weight", mine[1].grad, whole[1].grad[start:stop])
    try:  # the reference's own processing needs whole rows
        lk.full_kl(lk.VocabShard(new[..., start:stop], group, start), lk.VocabShard(ref_new[..., start:stop], group, start), valid,
                   sampling=s, reference="processed", kept=kept)
    except ValueError as err:
        raised["processed"] = str(err)
    # a sampled token missing from its own set: every rank raises, naming it
    mask = kept.to_mask()
    mask[1, 4, y[1, 4]] = False
    try:
        lk.token_logprobs(lk.VocabShard(new[..., :6] if rank == 0 else new[..., 6:], group, 0 if rank == 0 else 6), y,
                          sampling=s, ignore_index=-100, kept=KeptSets.from_mask(mask))
    except ValueError as err:
        raised["missing"] = str(err)


def _main(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    errors: dict[str, float] = {}
    raised: dict[str, str] = {}
    record: dict[str, Any] = {"rank": rank}
    try:
        run_checks(rank, errors, raised)
    except BaseException:
        record["failure"] = traceback.format_exc()
    record.update(errors=errors, raised=raised)
    Path(out, f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    finish_worker()


if __name__ == "__main__":
    torch.multiprocessing.spawn(_main, args=(sys.argv[1],), nprocs=WORLD, join=True)
