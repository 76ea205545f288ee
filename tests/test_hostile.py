"""Junk padding, NaN on valid tokens, inputs that do not fit, half precision, extreme log-ratios.

Every sampled-token estimator name goes through ``kl_penalty``, ``KLPenaltyLoss`` (every aggregation
mode), ``KLMetric`` and ``KLRewardCallback``. Junk at padded positions must leave values, rewards and
gradients *bitwise* equal to those of the same batch with clean padding.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

import _reference as reference
import lightning_kl as lk
from lightning_kl.functional import AGG_MODES
from lightning_kl.estimators import SAMPLED_ESTIMATORS

# gradients toward the reference are checked here on purpose: its warning is expected
pytestmark = pytest.mark.filterwarnings("ignore:`ref_[a-z]*` requires grad")

SAMPLED = SAMPLED_ESTIMATORS
JUNK = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf"), "-1e10": -1e10}
B, T = 4, 7


def batch(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([[7], [4], [1], [5]])
    mask = torch.arange(T).expand(B, T) < lengths
    logprob = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    return {
        "logprob": logprob.to(dtype),
        "ref_logprob": (logprob - 2 * torch.rand(B, T, generator=g, dtype=torch.float64) + 1).to(dtype),
        "old_logprob": (logprob + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).to(dtype),
        "scores": torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype),
        "mask": mask,
    }


def with_junk(x: Tensor, mask: Tensor, junk: float) -> Tensor:
    return torch.where(mask, x, torch.full_like(x, junk))


def loss_and_grads(
    name: str, agg: str, logprob: Tensor, ref: Tensor, mask: Tensor, old: Optional[Tensor] = None
) -> tuple[Tensor, Tensor, Tensor]:
    logprob = logprob.clone().requires_grad_(True)
    ref = ref.clone().requires_grad_(True)
    loss = lk.KLPenaltyLoss(name, coef=0.7, agg=agg)(logprob, ref, mask, old)
    loss.backward()
    assert logprob.grad is not None and ref.grad is not None
    return loss.detach(), logprob.grad, ref.grad


# ---------------------------------------------------------------------------------------------
# junk at padded positions


@pytest.mark.parametrize("junk", list(JUNK), ids=list(JUNK))
@pytest.mark.parametrize("name", SAMPLED)
def test_junk_padding_changes_nothing(name: str, junk: str) -> None:
    b = batch()
    m, j = b["mask"], JUNK[junk]
    clean_lp, clean_ref, clean_old = (torch.where(m, b[k], 0.0) for k in ("logprob", "ref_logprob", "old_logprob"))
    dirty = {k: with_junk(b[k], m, j) for k in ("logprob", "ref_logprob", "old_logprob")}

    for old_key in (None, "old_logprob"):
        old_clean = None if old_key is None else clean_old
        old_dirty = None if old_key is None else dirty["old_logprob"]
        expected = lk.kl_penalty(clean_lp, clean_ref, name, mask=m, old_logprob=old_clean)
        for lp, ref in ((dirty["logprob"], clean_ref), (clean_lp, dirty["ref_logprob"]), (dirty["logprob"], dirty["ref_logprob"])):
            assert torch.equal(lk.kl_penalty(lp, ref, name, mask=m, old_logprob=old_dirty), expected)
            for agg in AGG_MODES:
                want = loss_and_grads(name, agg, clean_lp, clean_ref, m, old_clean)
                got = loss_and_grads(name, agg, lp, ref, m, old_dirty)
                assert torch.isfinite(got[0]) and torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()
                for g, w in zip(got, want):
                    assert torch.equal(g, w), (agg, old_key)

    # the reward callback and the metric see the same
    clean_batch = {"scores": b["scores"], "logprobs": clean_lp, "ref_logprobs": clean_ref, "mask": m}
    dirty_batch = {**clean_batch, "logprobs": dirty["logprob"], "ref_logprobs": dirty["ref_logprob"]}
    cb = lk.KLRewardCallback(name, lk.FixedKLController(0.3))
    for got, want in zip(cb.shape_rewards(dirty_batch), cb.shape_rewards(clean_batch)):
        assert torch.equal(got, want)
    values = lk.kl_penalty(dirty["logprob"], dirty["ref_logprob"], name, mask=m)
    m1, m2 = lk.KLMetric(), lk.KLMetric()
    m1.update(with_junk(values, m, j), m)
    m2.update(lk.kl_penalty(clean_lp, clean_ref, name, mask=m), m)
    assert torch.equal(m1.compute(), m2.compute())


@pytest.mark.parametrize("name", SAMPLED)
def test_fully_padded_batch_gives_zero_and_zero_gradients(name: str) -> None:
    b = batch()
    none = torch.zeros_like(b["mask"])
    lp, ref, old = (with_junk(b[k], none, float("nan")) for k in ("logprob", "ref_logprob", "old_logprob"))
    for agg in AGG_MODES:
        for o in (None, old):
            loss, g_lp, g_ref = loss_and_grads(name, agg, lp, ref, none, o)
            assert loss.item() == 0.0 and torch.equal(g_lp, torch.zeros_like(g_lp)) and torch.equal(g_ref, torch.zeros_like(g_ref))
    cb = lk.KLRewardCallback(name, lk.AdaptiveKLController(0.2, target_kl=1.0, horizon=10))
    scores = b["scores"]
    rewards, kl_sum, n = cb.shape_rewards({"scores": scores, "logprobs": lp, "ref_logprobs": ref, "mask": none})
    assert torch.equal(rewards, scores) and kl_sum.item() == 0 and n.item() == 0
    assert cb.update_controller(kl_sum.item(), n.item()) is None and cb.controller.value == 0.2  # no update
    metric = lk.KLMetric()
    metric.update(lp, none)
    assert torch.isnan(metric.compute())  # no data: NaN, as the callback logs, not a KL of 0


# ---------------------------------------------------------------------------------------------
# NaN on a valid token: propagated, never dropped; anomaly detection and the controller catch it


@pytest.mark.parametrize("name", SAMPLED)
@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled", "ignore:Error detected in")  # asked for
def test_nan_on_a_valid_token_propagates_to_loss_and_gradients(name: str) -> None:
    b = batch()
    for key in ("logprob", "ref_logprob"):
        poisoned = dict(b)
        poisoned[key] = b[key].clone()
        poisoned[key][1, 2] = float("nan")  # row 1 has 4 valid tokens: position 2 is valid
        values = lk.kl_penalty(poisoned["logprob"], poisoned["ref_logprob"], name, mask=b["mask"])
        assert values[1, 2].isnan() and torch.isfinite(values[~values.isnan()]).all()
        for agg in AGG_MODES:
            loss, g_lp, g_ref = loss_and_grads(name, agg, poisoned["logprob"], poisoned["ref_logprob"], b["mask"])
            assert loss.isnan(), (key, agg)
            # the gradient of every other valid token is NaN: a NaN loss cannot train on quietly,
            # whatever the estimator (the poisoned token's own may be 0: clamp's gradient ignores a
            # NaN); padding still gets exactly 0
            m, others = b["mask"], b["mask"].clone()
            others[1, 2] = False
            assert g_lp[others].isnan().all() and g_ref[others].isnan().all(), (key, agg)
            assert not g_lp[~m].any() and not g_ref[~m].any()
            lp = poisoned["logprob"].clone().requires_grad_(True)
            with pytest.raises(RuntimeError, match="returned nan values"), torch.autograd.detect_anomaly():
                lk.KLPenaltyLoss(name, agg=agg)(lp, poisoned["ref_logprob"], b["mask"]).backward()
        metric = lk.KLMetric()
        metric.update(values, b["mask"])
        assert metric.compute().isnan()


class PolicyModule(pl.LightningModule):
    """A policy whose logprobs come from logits; the reference logprobs are data (may hold NaN)."""

    def __init__(self, estimator: str, nan_at: Optional[tuple[int, int]]) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(B, T, 5))
        self.kl = lk.KLPenaltyLoss(estimator, coef=0.1)
        self.nan_at = nan_at

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        b = batch()
        tokens = torch.randint(0, 5, (B, T), generator=g)
        ref = b["ref_logprob"].clone()
        if self.nan_at is not None:
            ref[self.nan_at] = float("nan")
        data = {"tokens": tokens, "ref_logprobs": ref, "mask": b["mask"], "logprobs": b["logprob"], "scores": b["scores"]}
        return torch.utils.data.DataLoader([data], batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logprob = self.logits.log_softmax(-1).gather(-1, batch["tokens"].unsqueeze(-1)).squeeze(-1)
        return self.kl(logprob, batch["ref_logprobs"], batch["mask"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled", "ignore:Error detected in")  # asked for
@pytest.mark.parametrize("name", ["k1", "abs", "k3", "low_var_kl", "k3+"])
def test_lightning_detect_anomaly_catches_a_nan_reference_logprob(name: str, quiet_trainer: Any) -> None:
    # the gradients of k1 (1), abs (sign(nan) = 0) and the clamped k3 / low_var_kl (0) ignore a NaN:
    # only the loss's NaN-propagating scale brings it into backward, where anomaly mode sees it
    quiet_trainer(fast_dev_run=True, detect_anomaly=True).fit(PolicyModule(name, nan_at=None))  # clean: trains
    with pytest.raises(RuntimeError, match="returned nan values"):
        quiet_trainer(fast_dev_run=True, detect_anomaly=True).fit(PolicyModule(name, nan_at=(0, 3)))


def test_callback_controller_raises_on_a_nan_valid_token(quiet_trainer: Any) -> None:
    module = PolicyModule("k1", nan_at=None)
    cb = lk.KLRewardCallback("k1", lk.AdaptiveKLController(0.2, target_kl=1.0, horizon=10), ref_logprobs_key="ref_logprobs")

    class Poison(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            batch["ref_logprobs"] = batch["ref_logprobs"].clone()
            batch["ref_logprobs"][2, 0] = float("nan")  # row 2's only valid token

    with pytest.raises(ValueError, match="non-finite KL.*not changed"):
        quiet_trainer(fast_dev_run=True, callbacks=[Poison(), cb]).fit(module)
    assert cb.controller.value == 0.2
    with pytest.raises(ValueError, match="non-finite KL"):
        lk.AdaptiveKLController().update(float("inf"), n_steps=4)
    with pytest.raises(ValueError, match="non-finite KL"):
        lk.FixedKLController().update(float("nan"), n_steps=4)


# ---------------------------------------------------------------------------------------------
# inputs that do not fit: errors name what was given


def test_shapes_dtypes_and_masks_that_do_not_fit() -> None:
    lp, ref = torch.zeros(2, 3), torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"logprob \(2, 3\) and ref_logprob \(2, 4\)"):
        lk.kl_penalty(lp, ref, "k1")
    with pytest.raises(ValueError, match=r"logprob \(2, 3\) and ref_logprob \(2, 4\)"):
        lk.KLPenaltyLoss("k3+")(lp, ref)
    with pytest.raises(ValueError, match=r"mask \(2, 4\) and logprob \(2, 3\)"):
        lk.kl_penalty(lp, lp, "k1", mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask \(3,\) and logprob \(2, 3\)"):
        lk.KLPenaltyLoss("k2")(lp, lp, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"old_logprob \(2,\) and logprob \(2, 3\)"):
        lk.kl_penalty(lp, lp, "k1", old_logprob=torch.zeros(2))
    with pytest.raises(TypeError, match="`logprob`.*torch.int64"):
        lk.kl_penalty(torch.zeros(2, 3, dtype=torch.int64), lp, "k1")
    with pytest.raises(TypeError, match="`ref_logprob`.*list"):
        lk.kl_penalty(lp, [[0.0] * 3] * 2, "k1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`mask`.*list"):
        lk.aggregate(lp, [[True] * 3] * 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"mask \(2, 1\) and values \(2, 3\)"):
        lk.aggregate(lp, torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="got a scalar"):
        lk.aggregate(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"mask \(2, 2\) and values \(2, 3\)"):
        lk.KLMetric().update(lp, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="`values`.*torch.bool"):
        lk.KLMetric().update(torch.ones(2, 3, dtype=torch.bool))


def test_callback_names_a_missing_key_and_a_bad_shape() -> None:
    b = batch()
    good = {"scores": b["scores"], "logprobs": b["logprob"], "ref_logprobs": b["ref_logprob"], "mask": b["mask"]}
    cb = lk.KLRewardCallback("k1")
    for key in good:
        broken = {k: v for k, v in good.items() if k != key}
        with pytest.raises(KeyError, match=f"no key '{key}'.*Keys in the batch"):
            cb.shape_rewards(broken)
    renamed = lk.KLRewardCallback("k1", ref_logprobs_key="ref_lp")
    with pytest.raises(KeyError, match="no key 'ref_lp'"):
        renamed.shape_rewards(good)
    with pytest.raises(ValueError, match=r"`scores` must be per token.*\(4, 7\).*per sequence \(4,\); got \(4, 3\)"):
        cb.shape_rewards({**good, "scores": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match=r"mask \(4, 6\) and logprobs \(4, 7\)"):
        cb.shape_rewards({**good, "mask": b["mask"][:, :6]})
    with pytest.raises(TypeError, match="mutable mapping.*tuple"):
        cb.shape_rewards(tuple(good.values()))


def test_controllers_and_parts_reject_nonsense_at_construction() -> None:
    bad_adaptive = [
        ({"horizon": 0}, "horizon.*> 0, got 0"),
        ({"horizon": -5}, "horizon.*got -5"),
        ({"target_kl": 0.0}, "target_kl.*> 0, got 0.0"),
        ({"target_kl": -1.0}, "target_kl.*got -1.0"),
        ({"init_kl_coef": -0.1}, "init_kl_coef.*got -0.1"),
        ({"init_kl_coef": 0.0}, "init_kl_coef.*got 0.0"),
        ({"init_kl_coef": float("nan")}, "init_kl_coef.*finite.*nan"),
        ({"horizon": float("inf")}, "horizon.*finite.*inf"),
        ({"target_kl": "6"}, "target_kl.*'6'"),
        ({"horizon": True}, "horizon.*True"),
    ]
    for kwargs, match in bad_adaptive:
        with pytest.raises(ValueError, match=match):
            lk.AdaptiveKLController(**kwargs)
    for coef, match in ((-0.001, ">= 0, got -0.001"), (float("nan"), "finite.*nan"), ("0.1", "'0.1'")):
        with pytest.raises(ValueError, match=match):
            lk.FixedKLController(kl_coef=coef)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="coef"):
            lk.KLPenaltyLoss(coef=coef)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="controller.*str"):
        lk.KLRewardCallback(controller="adaptive")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# half precision keeps float32 accuracy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", SAMPLED)
def test_half_precision_inputs_are_computed_in_float32(name: str, dtype: torch.dtype) -> None:
    b = batch(seed=5, dtype=dtype)
    as32 = {k: v.float() if v.is_floating_point() else v for k, v in b.items()}
    for agg in AGG_MODES:
        loss_h, g_lp_h, g_ref_h = loss_and_grads(name, agg, b["logprob"], b["ref_logprob"], b["mask"])
        loss_f, g_lp_f, g_ref_f = loss_and_grads(name, agg, as32["logprob"], as32["ref_logprob"], as32["mask"])
        assert loss_h.dtype == torch.float32
        assert torch.equal(loss_h, loss_f)  # the same float32 maths on the same values
        assert g_lp_h.dtype == dtype and torch.equal(g_lp_h, g_lp_f.to(dtype))
        assert torch.equal(g_ref_h, g_ref_f.to(dtype))
        # and float32 accuracy against float64 maths of the half values, from the formulas
        d = torch.where(b["mask"], b["logprob"].double() - b["ref_logprob"].double(), 0.0)
        w = 0.7 * reference.weights(b["mask"], agg)
        assert_close(loss_h.double(), (w * reference.value(name, d)).sum(), rtol=2e-6, atol=1e-7)
        want_grad = w * reference.grad(name, d)
        # float32 maths rounded to the half dtype: within one of its rounding steps
        eps = torch.finfo(dtype).eps
        assert_close(g_lp_h.double(), want_grad, rtol=eps, atol=1e-12)
        assert_close(g_ref_h.double(), -want_grad, rtol=eps, atol=1e-12)
    cb = lk.KLRewardCallback(name, lk.FixedKLController(0.3))
    half = {"scores": b["scores"], "logprobs": b["logprob"], "ref_logprobs": b["ref_logprob"], "mask": b["mask"]}
    full = {"scores": as32["scores"], "logprobs": as32["logprob"], "ref_logprobs": as32["ref_logprob"], "mask": b["mask"]}
    rewards_h, kl_sum_h, _ = cb.shape_rewards(half)
    rewards_f, kl_sum_f, _ = cb.shape_rewards(full)
    assert rewards_h.dtype == torch.float32 and torch.equal(rewards_h, rewards_f) and torch.equal(kl_sum_h, kl_sum_f)
    m_h, m_f = lk.KLMetric(), lk.KLMetric()
    m_h.update(lk.kl_penalty(b["logprob"], b["ref_logprob"], name, mask=b["mask"]), b["mask"])
    m_f.update(lk.kl_penalty(as32["logprob"], as32["ref_logprob"], name, mask=b["mask"]).to(dtype), b["mask"])
    assert torch.equal(m_h.compute(), m_f.compute())


# ---------------------------------------------------------------------------------------------
# extreme log-ratios: finite everywhere, each clamp as documented

EXTREME = [300.0, -300.0, 1e4, -1e4, 20.5, -20.5, 19.5, -19.5, 12.0, -3.0, 5.0, -2.0]


def _k3(d: float) -> float:
    c = min(max(d, -20.0), 20.0)
    return math.expm1(-c) + c


@pytest.mark.parametrize("name", SAMPLED)
def test_extreme_log_ratios_give_finite_values_and_gradients(name: str) -> None:
    d = torch.tensor(EXTREME, dtype=torch.float32)
    ref = -0.5 - d.clamp(min=0)  # log-probs: both <= 0
    lp = (ref + d).requires_grad_(True)
    values = lk.kl_penalty(lp, ref, name)
    values.sum().backward()
    assert torch.isfinite(values).all() and torch.isfinite(lp.grad).all()
    for agg in AGG_MODES:
        loss, g_lp, g_ref = loss_and_grads(name, agg, (ref + d).reshape(2, 6), ref.reshape(2, 6), None)
        assert torch.isfinite(loss) and torch.isfinite(g_lp).all() and torch.isfinite(g_ref).all()

    dd = [float(x) for x in (lp.detach() - ref).tolist()]  # the log-ratios as float32 represents them
    base = {"kl": "k1", "mse": "k2"}.get(name.rstrip("+"), name.rstrip("+"))
    if name.endswith("+"):
        # straight-through: the k2 gradient d, even where the base value is clamped
        assert lp.grad.tolist() == pytest.approx(dd, rel=1e-6)
    if base == "k3":
        # k3 of d clamped to [-20, 20]; its gradient 1 - exp(-d) inside, 0 outside
        assert values.tolist() == pytest.approx([_k3(x) for x in dd], rel=1e-6)
        if not name.endswith("+"):
            want = [-math.expm1(-x) if abs(x) <= 20 else 0.0 for x in dd]
            assert lp.grad.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    if base == "low_var_kl":
        # k3's value clamped to 10 (k3 >= 0, so the lower clamp never acts); gradient 0 where clamped
        assert values.tolist() == pytest.approx([min(_k3(x), 10.0) for x in dd], rel=1e-6)
        assert max(values.tolist()) == 10.0 and sum(v == 10.0 for v in values.tolist()) >= 4
        if not name.endswith("+"):
            want = [-math.expm1(-x) if abs(x) <= 20 and _k3(x) < 10 else 0.0 for x in dd]
            assert lp.grad.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    if base in ("k1", "abs", "k2") and not name.endswith("+"):
        want_v = {"k1": dd, "abs": [abs(x) for x in dd], "k2": [x * x / 2 for x in dd]}[base]
        want_g = {"k1": [1.0] * len(dd), "abs": [math.copysign(1.0, x) for x in dd], "k2": dd}[base]
        assert values.tolist() == pytest.approx(want_v, rel=1e-6)
        assert lp.grad.tolist() == pytest.approx(want_g, rel=1e-6)
