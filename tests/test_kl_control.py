"""KL control in the loss: ``KLPenaltyLoss(coef=controller)``.

The controllers' update rules against their formulas (float64), their edges (a KL exactly at the
target, the bounds, the schedule's corners) and bad arguments; then real Lightning loops: the
coefficient moves once per optimizer step under ``accumulate_grad_batches=2`` and follows the rule
from the step's KL computed here from the formula; a resumed run continues the uninterrupted one bit
for bit; a YAML file names the controller by ``class_path``; one controller shared by two users is
refused. The 2-process DDP run is ``tests/_kl_control_worker.py``.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.functional import AGG_MODES
from _ddp import run_ddp_worker
from _trainers import make_quiet_trainer

WORKER = Path(__file__).with_name("_kl_control_worker.py")

# ---------------------------------------------------------------------------------------------
# the update rules, from the formulas


def target_rule(beta: float, kl: float, target: float, eta: float, lo: float, hi: float) -> float:
    """log beta <- clip(log beta + eta clip(kl / target - 1, -1, 1), log lo, log hi), in float64."""
    error = min(max(kl / target - 1.0, -1.0), 1.0)
    return min(max(math.exp(math.log(beta) + eta * error), lo), hi)


def adaptive_rule(beta: float, kl: float, target: float, n: float, horizon: float) -> float:
    return beta * (1.0 + min(max(kl / target - 1.0, -0.2), 0.2) * n / horizon)


def scale_rule(step: int, kind: str, warmup: int, total: Optional[int], final: float) -> float:
    if step < warmup:
        return step / warmup
    if kind == "constant":
        return 1.0
    p = min(1.0, (step - warmup) / (total - warmup))
    shape = 1.0 - p if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return final + (1.0 - final) * shape


def test_target_controller_follows_dual_ascent_on_log_beta():
    ctl = lk.TargetKLController(target_kl=0.5, init_kl_coef=0.1, step_size=0.3, min_kl_coef=0.02, max_kl_coef=0.4)
    beta = 0.1
    for kl in (0.9, 0.5, 0.2, 3.0, 4.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.4, 0.7):
        ctl.update(kl, n_steps=3)
        beta = target_rule(beta, kl, 0.5, 0.3, 0.02, 0.4)
        assert ctl.value == pytest.approx(beta, rel=1e-14, abs=0)
    # the same rule on tensors, on the device, with no host read until `value`
    dev = lk.TargetKLController(target_kl=0.5, init_kl_coef=0.1, step_size=0.3, min_kl_coef=0.02, max_kl_coef=0.4)
    for kl in (0.9, 0.5, 0.2, 3.0):
        dev.update(torch.tensor(kl, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64))
    host = lk.TargetKLController(target_kl=0.5, init_kl_coef=0.1, step_size=0.3, min_kl_coef=0.02, max_kl_coef=0.4)
    for kl in (0.9, 0.5, 0.2, 3.0):
        host.update(kl, n_steps=3)
    assert dev.value == host.value  # bitwise by construction: one exp for both paths (the next test)


def test_the_float_and_tensor_paths_share_one_exp_and_agree_bitwise_on_any_input():
    # math.exp and torch.exp disagree by an ulp on some inputs (here 1 in 200; on an AVX-512 CPU 1 in 20):
    # the float path runs torch's exp on a float64 CPU tensor, so both paths give the same bits on any CPU
    from lightning_kl.controllers import adaptive_kl_factor, target_kl_factor

    kls = (torch.rand(400, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2.0).tolist()
    for kl in kls:
        assert target_kl_factor(kl, 1.0, 0.37) == float(target_kl_factor(torch.tensor(kl, dtype=torch.float64), 1.0, 0.37))
        n = torch.tensor(7.0, dtype=torch.float64)
        assert adaptive_kl_factor(kl, 1.0, 7, 100.0) == float(adaptive_kl_factor(torch.tensor(kl, dtype=torch.float64), 1.0, n, 100.0))
    for make in (
        lambda: lk.TargetKLController(target_kl=1.0, init_kl_coef=0.1, step_size=0.013, min_kl_coef=1e-9, max_kl_coef=1e9),
        lambda: lk.AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=1000),
        lambda: lk.KLSchedule(lk.TargetKLController(1.0, 0.1, 0.013, 1e-9, 1e9), kind="linear", warmup_steps=3, total_steps=300),
    ):
        host, dev = make(), make()
        for kl in kls:
            host.update(kl, n_steps=7)
            dev.update(torch.tensor(kl, dtype=torch.float64), torch.tensor(7.0, dtype=torch.float64))
            assert float(dev.value_tensor()) == host.value, type(host).__name__


def test_target_controller_edges_at_the_target_and_at_the_bounds():
    ctl = lk.TargetKLController(target_kl=2.0, init_kl_coef=0.25, step_size=0.7)
    ctl.update(2.0, n_steps=1)  # exactly at the budget: exp(0) = 1, unchanged bit for bit
    assert ctl.value == 0.25
    top = lk.TargetKLController(target_kl=1.0, init_kl_coef=0.5, step_size=1.0, min_kl_coef=0.1, max_kl_coef=0.5)
    top.update(1.0 + 1e-9, n_steps=1)  # above the budget at the upper bound: stays exactly there
    assert top.value == 0.5
    top.update(1e6, n_steps=1)  # a huge KL: no overflow, the bound
    assert top.value == 0.5
    top.update(-1e6, n_steps=1)  # a hugely negative k1 estimate counts as a KL of 0: log beta -= 1
    assert top.value == pytest.approx(0.5 / math.e, rel=1e-15)
    top.update(0.0, n_steps=1)  # 0.5 / e^2 < 0.1: the lower bound, exactly
    assert top.value == 0.1
    # the clip of the relative error: twice the budget and fifty times it move alike, by exactly eta
    a = lk.TargetKLController(target_kl=0.5, init_kl_coef=0.2, step_size=0.3)
    b = lk.TargetKLController(target_kl=0.5, init_kl_coef=0.2, step_size=0.3)
    a.update(1.0, n_steps=1)
    b.update(25.0, n_steps=1)
    assert a.value == b.value == 0.2 * math.exp(0.3)
    c = lk.TargetKLController(target_kl=0.5, init_kl_coef=0.2, step_size=0.3)
    c.update(0.999, n_steps=1)  # just inside the clip: less than eta
    assert c.value < a.value
    low = lk.TargetKLController(target_kl=1.0, init_kl_coef=0.1, step_size=1.0, min_kl_coef=0.1, max_kl_coef=0.5)
    low.update(0.0, n_steps=5)
    assert low.value == 0.1
    # a tensor batch with no sequence changes nothing; a non-finite KL is refused, the value kept
    low.update(torch.tensor(float("nan"), dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    assert low.value == 0.1
    low.update(torch.tensor(float("nan"), dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="non-finite KL"):
        _ = low.value
    assert low.value == 0.1
    with pytest.raises(ValueError, match="non-finite KL"):
        low.update(float("inf"), n_steps=1)


def test_adaptive_controller_at_the_target_and_at_the_clip():
    ctl = lk.AdaptiveKLController(init_kl_coef=0.3, target_kl=1.5, horizon=100)
    ctl.update(1.5, n_steps=10)
    assert ctl.value == 0.3
    ctl.update(1.5 * 1.2, n_steps=10)  # exactly at the clip (+0.2)
    assert ctl.value == pytest.approx(0.3 * (1 + 0.2 * 0.1), rel=1e-14)


@pytest.mark.parametrize(
    "kind, warmup, total, final",
    [("constant", 3, None, 0.0), ("linear", 2, 6, 0.1), ("cosine", 0, 4, 0.0), ("linear", 0, 1, 2.0), ("cosine", 2, 3, 0.5)],
)
def test_schedule_scale_from_the_formula(kind, warmup, total, final):
    sched = lk.KLSchedule(0.2, kind=kind, warmup_steps=warmup, total_steps=total, final_scale=final)
    for step in range(10):
        assert sched.step == step
        assert sched.value == pytest.approx(0.2 * scale_rule(step, kind, warmup, total, final), rel=1e-15, abs=1e-18)
        sched.update(0.3, n_steps=2)
    # the corners, exactly
    assert lk.KLSchedule(0.2, warmup_steps=4).value == 0.0
    at_end = lk.KLSchedule(0.2, kind="linear", warmup_steps=1, total_steps=3, final_scale=0.25)
    at_end.step = 1
    assert at_end.value == 0.2  # the end of the warm-up: the full coefficient
    at_end.step = 3
    assert at_end.value == 0.2 * 0.25
    at_end.step = 100
    assert at_end.value == 0.2 * 0.25


def test_schedule_composes_with_a_controller_and_keeps_its_state():
    inner = lk.TargetKLController(target_kl=1.0, init_kl_coef=0.1, step_size=0.5)
    sched = lk.KLSchedule(inner, kind="linear", warmup_steps=2, total_steps=4, final_scale=0.5)
    beta = 0.1
    for step, kl in enumerate((2.0, 0.5, 1.5, 1.0, 3.0)):
        assert sched.value == pytest.approx(beta * scale_rule(step, "linear", 2, 4, 0.5), rel=1e-14, abs=0)
        sched.update(torch.tensor(kl, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64))
        beta = target_rule(beta, kl, 1.0, 0.5, 1e-6, 100.0)
    assert inner.value == pytest.approx(beta, rel=1e-14)
    other = lk.KLSchedule(lk.TargetKLController(target_kl=1.0, init_kl_coef=0.7, step_size=0.5), kind="linear",
                          warmup_steps=2, total_steps=4, final_scale=0.5)
    other.load_state_dict(sched.state_dict())
    assert (other.step, other.value) == (sched.step, sched.value)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: lk.TargetKLController(target_kl=0.0), r"`target_kl` must be > 0, got 0\.0"),
        (lambda: lk.TargetKLController(target_kl=float("nan")), "`target_kl` must be a finite number"),
        (lambda: lk.TargetKLController(step_size=-0.1), r"`step_size` must be > 0, got -0\.1"),
        (lambda: lk.TargetKLController(min_kl_coef=0.0), "`min_kl_coef` must be > 0"),
        (lambda: lk.TargetKLController(min_kl_coef=0.5, max_kl_coef=0.1), r"`min_kl_coef` \(0\.5\) must be <= `max_kl_coef` \(0\.1\)"),
        (lambda: lk.TargetKLController(init_kl_coef=2.0, max_kl_coef=1.0), r"`init_kl_coef` must be within \[min_kl_coef, max_kl_coef\] = \[1e-06, 1\.0\], got 2\.0"),
        (lambda: lk.TargetKLController(init_kl_coef=True), "`init_kl_coef` must be a finite number, got True"),
        (lambda: lk.KLSchedule(0.1, kind="exp"), r"`kind` must be one of 'constant', 'linear', 'cosine', got 'exp'"),
        (lambda: lk.KLSchedule(0.1, kind="linear"), r"needs `total_steps` \(> warmup_steps=0\)"),
        (lambda: lk.KLSchedule(0.1, kind="cosine", warmup_steps=5, total_steps=5), r"`total_steps` must be an integer >= 6, got 5"),
        (lambda: lk.KLSchedule(0.1, warmup_steps=-1), r"`warmup_steps` must be an integer >= 0, got -1"),
        (lambda: lk.KLSchedule(0.1, warmup_steps=2.5), r"`warmup_steps` must be an integer >= 0, got 2\.5"),
        (lambda: lk.KLSchedule(0.1, total_steps=10), "kind='constant'.* takes no `total_steps`"),
        (lambda: lk.KLSchedule(0.1, kind="linear", total_steps=10, final_scale=-1.0), "`final_scale` must be >= 0"),
        (lambda: lk.KLSchedule(-0.1), "`controller` must be >= 0"),
        (lambda: lk.KLSchedule("0.1"), "`controller` must be a number >= 0 or a KLController, got '0.1'"),
        (lambda: lk.KLPenaltyLoss("k3+", coef="adaptive"), "`coef` must be a finite number >= 0 or a KLController.*got 'adaptive'"),
        (lambda: lk.KLPenaltyLoss("k3+", coef=-1.0), "`coef` must be a finite number >= 0 or a KLController"),
        (lambda: lk.KLPenaltyLoss("k3+", coef=lk.TargetKLController(target_kl=-1.0)), "`target_kl` must be > 0"),
    ],
)
def test_bad_controller_arguments_fail_at_construction(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# ---------------------------------------------------------------------------------------------
# the loss's statistics and its step, by hand


def _batch(seed: int, b: int = 4, t: int = 6, lengths: Optional[tuple[int, ...]] = None) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = lengths if lengths is not None else tuple(torch.randint(0, t + 1, (b,), generator=g).tolist())
    mask = torch.arange(t).expand(len(lengths), t) < torch.tensor(lengths)[:, None]
    logprob = -torch.rand(len(lengths), t, generator=g) * 3
    ref = (logprob - 0.3 * torch.randn(len(lengths), t, generator=g)).clamp(max=0.0)  # log-probs: <= 0
    return {"logprob": logprob, "ref": torch.where(mask, ref, float("nan")), "mask": mask}


def step_stats(batches: list[dict[str, Tensor]], agg: str, estimator: str = "k3") -> tuple[float, float, float]:
    """The KL the controller sees, in float64 from the formula: (sum, count, non-empty sequences)."""
    total = count = seqs = 0.0
    for b in batches:
        r = b["ref"].double() - b["logprob"].double()
        k = {"k3": torch.expm1(r) - r, "k1": -r}[estimator]
        for row, m in zip(k, b["mask"]):
            n = int(m.sum())
            if n == 0:
                continue
            s = float(row[m].sum())
            seqs += 1
            if agg == "token-mean":
                total, count = total + s, count + n
            elif agg == "seq-mean-token-mean":
                total, count = total + s / n, count + 1
            else:
                total, count = total + s, count + 1
    return total, count, seqs


@pytest.mark.parametrize("agg", AGG_MODES)
def test_update_coef_closes_the_step_from_its_micro_batches_in_the_units_of_agg(agg):
    ctl = lk.TargetKLController(target_kl=0.05, init_kl_coef=0.2, step_size=0.4)
    loss = lk.KLPenaltyLoss("k3+", coef=ctl, agg=agg)
    batches = [_batch(1, lengths=(6, 0, 2, 3)), _batch(2, lengths=(1, 5))]
    beta = 0.2
    for step in range(2):
        assert loss.coef == pytest.approx(beta, rel=1e-14)
        used = loss.coef
        for b in batches:
            plain = lk.KLPenaltyLoss("k3+", coef=used, agg=agg)(b["logprob"], b["ref"], b["mask"])
            assert torch.equal(loss(b["logprob"], b["ref"], b["mask"]), plain)  # the step's coefficient
        coef, kl = loss.update_coef()
        total, count, _ = step_stats(batches, agg)
        assert coef.dtype == torch.float64 and float(coef) == used
        assert_close(kl, torch.tensor(total / count, dtype=torch.float64), rtol=1e-6, atol=0)
        beta = target_rule(beta, float(kl), 0.05, 0.4, 1e-6, 100.0)
        assert loss.coef == pytest.approx(beta, rel=1e-14)
    # a step with no valid token anywhere: NaN, and the coefficient stays
    empty = _batch(3, lengths=(0, 0))
    loss(empty["logprob"], empty["ref"], empty["mask"])
    before = loss.coef
    coef, kl = loss.update_coef()
    assert math.isnan(float(kl)) and loss.coef == before
    assert loss.update_coef()[0] == before  # no forward at all: nothing changes either
    # a forward in eval mode (validation) adds nothing to the step
    loss.eval()
    b = batches[0]
    loss(b["logprob"], b["ref"], b["mask"])
    loss.train()
    assert math.isnan(float(loss.update_coef()[1])) and loss.coef == before
    # a number coef has no step to close
    assert lk.KLPenaltyLoss("k3+", coef=0.1).update_coef() is None


def test_the_adaptive_controller_counts_the_steps_non_empty_sequences():
    loss = lk.KLPenaltyLoss("k3+", coef=lk.AdaptiveKLController(0.1, target_kl=0.01, horizon=20), agg="seq-mean-token-sum")
    b = _batch(4, lengths=(3, 0, 6, 1, 2))
    loss(b["logprob"], b["ref"], b["mask"])
    _, kl = loss.update_coef()
    total, count, seqs = step_stats([b], "seq-mean-token-sum")
    assert seqs == 4
    assert loss.coef == pytest.approx(adaptive_rule(0.1, total / count, 0.01, seqs, 20), rel=1e-6)


def test_the_step_coefficient_is_not_changed_under_autograd():
    # update_coef before backward (outside Lightning, in the wrong order) must not corrupt the graph
    loss = lk.KLPenaltyLoss("k3+", coef=lk.TargetKLController(target_kl=0.01, init_kl_coef=0.5, step_size=1.0))
    b = _batch(5, lengths=(6, 6))
    lp = b["logprob"].clone().requires_grad_()
    value = loss(lp, b["ref"], b["mask"])
    loss.update_coef()
    assert loss.coef != 0.5
    value.backward()
    lp2 = b["logprob"].clone().requires_grad_()
    lk.KLPenaltyLoss("k3+", coef=0.5)(lp2, b["ref"], b["mask"]).backward()
    assert torch.equal(lp.grad, lp2.grad)  # the gradient of the coefficient the forward used


def test_state_dict_carries_the_controller_and_old_state_dicts_still_load():
    loss = lk.KLPenaltyLoss("k3+", coef=lk.KLSchedule(lk.TargetKLController(1.0, 0.3), warmup_steps=3))
    b = _batch(6)
    for _ in range(2):
        loss(b["logprob"], b["ref"], b["mask"])
        loss.update_coef()
    state = loss.state_dict()
    fresh = lk.KLPenaltyLoss("k3+", coef=lk.KLSchedule(lk.TargetKLController(1.0, 0.9), warmup_steps=3))
    fresh.load_state_dict(state)
    assert (fresh.controller.step, fresh.coef) == (2, loss.coef)
    # a state_dict from before (no entry) keeps the constructed coefficient, strict or not, with a warning
    with pytest.warns(UserWarning, match="holds no controller state .* has KLSchedule; keeping the coefficient"):
        fresh.load_state_dict({k: v for k, v in state.items() if not k.endswith("_extra_state")})
    number = lk.KLPenaltyLoss("k3+", coef=0.2)
    number.load_state_dict({})
    assert number.coef == 0.2
    with pytest.warns(UserWarning, match="holds the state of KLSchedule but this loss has a number coef"):
        number.load_state_dict(state)
    assert number.coef == 0.2


def test_a_number_coefs_state_dict_into_a_controller_warns_as_the_other_direction_does():
    # a number coef saves no controller state: loading it into a controller restarts the controller (a
    # schedule's warm-up too), which must not be silent, as a controller's state into a number coef is not
    number = lk.KLPenaltyLoss("k3+", coef=0.2)
    sched = lk.KLSchedule(lk.TargetKLController(1.0, 0.3), warmup_steps=3)
    sched.update(0.5, 4)
    controlled = lk.KLPenaltyLoss("k3+", coef=sched)
    with pytest.warns(UserWarning, match=r"no controller state .* has KLSchedule; .*restarts from step 0, its warm-up"):
        controlled.load_state_dict(number.state_dict())
    assert controlled.controller.step == 1  # as constructed (here: moved before the load)
    with pytest.warns(UserWarning, match="no controller state .* has TargetKLController; keeping the coefficient"):
        lk.KLPenaltyLoss("k3+", coef=lk.TargetKLController(1.0, 0.3)).load_state_dict(number.state_dict(), strict=False)
    with pytest.warns(UserWarning, match="holds the state of KLSchedule but this loss has a number coef"):
        number.load_state_dict(controlled.state_dict())
    bonus = lk.EntropyBonus(coef=lk.TargetEntropyController(0.5, init_coef=0.01))
    with pytest.warns(UserWarning, match="EntropyBonus: the state_dict holds no controller state .* this bonus has"):
        bonus.load_state_dict(lk.EntropyBonus(coef=0.01).state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lk.KLPenaltyLoss("k3+", coef=0.3).load_state_dict(number.state_dict())  # number into number: nothing to say


def test_a_schedules_state_of_another_controller_class_warns_and_keeps_its_controller():
    # as a plain controller of another class does (the module and the callback warn and keep theirs)
    saved = lk.KLSchedule(lk.AdaptiveKLController(init_kl_coef=0.5), warmup_steps=4)
    for _ in range(2):
        saved.update(3.0, 8)
    target = lk.KLSchedule(lk.TargetKLController(1.0, 0.02), warmup_steps=4)
    with pytest.warns(UserWarning, match="holds the state of a AdaptiveKLController but this schedule wraps a TargetKLController"):
        target.load_state_dict(saved.state_dict())
    assert target.controller.value == 0.02 and target.step == 2  # its own coefficient; the schedule's step
    loss = lk.KLPenaltyLoss("k3+", coef=lk.KLSchedule(lk.TargetKLController(1.0, 0.02), warmup_steps=4))
    with pytest.warns(UserWarning, match="this schedule wraps a TargetKLController"):
        loss.load_state_dict(lk.KLPenaltyLoss("k3+", coef=saved).state_dict())
    assert loss.controller.controller.value == 0.02
    same = lk.KLSchedule(lk.AdaptiveKLController(init_kl_coef=0.1), warmup_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(saved.state_dict())
    assert (same.step, same.controller.value) == (2, saved.controller.value)


# ---------------------------------------------------------------------------------------------
# real Lightning loops

STEPS, ACCUM = 5, 2
LENGTHS = ((6, 2, 0, 4), (1, 1, 3, 5), (6, 6, 6, 1), (2, 0, 0, 3), (5, 4, 3, 2), (1, 6, 2, 2))


def loop_batch(i: int) -> dict[str, Tensor]:
    return _batch(100 + i, lengths=LENGTHS[i % len(LENGTHS)])


def with_totals(batches: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    """Each micro-batch with its optimizer step's totals (``ACCUM`` micro-batches a step)."""
    out = []
    for i in range(0, len(batches), ACCUM):
        step = batches[i : i + ACCUM]
        totals = lk.step_totals([b["mask"] for b in step])
        out += [{**b, **totals} for b in step]
    return out


class Controlled(pl.LightningModule):
    """A policy of per-position offsets on fixed log-probs, a KL loss with a controller and a pull
    away from the reference; records the coefficient each micro-batch's forward used and the batch."""

    def __init__(self, coef: Union[float, lk.KLController] = 0.1, agg: str = "token-mean", estimator: str = "k3+") -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(6))
        self.kl = lk.KLPenaltyLoss(estimator, coef=coef, agg=agg)
        self.seen: list[tuple[int, float, dict[str, Tensor]]] = []

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(with_totals([loop_batch(i) for i in range(STEPS * ACCUM)]), batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logprob = (batch["logprob"] + self.shift).clamp(max=0.0)  # log-probs stay <= 0 as the pull raises them
        self.seen.append((self.trainer.global_step, self.kl.coef, {**batch, "logprob": logprob.detach()}))
        self.seen[-1][2].pop("num_tokens"), self.seen[-1][2].pop("num_seqs")
        pull = -(logprob * batch["mask"]).sum() / batch["mask"].sum().clamp(min=1)  # away from the reference
        totals = {"num_tokens": batch["num_tokens"], "num_seqs": batch["num_seqs"]}
        return 0.5 * pull + self.kl(logprob, batch["ref"], batch["mask"], **totals)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Logged(Callback):
    def __init__(self) -> None:
        self.coefs: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if "kl/coef" in trainer.callback_metrics and (len(self.coefs) < trainer.global_step):
            self.coefs.append(float(trainer.callback_metrics["kl/coef"]))


CONTROLLERS = {
    "target token-mean": (lambda: lk.TargetKLController(target_kl=0.05, init_kl_coef=0.3, step_size=0.5, max_kl_coef=2.0),
                          "token-mean",
                          lambda beta, kl, n, step: target_rule(beta, kl, 0.05, 0.5, 1e-6, 2.0)),
    "adaptive seq-mean-token-sum": (lambda: lk.AdaptiveKLController(init_kl_coef=0.3, target_kl=0.2, horizon=30),
                                    "seq-mean-token-sum",
                                    lambda beta, kl, n, step: adaptive_rule(beta, kl, 0.2, n, 30)),
}


@pytest.mark.parametrize("name", list(CONTROLLERS))
def test_a_trainer_moves_the_coefficient_once_per_optimizer_step_by_the_rule(name, tmp_path):
    make, agg, rule = CONTROLLERS[name]
    model, logged = Controlled(make(), agg=agg), Logged()
    make_quiet_trainer(tmp_path, max_steps=STEPS, accumulate_grad_batches=ACCUM, callbacks=[logged]).fit(model)
    assert [s for s, _, _ in model.seen] == [s for s in range(STEPS) for _ in range(ACCUM)]
    beta, expected = 0.3, []
    for step in range(STEPS):
        micro = [(c, b) for s, c, b in model.seen if s == step]
        # both micro-batches of a step used the same coefficient: the step's, from the rule
        assert len(micro) == ACCUM and micro[0][0] == micro[1][0]
        assert micro[0][0] == pytest.approx(beta, rel=1e-6, abs=0)
        expected.append(beta)
        total, count, seqs = step_stats([b for _, b in micro], agg)
        beta = rule(beta, total / count, seqs, step)
    assert model.kl.coef == pytest.approx(beta, rel=1e-6, abs=0)
    assert len(set(expected)) == STEPS  # it moved every step
    assert logged.coefs == pytest.approx(expected, rel=1e-6)  # kl/coef: the coefficient each step used


def test_a_schedule_alone_in_a_trainer_counts_optimizer_steps(tmp_path):
    model = Controlled(lk.KLSchedule(0.4, kind="cosine", warmup_steps=2, total_steps=4, final_scale=0.1))
    make_quiet_trainer(tmp_path, max_steps=STEPS, accumulate_grad_batches=ACCUM).fit(model)
    for step in range(STEPS):
        coefs = [c for s, c, _ in model.seen if s == step]
        assert coefs == [pytest.approx(0.4 * scale_rule(step, "cosine", 2, 4, 0.1), rel=1e-15, abs=0)] * ACCUM
    assert model.kl.controller.step == STEPS


def test_manual_optimization_closes_the_step_at_each_optimizer_step(tmp_path):
    class Manual(Controlled):
        def __init__(self, coef: Any) -> None:
            super().__init__(coef)
            self.automatic_optimization = False

        def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
            opt = self.optimizers()
            for _ in range(2):  # two optimizer steps per batch, as PPO epochs
                opt.zero_grad()
                self.manual_backward(super().training_step(batch, batch_idx))
                opt.step()

    ctl = lk.TargetKLController(target_kl=0.05, init_kl_coef=0.3, step_size=0.5)
    model = Manual(ctl)
    make_quiet_trainer(tmp_path, max_steps=4).fit(model)
    beta = 0.3
    for _, coef, b in model.seen:
        assert coef == pytest.approx(beta, rel=1e-6)
        total, count, _ = step_stats([b], "token-mean")
        beta = target_rule(beta, total / count, 0.05, 0.5, 1e-6, 100.0)
    assert len(model.seen) == 4


def test_one_controller_for_two_users_is_refused(tmp_path):
    ctl = lk.TargetKLController()
    model = Controlled(ctl)
    reward = lk.KLRewardCallback("k1", controller=ctl)
    with pytest.raises(ValueError, match="one KL controller object is used by KLPenaltyLoss 'kl' and KLRewardCallback"):
        make_quiet_trainer(tmp_path, max_steps=1, callbacks=[reward]).fit(model)
    model = Controlled(lk.KLSchedule(ctl, warmup_steps=2))
    model.kl2 = lk.KLPenaltyLoss("k1", coef=ctl)
    with pytest.raises(ValueError, match="used by KLPenaltyLoss 'kl' and KLPenaltyLoss 'kl2'"):
        make_quiet_trainer(tmp_path, max_steps=1).fit(model)


def test_two_controlled_losses_log_under_their_names(tmp_path):
    model = Controlled(lk.TargetKLController(target_kl=0.05, init_kl_coef=0.3))
    model.kl2 = lk.KLPenaltyLoss("k1", coef=lk.TargetKLController(target_kl=0.05, init_kl_coef=0.2))
    trainer = make_quiet_trainer(tmp_path, max_steps=2)
    trainer.fit(model)
    assert {"kl/coef/kl", "kl/coef/kl2", "kl/value/kl", "kl/value/kl2"} <= set(trainer.callback_metrics)
    assert "kl/coef" not in trainer.callback_metrics
    assert model.kl2.coef == 0.2  # closed every step, on every rank alike, but no forward: no KL, unchanged
    assert math.isnan(float(trainer.callback_metrics["kl/value/kl2"]))


def test_a_non_finite_global_kl_is_raised_from_fit_and_leaves_the_coefficient(tmp_path):
    class Poisoned(Controlled):
        def train_dataloader(self) -> Any:
            batches = with_totals([loop_batch(i) for i in range(2 * ACCUM)])
            batches[2]["ref"][0, 0] = float("-inf")  # a valid position of step 1: d = +inf, its KL is inf
            return torch.utils.data.DataLoader(batches, batch_size=None)

    model = Poisoned(lk.TargetKLController(target_kl=0.05, init_kl_coef=0.3, step_size=0.5))
    with pytest.raises(ValueError, match="non-finite KL"):
        make_quiet_trainer(tmp_path, max_steps=2, accumulate_grad_batches=ACCUM, log_every_n_steps=1).fit(model)
    total, count, _ = step_stats([b for s, _, b in model.seen if s == 0], "token-mean")
    assert model.kl.coef == pytest.approx(target_rule(0.3, total / count, 0.05, 0.5, 1e-6, 100.0), rel=1e-6)


# resume: a checkpoint at the end of epoch 0 (2 optimizer steps), then 3 more


class Epochs(Controlled):
    def train_dataloader(self) -> Any:
        e = self.current_epoch
        return torch.utils.data.DataLoader(with_totals([loop_batch(4 * e + i) for i in range(4)]), batch_size=None)


def _fit(root: Path, ckpt: Optional[str] = None, callbacks: Any = ()) -> Epochs:
    torch.manual_seed(0)
    model = Epochs(lk.KLSchedule(lk.TargetKLController(target_kl=0.05, init_kl_coef=0.3, step_size=0.5), warmup_steps=3))
    make_quiet_trainer(root, max_epochs=3, accumulate_grad_batches=ACCUM, reload_dataloaders_every_n_epochs=1,
                       enable_checkpointing=bool(callbacks), callbacks=list(callbacks)).fit(model, ckpt_path=ckpt)
    return model


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_continues_the_coefficient_bit_for_bit(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    whole = _fit(tmp_path / "whole", callbacks=[ckpt])
    saved = torch.load(tmp_path / "ckpt" / "epoch=0.ckpt", weights_only=False)["state_dict"]["kl._extra_state"]
    assert saved["controller"]["step"] == 2
    resumed = _fit(tmp_path / "resumed", ckpt=str(tmp_path / "ckpt" / "epoch=0.ckpt"))
    assert [(s, c) for s, c, _ in resumed.seen] == [(s, c) for s, c, _ in whole.seen if s >= 2]  # exact
    assert resumed.kl.coef == whole.kl.coef and resumed.kl.controller.step == whole.kl.controller.step == 6
    assert torch.equal(resumed.shift, whole.shift)


# YAML: the controller by class_path


class YamlModule(Controlled):
    def __init__(self, kl_coef: Union[float, lk.KLController] = 0.1, kl_agg: str = "token-mean") -> None:
        super().__init__(kl_coef, agg=kl_agg)


def test_yaml_names_the_controller_by_class_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prog"])
    config = {
        "trainer": {"max_steps": 3, "accumulate_grad_batches": 2, "accelerator": "cpu", "logger": False,
                    "enable_progress_bar": False, "enable_checkpointing": False, "enable_model_summary": False,
                    "default_root_dir": str(tmp_path / "run")},
        "seed_everything": 0,
        "model": {
            "kl_agg": "seq-mean-token-sum",
            "kl_coef": {
                "class_path": "lightning_kl.KLSchedule",
                "init_args": {
                    "controller": {"class_path": "lightning_kl.TargetKLController",
                                   "init_args": {"target_kl": 0.3, "init_kl_coef": 0.05, "step_size": 0.2}},
                    "kind": "linear", "warmup_steps": 1, "total_steps": 10, "final_scale": 0.5,
                },
            },
        },
    }
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(YamlModule, args=["fit", "--config", str(path)])
    sched = cli.model.kl.controller
    assert isinstance(sched, lk.KLSchedule) and isinstance(sched.controller, lk.TargetKLController)
    assert (sched.kind, sched.step, sched.controller.target_kl) == ("linear", 3, 0.3)
    assert sched.controller.value != 0.05
    # a bad argument fails when the config is parsed, before any step
    config["model"]["kl_coef"]["init_args"]["controller"]["init_args"]["step_size"] = 0.0
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match="`step_size` must be > 0, got 0.0"):
        LightningCLI(YamlModule, args=["fit", "--config", str(path)])


# 2 DDP processes, unequal tokens


def test_ddp_ranks_agree_on_the_coefficient_of_the_global_kl(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_kl_control_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    records = run_ddp_worker(WORKER, tmp_path, world=2)
    coefs = [r["coefs"] for r in records]
    assert coefs[0] == coefs[1]  # the same float64 on both ranks, every step
    assert records[0]["tokens"] != records[1]["tokens"]  # the ranks held different numbers of tokens
    beta = worker.INIT
    for step, coef in enumerate(coefs[0]):
        assert coef == pytest.approx(beta, rel=1e-6, abs=0)
        total = sum(r["stats"][step][0] for r in records)
        count = sum(r["stats"][step][1] for r in records)
        beta = target_rule(beta, total / count, worker.TARGET, worker.STEP_SIZE, 1e-6, 100.0)
        # per-rank KL would give another coefficient: the test would tell them apart
        local = [target_rule(coef, r["stats"][step][0] / r["stats"][step][1], worker.TARGET, worker.STEP_SIZE, 1e-6, 100.0) for r in records]
        assert all(abs(x - beta) > 1e-6 * beta for x in local)
    assert records[0]["final"] == records[1]["final"] == pytest.approx(beta, rel=1e-6)


# the toy example's config with a TargetKLController


def test_the_toy_example_runs_its_target_kl_config(tmp_path, monkeypatch):
    import importlib.util

    examples = Path(__file__).resolve().parents[1] / "examples"
    toy = sys.modules.get("toy_rlhf")
    if toy is None:
        spec = importlib.util.spec_from_file_location("toy_rlhf", examples / "toy_rlhf.py")
        toy = importlib.util.module_from_spec(spec)
        sys.modules["toy_rlhf"] = toy  # jsonargparse looks classes up by module name
        spec.loader.exec_module(toy)
    monkeypatch.setattr(sys, "argv", ["toy_rlhf.py"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cli = toy.main([
            "fit", "--config", str(examples / "configs" / "grpo_k3plus_target.yaml"), "--trainer.max_steps=3",
            "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={tmp_path}", f"--model.cache_dir={tmp_path / 'ref'}", "--model.d_model=16",
            "--model.n_layer=1", "--model.n_head=2", "--model.pretrain_steps=3", "--model.pretrain_batch_size=8",
            "--data.prompts_per_rollout=2", "--data.group_size=2", "--data.max_new_tokens=4", "--data.reference_samples=16",
        ])
    finally:
        torch.set_num_threads(threads)
    ctl = cli.model.kl.controller
    assert isinstance(ctl, lk.TargetKLController) and (ctl.target_kl, ctl.step_size) == (4.0, 0.1)
    assert cli.model.kl.agg == "seq-mean-token-sum"
    assert ctl.value != 0.05  # three optimizer steps moved it
    assert {"kl/coef", "kl/value"} <= set(cli.trainer.callback_metrics)
