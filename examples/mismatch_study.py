r"""The rollout/trainer mismatch, by exact enumeration: how far the uncorrected policy gradient is from
the true one, and how much each correction of ``lk.RolloutCorrection`` removes.

Run ``python examples/mismatch_study.py``: it prints a markdown table and writes
``docs/mismatch_study.png`` (a few seconds on a laptop CPU).

The problem is the tabular autoregressive policy of ``examples/estimator_study.py``
(:class:`TabularAR`: vocabulary 4, responses of at most 5 tokens, 364 of them, each prefix with its
own logits), with a fixed random reward per response. The trainer's policy is
:math:`\pi = \mathrm{softmax}(\theta)`; the rollout engine samples from
:math:`\mu = \mathrm{softmax}(\theta + \varepsilon z)` (a fixed direction :math:`z`, at mismatch sizes
:math:`\varepsilon`: numerics at the small end, a stale policy copy at the large one). The objective
is :math:`J = E_\pi[r]`; with the advantage :math:`A = r - E_\mu[r]` the true gradient is
:math:`\nabla J = \sum_y \pi(y) A(y) \nabla\log\pi(y)`. A correction with detached weights
:math:`w_{y,t}` trains, in expectation over responses :math:`y \sim \mu`, on

.. math::
    g = \sum_y \mu(y)\, A(y) \sum_t w_{y,t} \nabla\log\pi(y_t \mid y_{<t}),

computed exactly (a sum over all 364 responses, the weights from ``lk.RolloutCorrection``). The table
gives the relative bias :math:`\|g - \nabla J\| / \|\nabla J\|` and the relative standard deviation of
one response's gradient, :math:`\sqrt{E_\mu\|g_y - g\|^2} / \|\nabla J\|`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

import lightning_kl as lk

sys.path.insert(0, str(Path(__file__).resolve().parent))
from estimator_study import TabularAR  # noqa: E402

EPSILONS = (0.03, 0.1, 0.3, 1.0)
FLOOR = 1e-4  # the figure draws a bias below this (rounding: 1e-16) at this value
CORRECTIONS: dict[str, Optional[dict]] = {
    "none": None,
    "token TIS (c = 2)": dict(weights="token", upper=2.0),
    "token IcePop [0.5, 5]": dict(weights="token", mode="mask", lower=0.5, upper=5.0),
    "token IS (no cap)": dict(weights="token", upper=None),
    "sequence TIS (c = 2)": dict(weights="sequence", upper=2.0),
    "sequence MIS [0.5, 2]": dict(weights="sequence", mode="mask", lower=0.5, upper=2.0),
    "sequence IS (no cap)": dict(weights="sequence", upper=None),
}


def problem(eps: float, seed: int = 0) -> tuple[TabularAR, Tensor]:
    """The tabular policy with engine drift ``eps`` (the same direction for every ``eps``) and a reward."""
    pol = TabularAR(vocab=4, length=5, seed=seed, drift=eps)
    reward = torch.rand(len(pol.ys), generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return pol, reward


def gradients(pol: TabularAR, reward: Tensor, correction: Optional[dict]) -> dict[str, float]:
    lp, _, old, log_pi, _, log_mu = pol.logprobs()
    mu = log_mu.exp()
    adv = reward - (mu * reward).sum()
    (true,) = torch.autograd.grad((log_pi.exp() * adv).sum(), pol.theta, retain_graph=True)
    if correction is None:
        w = pol.mask.to(lp.dtype)
    else:
        w = lk.RolloutCorrection(**correction)(lp, old, pol.mask).weights
    per_response = adv * (w * lp).sum(-1)  # [n]: the surrogate of one response, detached weights
    n = per_response.shape[0]
    (g_all,) = torch.autograd.grad(per_response, pol.theta, torch.eye(n, dtype=lp.dtype), is_grads_batched=True)
    g_all = g_all.reshape(n, -1)
    g = (mu[:, None] * g_all).sum(0)
    spread = (mu * (g_all - g).square().sum(-1)).sum().sqrt()
    norm = true.norm()
    metrics = lk.mismatch_metrics(lp.detach(), old, pol.mask)
    return {
        "bias": float((g - true.flatten()).norm() / norm),
        "std": float(spread / norm),
        "seq_kl": float((mu * (log_mu - log_pi.detach())).sum()),  # KL(mu || pi) over responses
        "k3_kl": float(metrics["k3_kl"]),
    }


def study() -> dict[float, dict[str, dict[str, float]]]:
    out: dict[float, dict[str, dict[str, float]]] = {}
    for eps in EPSILONS:
        pol, reward = problem(eps)
        out[eps] = {name: gradients(pol, reward, cfg) for name, cfg in CORRECTIONS.items()}
    return out


def table(results: dict[float, dict[str, dict[str, float]]]) -> str:
    header = "| correction | " + " | ".join(f"eps = {e}" for e in EPSILONS) + " |"
    lines = [header, "|---|" + "---|" * len(EPSILONS)]
    kl = " | ".join(f"{results[e]['none']['seq_kl']:.2g}" for e in EPSILONS)
    lines.append(f"| KL(mu \\|\\| pi) of a response | {kl} |")
    for name in CORRECTIONS:
        cells = " | ".join(f"{results[e][name]['bias']:.2g} ({results[e][name]['std']:.2f})" for e in EPSILONS)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def figure(results: dict[float, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    kls = [results[e]["none"]["seq_kl"] for e in EPSILONS]
    for name in CORRECTIONS:
        bias = [max(results[e][name]["bias"], FLOOR) for e in EPSILONS]  # exact ones drawn at the floor
        std = [results[e][name]["std"] for e in EPSILONS]
        axes[0].loglog(kls, bias, marker="o", label=name)
        axes[1].loglog(kls, std, marker="o", label=name)
    axes[0].set(xlabel="KL(mu || pi) of a response", ylabel="relative bias of the expected gradient",
                title=f"bias (exact enumeration; {FLOOR:g}: exact to rounding)", ylim=(FLOOR / 2, 1.5))  # fmt: skip
    axes[1].set(xlabel="KL(mu || pi) of a response", ylabel="relative std of one response's gradient",
                title="noise")  # fmt: skip
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--figure", default=str(Path(__file__).resolve().parent.parent / "docs" / "mismatch_study.png"))
    args = parser.parse_args()
    results = study()
    print("relative bias of the expected gradient (relative std of one response's gradient)\n")
    print(table(results))
    figure(results, Path(args.figure))
    print(f"\nwrote {args.figure}")


if __name__ == "__main__":
    main()
