"""``level="sequence"``: the KL of whole responses, proven by exact enumeration.

A tabular autoregressive policy over a vocabulary of ``V = 3`` tokens, responses of at most ``T = 4``
tokens: token 0 ends a response (it is its last valid token), so responses have 1 to 4 tokens and
their lengths vary through the mask. Every prefix without an end token has its own free float64
logits (``theta[prefix]``: 15 prefixes x 3 logits), the reference and the sampler ``mu`` their own
fixed ones. Every one of the 31 responses is one row of a batch, so for a sampling distribution ``s``

    E_s[value]    = sum_y s(y) sum_t out_t(y)
    E_s[gradient] = grad_theta of sum_y s(y).detach() sum_t out_t(y)

and the targets are exact: ``KL = sum_y pi(y) log(pi(y) / pi_ref(y))`` and its gradient by autograd.
Nothing is sampled. Rows are laid out right-padded, left-padded or with holes, with junk (NaN, inf,
-1e10) at every masked position.
"""

from __future__ import annotations

import itertools
import math
import sys
from typing import NamedTuple, Optional

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from torch.testing import assert_close
from torch.utils.data import DataLoader

import lightning_kl as lk
from lightning_kl.sequence import LEVELS
from lightning_kl.estimators import SAMPLED_ESTIMATORS, parse_estimator
from _trainers import QUIET

V, T, EOS = 3, 4, 0
SAMPLED = list(SAMPLED_ESTIMATORS)
PLUS = [n for n in SAMPLED if n.endswith("+")]
TOKEN_EXACT = ["k2", "mse", *PLUS]  # exact gradient on-policy, no weights
WEIGHTED_EXACT = ["k1", "kl", "k3", *TOKEN_EXACT]  # exact gradient with old_logprob (differentiable weight for k1, k3)
UNBIASED_VALUE = ["k1", "kl", "k3", "k1+", "kl+", "k3+"]
JUNK = {"lp": float("nan"), "ref": float("-inf"), "old": -1e10}


def responses(eos: Optional[int] = EOS, length: int = T) -> list[tuple[int, ...]]:
    """Every response: it stops after ``eos`` or at ``length`` tokens (all of length ``length`` if eos is None)."""
    out = []

    def grow(prefix):
        for tok in range(V):
            y = prefix + (tok,)
            if tok == eos or len(y) == length:
                out.append(y)
            else:
                grow(y)

    grow(())
    return out


class Batch(NamedTuple):
    lp: torch.Tensor  # [N, L] log pi of the sampled tokens (junk where masked), differentiable
    ref: torch.Tensor  # [N, L]
    old: torch.Tensor  # [N, L] log mu
    mask: torch.Tensor  # [N, L]
    log_pi: torch.Tensor  # [N] log pi(y), differentiable
    log_ref: torch.Tensor  # [N]
    log_mu: torch.Tensor  # [N]


class Tabular:
    """The policy ``pi = softmax(theta[prefix])``, the reference and the sampler, over a set of responses."""

    def __init__(self, ys: list[tuple[int, ...]], seed: int = 0, sampler_noise: float = 1.0):
        self.ys = ys
        prefixes = sorted({y[:t] for y in ys for t in range(len(y))}, key=lambda p: (len(p), p))
        self.row = {p: i for i, p in enumerate(prefixes)}
        g = torch.Generator().manual_seed(seed)
        shape = (len(prefixes), V)
        self.theta = torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_()
        self.ref_logits = torch.randn(shape, generator=g, dtype=torch.float64)
        self.mu_logits = self.theta.detach() + sampler_noise * torch.randn(shape, generator=g, dtype=torch.float64)
        self._index: dict[str, tuple[torch.Tensor, ...]] = {}

    def batch(self, layout: str = "right") -> Batch:
        n, width = len(self.ys), T + 3
        if layout not in self._index:
            self._index[layout] = self._layout(layout, width)
        seq_t, pos_t, rows_t, toks_t = self._index[layout]

        def table(logits, junk):
            flat = torch.log_softmax(logits, -1)[rows_t, toks_t]
            full = torch.full((n, width), junk, dtype=torch.float64).index_put((seq_t, pos_t), flat)
            per_seq = torch.zeros(n, dtype=torch.float64).index_add(0, seq_t, flat)
            return full, per_seq

        lp, log_pi = table(self.theta, JUNK["lp"])
        ref, log_ref = table(self.ref_logits, JUNK["ref"])
        old, log_mu = table(self.mu_logits, JUNK["old"])
        mask = torch.zeros(n, width, dtype=torch.bool).index_put((seq_t, pos_t), torch.tensor(True))
        return Batch(lp, ref, old, mask, log_pi, log_ref, log_mu)

    def logits(self, layout: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
        """Both models' logits ``[N, L, V]`` at every valid position (NaN elsewhere), the policy's differentiable."""
        b = self.batch(layout)  # builds the index
        seq_t, pos_t, rows_t, _ = self._index[layout]
        shape = (*b.mask.shape, V)

        def place(table):
            return torch.full(shape, float("nan"), dtype=torch.float64).index_put((seq_t, pos_t), table[rows_t])

        return place(self.theta), place(self.ref_logits)

    def _layout(self, layout: str, width: int) -> tuple[torch.Tensor, ...]:
        """(response, position, prefix row, token) of every valid token."""
        seq, pos, rows, toks = [], [], [], []
        for i, y in enumerate(self.ys):
            if layout == "right":
                where = list(range(len(y)))
            elif layout == "left":
                where = list(range(width - len(y), width))
            elif layout == "holes":  # a masked slot before every valid token but the first
                where = [2 * t for t in range(len(y))]
            else:
                raise AssertionError(layout)
            for t, (p, tok) in enumerate(zip(where, y)):
                seq.append(i), pos.append(p), rows.append(self.row[y[:t]]), toks.append(tok)
        return tuple(torch.tensor(x) for x in (seq, pos, rows, toks))

    def exact_kl(self) -> tuple[float, torch.Tensor]:
        b = self.batch()
        kl = (b.log_pi.exp() * (b.log_pi - b.log_ref)).sum()
        (grad,) = torch.autograd.grad(kl, self.theta)
        return kl.item(), grad


def expectation(pol: Tabular, name: str, mode: str, level: str = "sequence", layout: str = "right", **kw):
    """E[sum_t out_t] and its gradient, for ``mode`` in on (no weights), on-detach, off (mu, weighted)."""
    b = pol.batch(layout)
    old = {"on": None, "on-detach": b.lp.detach(), "off": b.old}[mode]
    sampler = (b.log_mu if mode == "off" else b.log_pi).detach().exp()
    out = lk.kl_penalty(b.lp, b.ref, name, mask=b.mask, old_logprob=old, level=level, **kw)
    assert torch.isfinite(out).all() and (out[~b.mask] == 0).all()
    value = (sampler * out.sum(-1)).sum()
    (grad,) = torch.autograd.grad(value, pol.theta)
    return value.item(), grad


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def pol() -> Tabular:
    p = Tabular(responses())
    assert len(p.ys) == 31 and {len(y) for y in p.ys} == {1, 2, 3, 4}
    return p


# ---------------------------------------------------------------------------------------------
# the claims of lightning_kl.sequence


@pytest.mark.parametrize("kl_to_go", ["k1", "k3"])
@pytest.mark.parametrize("name", TOKEN_EXACT)
def test_on_policy_expected_gradient_is_the_sequence_kl_gradient(pol, name, kl_to_go):
    _, grad_kl = pol.exact_kl()
    _, grad = expectation(pol, name, "on", kl_to_go=kl_to_go)
    assert rel_err(grad, grad_kl) < 1e-9
    # the token level is the gradient of each token's KL given its prefix: another vector
    _, grad_token = expectation(pol, name, "on", level="token")
    assert rel_err(grad_token, grad_kl) > 0.3


@pytest.mark.parametrize("name", ["k1", "kl", "k3"])
def test_value_estimators_are_exact_with_detached_old_logprob(pol, name):
    _, grad_kl = pol.exact_kl()
    _, grad = expectation(pol, name, "on-detach")
    assert rel_err(grad, grad_kl) < 1e-9
    _, grad_plain = expectation(pol, name, "on")  # without the weight's score: biased, as at the token level
    assert rel_err(grad_plain, grad_kl) > 0.1


@pytest.mark.parametrize("kl_to_go", ["k1", "k3"])
@pytest.mark.parametrize("name", WEIGHTED_EXACT)
def test_off_policy_expected_gradient_is_the_sequence_kl_gradient(pol, name, kl_to_go):
    _, grad_kl = pol.exact_kl()
    _, grad = expectation(pol, name, "off", kl_to_go=kl_to_go)
    assert rel_err(grad, grad_kl) < 1e-9
    _, grad_token = expectation(pol, name, "off", level="token")
    assert rel_err(grad_token, grad_kl) > 0.3


@pytest.mark.parametrize("mode", ["on", "on-detach", "off"])
@pytest.mark.parametrize("name", UNBIASED_VALUE)
def test_expected_value_is_the_sequence_kl(pol, name, mode):
    kl, _ = pol.exact_kl()
    value, _ = expectation(pol, name, mode)
    assert value == pytest.approx(kl, rel=1e-12)


def test_the_sampler_is_far_and_the_levels_differ(pol):
    b = pol.batch()
    kl_mu = (b.log_mu.exp() * (b.log_mu - b.log_pi)).sum().item()
    assert kl_mu > 0.3  # KL(mu || pi) over responses: a sampler far from the policy
    _, grad_kl = pol.exact_kl()
    _, grad_token = expectation(pol, "k3+", "on", level="token")
    assert 0.3 < rel_err(grad_token, grad_kl) < 2.0  # 0.48 here


def one_response_gradients(pol: Tabular, mode: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's probabilities [N] and each response's gradient of sum_t out_t [N, P]."""
    b = pol.batch()
    old = b.old if mode == "off" else None
    out = lk.kl_penalty(b.lp, b.ref, "k3+", mask=b.mask, old_logprob=old, level="sequence", **kw).sum(-1)
    grads = [torch.autograd.grad(out[i], pol.theta, retain_graph=True)[0].flatten() for i in range(len(out))]
    return (b.log_mu if mode == "off" else b.log_pi).detach().exp(), torch.stack(grads)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_k3_kl_to_go_has_the_same_mean_and_less_noise(pol, mode):
    stds, means = [], []
    for kl_to_go in ("k1", "k3"):
        p, grads = one_response_gradients(pol, mode, kl_to_go=kl_to_go)
        mean = (p[:, None] * grads).sum(0)
        means.append(mean)
        stds.append((p * (grads - mean).square().sum(-1)).sum().sqrt().item())
    assert_close(means[1], means[0], rtol=1e-10, atol=1e-12)
    assert stds[1] < 0.95 * stds[0], stds  # 1.12 vs 1.22 on-policy here; the gain grows as the KL shrinks


def test_kl_to_go_errors():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"Unknown `kl_to_go` 'k2'\. Valid values: 'k1', 'k3'"):
        lk.KLPenaltyLoss("k3+", agg="token-sum", level="sequence", kl_to_go="k2")
    with pytest.raises(ValueError, match=r"`kl_to_go='k3'` does not apply here: level='token'"):
        lk.kl_penalty(lp, lp, "k3+", kl_to_go="k3")
    with pytest.raises(ValueError, match=r"`kl_to_go='k3'` does not apply here: 'full' uses the exact KL"):
        lk.KLPenaltyLoss("full", agg="token-sum", level="sequence", kl_to_go="k3")
    assert "kl_to_go='k3'" in repr(lk.KLPenaltyLoss("k3+", agg="token-sum", level="sequence", kl_to_go="k3"))


@pytest.mark.parametrize("name", SAMPLED)
def test_on_policy_values_are_the_token_levels(pol, name):
    b = pol.batch()
    seq = lk.kl_penalty(b.lp, b.ref, name, mask=b.mask, level="sequence")
    tok = lk.kl_penalty(b.lp, b.ref, name, mask=b.mask)
    assert torch.equal(seq.detach(), tok.detach())


def test_gradient_per_token_from_the_formula():
    # one response, d = (0.5, -1, [masked], 2): grad of sum(out) w.r.t. logprob_t = d_t + sum_{s > t} d_s (k2)
    lp = torch.tensor([[-1.0, -2.0, float("nan"), -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 7.0, -2.5]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True]])
    lk.kl_penalty(lp, ref, "k3+", mask=mask, level="sequence").sum().backward()
    assert_close(lp.grad, torch.tensor([[0.5 + 1.0, -1.0 + 2.0, 0.0, 2.0]], dtype=torch.float64), rtol=0, atol=1e-15)
    # off-policy, log w = (0.1, 0.2, -, -0.3): coefficient sum_{s >= t} rho_{1:s} d_s
    old = torch.tensor([[-1.1, -2.2, 0.0, -0.2]], dtype=torch.float64)
    lp.grad = None
    lk.kl_penalty(lp, ref, "k2", mask=mask, old_logprob=old, level="sequence").sum().backward()
    rho = torch.tensor([0.1, 0.3, 0.0], dtype=torch.float64).exp()
    dd = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64) * rho
    want = torch.tensor([[dd.sum(), dd[1:].sum(), 0.0, dd[2]]], dtype=torch.float64)
    assert_close(lp.grad, want, rtol=1e-14, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# truncation: every prefix mass pi(y<=s) becomes min(pi(y<=s), c mu(y<=s))


def truncated_target(pol: Tabular, c: float, local: str) -> tuple[float, torch.Tensor]:
    """Sum over prefixes y<=s (not over responses) of m_s * (k_s, g_s + d_s sum_{t<s} grad log pi_t).

    ``local`` is the local per-sample gradient coefficient: ``d`` (k2, '+', k3) or ``d+1`` (k1); the
    value is k3's.
    """
    total_value = torch.zeros((), dtype=torch.float64)
    surrogate = torch.zeros((), dtype=torch.float64)
    lsm = torch.log_softmax(pol.theta, -1)
    lsm_ref = torch.log_softmax(pol.ref_logits, -1)
    lsm_mu = torch.log_softmax(pol.mu_logits, -1)
    prefixes = {y[: s + 1] for y in pol.ys for s in range(len(y))}
    for pre in prefixes:
        lps = torch.stack([lsm[pol.row[pre[:t]], pre[t]] for t in range(len(pre))])
        refs = torch.stack([lsm_ref[pol.row[pre[:t]], pre[t]] for t in range(len(pre))])
        mus = torch.stack([lsm_mu[pol.row[pre[:t]], pre[t]] for t in range(len(pre))])
        m = torch.minimum(lps.sum().exp(), c * mus.sum().exp()).detach()
        d = (lps[-1] - refs[-1]).detach()
        total_value = total_value + m * (torch.exp(-d) + d - 1)
        coef_last = d + 1 if local == "d+1" else d
        surrogate = surrogate + m * (coef_last * lps[-1] + d * lps[:-1].sum())
    (grad,) = torch.autograd.grad(surrogate, pol.theta)
    return total_value.item(), grad


@pytest.mark.parametrize("name,local", [("k3+", "d"), ("k2", "d"), ("k3", "d"), ("k1", "d+1")])
def test_truncation_replaces_prefix_mass_by_its_cap(pol, name, local):
    c = 1.5
    b = pol.batch()
    rho = (b.log_pi - b.log_mu).exp()
    assert (rho > c).sum() >= 3  # the cap bites on several responses
    value, grad = expectation(pol, name, "off", max_weight=c)
    want_value, want_grad = truncated_target(pol, c, local)
    if name in ("k3+", "k3"):
        assert value == pytest.approx(want_value, rel=1e-12)
    assert rel_err(grad, want_grad) < 1e-9
    _, grad_kl = pol.exact_kl()
    assert rel_err(grad, grad_kl) > 1e-3  # and it is biased


def test_truncation_above_every_weight_changes_nothing(pol):
    b = pol.batch()
    seq_rho = (b.lp - b.old).where(b.mask, 0).cumsum(-1).exp().max().item()
    plain = expectation(pol, "k3+", "off")
    capped = expectation(pol, "k3+", "off", max_weight=seq_rho * 1.01)
    assert capped[0] == pytest.approx(plain[0], rel=1e-14)
    assert_close(capped[1], plain[1], rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# layouts, junk, aggregation modes, errors


@pytest.mark.parametrize("layout", ["left", "holes"])
@pytest.mark.parametrize("name,mode", [("k3+", "on"), ("k3", "off"), ("k2", "off")])
def test_padding_and_holes_change_nothing(pol, layout, name, mode):
    want_value, want_grad = expectation(pol, name, mode, layout="right", max_weight=3.0)
    value, grad = expectation(pol, name, mode, layout=layout, max_weight=3.0)
    assert value == pytest.approx(want_value, rel=1e-14)
    assert_close(grad, want_grad, rtol=1e-13, atol=1e-15)


def test_junk_at_masked_positions_never_reaches_values_or_gradients(pol):
    b = pol.batch("holes")
    outs = []
    for junk in (float("nan"), float("inf"), -1e10):
        lp = b.lp.detach().where(b.mask, junk).requires_grad_()
        ref, old = b.ref.where(b.mask, -junk), b.old.where(b.mask, junk)
        out = lk.kl_penalty(lp, ref, "k3", mask=b.mask, old_logprob=old, level="sequence", max_weight=2.0)
        (g,) = torch.autograd.grad(out.sum(), lp)
        assert torch.isfinite(g).all() and (g[~b.mask] == 0).all()
        outs.append((out.detach(), g))
    for out, g in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(g, outs[0][1])


def per_response_loss(pol: Tabular, name: str, agg: str, eos=EOS) -> torch.Tensor:
    """E over responses of KLPenaltyLoss on a batch of one response, on-policy: its gradient."""
    if eos is not EOS:
        pol = Tabular(responses(eos=eos, length=3), seed=1)
    b = pol.batch()
    loss_fn = lk.KLPenaltyLoss(name, coef=1.0, agg=agg, level="sequence")
    total = torch.zeros((), dtype=torch.float64)
    for i in range(len(pol.ys)):
        total = total + b.log_pi[i].detach().exp() * loss_fn(b.lp[i : i + 1], b.ref[i : i + 1], b.mask[i : i + 1])
    (grad,) = torch.autograd.grad(total, pol.theta)
    return pol, grad


@pytest.mark.parametrize("agg,scale", [("token-sum", 1.0), ("seq-mean-token-sum", 1.0),
                                       ("seq-mean-token-sum-norm", 1.0 / (T + 3))])
def test_sum_modes_are_exact(pol, agg, scale):
    _, grad_kl = pol.exact_kl()
    _, grad = per_response_loss(pol, "k3+", agg)
    assert rel_err(grad, scale * grad_kl) < 1e-9


def test_token_mean_is_exact_for_fixed_lengths_only(pol):
    fixed, grad = per_response_loss(pol, "k3+", "token-mean", eos=None)  # every response has 3 tokens
    _, grad_kl = fixed.exact_kl()
    assert rel_err(grad, grad_kl / 3) < 1e-9
    _, grad_kl = pol.exact_kl()
    _, grad = per_response_loss(pol, "k3+", "token-mean")  # lengths 1..4: divides by a random count
    cos = (grad.flatten() @ grad_kl.flatten()) / (grad.norm() * grad_kl.norm())
    assert cos < 1 - 1e-3


def test_bad_level_fails_with_the_valid_ones():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"Unknown KL level 'seq'\. Valid levels: 'token', 'sequence'"):
        lk.kl_penalty(lp, lp, "k3+", level="seq")
    with pytest.raises(ValueError, match=r"Unknown KL level 'Sequence'.*'token', 'sequence'"):
        lk.KLPenaltyLoss("k3+", level="Sequence")
    assert LEVELS == ("token", "sequence")
    with pytest.raises(ValueError, match=r"Unknown KL level None"):
        lk.KLPenaltyLoss("k3+", level=None)


def test_seq_mean_token_mean_is_rejected_at_construction():
    with pytest.raises(ValueError, match=r"'seq-mean-token-mean' does not fit level='sequence'.*length-normalized.*"
                                         r"'token-mean', 'token-sum', 'seq-mean-token-sum', 'seq-mean-token-sum-norm'"):
        lk.KLPenaltyLoss("k3+", agg="seq-mean-token-mean", level="sequence")
    lk.KLPenaltyLoss("k3+", agg="seq-mean-token-mean")  # the token level keeps every mode


# ---------------------------------------------------------------------------------------------
# full: the exact local term, and the exact KL of the later positions as the KL-to-go


@pytest.mark.parametrize("layout", ["right", "holes"])
def test_full_with_sampled_logprob_is_exact(pol, layout):
    kl, grad_kl = pol.exact_kl()

    def expect(sequence=False):
        b = pol.batch(layout)
        logits, ref_logits = pol.logits(layout)
        p = b.log_pi.detach().exp()
        kw = dict(level="sequence", sampled_logprob=b.lp) if sequence else {}
        out = lk.kl_penalty(logits, ref_logits, "full", mask=b.mask, **kw)
        assert torch.isfinite(out).all() and (out[~b.mask] == 0).all()
        value = (p * out.sum(-1)).sum()
        (grad,) = torch.autograd.grad(value, pol.theta)
        return value.item(), grad

    value, grad = expect(sequence=True)
    assert value == pytest.approx(kl, rel=1e-12)  # sum_t KL_t(y_<t) is an unbiased estimate of the KL
    assert rel_err(grad, grad_kl) < 1e-9
    value_token, grad_token = expect()
    assert value_token == pytest.approx(kl, rel=1e-12) and rel_err(grad_token, grad_kl) > 0.3


def test_full_sequence_through_the_loss_and_its_errors(pol):
    b = pol.batch()
    logits, ref_logits = pol.logits()
    loss_fn = lk.KLPenaltyLoss("full", coef=1.0, agg="token-sum", level="sequence")
    loss = loss_fn(logits, ref_logits, b.mask, sampled_logprob=b.lp)
    want = lk.kl_penalty(logits, ref_logits, "full", mask=b.mask, level="sequence", sampled_logprob=b.lp).sum()
    (g1,) = torch.autograd.grad(loss, pol.theta, retain_graph=True)
    (g2,) = torch.autograd.grad(want, pol.theta, retain_graph=True)
    assert_close(g1, g2)
    with pytest.raises(ValueError, match=r"'full' at level='sequence' needs `sampled_logprob`.*score"):
        loss_fn(logits, ref_logits, b.mask)
    with pytest.raises(ValueError, match=r"`sampled_logprob` must have the shape.*\(3, 31\) and logits \(31, 7, 3\)"):
        lk.kl_penalty(logits, ref_logits, "full", mask=b.mask, level="sequence", sampled_logprob=b.lp[:, :3].T)
    with pytest.raises(ValueError, match=r"`sampled_logprob` is for estimator='full' at level='sequence' only"):
        lk.kl_penalty(logits, ref_logits, "full", mask=b.mask, sampled_logprob=b.lp)
    with pytest.raises(ValueError, match=r"`sampled_logprob` is for estimator='full' at level='sequence' only"):
        lk.KLPenaltyLoss("k3+", agg="token-sum", level="sequence")(b.lp, b.ref, b.mask, sampled_logprob=b.lp)
    with pytest.raises(ValueError, match=r"old_logprob"):
        lk.kl_penalty(logits, ref_logits, "full", mask=b.mask, level="sequence", sampled_logprob=b.lp,
                      old_logprob=b.old)


def test_loss_is_coef_times_aggregate_of_the_functional():
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(4, 6, generator=g, dtype=torch.float64) - 6).requires_grad_()
    ref, old = torch.randn(4, 6, generator=g, dtype=torch.float64) - 6, torch.randn(4, 6, generator=g, dtype=torch.float64) - 6
    mask = torch.rand(4, 6, generator=g) > 0.3
    loss_fn = lk.KLPenaltyLoss("k3+", coef=0.5, agg="seq-mean-token-sum", level="sequence", max_weight=2.0)
    assert "level='sequence'" in repr(loss_fn)
    loss = loss_fn(lp, ref, mask, old_logprob=old)
    want = 0.5 * lk.aggregate(lk.kl_penalty(lp, ref, "k3+", mask=mask, old_logprob=old, level="sequence",
                                            max_weight=2.0), mask, "seq-mean-token-sum")
    (g1,) = torch.autograd.grad(loss, lp, retain_graph=True)
    (g2,) = torch.autograd.grad(want, lp)
    assert_close(loss, want)
    assert_close(g1, g2)
    # and both against float64 maths of the module's formulas, token by token: per-decision weights
    # rho_t = min(exp(sum_{u <= t} log w_u), 2) over valid tokens, value rho_t * k3(d_t), gradient
    # rho_t * d_t (k3+, detached weight) plus the KL-to-go sum_{s > t} rho_s d_s; seq-mean-token-sum
    want_loss, want_grad, rows = 0.0, torch.zeros(4, 6, dtype=torch.float64), 0
    for i in range(4):
        valid = [t for t in range(6) if mask[i, t]]
        rows += bool(valid)
        log_rho, rho, dd = 0.0, {}, {}
        for t in valid:
            log_rho += float(lp[i, t].detach() - old[i, t])
            rho[t], dd[t] = min(math.exp(log_rho), 2.0), float(lp[i, t].detach() - ref[i, t])
            want_loss += rho[t] * (math.exp(-dd[t]) + dd[t] - 1)
        for t in valid:
            want_grad[i, t] = rho[t] * dd[t] + sum(rho[s] * dd[s] for s in valid if s > t)
    assert loss.item() == pytest.approx(0.5 * want_loss / rows, rel=1e-12)
    assert_close(g1, 0.5 * want_grad / rows, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# the reward path: KLRewardCallback's k1 penalty with reward-to-go is the sequence level


def test_reward_to_go_with_the_callback_is_the_sequence_kl_gradient(pol):
    beta = 0.7
    b = pol.batch("holes")
    batch = {"scores": torch.zeros(len(pol.ys), dtype=torch.float64), "logprobs": b.lp.detach(),
             "ref_logprobs": b.ref, "mask": b.mask}
    callback = lk.KLRewardCallback("k1", controller=lk.FixedKLController(beta))
    rewards, _, _ = callback.shape_rewards(batch)
    r = rewards.where(b.mask, 0).to(torch.float64)
    to_go = r.flip(-1).cumsum(-1).flip(-1)  # sum_{s >= t} r_s
    weights = b.log_pi.detach().exp()[:, None]
    lp = b.lp.where(b.mask, 0)

    def expected_policy_gradient(advantage):
        (grad,) = torch.autograd.grad(-(weights * advantage * lp).sum(), pol.theta, retain_graph=True)
        return grad

    _, grad_kl = pol.exact_kl()
    # REINFORCE on rewards-to-go: E[-sum_t grad log pi_t sum_{s>=t} r_s] = beta grad KL(responses)
    assert rel_err(expected_policy_gradient(to_go), beta * grad_kl) < 1e-9
    # the whole return on every token is exact too (the past terms have expectation 0)
    assert rel_err(expected_policy_gradient(r.sum(-1, keepdim=True)), beta * grad_kl) < 1e-9
    # each token's own penalty only: the token level
    assert rel_err(expected_policy_gradient(r), beta * grad_kl) > 0.3


# ---------------------------------------------------------------------------------------------
# a real Lightning loop with level="sequence", every sampled name; the YAML path


class ARPolicy(torch.nn.Module):
    """A bigram policy: the next token's logits depend on the previous token (a start token V)."""

    def __init__(self, vocab: int = 4) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(vocab + 1, vocab))

    def logprob(self, tokens: torch.Tensor) -> torch.Tensor:
        prev = torch.cat([torch.full_like(tokens[:, :1], self.logits.shape[1]), tokens[:, :-1]], 1)
        return self.logits.log_softmax(-1)[prev].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def sample(self, n: int, length: int) -> torch.Tensor:
        prev = torch.full((n,), self.logits.shape[1])
        out = []
        for _ in range(length):
            prev = torch.distributions.Categorical(logits=self.logits[prev]).sample()
            out.append(prev)
        return torch.stack(out, 1)


class SequenceKLModule(pl.LightningModule):
    def __init__(self, estimator: str = "k3+", level: str = "sequence", agg: str = "seq-mean-token-sum",
                 kl_coef: float = 1.0, ppo_epochs: int = 2) -> None:
        super().__init__()
        self.policy, self.ref = ARPolicy(), ARPolicy().requires_grad_(False)
        with torch.no_grad():
            self.policy.logits.normal_(generator=torch.Generator().manual_seed(0))
        self.kl = lk.KLPenaltyLoss(estimator, coef=kl_coef, agg=agg, level=level)  # validated here
        self.ppo_epochs = ppo_epochs
        self.losses: list[float] = []

    def train_dataloader(self):
        return DataLoader(range(16), batch_size=4)

    def training_step(self, batch, batch_idx):
        tokens = self.policy.sample(8, 5)
        mask = torch.arange(5) < torch.randint(1, 6, (8, 1))  # variable lengths
        old = self.policy.logprob(tokens).detach()
        ref = self.ref.logprob(tokens).masked_fill(~mask, float("nan"))
        loss = 0.0
        for _ in range(self.ppo_epochs):  # the second pass weights by old_logprob (differentiable for k1, k3)
            loss = loss + self.kl(self.policy.logprob(tokens), ref, mask, old_logprob=old)
        self.log("train/kl", self.kl.metric)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("estimator", SAMPLED)
def test_every_estimator_trains_at_the_sequence_level(estimator, quiet_trainer):
    pl.seed_everything(0)
    model = SequenceKLModule(estimator)
    before = model.policy.logits.detach().clone()
    trainer = quiet_trainer(fast_dev_run=2)
    trainer.fit(model)
    assert len(model.losses) == 2 and all(math.isfinite(x) for x in model.losses)
    assert not torch.equal(before, model.policy.logits.detach())
    assert torch.isfinite(trainer.callback_metrics["train/kl"])


def _config(tmp_path, level):
    config = {"model": {"estimator": "k3+", "level": level},
              "trainer": {**QUIET, "fast_dev_run": 2, "default_root_dir": str(tmp_path)}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_yaml_level(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["x.py"])
    cli = LightningCLI(SequenceKLModule, args=["fit", "--config", str(_config(tmp_path, "sequence"))])
    assert cli.model.kl.level == "sequence" and len(cli.model.losses) == 2
    with pytest.raises(ValueError, match=r"Unknown KL level 'seqence'"):
        LightningCLI(SequenceKLModule, args=["fit", "--config", str(_config(tmp_path, "seqence"))])


@pytest.mark.parametrize("name", ["k3+", "k3", "k2"])
def test_fused_kernel_path_gives_the_compositions_result(name, monkeypatch):
    from lightning_kl.kernels import fused

    g = torch.Generator().manual_seed(0)
    shape = (3, 40_000)  # above one chunk: the fused kernel serves the token-level value
    lp0 = -3 * torch.rand(shape, generator=g) - 3
    ref, old = lp0 + 0.3 * torch.randn(shape, generator=g), lp0 + 0.2 * torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.2
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(fused, "ENABLED", enabled)
        assert fused.use_fused(parse_estimator(name), lp0) == enabled
        lp = lp0.clone().requires_grad_()
        out = lk.kl_penalty(lp, ref, name, mask=mask, old_logprob=old, level="sequence", max_weight=5.0)
        (grad,) = torch.autograd.grad(lk.aggregate(out, mask, "seq-mean-token-sum"), lp)
        results.append((out.detach(), grad))
    assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)  # float32: the kernels round differently


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_computed_in_float32(dtype):
    g = torch.Generator().manual_seed(1)
    lp32 = torch.randn(3, 9, generator=g) - 1
    ref32, old32 = lp32 + 0.3 * torch.randn(3, 9, generator=g), lp32 + 0.2 * torch.randn(3, 9, generator=g)
    lp32, ref32, old32 = (x - 3 for x in (lp32, ref32, old32))  # log-probs: every one <= 0
    mask = torch.rand(3, 9, generator=g) > 0.2
    lp16, ref16, old16 = (x.to(dtype) for x in (lp32, ref32, old32))
    results = []
    for lp, ref, old in ((lp16, ref16, old16), (lp16.float(), ref16.float(), old16.float())):
        lp = lp.clone().requires_grad_()
        loss = lk.KLPenaltyLoss("k3+", coef=1.0, agg="token-sum", level="sequence")(lp, ref, mask, old_logprob=old)
        (grad,) = torch.autograd.grad(loss, lp)
        results.append((loss, grad))
    (loss16, grad16), (loss32, grad32) = results
    assert loss16.dtype == torch.float32 and grad16.dtype == dtype
    assert_close(loss16, loss32)  # the same float32 maths on the same (rounded) inputs
    assert_close(grad16, grad32.to(dtype))


def test_k3_off_policy_keeps_its_precision_far_below_the_reference():
    # d = -18 at the first token: the product rule's two terms of size w e^18 cancel to w d in float32
    lp = torch.tensor([[-20.0, -1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -1.5, -1.0]])
    old = torch.tensor([[-20.5, -1.2, -2.1]])
    grads = {}
    for name in ("k3", "k3+"):
        lp.grad = None
        lk.kl_penalty(lp, ref, name, old_logprob=old, level="sequence").sum().backward()
        grads[name] = lp.grad.clone()
    # k3 with a differentiable weight and k3+ with a detached one: the same gradient, token by token
    assert_close(grads["k3"], grads["k3+"], rtol=1e-5, atol=0)
    assert grads["k3+"][0, 0] < -16  # rho_1 d_1 + the KL-to-go, with rho_1 = e^0.5


# ---------------------------------------------------------------------------------------------
# the KL-to-go keeps small tails exact: sums of the later values only, never (sum from t on) - v_t


def _tails64(values: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    v = values.double() if mask is None else torch.where(mask, values.double(), 0.0)
    return torch.stack([v[..., t + 1 :].sum(-1) for t in range(v.shape[-1])], -1)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).abs() / want.abs().clamp_min(1e-30)).max())


# large KLs early and between, tiny ones after: each tail far smaller than the token before it
_SPIKY = torch.tensor([[1.0, 1.9e-6, 2.0, 1.7e-6, 3e-7, 0.5, 2e-8, 1e-8, 5e-9], [3.0, 1e-7, 4e-8, 2.5, 1.5e-7, 1.2e-7, 0.25, 3e-8, 1e-9]])


def test_kl_to_go_tails_are_exact_in_float32():
    from lightning_kl.sequence import future_sum, weighted_kl_to_go

    v = _SPIKY.float()
    mask = torch.ones_like(v, dtype=torch.bool)
    mask[0, 4] = False  # a hole: it adds nothing
    want = _tails64(v, mask)
    assert _rel(future_sum(v, mask)[want > 0], want[want > 0]) < 1e-6
    assert torch.all(future_sum(v, mask)[:, -1] == 0)
    old = (torch.where(mask, v, 0).flip(-1).cumsum(-1).flip(-1) - torch.where(mask, v, 0))  # the old formula
    assert _rel(old[want > 0], want[want > 0]) > 1e-2  # it loses the tails' digits: this test can fail
    # the sampled estimators' KL-to-go: the tails of d = lp - ref (exact in float32 here: Sterbenz)
    ref = -torch.full_like(v, 4.0)
    lp = ref + v
    d = lp.double() - ref.double()
    assert _rel(weighted_kl_to_go(lp, ref, mask)[want > 0], _tails64(d, mask)[want > 0]) < 1e-6


def test_full_kl_to_go_keeps_the_digits_of_tiny_later_kls():
    """``full`` at the sequence level: the score term of token t is the sum of the later exact KLs. With a
    KL of order 1 at t and of order 1e-6 after it, that sum keeps its digits (the old difference gave a
    relative error of 5.5e-4 on these tails, 1e-2 on the tails of the first test)."""
    g = torch.Generator().manual_seed(0)
    b, t, V = 2, 9, 16
    z = torch.randn(b, t, V, generator=g) * 2
    profile = torch.tensor([[1.0, 2e-5, 2.0, 1.7e-5, 3e-5, 0.5, 2e-5, 1e-5, 5e-5], [3.0, 1e-5, 4e-5, 2.5, 1.5e-5, 1.2e-5, 0.25, 3e-5, 1e-5]])
    scale = profile.sqrt().unsqueeze(-1)  # KL ~ |perturbation|^2: from order 1 down to 1e-6
    zr = z + scale * torch.randn(b, t, V, generator=g) * 2
    lp = lk.token_logprobs(z, z.argmax(-1)).requires_grad_()
    mask = torch.ones(b, t, dtype=torch.bool)
    kl = lk.kl_penalty(z, zr, "full", mask=mask, level="sequence", sampled_logprob=lp)
    kl.sum().backward()
    want = _tails64(kl.detach(), mask)  # the tails of the float32 KLs themselves, summed in float64
    assert kl.detach().max() > 0.1 and 0 < kl.detach()[:, -2:].min() and kl.detach()[:, -2:].max() < 1e-4
    assert _rel(lp.grad[:, :-1], want[:, :-1]) < 1e-6
    old = kl.detach().flip(-1).cumsum(-1).flip(-1) - kl.detach()  # the old formula
    assert _rel(old[:, :-1], want[:, :-1]) > 1e-4  # 5.5e-4 measured: the test can fail
    assert torch.all(lp.grad[:, -1] == 0)
