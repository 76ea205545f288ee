"""Entropy control: ``EntropyBonus`` against float64 maths, ``high_entropy_mask`` against TRL's rule on one
process and across 2 and 3 gloo processes, ``TargetEntropyController`` by its two rules, in a Trainer
with accumulation, across 2 DDP ranks, through a checkpoint resume and from YAML."""

from __future__ import annotations

import math
import sys
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
from lightning_kl.high_entropy import masked_quantile
from _ddp import run_ddp_worker
from _trainers import make_quiet_trainer

F64 = torch.float64
TESTS = Path(__file__).parent


# ----------------------------------------------------------------------------------------------
# float64 references written from the formulas


def ref_entropy(z: Tensor, temperature: float = 1.0, top_k: Optional[int] = None) -> Tensor:
    """H of softmax(z / T), restricted to the top-k logits and renormalized; float64, differentiable."""
    z = z.to(F64) / temperature
    kept = torch.ones_like(z, dtype=torch.bool)
    if top_k is not None:
        kept = z >= z.topk(top_k, dim=-1).values[..., -1:]
    z = torch.where(kept, z, torch.zeros((), dtype=F64))
    logp = z - torch.where(kept, z, -math.inf).logsumexp(-1, keepdim=True)  # log p on the kept set
    p = torch.where(kept, logp.exp(), torch.zeros((), dtype=F64))
    return -(p * torch.where(kept, logp, torch.zeros((), dtype=F64))).sum(-1)


def ref_aggregate(v: Tensor, m: Tensor, mode: str) -> Tensor:
    v = torch.where(m, v, torch.zeros((), dtype=v.dtype))
    n_i, s_i = m.sum(-1), v.sum(-1)
    if mode == "token-mean":
        return s_i.sum() / m.sum()
    if mode == "token-sum":
        return s_i.sum()
    if mode == "seq-mean-token-sum":
        return s_i.sum() / (n_i > 0).sum()
    if mode == "seq-mean-token-mean":
        return (s_i / n_i.clamp(min=1)).sum() / (n_i > 0).sum()
    return s_i.sum() / v.shape[-1]  # seq-mean-token-sum-norm


def _batch(seed: int = 0, b: int = 3, t: int = 5, v: int = 11) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(b, t, v, generator=g)
    mask = torch.arange(t).expand(b, t) < torch.tensor([5, 2, 0][:b] + [3] * max(0, b - 3))[:, None]
    logits[~mask] = float("nan")  # padding holds junk: it must never reach the loss or the gradient
    return logits, mask


SAMPLERS = {"plain": {}, "T=0.7": {"temperature": 0.7}, "T=1.3,top_k=4": {"temperature": 1.3, "top_k": 4}}


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_the_bonus_from_logits_is_minus_coef_times_the_aggregated_entropy_with_its_gradient(agg, sampler):
    logits, mask = _batch()
    kw = SAMPLERS[sampler]
    bonus = lk.EntropyBonus(coef=0.3, agg=agg, sampling=lk.Sampling(**kw))
    x = logits.clone().requires_grad_(True)
    loss = bonus(x, mask)
    loss.backward()
    x64 = torch.where(mask[..., None], logits, 0.0).to(F64).requires_grad_(True)
    expected = -0.3 * ref_aggregate(ref_entropy(x64, **kw), mask, agg)
    expected.backward()
    assert_close(loss.to(F64), expected, rtol=1e-5, atol=1e-6)
    assert_close(x.grad.to(F64), x64.grad, rtol=1e-4, atol=1e-6)
    assert (x.grad[~mask] == 0).all()  # NaN padding: exactly 0
    # the metric: the token-mean entropy of the valid tokens
    assert_close(bonus.metric.compute(), ref_aggregate(ref_entropy(x64.detach(), **kw), mask, "token-mean"))


def test_the_bonus_from_a_head_equals_float64_values_and_gradients():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 4, 6, generator=g, dtype=F64, requires_grad=True)
    weight = torch.randn(9, 6, generator=g, dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    sampling = lk.Sampling(temperature=0.8, top_k=5)
    loss = lk.EntropyBonus(coef=0.5, agg="seq-mean-token-mean", sampling=sampling)(lk.FromHidden(hidden, weight), mask)
    grads = torch.autograd.grad(loss, (hidden, weight))
    h2, w2 = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    expected = -0.5 * ref_aggregate(ref_entropy(h2 @ w2.T, 0.8, 5), mask, "seq-mean-token-mean")
    assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(expected, (h2, w2))):
        assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_a_precomputed_entropy_gives_the_same_bonus_and_gradient():
    logits, mask = _batch(2)
    sampling = lk.Sampling(temperature=0.9)
    bonus = lk.EntropyBonus(coef=0.2, sampling=sampling)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    la = bonus(a, mask)
    lb = bonus(entropy=lk.token_entropy(b, mask, sampling=sampling), mask=mask)
    la.backward(), lb.backward()
    assert torch.equal(la, lb) and torch.equal(a.grad, b.grad)
    with pytest.raises(ValueError, match="exactly one; got x=a value, entropy=a value"):
        bonus(a, mask, entropy=lk.token_entropy(b, mask))
    with pytest.raises(ValueError, match="exactly one; got x=None, entropy=None"):
        bonus(mask=mask)
    with pytest.raises(ValueError, match=r"shape"):
        bonus(entropy=torch.zeros(3, 4), mask=mask)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"coef": -0.1}, r"`coef` must be a finite number >= 0 or a controller .*got -0.1"),
        ({"coef": float("nan")}, r"`coef` must be a finite number >= 0"),
        ({"coef": True}, r"`coef` must be a finite number >= 0"),
        ({"agg": "mean"}, r"Unknown aggregation mode 'mean'. Valid modes: 'token-mean'"),
        ({"sampling": 0.7}, r"`sampling` must be an lk.Sampling or None, got float"),
    ],
)
def test_bad_bonus_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lk.EntropyBonus(**kwargs)


# ----------------------------------------------------------------------------------------------
# high_entropy_mask: TRL's rule


def trl_get_high_entropy_mask():
    """TRL 1.16's ``GRPOTrainer.get_high_entropy_mask`` (its own code, taken out by its syntax tree), with
    an ``accelerator`` of one process; or None when TRL is not installed for the mismatch tests."""
    try:
        from _mismatch_stacks import _compile, _function, _tree, package_root
    except ImportError:  # pragma: no cover
        return None
    try:
        root = package_root("trl")
    except pytest.skip.Exception:
        return None
    return _compile(_function(_tree(root / "trainer" / "grpo_trainer.py"), "get_high_entropy_mask"), {"torch": torch})


class _OneAccelerator:
    """``accelerator.pad_across_processes`` and ``gather`` of one process holding the concatenated batch."""

    def __init__(self, parts: Optional[list[Tensor]] = None) -> None:
        self.parts = parts

    def pad_across_processes(self, local: Tensor, dim: int, pad_index: float) -> Tensor:
        if self.parts is None:
            return local
        longest = max(p.numel() for p in self.parts)
        return torch.stack([torch.nn.functional.pad(p, (0, longest - p.numel()), value=pad_index) for p in self.parts])

    def gather(self, padded: Tensor) -> Tensor:
        return padded.reshape(-1)


def formula_mask(entropy: Tensor, mask: Tensor, top: float) -> Tensor:
    """TRL's formula written from its code, in float64: quantile 1 - top of the valid values, kept when >= it."""
    valid = entropy[mask].to(F64)
    if valid.numel() == 0:
        return torch.zeros_like(mask)
    return mask & (entropy.to(F64) >= torch.quantile(valid, 1 - top))


def _entropies(seed: int, shape: tuple[int, int], ties: bool = False) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(shape, generator=g) * 3
    if ties:
        h = (h * 2).round() / 2  # few distinct values: ties at the threshold
    return h


TOPS = [1.0, 0.2, 0.5, 0.37, 1e-9, 0.999]


@pytest.mark.parametrize("top", TOPS)
@pytest.mark.parametrize("ties", [False, True])
def test_the_mask_equals_trls_get_high_entropy_mask_on_one_process(top, ties):
    trl = trl_get_high_entropy_mask()
    for seed in range(5):
        h = _entropies(seed, (4, 7), ties)
        m = torch.rand(4, 7, generator=torch.Generator().manual_seed(100 + seed)) < 0.7
        h_padded = torch.where(m, h, torch.tensor(float("nan")))  # junk at padding is never read
        got = lk.high_entropy_mask(h_padded, m, top=top)
        assert torch.equal(got, formula_mask(h, m, top)) or not ties  # float64 formula: equal unless rounding at a tie
        if trl is not None:
            self = type("S", (), {"accelerator": _OneAccelerator()})()
            assert torch.equal(got, trl(self, h, m.int(), 1 - top)), (seed, top)
    if trl is None:
        pytest.skip("TRL 1.16 not installed for the mismatch tests (LIGHTNING_KL_STACKS): compared with the float64 formula only")


def test_the_mask_edges_top_one_keeps_every_valid_token_and_a_tiny_top_only_the_largest():
    h = torch.tensor([[0.5, 2.0, 1.0, 2.0], [0.1, 9.0, 0.0, 0.0]])
    m = torch.tensor([[True, True, True, True], [True, False, False, False]])
    assert torch.equal(lk.high_entropy_mask(h, m, top=1.0), m)
    assert lk.high_entropy_mask(h, m, top=1e-9).tolist() == [[False, True, False, True], [False] * 4]  # both maxima
    # exactly at the threshold: 5 valid values 0.1 0.5 1 2 2, top 0.5: the median 1.0 is kept
    assert lk.high_entropy_mask(h, m, top=0.5).tolist() == [[False, True, True, True], [False] * 4]
    assert not lk.high_entropy_mask(h, torch.zeros_like(m), top=0.2).any()  # nothing valid: nothing kept
    assert not lk.high_entropy_mask(torch.zeros(0, 3), None).any()
    assert torch.equal(lk.high_entropy_mask(h, None, top=1.0), torch.ones_like(m))
    with pytest.raises(ValueError, match=r"shape"):
        lk.high_entropy_mask(h, m[:, :3])
    with pytest.raises(TypeError, match="entropy"):
        lk.high_entropy_mask(torch.ones(2, 3, dtype=torch.int64), None)
    nan = h.clone()
    nan[0, 0] = float("nan")  # a NaN on a valid token: nothing kept (torch.quantile is NaN there)
    assert not lk.high_entropy_mask(nan, m).any()


@pytest.mark.parametrize("top", [0, 0.0, -0.1, 1.5, True, "0.2", float("nan")])
def test_a_bad_top_fails_naming_the_interval(top):
    with pytest.raises(ValueError, match=r"`top` must be a fraction of the valid tokens in \(0, 1\]"):
        lk.high_entropy_mask(torch.rand(2, 3), None, top=top)
    if top == 0:
        with pytest.raises(ValueError, match="top_entropy_quantile=0.0"):
            lk.high_entropy_mask(torch.rand(2, 3), None, top=top)


def test_masked_quantile_is_torch_quantile_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, F64):
        for n in (1, 2, 3, 10, 97):
            v = torch.randn(n + 5, generator=g, dtype=dtype)
            valid = torch.ones(n + 5, dtype=torch.bool)
            valid[torch.randperm(n + 5, generator=g)[:5]] = False
            for q in (0.0, 0.2, 0.5, 0.8, 1 - 0.37, 1.0):
                assert torch.equal(masked_quantile(v, valid, q), torch.quantile(v[valid], q)), (dtype, n, q)


# the worker runs every case of MASK_CASES on WORLD gloo processes (file store: no port) and on one


@pytest.mark.parametrize("world", [2, 3])
def test_the_mask_across_gloo_ranks_equals_one_process_on_the_concatenated_batch(world, tmp_path):
    records = run_ddp_worker(TESTS / "_entropy_mask_worker.py", tmp_path, str(world), world=world, timeout=240)
    import importlib.util

    spec = importlib.util.spec_from_file_location("_entropy_mask_worker", TESTS / "_entropy_mask_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    trl = trl_get_high_entropy_mask()
    for case, (lengths, top) in worker.MASK_CASES.items():
        parts = [worker.rank_data(world, r, lengths) for r in range(world)]
        h = torch.cat([p[0] for p in parts])
        m = torch.cat([p[1] for p in parts])
        one = lk.high_entropy_mask(h, m, top=top)  # one process on the concatenated batch
        assert torch.equal(one, formula_mask(h, m, top))
        if trl is not None:  # TRL's own code, its accelerator gathering the ranks' valid values
            acc = _OneAccelerator([p[0][p[1]] for p in parts])
            assert torch.equal(one, trl(type("S", (), {"accelerator": acc})(), h, m.int(), 1 - top))
        rows = 0
        for r, rec in enumerate(records):
            n = parts[r][0].shape[0]
            assert rec["masks"][case] == one[rows:rows + n].tolist(), (case, r)
            rows += n
    assert all(rec["explicit_group"] for rec in records)
    for rec in records:  # one rank's bad mask: every rank raised the same error, naming it
        assert rec["raised"] is not None and f"found on rank {world - 1}; every rank raises" in rec["raised"]
        assert "shape" in rec["raised"]


# ----------------------------------------------------------------------------------------------
# TargetEntropyController: the rules


def dual_rule(c: float, h: float, target: float, eta: float, lo: float, hi: float) -> float:
    return min(max(math.exp(math.log(c) + eta * min(max(1 - h / target, -1.0), 1.0)), lo), hi)


def additive_rule(c: float, h: float, target: float, delta: float, lo: float, hi: float) -> float:
    return min(c + delta, hi) if h <= target else max(c - delta, lo)


def test_the_dual_rule_rises_under_the_target_falls_above_and_stays_within_bounds():
    ctl = lk.TargetEntropyController(target_entropy=0.5, init_coef=0.01, step_size=0.3, coef_min=0.005, coef_max=0.02)
    c = 0.01
    seen = []
    for h in (0.2, 0.5, 0.0, 0.9, 5.0, 5.0, 5.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0):
        ctl.update(h, n_steps=10)
        c = dual_rule(c, h, 0.5, 0.3, 0.005, 0.02)
        # c exp(x) against exp(log c + x), math.exp against torch's: per step an ulp or two of each exp and
        # |log c| < 6 ulp from the log, at most 13 steps before a bound resets the error: rel 2e-14
        assert ctl.value == pytest.approx(c, rel=2e-14, abs=0)
        seen.append(ctl.value)
    assert seen[1] == seen[0] > 0.01 and seen[3] < seen[2]  # at the target unchanged; above it down
    assert 0.005 in seen and ctl.value == 0.02  # both bounds reached
    # on tensors, the same float64 numbers, no host read in update
    t = lk.TargetEntropyController(target_entropy=0.5, init_coef=0.01, step_size=0.3, coef_min=0.005, coef_max=0.02)
    for h in (0.2, 0.5, 0.0, 0.9):
        t.update(torch.tensor(h, dtype=F64), torch.tensor(10.0, dtype=F64))
    f = lk.TargetEntropyController(target_entropy=0.5, init_coef=0.01, step_size=0.3, coef_min=0.005, coef_max=0.02)
    for h in (0.2, 0.5, 0.0, 0.9):
        f.update(h, 10)
    assert t.value == f.value  # bitwise by construction: one exp for both paths (the next test)


def test_the_dual_rules_float_and_tensor_paths_share_one_exp_and_agree_bitwise_on_any_input():
    # math.exp and torch.exp disagree by an ulp on some inputs (here 1 in 200; on an AVX-512 CPU 1 in 20):
    # the float path runs torch's exp on a float64 CPU tensor, so both paths give the same bits on any CPU
    from lightning_kl.entropy_controller import target_entropy_factor

    hs = (torch.rand(400, generator=torch.Generator().manual_seed(1), dtype=F64) * 1.2).tolist()
    for h in hs:
        assert target_entropy_factor(h, 0.6, 0.37) == float(target_entropy_factor(torch.tensor(h, dtype=F64), 0.6, 0.37))
    host = lk.TargetEntropyController(target_entropy=0.6, init_coef=0.01, step_size=0.013, coef_min=1e-9, coef_max=1e9)
    dev = lk.TargetEntropyController(target_entropy=0.6, init_coef=0.01, step_size=0.013, coef_min=1e-9, coef_max=1e9)
    for h in hs:
        host.update(h, 10)
        dev.update(torch.tensor(h, dtype=F64), torch.tensor(10.0, dtype=F64))
        assert float(dev.value_tensor()) == host.value


def test_the_additive_rule_is_trls_with_its_gate():
    # TRL 1.16 GRPOTrainer: coef += delta at or below the target (clipped to max), -= delta above (clipped
    # to min); the coefficient applied is coef when the last step's entropy was <= target, else 0 (inf before)
    ctl = lk.TargetEntropyController(0.4, init_coef=0.01, rule="additive", coef_delta=0.004, coef_max=0.02)
    tens = lk.TargetEntropyController(0.4, init_coef=0.01, rule="additive", coef_delta=0.004, coef_max=0.02)
    assert ctl.value == 0.0 and ctl.coef == 0.01  # no step yet: not applied
    c = 0.01
    for h in (0.4, 0.3, 0.1, 0.1, 0.1, 0.9, 0.9, 0.9, 0.9, 0.35):
        ctl.update(h, 5)
        tens.update(torch.tensor(h, dtype=F64), torch.tensor(5.0, dtype=F64))
        c = additive_rule(c, h, 0.4, 0.004, 0.0, 0.02)
        assert ctl.coef == pytest.approx(c, abs=1e-15) and ctl.value == (ctl.coef if h <= 0.4 else 0.0)
        assert float(tens.value_tensor()) == ctl.value and tens.coef == ctl.coef
    # a step with no valid token leaves everything as it was (TRL's would read an entropy of 0)
    before = (ctl.coef, ctl.value)
    tens.update(torch.tensor(float("nan"), dtype=F64), torch.tensor(0.0, dtype=F64))
    assert (tens.coef, tens.value) == before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rule": "trl"}, r"Unknown entropy rule 'trl'. Valid rules: 'dual', 'additive'"),
        ({"target_entropy": 0.0}, r"`target_entropy` must be > 0, got 0.0"),
        ({"init_coef": 0.0}, r"`init_coef` must be > 0, got 0.0"),  # dual: log space
        ({"init_coef": 2.0}, r"`init_coef` must be within \[coef_min, coef_max\]"),
        ({"coef_min": 0.5, "coef_max": 0.1, "init_coef": 0.2}, r"`coef_min` \(0.5\) must be <= `coef_max` \(0.1\)"),
        ({"rule": "additive", "coef_delta": -1.0}, r"`coef_delta` must be > 0, got -1.0"),
        ({"rule": "additive", "coef_min": -0.1}, r"`coef_min` must be >= 0, got -0.1"),
        ({"step_size": float("inf")}, r"`step_size` must be a finite number"),
    ],
)
def test_bad_controller_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lk.TargetEntropyController(**kwargs)


def test_a_non_finite_entropy_is_refused_and_the_state_round_trips():
    ctl = lk.TargetEntropyController(0.5, init_coef=0.01)
    with pytest.raises(ValueError, match="non-finite entropy"):
        ctl.update(float("nan"), 4)
    ctl.update(torch.tensor(float("inf"), dtype=F64), torch.tensor(4.0, dtype=F64))
    with pytest.raises(ValueError, match="non-finite entropy"):
        ctl.value  # noqa: B018
    assert ctl.value == 0.01
    add = lk.TargetEntropyController(0.5, init_coef=0.01, rule="additive")
    add.update(0.3, 4)
    copy = lk.TargetEntropyController(0.5, init_coef=0.01, rule="additive")
    copy.load_state_dict(add.state_dict())
    assert (copy.coef, copy.value, copy.state_dict()) == (add.coef, add.value, add.state_dict())


def test_a_schedule_wraps_either_rule():
    for rule in ("dual", "additive"):
        ctl = lk.TargetEntropyController(0.5, init_coef=0.01, rule=rule)
        sched = lk.KLSchedule(ctl, kind="linear", warmup_steps=2, total_steps=4, final_scale=0.5)
        sched.update(0.2, 8)
        assert sched.value == pytest.approx(ctl.value * 0.5)  # warm-up step 1 of 2
        assert sched.state_dict()["controller"] == ctl.state_dict()


# ----------------------------------------------------------------------------------------------
# in a Trainer: once per optimizer step, with accumulation


STEPS, ACCUM, T, V = 4, 2, 5, 7


def loop_batch(i: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(i)
    lengths = torch.tensor([5, 3, int(i % 3)])
    return {"noise": torch.randn(3, T, V, generator=g), "mask": torch.arange(T).expand(3, T) < lengths[:, None]}


class Bonused(pl.LightningModule):
    def __init__(self, coef: Any, agg: str = "token-mean") -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(T, V))
        self.entropy = lk.EntropyBonus(coef=coef, agg=agg)
        self.seen: list[tuple[int, float, float, float]] = []  # (step, coef, entropy sum, tokens)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader([loop_batch(i) for i in range(STEPS * ACCUM)], batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        z = self.logits + batch["noise"]
        m = batch["mask"]
        h = ref_entropy(z.detach())
        self.seen.append((self.trainer.global_step, self.entropy.coef, float(h[m].sum()), float(m.sum())))
        sharpen = -(z.log_softmax(-1)[..., 0] * m).sum() / m.sum().clamp(min=1)  # pushes the entropy down
        return sharpen + self.entropy(z, m)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=2.0)


class Logged(Callback):
    def __init__(self) -> None:
        self.coefs: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if "entropy/coef" in trainer.callback_metrics and len(self.coefs) < trainer.global_step:
            self.coefs.append(float(trainer.callback_metrics["entropy/coef"]))


RULES = {
    "dual": (lambda: lk.TargetEntropyController(1.5, init_coef=0.2, step_size=0.5), lambda c, h: dual_rule(c, h, 1.5, 0.5, 1e-6, 1.0)),
    "additive": (lambda: lk.TargetEntropyController(1.5, init_coef=0.2, rule="additive", coef_delta=0.05),
                 lambda c, h: additive_rule(c, h, 1.5, 0.05, 0.0, 1.0)),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_a_trainer_moves_the_coefficient_once_per_optimizer_step(rule, tmp_path):
    make, step_rule = RULES[rule]
    model, logged = Bonused(make()), Logged()
    make_quiet_trainer(tmp_path, max_steps=STEPS, accumulate_grad_batches=ACCUM, callbacks=[logged]).fit(model)
    assert [s for s, *_ in model.seen] == [s for s in range(STEPS) for _ in range(ACCUM)]
    coef, last, expected = 0.2, math.inf, []
    for step in range(STEPS):
        micro = [x for x in model.seen if x[0] == step]
        applied = coef if rule == "dual" or last <= 1.5 else 0.0
        assert micro[0][1] == micro[1][1] == pytest.approx(applied, rel=1e-6, abs=0)  # the engine's float32 entropies
        expected.append(applied)
        h = sum(x[2] for x in micro) / sum(x[3] for x in micro)  # the step's token-mean over both micro-batches
        coef, last = step_rule(coef, h), h
    assert logged.coefs == pytest.approx(expected, rel=1e-6)
    assert len(set(expected)) >= (3 if rule == "dual" else 2)  # it moved (additive: the gate closed, then open)


def test_the_bonus_and_a_kl_loss_log_under_their_own_names_and_a_shared_controller_is_refused(tmp_path):
    model = Bonused(lk.TargetEntropyController(1.5, init_coef=0.2))
    model.kl = lk.KLPenaltyLoss("k1", coef=lk.TargetKLController(init_kl_coef=0.1))
    trainer = make_quiet_trainer(tmp_path, max_steps=2)
    trainer.fit(model)
    assert {"entropy/coef", "entropy/value", "kl/coef", "kl/value"} <= set(trainer.callback_metrics)
    ctl = lk.TargetEntropyController(1.5, init_coef=0.2)
    model = Bonused(ctl)
    model.kl = lk.KLPenaltyLoss("k1", coef=ctl)
    with pytest.raises(ValueError, match="used by KLPenaltyLoss 'kl' and EntropyBonus 'entropy'|used by EntropyBonus 'entropy' and KLPenaltyLoss 'kl'"):
        make_quiet_trainer(tmp_path, max_steps=1).fit(model)


class Epochs(Bonused):
    def train_dataloader(self) -> Any:
        e = self.current_epoch
        return torch.utils.data.DataLoader([loop_batch(4 * e + i) for i in range(4)], batch_size=None)


def _fit(root: Path, rule: str, ckpt: Optional[str] = None, callbacks: Any = ()) -> Epochs:
    torch.manual_seed(0)
    ctl = lk.TargetEntropyController(1.5, init_coef=0.2, rule=rule, step_size=0.5, coef_delta=0.05)
    model = Epochs(lk.KLSchedule(ctl, warmup_steps=3))
    make_quiet_trainer(root, max_epochs=3, accumulate_grad_batches=ACCUM, reload_dataloaders_every_n_epochs=1,
                       enable_checkpointing=bool(callbacks), callbacks=list(callbacks)).fit(model, ckpt_path=ckpt)
    return model


@pytest.mark.parametrize("rule", ["dual", "additive"])
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_continues_the_coefficient_bit_for_bit(rule, tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    whole = _fit(tmp_path / "whole", rule, callbacks=[ckpt])
    saved = torch.load(tmp_path / "ckpt" / "epoch=0.ckpt", weights_only=False)["state_dict"]["entropy._extra_state"]
    assert saved["controller"]["step"] == 2 and "last_entropy" in saved["controller"]["controller"]
    resumed = _fit(tmp_path / "resumed", rule, ckpt=str(tmp_path / "ckpt" / "epoch=0.ckpt"))
    assert [(s, c) for s, c, *_ in resumed.seen] == [(s, c) for s, c, *_ in whole.seen if s >= 2]  # exact
    ctl, ctl_whole = resumed.entropy.controller.controller, whole.entropy.controller.controller
    assert ctl.state_dict() == ctl_whole.state_dict() and resumed.entropy.coef == whole.entropy.coef
    assert torch.equal(resumed.logits, whole.logits)
    assert len({c for _, c, *_ in whole.seen}) >= 3  # it moved across the checkpoint


def test_ddp_ranks_with_different_entropies_agree_on_the_coefficient_of_the_global_entropy(tmp_path):
    import importlib.util

    path = TESTS / "_entropy_control_worker.py"
    spec = importlib.util.spec_from_file_location("_entropy_control_worker", path)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    records = run_ddp_worker(path, tmp_path, world=2)
    assert records[0]["coefs"] == records[1]["coefs"] and records[0]["final"] == records[1]["final"]
    local = [[s / n for s, n in r["stats"]] for r in records]
    assert all(abs(a - b) > 0.05 for a, b in zip(*local))  # the ranks' own entropies differ
    coef, expected = worker.INIT, []
    for step in range(worker.STEPS):
        expected.append(coef)
        total = sum(r["stats"][step][0] for r in records)
        count = sum(r["stats"][step][1] for r in records)
        coef = dual_rule(coef, total / count, worker.TARGET, worker.STEP_SIZE, 1e-6, 1.0)
    assert records[0]["coefs"] == pytest.approx(expected, rel=1e-6)  # the engine's float32 entropies
    assert records[0]["final"] == pytest.approx(coef, rel=1e-6)


# ----------------------------------------------------------------------------------------------
# YAML


class YamlModule(Bonused):
    def __init__(self, bonus: lk.EntropyBonus, top: float = 0.2) -> None:
        super().__init__(0.0)
        self.entropy = bonus
        self.top = top

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        z = self.logits + batch["noise"]
        m = lk.high_entropy_mask(ref_entropy(z.detach()), batch["mask"], top=self.top)
        sharpen = -(z.log_softmax(-1)[..., 0] * m).sum() / m.sum().clamp(min=1)
        return sharpen + self.entropy(z, batch["mask"])


def test_yaml_names_the_bonus_its_controller_and_schedule_by_class_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prog"])
    config = {
        "trainer": {"max_steps": 3, "accumulate_grad_batches": 2, "accelerator": "cpu", "logger": False,
                    "enable_progress_bar": False, "enable_checkpointing": False, "enable_model_summary": False,
                    "default_root_dir": str(tmp_path / "run")},
        "seed_everything": 0,
        "model": {
            "top": 0.5,
            "bonus": {
                "class_path": "lightning_kl.EntropyBonus",
                "init_args": {
                    "agg": "seq-mean-token-mean",
                    "sampling": {"class_path": "lightning_kl.Sampling", "init_args": {"temperature": 0.8}},
                    "coef": {
                        "class_path": "lightning_kl.KLSchedule",
                        "init_args": {
                            "controller": {"class_path": "lightning_kl.TargetEntropyController",
                                           "init_args": {"target_entropy": 1.5, "init_coef": 0.05, "rule": "additive"}},
                            "warmup_steps": 1,
                        },
                    },
                },
            },
        },
    }
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(YamlModule, args=["fit", "--config", str(path)])
    bonus = cli.model.entropy
    assert isinstance(bonus, lk.EntropyBonus) and bonus.agg == "seq-mean-token-mean"
    assert bonus.sampling == lk.Sampling(temperature=0.8)
    ctl = bonus.controller.controller
    assert isinstance(ctl, lk.TargetEntropyController) and ctl.rule == "additive" and bonus.controller.step == 3
    assert ctl.coef != 0.05
    config["model"]["bonus"]["init_args"]["coef"]["init_args"]["controller"]["init_args"]["rule"] = "skywork"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match="Unknown entropy rule 'skywork'"):
        LightningCLI(YamlModule, args=["fit", "--config", str(path)])


def test_an_eval_forward_adds_nothing_to_the_step_and_the_bonus_pickles():
    import pickle

    bonus = lk.EntropyBonus(coef=lk.TargetEntropyController(1.0, init_coef=0.1))
    logits, mask = _batch(4)
    bonus.eval()
    bonus(logits, mask)
    assert bonus._coefficient.pending is None
    bonus.train()
    bonus(logits, mask)
    coef, h = bonus.update_coef()
    assert float(coef) == 0.1
    assert_close(h, ref_aggregate(ref_entropy(torch.where(mask[..., None], logits, 0.0)), mask, "token-mean"), rtol=1e-6, atol=0)
    copy = pickle.loads(pickle.dumps(bonus))
    assert copy.coef == bonus.coef != 0.1 and copy.controller is not bonus.controller
    # a step with no forward: nothing to see, the coefficient stays
    before = bonus.coef
    _, h = bonus.update_coef()
    assert math.isnan(float(h)) and bonus.coef == before
    assert lk.EntropyBonus(coef=0.3).update_coef() is None


def test_the_mask_the_bonus_and_the_controller_read_nothing_on_the_host(monkeypatch):
    # as on a GPU: every read of a value into Python and every op sized by values is refused
    from test_no_host_sync import device_form

    logits, mask = _batch(5)
    h = lk.token_entropy(logits, mask)
    host_mask = lk.high_entropy_mask(h, mask, top=0.3)
    host = lk.EntropyBonus(coef=lk.TargetEntropyController(1.0, init_coef=0.1))
    additive = lk.EntropyBonus(coef=lk.TargetEntropyController(1.0, init_coef=0.1, rule="additive"))
    x = logits.clone().requires_grad_(True)
    host_loss = host(x, mask)
    host_loss.backward()
    host_grad = x.grad
    with device_form(monkeypatch):
        dev_mask = lk.high_entropy_mask(h, mask, top=0.3)
        dev = lk.EntropyBonus(coef=lk.TargetEntropyController(1.0, init_coef=0.1))
        x = logits.clone().requires_grad_(True)
        loss = dev(x, mask)
        loss.backward()
        dev.update_coef()
        additive(logits, mask)
        additive.update_coef()
        dev(logits, mask)  # the next step's coefficient, from the device
    assert torch.equal(dev_mask, host_mask)
    assert torch.equal(loss, host_loss) and torch.equal(x.grad, host_grad)
    host.update_coef()
    assert dev.coef == host.coef != 0.1
    assert additive.coef == 0.0 and additive.controller.coef == pytest.approx(0.095)  # above the target: down, gate closed


@pytest.mark.filterwarnings("ignore:Attribute 'entropy_bonus' is an instance of `nn.Module`")
@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")
def test_the_entropy_study_runs_a_controller_and_the_mask_reports_and_resumes(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("entropy_study", TESTS.parent / "examples" / "entropy_study.py")
    study = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(TESTS.parent / "examples"))
    try:
        spec.loader.exec_module(study)
        args = ["--out", str(tmp_path / "study"), "--seeds", "0", "--rollouts", "3", "--pretrain-steps", "2",
                "--png", str(tmp_path / "study.png"), "--arms", "target-additive", "top20"]
        study.main(args)
        rows = (tmp_path / "study" / "entropy_study.csv").read_text().splitlines()
        assert len(rows) == 1 + 2 and (tmp_path / "study.png").exists()
        first = capsys.readouterr().out
        assert "| top20 | 1 |" in first and "| 0.20 |" in first.split("| top20 |")[1]  # a fifth of the tokens: the mask
        study.main(args)  # every run is in the CSV: nothing runs again
        assert "[entropy_study]" not in capsys.readouterr().out
    finally:
        sys.path.remove(str(TESTS.parent / "examples"))


def test_a_number_coef_bonus_adds_nothing_to_the_state_dict_and_a_controllers_state_round_trips():
    # as KLPenaltyLoss (one ControllerState serves both): only state that exists is saved, so a model
    # with a number-coef bonus loads strictly into one without it; a controller's state comes back
    class Holder(torch.nn.Module):
        def __init__(self, bonus=None):
            super().__init__()
            self.shift = torch.nn.Parameter(torch.zeros(2))
            if bonus is not None:
                self.entropy = bonus

    sd = Holder(lk.EntropyBonus(coef=0.01)).state_dict()
    assert "entropy._extra_state" not in sd
    Holder().load_state_dict(sd, strict=True)
    ctl = lk.TargetEntropyController(target_entropy=0.5, init_coef=0.1)
    ctl.update(0.2, 8)
    sd = Holder(lk.EntropyBonus(coef=ctl)).state_dict()
    assert sd["entropy._extra_state"]["controller_class"] == "TargetEntropyController"
    fresh = Holder(lk.EntropyBonus(coef=lk.TargetEntropyController(target_entropy=0.5, init_coef=0.1)))
    fresh.load_state_dict(sd, strict=True)
    assert fresh.entropy.controller.value == ctl.value != 0.1
