"""The vocabulary engine's matrix in one process: source x sampler x quantity, values and gradients.

Every combination of a source (logits, a strided slice of logits, ``lk.FromHidden`` with a bias), a
sampler (none, temperature, top-k, top-p, min-p, and combinations) and a quantity (the token log-prob,
the full KL with each of the three references, the token entropy) is compared with the dense float64
formula: ``transformers``' own warpers (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, ``MinPLogitsWarper``) process the scores, and ``log_softmax`` and autograd give
the value and every gradient (logits; hidden states, head and bias). Masked rows hold NaN: their value
and gradient must be exactly 0. The split vocabulary (2 gloo processes, uneven shards) is in
``test_vocab_parallel.py``.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.logprobs import REFERENCES

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

B, T, V, D = 2, 5, 13, 6
F64 = torch.float64
NINF = float("-inf")

SAMPLERS = {
    "none": lk.Sampling(),
    "T": lk.Sampling(0.7),
    "top_k": lk.Sampling(top_k=4),
    "top_p": lk.Sampling(top_p=0.6),
    "min_p": lk.Sampling(min_p=0.15),
    "T+k+p": lk.Sampling(1.3, top_k=7, top_p=0.8),
    "all": lk.Sampling(0.8, top_k=6, top_p=0.85, min_p=0.05),
}


def processed_scores(z: Tensor, s: lk.Sampling) -> Tensor:
    """generate's processing of ``z [..., V]`` by transformers' own warpers (float64, removed -> -inf)."""
    warpers: list[Any] = []
    if s.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(s.temperature))
    if s.top_k is not None:
        warpers.append(TopKLogitsWarper(s.top_k))
    if s.top_p is not None:
        warpers.append(TopPLogitsWarper(s.top_p))
    if s.min_p is not None:
        warpers.append(MinPLogitsWarper(s.min_p))
    flat = z.reshape(-1, z.shape[-1])
    return LogitsProcessorList(warpers)(None, flat).reshape(z.shape)


def log_dist(scores: Tensor) -> tuple[Tensor, Tensor]:
    """``log p`` with ``-inf`` off the support, and ``p``."""
    logp = torch.log_softmax(scores, -1)
    return logp, logp.exp()


def dense_entropy(z: Tensor, s: lk.Sampling) -> Tensor:
    logp, p = log_dist(processed_scores(z, s))
    return -(p * logp.masked_fill(p == 0, 0)).sum(-1)


def dense_kl(z: Tensor, zr: Tensor, s: lk.Sampling, reference: str, safe: bool = False) -> Tensor:
    """``safe``: a finite stand-in for log 0 where q = 0 < p (the infinite rows, weighted 0), for NaN-free autograd."""
    kept = processed_scores(z, s)
    if reference == "processed":
        ref = processed_scores(zr, s)
    else:
        ref = zr / s.temperature
        if reference == "policy_kept":
            ref = ref.masked_fill(kept == NINF, NINF)
    logp, p = log_dist(kept)
    logq, _ = log_dist(ref)
    off = p == 0
    if safe:
        logq = logq.masked_fill(logq == NINF, 0)
    return (p * (logp.masked_fill(off, 0) - logq.masked_fill(off, 0))).sum(-1)


def dense_logprobs(z: Tensor, tokens: Tensor, s: lk.Sampling) -> Tensor:
    logp, _ = log_dist(processed_scores(z, s))
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _inputs(seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "z": 2 * torch.randn(B, T + 1, V, generator=g, dtype=F64),
        "hidden": torch.randn(B, T, D, generator=g, dtype=F64),
        "weight": torch.randn(V, D, generator=g, dtype=F64),
        "bias": torch.randn(V, generator=g, dtype=F64),
        "mask": torch.tensor([[True, True, False, True, True], [True, False, True, True, False]]),
        "weights": torch.randn(B, T, generator=g, dtype=F64),
    }


class Model:
    """One source's leaves (what gets gradients), its engine input, and the dense logits they make."""

    def __init__(self, kind: str, x: dict[str, Tensor], nan_rows: Tensor) -> None:
        self.kind = kind
        if kind == "hidden":
            hidden = x["hidden"].masked_fill(~nan_rows.unsqueeze(-1), float("nan")) if nan_rows is not None else x["hidden"]
            self.leaves = [hidden.clone().requires_grad_(), x["weight"].clone().requires_grad_(), x["bias"].clone().requires_grad_()]
        else:
            z = x["z"].clone()
            if nan_rows is not None:
                z[:, :-1][~nan_rows] = float("nan")
            self.leaves = [z.requires_grad_()]

    def engine_input(self) -> Any:
        if self.kind == "hidden":
            return lk.FromHidden(*self.leaves)
        # a contiguous copy is read in place by row slices; the strided slice is gathered by rows
        return self.leaves[0][:, :-1] if self.kind == "slice" else self.leaves[0][:, :-1].contiguous()

    def dense(self, clean: "Model") -> Tensor:
        """The dense logits of the clean leaves (no NaN), differentiable."""
        if self.kind == "hidden":
            return F.linear(*clean.leaves)
        return clean.leaves[0][:, :-1]


def _check(kind: str, quantity: Callable[[Any], Tensor], dense: Callable[[Tensor], Tensor], masked: bool, seed: int = 0) -> None:
    x = _inputs(seed)
    mask = x["mask"] if masked else None
    got_model = Model(kind, x, mask)
    clean = Model(kind, x, None)
    got = quantity(got_model.engine_input())
    want = dense(got_model.dense(clean))
    if mask is not None:
        want = want.where(mask, 0)
        assert (got[~mask] == 0).all()
    finite = want.isfinite()
    assert torch.equal(finite, got.isfinite()) and torch.equal(want[~finite], got[~finite])
    assert_close(got[finite], want[finite].detach(), rtol=1e-10, atol=1e-12)
    w = x["weights"].where(finite, 0)
    grads = torch.autograd.grad((w * got.where(finite, 0)).sum(), got_model.leaves)
    safe = dense(got_model.dense(clean), True)
    expect = torch.autograd.grad((w * (safe if mask is None else safe.where(mask, 0)).where(finite, 0)).sum(), clean.leaves)
    for a, e in zip(grads, expect):
        assert torch.isfinite(a).all()
        assert_close(a, e, rtol=1e-9, atol=1e-12)
    if mask is not None and kind != "hidden":
        assert (grads[0][:, :-1][~mask] == 0).all()  # exactly 0 where the logits are NaN


SOURCES = ["logits", "slice", "hidden"]


@pytest.mark.parametrize("kind", SOURCES)
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_entropy(kind: str, name: str) -> None:
    s = SAMPLERS[name]
    _check(kind, lambda x: lk.token_entropy(x, _inputs(0)["mask"], sampling=s, chunk_size=3), lambda z, safe=False: dense_entropy(z, s), True)


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("kind", SOURCES)
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_full_kl(kind: str, name: str, reference: str) -> None:
    s = SAMPLERS[name]
    x = _inputs(1)
    # a reference close to the policy: its own kept sets often hold the policy's (finite "processed")
    zr = x["z"] + 0.4 * torch.randn(x["z"].shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    if kind == "hidden":
        ref_x: Any = lk.FromHidden(x["hidden"] + 0.2, x["weight"] * 0.9)
        ref_dense = F.linear(x["hidden"] + 0.2, x["weight"] * 0.9)
    else:
        ref_x = zr[:, :-1] if kind == "slice" else zr[:, :-1].contiguous()
        ref_dense = ref_x

    def quantity(inp: Any) -> Tensor:
        return lk.full_kl(inp, ref_x, _inputs(0)["mask"], sampling=s, reference=reference, chunk_size=3)

    _check(kind, quantity, lambda z, safe=False: dense_kl(z, ref_dense, s, reference, safe), True)


@pytest.mark.parametrize("kind", SOURCES)
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_token_logprobs_and_kept_mass(kind: str, name: str) -> None:
    s = SAMPLERS[name]
    x = _inputs(2)
    dense_z = F.linear(x["hidden"], x["weight"], x["bias"]) if kind == "hidden" else x["z"][:, :-1]
    # tokens drawn from each row's kept set, and one ignored position
    kept = processed_scores(dense_z, s) > NINF
    tokens = torch.where(kept, torch.rand(kept.shape, generator=torch.Generator().manual_seed(3)), -1.0).argmax(-1)
    tokens[0, 2] = -100

    def quantity(inp: Any) -> Tensor:
        return lk.token_logprobs(inp, tokens, sampling=s, ignore_index=-100, chunk_size=3)

    _check(kind, quantity, lambda z, safe=False: dense_logprobs(z, tokens.clamp(min=0), s).where(tokens != -100, 0), False, seed=2)
    z = dense_z.detach()
    _, log_kept = lk.token_logprobs(z, tokens, sampling=s, ignore_index=-100, return_log_kept=True)
    want = torch.logsumexp(processed_scores(z, s), -1) - torch.logsumexp(z / s.temperature, -1)
    assert_close(log_kept, want.where(tokens != -100, 0), rtol=1e-12, atol=1e-12)


def test_a_token_outside_the_kept_set_is_minus_inf_with_zero_gradient_or_raises() -> None:
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]], dtype=F64, requires_grad=True)
    lp = lk.token_logprobs(z, torch.tensor([3]), sampling=lk.Sampling(top_k=2), outside="-inf")
    assert lp.item() == NINF
    (g,) = torch.autograd.grad(lp.where(lp.isfinite(), 0).sum() + 0 * lp.sum().nan_to_num(), z)
    assert (g == 0).all()
    with pytest.raises(ValueError, match=r"outside the kept set"):
        lk.token_logprobs(z, torch.tensor([3]), sampling=lk.Sampling(top_k=2))


def test_entropy_edges() -> None:
    # uniform: log V; one kept token (top_k=1, top_p=0): 0; a -inf logit adds nothing (0 log 0 = 0)
    assert_close(lk.token_entropy(torch.zeros(3, 8, dtype=F64)), torch.full((3,), torch.log(torch.tensor(8.0, dtype=F64)).item(), dtype=F64))
    z = torch.randn(4, 9, dtype=F64)
    assert (lk.token_entropy(z, sampling=lk.Sampling(top_k=1)) == 0).all()
    assert (lk.token_entropy(z, sampling=lk.Sampling(top_p=0.0)) == 0).all()
    zi = torch.tensor([[0.0, 0.0, NINF]], dtype=F64, requires_grad=True)
    h = lk.token_entropy(zi)
    assert_close(h, torch.log(torch.tensor([2.0], dtype=F64)))
    h.sum().backward()
    assert torch.equal(zi.grad, torch.zeros_like(zi))  # the uniform maximum: gradient 0, and none into -inf


def test_entropy_keeps_no_float32_copy_of_the_logits() -> None:
    # what autograd keeps between forward and backward: the logits themselves and O(rows) numbers
    z = torch.randn(4, 7, 1000, dtype=torch.bfloat16, requires_grad=True)
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h = lk.token_entropy(z)
    assert h.dtype == torch.float32 and saved and all(t.data_ptr() == z.data_ptr() for t in saved)  # only z itself
    h.sum().backward()
    assert z.grad.dtype == torch.bfloat16


def test_bad_calls_name_the_problem() -> None:
    z = torch.randn(2, 3, 5)
    with pytest.raises(TypeError, match=r"both be logits .* or both lk.FromHidden"):
        lk.full_kl(z, lk.FromHidden(torch.randn(2, 3, 4), torch.randn(5, 4)))
    with pytest.raises(ValueError, match=r"`reference` must be one of"):
        lk.full_kl(z, z, reference="own")
    with pytest.raises(TypeError, match=r"`sampling` must be an lk.Sampling or None, got dict"):
        lk.token_entropy(z, sampling={"top_k": 2})
    with pytest.raises(ValueError, match=r"`mask` must have the shape"):
        lk.token_entropy(z, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"not with \['temperature'\]"):
        lk.full_kl(z, z, sampling=lk.Sampling(), temperature=0.5)


@pytest.mark.parametrize("name", ["none", "T", "top_k"])
@pytest.mark.parametrize("elements", [3, 12, 15])
@pytest.mark.parametrize("quantity", ["logprobs", "entropy", "kl"])
def test_a_head_tiles_the_vocabulary_inside_a_row_block(monkeypatch, name: str, elements: int, quantity: str) -> None:
    """Tiles of 1, 4 (the last one 1 wide) and 5 columns at chunks of 3 rows, their log-sum-exps merged:
    the same values and gradients (top-k needs whole rows: it keeps them)."""
    from lightning_kl.kernels import engine

    counts = []
    real = engine.Source.tiles
    monkeypatch.setattr(engine, "HIDDEN_CPU_TILE_ELEMENTS", elements)
    monkeypatch.setattr(engine.Source, "tiles", lambda self, *a: counts.append(len(real(self, *a))) or real(self, *a))
    if quantity == "logprobs":
        test_token_logprobs_and_kept_mass("hidden", name)
    elif quantity == "entropy":
        test_entropy("hidden", name)
    else:
        for reference in REFERENCES:
            test_full_kl("hidden", name, reference)
    assert max(counts) == (1 if name == "top_k" else -(-V // (elements // 3)))
