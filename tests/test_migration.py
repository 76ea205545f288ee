"""Every equivalence that ``docs/migration.md`` states, checked against the other stack's maths.

Each ``*_reference`` function below is the other stack's KL term written in float64 from its
documentation and from the formula its source states, at the commit the guide names (verl
b178a3cd, TRL f2cd5771, OpenRLHF 3c3be623, NeMo-RL 7ea279ab, slime 624b824a); none is their code.
A row of the guide that says "the same" is a test here that compares values and gradients on a grid
of log-ratios ``d = logprob - ref_logprob``; a row that says "differs" is a test that measures by how
much, and the guide quotes those numbers.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn
from torch.testing import assert_close

import lightning_kl as lk

# gradients toward the reference are compared on purpose, and the example's rollouts have a length
pytestmark = [
    pytest.mark.filterwarnings("ignore:`ref_[a-z]*` requires grad"),
    pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined"),
]

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "migration.md"

# log-ratios from -25 to 25 (no grid point on a clamp edge: 997 points), plus a few small ones
D = torch.cat([torch.linspace(-25.0, 25.0, 997, dtype=torch.float64), torch.tensor([-1e-3, 0.0, 1e-3, 0.3, -0.7], dtype=torch.float64)])
TIGHT = dict(rtol=1e-12, atol=1e-12)
# a weighted k3 written as w * k3 (as the references do) gets its gradient from two terms of size
# w e^{-d} that cancel to about d: float64 keeps 1e-16 of them, a relative 3e-9 at |d| near 20
WEIGHTED_K3_RTOL = 1e-8


def _pair(d: Tensor, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Policy and reference log-probs with ``logprob - ref_logprob = d``."""
    g = torch.Generator().manual_seed(seed)
    lp = -3.0 * torch.rand(d.shape, generator=g, dtype=torch.float64) - (-d).clamp(min=0)  # both <= 0
    return lp, lp - d


def _value_and_grads(fn: Callable[[Tensor, Tensor], Tensor], lp: Tensor, ref: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``fn(lp, ref)`` per token and its gradients w.r.t. ``lp`` and ``ref`` (of the sum)."""
    lp = lp.detach().clone().requires_grad_()
    ref = ref.detach().clone().requires_grad_()
    value = fn(lp, ref)
    g_lp, g_ref = torch.autograd.grad(value.sum(), (lp, ref), allow_unused=True)
    g_ref = torch.zeros_like(ref) if g_ref is None else g_ref
    return value.detach(), g_lp, g_ref


def _assert_same(
    ours: Callable, theirs: Callable, lp: Tensor, ref: Tensor, where: Optional[Tensor] = None, rtol: float = 1e-12
) -> None:
    got, want = _value_and_grads(ours, lp, ref), _value_and_grads(theirs, lp, ref)
    for g, w, what in zip(got, want, ("value", "grad wrt logprob", "grad wrt ref_logprob")):
        if where is not None:
            g, w = g[where], w[where]
        assert_close(g, w, rtol=rtol, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _ours(name: str, **kwargs: Any) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda lp, ref: lk.kl_penalty(lp, ref, name, **kwargs)


def _k3(d: Tensor) -> Tensor:
    return torch.exp(-d) + d - 1


# =================================================================================================
# verl (volcengine/verl b178a3cd, version file 0.8.0.dev): core_algos.kl_penalty, agg_loss,
# AdaptiveKLController, ray_trainer.apply_kl_penalty


def verl_reference(lp: Tensor, ref: Tensor, name: str) -> Tensor:
    """verl's documented estimators: ``k3`` and ``low_var_kl`` are one branch, clamped twice."""
    base = name[:-1] if name.endswith("+") else name
    d = lp - ref
    if base in ("kl", "k1"):
        value = d
    elif base == "abs":
        value = d.abs()
    elif base in ("mse", "k2"):
        value = 0.5 * d * d
    elif base in ("low_var_kl", "k3"):
        x = (ref - lp).clamp(-20.0, 20.0)  # the log-ratio ref / policy, clamped before exp
        value = (torch.exp(x) - x - 1).clamp(-10.0, 10.0)
    else:
        raise AssertionError(name)
    if name.endswith("+"):  # documented: the value of the base name with the gradient of d**2 / 2
        k2 = 0.5 * d * d
        value = value.detach() + (k2 - k2.detach())
    return value


VERL_TO_OURS = {
    "kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "low_var_kl", "k3": "low_var_kl",
}  # fmt: skip
VERL_TO_OURS.update({f"{k}+": f"{v}+" for k, v in VERL_TO_OURS.items()})


@pytest.mark.parametrize("verl_name", sorted(VERL_TO_OURS))
def test_verl_names_map_to_ours_on_every_log_ratio(verl_name: str) -> None:
    lp, ref = _pair(D)
    _assert_same(_ours(VERL_TO_OURS[verl_name]), lambda a, b: verl_reference(a, b, verl_name), lp, ref)


def test_verl_k3_is_our_low_var_kl_not_our_k3() -> None:
    # where k3 <= 10 the three agree; the edges, by bisection on k3(d) = 10
    def above(x: float) -> bool:
        return _k3(torch.tensor(x, dtype=torch.float64)).item() > 10

    def edge(lo: float, hi: float) -> float:  # above(lo) != above(hi)
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if above(mid) == above(lo) else (lo, mid)
        return lo

    left, right = edge(-5.0, 0.0), edge(5.0, 15.0)
    assert round(left, 3) == -2.611 and round(right, 3) == 11.0
    lp, ref = _pair(D)
    inside = (D > left + 1e-9) & (D < right - 1e-9)
    for verl_name in ("k3", "k3+"):
        _assert_same(_ours(verl_name), lambda a, b: verl_reference(a, b, verl_name), lp, ref, where=inside)
    # outside, our k3 keeps the value and the gradient 1 - e^{-d}; verl's k3 is 10 with gradient 0
    lp, ref = _pair(torch.tensor([-3.0], dtype=torch.float64))
    ours_v, ours_g, _ = _value_and_grads(_ours("k3"), lp, ref)
    verl_v, verl_g, _ = _value_and_grads(lambda a, b: verl_reference(a, b, "k3"), lp, ref)
    assert ours_v.item() == pytest.approx(math.exp(3) - 4, rel=1e-12)  # 16.09
    assert ours_g.item() == pytest.approx(1 - math.exp(3), rel=1e-12)  # -19.09
    assert (verl_v.item(), verl_g.item()) == (10.0, 0.0)
    assert 1 - verl_v.item() / ours_v.item() == pytest.approx(0.378, abs=5e-4)
    # k3+: the same gradient d, but verl's value is the clamped one
    ours_v, ours_g, _ = _value_and_grads(_ours("k3+"), lp, ref)
    verl_v, verl_g, _ = _value_and_grads(lambda a, b: verl_reference(a, b, "k3+"), lp, ref)
    assert ours_g.item() == verl_g.item() == -3.0
    assert (ours_v.item(), verl_v.item()) == (pytest.approx(math.exp(3) - 4), 10.0)


def verl_agg_reference(mat: Tensor, mask: Tensor, mode: str, scale: Optional[float] = None) -> Tensor:
    """verl's ``loss_agg_mode`` (one process, micro-batch counts): fully masked rows leave the seq means."""
    m = mask.to(mat.dtype)
    sums, counts = (mat * m).sum(-1), m.sum(-1)
    nonempty = (counts > 0).to(mat.dtype)
    if mode == "token-mean":
        return sums.sum() / m.sum()
    if mode == "seq-mean-token-sum":
        return (sums * nonempty).sum() / nonempty.sum()
    if mode == "seq-mean-token-mean":
        return (sums / (counts + 1e-8) * nonempty).sum() / nonempty.sum()
    if mode == "seq-mean-token-sum-norm":
        return sums.sum() / (mask.shape[-1] if scale is None else scale)
    raise AssertionError(mode)


def _batch(b: int = 5, t: int = 7, seed: int = 1, spread: float = 1.5) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = -3.0 * torch.rand(b, t, generator=g, dtype=torch.float64)
    ref = lp - spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    shift = ref.max().clamp(min=0)  # log-probs: both <= 0
    lp, ref = lp - shift, ref - shift
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t) < lengths[:, None]
    return lp, ref, mask


@pytest.mark.parametrize(
    ("mode", "scale"),
    [("token-mean", None), ("seq-mean-token-sum", None), ("seq-mean-token-mean", None),
     ("seq-mean-token-sum-norm", None), ("seq-mean-token-sum-norm", 512.0)],
)  # fmt: skip
def test_verl_kl_loss_is_our_loss_with_its_agg_mode(mode: str, scale: Optional[float]) -> None:
    # actor.use_kl_loss=True, kl_loss_type=low_var_kl, kl_loss_coef, loss_agg_mode, loss_scale_factor
    lp, ref, mask = _batch()
    mask[2] = False  # a fully masked sequence: verl leaves it out of the seq means, as we do
    coef = 0.001
    loss_fn = lk.KLPenaltyLoss("low_var_kl", coef=coef, agg=mode, agg_norm=scale)
    _assert_same(
        lambda a, b: loss_fn(a, b, mask),
        lambda a, b: coef * verl_agg_reference(verl_reference(a, b, "low_var_kl"), mask, mode, scale),
        lp, ref,
        rtol=1e-7 if mode == "seq-mean-token-mean" else 1e-12,  # verl divides by (count + 1e-8)
    )  # fmt: skip


def verl_adaptive_reference(value: float, current_kl: float, n_steps: int, target: float, horizon: float) -> float:
    """Ziegler et al.'s proportional controller as verl and OpenRLHF state it."""
    error = min(max(current_kl / target - 1, -0.2), 0.2)
    return value * (1 + error * n_steps / horizon)


class _Recorder(pl.LightningModule):
    """Trains nothing; keeps each batch's rewards as ``training_step`` sees them."""

    def __init__(self, batches: list[dict[str, Tensor]]) -> None:
        super().__init__()
        self.batches = batches
        self.seen: list[Tensor] = []
        self.w = nn.Parameter(torch.zeros((), dtype=torch.float64))

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.batches, batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.seen.append(batch["rewards"].detach().clone())
        return self.w * batch["rewards"].sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("verl_name", ["kl", "low_var_kl"])
def test_verl_kl_in_reward_with_adaptive_controller_in_a_trainer(quiet_trainer: Any, verl_name: str) -> None:
    # algorithm.use_kl_in_reward=True, kl_penalty, kl_ctrl.type=adaptive: token_level_scores - beta * kld,
    # then the controller observes the mean over sequences of each sequence's token-mean KL, n_steps = b
    kl_coef, target, horizon = 0.05, 0.1, 40
    batches = []
    for i in range(4):
        lp, ref, mask = _batch(b=6, t=5, seed=10 + i, spread=0.5 + 0.3 * i)
        scores = torch.where(mask, torch.randn(mask.shape, dtype=torch.float64), 0.0)
        batches.append({"scores": scores, "logprobs": lp, "ref_logprobs": ref, "mask": mask})
    callback = lk.KLRewardCallback(VERL_TO_OURS[verl_name], lk.AdaptiveKLController(kl_coef, target_kl=target, horizon=horizon))
    module = _Recorder([dict(b) for b in batches])
    quiet_trainer(max_epochs=1, callbacks=[callback]).fit(module)

    beta = kl_coef
    for batch, seen in zip(batches, module.seen):
        kld = verl_reference(batch["logprobs"], batch["ref_logprobs"], verl_name) * batch["mask"]
        assert_close(seen, batch["scores"] - beta * kld, **TIGHT)
        m = batch["mask"].to(torch.float64)
        current_kl = ((kld * m).sum(-1) / m.sum(-1)).mean().item()
        beta = verl_adaptive_reference(beta, current_kl, kld.shape[0], target, horizon)
    assert callback.controller.value == pytest.approx(beta, rel=1e-12)
    assert beta != kl_coef


# =================================================================================================
# TRL (huggingface/trl f2cd5771, 1.10.0.dev0): GRPOTrainer._compute_loss, experimental PPOTrainer,
# RLOOTrainer


def trl_grpo_kl_reference(lp: Tensor, ref: Tensor, weight: Optional[Tensor] = None) -> Tensor:
    """GRPO's per-token KL: k3 with no clamp, times the IS ratio with ``use_bias_correction_kl``."""
    x = ref - lp
    kl = torch.exp(x) - x - 1
    return kl if weight is None else kl * weight


def test_trl_grpo_k3_is_our_k3_within_its_overflow_guard() -> None:
    lp, ref = _pair(D)
    inside = D.abs() < 20
    _assert_same(_ours("k3"), trl_grpo_kl_reference, lp, ref, where=inside)
    # beyond |d| = 20 our k3 saturates (value k3(+-20), gradient 0); TRL's keeps growing: at d = -25
    lp, ref = _pair(torch.tensor([-25.0], dtype=torch.float64))
    assert trl_grpo_kl_reference(lp, ref).item() == pytest.approx(math.exp(25) - 26, rel=1e-12)  # 7.2e10
    assert lk.kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(20) - 21, rel=1e-12)  # 4.9e8


@pytest.mark.parametrize("on_policy", [True, False])
def test_trl_use_bias_correction_kl_is_our_k3_with_old_logprob(on_policy: bool) -> None:
    # use_bias_correction_kl=True at importance_sampling_level="token": k3 * exp(logprob - old_logprob),
    # the ratio differentiable; num_iterations=1 makes old_logprob = logprob.detach()
    lp, ref = _pair(D)
    inside = D.abs() < 20
    if on_policy:
        _assert_same(
            lambda a, b: lk.kl_penalty(a, b, "k3", old_logprob=a.detach()),
            lambda a, b: trl_grpo_kl_reference(a, b, torch.exp(a - a.detach())),
            lp, ref, inside, WEIGHTED_K3_RTOL,
        )  # fmt: skip
    else:
        old = (lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)).clamp(max=0)
        _assert_same(
            lambda a, b: lk.kl_penalty(a, b, "k3", old_logprob=old),
            lambda a, b: trl_grpo_kl_reference(a, b, torch.exp(a - old)),
            lp, ref, inside, WEIGHTED_K3_RTOL,
        )  # fmt: skip


def trl_loss_type_reference(per_token: Tensor, mask: Tensor, loss_type: str, max_completion_length: int = 0) -> Tensor:
    """How GRPOTrainer reduces its per-token loss (the KL term included), one process, no accumulation."""
    m = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (per_token.shape[0] * max_completion_length)
    if loss_type == "dapo":  # num_items_in_batch: the valid tokens of the whole accumulated global batch
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    raise AssertionError(loss_type)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_trl_loss_type_is_our_agg(loss_type: str) -> None:
    lp, ref, mask = _batch(spread=0.7)
    beta, max_len = 0.04, 16
    agg = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm", "dapo": "token-mean"}[loss_type]
    # dr_grpo divides by (sequences in the batch) x max_completion_length: a constant for a fixed batch size
    agg_norm = lp.shape[0] * max_len if loss_type == "dr_grpo" else None
    loss_fn = lk.KLPenaltyLoss("k3", coef=beta, agg=agg, agg_norm=agg_norm)
    _assert_same(
        lambda a, b: loss_fn(a, b, mask),
        lambda a, b: beta * trl_loss_type_reference(trl_grpo_kl_reference(a, b), mask, loss_type, max_len),
        lp, ref,
    )  # fmt: skip


def test_trl_grpo_loss_type_counts_empty_sequences_we_do_not() -> None:
    lp, ref, mask = _batch(spread=0.7)
    mask[3] = False  # a response with no completion token
    beta = 0.04
    ours = lk.KLPenaltyLoss("k3", coef=beta, agg="seq-mean-token-mean")(lp, ref, mask)
    trl = beta * trl_loss_type_reference(trl_grpo_kl_reference(lp, ref), mask, "grpo")
    assert_close(trl, ours * 4 / 5, **TIGHT)  # TRL divides by 5 sequences, we by the 4 with a token


def test_trl_dapo_over_accumulated_micro_batches_is_our_token_mean_with_step_totals() -> None:
    # dapo divides every micro-batch by the accumulated batch's token count and does not divide by the
    # number of micro-batches; Lightning divides our loss by accumulate_grad_batches: the same gradient
    beta, k = 0.04, 3
    micro = [_batch(b=3, t=6, seed=20 + i, spread=0.7) for i in range(k)]
    total = sum(int(m.sum()) for _, _, m in micro)
    assert lk.step_totals([m for _, _, m in micro])["num_tokens"].item() == total
    loss_fn = lk.KLPenaltyLoss("k3", coef=beta, agg="token-mean")
    for lp, ref, mask in micro:
        _assert_same(
            lambda a, b: loss_fn(a, b, mask, num_tokens=total, accumulate_grad_batches=k) / k,
            lambda a, b: beta * (trl_grpo_kl_reference(a, b) * mask).sum() / total,
            lp, ref,
        )  # fmt: skip


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_trl_ppo_non_score_reward_is_our_callback_penalty(estimator: str) -> None:
    # PPOConfig(kl_estimator, kl_coef): non_score_reward = -kl_coef * kl per token (k3 unclamped)
    lp, ref, mask = _batch(spread=2.0)
    kl_coef = 0.05
    logr = ref - lp
    kl = -logr if estimator == "k1" else (torch.exp(logr) - 1) - logr
    callback = lk.KLRewardCallback(estimator, lk.FixedKLController(kl_coef))
    rewards, _, _ = callback.shape_rewards({"scores": torch.zeros_like(lp), "logprobs": lp, "ref_logprobs": ref, "mask": mask})
    assert (lp - ref)[mask].abs().max() < 20  # inside k3's overflow guard
    assert_close(rewards[mask], (-kl_coef * kl)[mask], **TIGHT)
    assert (rewards[~mask] == 0).all()


def test_trl_rloo_sequence_reward_is_the_sum_of_our_token_rewards() -> None:
    # RLOOTrainer(beta): rewards = rewards - beta * sum_t (old_logprob - ref_logprob) per sequence
    lp, ref, mask = _batch(spread=1.0)
    beta = 0.05
    scores = torch.randn(lp.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    callback = lk.KLRewardCallback("k1", lk.FixedKLController(beta))
    rewards, _, _ = callback.shape_rewards({"scores": scores, "logprobs": lp, "ref_logprobs": ref, "mask": mask})
    assert_close(rewards.sum(-1), scores - beta * ((lp - ref) * mask).sum(-1), **TIGHT)


# =================================================================================================
# OpenRLHF (OpenRLHF/OpenRLHF 3c3be623, v0.11.0): models/utils.compute_approx_kl, compute_reward,
# models/loss.aggregate_loss


def openrlhf_reference(lp: Tensor, ref: Tensor, estimator: str) -> Tensor:
    """``--algo.kl.estimator``: k1, k2, k3 of ``log_probs - log_probs_base``, every one clamped to +-10."""
    r = lp - ref
    if estimator == "k1":
        kl = r
    elif estimator == "k2":
        kl = r * r / 2
    elif estimator == "k3":
        kl = torch.exp(-r) - 1 + r
    else:
        raise AssertionError(estimator)
    return kl.clamp(-10.0, 10.0)


@pytest.mark.parametrize(
    ("estimator", "ours", "unclamped"),
    [("k3", "low_var_kl", 1e9), ("k1", "k1", 10.0), ("k2", "k2", math.sqrt(20.0))],
)
def test_openrlhf_estimators_where_they_are_ours(estimator: str, ours: str, unclamped: float) -> None:
    lp, ref = _pair(D)
    inside = D.abs() < unclamped - 1e-9
    _assert_same(_ours(ours), lambda a, b: openrlhf_reference(a, b, estimator), lp, ref, where=inside)


def test_openrlhf_clamps_k1_and_k2() -> None:
    # at d = -12 (the policy gives the token e^-12 of the reference's probability)
    lp, ref = _pair(torch.tensor([-12.0], dtype=torch.float64))
    assert _value_and_grads(lambda a, b: openrlhf_reference(a, b, "k1"), lp, ref)[:2] == (torch.tensor([-10.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64))
    v, g, _ = _value_and_grads(_ours("k1"), lp, ref)
    assert (v.item(), g.item()) == (pytest.approx(-12.0), 1.0)
    lp, ref = _pair(torch.tensor([5.0], dtype=torch.float64))
    assert openrlhf_reference(lp, ref, "k2").item() == 10.0 and lk.kl_penalty(lp, ref, "k2").item() == pytest.approx(12.5)


def test_openrlhf_reward_is_our_callback_where_k1_is_unclamped() -> None:
    # compute_reward: the score r at each sequence's last action token, minus kl_coef * kl at every token
    lp, ref, mask = _batch(spread=2.0)
    kl_coef = 0.01
    r = torch.tensor([1.0, -2.0, 0.5, 3.0, -0.25], dtype=torch.float64)
    want = -kl_coef * openrlhf_reference(lp, ref, "k1")
    last = mask.shape[1] - 1 - mask.long().fliplr().argmax(dim=1)
    want[torch.arange(len(r)), last] += r
    callback = lk.KLRewardCallback("k1", lk.FixedKLController(kl_coef))
    rewards, _, _ = callback.shape_rewards({"scores": r, "logprobs": lp, "ref_logprobs": ref, "mask": mask})
    assert (lp - ref)[mask].abs().max() < 10
    assert_close(rewards[mask], want[mask], **TIGHT)


def openrlhf_aggregate_reference(loss: Tensor, mask: Tensor, token_level_loss: bool) -> Tensor:
    m = mask.to(loss.dtype)
    if token_level_loss:
        return (loss * m).sum() / m.sum()
    counts = m.sum(-1)
    seq = (loss * m).sum(-1) / (counts + 1e-8)  # the 1e-8: a relative 1e-8 / count from ours
    keep = (counts > 0).to(loss.dtype)
    return (seq * keep).sum() / keep.sum()


@pytest.mark.parametrize("token_level_loss", [True, False])
def test_openrlhf_kl_loss_is_our_low_var_kl_loss(token_level_loss: bool) -> None:
    # --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef; policy_loss_type ppo (token level) or gspo
    lp, ref, mask = _batch(spread=2.5)
    mask[1] = False
    coef = 0.01
    loss_fn = lk.KLPenaltyLoss("low_var_kl", coef=coef, agg="token-mean" if token_level_loss else "seq-mean-token-mean")
    _assert_same(
        lambda a, b: loss_fn(a, b, mask),
        lambda a, b: coef * openrlhf_aggregate_reference(openrlhf_reference(a, b, "k3"), mask, token_level_loss),
        lp, ref,
        rtol=1e-7,
    )  # fmt: skip


def test_adaptive_controllers_of_verl_and_openrlhf_are_ours() -> None:
    ctl = lk.AdaptiveKLController(init_kl_coef=0.01, target_kl=0.1, horizon=10000)
    want = 0.01
    # clipped up, clipped down, zero error, inside the clip both ways
    for current_kl, n in [(0.3, 512), (0.05, 512), (0.1, 256), (0.11, 2048), (0.095, 1024), (1e-4, 64)]:
        ctl.update(current_kl, n_steps=n)
        want = verl_adaptive_reference(want, current_kl, n, 0.1, 10000)
        assert ctl.value == pytest.approx(want, rel=1e-14)


# =================================================================================================
# NeMo-RL (NVIDIA-NeMo/RL 7ea279ab): algorithms/utils.calculate_kl, loss_functions.ClippedPGLossFn


def nemo_reference(
    lp: Tensor, ref: Tensor, kl_type: str = "k3", input_clamp: Optional[float] = 20.0,
    output_clamp: Optional[float] = 10.0, weight: Optional[Tensor] = None,
) -> Tensor:  # fmt: skip
    """``calculate_kl``: logr = ref - logprob, input clamp (detaching the weight where it bites),
    the estimator, times the weight, then the output clamp."""
    logr = ref - lp
    if input_clamp is not None:
        clamped = logr.clamp(-input_clamp, input_clamp)
        if weight is not None:
            weight = torch.where(logr == clamped, weight, weight.detach())
        logr = clamped
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr * logr / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise AssertionError(kl_type)
    if weight is not None:
        kl = weight * kl
    return kl if output_clamp is None else kl.clamp(-output_clamp, output_clamp)


def _on_policy_weight(lp: Tensor) -> Tensor:
    return torch.exp(lp - lp.detach())  # value 1, gradient: the score of the sampled token


def test_nemo_default_kl_is_our_low_var_kl_with_old_logprob_detached_where_k3_is_below_10() -> None:
    lp, ref = _pair(D)
    below = _k3(D) < 10 - 1e-9
    ours = _ours_detached("low_var_kl")
    theirs = lambda a, b: nemo_reference(a, b, weight=_on_policy_weight(a))  # noqa: E731
    _assert_same(ours, theirs, lp, ref, below, WEIGHTED_K3_RTOL)
    # where k3 > 10 NeMo clamps the weighted value: gradient 0; ours clamps k3 and keeps the weight's
    # gradient 10 * grad log pi
    lp, ref = _pair(torch.tensor([-3.0], dtype=torch.float64))
    assert _value_and_grads(theirs, lp, ref)[1].item() == 0.0
    assert _value_and_grads(ours, lp, ref)[1].item() == pytest.approx(10.0)
    # without the output clamp (kl_output_clamp_value: null): our k3, inside the input clamp
    lp, ref = _pair(D)
    inside = D.abs() < 20
    _assert_same(_ours_detached("k3"), lambda a, b: nemo_reference(a, b, output_clamp=None, weight=_on_policy_weight(a)), lp, ref, inside, WEIGHTED_K3_RTOL)
    # k1: our k1 with old_logprob detached, inside the output clamp
    inside = D.abs() < 10
    _assert_same(_ours_detached("k1"), lambda a, b: nemo_reference(a, b, "k1", weight=_on_policy_weight(a)), lp, ref, inside)


def test_nemo_before_its_weighted_kl_was_our_low_var_kl() -> None:
    # until 2026-06-24 the default weight was a constant 1: k3 with both clamps, as verl's low_var_kl
    lp, ref = _pair(D)
    _assert_same(_ours("low_var_kl"), lambda a, b: nemo_reference(a, b, weight=torch.ones_like(a)), lp, ref)


def _ours_detached(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda lp, ref: lk.kl_penalty(lp, ref, name, old_logprob=lp.detach())


def test_nemo_on_policy_kl_approximation_is_our_old_logprob() -> None:
    # use_on_policy_kl_approximation: weight exp(logprob - generation_logprobs), differentiable
    lp, ref = _pair(D)
    gen = (lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)).clamp(max=0)
    inside = D.abs() < 20
    _assert_same(
        lambda a, b: lk.kl_penalty(a, b, "k3", old_logprob=gen),
        lambda a, b: nemo_reference(a, b, output_clamp=None, weight=torch.exp(a - gen)),
        lp, ref, inside, WEIGHTED_K3_RTOL,
    )  # fmt: skip


class _Categorical:
    """The categorical policy of ``docs/estimators.md``'s gradient table (vocabulary 6, seed 0, KL 0.53)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.theta = torch.randn(6, generator=g, dtype=torch.float64).requires_grad_()
        self.ref = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)

    def relative_error(self, per_token: Callable[[Tensor, Tensor], Tensor]) -> float:
        """Exact expectation over the policy's own samples of the gradient of ``per_token``, against grad KL."""
        lp = torch.log_softmax(self.theta, 0)
        (exact,) = torch.autograd.grad((lp.exp() * (lp - self.ref)).sum(), self.theta)
        lp = torch.log_softmax(self.theta, 0)
        (got,) = torch.autograd.grad((lp.exp().detach() * per_token(lp, self.ref)).sum(), self.theta)
        return ((got - exact).norm() / exact.norm()).item()


def test_nemo_weighted_k2_is_biased_ours_is_not() -> None:
    pol = _Categorical()
    nemo = {name: pol.relative_error(lambda a, b, n=name: nemo_reference(a, b, n, weight=_on_policy_weight(a))) for name in ("k1", "k2", "k3")}
    assert nemo["k1"] < 1e-12 and nemo["k3"] < 1e-12
    assert nemo["k2"] == pytest.approx(0.196, abs=5e-4)  # the guide quotes this number
    assert pol.relative_error(lambda a, b: _k3(a - b)) == pytest.approx(0.50, abs=5e-3)  # estimators.md's k3
    assert pol.relative_error(_ours_detached("k2")) < 1e-12
    assert pol.relative_error(_ours("k2")) < 1e-12


def test_nemo_kl_in_reward_is_our_low_var_kl_callback() -> None:
    # use_kl_in_reward (Reinforce++): -kl_coef * calculate_kl(k3, clamps 20 / 10) at response tokens,
    # the reward added at the last response token, 0 elsewhere
    lp, ref, mask = _batch(spread=3.0)
    kl_coef = 0.01
    reward = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5], dtype=torch.float64)
    want = -kl_coef * nemo_reference(lp, ref)
    last = mask.shape[1] - 1 - mask.long().fliplr().argmax(dim=1)
    want[torch.arange(len(reward)), last] += reward
    want = want * mask
    callback = lk.KLRewardCallback("low_var_kl", lk.FixedKLController(kl_coef))
    rewards, _, _ = callback.shape_rewards({"scores": reward, "logprobs": lp, "ref_logprobs": ref, "mask": mask})
    assert (_k3(lp - ref)[mask] > 10).any()  # the clamp bites somewhere in this batch
    assert_close(rewards, want, **TIGHT)


# =================================================================================================
# slime (THUDM/slime 624b824a): utils/ppo_utils.compute_approx_kl, --use-kl-loss, --use-unbiased-kl


def slime_reference(lp: Tensor, ref: Tensor, kl_loss_type: str, weight: Optional[Tensor] = None) -> Tensor:
    """k1, k2, k3 unclamped; low_var_kl is k3 clamped to +-10 after the optional IS weight."""
    r = lp - ref
    if kl_loss_type == "k1":
        kl = r
    elif kl_loss_type == "k2":
        kl = r * r / 2
    else:
        kl = torch.exp(-r) - 1 + r
    if weight is not None:
        kl = weight * kl
    return kl.clamp(-10.0, 10.0) if kl_loss_type == "low_var_kl" else kl


@pytest.mark.parametrize(("name", "limit"), [("k1", 1e9), ("k2", 1e9), ("k3", 20.0), ("low_var_kl", 1e9)])
def test_slime_names_are_ours(name: str, limit: float) -> None:
    lp, ref = _pair(D)
    _assert_same(_ours(name), lambda a, b: slime_reference(a, b, name), lp, ref, where=D.abs() < limit)


def test_slime_unbiased_kl_is_our_old_logprob_for_k1_and_k3_not_k2() -> None:
    lp, ref = _pair(D)
    old = (lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)).clamp(max=0)
    inside = D.abs() < 20
    for name in ("k1", "k3"):
        theirs = lambda a, b, n=name: slime_reference(a, b, n, torch.exp(a - old))  # noqa: E731
        _assert_same(_ours(name, old_logprob=old), theirs, lp, ref, inside, WEIGHTED_K3_RTOL)
    # k2: slime's weight is differentiable, ours is detached (the exact choice): the gradients differ
    ours = _value_and_grads(_ours("k2", old_logprob=old), lp, ref)
    theirs = _value_and_grads(lambda a, b: slime_reference(a, b, "k2", torch.exp(a - old)), lp, ref)
    assert_close(ours[0], theirs[0], **TIGHT)
    assert not torch.allclose(ours[1], theirs[1])


# =================================================================================================
# the guide itself


def test_every_constructor_in_the_guide_builds() -> None:
    text = GUIDE.read_text()
    spans = re.findall(r"`(lk\.[A-Za-z]+\(.*?\))`", text)
    assert len(spans) >= 15, spans  # the regex still finds the tables' constructors
    # the entropy rows name the other stacks' settings as variables: bound here to their defaults
    stacks = {"entropy_coef": 0.01, "entropy_coeff": 0.001, "entropy_target": 0.2, "entropy_coef_delta": 0.005,
              "entropy_coef_min": 0.0, "entropy_coef_max": 1.0}  # fmt: skip
    for span in spans:
        eval(span, {"lk": lk, **stacks})  # a renamed argument or estimator fails here


def test_the_guide_names_the_commits_it_read() -> None:
    text = GUIDE.read_text()
    for commit in ("b178a3cd", "f2cd5771", "3c3be623", "7ea279ab", "624b824a"):
        assert commit in text


def _load_minimal() -> Any:
    spec = importlib.util.spec_from_file_location("lk_examples_minimal_migration", ROOT / "examples" / "minimal.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # jsonargparse finds classes by module name
    spec.loader.exec_module(module)
    return module


def test_the_guides_yaml_trains_with_verls_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (block,) = re.findall(r"```yaml\n(.*?)```", GUIDE.read_text(), flags=re.S)
    guide = yaml.safe_load(block)
    config = yaml.safe_load((ROOT / "examples" / "configs" / "minimal.yaml").read_text())
    config["model"].update(guide["model"], num_batches=2)
    config["trainer"].update(guide["trainer"], default_root_dir=str(tmp_path), logger=False,
                             enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(config))
    minimal = _load_minimal()
    monkeypatch.setattr(sys, "argv", ["minimal.py"])
    cli = LightningCLI(minimal.KLBandit, args=["fit", "--config", str(path)])
    assert (cli.model.kl.estimator, cli.model.kl.coef, cli.model.kl.agg) == ("low_var_kl", 0.001, "token-mean")
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, lk.KLRewardCallback)]
    ctl = callback.controller
    assert (callback.estimator, type(ctl), ctl.target_kl, ctl.horizon) == ("k1", lk.AdaptiveKLController, 0.1, 10000)
    assert cli.trainer.global_step == 2 and ctl.value != 0.001  # trained, and the controller moved


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_kl_loss_is_verl_091s_own_agg_loss_and_its_sum_norm_divides_by_the_sequences(mode: str) -> None:
    # verl 0.9.1's agg_loss, run as it is (one process): three modes are ours by name; its
    # seq-mean-token-sum-norm also divides by the sequences, (sum_i S_i) / B / loss_scale_factor, which is
    # agg="seq-mean-token-sum" with coef / loss_scale_factor here (docs/migration.md), not our mode of that name
    from _verl_losses import load_verl_losses

    agg_loss = load_verl_losses()["agg_loss"]
    lp, ref, mask = _batch()
    mask[2] = False  # a fully masked sequence: out of every seq mean, and of verl's global_batch_size
    mat = verl_reference(lp, ref, "low_var_kl")
    for scale in (None, 3.0):
        theirs = agg_loss(mat, mask.to(mat.dtype), mode, loss_scale_factor=scale)
        if mode != "seq-mean-token-sum-norm":
            assert_close(lk.KLPenaltyLoss("low_var_kl", coef=1.0, agg=mode)(lp, ref, mask), theirs,
                         rtol=2e-8 if mode == "seq-mean-token-mean" else 1e-12, atol=0.0)  # fmt: skip
            continue
        norm = mask.shape[-1] if scale is None else scale
        mapped = lk.KLPenaltyLoss("low_var_kl", coef=1.0 / norm, agg="seq-mean-token-sum")(lp, ref, mask)
        assert_close(mapped, theirs, rtol=1e-12, atol=0.0)
        ours = lk.KLPenaltyLoss("low_var_kl", coef=1.0, agg=mode, agg_norm=scale)(lp, ref, mask)
        sequences = int(mask.any(-1).sum())
        assert_close(ours / sequences, theirs, rtol=1e-12, atol=0.0)  # the older verl's sum-norm: no / B
