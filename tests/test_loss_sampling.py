"""``KLPenaltyLoss("full", sampling=lk.Sampling(...))`` from logits or ``lk.FromHidden``, at both levels.

Values and gradients against dense float64 formulas: the policy's processed distribution from
``transformers``' own warpers (temperature, top-k, top-p, min-p, in ``generate``'s order), the
reference ``softmax(ref_logits / T)``, the sequence level's KL-to-go term carried by the processed
log-prob of the sampled token. The loss is the function users call: ``coef * aggregate(kl_penalty(...))``.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

import lightning_kl as lk

F64 = torch.float64
B, T, V, D = 2, 5, 11, 4


def _processed_logp(z: Tensor, sampling: lk.Sampling) -> Tensor:
    """log of the sampler's distribution, dense, with transformers' warpers (-inf outside the kept set)."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    rows = z.reshape(-1, z.shape[-1]) / sampling.temperature
    if sampling.top_k is not None:
        rows = TopKLogitsWarper(sampling.top_k)(None, rows)
    if sampling.top_p is not None:
        rows = TopPLogitsWarper(sampling.top_p)(None, rows)
    if sampling.min_p is not None:
        rows = MinPLogitsWarper(sampling.min_p)(None, rows)
    return torch.log_softmax(rows, -1).reshape(z.shape)


def _dense_kl(z: Tensor, zr: Tensor, sampling: lk.Sampling) -> Tensor:
    logp = _processed_logp(z, sampling)
    logq = torch.log_softmax(zr / sampling.temperature, -1)
    p = logp.exp()
    kept = p > 0  # 0 log 0 = 0 outside the kept set, with a gradient of 0 there
    return (p * (torch.where(kept, logp, 0.0) - logq)).sum(-1)


def _dense_loss(z: Tensor, zr: Tensor, mask: Tensor, sampling: lk.Sampling, level: str, tokens: Tensor, coef: float, agg: str) -> Tensor:
    kl = torch.where(mask, _dense_kl(z, zr, sampling), 0.0)
    if level == "sequence":
        lp = _processed_logp(z, sampling).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        lp = torch.where(mask, lp, 0.0)
        future = kl.detach().flip(-1).cumsum(-1).flip(-1) - kl.detach()  # sum over later valid positions
        kl = kl + (lp - lp.detach()) * future
    weights = {"token-mean": mask / mask.sum(), "token-sum": mask * 1.0, "seq-mean-token-sum": mask / mask.any(-1).sum()}[agg]
    return coef * (weights * kl).sum()


def _data(seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=F64) * 2
    zr = z + torch.randn(B, T, V, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    tokens = z.argmax(-1)  # the argmax is in every kept set
    return {"z": z, "zr": zr, "mask": mask, "tokens": tokens}


SAMPLERS = [
    lk.Sampling(),
    lk.Sampling(temperature=0.7),
    lk.Sampling(temperature=0.7, top_p=0.8, top_k=0),
    lk.Sampling(top_k=3),
    lk.Sampling(temperature=1.3, min_p=0.1),
    lk.Sampling(temperature=0.9, top_k=6, top_p=0.9),
]


@pytest.mark.parametrize("level, agg", [("token", "token-mean"), ("sequence", "seq-mean-token-sum"), ("sequence", "token-sum")])
@pytest.mark.parametrize("sampling", SAMPLERS, ids=repr)
def test_full_with_a_sampler_is_the_dense_formula_values_and_gradients(sampling: lk.Sampling, level: str, agg: str) -> None:
    data = _data()
    z, zr = data["z"].clone().requires_grad_(), data["zr"].clone().requires_grad_()
    zd, zrd = data["z"].clone().requires_grad_(), data["zr"].clone().requires_grad_()
    mask, tokens = data["mask"], data["tokens"]
    loss_fn = lk.KLPenaltyLoss("full", coef=0.5, agg=agg, level=level, sampling=sampling)
    kwargs: dict[str, Any] = {}
    if level == "sequence":
        # the processed log-prob of the sampled token (differentiable), from the same sampler
        kwargs["sampled_logprob"] = _processed_logp(z, sampling).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    with pytest.warns(UserWarning, match="`ref_logits` requires grad") as record:  # its gradient is tested here
        got = loss_fn(z, zr, mask, **kwargs)
    assert record[0].filename == __file__  # the warning points at the user's call, through nn.Module's frames
    want = _dense_loss(zd, zrd, mask, sampling, level, tokens, 0.5, agg)
    assert_close(got, want, rtol=1e-10, atol=1e-12)
    got_grads = torch.autograd.grad(got, (z, zr))
    want_grads = torch.autograd.grad(want, (zd, zrd))
    for a, b in zip(got_grads, want_grads):
        assert_close(a, b, rtol=1e-9, atol=1e-12)
    # the metric got the exact per-token KL of the valid positions
    kl = _dense_kl(data["z"], data["zr"], sampling)[mask]
    assert_close(loss_fn.metric.compute().double(), kl.mean(), rtol=1e-6, atol=1e-7)


def test_the_top_p_sequence_kl_is_not_the_plain_softmax_kl() -> None:
    # the trap: KLPenaltyLoss("full") read the plain softmax KL of a top-p sampler
    data = _data(1)
    sampling = lk.Sampling(temperature=0.7, top_p=0.8)
    slp = _processed_logp(data["z"], sampling).gather(-1, data["tokens"].unsqueeze(-1)).squeeze(-1)
    args = (data["z"], data["zr"], data["mask"])
    processed = lk.KLPenaltyLoss("full", agg="token-sum", level="sequence", sampling=sampling)(*args, sampled_logprob=slp)
    plain = lk.KLPenaltyLoss("full", agg="token-sum", level="sequence", sampling=lk.Sampling(temperature=0.7))(*args, sampled_logprob=slp)
    assert not torch.isclose(processed, plain, rtol=1e-3)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_from_hidden_is_the_dense_formula_at_both_levels(level: str, temperature: float) -> None:
    g = torch.Generator().manual_seed(3)
    h, hr = torch.randn(B, T, D, generator=g, dtype=F64), torch.randn(B, T, D, generator=g, dtype=F64)
    w, wr = torch.randn(V, D, generator=g, dtype=F64), torch.randn(V, D, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    sampling = lk.Sampling(temperature=temperature)
    ins = [t.clone().requires_grad_() for t in (h, w)]
    dense_ins = [t.clone().requires_grad_() for t in (h, w)]
    tokens = (h @ w.T).argmax(-1)
    agg = "seq-mean-token-sum"
    kwargs: dict[str, Any] = {}
    if level == "sequence":
        kwargs["sampled_logprob"] = _processed_logp(ins[0] @ ins[1].T, sampling).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    loss_fn = lk.KLPenaltyLoss("full", coef=2.0, agg=agg, level=level, sampling=sampling)
    got = loss_fn(lk.FromHidden(*ins), lk.FromHidden(hr, wr), mask, **kwargs)
    want = _dense_loss(dense_ins[0] @ dense_ins[1].T, hr @ wr.T, mask, sampling, level, tokens, 2.0, agg)
    assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, ins), torch.autograd.grad(want, dense_ins)):
        assert_close(a, b, rtol=1e-9, atol=1e-12)
    # kl_penalty, the function users call, gives the loss's per-token values
    values = lk.kl_penalty(lk.FromHidden(h, w), lk.FromHidden(hr, wr), "full", mask=mask, sampling=sampling)
    assert_close(values, torch.where(mask, _dense_kl(h @ w.T, hr @ wr.T, sampling), 0.0), rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:`ref_(hidden|logits)` requires grad")  # the reference side's gradient is checked too
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_truncating_sampler_from_hidden_states_equals_the_same_from_their_logits(level: str) -> None:
    """The engine makes the logits from the head chunk by chunk: the loss from ``FromHidden`` is the loss
    of ``hidden @ weight.T + bias``, values and gradients (hidden states, head and bias), in float64."""
    g = torch.Generator().manual_seed(7)
    h, rh = torch.randn(2, 3, D, generator=g, dtype=F64), torch.randn(2, 3, D, generator=g, dtype=F64)
    w, rw = torch.randn(V, D, generator=g, dtype=F64), torch.randn(V, D, generator=g, dtype=F64)
    b = torch.randn(V, generator=g, dtype=F64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    tokens = torch.randint(0, V, (2, 3), generator=g)
    s = lk.Sampling(temperature=0.8, top_p=0.9, top_k=V - 2)
    agg = "token-mean" if level == "token" else "seq-mean-token-sum"
    results = []
    for from_hidden in (True, False):
        leaves = [x.clone().requires_grad_() for x in (h, w, b, rh, rw)]
        hh, ww, bb, rhh, rww = leaves
        logits, ref_logits = hh @ ww.T + bb, rhh @ rww.T
        x, ref_x = (lk.FromHidden(hh, ww, bb), lk.FromHidden(rhh, rww)) if from_hidden else (logits, ref_logits)
        extra = {}
        if level == "sequence":
            # the processed log-probs of the sampled tokens (outside the kept set: -inf, masked here)
            lp = lk.token_logprobs(logits, tokens, sampling=s, outside="-inf")
            extra["sampled_logprob"] = lp.masked_fill(~torch.isfinite(lp), -1.0)
        loss = lk.KLPenaltyLoss("full", coef=1.0, agg=agg, level=level, sampling=s)(x, ref_x, mask, **extra)
        results.append((loss.detach(), *torch.autograd.grad(loss, leaves)))
    for a, c in zip(*results):
        assert_close(a, c, rtol=1e-10, atol=1e-12)
    assert results[0][0] > 0


def test_temperature_on_the_loss_and_kl_penalty_is_deprecated_for_sampling() -> None:
    data = _data()
    args = (data["z"], data["zr"], data["mask"])
    with pytest.warns(DeprecationWarning, match=r"`KLPenaltyLoss\(temperature=...\)` is deprecated: pass `sampling=lk.Sampling\(temperature=0.7\)`") as record:
        old = lk.KLPenaltyLoss("full", temperature=0.7)
    assert record[0].filename == __file__  # points at the user's line
    assert old.sampling == lk.Sampling(temperature=0.7) and old.temperature == 0.7
    assert_close(old(*args), lk.KLPenaltyLoss("full", sampling=lk.Sampling(temperature=0.7))(*args))
    with pytest.warns(DeprecationWarning, match=r"`kl_penalty\(temperature=...\)` is deprecated") as record:
        values = lk.kl_penalty(data["z"], data["zr"], "full", mask=data["mask"], temperature=0.7)
    assert record[0].filename == __file__
    assert_close(values, lk.kl_penalty(data["z"], data["zr"], "full", mask=data["mask"], sampling=lk.Sampling(temperature=0.7)))
    # no warning without the keyword; both at once, or a bad value, are refused by name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lk.KLPenaltyLoss("full", sampling=lk.Sampling(temperature=0.7))
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="not with the deprecated `temperature=`"):
        lk.KLPenaltyLoss("full", temperature=0.7, sampling=lk.Sampling())
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="`temperature` must be a finite number > 0, got 0"):
        lk.KLPenaltyLoss("full", temperature=0)
    with pytest.raises(TypeError, match="`sampling` must be an `lk.Sampling` or None, got dict"):
        lk.KLPenaltyLoss("full", sampling={"temperature": 0.7})


def test_a_sampler_with_a_sampled_estimator_is_refused_and_the_neutral_one_accepted() -> None:
    # a sampled estimator takes log-probs: both models' must come from the same Sampling, which the loss
    # cannot see; a non-neutral sampler here is a sign that the user expects the loss to apply it
    with pytest.raises(ValueError, match=r"'full' estimator \(logits\) only, got Sampling\(temperature=0.7.*compute the policy's and the reference's under the same sampler"):
        lk.KLPenaltyLoss("k3+", sampling=lk.Sampling(temperature=0.7))
    lk.KLPenaltyLoss("k3+", sampling=lk.Sampling())
    assert "sampling=" not in repr(lk.KLPenaltyLoss("full"))
    assert "sampling=Sampling(temperature=0.7" in repr(lk.KLPenaltyLoss("full", sampling=lk.Sampling(temperature=0.7)))
