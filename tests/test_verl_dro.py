"""verl's ``dro`` policy loss (``compute_policy_loss_dro`` of verl 0.9.1, run as it is: ``tests/_verl_losses.py``)
against the ``k2`` recipe of docs/mismatch.md: the quadratic log-ratio penalty ``0.5 * dro_beta * (log pi -
log pi_old)^2`` is ``dro_beta * k2``, beside verl's ``-A * log pi``; values and gradients in float64, in every
``loss_agg_mode`` (one process, and with the global-batch divisors of ``global_batch_info``), with and without
``rollout_is_weights``; and its penalty is prime-rl's ``kl_tau * log^2(pi / mu)`` at ``dro_beta = 2 * kl_tau``
toward the sampler's log-probs.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from _snippets import snippet

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
#: float64 agreement; verl's seq-mean-token-mean divides each sequence's sum by its count + 1e-8: a relative
#: 1e-8 / n_i per sequence (at most 1e-8), which the exact mean does not have
_RTOL = dict.fromkeys(MODES, 1e-12) | {"seq-mean-token-mean": 2e-8}


def _data(seed: int, b: int = 6, t: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 1e-3
    lp = (old + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    lengths = torch.tensor([t, 1, 0, 5, t - 3, 9])[:b]  # a sequence with no valid token too
    mask = torch.arange(t) < lengths[:, None]
    lp = lp.masked_fill(~mask, -7.0)  # padding: any log-prob
    return {"lp": lp, "old": old, "adv": torch.randn(b, t, generator=g, dtype=torch.float64), "mask": mask,
            "w": torch.rand(b, t, generator=g, dtype=torch.float64) * 2}  # fmt: skip


def _verl(d: dict[str, torch.Tensor], beta: float, mode: str, weights: bool = False, **batch_info: float):
    from _verl_losses import load_verl_losses, verl_config

    lp = d["lp"].clone().requires_grad_()
    config = verl_config(policy_loss={"loss_mode": "dro", "dro_beta": beta}, global_batch_info=dict(batch_info))
    loss, metrics = load_verl_losses()["dro"](d["old"], lp, d["adv"], d["mask"].double(), mode, config,
                                              rollout_is_weights=d["w"] if weights else None)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def _recipe(d: dict[str, torch.Tensor], beta: float, mode: str, weights: bool = False, **divisors: float):
    """docs/mismatch.md's block, its ``dro_beta`` and verl's ``loss_agg_mode`` set, the weights over both terms.

    verl 0.9.1's ``seq-mean-token-sum-norm`` is the mean over sequences of their token sums, divided by
    ``loss_scale_factor`` (the padded length by default): ``lk.aggregate``'s ``seq-mean-token-sum`` over that
    number, where ``lk.aggregate``'s ``seq-mean-token-sum-norm`` (Dr. GRPO's) divides the token sums by the
    constant alone (the table of docs/mismatch.md)."""
    if mode == "seq-mean-token-sum-norm":
        scale = divisors.pop("norm", d["mask"].shape[-1])
        loss, grad = _recipe(d, beta, "seq-mean-token-sum", weights, **divisors)
        return loss / scale, grad / scale
    code = snippet("docs/mismatch.md", "dro_beta").replace("dro_beta = 0.1", f"dro_beta = {beta!r}")
    code = code.replace('mask, "token-mean")', f"mask, {mode!r}, **divisors)")
    if weights:
        code = code.replace("lk.aggregate(-logprob * A + dro_beta * k2,", "lk.aggregate(w * (-logprob * A + dro_beta * k2),")
    lp = d["lp"].clone().requires_grad_()
    ns = {"torch": torch, "lk": lk, "logprob": lp, "old_logprob": d["old"], "mask": d["mask"], "w": d["w"],
          "batch": {"advantages": d["adv"]}, "divisors": divisors}  # fmt: skip
    exec(compile(code, "<docs/mismatch.md>", "exec"), ns)
    (grad,) = torch.autograd.grad(ns["loss"], lp)
    return ns["loss"].detach(), grad


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_the_k2_recipe_is_verls_dro_loss_value_and_gradient(mode: str, weights: bool) -> None:
    d = _data(seed=3)
    for beta in (0.1, 2.5):
        want, want_grad, metrics = _verl(d, beta, mode, weights)
        got, grad = _recipe(d, beta, mode, weights)
        assert_close(got, want, rtol=_RTOL[mode], atol=1e-14)
        assert_close(grad, want_grad, rtol=_RTOL[mode], atol=1e-14)
        assert (grad[~d["mask"]] == 0).all()
        # verl's metric: the mean of log(pi_old / pi), k1 toward the old policy
        k1 = lk.kl_penalty(d["old"], d["lp"], "k1", mask=d["mask"])
        assert_close(torch.tensor(metrics["actor/ppo_kl"], dtype=torch.float64), lk.aggregate(k1, d["mask"], "token-mean"))


@pytest.mark.parametrize("mode", MODES)
def test_verls_global_batch_divisors_are_the_aggregates_counts(mode: str) -> None:
    # a process of 2: verl divides by the global batch's counts and multiplies by dp_size, as lk.aggregate does
    d = _data(seed=4)
    info = {"dp_size": 2, "batch_num_tokens": 71, "global_batch_size": 11}
    if mode == "seq-mean-token-sum-norm":
        info["loss_scale_factor"] = 32
    want, want_grad, _ = _verl(d, 0.3, mode, **info)
    divisors = {"num_tokens": 71, "num_seqs": 11, "world_size": 2}
    if mode == "seq-mean-token-sum-norm":
        divisors["norm"] = 32
    got, grad = _recipe(d, 0.3, mode, **divisors)
    assert_close(got, want, rtol=_RTOL[mode], atol=1e-14)
    assert_close(grad, want_grad, rtol=_RTOL[mode], atol=1e-14)


def test_the_penalty_is_prime_rls_at_twice_its_kl_tau_toward_the_sampler() -> None:
    # with no advantage, verl's dro toward mu (old_log_prob = the sampler's log-probs) at dro_beta = 2 kl_tau
    # is prime-rl's KL term, kl_tau * l^2 over the token count (tests/test_trust_region.py: its formula)
    from test_trust_region import _prime_rl_default_loss

    d = _data(seed=5)
    kl_tau = 1e-3
    zero = dict(d, adv=torch.zeros_like(d["adv"]))
    want, want_grad, _ = _verl(zero, 2 * kl_tau, "token-mean")
    lp = d["lp"].clone().requires_grad_()
    prime = _prime_rl_default_loss(lp, d["old"], zero["adv"], d["mask"], kl_tau=kl_tau)
    (prime_grad,) = torch.autograd.grad(prime, lp)
    assert_close(want, prime.detach(), rtol=1e-12, atol=1e-15)
    assert_close(want_grad, prime_grad, rtol=1e-12, atol=1e-15)


def test_verl_refuses_a_dro_beta_that_is_not_positive_and_the_recipe_takes_zero() -> None:
    d = _data(seed=6)
    for beta in (None, 0.0, -1.0):
        with pytest.raises(ValueError, match="dro_beta must be a positive value"):
            _verl(d, beta, "token-mean")
    got, _ = _recipe(d, 0.0, "token-mean")  # beta = 0: the policy term alone
    assert_close(got, lk.aggregate(-d["lp"] * d["adv"], d["mask"], "token-mean"))
