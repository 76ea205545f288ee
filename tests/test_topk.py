"""A teacher's top-k log-probs as the other side (lk.TopK, lightning_kl.distill.topk): the divergence
coarsened onto the k ids and a tail per model, against float64 maths written out by enumeration; the
full divergence at k = V; 0 <= coarsened <= full over random draws; the payload's errors; and the
engine's k-id gather it runs through."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.distill.topk import TopKDivergence
from lightning_kl.kernels import engine
from lightning_kl.kernels.engine import WHOLE, Tensors, token_logprobs_kernel

NINF = float("-inf")
CASES = [("reverse", None), ("forward", None), ("jsd", 0.0), ("jsd", 0.3), ("jsd", 1.0), ("mixed", 0.25), ("mixed", 1.0)]
DIRECTIONS = [("reverse", None), ("forward", None), ("jsd", 0.3), ("mixed", 0.6)]


# --- the maths written out: float64, plain Python per row ------------------------------------


def _kl(a, b):  # KL(a || b), 0 log 0 = 0
    return sum((x * (math.log(x) - math.log(y)) if y > 0 else math.inf) if x > 0 else 0.0 for x, y in zip(a, b))


def _div(p, q, name, beta):
    if name == "reverse" or (name == "jsd" and beta == 1.0):
        return _kl(p, q)
    if name == "forward" or (name == "jsd" and beta == 0.0):
        return _kl(q, p)
    if name == "mixed":  # a weight of 0 drops its term (0 * inf)
        return ((1 - beta) * _kl(q, p) if beta < 1 else 0.0) + (beta * _kl(p, q) if beta > 0 else 0.0)
    m = [(1 - beta) * a + beta * b for a, b in zip(p, q)]
    return beta * _kl(q, m) + (1 - beta) * _kl(p, m)


def _cells(p, ids, lq):
    """The k + 1 cells of one row: the student's processed probabilities ``p`` (all V) at the live ids, the
    served probabilities there, and each model's rest."""
    live = [(i, l) for i, l in zip(ids, lq) if l != NINF]
    P = [p[i] for i, _ in live]
    Q = [math.exp(l) for _, l in live]
    rest = [1.0 - sum(P), 1.0 - sum(Q)]  # exactly 0 where the cells hold all the mass (float64 noise otherwise)
    return P + [rest[0] if abs(rest[0]) > 1e-14 else 0.0], Q + [rest[1] if abs(rest[1]) > 1e-14 else 0.0]


def _processed(z, T=1.0, top_k=None):
    """The student's processed distribution, written out: softmax(z / T) on its top_k largest."""
    s = z / T
    if top_k is not None:
        s = s.masked_fill(s < s.topk(top_k, dim=-1).values[..., -1:], NINF)
    return s.log_softmax(-1)


def _torch_kl(a, b):  # differentiable KL(a || b) over the last dim, 0 log 0 = 0 (no NaN in the gradient)
    has, ok = a > 0, (a > 0) & (b > 0)
    a1, b1 = torch.where(has, a, 1.0), torch.where(ok, b, 1.0)
    return torch.where(ok, a1 * (a1.log() - b1.log()), torch.where(has, math.inf, 0.0)).sum(-1)


def _torch_div(P, Q, name, beta):
    if name == "reverse" or (name == "jsd" and beta == 1.0):
        return _torch_kl(P, Q)
    if name == "forward" or (name == "jsd" and beta == 0.0):
        return _torch_kl(Q, P)
    if name == "mixed":
        return ((1 - beta) * _torch_kl(Q, P) if beta < 1 else 0.0) + (beta * _torch_kl(P, Q) if beta > 0 else 0.0)
    M = (1 - beta) * P + beta * Q
    return beta * _torch_kl(Q, M) + (1 - beta) * _torch_kl(P, M)


def _torch_reference(lp_full, ids, lq, name, beta):
    """The coarsened divergence in torch float64, differentiable w.r.t. the student's full log-probs:
    cells gathered, tails 1 - sum (no log domain), padding dropped."""
    live = lq != NINF
    P = torch.where(live, lp_full.gather(-1, ids.clamp(min=0)).exp(), 0.0)
    Q = torch.where(live, lq.exp(), 0.0)
    P = torch.cat([P, (1 - P.sum(-1, keepdim=True))], -1)
    Q = torch.cat([Q, (1 - Q.sum(-1, keepdim=True))], -1)
    return _torch_div(P, Q, name, beta)


# --- payloads ------------------------------------------------------------------------------------


def _teacher(lead, V, k, gen, pad=True, dtype=torch.float64):
    """A teacher's top-k of a random distribution (its k largest, in order), some rows' last entries
    padded with -inf and junk ids."""
    zq = 2 * torch.randn(*lead, V, generator=gen, dtype=torch.float64)
    lq_full = zq.log_softmax(-1)
    lq, ids = lq_full.topk(k, dim=-1)
    if pad:
        short = torch.rand(*lead, generator=gen) < 0.3
        cut = torch.zeros(*lead, k, dtype=torch.bool)
        cut[..., k - 1] = short
        lq = lq.masked_fill(cut, NINF)
        ids = ids.masked_fill(cut, -7)  # a padded entry's id is not read
    return lk.TopK(ids, lq.to(dtype)), lq_full


B, T_, V, K = 2, 5, 11, 4


def _student(source, gen):
    h = torch.randn(B, T_, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    if source == "logits":
        z = (2 * torch.randn(B, T_, V, generator=gen, dtype=torch.float64)).requires_grad_()
        return z, (z,), lambda: z
    cap = 3.0
    return lk.FromHidden(h, W, softcap=cap), (h, W), lambda: cap * torch.tanh(h @ W.T / cap)


@pytest.mark.parametrize("name,beta", CASES)
@pytest.mark.parametrize("sampler", ["none", "T", "top_k"])
@pytest.mark.parametrize("source", ["logits", "hidden", "tiled"])
def test_values_gradients_and_tails_match_the_enumeration(monkeypatch, source, sampler, name, beta):
    if source == "tiled":  # a head's vocabulary walked by tiles of 4 columns (top-k keeps whole rows)
        monkeypatch.setattr(engine, "HIDDEN_CPU_TILE_ELEMENTS", 4 * B * T_)
    gen = torch.Generator().manual_seed(1)
    x, leaves, logits = _student("logits" if source == "logits" else "hidden", gen)
    topk, _ = _teacher((B, T_), V, K, gen)
    mask = torch.ones(B, T_, dtype=torch.bool)
    mask[1, 3:] = False
    T, top_k = {"none": (1.0, None), "T": (0.7, None), "top_k": (0.8, 6)}[sampler]
    sampling = lk.Sampling(temperature=T, top_k=top_k)
    got = lk.full_kl(x, topk, mask, sampling=sampling, divergence=name, beta=beta, return_tails=True)
    assert isinstance(got, TopKDivergence)
    lp_full = _processed(logits(), T, top_k)
    p_full = lp_full.detach().exp()
    for b in range(B):
        for t in range(T_):
            if not mask[b, t]:
                assert got.value[b, t] == 0 and got.student_tail[b, t] == 0 and got.teacher_tail[b, t] == 0
                continue
            P, Q = _cells(p_full[b, t].tolist(), topk.ids[b, t].tolist(), topk.logprobs[b, t].tolist())
            want = _div(P, Q, name, beta)
            if math.isinf(want):
                assert got.value[b, t].item() == math.inf
            else:
                assert got.value[b, t].item() == pytest.approx(want, rel=1e-10, abs=1e-13)
            assert got.student_tail[b, t].item() == pytest.approx(P[-1], rel=1e-10, abs=1e-14)
            assert got.teacher_tail[b, t].item() == pytest.approx(Q[-1], rel=1e-10, abs=1e-14)
    finite = mask & torch.isfinite(got.value)
    w = torch.randn(B, T_, generator=gen, dtype=torch.float64) * finite
    grads = torch.autograd.grad((got.value.masked_fill(~finite, 0) * w).sum(), leaves)
    want = _torch_reference(lp_full, topk.ids, topk.logprobs, name, beta)
    wants = torch.autograd.grad((want.masked_fill(~finite, 0) * w).sum(), leaves)
    for a, e in zip(grads, wants):
        assert_close(a, e, rtol=1e-9, atol=1e-12)


def _full(lp, lq, name, beta):
    """The full divergence of two float64 log-prob rows, by the formula (plain Python)."""
    return _div(lp.exp().tolist(), lq.exp().tolist(), name, beta)


@pytest.mark.parametrize("name,beta", CASES)
def test_k_equal_to_v_is_the_full_divergence_in_value_and_gradient(name, beta):
    gen = torch.Generator().manual_seed(2)
    z = (2 * torch.randn(3, V, generator=gen, dtype=torch.float64)).requires_grad_()
    zq = 2 * torch.randn(3, V, generator=gen, dtype=torch.float64)
    lq_full = zq.log_softmax(-1)
    perm = torch.stack([torch.randperm(V, generator=gen) for _ in range(3)])
    topk = lk.TopK(perm, lq_full.gather(-1, perm))
    got = lk.full_kl(z, topk, divergence=name, beta=beta, return_tails=True)
    lp = z.log_softmax(-1)
    for r in range(3):
        assert got.value[r].item() == pytest.approx(_full(lp[r].detach(), lq_full[r], name, beta), rel=1e-12, abs=1e-14)
    assert (got.student_tail == 0).all() and (got.teacher_tail == 0).all()  # both tails rounding noise: 0
    # the gradient is the full divergence's, by autograd of the formula over the whole vocabulary
    want = _torch_div(lp.exp(), lq_full.exp(), name, beta)
    assert_close(torch.autograd.grad(got.value.sum(), z)[0], torch.autograd.grad(want.sum(), z)[0], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("seed", range(40))
def test_the_coarsened_divergence_lies_between_zero_and_the_full_one(seed):
    """The data-processing inequality: 0 <= D(cells) <= D(full), for any ids (not only the top ones),
    any k, temperature and direction; float64."""
    gen = torch.Generator().manual_seed(100 + seed)
    v = int(torch.randint(2, 40, (), generator=gen))
    n = 8
    scale = float(torch.rand((), generator=gen)) * 5
    z = scale * torch.randn(n, v, generator=gen, dtype=torch.float64)
    lq_full = (scale * torch.randn(n, v, generator=gen, dtype=torch.float64)).log_softmax(-1)
    T = 0.3 + float(torch.rand((), generator=gen)) * 1.5
    lp_full = (z / T).log_softmax(-1)
    for name, beta in CASES:
        full = [_full(lp_full[r], lq_full[r], name, beta) for r in range(n)]
        for k in sorted({1, max(1, v // 3), v - 1, v} - {0}):
            ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)])
            got = lk.full_kl(z, lk.TopK(ids, lq_full.gather(-1, ids)), sampling=lk.Sampling(temperature=T), divergence=name,
                             beta=beta, return_tails=True)
            for r in range(n):
                assert got.value[r].item() >= 0.0
                assert got.value[r].item() <= full[r] + 1e-12 * max(1.0, full[r]) + _tail_slack(got, r, k), (name, beta, k, r)


def _tail_slack(got, r, k):
    """What the rounding of the tails can move the value by: each tail is a difference 1 - sum, known to
    about k ulps (delta) whatever its size, and the value's derivative w.r.t. a tail is at most
    2 + |log P_t| + |log Q_t| + Q_t / P_t + P_t / Q_t (the KLs'; the JSD's and the mixture's are below)."""
    pt, qt = got.student_tail[r].item(), got.teacher_tail[r].item()
    if pt == 0 or qt == 0:
        return 0.0
    delta = 32 * torch.finfo(torch.float64).eps  # a tail at its floor lies in [0, floor]; else known to a few ulps
    return delta * (2 + abs(math.log(pt)) + abs(math.log(qt)) + qt / pt + pt / qt)


def test_a_missing_tail_a_tail_from_the_wrong_model_and_a_sign_change_the_value():
    """The three plants the enumeration must catch, shown on one row: each wrong form differs."""
    z = torch.tensor([[1.0, 0.0, -1.0, 0.5]], dtype=torch.float64)
    lq_full = torch.tensor([[0.0, 1.0, -0.5, -2.0]], dtype=torch.float64).log_softmax(-1)
    ids = torch.tensor([[1, 0]])
    topk = lk.TopK(ids, lq_full.gather(-1, ids))
    p = z.log_softmax(-1).exp()[0].tolist()
    P, Q = _cells(p, [1, 0], lq_full.gather(-1, ids)[0].tolist())
    got = lk.full_kl(z, topk).item()
    assert got == pytest.approx(_kl(P, Q), rel=1e-12)
    assert abs(got - _kl(P[:-1], Q[:-1])) > 1e-3  # no tail cell
    assert abs(got - _kl(P[:-1] + [Q[-1]], Q)) > 1e-3  # the student's tail taken from the teacher
    assert abs(got - _kl(Q, P)) > 1e-3  # the other direction


def test_padding_is_neutral_and_masked_rows_are_zero_with_zero_gradient():
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(4, V, generator=gen, dtype=torch.float64, requires_grad=True)
    lq_full = torch.randn(4, V, generator=gen, dtype=torch.float64).log_softmax(-1)
    lq, ids = lq_full.topk(3, dim=-1)
    short = lk.full_kl(z, lk.TopK(ids, lq), divergence="jsd", beta=0.4)
    g_short = torch.autograd.grad(short.sum(), z)[0]
    # two more entries per row, -inf, with junk ids (out of range, duplicates): the same value and gradient
    padded = lk.TopK(torch.cat([ids, torch.full((4, 2), 10**6)], -1), torch.cat([lq, torch.full((4, 2), NINF, dtype=torch.float64)], -1))
    longer = lk.full_kl(z, padded, divergence="jsd", beta=0.4)
    assert_close(short, longer, rtol=1e-14, atol=0)  # (the sums' order differs: an ulp or two)
    assert_close(g_short, torch.autograd.grad(longer.sum(), z)[0], rtol=1e-13, atol=1e-16)
    # a masked row: 0 and exactly 0 gradient whatever its logits and payload hold (NaN, junk)
    z2 = z.detach().clone()
    z2[1] = float("nan")
    z2.requires_grad_()
    junk = lk.TopK(padded.ids.clone(), padded.logprobs.clone())
    junk.ids[1] = 5  # duplicates
    junk.logprobs[1] = 3.0  # above 0, mass above 1
    mask = torch.tensor([True, False, True, True])
    got = lk.full_kl(z2, junk, mask, divergence="jsd", beta=0.4)
    assert got[1] == 0
    assert_close(got[mask], short[mask].detach(), rtol=1e-14, atol=0)
    g = torch.autograd.grad(got.sum(), z2)[0]
    assert (g[1] == 0).all()
    assert_close(g[mask], g_short[mask], rtol=1e-13, atol=1e-16)


def test_a_row_whose_payload_is_all_padding_is_zero():
    z = torch.randn(2, V, dtype=torch.float64, requires_grad=True)
    topk = lk.TopK(torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), NINF, dtype=torch.float64))
    for name, beta in CASES:
        got = lk.full_kl(z, topk, divergence=name, beta=beta, return_tails=True)
        assert (got.value == 0).all() and (got.student_tail == 1).all() and (got.teacher_tail == 1).all()
        assert (torch.autograd.grad(got.value.sum(), z)[0] == 0).all()


# --- a sampler on the student's side --------------------------------------------------------------


def test_an_id_outside_the_students_kept_set_keeps_its_cell_with_mass_zero():
    """The definition, by enumeration: top_k=2 keeps ids {0, 1}; the teacher's ids 1, 3: the cells are
    (p_1, 0, p_0) against (q_1, q_3, rest). Reverse: finite; forward: +inf and its backward raises."""
    z = torch.tensor([[3.0, 2.0, 0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    lq = torch.tensor([[-1.0, -0.9]], dtype=torch.float64)
    topk = lk.TopK(torch.tensor([[1, 3]]), lq)
    s = lk.Sampling(top_k=2)
    p = torch.softmax(torch.tensor([3.0, 2.0], dtype=torch.float64), -1).tolist()
    P, Q = [p[1], 0.0, p[0]], [math.exp(-1.0), math.exp(-0.9), 1 - math.exp(-1.0) - math.exp(-0.9)]
    got = lk.full_kl(z, topk, sampling=s, return_tails=True)
    assert got.value.item() == pytest.approx(_kl(P, Q), rel=1e-12)
    assert got.student_tail.item() == pytest.approx(p[0], rel=1e-12)
    assert lk.full_kl(z, topk, sampling=s, divergence="jsd", beta=0.5).item() == pytest.approx(_div(P, Q, "jsd", 0.5), rel=1e-12)
    fwd = lk.full_kl(z, topk, sampling=s, divergence="forward")
    assert fwd.item() == math.inf
    with pytest.raises(ValueError, match=r"\+inf at position \(0,\).*cannot sample"):
        fwd.sum().backward()
    fwd.detach()  # without a gradient it is a value like any other
    with pytest.raises(ValueError, match=r"needs the teacher's whole row"):
        lk.full_kl(z, topk, sampling=s, reference="policy_kept")
    # without truncation the references are one: accepted
    lk.full_kl(z, topk, sampling=lk.Sampling(temperature=0.5), reference="processed")


def test_a_kept_set_inside_the_ids_gives_a_student_tail_at_its_floor():
    """top_k=2 keeps {0, 1}, both among the teacher's ids: the student's tail is 0, below what a 1 - sum
    resolves, against a teacher's tail of 0.73: it counts as its floor (32 ulps), reverse as the enumeration,
    forward large and finite."""
    z = torch.tensor([[3.0, 2.0, 0.0, -1.0]], dtype=torch.float64)
    topk = lk.TopK(torch.tensor([[0, 1, 2]]), torch.tensor([[-3.0, -4.0, -3.0]], dtype=torch.float64))
    got = lk.full_kl(z, topk, sampling=lk.Sampling(top_k=2), return_tails=True)
    floor = 32 * torch.finfo(torch.float64).eps
    assert got.student_tail.item() == pytest.approx(floor, rel=1e-12)
    p = torch.softmax(torch.tensor([3.0, 2.0], dtype=torch.float64), -1).tolist()
    q = [math.exp(-3.0), math.exp(-4.0), math.exp(-3.0)]
    assert got.value.item() == pytest.approx(_kl(p + [0.0, floor], q + [1 - sum(q)]), rel=1e-12)
    fwd = lk.full_kl(z, topk, sampling=lk.Sampling(top_k=2), divergence="forward")
    assert fwd.item() == pytest.approx(_kl(q + [1 - sum(q)], p + [0.0, floor]), rel=1e-12)  # inf: id 2 lies outside
    topk2 = lk.TopK(torch.tensor([[0, 1]]), torch.tensor([[-3.0, -4.0]], dtype=torch.float64))
    fwd2 = lk.full_kl(z, topk2, sampling=lk.Sampling(top_k=2), divergence="forward")
    q2 = [math.exp(-3.0), math.exp(-4.0)]
    assert fwd2.item() == pytest.approx(_kl(q2 + [1 - sum(q2)], p + [floor]), rel=1e-12)
    assert 20 < fwd2.item() < math.inf


# --- the payload's errors ---------------------------------------------------------------------------


def _payload(ids, lq):
    return lk.TopK(torch.tensor(ids), torch.tensor(lq, dtype=torch.float64))


def test_bad_payloads_are_refused_naming_the_position():
    z = torch.zeros(2, 3, 5, dtype=torch.float64)
    good_ids = [[[0, 1], [2, 3], [4, 0]], [[1, 2], [3, 4], [0, 1]]]
    good_lq = [[[-1.0, -2.0]] * 3] * 2

    def bad(pos, ids=None, lq=None):
        i = [[list(r) for r in row] for row in good_ids]
        q = [[list(r) for r in row] for row in good_lq]
        if ids is not None:
            i[pos[0]][pos[1]] = ids
        if lq is not None:
            q[pos[0]][pos[1]] = lq
        return _payload(i, q)

    lk.full_kl(z, _payload(good_ids, good_lq))
    with pytest.raises(ValueError, match=r"id 3 twice in the row at position \(1, 1\) \(entries \[0, 1\]\)"):
        lk.full_kl(z, bad((1, 1), ids=[3, 3]))
    with pytest.raises(ValueError, match=r"id 5 out of range at position \(0, 2, 1\).*V=5"):
        lk.full_kl(z, bad((0, 2), ids=[4, 5]))
    with pytest.raises(ValueError, match=r"id -1 out of range at position \(1, 0, 0\)"):
        lk.full_kl(z, bad((1, 0), ids=[-1, 2]))
    with pytest.raises(ValueError, match=r"log-prob 0.01 above 0 at position \(0, 1, 1\)"):
        lk.full_kl(z, bad((0, 1), lq=[-3.0, 0.01]))
    with pytest.raises(ValueError, match=r"log-prob inf above 0"):
        lk.full_kl(z, bad((0, 1), lq=[-3.0, math.inf]))
    with pytest.raises(ValueError, match=r"NaN at position \(1, 2, 0\)"):
        lk.full_kl(z, bad((1, 2), lq=[math.nan, -1.0]))
    with pytest.raises(ValueError, match=r"mass 1.0\d* above 1 at position \(0, 0\)"):
        lk.full_kl(z, bad((0, 0), lq=[math.log(0.6), math.log(0.41)]))
    # the edges: the tolerance itself is accepted (a log-prob of +tol, a mass of 1 + tol), beyond it refused
    tol = lk.TopK.tolerance
    ok = lk.full_kl(z, bad((0, 0), lq=[tol, -30.0]), return_tails=True)
    assert ok.teacher_tail[0, 0].item() == pytest.approx(32 * torch.finfo(torch.float64).eps, rel=1e-12)  # mass 1 + tol: no tail, counted at its floor
    lk.full_kl(z, bad((0, 0), lq=[math.log(0.5), math.log(0.5 + tol * 0.99)]))
    with pytest.raises(ValueError, match=r"above 0"):
        lk.full_kl(z, bad((0, 0), lq=[tol * 1.01, -30.0]))
    with pytest.raises(ValueError, match=r"above 1"):
        lk.full_kl(z, bad((0, 0), lq=[math.log(0.5), math.log(0.5 + tol * 1.02)]))


def test_bad_shapes_and_types_are_refused_at_construction_or_use():
    with pytest.raises(ValueError, match=r"one shape \[..., k\].*ids \(2, 3\) and logprobs \(2, 4\)"):
        lk.TopK(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"k >= 1"):
        lk.TopK(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0))
    with pytest.raises(TypeError, match=r"integer tensor"):
        lk.TopK(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(TypeError, match=r"floating point"):
        lk.TopK(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"two tensors"):
        lk.TopK([[0]], torch.zeros(1, 1))
    topk = lk.TopK(torch.zeros(2, 3, 2, dtype=torch.long), torch.full((2, 3, 2), -1.0))
    with pytest.raises(ValueError, match=r"expected ids \(2, 4, 2\)"):
        lk.full_kl(torch.zeros(2, 4, 7), topk)
    with pytest.raises(ValueError, match=r"`mask` must have the shape"):
        lk.full_kl(torch.zeros(2, 3, 7), topk, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"Unknown divergence 'kl'. Valid divergences: 'reverse', 'forward', 'jsd', 'mixed'"):
        lk.full_kl(torch.zeros(2, 3, 7), topk, divergence="kl")
    with pytest.raises(ValueError, match=r"`beta` must be a number in \[0, 1\]"):
        lk.full_kl(torch.zeros(2, 3, 7), topk, divergence="jsd", beta=1.5)
    with pytest.raises(AttributeError):
        topk.ids = torch.zeros(1)  # frozen


def test_float32_served_logprobs_with_a_float32_student():
    """The usual payload: float32 log-probs of a float32 log-softmax, the student in float32: close to the
    float64 value, and the rounding of a full list (k = V) gives tails of exactly 0."""
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(6, 50, generator=gen)
    lq_full = torch.randn(6, 50, generator=gen).log_softmax(-1)
    for k in (8, 50):
        lq, ids = lq_full.topk(k, dim=-1)
        got = lk.full_kl(z, lk.TopK(ids, lq), divergence="forward", return_tails=True)
        want = lk.full_kl(z.double(), lk.TopK(ids, lq.double()), divergence="forward")
        assert got.value.dtype == torch.float32
        assert_close(got.value, want.float(), rtol=1e-4, atol=1e-6)
        if k == 50:
            assert (got.student_tail == 0).all() and (got.teacher_tail == 0).all()


# --- the engine's k ids per row -----------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["none", "T", "top_k", "top_p"])
@pytest.mark.parametrize("source", ["logits", "hidden", "tiled"])
def test_the_engine_gathers_k_ids_per_row_with_their_summed_gradient(monkeypatch, source, sampler):
    from lightning_kl.ground.sampler import process_scores

    if source == "tiled":
        monkeypatch.setattr(engine, "HIDDEN_CPU_TILE_ELEMENTS", 3 * 7)
    gen = torch.Generator().manual_seed(5)
    n, v, k = 7, 13, 5
    s = {"none": lk.Sampling(), "T": lk.Sampling(0.6), "top_k": lk.Sampling(0.8, top_k=6), "top_p": lk.Sampling(top_p=0.8)}[sampler]
    h = torch.randn(n, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    W = torch.randn(v, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    z = (2 * torch.randn(n, v, generator=gen, dtype=torch.float64)).requires_grad_()
    src, leaves, logits = (Tensors(z), (z,), z) if source == "logits" else (Tensors(h, W), (h, W), h @ W.T)
    ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)])
    ignored = torch.zeros(n, dtype=torch.bool)
    ignored[2] = True
    lp, log_kept, outside = token_logprobs_kernel(src, ids, ignored, s, WHOLE, 3)
    want = process_scores(logits / s.temperature, s).log_softmax(-1).gather(1, ids).masked_fill(ignored[:, None], 0)
    assert lp.shape == outside.shape == (n, k) and log_kept.shape == (n,)
    assert torch.equal(outside, want.isinf())
    assert_close(lp, want, rtol=1e-12, atol=1e-12)
    w = torch.randn(n, k, generator=gen, dtype=torch.float64).masked_fill(outside, 0)
    for a, e in zip(torch.autograd.grad((lp.masked_fill(outside, 0) * w).sum(), leaves),
                    torch.autograd.grad((want.masked_fill(outside, 0) * w).sum(), leaves)):
        assert_close(a, e, rtol=1e-10, atol=1e-12)
    # one id per row as [n, 1] is the [n] call's, bitwise
    one, _, _ = token_logprobs_kernel(src, ids[:, :1], ignored, s, WHOLE, 3)
    single, _, _ = token_logprobs_kernel(src, ids[:, 0], ignored, s, WHOLE, 3)
    assert torch.equal(one[:, 0], single)


def test_the_device_form_of_the_checks_names_the_rule_without_a_host_read(monkeypatch):
    """Off the CPU nothing is read on the host: a bad payload and a backward through +inf stop on a device
    assertion naming the rule (run here on the CPU with host reads refused)."""
    from lightning_kl.ground import checks

    monkeypatch.setattr(checks, "HOST_READ_DEVICES", frozenset())
    z = torch.zeros(1, 2, 5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"a row's ids must be distinct"):
        lk.full_kl(z, _payload([[[1, 1], [0, 2]]], [[[-1.0, -2.0], [-1.0, -2.0]]]))
    with pytest.raises(RuntimeError, match=r"sum to at most 1"):
        lk.full_kl(z, _payload([[[1, 3], [0, 2]]], [[[-0.1, -0.2], [-1.0, -2.0]]]))
    zt = torch.tensor([[3.0, 2.0, 0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    fwd = lk.full_kl(zt, _payload([[1, 3]], [[-1.0, -0.9]]), sampling=lk.Sampling(top_k=2), divergence="forward")
    with pytest.raises(RuntimeError, match=r"cannot sample"):
        fwd.sum().backward()


def test_a_bfloat16_head_gives_the_float32_value_of_its_logits():
    """From a bf16 head (FromHidden) the maths runs in float32 (the engine's) and float64 (the cells): the
    value is that of the head's bf16 logits in float64 to float32 rounding."""
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(2, 3, 8, generator=gen).bfloat16().requires_grad_()
    W = torch.randn(40, 8, generator=gen).bfloat16().requires_grad_()
    lq, ids = torch.randn(2, 3, 40, generator=gen).log_softmax(-1).topk(5, dim=-1)
    got = lk.full_kl(lk.FromHidden(h, W), lk.TopK(ids, lq), divergence="jsd", beta=0.5)
    assert got.dtype == torch.float32
    want = lk.full_kl((h @ W.T).double(), lk.TopK(ids, lq.double()), divergence="jsd", beta=0.5)
    assert_close(got, want.float(), rtol=1e-4, atol=1e-6)
    got.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and torch.isfinite(h.grad.float()).all() and torch.isfinite(W.grad.float()).all()
