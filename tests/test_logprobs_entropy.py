"""``lk.token_logprobs_and_entropy``: token log-probs and entropy from one read of the vocabulary.

Against float64 formulas (tests/_exact.py): values and the gradient of ``sum(a lp + b H)`` with two
independent weights, from logits, from a head (also walked by narrow tiles), over vocabulary shards
(thread-ranks), with and without a truncating sampler; the same numbers as the two separate calls;
ignored tokens; one gradient writer from a head.
"""

from __future__ import annotations

from typing import Any

import _exact as X
import pytest
import torch

import lightning_kl as lk
from lightning_kl.kernels import engine

N, V, D = 20, 300, 16


def _data(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64)
    z = torch.randn(N, V, generator=g, dtype=torch.float64) * 2 + 5
    return {
        "z": z.to(dtype), "h": h.to(dtype), "w": w.to(dtype), "b": b.to(dtype),
        "a": torch.randn(N, generator=g, dtype=torch.float64), "c": torch.randn(N, generator=g, dtype=torch.float64),
    }


SAMPLINGS = [lk.Sampling(), lk.Sampling(temperature=0.7), lk.Sampling(temperature=0.01), lk.Sampling(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05)]


def _tokens(z: torch.Tensor, sampling: lk.Sampling) -> torch.Tensor:
    removed = X.removed_sets(z.float(), None, sampling, "unprocessed")[0]
    return torch.multinomial((~removed).double(), 1, generator=torch.Generator().manual_seed(5)).squeeze(1)


def _check(got: torch.Tensor, want: torch.Tensor, what: str, scale: float = 1.0) -> None:
    err = X.max_error(got, want)
    tol = 2e-5 * max(float(want.abs().max()), 1.0) * scale
    assert err <= tol, f"{what}: error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
@pytest.mark.parametrize("source", ["logits", "head", "head-tiled"])
def test_values_and_both_gradients_against_float64(source: str, sampling: lk.Sampling, monkeypatch: pytest.MonkeyPatch) -> None:
    if source == "head-tiled":
        if sampling.truncates:
            pytest.skip("a head is walked by tiles without truncation only")
        monkeypatch.setattr(engine, "HIDDEN_CPU_TILE_ELEMENTS", 70 * 4)  # tiles of 70 columns for chunks of 4 rows
    d = _data()
    leaves = [X.leaf(d["z"])] if source == "logits" else [X.leaf(d[k]) for k in ("h", "w", "b")]
    x = leaves[0] if source == "logits" else lk.FromHidden(*leaves)
    z = X.logits_of(x, torch.float32).detach()
    tokens = _tokens(z, sampling)
    lp, ent = lk.token_logprobs_and_entropy(x, tokens, sampling=sampling, chunk_size=4)
    grads = torch.autograd.grad((lp.double() * d["a"] + ent.double() * d["c"]).sum(), leaves)
    removed = X.removed_sets(z, None, sampling, "unprocessed")[0]
    lp64, ent64, gz = X.formula_rows(z, tokens, sampling.temperature, removed, d["a"], d["c"])
    _check(lp, lp64, "log-probs")
    _check(ent, ent64, "entropy")
    want = [gz] if source == "logits" else X.chain_head(gz, *leaves)
    for name, got, w in zip(["x/hidden", "weight", "bias"], grads, want):
        _check(got, w, f"gradient w.r.t. {name}", scale=10.0)


@pytest.mark.parametrize("sampling", SAMPLINGS[:3], ids=str)
@pytest.mark.parametrize("head", [False, True], ids=["logits", "head"])
def test_over_vocabulary_shards(head: bool, sampling: lk.Sampling) -> None:
    # the ranks' own merge code, on thread-ranks: columns [0, 120) and [120, 300) (head rows alike)
    d = _data(seed=1)
    bounds = [0, 120, V]
    leaves = [X.leaf(d["z"])] if not head else [X.leaf(d[k]) for k in ("h", "w", "b")]
    x = leaves[0] if not head else lk.FromHidden(*leaves)
    z = X.logits_of(x, torch.float32).detach()
    tokens = _tokens(z, sampling)
    grads: dict[int, Any] = {}

    def job(rank: int, cols: slice, part: engine.Partition) -> tuple[torch.Tensor, torch.Tensor]:
        src = engine.Tensors(leaves[0], leaves[1][cols], leaves[2][cols]) if head else engine.Tensors(leaves[0][:, cols])
        lp, ent, _ = engine.token_logprobs_entropy_kernel(src, tokens, None, sampling, part, 3)
        grads[rank] = torch.autograd.grad((lp.double() * d["a"] + ent.double() * d["c"]).sum(), leaves)
        return lp.detach(), ent.detach()

    outs = X.on_thread_ranks(bounds, job)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    lp64, ent64, gz = X.formula_rows(z, tokens, sampling.temperature, torch.zeros(z.shape, dtype=torch.bool), d["a"], d["c"])
    _check(outs[0][0], lp64, "log-probs")
    _check(outs[0][1], ent64, "entropy")
    if head:
        want = X.chain_head(gz, *leaves)
        assert torch.equal(grads[0][0], grads[1][0]), "every rank holds the hidden states' whole gradient"
        _check(grads[0][0], want[0], "gradient w.r.t. hidden", 10.0)
        for k in range(2):
            rows = slice(bounds[k], bounds[k + 1])
            _check(grads[k][1][rows], want[1][rows], f"rank {k}'s head rows", 10.0)
            _check(grads[k][2][rows], want[2][rows], f"rank {k}'s bias", 10.0)
    else:
        full = grads[0][0][:, :120].clone(), grads[1][0][:, 120:]
        _check(torch.cat(full, 1), gz, "gradient w.r.t. the logits", 10.0)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_equals_the_two_separate_calls(dtype: torch.dtype, sampling: lk.Sampling) -> None:
    d = _data(dtype, seed=2)
    tokens = _tokens(d["z"].float(), sampling)
    z1, z2 = X.leaf(d["z"]), X.leaf(d["z"])
    lp, ent = lk.token_logprobs_and_entropy(z1, tokens, sampling=sampling, chunk_size=7)
    lp_alone = lk.token_logprobs(z2, tokens, sampling=sampling, chunk_size=7)
    ent_alone = lk.token_entropy(z2, sampling=sampling, chunk_size=7)
    assert torch.equal(lp, lp_alone) and torch.equal(ent, ent_alone)  # the same ops on the same numbers
    (g1,) = torch.autograd.grad((lp * d["a"].float() + ent * d["c"].float()).sum(), z1)
    (g2,) = torch.autograd.grad((lp_alone * d["a"].float() + ent_alone * d["c"].float()).sum(), z2)
    # one rounding to the input dtype of the sum, against two roundings added
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(g1.double(), g2.double(), rtol=2 * eps, atol=2 * eps * float(g2.abs().max().double()))


def test_ignored_tokens_get_zero_and_zero_gradient_even_on_nan_logits() -> None:
    d = _data(seed=3)
    z = d["z"].clone()
    tokens = _tokens(z, lk.Sampling())
    tokens[[2, 7]] = -100
    z[7] = float("nan")  # padding
    z = z.requires_grad_(True)
    lp, ent = lk.token_logprobs_and_entropy(z, tokens, ignore_index=-100, chunk_size=4)
    assert lp[2] == 0 and ent[2] == 0 and lp[7] == 0 and ent[7] == 0
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    (g,) = torch.autograd.grad((lp + ent).sum(), z)
    assert torch.equal(g[[2, 7]], torch.zeros(2, V))
    keep = torch.ones(N, dtype=torch.bool)
    keep[[2, 7]] = False
    lp64, ent64, _ = X.formula_rows(z.detach()[keep], tokens[keep], 1.0, torch.zeros(int(keep.sum()), V, dtype=torch.bool), None, None)
    _check(lp[keep], lp64, "log-probs")
    _check(ent[keep], ent64, "entropy")


def test_one_gradient_writer_from_a_head(monkeypatch: pytest.MonkeyPatch) -> None:
    # one float32 [V, d] accumulator for both gradients (two calls would make two, then autograd adds them)
    made: list[Any] = []
    real = engine.HeadGrad

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "HeadGrad", counting)
    d = _data(seed=4)
    h, w = X.leaf(d["h"]), X.leaf(d["w"])
    tokens = _tokens(X.logits_of(lk.FromHidden(h, w), torch.float32).detach(), lk.Sampling())
    lp, ent = lk.token_logprobs_and_entropy(lk.FromHidden(h, w), tokens)
    (lp.sum() + ent.sum()).backward()
    assert len(made) == 1


def test_a_token_outside_the_kept_set() -> None:
    z = torch.tensor([[3.0, 2.0, 0.0, -1.0]])
    with pytest.raises(ValueError, match="outside the kept set"):
        lk.token_logprobs_and_entropy(z, torch.tensor([3]), sampling=lk.Sampling(top_k=2))
    lp, ent = lk.token_logprobs_and_entropy(z, torch.tensor([3]), sampling=lk.Sampling(top_k=2), outside="-inf")
    p = torch.softmax(torch.tensor([3.0, 2.0]), 0)
    assert lp[0] == float("-inf")
    torch.testing.assert_close(ent[0], -(p * p.log()).sum())


def test_only_one_of_the_two_used_in_the_loss() -> None:
    # a gradient arrives for one output only: the other adds nothing
    d = _data(seed=6)
    z = X.leaf(d["z"])
    tokens = _tokens(d["z"], lk.Sampling())
    lp, ent = lk.token_logprobs_and_entropy(z, tokens)
    (g,) = torch.autograd.grad(ent.sum(), z)
    _, _, want = X.formula_rows(d["z"], tokens, 1.0, torch.zeros(N, V, dtype=torch.bool), None, torch.ones(N))
    _check(g, want, "entropy gradient alone", 10.0)
