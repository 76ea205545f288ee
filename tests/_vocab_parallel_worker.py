"""Vocabulary-parallel log-probs and full KL on 2 CPU processes (gloo), against one process on the gathered logits.

``python tests/_vocab_parallel_worker.py OUT_DIR`` spawns 2 processes (a file store in OUT_DIR: no
port); each builds the same float64 global logits, takes its shard of the vocabulary (a DTensor
``Shard(-1)`` on a 1-D mesh, or a plain local shard as ``lk.VocabShard``), runs every check and
writes ``OUT_DIR/rank{r}.json``: ``{"rank", "world_size", "errors": {check: max abs error},
"raised": {check: message}}``. The reference of every check is this package's single-process kernel
on the gathered logits (itself tested against float64 maths from the formula in test_logprobs and
test_full) and, for the clean cases, the formula composed with torch ops and autograd here.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from _ddp import finish_worker

WORLD = 2
B, T = 3, 7  # rows: 21 tokens; chunk_size=4 splits them into several chunks


def _close(errors: dict[str, float], name: str, got: Tensor, want: Tensor) -> None:
    got, want = got.detach().to(torch.float64), want.detach().to(torch.float64)
    assert got.shape == want.shape, (name, tuple(got.shape), tuple(want.shape))
    same_nan = bool((got.isnan() == want.isnan()).all())
    diff = (got - want).nan_to_num(0.0).abs()
    inf_ok = bool((got.isinf() == want.isinf()).all()) and bool((got[got.isinf()] == want[want.isinf()]).all())
    errors[name] = (float(diff.max()) if diff.numel() else 0.0) if same_nan and inf_ok else float("inf")


def _logits(vocab: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, vocab, generator=g, dtype=torch.float64) * 2


def _tokens(vocab: int, split: int) -> Tensor:
    # every shard, both edges of the split and of the vocabulary, and label padding
    ids = torch.tensor([0, split - 1, split, vocab - 1, 1, split + 1, -100])
    return ids.repeat(B * T // len(ids) + 1)[: B * T].view(B, T)


def _mask() -> Tensor:
    lengths = torch.tensor([7, 4, 0])
    return torch.arange(T).expand(B, T) < lengths.unsqueeze(1)


def _formula_logprobs(z: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    keep = tokens != -100
    lp = torch.log_softmax(z / temperature, -1).gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, lp, 0.0)


def _formula_kl(z: Tensor, zr: Tensor, mask: Tensor, temperature: float) -> Tensor:
    logp, logq = torch.log_softmax(z / temperature, -1), torch.log_softmax(zr / temperature, -1)
    return torch.where(mask, (logp.exp() * (logp - logq)).sum(-1), 0.0)


def _shard(x: Tensor, start: int, stop: int) -> Tensor:
    return x[..., start:stop].detach().clone().requires_grad_()


def run_checks(rank: int, errors: dict[str, float], raised: dict[str, str]) -> None:
    import lightning_kl as lk
    from _vocab import kl_from_hidden, logprobs_from_hidden
    from lightning_kl.ground import checks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (WORLD,))
    group = mesh.get_group(0)
    g = torch.Generator().manual_seed(7)

    # --- token log-probs, DTensor Shard(-1), uneven vocabulary (11 = 6 + 5), temperature, chunks
    vocab = 11
    size, offset = Shard.local_shard_size_and_offset(vocab, WORLD, rank)
    z = _logits(vocab, 1)
    tokens = _tokens(vocab, 6)
    weights = torch.randn(B, T, generator=g, dtype=torch.float64)  # the same on every rank
    for temperature, chunk in ((1.0, None), (0.7, 4)):
        local = _shard(z, offset, offset + size)
        dt = DTensor.from_local(local, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
        lp = lk.token_logprobs(dt, tokens, sampling=lk.Sampling(temperature), ignore_index=-100, chunk_size=chunk)
        (lp * weights).sum().backward()
        ref_z = z.clone().requires_grad_()
        ref = lk.token_logprobs(ref_z, tokens, sampling=lk.Sampling(temperature), ignore_index=-100)
        (ref * weights).sum().backward()
        formula_z = z.clone().requires_grad_()
        formula = _formula_logprobs(formula_z, tokens, temperature)
        (formula * weights).sum().backward()
        tag = f"logprobs_dtensor_T{temperature}_chunk{chunk}"
        _close(errors, f"{tag}_value", lp, ref)
        _close(errors, f"{tag}_grad", local.grad, ref_z.grad[..., offset : offset + size])
        _close(errors, f"{tag}_value_formula", lp, formula)
        _close(errors, f"{tag}_grad_formula", local.grad, formula_z.grad[..., offset : offset + size])
        errors[f"{tag}_is_plain_tensor"] = 0.0 if type(lp) is Tensor else float("inf")

    # --- the explicit form: plain local shards with a custom split (3 + 8), non-contiguous rows,
    # and a split where rank 1 holds no vocabulary at all (11 + 0)
    for split in (3, vocab):
        start, stop = (0, split) if rank == 0 else (split, vocab)
        full = _logits(vocab + 1, 2)  # logits[..., :-1]: a non-contiguous view, read in place
        local = full[:, :, start:stop].detach().clone().requires_grad_() if stop > start else full[:, :, :0].detach().clone().requires_grad_()
        rows = local[:, :-1]  # non-contiguous leading dims
        toks = _tokens(vocab, split)[:, :-1].clamp(max=vocab - 1)
        lp = lk.token_logprobs(lk.VocabShard(rows, group, start), toks, ignore_index=-100, chunk_size=4)
        (lp * weights[:, :-1]).sum().backward()
        ref_z = full[:, :-1, :vocab].clone().requires_grad_()
        ref = lk.token_logprobs(ref_z, toks, ignore_index=-100)
        (ref * weights[:, :-1]).sum().backward()
        _close(errors, f"logprobs_shard_split{split}_value", lp, ref)
        _close(errors, f"logprobs_shard_split{split}_grad", local.grad[:, :-1], ref_z.grad[..., start:stop])
        _close(errors, f"logprobs_shard_split{split}_grad_last_row", local.grad[:, -1], torch.zeros_like(local.grad[:, -1]))

    # --- full KL, DTensor both sides: mask with NaN padding, -inf policy entries (p = 0) in both
    # shards, temperature, chunks; gradients of both sides
    zr = _logits(vocab, 3)
    mask = _mask()
    zp = torch.where(mask.unsqueeze(-1), z, float("nan"))
    zp[0, 1, 2] = zp[0, 1, 8] = float("-inf")  # p = 0 on both ranks; the reference's q > 0 there
    for temperature, chunk in ((1.0, None), (1.3, 4)):
        loc, loc_ref = _shard(zp, offset, offset + size), _shard(zr, offset, offset + size)
        dz = DTensor.from_local(loc, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
        dr = DTensor.from_local(loc_ref, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
        kl = lk.full_kl(dz, dr, mask, sampling=lk.Sampling(temperature), chunk_size=chunk)
        (kl * weights).sum().backward()
        ref_z, ref_r = zp.clone().requires_grad_(), zr.clone().requires_grad_()
        ref = lk.full_kl(ref_z, ref_r, mask, sampling=lk.Sampling(temperature))
        (ref * weights).sum().backward()
        tag = f"full_kl_dtensor_T{temperature}_chunk{chunk}"
        _close(errors, f"{tag}_value", kl, ref)
        _close(errors, f"{tag}_grad", loc.grad, ref_z.grad[..., offset : offset + size])
        _close(errors, f"{tag}_grad_ref", loc_ref.grad, ref_r.grad[..., offset : offset + size])
        # clean rows (no -inf): the formula with torch ops and autograd
        clean = z.clone().requires_grad_()
        zr_f = zr.clone().requires_grad_()
        formula = _formula_kl(clean, zr_f, mask, temperature)
        (formula * weights).sum().backward()
        loc2, loc2_ref = _shard(z, offset, offset + size), _shard(zr, offset, offset + size)
        kl2 = lk.full_kl(lk.VocabShard(loc2, group, offset), lk.VocabShard(loc2_ref, group, offset), mask, sampling=lk.Sampling(temperature), chunk_size=chunk)
        (kl2 * weights).sum().backward()
        _close(errors, f"{tag}_value_formula", kl2, formula)
        _close(errors, f"{tag}_grad_formula", loc2.grad, clean.grad[..., offset : offset + size])
        _close(errors, f"{tag}_grad_ref_formula", loc2_ref.grad, zr_f.grad[..., offset : offset + size])

    # --- kl_penalty("full") and KLPenaltyLoss("full") at both levels; at the sequence level the
    # sampled log-probs come from token_logprobs of the same sharded logits
    toks = _tokens(vocab, 6).clamp(min=0)
    for level, agg in (("token", "token-mean"), ("sequence", "seq-mean-token-sum")):
        loc, loc_ref = _shard(zp, offset, offset + size), _shard(zr, offset, offset + size)
        dz = DTensor.from_local(loc, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
        dr = DTensor.from_local(loc_ref, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
        extra: dict[str, Any] = {}
        if level == "sequence":
            extra["sampled_logprob"] = lk.token_logprobs(dz, toks)
        loss_fn = lk.KLPenaltyLoss("full", coef=0.5, agg=agg, level=level)
        penalty = lk.kl_penalty(dz, dr, "full", mask=mask, level=level, **extra)
        loss = loss_fn(dz, dr, mask, **extra) + (penalty * weights).sum()
        loss.backward()
        ref_z, ref_r = zp.clone().requires_grad_(), zr.clone().requires_grad_()
        ref_extra: dict[str, Any] = {}
        if level == "sequence":
            ref_extra["sampled_logprob"] = lk.token_logprobs(ref_z, toks)
        ref_fn = lk.KLPenaltyLoss("full", coef=0.5, agg=agg, level=level)
        ref_penalty = lk.kl_penalty(ref_z, ref_r, "full", mask=mask, level=level, **ref_extra)
        ref_loss = ref_fn(ref_z, ref_r, mask, **ref_extra) + (ref_penalty * weights).sum()
        ref_loss.backward()
        tag = f"loss_full_{level}"
        _close(errors, f"{tag}_value", loss, ref_loss)
        _close(errors, f"{tag}_penalty", penalty, ref_penalty)
        _close(errors, f"{tag}_grad", loc.grad, ref_z.grad[..., offset : offset + size])
        _close(errors, f"{tag}_grad_ref", loc_ref.grad, ref_r.grad[..., offset : offset + size])
        _close(errors, f"{tag}_metric", loss_fn.metric.compute(), ref_fn.metric.compute())

    # --- from hidden states with a column-parallel head (lk.VocabShard of its rows, uneven 6 + 5):
    # log-probs and the full KL (NaN hidden states in the padding), gradients of the hidden states
    # (summed over the group), of the head's rows and of the bias slice, against one process
    d = 4
    h = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    hr = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    w, wr = torch.randn(vocab, d, generator=g, dtype=torch.float64), torch.randn(vocab, d, generator=g, dtype=torch.float64)
    bias, rbias = torch.randn(vocab, generator=g, dtype=torch.float64), torch.randn(vocab, generator=g, dtype=torch.float64)
    rows = slice(offset, offset + size)
    for temperature, chunk in ((1.0, None), (0.8, 4)):
        leaves = [x.clone().requires_grad_() for x in (h, w[rows], bias[rows])]
        lp = logprobs_from_hidden(leaves[0], lk.VocabShard(leaves[1], group, offset), tokens, bias=leaves[2], temperature=temperature, ignore_index=-100, chunk_size=chunk)
        (lp * weights).sum().backward()
        ref_leaves = [x.clone().requires_grad_() for x in (h, w, bias)]
        ref = logprobs_from_hidden(ref_leaves[0], ref_leaves[1], tokens, bias=ref_leaves[2], temperature=temperature, ignore_index=-100)
        (ref * weights).sum().backward()
        tag = f"hidden_logprobs_T{temperature}_chunk{chunk}"
        _close(errors, f"{tag}_value", lp, ref)
        _close(errors, f"{tag}_grad_hidden", leaves[0].grad, ref_leaves[0].grad)
        _close(errors, f"{tag}_grad_weight", leaves[1].grad, ref_leaves[1].grad[rows])
        _close(errors, f"{tag}_grad_bias", leaves[2].grad, ref_leaves[2].grad[rows])

        hp = torch.where(mask.unsqueeze(-1), h, float("nan"))
        leaves = [x.clone().requires_grad_() for x in (hp, w[rows], bias[rows], hr, wr[rows])]
        kl = kl_from_hidden(
            leaves[0], lk.VocabShard(leaves[1], group, offset), leaves[3], lk.VocabShard(leaves[4], group, offset), mask,
            bias=leaves[2], ref_bias=rbias[rows], temperature=temperature, chunk_size=chunk,
        )
        loss_fn = lk.KLPenaltyLoss("full", agg="token-mean", sampling=lk.Sampling(temperature=temperature))
        loss = (kl * weights).sum() + loss_fn(lk.FromHidden(leaves[0], lk.VocabShard(leaves[1], group, offset), leaves[2]),
                                              lk.FromHidden(leaves[3], lk.VocabShard(leaves[4], group, offset), rbias[rows]), mask)
        loss.backward()
        ref_leaves = [x.clone().requires_grad_() for x in (hp, w, bias, hr, wr)]
        ref = kl_from_hidden(ref_leaves[0], ref_leaves[1], ref_leaves[3], ref_leaves[4], mask, bias=ref_leaves[2], ref_bias=rbias, temperature=temperature)
        ref_fn = lk.KLPenaltyLoss("full", agg="token-mean", sampling=lk.Sampling(temperature=temperature))
        ref_loss = (ref * weights).sum() + ref_fn(lk.FromHidden(ref_leaves[0], ref_leaves[1], ref_leaves[2]), lk.FromHidden(ref_leaves[3], ref_leaves[4], rbias), mask)
        ref_loss.backward()
        tag = f"hidden_full_kl_T{temperature}_chunk{chunk}"
        _close(errors, f"{tag}_value", kl, ref)
        _close(errors, f"{tag}_loss", loss, ref_loss)
        for i, what in enumerate(("hidden", "weight", "bias", "ref_hidden", "ref_weight")):
            want = ref_leaves[i].grad if what in ("hidden", "ref_hidden") else ref_leaves[i].grad[rows]
            _close(errors, f"{tag}_grad_{what}", leaves[i].grad, want)

    # --- the token entropy: a DTensor (6 + 5, NaN padding, -inf entries), a VocabShard where rank 1
    # holds no vocabulary (11 + 0), a column-parallel head; value and gradients against one process
    # (itself tested against float64 formulas, test_engine_matrix.py) and, on clean rows, the formula
    for temperature, chunk in ((1.0, None), (0.6, 4)):
        sampling = lk.Sampling(temperature)
        loc = _shard(zp, offset, offset + size)
        dz = DTensor.from_local(loc, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
        ent = lk.token_entropy(dz, mask, sampling=sampling, chunk_size=chunk)
        (ent * weights).sum().backward()
        ref_z = zp.clone().requires_grad_()
        ref = lk.token_entropy(ref_z, mask, sampling=sampling)
        (ref * weights).sum().backward()
        clean = z.clone().requires_grad_()
        logp = torch.log_softmax(clean / temperature, -1)
        formula = torch.where(mask, -(logp.exp() * logp).sum(-1), 0.0)
        (formula * weights).sum().backward()
        loc_c = _shard(z, offset, offset + size)
        ent_c = lk.token_entropy(lk.VocabShard(loc_c, group, offset), mask, sampling=sampling, chunk_size=chunk)
        (ent_c * weights).sum().backward()
        tag = f"entropy_T{temperature}_chunk{chunk}"
        _close(errors, f"{tag}_value", ent, ref)
        _close(errors, f"{tag}_grad", loc.grad, ref_z.grad[..., offset : offset + size])
        _close(errors, f"{tag}_value_formula", ent_c, formula)
        _close(errors, f"{tag}_grad_formula", loc_c.grad, clean.grad[..., offset : offset + size])
    # --- log-probs and entropy in one pass of a DTensor (NaN padding ignored, -inf entries): both values and
    # the gradient of a mix of both against the two separate calls in one process
    g_ent = torch.randn(B, T, generator=g, dtype=torch.float64)  # the same on every rank
    toks = torch.where(mask, tokens, -100)
    for temperature, chunk in ((1.0, None), (0.6, 4)):
        sampling = lk.Sampling(temperature)
        loc = _shard(zp, offset, offset + size)
        dz = DTensor.from_local(loc, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
        lp, ent = lk.token_logprobs_and_entropy(dz, toks, sampling=sampling, ignore_index=-100, chunk_size=chunk)
        ((lp * weights).sum() + (ent * g_ent).sum()).backward()
        ref_z = zp.clone().requires_grad_()
        lp1 = lk.token_logprobs(ref_z, toks, sampling=sampling, ignore_index=-100)
        ent1 = lk.token_entropy(ref_z, toks != -100, sampling=sampling)  # an ignored token: entropy 0
        ((lp1 * weights).sum() + (ent1 * g_ent).sum()).backward()
        tag = f"one_pass_dtensor_T{temperature}_chunk{chunk}"
        _close(errors, f"{tag}_logprob", lp, lp1)
        _close(errors, f"{tag}_entropy", ent, ent1)
        _close(errors, f"{tag}_grad", loc.grad, ref_z.grad[..., offset : offset + size])
    start, stop = (0, vocab) if rank == 0 else (vocab, vocab)
    loc = z[..., start:stop].detach().clone().requires_grad_()
    ent = lk.token_entropy(lk.VocabShard(loc, group, start), mask, chunk_size=4)
    (ent * weights).sum().backward()
    ref_z = z.clone().requires_grad_()
    ref = lk.token_entropy(ref_z, mask)
    (ref * weights).sum().backward()
    _close(errors, "entropy_empty_shard_value", ent, ref)
    _close(errors, "entropy_empty_shard_grad", loc.grad, ref_z.grad[..., start:stop])
    leaves = [x.clone().requires_grad_() for x in (hp, w[rows], bias[rows])]
    ent = lk.token_entropy(lk.FromHidden(leaves[0], lk.VocabShard(leaves[1], group, offset), leaves[2]), mask, sampling=lk.Sampling(0.9), chunk_size=4)
    (ent * weights).sum().backward()
    ref_leaves = [x.clone().requires_grad_() for x in (hp, w, bias)]
    ref = lk.token_entropy(lk.FromHidden(*ref_leaves), mask, sampling=lk.Sampling(0.9))
    (ref * weights).sum().backward()
    _close(errors, "entropy_hidden_value", ent, ref)
    for i, what in enumerate(("hidden", "weight", "bias")):
        _close(errors, f"entropy_hidden_grad_{what}", leaves[i].grad, ref_leaves[i].grad if i == 0 else ref_leaves[i].grad[rows])
    # --- heads with a logit scale and a soft cap (Gemma 2's, Cohere's), column-parallel: log-probs, the full
    # KL (each head its own scale and cap; NaN padding) and the entropy, values and every gradient, against
    # one process on the whole head and against the formula (autograd through c tanh(s a / c))
    heads = {"policy": dict(logit_scale=0.5, softcap=1.5), "ref": dict(softcap=2.0)}
    for temperature, chunk in ((1.0, None), (0.7, 4)):
        sampling = lk.Sampling(temperature)
        leaves = [x.clone().requires_grad_() for x in (hp, w[rows], bias[rows], hr, wr[rows])]
        pol = lk.FromHidden(leaves[0], lk.VocabShard(leaves[1], group, offset), leaves[2], **heads["policy"])
        ref_h = lk.FromHidden(leaves[3], lk.VocabShard(leaves[4], group, offset), rbias[rows], **heads["ref"])
        lp = lk.token_logprobs(pol, torch.where(mask, tokens, -100), sampling=sampling, ignore_index=-100, chunk_size=chunk)
        out = (lp * weights).sum() + (lk.full_kl(pol, ref_h, mask, sampling=sampling, chunk_size=chunk) * weights).sum()
        out = out + (lk.token_entropy(pol, mask, sampling=sampling, chunk_size=chunk) * weights).sum()
        out.backward()
        one = [x.clone().requires_grad_() for x in (hp, w, bias, hr, wr)]
        pol1 = lk.FromHidden(one[0], one[1], one[2], **heads["policy"])
        ref1 = lk.FromHidden(one[3], one[4], rbias, **heads["ref"])
        lp1 = lk.token_logprobs(pol1, torch.where(mask, tokens, -100), sampling=sampling, ignore_index=-100)
        out1 = (lp1 * weights).sum() + (lk.full_kl(pol1, ref1, mask, sampling=sampling) * weights).sum()
        out1 = out1 + (lk.token_entropy(pol1, mask, sampling=sampling) * weights).sum()
        out1.backward()
        clean = [x.clone().requires_grad_() for x in (h, w, bias, hr, wr)]
        zc = 1.5 * torch.tanh(0.5 * torch.nn.functional.linear(clean[0], clean[1], clean[2]) / 1.5)
        zrc = 2.0 * torch.tanh(torch.nn.functional.linear(clean[3], clean[4], rbias) / 2.0)
        logp = torch.log_softmax(zc / temperature, -1)
        formula = torch.where(mask, logp.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
        formula = formula * (tokens != -100)
        formula = formula + _formula_kl(zc, zrc, mask, temperature) + torch.where(mask, -(logp.exp() * logp).sum(-1), 0.0)
        (formula * weights).sum().backward()
        tag = f"capped_T{temperature}_chunk{chunk}"
        _close(errors, f"{tag}_value", out, out1)
        _close(errors, f"{tag}_value_formula", out, (formula * weights).sum())
        for i, what in enumerate(("hidden", "weight", "bias", "ref_hidden", "ref_weight")):
            whole = one[i].grad if what in ("hidden", "ref_hidden") else one[i].grad[rows]
            _close(errors, f"{tag}_grad_{what}", leaves[i].grad, whole)
            if what != "hidden":  # NaN padding in the policy's hidden states: the formula took clean ones
                _close(errors, f"{tag}_grad_{what}_formula", leaves[i].grad, clean[i].grad if what == "ref_hidden" else clean[i].grad[rows])
    # without truncation the three references are one KL
    for reference in ("processed", "policy_kept"):
        loc, loc_ref = _shard(zp, offset, offset + size), _shard(zr, offset, offset + size)
        kl = lk.full_kl(lk.VocabShard(loc, group, offset), lk.VocabShard(loc_ref, group, offset), mask, reference=reference, chunk_size=4)
        _close(errors, f"kl_reference_{reference}", kl, lk.full_kl(zp, zr, mask))

    # --- bfloat16 shards: the maths in float32, gradients in bfloat16, as one process on the same values
    zb, zrb = z.to(torch.bfloat16), zr.to(torch.bfloat16)
    loc, loc_ref = _shard(zb, offset, offset + size), _shard(zrb, offset, offset + size)
    dz = DTensor.from_local(loc, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
    dr = DTensor.from_local(loc_ref, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
    out = lk.token_logprobs(dz, tokens, ignore_index=-100) + lk.full_kl(dz, dr, mask)
    out.backward(weights.float())
    ref_z, ref_r = zb.clone().requires_grad_(), zrb.clone().requires_grad_()
    ref = lk.token_logprobs(ref_z, tokens, ignore_index=-100) + lk.full_kl(ref_z, ref_r, mask)
    ref.backward(weights.float())
    errors["bf16_dtypes"] = 0.0 if (out.dtype, loc.grad.dtype, loc_ref.grad.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16) else float("inf")
    errors["bf16_value"] = max(0.0, float((out - ref).detach().abs().max()) - 1e-5)  # float32 maths: 1e-5 allowed
    errors["bf16_grad"] = max(0.0, float((loc.grad.float() - ref_z.grad[..., offset : offset + size].float()).abs().max()) - 4e-3)
    errors["bf16_grad_ref"] = max(0.0, float((loc_ref.grad.float() - ref_r.grad[..., offset : offset + size].float()).abs().max()) - 4e-3)

    # --- sampled estimators on loss_parallel's replicated log-probs (backward inside the context, as
    # torch asks), equal to the same loss on lk.token_logprobs of the same shards
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    toks = _tokens(vocab, 6).clamp(min=0)
    for level in ("token", "sequence"):
        grads = []
        for source in ("loss_parallel", "lk"):
            local = _shard(z, offset, offset + size)
            dz = DTensor.from_local(local, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
            with loss_parallel():
                if source == "loss_parallel":
                    lp = -F.cross_entropy(dz.flatten(0, 1), toks.flatten(), reduction="none").view(B, T)
                else:
                    lp = lk.token_logprobs(dz, toks)
                ref_lp = lp.detach() - 0.2
                loss = lk.KLPenaltyLoss("k3+", agg="token-sum", level=level)(lp, ref_lp, mask, old_logprob=lp.detach() + 0.05)
                loss = loss + (lk.kl_penalty(lp, ref_lp, "k2", mask=mask) * weights).sum()
                loss.backward()
            grads.append((loss, local.grad))
        _close(errors, f"sampled_loss_parallel_{level}_value", grads[0][0], grads[1][0])
        _close(errors, f"sampled_loss_parallel_{level}_grad", grads[0][1], grads[1][1])

    # --- the device form of the checks (as off the CPU), with every host read refused
    reads = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "nonzero", "masked_select")
    saved = {name: getattr(Tensor, name) for name in reads}
    saved_devices = checks.HOST_READ_DEVICES

    def refuse(name: str) -> Callable[..., Any]:
        def read(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"Tensor.{name}: a host read")

        return read

    local = _shard(z, offset, offset + size)
    loc_ref = _shard(zr, offset, offset + size)
    dz = DTensor.from_local(local, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
    dr = DTensor.from_local(loc_ref, mesh, [Shard(-1)], run_check=False, shape=z.shape, stride=z.stride())
    checks.HOST_READ_DEVICES = frozenset()
    try:
        for name in reads:
            setattr(Tensor, name, refuse(name))
        lp = lk.token_logprobs(dz, tokens, ignore_index=-100, chunk_size=4)
        kl = lk.full_kl(dz, dr, mask, chunk_size=4)
        hl, wl = h.clone().requires_grad_(), w[rows].clone().requires_grad_()
        lp_h = logprobs_from_hidden(hl, lk.VocabShard(wl, group, offset), tokens, ignore_index=-100, chunk_size=4)
        kl_h = kl_from_hidden(hl, lk.VocabShard(wl, group, offset), hr, lk.VocabShard(wr[rows], group, offset), mask, chunk_size=4)
        (lp.sum() + kl.sum() + lp_h.sum() + kl_h.sum()).backward()
        try:
            lk.token_logprobs(dz, tokens.masked_fill(tokens == -100, vocab))
        except RuntimeError as err:
            raised["device_check_out_of_range"] = str(err)
    finally:
        for name, fn in saved.items():
            setattr(Tensor, name, fn)
        checks.HOST_READ_DEVICES = saved_devices
    errors["no_host_reads_ran"] = 0.0

    # --- errors: out-of-range ids, shards that overlap, placements that are not a vocabulary split
    for tag, make in (
        ("error_out_of_range", lambda: lk.token_logprobs(dz, tokens.masked_fill(tokens == -100, vocab))),
        ("error_overlap", lambda: lk.token_logprobs(lk.VocabShard(z[..., :6], group, 0), tokens.clamp(min=0))),
        ("error_replicated", lambda: lk.token_logprobs(DTensor.from_local(z, mesh, [Replicate()], run_check=False), tokens)),
        ("error_mixed", lambda: lk.full_kl(dz, z)),
        ("error_offsets", lambda: lk.full_kl(lk.VocabShard(z[..., :5], group, 0), lk.VocabShard(z[..., :5], group, 1))),
    ):
        try:
            make()
        except (ValueError, TypeError) as err:
            raised[tag] = f"{type(err).__name__}: {err}"


def _main(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD)
    torch.set_num_threads(2)  # the chunk runner's pool, 2 threads per process
    errors: dict[str, float] = {}
    raised: dict[str, str] = {}
    record: dict[str, Any] = {"rank": rank, "world_size": dist.get_world_size()}
    try:
        run_checks(rank, errors, raised)
    except BaseException:
        record["failure"] = traceback.format_exc()
    record.update(errors=errors, raised=raised)
    Path(out, f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    finish_worker()


if __name__ == "__main__":
    torch.multiprocessing.spawn(_main, args=(sys.argv[1],), nprocs=WORLD, join=True)
