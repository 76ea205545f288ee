"""Replay through the exact divergence: ``lk.full_kl(..., kept=)``, ``KLPenaltyLoss("full")(..., kept=)`` and
``lk.kl_penalty(..., "full", kept=)``, the policy renormalized on the rollout's recorded kept sets.

Against: today's processed divergence (on-policy, the record being the policy's own kept sets: the same bits,
value and gradients of both sides, every reference and divergence), float64 maths written from the formulas
(off-policy: the policy's ``log_softmax`` of ``z / T`` with ``-inf`` off the recorded set, the reference's by
``reference=``, then :func:`test_divergence_engine.dense_divergence` and autograd for every gradient), records
built by hand (ties, a record that leaves out the current top), the refusals, and a real Lightning Trainer loop
against a plain one. Vocabulary shards: ``tests/_replay_shard_worker.py`` (``test_replay.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.ground.kept import KeptSets
from lightning_kl.logprobs import REFERENCES

from test_divergence_engine import CASES, HEAD, dense_divergence  # noqa: E402
from test_engine_matrix import processed_scores  # noqa: E402
from test_replay import IDS, SAMPLERS, rollout  # noqa: E402

B, L, V, D = 3, 7, 29, 5
F64 = torch.float64
NINF = float("-inf")

pytestmark = pytest.mark.filterwarnings("ignore:`ref_")  # the other side requires grad on purpose


def _leaves(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "z": (3 * torch.randn(B, L, V, generator=g)).to(dtype),
        "zr": (3 * torch.randn(B, L, V, generator=g)).to(dtype),
        "h": torch.randn(B, L, D, generator=g).to(dtype),
        "w": (2 * torch.randn(V, D, generator=g)).to(dtype),
        "b": torch.randn(V, generator=g).to(dtype),
        "rh": torch.randn(B, L, D, generator=g).to(dtype),
        "rw": (2 * torch.randn(V, D, generator=g)).to(dtype),
    }


def _inputs(source: str, x: dict[str, Tensor], grad: bool = True) -> tuple[list[Tensor], Any, Any]:
    """Fresh leaves (policy's, then the reference's) and both engine inputs of ``source``."""
    if source in ("hidden", "softcap"):
        cap = HEAD if source == "softcap" else {}
        pol = [x[k].clone().requires_grad_(grad) for k in ("h", "w", "b")]
        oth = [x[k].clone().requires_grad_(grad) for k in ("rh", "rw")]
        return pol + oth, lk.FromHidden(*pol, **cap), lk.FromHidden(*oth, **cap)
    pol, oth = x["z"].clone().requires_grad_(grad), x["zr"].clone().requires_grad_(grad)
    if source == "strided":  # logits[:, :-1] of a [L + 1, B, V] buffer: read in place, not viewable flat
        def strided(t: Tensor) -> Tensor:
            return torch.cat([t, t[:, :1]], 1).transpose(0, 1).contiguous().transpose(0, 1)[:, :-1]

        return [pol, oth], strided(pol), strided(oth)
    return [pol, oth], pol, oth


def _logits(source: str, x: dict[str, Tensor]) -> Tensor:
    """The policy's logits of ``source`` (no grad)."""
    if source in ("hidden", "softcap"):
        a = F.linear(x["h"], x["w"], x["b"]).float()
        return HEAD["softcap"] * torch.tanh(HEAD["logit_scale"] * a / HEAD["softcap"]) if source == "softcap" else a
    return x["z"].float()


# ---------------------------------------------------------------------------------------------
# on-policy: the record is the policy's own kept set, and replay is today's divergence, the same bits


ON = {k: kw for k, kw in zip(IDS, SAMPLERS) if k in ("top_p_tiny", "T+k+p+min_p", "T_small+k")}


@pytest.mark.parametrize("kw", list(ON.values()), ids=list(ON))
@pytest.mark.parametrize("source", ["logits", "strided", "chunks", "bf16", "hidden", "softcap"])
def test_on_policy_replay_is_todays_divergence_bitwise_for_every_reference_and_divergence(kw, source):
    s = lk.Sampling(**kw)
    x = _leaves(1, torch.bfloat16 if source == "bf16" else torch.float32)
    chunk = 2 if source == "chunks" else None
    y = rollout(_logits(source, x), s, seed=2)
    _, kept = lk.token_logprobs(_inputs(source, x, False)[1], y, sampling=s, return_kept=True)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 3:] = False
    gout = torch.randn(B, L, generator=torch.Generator().manual_seed(3))
    for reference in REFERENCES:
        for name, beta in CASES if source == "logits" else [("reverse", None), ("forward", None), ("jsd", 0.3)]:
            kw2 = dict(sampling=s, reference=reference, divergence=name, beta=beta, chunk_size=chunk)
            leaves1, a, ar = _inputs(source, x)
            want = lk.full_kl(a, ar, mask, **kw2)
            leaves2, b, br = _inputs(source, x)
            got = lk.full_kl(b, br, mask, kept=kept, **kw2)
            assert torch.equal(got, want), (reference, name, beta)
            w = gout.where(want.isfinite(), 0)  # no gradient through a +inf value (it raises)
            (want.where(want.isfinite(), 0) * w).sum().backward()
            (got.where(got.isfinite(), 0) * w).sum().backward()
            for l1, l2 in zip(leaves1, leaves2):
                assert torch.equal(l1.grad, l2.grad), (reference, name, beta)


# ---------------------------------------------------------------------------------------------
# off-policy: finite where defined, exact values and gradients of both sides against float64


def dense_replay(z: Tensor, zr: Tensor, keep: Tensor, s: lk.Sampling, reference: str) -> tuple[Tensor, Tensor]:
    """float64 log-probs of both sides: the policy's ``softmax(z / T)`` on the recorded ``keep``; the reference's
    softmax (``"unprocessed"``), on ``keep`` (``"policy_kept"``) or processed by ``s`` (``"processed"``)."""
    lp = (z / s.temperature).masked_fill(~keep, NINF).log_softmax(-1)
    if reference == "processed":
        return lp, processed_scores(zr, s).log_softmax(-1)
    ref = zr / s.temperature
    return lp, (ref.masked_fill(~keep, NINF) if reference == "policy_kept" else ref).log_softmax(-1)


#: off-policy samplers by source (the kept sets themselves are test_replay.py's); "T" alone: an engine's record
OFF = {
    "logits": [dict(temperature=1.3, top_k=8, top_p=0.9, min_p=0.02), dict(top_k=5), dict(temperature=0.6)],
    "hidden": [dict(temperature=0.7, top_p=0.9)],
    "softcap": [dict(min_p=0.1)],
}


def check_off_policy(source: str, s: lk.Sampling, reference: str, name: str, beta: Optional[float], chunk: Optional[int] = 3) -> None:
    old = _leaves(4, F64)
    y = rollout(_logits(source, old), s, seed=5)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2, 1] = False
    _, kept = lk.token_logprobs(_inputs(source, old, False)[1], y, sampling=s, return_kept=True)
    if kept is None:  # a sampler that keeps every token: an engine's record of its own (a third of each row)
        kept = KeptSets.from_mask(torch.rand(B, L, V, generator=torch.Generator().manual_seed(6)) < 0.3)
        kept = KeptSets(kept.ids, kept.offsets, kept.shape, V, s.temperature)
    keep = kept.to_mask()
    keep[0, 5] = False  # a masked position may hold any set, the empty one included
    rec = KeptSets.from_mask(keep)
    kept = KeptSets(rec.ids, rec.offsets, (B, L), V, s.temperature)
    g = torch.Generator().manual_seed(7)
    new = {k: v + torch.randn(v.shape, generator=g, dtype=F64) for k, v in old.items()}  # the policy (and the data) moved
    leaves, a, ar = _inputs(source, new)
    if source in ("hidden", "softcap"):  # NaN hidden states at masked rows: value and gradient exactly 0
        dirty = [leaves[0].detach().masked_fill(~mask.unsqueeze(-1), float("nan")).requires_grad_()] + leaves[1:3]
        dirty_r = [leaves[3].detach().masked_fill(~mask.unsqueeze(-1), float("nan")).requires_grad_(), leaves[4]]
        cap = HEAD if source == "softcap" else {}
        a, ar = lk.FromHidden(*dirty, **cap), lk.FromHidden(*dirty_r, **cap)
        engine_leaves = dirty + dirty_r
    else:
        engine_leaves = [leaves[0].detach().masked_fill(~mask.unsqueeze(-1), float("nan")).requires_grad_(), leaves[1]]
        a, ar = engine_leaves
    got = lk.full_kl(a, ar, mask, sampling=s, reference=reference, divergence=name, beta=beta, chunk_size=chunk, kept=kept)
    # dense float64 from clean leaves
    clean, da, dr = _inputs(source, new)
    z = F.linear(*clean[:3]) if source in ("hidden", "softcap") else clean[0]
    zr = F.linear(*clean[3:]) if source in ("hidden", "softcap") else clean[1]
    if source == "softcap":
        z, zr = (HEAD["softcap"] * torch.tanh(HEAD["logit_scale"] * t / HEAD["softcap"]) for t in (z, zr))
    lp, lq = dense_replay(z, zr, keep | ~mask.unsqueeze(-1), s, reference)  # (masked rows: any set, kept out of autograd's NaN)
    want = dense_divergence(lp, lq, name, beta).where(mask, 0)
    assert (got[~mask] == 0).all()
    finite = want.isfinite()
    assert torch.equal(finite, got.isfinite()) and torch.equal(want[~finite], got[~finite])
    if (name == "reverse" and reference != "processed") or (name == "jsd" and 0 < beta < 1) or reference == "policy_kept":
        assert finite[mask].all()  # finite wherever the other side's support covers the recorded set
    assert_close(got[finite], want[finite].detach(), rtol=1e-10, atol=1e-12)
    w = torch.randn(B, L, generator=torch.Generator().manual_seed(8), dtype=F64).where(finite, 0)
    grads = torch.autograd.grad((w * got.where(finite, 0)).sum(), engine_leaves)
    safe = dense_divergence(lp, lq, name, beta, True).where(mask, 0)
    expect = torch.autograd.grad((w * safe.where(finite, 0)).sum(), clean)
    for gg, e in zip(grads, expect):
        assert torch.isfinite(gg).all() and torch.isfinite(e).all()
        assert_close(gg, e, rtol=1e-9, atol=1e-12)
    if source not in ("hidden", "softcap"):
        assert (grads[0][~mask] == 0).all()
        # off the recorded set the policy has no mass: its logits there get no gradient
        assert (grads[0][mask.unsqueeze(-1).expand_as(keep) & ~keep] == 0).all()


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("source", list(OFF))
def test_off_policy_replay_is_exact_against_float64_for_every_reference_and_divergence(source, reference):
    for kw in OFF[source]:
        for name, beta in CASES:
            check_off_policy(source, lk.Sampling(**kw), reference, name, beta)


@pytest.mark.parametrize("name,beta", [("reverse", None), ("forward", None), ("jsd", 0.3), ("mixed", 0.25)])
def test_a_head_tiles_the_vocabulary_under_replay_and_processed_keeps_whole_rows(monkeypatch, name, beta):
    """Tiles of 4 columns at chunks of 3 rows: the recorded set is read by each tile's columns, the parts merge
    (the JSD reads them again); the reference's own processing ("processed") needs whole rows: one tile."""
    from lightning_kl.kernels import engine

    counts: list[int] = []
    real = engine.Source.tiles
    monkeypatch.setattr(engine, "HIDDEN_CPU_TILE_ELEMENTS", 12)
    monkeypatch.setattr(engine.Source, "tiles", lambda self, *a: counts.append(len(real(self, *a))) or real(self, *a))
    s = lk.Sampling(0.8, top_p=0.75)
    for reference in REFERENCES:
        counts.clear()
        for source in ("hidden", "softcap"):
            check_off_policy(source, s, reference, name, beta)
        assert max(counts) == (1 if reference == "processed" else -(-V // 4)), reference


def test_a_record_that_leaves_out_the_current_top_is_exact_at_a_small_temperature():
    # off-policy the current argmax can lie outside the record: the shift is the largest recorded logit
    z = torch.tensor([[50.0, 1.0, 0.5, -3.0]], dtype=F64, requires_grad=True)
    zr = torch.tensor([[0.2, 0.1, 0.3, -0.5]], dtype=F64, requires_grad=True)
    kept = KeptSets(torch.tensor([1, 2]), torch.tensor([0, 2]), (1,), 4)
    keep = torch.tensor([[False, True, True, False]])
    s = lk.Sampling(0.01, top_k=1)
    for reference in ("unprocessed", "policy_kept"):
        for name, beta in CASES:
            got = lk.full_kl(z, zr, sampling=s, reference=reference, divergence=name, beta=beta, kept=kept)
            lp, lq = dense_replay(z, zr, keep, s, reference)
            want = dense_divergence(lp, lq, name, beta)
            assert torch.equal(got.isfinite(), want.isfinite())
            if want.isfinite().all():
                assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
                gz, gr = torch.autograd.grad(got.sum(), (z, zr))
                ez, er = torch.autograd.grad(want.sum(), (z, zr))
                assert_close(gz, ez, rtol=1e-9, atol=1e-12) and assert_close(gr, er, rtol=1e-9, atol=1e-12)
                assert gz[0, 0] == 0 and gz[0, 3] == 0


def test_ties_at_the_boundary_follow_the_recorded_set_not_a_recomputed_one():
    # top-k 2 on [3, 1, 1, 0]: generate keeps both tied 1s (3 tokens); an engine that broke the tie kept {0, 1}
    z = torch.tensor([[3.0, 1.0, 1.0, 0.0]], dtype=F64, requires_grad=True)
    zr = torch.tensor([[0.0, 0.5, 1.0, 2.0]], dtype=F64)
    s = lk.Sampling(top_k=2)
    engine = KeptSets(torch.tensor([0, 1]), torch.tensor([0, 2]), (1,), 4)
    keep = torch.tensor([[True, True, False, False]])
    got = lk.full_kl(z, zr, sampling=s, kept=engine, reference="policy_kept")
    lp, lq = dense_replay(z.detach(), zr, keep, s, "policy_kept")
    assert_close(got, dense_divergence(lp, lq, "reverse", None), rtol=0, atol=1e-15)
    assert not torch.equal(got, lk.full_kl(z, zr, sampling=s, reference="policy_kept"))  # the recomputed set: 3 tokens
    got.backward()
    assert z.grad[0, 2] == 0 and z.grad[0, 3] == 0  # the tied token outside the record: no mass, no gradient


# ---------------------------------------------------------------------------------------------
# a served teacher's top-k (lk.TopK): the student's cells on the recorded sets


@pytest.mark.parametrize("name,beta", [("reverse", None), ("forward", None), ("jsd", 0.3)])
def test_a_topk_teacher_scores_the_student_on_the_recorded_sets(name, beta):
    s = lk.Sampling(0.8, top_p=0.75)
    x = _leaves(12, F64)
    y = rollout(x["z"], s, seed=13)
    _, kept = lk.token_logprobs(x["z"], y, sampling=s, return_kept=True)
    ids = torch.topk(x["zr"], 4, dim=-1).indices
    topk = lk.TopK(ids, torch.log_softmax(x["zr"], -1).gather(-1, ids))
    kw = dict(divergence=name, beta=beta)
    # on-policy: the sampler's own sets, the same bits
    a, b = x["z"].clone().requires_grad_(), x["z"].clone().requires_grad_()
    want, got = lk.full_kl(a, topk, sampling=s, **kw), lk.full_kl(b, topk, sampling=s, kept=kept, **kw)
    assert torch.equal(got, want)
    fin = want.isfinite()
    (want.where(fin, 0).sum()).backward(), (got.where(fin, 0).sum()).backward()
    assert torch.equal(a.grad, b.grad)
    # off-policy: the student's softmax on the recorded sets, as its logits with -inf off them (no truncation)
    new = x["z"] + torch.randn(x["z"].shape, generator=torch.Generator().manual_seed(14), dtype=F64)
    c, e = new.clone().requires_grad_(), new.clone().requires_grad_()
    got = lk.full_kl(c, topk, sampling=s, kept=kept, **kw)
    want = lk.full_kl(e.masked_fill(~kept.to_mask(), NINF), topk, sampling=lk.Sampling(0.8), **kw)
    fin = want.isfinite()
    assert torch.equal(fin, got.isfinite())
    assert_close(got[fin], want[fin], rtol=1e-12, atol=1e-13)
    (got.where(fin, 0).sum()).backward(), (want.where(fin, 0).sum()).backward()
    assert_close(c.grad, e.grad, rtol=1e-10, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# what is refused, at call time, named


def test_refusals_name_the_record_and_the_combination():
    s = lk.Sampling(top_p=0.8)
    x = _leaves(9)
    y = rollout(x["z"], s)
    _, kept = lk.token_logprobs(x["z"], y, sampling=s, return_kept=True)
    mask = torch.ones(B, L, dtype=torch.bool)
    keep = kept.to_mask()
    keep[1, 2] = False
    empty = KeptSets.from_mask(keep)
    with pytest.raises(ValueError, match=r"empty set at position \(1, 2\)"):
        lk.full_kl(x["z"], x["zr"], mask, sampling=s, kept=empty)
    mask[1, 2] = False
    lk.full_kl(x["z"], x["zr"], mask, sampling=s, kept=empty)  # a masked position may hold the empty set
    with pytest.raises(ValueError, match=r"positions of shape \(3, 7\), but the tokens have shape \(3, 6\)"):
        lk.full_kl(x["z"][:, :6], x["zr"][:, :6], sampling=s, kept=kept)
    with pytest.raises(ValueError, match="recorded by a sampler at temperature 1.0, but it is replayed at 0.7"):
        lk.full_kl(x["z"], x["zr"], sampling=lk.Sampling(0.7, top_p=0.8), kept=kept)
    with pytest.raises(TypeError, match="`kept` must be the kept sets returned with return_kept=True"):
        lk.full_kl(x["z"], x["zr"], sampling=s, kept=keep)
    topk = lk.TopK(torch.zeros(B, L, 2, dtype=torch.long) + torch.tensor([0, 1]), torch.full((B, L, 2), -1.0))
    with pytest.raises(ValueError, match="reference='policy_kept' with a truncating sampler \\(or a replayed kept set\\)"):
        lk.full_kl(x["z"], topk, sampling=lk.Sampling(0.7), kept=KeptSets(kept.ids, kept.offsets, kept.shape, V), reference="policy_kept")
    with pytest.raises(ValueError, match="applies to estimator='full'"):
        lk.KLPenaltyLoss("k3")(torch.full((B, L), -1.0), torch.full((B, L), -1.0), mask, kept=kept)
    assert lk.KLPenaltyLoss("full", sampling=s, divergence="jsd", beta=0.3)(x["z"], x["zr"], mask, kept=kept).isfinite()
    with pytest.raises(ValueError, match="holds the forward KL"):
        lk.KLPenaltyLoss("full", divergence="mixed", beta=0.5)(x["z"], x["zr"], mask, kept=kept)  # refused at the call
    with pytest.raises(ValueError, match="applies to estimator='full'"):
        lk.kl_penalty(torch.full((B, L), -1.0), torch.full((B, L), -1.0), "k3", kept=kept)


# ---------------------------------------------------------------------------------------------
# the loss: kept= per batch, like the mask; the function's values; a real Trainer loop


def _moved(seed: int, s: lk.Sampling) -> tuple[dict[str, Tensor], Tensor, KeptSets, Tensor]:
    """A rollout's record from old logits and the moved policy's inputs (logits and heads)."""
    old = _leaves(seed)
    y = rollout(old["z"], s, seed=seed + 1)
    y[2, -2:] = -100
    mask = y != -100
    _, kept = lk.token_logprobs(old["z"], y, sampling=s, ignore_index=-100, return_kept=True)
    g = torch.Generator().manual_seed(seed + 2)
    new = {k: v + 1.5 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    return new, y, kept, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("name,beta", [("reverse", None), ("jsd", 0.4)])
def test_the_loss_replays_as_full_kl_does_and_is_todays_loss_on_policy(agg, name, beta):
    s = lk.Sampling(0.9, top_p=0.8)
    new, y, kept, mask = _moved(10, s)
    loss = lk.KLPenaltyLoss("full", coef=0.3, agg=agg, sampling=s, divergence=name, beta=beta)
    # off-policy: the token aggregate of full_kl's replayed values (the policy's own kept sets would raise nothing
    # here, but they are another distribution: the record is what the sampler drew from)
    a, b = new["z"].clone().requires_grad_(), new["z"].clone().requires_grad_()
    got = loss(a, new["zr"], mask, kept=kept)
    per = lk.full_kl(b, new["zr"], mask, sampling=s, divergence=name, beta=beta, kept=kept)
    want = 0.3 * lk.aggregate(per, mask, agg)
    assert got.isfinite() and torch.equal(got, want)
    got.backward(), want.backward()
    assert torch.equal(a.grad, b.grad)
    assert not torch.equal(got, loss(new["z"], new["zr"], mask))  # the current kept sets: another number
    # kl_penalty("full") replays alike (the reverse KL)
    if name == "reverse":
        assert torch.equal(lk.kl_penalty(new["z"], new["zr"], "full", mask=mask, sampling=s, kept=kept), per)
    # on-policy (the record is the policy's own): today's loss, the same bits, logits and heads
    _, own = lk.token_logprobs(new["z"], y, sampling=s, ignore_index=-100, return_kept=True, outside="-inf")
    assert torch.equal(loss(new["z"], new["zr"], mask, kept=own), loss(new["z"], new["zr"], mask))
    hx = lk.FromHidden(new["h"], new["w"], new["b"])
    _, own_h = lk.token_logprobs(hx, y, sampling=s, ignore_index=-100, return_kept=True, outside="-inf")
    hr = lk.FromHidden(new["rh"], new["rw"])
    assert torch.equal(loss(hx, hr, mask, kept=own_h), loss(hx, hr, mask))
    # a served teacher's top-k in the reference's place replays as full_kl does (the loss routes the record to it)
    ids = torch.topk(new["zr"], 4, dim=-1).indices
    topk = lk.TopK(ids, torch.log_softmax(new["zr"], -1).gather(-1, ids))
    c, e = new["z"].clone().requires_grad_(), new["z"].clone().requires_grad_()
    got = loss(c, topk, mask, kept=kept)
    want = 0.3 * lk.aggregate(lk.full_kl(e, topk, mask, sampling=s, divergence=name, beta=beta, kept=kept), mask, agg)
    assert got.isfinite() and torch.equal(got, want)
    got.backward(), want.backward()
    assert torch.equal(c.grad, e.grad)
    assert not torch.equal(got, loss(new["z"], topk, mask))  # the record was read, not the current kept sets
    # the metric saw the replayed values
    assert loss.metric.compute().isfinite()


def test_a_trainer_feeds_the_record_from_the_batch_as_a_plain_loop_does(tmp_path):
    """Each batch holds its rollout's record (a KeptSets beside the mask); Lightning moves it with the batch
    (its ``.to``); two epochs over the same rollouts (the policy moves: off-policy from the second step on).
    The Trainer's weights equal a plain loop's, and each step's loss is finite where today's scorer raises."""
    import lightning.pytorch as pl

    s, LR = lk.Sampling(0.8, top_p=0.7), 20.0
    g = torch.Generator().manual_seed(20)
    ref_head = torch.nn.Linear(D, V)
    with torch.no_grad():
        ref_head.weight.copy_(torch.randn(V, D, generator=g))
    head0 = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head0.weight.copy_(2 * torch.randn(V, D, generator=g))
    batches = []
    for i in range(3):
        h = torch.randn(B, L, D, generator=g)
        y = rollout(head0(h).detach(), s, seed=30 + i)
        _, kept = lk.token_logprobs(lk.FromHidden(h, head0.weight.detach()), y, sampling=s, return_kept=True)
        batches.append({"hidden": h, "mask": torch.ones(B, L, dtype=torch.bool), "kept": kept, "tokens": y})

    def step_loss(head: torch.nn.Linear, loss: lk.KLPenaltyLoss, batch: dict[str, Any]) -> Tensor:
        assert isinstance(batch["kept"], KeptSets)
        x = lk.FromHidden(batch["hidden"], head.weight)
        ref = lk.FromHidden(batch["hidden"], ref_head.weight.detach(), ref_head.bias.detach())
        return loss(x, ref, batch["mask"], kept=batch["kept"])

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(D, V, bias=False)
            self.head.load_state_dict(head0.state_dict())
            self.kl = lk.KLPenaltyLoss("full", coef=1.0, sampling=s)
            self.losses: list[Tensor] = []

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
            out = step_loss(self.head, self.kl, batch)
            self.losses.append(out.detach())
            return out

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    module = Module()
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, loader)
    # the plain loop: the same steps by hand
    head = torch.nn.Linear(D, V, bias=False)
    head.load_state_dict(head0.state_dict())
    loss = lk.KLPenaltyLoss("full", coef=1.0, sampling=s)
    opt = torch.optim.SGD(head.parameters(), lr=LR)
    plain = []
    for _ in range(2):
        for batch in batches:
            opt.zero_grad()
            out = step_loss(head, loss, batch)
            out.backward()
            opt.step()
            plain.append(out.detach())
    assert torch.equal(torch.stack(module.losses), torch.stack(plain)) and torch.stack(plain).isfinite().all()
    assert torch.equal(module.head.weight, head.weight)
    # the policy moved: a sampled token left its current kept set, where today's scorer raises
    left = [lk.token_logprobs(lk.FromHidden(b["hidden"], head.weight.detach()), b["tokens"], sampling=s, outside="-inf") == NINF for b in batches]
    assert torch.stack(left).any()


# ---------------------------------------------------------------------------------------------
# replay reads nothing on the host (as on a GPU): the same values and gradients as the host form


def test_full_kl_and_the_loss_replay_without_a_host_read(monkeypatch):
    from test_no_host_sync import device_form

    s = lk.Sampling(0.8, top_p=0.8)
    new, y, kept, mask = _moved(16, s)
    loss = lk.KLPenaltyLoss("full", coef=1.0, sampling=s)
    kw = dict(sampling=s, reference="policy_kept", divergence="jsd", beta=0.3, kept=kept, chunk_size=4)
    a, b, c, d = (new["z"].clone().requires_grad_() for _ in range(4))
    want = lk.full_kl(a, new["zr"], mask, **kw)
    want.sum().backward()
    want_loss = loss(c, new["zr"], mask, kept=kept)
    want_loss.backward()
    keep = kept.to_mask()
    keep[0, 0] = False
    empty = KeptSets.from_mask(keep)
    empty = KeptSets(empty.ids, empty.offsets, (B, L), V, 0.8)  # (a record is validated on the host once, when built)
    with device_form(monkeypatch):
        got = lk.full_kl(b, new["zr"], mask, **kw)
        got.sum().backward()
        got_loss = loss(d, new["zr"], mask, kept=kept)
        got_loss.backward()
        with pytest.raises(RuntimeError, match="every valid position needs a non-empty recorded kept set"):
            lk.full_kl(new["z"], new["zr"], mask, sampling=s, kept=empty)
    assert torch.equal(got, want) and torch.equal(b.grad, a.grad)
    assert torch.equal(got_loss, want_loss) and torch.equal(d.grad, c.grad)
