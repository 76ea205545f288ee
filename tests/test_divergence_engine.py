"""Every divergence through the one vocabulary engine: source x direction x sampler x reference, values and
gradients, in one process, against float64 maths written from the formulas.

The dense side: ``transformers``' own warpers process the scores (as in ``test_engine_matrix.py``), each
side's log-probs by ``log_softmax`` (``-inf`` off its support), then the divergence written out term by
term from its definition (:func:`dense_divergence`: the two KLs, the mixture, TRL's generalized JSD with
``m = (1 - beta) p + beta q``), and autograd for every gradient: the policy's logits, hidden states, head
and bias, and the other side's when it requires grad. Masked rows hold NaN: value and gradient exactly 0.
A head's tiles and the split vocabulary's shards are in ``test_a_head_tiles_...`` below and in
``test_vocab_parallel.py``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.logprobs import REFERENCES

from test_engine_matrix import B, D, SAMPLERS, T, V, processed_scores  # noqa: E402

F64 = torch.float64
NINF = float("-inf")

#: (divergence, beta) cases: the directions, the JSD inside and at both ends, the mixture inside and at an end
CASES = [("reverse", None), ("forward", None), ("jsd", 0.3), ("jsd", 0.0), ("jsd", 1.0), ("mixed", 0.25), ("mixed", 0.0)]


def _kl_terms(la: Tensor, lb: Tensor, safe: bool = False) -> Tensor:
    """KL(a || b) per row from log-probs, 0 log 0 = 0 (a = 0 adds nothing, whatever b holds). ``safe``: a
    finite stand-in for log 0 where b = 0 < a (the infinite rows, weighted 0), for NaN-free autograd."""
    a = la.exp()
    if safe:
        lb = lb.masked_fill(lb == NINF, 0)
    return torch.where(a > 0, a * (la.where(a > 0, 0) - lb.where(a > 0, 0)), 0).sum(-1)


def dense_divergence(lp: Tensor, lq: Tensor, name: str, beta: Optional[float], safe: bool = False) -> Tensor:
    """The divergence of each row written from its definition (TRL's ends: beta 0 forward, 1 reverse)."""
    if name == "reverse" or (name == "jsd" and beta == 1.0):
        return _kl_terms(lp, lq, safe)
    if name == "forward" or (name == "jsd" and beta == 0.0):
        return _kl_terms(lq, lp, safe)
    if name == "mixed":  # a term of weight 0 is left out (0 * inf)
        return sum(w * _kl_terms(a, b, safe) for w, a, b in ((1 - beta, lq, lp), (beta, lp, lq)) if w)
    m = (1 - beta) * lp.exp() + beta * lq.exp()
    lm = torch.where(m > 0, m.where(m > 0, 1).log(), NINF)  # log 0 = -inf without an infinite derivative
    return beta * _kl_terms(lq, lm) + (1 - beta) * _kl_terms(lp, lm)


def dense_sides(z: Tensor, zr: Tensor, s: lk.Sampling, reference: str) -> tuple[Tensor, Tensor]:
    kept = processed_scores(z, s)
    if reference == "processed":
        ref = processed_scores(zr, s)
    else:
        ref = zr / s.temperature
        if reference == "policy_kept":
            ref = ref.masked_fill(kept == NINF, NINF)
    return kept.log_softmax(-1), ref.log_softmax(-1)


def _inputs(seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "z": 2 * torch.randn(B, T, V, generator=g, dtype=F64),
        "zr": 2 * torch.randn(B, T, V, generator=g, dtype=F64),
        "hidden": torch.randn(B, T, D, generator=g, dtype=F64),
        "weight": torch.randn(V, D, generator=g, dtype=F64),
        "bias": torch.randn(V, generator=g, dtype=F64),
        "rhidden": torch.randn(B, T, D, generator=g, dtype=F64),
        "rweight": torch.randn(V, D, generator=g, dtype=F64),
        "mask": torch.tensor([[True, True, False, True, True], [True, False, True, True, False]]),
        "weights": torch.randn(B, T, generator=g, dtype=F64),
    }


HEAD = dict(logit_scale=0.8, softcap=3.0)


class Side:
    """One model's leaves, its engine input (NaN at masked rows), and its dense logits from clean leaves."""

    def __init__(self, kind: str, x: dict[str, Tensor], mask: Tensor, other: bool, grad: bool) -> None:
        self.kind = kind
        if kind == "logits":
            self.clean = [x["zr" if other else "z"].clone().requires_grad_(grad)]
            self.dirty = [self.clean[0].detach().clone().masked_fill(~mask.unsqueeze(-1), float("nan")).requires_grad_(grad)]
        else:
            h, w = x["rhidden" if other else "hidden"], x["rweight" if other else "weight"]
            b = x["bias"]
            self.clean = [t.clone().requires_grad_(grad) for t in (h, w, b)]
            self.dirty = [h.masked_fill(~mask.unsqueeze(-1), float("nan")).requires_grad_(grad), w.clone().requires_grad_(grad), b.clone().requires_grad_(grad)]

    def engine(self) -> Any:
        if self.kind == "logits":
            return self.dirty[0]
        return lk.FromHidden(*self.dirty, **(HEAD if self.kind == "capped" else {}))

    def dense(self) -> Tensor:
        if self.kind == "logits":
            return self.clean[0]
        a = F.linear(*self.clean)
        if self.kind == "capped":
            return HEAD["softcap"] * torch.tanh(HEAD["logit_scale"] * a / HEAD["softcap"])
        return a


def check(kind: str, name: str, beta: Optional[float], s: lk.Sampling, reference: str, other_grad: bool = False, seed: int = 0, **kw: Any) -> None:
    x = _inputs(seed)
    mask = x["mask"]
    pol, oth = Side(kind, x, mask, False, True), Side(kind, x, mask, True, other_grad)
    got = lk.full_kl(pol.engine(), oth.engine(), mask, sampling=s, reference=reference, divergence=name, beta=beta, **kw)
    lp, lq = dense_sides(pol.dense(), oth.dense(), s, reference)
    want = dense_divergence(lp, lq, name, beta).where(mask, 0)
    assert (got[~mask] == 0).all()
    finite = want.isfinite()
    assert torch.equal(finite, got.isfinite()) and torch.equal(want[~finite], got[~finite])
    assert_close(got[finite], want[finite].detach(), rtol=1e-10, atol=1e-12)
    w = x["weights"].where(finite, 0)
    leaves = pol.dirty + (oth.dirty if other_grad else [])
    grads = torch.autograd.grad((w * got.where(finite, 0)).sum(), leaves)
    # where the value is +inf its weight is 0: the dense side's NaN there stays out of autograd
    safe = dense_divergence(lp, lq, name, beta, True).where(mask, 0)
    expect = torch.autograd.grad((w * safe.where(finite, 0)).sum(), pol.clean + (oth.clean if other_grad else []))
    for a, e in zip(grads, expect):
        assert torch.isfinite(a).all() and torch.isfinite(e).all()
        assert_close(a, e, rtol=1e-9, atol=1e-12)
    if kind == "logits":
        assert (grads[0][~mask] == 0).all()


@pytest.mark.filterwarnings("ignore:`ref_")
@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("name,beta", CASES)
@pytest.mark.parametrize("kind", ["logits", "hidden", "capped"])
def test_matrix(kind: str, name: str, beta: Optional[float], sampler: str, reference: str) -> None:
    check(kind, name, beta, SAMPLERS[sampler], reference, other_grad=(sampler in ("none", "T", "top_k")), chunk_size=3)


@pytest.mark.filterwarnings("ignore:`ref_")
@pytest.mark.parametrize("name,beta", [("forward", None), ("jsd", 0.3), ("mixed", 0.25)])
@pytest.mark.parametrize("sampler", ["none", "T", "T+k+p"])
def test_a_head_tiles_the_vocabulary_and_merges_every_divergence(monkeypatch, name: str, beta: Optional[float], sampler: str) -> None:
    """Tiles of 4 columns (the last 1 wide) at chunks of 3 rows: the KL mixes merge per tile, the JSD reads
    them again with the global log-sums; the same values and gradients (a truncating sampler keeps whole rows)."""
    from lightning_kl.kernels import engine

    counts: list[int] = []
    real = engine.Source.tiles
    monkeypatch.setattr(engine, "HIDDEN_CPU_TILE_ELEMENTS", 12)
    monkeypatch.setattr(engine.Source, "tiles", lambda self, *a: counts.append(len(real(self, *a))) or real(self, *a))
    for kind in ("hidden", "capped"):
        check(kind, name, beta, SAMPLERS[sampler], "unprocessed", other_grad=True, chunk_size=3)
    assert max(counts) == (1 if SAMPLERS[sampler].truncates else -(-V // 4))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name,beta", [("jsd", 1.0), ("mixed", 1.0)])
def test_the_reverse_ends_take_the_reverse_kls_own_path_bitwise(name: str, beta: float, temperature: float) -> None:
    g = torch.Generator().manual_seed(3)
    z = (3 * torch.randn(4, 6, 50, generator=g)).to(torch.bfloat16).requires_grad_()
    zr = (3 * torch.randn(4, 6, 50, generator=g)).to(torch.bfloat16).requires_grad_()
    s = lk.Sampling(temperature)
    with pytest.warns(UserWarning, match="requires grad"):
        a = lk.full_kl(z, zr, sampling=s, chunk_size=5)
        b = lk.full_kl(z, zr, sampling=s, divergence=name, beta=beta, chunk_size=5)
    assert torch.equal(a, b)
    ga = torch.autograd.grad(a.sum(), [z, zr])
    gb = torch.autograd.grad(b.sum(), [z, zr])
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def _trl_generalized_jsd_loss() -> Any:
    from _mismatch_stacks import _compile, _function, _tree, package_root

    path = package_root("trl") / "experimental" / "gkd" / "gkd_trainer.py"
    return _compile(_function(_tree(path), "generalized_jsd_loss"), {"torch": torch, "F": F})


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_jsd_is_trls_own_generalized_jsd_loss(beta: float, temperature: float) -> None:
    """TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` (its own code, from the pinned package), per token and
    with its gradient w.r.t. the student's logits: the same convention (beta 0 forward, 1 reverse)."""
    trl_jsd = _trl_generalized_jsd_loss()
    g = torch.Generator().manual_seed(int(10 * beta) + 1)
    student = (2 * torch.randn(3, 5, 17, generator=g, dtype=F64)).requires_grad_()
    teacher = 2 * torch.randn(3, 5, 17, generator=g, dtype=F64)
    labels = torch.tensor([[1, 2, -100, 3, 4], [5, -100, -100, 6, 7], [8, 9, 10, 11, 12]])
    theirs = trl_jsd(student, teacher, labels=labels, beta=beta, temperature=temperature, reduction="none")
    ours = lk.full_kl(student, teacher, labels != -100, sampling=lk.Sampling(temperature), divergence="jsd", beta=beta)
    assert_close(ours[labels != -100], theirs.sum(-1), rtol=1e-12, atol=1e-14)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), student)
    (g_ours,) = torch.autograd.grad(ours.sum(), student)
    assert_close(g_ours, g_theirs, rtol=1e-10, atol=1e-13)
    # and the end that TRL special-cases is the KL it names
    if beta in (0.0, 1.0):
        direction = "forward" if beta == 0.0 else "reverse"
        assert_close(ours, lk.full_kl(student, teacher, labels != -100, sampling=lk.Sampling(temperature), divergence=direction), rtol=0, atol=0)


@pytest.mark.parametrize("name,beta", [("forward", None), ("jsd", 0.5), ("mixed", 0.5)])
@pytest.mark.parametrize("ref_grad", [False, True])
def test_no_tensor_larger_than_a_chunk_but_the_gradients(name: str, beta: Optional[float], ref_grad: bool) -> None:
    from test_full import _AllocationLog, logits

    n, vocab, chunk = 24, 64, 3  # the O(n) statistics (6 rows) stay below a chunk of 3 rows
    z = logits(n, vocab).float().requires_grad_()
    zr = logits(n, vocab, seed=1).float().requires_grad_(ref_grad)
    mask = torch.arange(n) % 5 != 0
    log = _AllocationLog()
    with log, pytest.warns(UserWarning, match="requires grad") if ref_grad else _nothing():
        kl = lk.full_kl(z, zr, mask, sampling=lk.Sampling(0.7), divergence=name, beta=beta, chunk_size=chunk)
        kl.sum().backward()
    big = [s for s in log.sizes if s[1] > chunk * vocab]
    assert len(big) == 1 + ref_grad, big  # the gradient buffers, nothing else
    assert all(size == n * vocab for _, size in big)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def test_an_infinite_divergence_raises_in_backward_and_is_finite_where_it_should_be() -> None:
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]], dtype=F64, requires_grad=True)
    zr = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=F64)
    top2 = lk.Sampling(top_k=2)
    # the teacher's mass outside the policy's kept set: KL(q || p~) = +inf, its gradient does not exist
    fwd = lk.full_kl(z, zr, sampling=top2, divergence="forward")
    assert fwd.item() == math.inf
    with pytest.raises(ValueError, match=r"'forward' divergence is \+inf at 1 token.*reference='policy_kept'"):
        fwd.sum().backward()
    # on the policy's kept set, and the JSD inside (0, 1): finite, with a gradient
    for kw in (dict(divergence="forward", reference="policy_kept"), dict(divergence="jsd", beta=0.5), dict(divergence="mixed", beta=0.5, reference="policy_kept")):
        v = lk.full_kl(z, zr, sampling=top2, **kw)
        assert math.isfinite(v.item())
        (g,) = torch.autograd.grad(v.sum(), z)
        assert torch.isfinite(g).all() and (g[0, 2:] == 0).all()  # nothing for the removed tokens


@pytest.mark.parametrize("bad, message", [
    (dict(divergence="kl"), r"Unknown divergence 'kl'. Valid divergences: 'reverse', 'forward', 'jsd', 'mixed'"),
    (dict(divergence="jsd", beta=1.5), r"`beta` must be a number in \[0, 1\]"),
    (dict(divergence="forward", beta=0.5), r"`beta` is for divergence='jsd' or 'mixed'"),
])
def test_full_kl_refuses_a_bad_divergence(bad: dict, message: str) -> None:
    z = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=message):
        lk.full_kl(z, z, **bad)
    with pytest.raises(ValueError, match=message):
        lk.KLPenaltyLoss("full", **bad)


def test_the_loss_refuses_a_direction_it_cannot_compute() -> None:
    with pytest.raises(ValueError, match=r"divergence='forward' needs estimator='full'.*Valid with 'k3\+': divergence='reverse'"):
        lk.KLPenaltyLoss("k3+", divergence="forward")
    with pytest.raises(ValueError, match=r"divergence='jsd' takes level='token' only"):
        lk.KLPenaltyLoss("full", level="sequence", agg="token-sum", divergence="jsd")
    for name, beta in (("forward", None), ("mixed", 0.99), ("jsd", 0.0)):
        with pytest.raises(ValueError, match=r"holds the forward KL .* \+inf at every token under the truncating"):
            lk.KLPenaltyLoss("full", sampling=lk.Sampling(top_k=5), divergence=name, beta=beta)
    lk.KLPenaltyLoss("full", sampling=lk.Sampling(top_k=5), divergence="jsd", beta=0.01)  # finite
    lk.KLPenaltyLoss("full", sampling=lk.Sampling(top_k=5), divergence="mixed", beta=1.0)  # the reverse KL
    assert "divergence='jsd', beta=0.5" in repr(lk.KLPenaltyLoss("full", divergence="jsd"))
    lk.KLPenaltyLoss("k3+", divergence="reverse")  # the default, said explicitly


@pytest.mark.parametrize("name,beta", [("forward", None), ("jsd", 0.2), ("mixed", 0.7)])
@pytest.mark.parametrize("source", ["logits", "capped"])
def test_the_loss_is_the_token_mean_of_full_kl(name: str, beta: Optional[float], source: str) -> None:
    x = _inputs(4)
    mask = x["mask"]
    pol, oth = Side(source, x, mask, False, True), Side(source, x, mask, True, False)
    s = lk.Sampling(0.8, top_p=0.9) if name == "jsd" else lk.Sampling(0.8)  # the forward KL is +inf under truncation
    loss_fn = lk.KLPenaltyLoss("full", coef=0.5, sampling=s, divergence=name, beta=beta)
    loss = loss_fn(pol.engine(), oth.engine(), mask)
    lp, lq = dense_sides(pol.dense(), oth.dense(), s, "unprocessed")
    want = 0.5 * dense_divergence(lp, lq, name, beta)[mask].mean()
    assert_close(loss, want.to(loss.dtype), rtol=1e-10, atol=1e-12)
    got = torch.autograd.grad(loss, pol.dirty)
    expect = torch.autograd.grad(want, pol.clean)
    for a, e in zip(got, expect):
        assert_close(a, e, rtol=1e-9, atol=1e-12)
    assert_close(loss_fn.metric.compute(), want.detach() / 0.5, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# configuration from YAML: the loss with its divergence, by LightningCLI


def _cli(tmp_path: Any, monkeypatch: Any, init_args: dict) -> Any:
    import sys

    import lightning.pytorch as pl
    import yaml
    from lightning.pytorch.cli import LightningCLI

    class Distilled(pl.LightningModule):
        def __init__(self, kl: lk.KLPenaltyLoss) -> None:
            super().__init__()
            self.kl = kl

    monkeypatch.setattr(sys, "argv", ["cli.py"])
    path = tmp_path / "config.yaml"
    kl = {"class_path": "lightning_kl.KLPenaltyLoss", "init_args": {"estimator": "full", **init_args}}
    path.write_text(yaml.safe_dump({"seed_everything": 0, "model": {"kl": kl}}))
    return LightningCLI(Distilled, args=["--config", str(path)], run=False)


def test_yaml_builds_each_divergence_and_refuses_a_bad_one_with_the_valid_names(tmp_path, monkeypatch) -> None:
    cli = _cli(tmp_path, monkeypatch, {"divergence": "jsd", "beta": 0.1})
    assert (cli.model.kl.divergence, cli.model.kl.beta) == ("jsd", 0.1)
    assert _cli(tmp_path, monkeypatch, {"divergence": "forward"}).model.kl.divergence == "forward"
    with pytest.raises(ValueError, match=r"Unknown divergence 'fkl'. Valid divergences: 'reverse', 'forward', 'jsd', 'mixed'"):
        _cli(tmp_path, monkeypatch, {"divergence": "fkl"})
    with pytest.raises(ValueError, match=r"`beta` must be a number in \[0, 1\]"):
        _cli(tmp_path, monkeypatch, {"divergence": "mixed", "beta": 2.0})


# ---------------------------------------------------------------------------------------------
# a vocabulary split over 2 processes (gloo): tests/_divergence_parallel_worker.py


def test_a_vocabulary_split_over_two_processes_gives_the_one_process_values_and_gradients(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    worker = Path(__file__).resolve().parent / "_divergence_parallel_worker.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    try:
        proc = subprocess.run([sys.executable, str(worker), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the 2-process run did not finish in {err.timeout} s:\n{err.stderr}")
    errors = {}
    for rank in range(2):
        path = tmp_path / f"rank{rank}.json"
        assert proc.returncode == 0 and path.exists(), f"worker failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
        record = json.loads(path.read_text())
        assert "failure" not in record, record["failure"]
        errors.update({f"rank{rank}:{k}": v for k, v in record["errors"].items()})
    # 3 divergences x 2 (temperature, chunk) x (3 DTensor + 3 empty shard + 6 head) checks, on each rank
    assert len(errors) == 2 * 3 * 2 * 12
    bad = {k: v for k, v in errors.items() if not v <= 1e-12}
    assert not bad, bad
