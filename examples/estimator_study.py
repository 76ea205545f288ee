r"""The estimator study: which KL estimator, in the reward or in the loss, on-policy or off-policy.

Run ``python examples/estimator_study.py``: it prints markdown tables and writes
``docs/estimator_study.png`` (under a minute on a laptop CPU). Every estimate goes through
:func:`lightning_kl.kl_penalty`; the targets are exact.

(a) **Bias and standard deviation of one sample**, reproducing John Schulman's note "Approximating KL
    Divergence" (2020): samples :math:`x \sim q = N(0, 1)`, reference :math:`p = N(\mu, 1)`, target
    :math:`\mathrm{KL}(q \| p) = \mu^2/2`. His :math:`r = p(x)/q(x)`; our log-ratio is
    :math:`d = \log q(x) - \log p(x) = -\log r` (``logprob = log q``, ``ref_logprob = log p``), so his
    :math:`k_1 = -\log r`, :math:`k_2 = (\log r)^2/2`, :math:`k_3 = (r - 1) - \log r` are our ``k1``,
    ``k2``, ``k3`` (the ``+`` names share their values). Three columns of evidence: his published
    numbers, a Monte-Carlo run, and exact moments by quadrature on a fine grid (plus the closed forms
    :math:`\log r \sim N(-\mu^2/2, \mu^2)` gives for k1, k2 and the unclamped k3).
(b) **Which estimators give the exact KL gradient**, by exact enumeration over a small categorical
    policy :math:`\pi = \mathrm{softmax}(\theta)`: the expected per-sample gradient (a sum over the
    vocabulary weighted by the sampler) against the exact :math:`\nabla_\theta \mathrm{KL}(\pi \| \pi_{ref})`,
    in loss form (backpropagate the estimate) and in reward form (REINFORCE with reward :math:`-k`,
    the estimate detached: gradient :math:`E[k \nabla \log\pi]`), on-policy and off-policy.
(c) **A figure**: relative bias and standard deviation against the true KL over a range of :math:`\mu`.
(d) **Whole responses** (``level="sequence"``), on a tabular autoregressive policy enumerated exactly
    (:class:`TabularAR`): the expected-gradient errors against the gradient of the responses' KL,
    token vs sequence level, on- and off-policy, per name; the noise of one response's gradient at
    each level; and RL toward the known optimum :math:`\pi^* \propto \pi_{ref} e^{r/\beta}` with a
    reward that only a whole response earns, where only the sequence level reaches :math:`\pi^*`
    (``docs/sequence_study.png``).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

import lightning_kl as lk
from lightning_kl.estimators import BASE_ESTIMATORS

NAMES = ("k1", "k2", "k3", "abs", "low_var_kl")
# Schulman's published table: (bias / true KL, std / true KL) of one sample
SCHULMAN = {
    0.1: {"k1": (0.0, 20.0), "k2": (0.002, 1.42), "k3": (0.0, 1.42)},
    1.0: {"k1": (0.0, 2.0), "k2": (0.25, 1.73), "k3": (0.0, 1.7)},
}
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


# ---------------------------------------------------------------------------------------------
# (a) Gaussians


def gaussian_estimates(x: Tensor, mu: float | Tensor, name: str) -> Tensor:
    """The per-sample estimate of ``name`` at samples ``x`` of q = N(0, 1) against p = N(mu, 1).

    ``x`` ``[n]`` and a float ``mu`` give ``[n]``; a ``[m, 1]`` tensor of ``mu`` gives ``[m, n]``.
    """
    logq = -0.5 * x.square() - LOG_SQRT_2PI  # the policy (it sampled x)
    logp = -0.5 * (x - mu).square() - LOG_SQRT_2PI  # the reference
    logq, logp = torch.broadcast_tensors(logq, logp)
    return lk.kl_penalty(logq, logp, name)


class Quadrature:
    """Exact moments under q = N(0, 1): a Riemann sum on a fine grid, with exponentially small error.

    The library's estimates are bounded (k3 saturates at e^20), so the Gaussian tails past +-14 weigh
    nothing.
    """

    def __init__(self, half_width: float = 14.0, points: int = 50_001) -> None:
        self.x = torch.linspace(-half_width, half_width, points, dtype=torch.float64)
        h = 2 * half_width / (points - 1)
        self.w = torch.exp(-0.5 * self.x.square() - LOG_SQRT_2PI) * h

    def means(self, values: Tensor) -> Tensor:
        """E_q over the last dimension (the grid)."""
        return (self.w * values).sum(-1)

    def stds(self, values: Tensor) -> Tensor:
        m = self.means(values)
        return self.means((values - m.unsqueeze(-1)).square()).clamp(min=0).sqrt()

    def mean(self, values: Tensor) -> float:
        return float(self.means(values))

    def std(self, values: Tensor) -> float:
        return float(self.stds(values))


def closed_form(name: str, mu: float) -> tuple[Optional[float], Optional[float]]:
    """(bias / KL, std / KL) of the unclamped k1, k2, k3, from log r ~ N(-mu^2/2, mu^2)."""
    kl = mu * mu / 2
    if name == "k1":
        return 0.0, mu / kl
    if name == "k2":  # E = (mu^2 + mu^4/4) / 2, Var(L^2) = 2 s^4 + 4 m^2 s^2
        return mu * mu / 4, math.sqrt(2 + mu * mu)
    if name == "k3":  # Var(r - L) = (e^{mu^2} - 1) + mu^2 - 2 Cov(r, L), Cov(r, L) = mu^2
        return 0.0, math.sqrt(math.expm1(mu * mu) - mu * mu) / kl
    return None, None


def fmt(v: Optional[float], digits: int = 3) -> str:
    if v is None:
        return "—"
    if v == 0 or 1e-3 <= abs(v) < 1e4:
        return f"{v:.{digits}g}"
    return f"{v:.2e}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def study_gaussian(samples: int, seed: int, quad: Quadrature) -> str:
    g = torch.Generator().manual_seed(seed)
    out = []
    for mu, published in SCHULMAN.items():
        kl = mu * mu / 2
        x = torch.randn(samples, generator=g, dtype=torch.float64)
        rows = []
        for name in NAMES:
            k = gaussian_estimates(x, mu, name)
            mc_bias, mc_std = (float(k.mean()) - kl) / kl, float(k.std()) / kl
            se = mc_std / math.sqrt(samples)  # one standard error of the Monte-Carlo bias
            kq = gaussian_estimates(quad.x, mu, name)
            ex_bias, ex_std = (quad.mean(kq) - kl) / kl, quad.std(kq) / kl
            cf_bias, cf_std = closed_form(name, mu)
            pub = published.get(name, (None, None))
            rows.append(
                [
                    f"`{name}`",
                    fmt(pub[0]),
                    fmt(pub[1]),
                    f"{mc_bias:+.4f} ± {se:.4f}",
                    fmt(mc_std),
                    f"{ex_bias:+.5f}",
                    fmt(ex_std, 4),
                    fmt(cf_bias, 4) if cf_bias is not None else "—",
                    fmt(cf_std, 4),
                ]
            )
        out.append(
            f"**q = N(0,1), p = N({mu:g},1): true KL = {kl:g}** (Monte Carlo: {samples:,} samples, seed {seed})\n\n"
            + table(
                [
                    "estimator",
                    "Schulman bias/true",
                    "Schulman std/true",
                    "MC bias/true",
                    "MC std/true",
                    "exact bias/true",
                    "exact std/true",
                    "closed-form bias/true",
                    "closed-form std/true",
                ],
                rows,
            )
        )
    return "\n\n".join(out)


def study_clamps(quad: Quadrature, mus: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0)) -> str:
    """Where the clamps bite: low_var_kl's value clamp at 10, and k3's overflow clamp |d| <= 20."""
    rows = []
    for mu in mus:
        kl = mu * mu / 2
        k3 = gaussian_estimates(quad.x, mu, "k3")
        lv = gaussian_estimates(quad.x, mu, "low_var_kl")
        d = -0.5 * quad.x.square() + 0.5 * (quad.x - mu).square()
        p_lv = quad.mean((k3 > lk.estimators.LOW_VAR_KL_CLAMP).double())
        p_k3 = quad.mean((d.abs() > lk.estimators.K3_CLAMP).double())
        _, k3_std_math = closed_form("k3", mu)
        k3_bias = (quad.mean(k3) - kl) / kl
        rows.append(
            [
                f"{kl:g}",
                "0" if abs(k3_bias) < 1e-12 else f"{k3_bias:+.2e}",  # below 1e-12: rounding
                fmt(quad.std(k3) / kl),
                fmt(k3_std_math),
                f"{p_k3:.1e}",
                f"{(quad.mean(lv) - kl) / kl:+.4f}",
                fmt(quad.std(lv) / kl),
                f"{p_lv:.1e}",
            ]
        )
    return (
        "**Where the clamps bite** (exact moments; same Gaussians, larger mu)\n\n"
        + table(
            [
                "true KL",
                "`k3` bias/true",
                "`k3` std/true",
                "k3 std/true, no clamp (closed form)",
                "P(d outside ±20)",
                "`low_var_kl` bias/true",
                "`low_var_kl` std/true",
                "P(k3 > 10)",
            ],
            rows,
        )
    )


# ---------------------------------------------------------------------------------------------
# (b) exact gradients on a categorical policy


class Categorical:
    """pi = softmax(theta) over ``vocab`` tokens, a fixed reference and a fixed older sampler."""

    def __init__(self, vocab: int = 6, seed: int = 0, drift: float = 1.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.theta = torch.randn(vocab, generator=g, dtype=torch.float64).requires_grad_()
        self.ref = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64), 0)
        noise = torch.randn(vocab, generator=g, dtype=torch.float64)
        self.old = torch.log_softmax(self.theta.detach() + drift * noise, 0)

    def logprob(self) -> Tensor:
        return torch.log_softmax(self.theta, 0)

    def exact(self) -> tuple[float, Tensor]:
        lp = self.logprob()
        kl = (lp.exp() * (lp - self.ref)).sum()
        (grad,) = torch.autograd.grad(kl, self.theta)
        return kl.item(), grad

    def expect(self, per_sample: Callable[[Tensor], Tensor], off_policy: bool) -> tuple[float, Tensor]:
        """E[value], E[gradient] of a per-sample surrogate over the sampler (pi_old or pi)."""
        lp = self.logprob()
        sampler = self.old.exp() if off_policy else lp.detach().exp()
        total = (sampler * per_sample(lp)).sum()
        (grad,) = torch.autograd.grad(total, self.theta)
        return total.item(), grad


def study_gradients(pol: Categorical, max_weight: float) -> str:
    kl, grad_kl = pol.exact()
    lp = pol.logprob().detach()
    w = (lp - pol.old).exp()
    drift = float((lp.exp() * (lp - pol.old)).sum())

    def err(grad: Tensor) -> str:
        e = float((grad - grad_kl).norm() / grad_kl.norm())
        return "**exact**" if e < 1e-9 else f"{e:.2f}"

    def vbias(value: float) -> str:
        e = (value - kl) / kl
        return "**exact**" if abs(e) < 1e-9 else f"{e:+.2f}"

    ref, old = pol.ref, pol.old
    # each mode: (column title, per-sample surrogate given logprob, sampled off-policy?)
    modes = {
        "loss, on-policy": (lambda n: lambda lp: lk.kl_penalty(lp, ref, n), False),
        "loss, on-policy, `old_logprob=logprob.detach()`": (
            lambda n: lambda lp: lk.kl_penalty(lp, ref, n, old_logprob=lp.detach()),
            False,
        ),
        "loss, off-policy, `old_logprob`": (lambda n: lambda lp: lk.kl_penalty(lp, ref, n, old_logprob=old), True),
        f"loss, off-policy, `old_logprob`, `max_weight={max_weight:g}`": (
            lambda n: lambda lp: lk.kl_penalty(lp, ref, n, old_logprob=old, max_weight=max_weight),
            True,
        ),
        "loss, off-policy, no weights": (lambda n: lambda lp: lk.kl_penalty(lp, ref, n), True),
        # REINFORCE on reward -k: surrogate ratio * k.detach(), ratio = pi / pi_sampler (1 on-policy,
        # with gradient grad log pi): gradient E_pi[k grad log pi]
        "reward, on-policy": (
            lambda n: lambda lp: (lp - lp.detach()).exp() * lk.kl_penalty(lp, ref, n).detach(),
            False,
        ),
        "reward, off-policy (PPO ratio, k of the current policy)": (
            lambda n: lambda lp: (lp - old).exp() * lk.kl_penalty(lp, ref, n).detach(),
            True,
        ),
        "reward, off-policy (PPO ratio, k stored at rollout)": (
            lambda n: lambda lp: (lp - old).exp() * lk.kl_penalty(old, ref, n).detach(),
            True,
        ),
    }
    names = [n for n in BASE_ESTIMATORS] + [f"{n}+" for n in BASE_ESTIMATORS]
    grad_rows, value_rows = [], []
    for name in names:
        g_row, v_row = [f"`{name}`"], [f"`{name}`"]
        for title, (make, off) in modes.items():
            value, grad = pol.expect(make(name), off)
            g_row.append(err(grad))
            if title.startswith("loss"):
                v_row.append(vbias(value))
        grad_rows.append(g_row)
        value_rows.append(v_row)
    loss_titles = [t for t in modes if t.startswith("loss")]
    return (
        f"**Categorical policy** (vocab {pol.theta.numel()}, KL(pi || pi_ref) = {kl:.4f}; "
        f"KL(pi || pi_old) = {drift:.3f}, a deliberately large drift; pi / pi_old from {w.min():.2f} to "
        f"{w.max():.2f}, {int((w > max_weight).sum())} tokens above {max_weight:g}). "
        "Relative error of the expected gradient, "
        "||E[g] - grad KL|| / ||grad KL||, by exact enumeration:\n\n"
        + table(["estimator", *modes], grad_rows)
        + "\n\nRelative bias of the expected value (loss form), (E[k] - KL) / KL:\n\n"
        + table(["estimator", *loss_titles], value_rows)
    )


def study_truncation(pol: Categorical, caps: tuple[float, ...] = (1.0, 1.25, 1.5, 2.0, 3.0)) -> str:
    """What ``max_weight`` costs: bias of the expected value and gradient, off-policy, against the cap.

    Two extra columns show the design the library rejected: a plain ``clamp`` of a differentiable
    weight (zero gradient where it clips), written here by hand.
    """
    kl, grad_kl = pol.exact()
    names = ("k1", "k3", "k2", "k3+")
    pi, s = pol.logprob().exp().detach(), pol.old.exp()

    def cell(value: float, grad: Tensor) -> str:
        return f"{(value - kl) / kl:+.3f} / {float((grad - grad_kl).norm() / grad_kl.norm()):.3f}"

    def plain_clamp(name: str, c: float) -> Callable[[Tensor], Tensor]:
        def per_sample(lp: Tensor) -> Tensor:
            w = (lp - pol.old).clamp(max=math.log(c)).exp()
            return w * lk.kl_penalty(lp, pol.ref, name)

        return per_sample

    def library(name: str, c: Optional[float]) -> Callable[[Tensor], Tensor]:
        return lambda lp: lk.kl_penalty(lp, pol.ref, name, old_logprob=pol.old, max_weight=c)

    rows = []
    for c in (*caps, None):
        kept = pi if c is None else torch.minimum(pi, c * s)
        row = ["none" if c is None else f"{c:g}", f"{float(kept.sum()):.3f}"]
        for name in names:
            row.append(cell(*pol.expect(library(name, c), True)))
        for name in ("k1", "k3"):
            row.append("—" if c is None else cell(*pol.expect(plain_clamp(name, c), True)))
        rows.append(row)
    return (
        "**What truncation costs** (same policy, off-policy, `old_logprob` and `max_weight`; each cell: "
        "value bias (E[k] - KL) / KL / gradient error ||E[g] - grad KL|| / ||grad KL||; "
        "mass kept = sum_x min(pi, c pi_old))\n\n"
        + table(
            [
                "max_weight",
                "mass kept",
                *[f"`{n}`" for n in names],
                *[f"`{n}`, plain clamp (rejected)" for n in ("k1", "k3")],
            ],
            rows,
        )
    )


# ---------------------------------------------------------------------------------------------
# (d) whole responses: the sequence level


class TabularAR:
    """A tabular autoregressive policy over whole responses, enumerated exactly.

    Vocabulary ``vocab``; token 0 ends a response, which otherwise stops at ``length`` tokens. Every
    prefix has its own free logits (``theta[prefix]``), the reference and the sampler ``mu`` too.
    Each of the responses is one row of a right-padded batch.
    """

    def __init__(self, vocab: int = 3, length: int = 4, seed: int = 0, drift: float = 1.0) -> None:
        ys: list[tuple[int, ...]] = []

        def grow(prefix: tuple[int, ...]) -> None:
            for tok in range(vocab):
                y = prefix + (tok,)
                (ys.append if tok == 0 or len(y) == length else grow)(y)

        grow(())
        self.ys = ys
        prefixes = sorted({y[:t] for y in ys for t in range(len(y))}, key=lambda p: (len(p), p))
        row = {p: i for i, p in enumerate(prefixes)}
        g = torch.Generator().manual_seed(seed)
        shape = (len(prefixes), vocab)
        self.theta = torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_()
        self.ref_logits = torch.randn(shape, generator=g, dtype=torch.float64)
        self.mu_logits = self.theta.detach() + drift * torch.randn(shape, generator=g, dtype=torch.float64)
        idx = [(i, t, row[y[:t]], tok) for i, y in enumerate(ys) for t, tok in enumerate(y)]
        self.seq, self.pos, self.rows, self.toks = (torch.tensor(c) for c in zip(*idx))
        self.mask = torch.zeros(len(ys), length, dtype=torch.bool)
        self.mask[self.seq, self.pos] = True

    def table(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token log-probs ``[n, length]`` (0 on padding) and per-response ``log p(y)`` ``[n]``."""
        flat = torch.log_softmax(logits, -1)[self.rows, self.toks]
        full = torch.zeros(self.mask.shape, dtype=flat.dtype).index_put((self.seq, self.pos), flat)
        return full, full.sum(-1)

    def logprobs(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        lp, log_pi = self.table(self.theta)
        ref, log_ref = self.table(self.ref_logits)
        old, log_mu = self.table(self.mu_logits)
        return lp, ref, old, log_pi, log_ref, log_mu

    def logits(self) -> tuple[Tensor, Tensor]:
        """Both models' logits ``[n, length, vocab]`` at every valid position (0 on padding)."""
        shape = (*self.mask.shape, self.theta.shape[1])

        def place(table: Tensor) -> Tensor:
            return torch.zeros(shape, dtype=table.dtype).index_put((self.seq, self.pos), table[self.rows])

        return place(self.theta), place(self.ref_logits)

    def exact(self) -> tuple[float, Tensor]:
        """KL(pi || pi_ref) over responses and its gradient."""
        _, _, _, log_pi, log_ref, _ = self.logprobs()
        kl = (log_pi.exp() * (log_pi - log_ref)).sum()
        (grad,) = torch.autograd.grad(kl, self.theta)
        return kl.item(), grad


def _per_sample(pol: TabularAR, name: str, level: str, mode: str, max_weight: Optional[float] = None,
                kl_to_go: str = "k1"):
    """The sampler's probabilities ``[n]`` and each response's ``sum_t out_t`` ``[n]`` (differentiable)."""
    lp, ref, old, log_pi, _, log_mu = pol.logprobs()
    sampler = (log_mu if mode == "off" else log_pi).detach().exp()
    if name == "full":  # on-policy only: the exact per-position KL from logits
        logits, ref_logits = pol.logits()
        sampled = lp if level == "sequence" else None
        out = lk.kl_penalty(logits, ref_logits, name, mask=pol.mask, level=level, sampled_logprob=sampled)
        return sampler, out.sum(-1)
    old_logprob = {"on": None, "on-detach": lp.detach(), "off": old}[mode]
    extra = {"kl_to_go": kl_to_go} if level == "sequence" else {}
    out = lk.kl_penalty(lp, ref, name, mask=pol.mask, old_logprob=old_logprob, level=level, max_weight=max_weight,
                        **extra)
    return sampler, out.sum(-1)


def study_sequence_gradients(pol: TabularAR, max_weight: float) -> str:
    """(d1) expected-gradient errors against grad KL(responses), token vs sequence level, per name."""
    kl, grad_kl = pol.exact()
    _, _, _, log_pi, _, log_mu = pol.logprobs()
    log_pi = log_pi.detach()
    drift = float((log_pi.exp() * (log_pi - log_mu)).sum())
    rho_max = float((log_pi - log_mu).exp().max())

    def err(grad: Tensor) -> str:
        e = float((grad - grad_kl).norm() / grad_kl.norm())
        return "**exact**" if e < 1e-9 else f"{e:.2f}"

    columns = [
        ("on", None, "on-policy"),
        ("on-detach", None, "on-policy, `old_logprob=logprob.detach()`"),
        ("off", None, "off-policy, `old_logprob`"),
        ("off", max_weight, f"off-policy, `max_weight={max_weight:g}`"),
    ]
    names = [*BASE_ESTIMATORS, *[f"{n}+" for n in BASE_ESTIMATORS], "full"]
    rows, value_rows = [], []
    for name in names:
        row, vrow = [f"`{name}`"], [f"`{name}`"]
        for mode, cap, _ in columns:
            if name == "full" and mode != "on":  # no importance weights for the exact KL
                row += ["—", "—"]
                vrow += ["—"] if cap is None and mode == "off" else []
                continue
            for level in ("token", "sequence"):
                sampler, per = _per_sample(pol, name, level, mode, cap)
                total = (sampler * per).sum()
                (grad,) = torch.autograd.grad(total, pol.theta)
                row.append(err(grad))
                if level == "sequence" and cap is None and mode != "on-detach":
                    e = (total.item() - kl) / kl
                    vrow.append("**exact**" if abs(e) < 1e-9 else f"{e:+.2f}")
        rows.append(row)
        value_rows.append(vrow)
    header = ["estimator"] + [f"{title}: {lvl}" for _, _, title in columns for lvl in ("token", "sequence")]
    return (
        f"**Whole responses** (tabular autoregressive policy: vocabulary {pol.theta.shape[1]}, token 0 ends a "
        f"response, at most {pol.mask.shape[1]} tokens, {len(pol.ys)} responses, free logits per prefix; "
        f"KL(pi || pi_ref) = {kl:.4f} nats per response; sampler: KL(pi || mu) = {drift:.3f}, "
        f"rho(y) = pi(y) / mu(y) up to {rho_max:.1f}). Relative error of the expected gradient of the summed "
        "per-token output against the exact gradient of the responses' KL, by enumeration:\n\n"
        + table(header, rows)
        + "\n\nRelative bias of the expected value at the sequence level, sum_t rho_{1:t} k_t "
        "(the token level's values on-policy):\n\n"
        + table(["estimator", "on-policy", "off-policy, `old_logprob`"], value_rows)
    )


def study_sequence_std(pol: TabularAR, names: tuple[str, ...] = ("k3+", "k3+ k3", "k2", "k3", "full")) -> str:
    """(d3) the standard deviation of one response's gradient at each level (the price of exactness).

    ``"k3+ k3"``: ``k3+`` with ``kl_to_go="k3"`` (a control variate for the KL-to-go; the token level
    is the same as ``k3+``'s).
    """
    _, grad_kl = pol.exact()
    rows = []
    for label in names:
        name, kl_to_go = (label.split() + ["k1"])[:2]
        row = [f"`{name}`" + (f", `kl_to_go=\"{kl_to_go}\"`" if kl_to_go != "k1" else "")]
        for mode in ("on", "off"):
            if (mode == "on" and name == "k3") or (mode == "off" and name == "full"):
                row += ["—", "—"]
                continue
            for level in ("token", "sequence"):
                sampler, per = _per_sample(pol, name, level, mode, kl_to_go=kl_to_go)
                grads = torch.stack(
                    [torch.autograd.grad(per[i], pol.theta, retain_graph=True)[0].flatten() for i in range(len(per))]
                )
                mean = (sampler[:, None] * grads).sum(0)
                var = (sampler * (grads - mean).square().sum(-1)).sum()
                row.append(f"{float(var.sqrt() / grad_kl.norm()):.2f}")
        rows.append(row)
    return (
        "**Noise of one response's gradient**: sqrt(E||g - E g||^2) / ||grad KL||, exact over the responses "
        "(`k3` needs `old_logprob` to be exact, `full` takes no weights; `full` at the sequence level: the exact "
        "local term and the exact KL of the later positions as the KL-to-go):\n\n"
        + table(["estimator", "on-policy: token", "on-policy: sequence", "off-policy: token", "off-policy: sequence"], rows)
    )


def study_kl_to_go_noise(seed: int, shrinks: tuple[float, ...] = (1.0, 0.3, 0.1)) -> str:
    """(d3') the KL-to-go's estimator against the noise, as the reference comes closer to the policy.

    The reference's logits are moved toward the policy's, ``ref <- theta + shrink * (ref - theta)``;
    on-policy, ``k3+`` at the sequence level with ``kl_to_go="k1"`` and ``"k3"``, and ``full``.
    """
    rows = []
    for shrink in shrinks:
        pol = TabularAR(seed=seed)
        with torch.no_grad():
            pol.ref_logits.copy_(pol.theta + shrink * (pol.ref_logits - pol.theta))
        kl, grad_kl = pol.exact()
        row = [f"{kl:.4f}"]
        for name, kl_to_go in (("k3+", "k1"), ("k3+", "k3"), ("full", "k1")):
            sampler, per = _per_sample(pol, name, "sequence", "on", kl_to_go=kl_to_go)
            grads = torch.stack(
                [torch.autograd.grad(per[i], pol.theta, retain_graph=True)[0].flatten() for i in range(len(per))]
            )
            mean = (sampler[:, None] * grads).sum(0)
            err = float((mean - grad_kl.flatten()).norm() / grad_kl.norm())
            var = (sampler * (grads - mean).square().sum(-1)).sum()
            std = f"{float(var.sqrt() / grad_kl.norm()):.2f}"
            row.append(std if err < 1e-9 else f"{std} (biased: {err:.2g})")
        rows.append(row)
    return (
        "**The KL-to-go's noise** (on-policy, sequence level; the reference's logits moved toward the policy's "
        "to lower the KL; every expected gradient exact): sqrt(E||g - E g||^2) / ||grad KL|| of one response\n\n"
        + table(["KL(pi || pi_ref) per response", "`k3+` (`kl_to_go=\"k1\"`)", "`k3+`, `kl_to_go=\"k3\"`",
                 "`full` (exact KL-to-go)"], rows)
    )


def sequence_rl(pol: TabularAR, beta: float, steps: int, lr: float, batch: int, seed: int,
                name: str = "k3+") -> tuple[str, dict[str, list[float]]]:
    """(d2) RL toward pi* = pi_ref exp(r / beta) / Z with a reward that only a whole response earns.

    Loss per step: REINFORCE on the reward (a batch-mean baseline) plus ``beta`` times the KL
    estimate, aggregated ``seq-mean-token-sum`` at each level. ``exact``: the expected gradient
    (enumeration, no sampling noise); ``sampled``: ``batch`` responses drawn from pi each step.
    Both optimizers are Adam with the same learning rate. Reports KL(pi || pi*) over responses.
    """
    reward = torch.tensor([float(len(y) == pol.mask.shape[1] and y[-1] == 1 and y[0] == 2) for y in pol.ys],
                          dtype=torch.float64)
    _, _, _, _, log_ref, _ = pol.logprobs()
    log_star = torch.log_softmax(log_ref + reward / beta, 0)
    theta0 = pol.theta.detach().clone()

    def kl_star() -> float:
        with torch.no_grad():
            _, _, _, log_pi, _, _ = pol.logprobs()
            return float((log_pi.exp() * (log_pi - log_star)).sum())

    curves: dict[str, list[float]] = {}
    finals = {}
    for how in ("exact", "sampled"):
        for level in ("token", "sequence"):
            with torch.no_grad():
                pol.theta.copy_(theta0)
            opt = torch.optim.Adam([pol.theta], lr=lr)
            loss_fn = lk.KLPenaltyLoss(name, coef=beta, agg="seq-mean-token-sum", level=level)
            g = torch.Generator().manual_seed(seed)
            curve = [kl_star()]
            for _ in range(steps):
                lp, ref, _, log_pi, _, _ = pol.logprobs()
                p = log_pi.detach().exp()
                if how == "exact":
                    # E_pi[-r log pi(y)] + beta E_pi[sum_t out_t], the expectation written as weights
                    pg = -(p * reward * log_pi).sum()
                    kl_term = beta * (p * lk.kl_penalty(lp, ref, name, mask=pol.mask, level=level).sum(-1)).sum()
                else:
                    i = torch.multinomial(p, batch, replacement=True, generator=g)
                    r = reward[i]
                    pg = -((r - r.mean()) * log_pi[i]).mean()
                    kl_term = loss_fn(lp[i], ref[i], pol.mask[i])
                opt.zero_grad()
                (pg + kl_term).backward()
                opt.step()
                curve.append(kl_star())
            curves[f"{how}, {level} level"] = curve
            finals[(how, level)] = (curve[-1], sum(curve[-(steps // 4):]) / (steps // 4))
    with torch.no_grad():
        pol.theta.copy_(theta0)
    log_pi0 = pol.logprobs()[3].detach()
    start = float((log_pi0.exp() * (log_pi0 - log_star)).sum())
    p_star = float(log_star.exp()[reward > 0].sum())
    rows = [[how, level, f"{finals[(how, level)][0]:.2e}", f"{finals[(how, level)][1]:.2e}"]
            for how in ("exact", "sampled") for level in ("token", "sequence")]
    text = (
        f"**RL toward the known optimum** pi* = pi_ref exp(r / beta) / Z (beta = {beta:g}; r(y) = 1 for the "
        f"responses of full length that start with 2 and end with 1, else 0; pi*(r = 1) = {p_star:.3f}); "
        f"`{name}` in the loss (`seq-mean-token-sum`) plus REINFORCE on r, Adam lr {lr:g}, {steps} steps; "
        f"`exact`: the expected gradient by enumeration; `sampled`: {batch} responses from pi per step. "
        f"KL(pi || pi*) over responses: {start:.3f} at the start; then:\n\n"
        + table(["gradient", "level", "KL(pi || pi*), last step", "mean over the last quarter"], rows)
    )
    return text, curves


def sequence_figure(curves: dict[str, list[float]], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
    styles = {"token": "C3", "sequence": "C0"}
    for label, curve in curves.items():
        level = "sequence" if "sequence" in label else "token"
        ax.plot(curve, "-" if label.startswith("exact") else ":", color=styles[level], label=label)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("KL(pi || pi*) over responses")
    ax.set_title("k3+ in the loss: only the sequence level reaches pi* = pi_ref exp(r/beta) / Z")
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    try:
        shown = path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        shown = path
    return f"Figure written to `{shown}`."


# ---------------------------------------------------------------------------------------------
# (c) the figure


def figure(quad: Quadrature, path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mu_t = torch.logspace(math.log10(0.05), math.log10(5.0), 60, dtype=torch.float64)
    mus = mu_t.tolist()
    kls = [mu * mu / 2 for mu in mus]
    kl_t = mu_t.square() / 2
    fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    styles = {"k1": "C0", "k2": "C1", "k3": "C2", "abs": "C4", "low_var_kl": "C3"}
    for name in NAMES:
        k = gaussian_estimates(quad.x, mu_t[:, None], name)  # [mus, grid] in one call
        bias = ((quad.means(k) - kl_t) / kl_t).tolist()
        std = (quad.stds(k) / kl_t).tolist()
        ls = "--" if name == "low_var_kl" else "-"
        ax_b.plot(kls, bias, ls, color=styles[name], label=name)
        ax_s.plot(kls, std, ls, color=styles[name], label=name)
    ax_s.plot(kls, [closed_form("k3", mu)[1] for mu in mus], ":", color="C2", label="k3, no overflow clamp")
    for mu in SCHULMAN:
        for ax in (ax_b, ax_s):
            ax.axvline(mu * mu / 2, color="0.8", lw=0.8, zorder=0)
    ax_b.set_xscale("log")
    ax_b.set_yscale("symlog", linthresh=1e-4)
    ax_b.set_xlabel("true KL(q || p) = mu^2 / 2")
    ax_b.set_ylabel("bias / true KL")
    ax_b.set_title("relative bias of one sample ('+' names: same values)")
    ax_b.legend(fontsize=8)
    ax_s.set_xscale("log")
    ax_s.set_yscale("log")
    ax_s.set_xlabel("true KL(q || p) = mu^2 / 2")
    ax_s.set_ylabel("std / true KL")
    ax_s.set_title("relative standard deviation of one sample")
    ax_s.legend(fontsize=8)
    fig.suptitle("x ~ q = N(0,1), p = N(mu,1); exact moments of lightning_kl.kl_penalty (grey: Schulman's two levels)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    try:
        shown = path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        shown = path
    return f"Figure written to `{shown}`."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000, help="Monte-Carlo samples per KL level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-weight", type=float, default=1.5, help="the truncation cap shown in (b)")
    parser.add_argument(
        "--figure", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "estimator_study.png"
    )
    parser.add_argument(
        "--sequence-figure", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "sequence_study.png"
    )
    parser.add_argument("--rl-steps", type=int, default=300, help="optimizer steps of the tabular RL in (d)")
    args = parser.parse_args()
    start = time.perf_counter()
    quad = Quadrature()
    print("## (a) Bias and standard deviation of one sample (Schulman's table)\n")
    print(study_gaussian(args.samples, args.seed, quad), end="\n\n")
    print(study_clamps(quad), end="\n\n")
    print("## (b) Which estimators give the exact KL gradient\n")
    pol = Categorical(seed=args.seed)
    print(study_gradients(pol, args.max_weight), end="\n\n")
    print(study_truncation(pol), end="\n\n")
    print("## (c) Figure\n")
    print(figure(quad, args.figure))
    print("\n## (d) Whole responses: token level and sequence level\n")
    # thousands of tiny steps: a second intra-op thread only adds waiting (10x slower on a busy 2-core machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    seq_pol = TabularAR(seed=args.seed)
    print(study_sequence_gradients(seq_pol, args.max_weight), end="\n\n")
    print(study_sequence_std(seq_pol), end="\n\n")
    print(study_kl_to_go_noise(args.seed), end="\n\n")
    text, curves = sequence_rl(seq_pol, beta=0.5, steps=args.rl_steps, lr=0.05, batch=64, seed=args.seed)
    print(text, end="\n\n")
    print(sequence_figure(curves, args.sequence_figure))
    torch.set_num_threads(threads)
    print(f"\n(ran in {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
