"""The trust region toward the sampler: ``RolloutCorrection(trust_region=...)`` (DPPO's binary TV and binary
KL masks) against verl 0.9.1's own ``compute_policy_loss_dppo_tv`` / ``_dppo_kl`` and float64 formulas, and
the ``k2`` recipe of docs/mismatch.md against prime-rl's default loss.

prime-rl's formula is written here from its source, ``src/prime_rl/trainer/rl/loss.py`` of
github.com/PrimeIntellect-ai/prime-rl (``default_loss_fn`` with ``DefaultLossConfig``: ``dppo_mask_low`` /
``_high`` 0.2, ``adv_tau`` 1, ``kl_tau`` 1e-3; ``compute_loss`` divides the summed per-token loss by the
global token count): per token,
``-(keep * adv_tau * A * exp(l)) + kl_tau * l**2`` with ``l = log pi - log mu`` and ``keep`` the valid
tokens inside the binary TV region (masked where ``A > 0`` and ``p - q > high``, or ``A <= 0`` and
``p - q < -low``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from _snippets import snippet
from lightning_kl.trust_region import binary_kl, trust_region_keep


def _data(seed: int, b: int = 8, t: int = 64, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(b, t, generator=g, dtype=torch.float64) ** 2 * 4 - 1e-3  # probabilities from 0.02 to ~1
    lp = (mu + 0.6 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t) < lengths[:, None]
    return {"lp": lp.to(dtype), "mu": mu.to(dtype), "adv": adv.to(dtype), "mask": mask}


def _verl_mask_and_loss(kind: str, d: dict[str, torch.Tensor], low: float, high: float, c: float):
    from _verl_losses import load_verl_losses, verl_config

    lp = d["lp"].clone().requires_grad_()
    loss, metrics = load_verl_losses()[kind](
        old_log_prob=d["mu"], log_prob=lp, advantages=d["adv"], response_mask=d["mask"].float(),
        loss_agg_mode="token-mean", config=verl_config(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c),
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    # d loss / d log pi = -A * min(ratio, c) * valid / N: nonzero exactly where the token is valid (A != 0)
    return grad != 0, loss.detach(), grad, metrics


@pytest.mark.parametrize("kind", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.05, 0.3), (0.01, 0.002)])
def test_the_gate_and_the_loss_equal_verls_dppo(kind: str, low: float, high: float) -> None:
    d = _data(seed=hash((kind, low)) % 1000)
    c = 3.0
    want_mask, want_loss, want_grad, metrics = _verl_mask_and_loss(kind, d, low, high, c)
    actor = {"policy_loss": {"loss_mode": kind}, "clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": c}
    fix = lk.RolloutCorrection.from_verl({}, actor=actor)
    lp = d["lp"].clone().requires_grad_()
    out = fix(lp, d["mu"], d["mask"], advantages=d["adv"])
    gate = (out.weights != 0) & d["mask"]
    assert torch.equal(gate, want_mask & d["mask"])
    assert 0 < int((d["mask"] & ~gate).sum()) < int(d["mask"].sum())  # the data reach both sides
    assert torch.equal(out.mask, d["mask"])  # outside the region: a weight of 0, in the denominator still
    loss = lk.aggregate(-d["adv"] * out.weights * lp, out.mask, "token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert_close(grad, want_grad, rtol=1e-6, atol=0)
    assert float(out.metrics["trust_region_masked_fraction"]) == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-7)


def _formula_keep(region: str, lp: torch.Tensor, mu: torch.Tensor, adv: torch.Tensor, low: float, high: float):
    """The paper's masks in float64, written from the formulas (not from the module's helpers)."""
    p, q = lp.double().exp(), mu.double().exp()
    if region == "binary_tv":
        return torch.where(adv > 0, p - q <= high, p - q >= -low)
    d = q * (q.log() - p.log()) + (1 - q) * ((1 - q).log() - (1 - p).log())
    return torch.where(adv > 0, (d <= high) | (p <= q), (d <= low) | (p >= q))


@pytest.mark.parametrize("region", ["binary_tv", "binary_kl"])
def test_the_gate_equals_the_float64_formula_with_zero_advantages_and_padding(region: str) -> None:
    d = _data(seed=3, dtype=torch.float64)
    d["adv"][:, ::5] = 0.0  # a zero advantage takes the second branch (A <= 0)
    d["lp"][~d["mask"]] = math.nan  # padding is never read
    fix = lk.RolloutCorrection(None, trust_region=region, trust_region_threshold=(0.03, 0.1))
    out = fix(d["lp"], d["mu"], d["mask"], advantages=d["adv"])
    want = _formula_keep(region, d["lp"].nan_to_num(), d["mu"], d["adv"], 0.03, 0.1) & d["mask"]
    assert torch.equal(out.weights != 0, want)
    assert out.weights.dtype == torch.float64 and set(out.weights.unique().tolist()) <= {0.0, 1.0}
    assert 0 < int((d["mask"] & ~want).sum())
    # advantages per sequence ([b]) broadcast over the tokens
    seq = fix(d["lp"], d["mu"], d["mask"], advantages=d["adv"][:, 1]).weights
    assert torch.equal(seq != 0, _formula_keep(region, d["lp"].nan_to_num(), d["mu"], d["adv"][:, 1:2].expand_as(d["lp"]), 0.03, 0.1) & d["mask"])


@pytest.mark.parametrize("region", ["binary_tv", "binary_kl"])
def test_a_token_exactly_at_the_threshold_is_kept(region: str) -> None:
    # p - q (or D) computed as the module computes it, then used as the threshold: kept (<=), and the
    # next float below it masks the token
    lp = torch.tensor([[-0.25, -1.5]], dtype=torch.float64)  # p above q: A > 0 reads the high side
    mu = torch.tensor([[-0.75, -0.5]], dtype=torch.float64)  # p below q: A <= 0 reads the low side
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    if region == "binary_tv":
        high = float(lp[0, 0].exp() - mu[0, 0].exp())
        low = float(mu[0, 1].exp() - lp[0, 1].exp())
    else:
        high, low = float(binary_kl(mu[0, 0], lp[0, 0])), float(binary_kl(mu[0, 1], lp[0, 1]))
    m = torch.ones(1, 2, dtype=torch.bool)
    at = trust_region_keep(lp, mu, adv, m, region, low, high)
    assert at.tolist() == [[True, True]]
    below = trust_region_keep(lp, mu, adv, m, region, math.nextafter(low, 0), math.nextafter(high, 0))
    assert below.tolist() == [[False, False]]


def test_binary_kl_against_float64_formula_and_at_its_ends() -> None:
    lq = torch.tensor([-0.1, -2.0, -5.0, -0.7], dtype=torch.float64)
    lp = torch.tensor([-0.3, -1.0, -4.0, -0.7], dtype=torch.float64)
    q, p = lq.exp(), lp.exp()
    want = q * torch.log(q / p) + (1 - q) * torch.log((1 - q) / (1 - p))
    assert_close(binary_kl(lq, lp), want, rtol=1e-12, atol=1e-15)
    # q = 1: -log p; p = 1 > q: inf; both 1: 0
    ends = binary_kl(torch.tensor([0.0, -0.5, 0.0]), torch.tensor([-0.5, 0.0, 0.0]))
    assert ends[0].item() == pytest.approx(0.5) and ends[1].item() == math.inf and ends[2].item() == 0.0
    # near p = 1 in float32, where 1 - p rounds: float64 maths agree to float32 precision
    lq32, lp32 = torch.tensor([-1e-3], dtype=torch.float32), torch.tensor([-1e-6], dtype=torch.float32)
    qd, pd = lq32.double().exp(), lp32.double().exp()
    exact = qd * (lq32.double() - lp32.double()) + (-torch.expm1(lq32.double())) * (
        torch.log(-torch.expm1(lq32.double())) - torch.log(-torch.expm1(lp32.double())))
    assert_close(binary_kl(lq32, lp32).double(), exact, rtol=1e-5, atol=0)


def test_the_gate_multiplies_the_importance_weights_and_counts_in_the_metrics() -> None:
    lp = torch.tensor([[-0.1, -2.0, -0.5, -1.0]])
    mu = torch.tensor([[-0.5, -0.2, -0.5, -1.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True, False]])
    plain = lk.RolloutCorrection("token", upper=2.0)(lp, mu, mask)
    out = lk.RolloutCorrection("token", upper=2.0, trust_region="binary_tv", trust_region_threshold=0.2)(lp, mu, mask, adv)
    # token 0: p - q = 0.905 - 0.607 > 0.2 with A > 0; token 1: 0.135 - 0.819 < -0.2 with A < 0
    assert out.weights.tolist() == [[0.0, 0.0, plain.weights[0, 2].item(), 0.0]]
    assert torch.equal(out.mask, mask)
    assert out.metrics["trust_region_masked_fraction"].item() == pytest.approx(2 / 3)
    # measured, not returned (verl's bypass ppo_clip): the gate alone
    alone = lk.RolloutCorrection("token", upper=2.0, return_weights=False, trust_region="binary_tv",
                                 trust_region_threshold=0.2)(lp, mu, mask, adv)  # fmt: skip
    assert alone.weights.tolist() == [[0.0, 0.0, 1.0, 0.0]] and "rollout_is_mean" in alone.metrics


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"trust_region": "tv"}, r"unknown `trust_region` 'tv'; valid values: 'binary_tv', 'binary_kl', None"),
        ({"trust_region": "binary_tv"}, r"needs `trust_region_threshold`"),
        ({"trust_region_threshold": 0.2}, r"given without `trust_region`"),
        ({"trust_region": "binary_kl", "trust_region_threshold": 0.0}, r"positive finite number or a pair"),
        ({"trust_region": "binary_kl", "trust_region_threshold": -0.1}, r"positive finite"),
        ({"trust_region": "binary_kl", "trust_region_threshold": math.nan}, r"positive finite"),
        ({"trust_region": "binary_kl", "trust_region_threshold": True}, r"positive finite"),
        ({"trust_region": "binary_kl", "trust_region_threshold": (0.1, 0.2, 0.3)}, r"positive finite"),
        ({"trust_region": "binary_kl", "trust_region_threshold": "0.1"}, r"positive finite"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lk.RolloutCorrection(None, **kwargs)


def test_the_advantages_are_required_and_checked() -> None:
    fix = lk.RolloutCorrection(None, trust_region="binary_tv", trust_region_threshold=0.2)
    lp, mu = torch.full((2, 3), -1.0), torch.full((2, 3), -1.2)
    with pytest.raises(ValueError, match=r"`trust_region` is set: pass `advantages`"):
        fix(lp, mu)
    with pytest.raises(ValueError, match=r"`advantages` must be \[...\], \[..., 1\] or \[..., t\] for log-probs \(2, 3\), got \(3,\)"):
        fix(lp, mu, advantages=torch.ones(3))


def test_from_verl_maps_the_dppo_loss_modes_and_refuses_what_one_correction_cannot_hold() -> None:
    R = lk.RolloutCorrection
    tv = R.from_verl({}, actor={"policy_loss": {"loss_mode": "dppo_tv"}})
    assert (tv.trust_region, tv.trust_threshold, tv.upper, tv.bypass, tv.weights) == ("binary_tv", (0.2, 0.2), 3.0, True, "token")
    kl = R.from_verl({}, actor={"policy_loss": {"loss_mode": "dppo_kl"}, "clip_ratio": 0.05, "clip_ratio_low": None,
                                "clip_ratio_high": 0.08, "clip_ratio_c": 20.0})  # fmt: skip
    assert (kl.trust_region, kl.trust_threshold, kl.upper) == ("binary_kl", (0.05, 0.08), 20.0)
    # an object with attributes, as verl's ActorConfig
    from types import SimpleNamespace

    obj = SimpleNamespace(policy_loss=SimpleNamespace(loss_mode="dppo_tv"), clip_ratio=0.2, clip_ratio_low=0.1,
                          clip_ratio_high=0.3, clip_ratio_c=3.0)  # fmt: skip
    assert R.from_verl({}, actor=obj).trust_threshold == (0.1, 0.3)
    # another loss mode: the block as it is
    assert repr(R.from_verl({"rollout_is": "token"}, actor={"policy_loss": {"loss_mode": "kl_cov"}})) == repr(
        R.from_verl({"rollout_is": "token"}))
    with pytest.raises(ValueError, match=r"verl replaces the loss mode by 'bypass_mode'"):
        R.from_verl({"bypass_mode": True}, actor={"policy_loss": {"loss_mode": "dppo_tv"}})
    with pytest.raises(ValueError, match=r"build RolloutCorrection.from_verl\(block\) for the first"):
        R.from_verl({"rollout_is": "token"}, actor={"policy_loss": {"loss_mode": "dppo_kl"}})
    with pytest.raises(ValueError, match=r"unknown `policy_loss.loss_mode` 'dppo'; valid values: 'vanilla', 'dppo_tv'"):
        R.from_verl({}, actor={"policy_loss": {"loss_mode": "dppo"}})


def _prime_rl_default_loss(trainer_lp, inference_lp, advantages, loss_mask, low=0.2, high=0.2, adv_tau=1.0, kl_tau=1e-3):
    """prime-rl's ``default_loss_fn`` summed over the samples and divided by the token count, as
    ``compute_loss`` does (module docstring), row by row as its packed samples."""
    total = 0.0
    for t_lp, i_lp, adv, m in zip(trainer_lp, inference_lp, advantages, loss_mask):
        log_ratio = t_lp - i_lp
        ratio = torch.exp(log_ratio)
        diff = torch.exp(t_lp) - torch.exp(i_lp)
        masked = torch.where(adv > 0, diff > high, diff < -low)
        keep = m & ~masked
        per_token = -(keep * (adv_tau * adv) * ratio) + kl_tau * (m * log_ratio**2)
        total = total + per_token.sum()
    return total / loss_mask.sum()


def test_the_k2_recipe_of_the_docs_equals_prime_rls_default_loss() -> None:
    code = snippet("docs/mismatch.md", "kl_tau")
    d = _data(seed=11, dtype=torch.float64)
    d["lp"][~d["mask"]] = -5.0  # padding: any log-prob
    lp = d["lp"].clone().requires_grad_()
    ns = {"torch": torch, "lk": lk, "logprob": lp, "mask": d["mask"],
          "batch": {"rollout_logprobs": d["mu"], "advantages": d["adv"]}}  # fmt: skip
    exec(compile(code, "<docs/mismatch.md>", "exec"), ns)
    (grad,) = torch.autograd.grad(ns["loss"], lp)
    lp2 = d["lp"].clone().requires_grad_()
    want = _prime_rl_default_loss(lp2, d["mu"], d["adv"], d["mask"])
    (want_grad,) = torch.autograd.grad(want, lp2)
    assert_close(ns["loss"], want, rtol=1e-12, atol=1e-15)
    assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    # the KL term is the k2 estimator: tau * l^2 = 2 tau * k2
    l = (d["lp"] - d["mu"])[d["mask"]]
    assert_close(lk.kl_penalty(d["lp"], d["mu"], "k2", mask=d["mask"])[d["mask"]], 0.5 * l**2)


@pytest.mark.parametrize("region", ["binary_tv", "binary_kl"])
def test_a_nan_log_prob_at_a_valid_token_is_outside_the_region(region: str) -> None:
    # NaN compares False on both sides: the gate is 0 there (the loss, which reads the log-prob, is NaN)
    fix = lk.RolloutCorrection(None, trust_region=region, trust_region_threshold=0.1)
    lp = torch.tensor([[math.nan, -1.0, -1.0]])
    mu = torch.tensor([[-1.0, -1.0, math.nan]])
    out = fix(lp, mu, advantages=torch.tensor([[1.0, -1.0, -1.0]]))
    assert out.weights.tolist() == [[0.0, 1.0, 0.0]]
