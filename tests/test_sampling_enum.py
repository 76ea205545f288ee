"""The sampled estimators fed processed log-probs are exact for the processed policy, by enumeration.

A tabular autoregressive policy over ``V = 5`` tokens, responses of ``L = 3`` tokens: every prefix has
its own free float64 logits ``theta[prefix]``; the reference and the sampler their own fixed ones. The
sampler truncates (top-k, top-p, min-p, at a temperature), so the processed policy
``pi~(y) = prod_t p~(y_t | y_<t)`` puts mass on the responses whose every token is in its prefix's
kept set only: those are the rows of the batch, and for a sampling distribution ``s``

    E_s[value]    = sum_y s(y) sum_t out_t(y)
    E_s[gradient] = grad_theta of sum_y s(y).detach() sum_t out_t(y)

The log-probs come from ``lk.processed_logprobs`` (the library's kernel, whose gradient flows into
``theta``); the targets are written from the formula in float64 with a kept-set rule of their own:
``KL(pi~ || pi_ref) = sum_y pi~(y) log(pi~(y) / pi_ref(y))`` and its gradient by autograd, and at the
token level each prefix's KL with the prefix's mass held fixed. Nothing is sampled.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.estimators import SAMPLED_ESTIMATORS
from _vocab import processed, processed_kl

V, L = 5, 3
SAMPLED = list(SAMPLED_ESTIMATORS)
PLUS = [n for n in SAMPLED if n.endswith("+")]
TOKEN_EXACT = ["k2", "mse", *PLUS]
WEIGHTED_EXACT = ["k1", "kl", "k3", *TOKEN_EXACT]
UNBIASED_VALUE = ["k1", "kl", "k3", "k1+", "kl+", "k3+"]
PROCESSINGS = {
    "top_k": dict(temperature=1.3, top_k=2),
    "top_p": dict(temperature=1.2, top_p=0.8),
    "all": dict(temperature=0.9, top_k=4, top_p=0.9, min_p=0.1),
}


def kept_set(z: torch.Tensor, temperature: float, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """The kept set of each row of ``z [P, V]``, from the rule as documented (no ties in ``z``)."""
    z = z.detach() / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k is not None:  # the top_k highest scores
        keep &= z >= z.sort(-1, descending=True).values[:, top_k - 1 : top_k]
    if top_p is not None:  # the tokens with less than top_p of mass strictly above them
        p = torch.softmax(z.masked_fill(~keep, float("-inf")), -1)
        above = (p.unsqueeze(-2) * (p.unsqueeze(-2) > p.unsqueeze(-1))).sum(-1)
        keep &= above < top_p
    if min_p is not None:  # probability at least min_p times the largest
        p = torch.softmax(z.masked_fill(~keep, float("-inf")), -1)
        keep &= p >= min_p * p.amax(-1, keepdim=True)
    return keep


def log_processed(z: torch.Tensor, keep: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax((z / temperature).masked_fill(~keep, float("-inf")), -1)


class Setup(NamedTuple):
    theta: torch.Tensor  # [P, V] policy logits, requires grad
    ref_logits: torch.Tensor
    mu_logits: torch.Tensor  # the sampler (same processing, same kept sets, other probabilities)
    proc: dict
    keep: torch.Tensor  # [P, V] the policy's kept sets
    ys: list  # responses in the processed policy's support
    rows: torch.Tensor  # [N, L] prefix row of each position
    toks: torch.Tensor  # [N, L]
    prefixes: list


def make(proc: dict, seed: int = 0) -> Setup:
    prefixes = [p for n in range(L) for p in itertools.product(range(V), repeat=n)]
    row = {p: i for i, p in enumerate(prefixes)}
    g = torch.Generator().manual_seed(seed)
    theta = 1.5 * torch.randn(len(prefixes), V, generator=g, dtype=torch.float64)
    ref = 1.5 * torch.randn(len(prefixes), V, generator=g, dtype=torch.float64)
    keep = kept_set(theta, **proc)
    mu = theta.clone()
    for i in range(len(prefixes)):  # a sampler with the policy's kept sets and other probabilities
        for _ in range(1000):
            mu[i] = theta[i] + 0.5 * torch.randn(V, generator=g, dtype=torch.float64)
            if torch.equal(kept_set(mu[i : i + 1], **proc), keep[i : i + 1]):
                break
        else:
            raise AssertionError("no sampler with the policy's kept sets")
    ys = [y for y in itertools.product(range(V), repeat=L) if all(keep[row[y[:t]], y[t]] for t in range(L))]
    rows = torch.tensor([[row[y[:t]] for t in range(L)] for y in ys])
    return Setup(theta.requires_grad_(), ref, mu, proc, keep, ys, rows, torch.tensor(ys), prefixes)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny tensors: on shared cores each op's OpenMP barrier costs more than its work (47 s -> 4 s)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(PROCESSINGS))
def setup(request) -> Setup:
    s = make(PROCESSINGS[request.param])
    kept = s.keep.sum(-1)
    assert (kept < V).all() and len(s.ys) >= 8  # every prefix truncates, and sampling is random
    return s


def library_logprobs(s: Setup, reference: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lp`` (differentiable), ``ref`` and ``old`` ``[N, L]``; the reference at the temperature,
    unprocessed or renormalized on the policy's kept set."""
    lp = processed(s.theta[s.rows], s.toks, **s.proc).logprobs
    old = processed(s.mu_logits[s.rows], s.toks, **s.proc).logprobs
    if reference == "unprocessed":
        ref = lk.token_logprobs(s.ref_logits[s.rows], s.toks, sampling=lk.Sampling(s.proc["temperature"]))
    else:
        ref = processed(s.ref_logits[s.rows], s.toks, **s.proc, kept_from=s.theta[s.rows]).logprobs
    return lp, ref, old


def formula(s: Setup, reference: str = "unprocessed") -> dict[str, torch.Tensor]:
    T = s.proc["temperature"]
    log_pt = log_processed(s.theta, s.keep, T)  # differentiable
    log_ref = torch.log_softmax(s.ref_logits / T, -1)
    if reference == "policy_kept":
        log_ref = log_processed(s.ref_logits, s.keep, T)
    log_mu = log_processed(s.mu_logits, kept_set(s.mu_logits, **s.proc), T)
    pos = (s.rows, s.toks)
    log_pi_y = log_pt[pos].sum(-1)
    kl = (log_pi_y.exp() * (log_pi_y - log_ref[pos].sum(-1))).sum()
    # token level: each prefix's KL, weighted by the prefix's mass (fixed)
    p = log_pt.exp()
    kl_prefix = (p * (log_pt.where(s.keep, 0) - log_ref.where(s.keep, 0))).sum(-1)  # 0 log 0 = 0, no NaN gradient
    mass = torch.stack([log_pt[[s.prefixes.index(pre[:t]) for t in range(len(pre))], list(pre)].sum() for pre in s.prefixes]).exp()
    kl_token = (mass.detach() * kl_prefix).sum()
    return {
        "kl": kl,
        "kl_token": kl_token,
        "pi": log_pi_y.exp().detach(),
        "mu": log_mu[pos].sum(-1).exp(),
        "kl_prefix": kl_prefix,
        "mass": mass.detach(),
        "ref_mass_off_kept": (1 - log_ref.exp().where(s.keep, 0).sum(-1)),
    }


def expectation(s: Setup, name: str, mode: str, level: str, reference: str = "unprocessed", logprobs=None) -> tuple[float, torch.Tensor]:
    lp, ref, old = library_logprobs(s, reference) if logprobs is None else logprobs
    f = formula(s, reference)
    out = lk.kl_penalty(lp, ref, name, old_logprob={"on": None, "off": old}[mode], level=level)
    value = (f["mu" if mode == "off" else "pi"] * out.sum(-1)).sum()
    (grad,) = torch.autograd.grad(value, s.theta)
    return value.item(), grad


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_the_library_log_probs_are_the_formula_and_the_distributions_sum_to_one(setup):
    f = formula(setup)
    lp, _, _ = library_logprobs(setup, "unprocessed")
    want = log_processed(setup.theta, setup.keep, setup.proc["temperature"])[setup.rows, setup.toks]
    assert_close(lp, want, rtol=0, atol=1e-13)
    _, ref, _ = library_logprobs(setup, "policy_kept")
    want = log_processed(setup.ref_logits, setup.keep, setup.proc["temperature"])[setup.rows, setup.toks]
    assert_close(ref, want, rtol=0, atol=1e-13)
    assert f["pi"].sum().item() == pytest.approx(1, abs=1e-12)
    assert f["mu"].sum().item() == pytest.approx(1, abs=1e-12)
    assert len(setup.ys) < V**L  # the truncation removes responses


# off-policy at the token level, each token is weighted alone (prefix masses under the sampler), as
# without processing: the sequence level carries the prefix weights
@pytest.mark.parametrize("mode,level", [("on", "token"), ("on", "sequence"), ("off", "sequence")])
@pytest.mark.parametrize("name", UNBIASED_VALUE)
def test_expected_value_is_the_kl_against_the_reference_on_the_kept_set(setup, name, mode, level):
    value, _ = expectation(setup, name, mode, level, "policy_kept")
    assert value == pytest.approx(formula(setup, "policy_kept")["kl"].item(), rel=1e-11)


@pytest.mark.parametrize("mode,level", [("on", "token"), ("on", "sequence"), ("off", "sequence")])
@pytest.mark.parametrize("name", UNBIASED_VALUE)
def test_against_the_unprocessed_reference_k1_is_unbiased_and_k3_misses_the_mass_off_the_kept_set(setup, name, mode, level):
    # E[exp(-d)] = sum over the kept set of the reference's probabilities = 1 - (its mass off the set):
    # k3's value is KL - E_prefix[mass off the kept set], k1's is the KL
    f = formula(setup, "unprocessed")
    value, _ = expectation(setup, name, mode, level, "unprocessed")
    want = f["kl"].item()
    if name.startswith("k3"):
        want -= (f["mass"] * f["ref_mass_off_kept"]).sum().item()
        assert abs(want - f["kl"].item()) > 0.05 * f["kl"].item()
    assert value == pytest.approx(want, rel=1e-11)


@pytest.mark.parametrize("reference", ["unprocessed", "policy_kept"])
@pytest.mark.parametrize("name", TOKEN_EXACT)
def test_on_policy_sequence_gradient_is_the_processed_kl_gradient(setup, name, reference):
    (grad_kl,) = torch.autograd.grad(formula(setup, reference)["kl"], setup.theta)
    _, grad = expectation(setup, name, "on", "sequence", reference)
    assert rel_err(grad, grad_kl) < 1e-9
    # the token level is another vector: the gradient of each prefix's KL, prefix mass fixed
    (grad_token,) = torch.autograd.grad(formula(setup, reference)["kl_token"], setup.theta)
    _, grad_t = expectation(setup, name, "on", "token", reference)
    assert rel_err(grad_t, grad_token) < 1e-9
    assert rel_err(grad_token, grad_kl) > 0.1


@pytest.mark.parametrize("reference", ["unprocessed", "policy_kept"])
@pytest.mark.parametrize("name", WEIGHTED_EXACT)
def test_off_policy_sequence_gradient_is_the_processed_kl_gradient(setup, name, reference):
    (grad_kl,) = torch.autograd.grad(formula(setup, reference)["kl"], setup.theta)
    _, grad = expectation(setup, name, "off", "sequence", reference)
    assert rel_err(grad, grad_kl) < 1e-9


def test_full_vocabulary_log_probs_of_processed_samples_are_biased(setup):
    # the same samples scored with log softmax(z / T): the weights are off by the kept mass

    def scored(old_full: bool = False):
        lp, ref, old = library_logprobs(setup, "unprocessed")
        full = lk.token_logprobs(setup.theta[setup.rows], setup.toks, sampling=lk.Sampling(setup.proc["temperature"]))
        return (lp, ref, full.detach()) if old_full else (full, ref, old)

    kl = formula(setup)["kl"]
    (grad_kl,) = torch.autograd.grad(kl, setup.theta)
    value, _ = expectation(setup, "k1", "on", "sequence", logprobs=scored())
    assert abs(value - kl.item()) > 0.02 * kl.item()
    _, grad = expectation(setup, "k3+", "on", "sequence", logprobs=scored())
    assert rel_err(grad, grad_kl) > 0.05
    _, grad = expectation(setup, "k2", "off", "sequence", logprobs=scored(old_full=True))  # a full-softmax old_logprob
    assert rel_err(grad, grad_kl) > 0.05


@pytest.mark.parametrize("reference", ["unprocessed", "policy_kept"])
def test_exact_processed_kl_is_each_prefix_kl(setup, reference):
    # lk.processed_full_kl at every prefix, against the formula (value and gradient)
    T = setup.proc["temperature"]
    got = processed_kl(setup.theta, setup.ref_logits, **setup.proc, reference=reference, chunk_size=7)
    log_pt = log_processed(setup.theta, setup.keep, T)
    log_q = torch.log_softmax(setup.ref_logits / T, -1)
    if reference == "policy_kept":
        log_q = log_processed(setup.ref_logits, setup.keep, T)
    want = (log_pt.exp() * (log_pt.where(setup.keep, 0) - log_q.where(setup.keep, 0))).sum(-1)
    if reference == "unprocessed":
        assert_close(want, formula(setup)["kl_prefix"], rtol=0, atol=1e-14)
    assert_close(got, want, rtol=1e-12, atol=1e-14)
    w = formula(setup)["mass"]
    (g_got,) = torch.autograd.grad((w * got).sum(), setup.theta)
    (g_want,) = torch.autograd.grad((w * want).sum(), setup.theta)
    assert_close(g_got, g_want, rtol=1e-10, atol=1e-13)
