"""lk.ReferenceRefresh and lightning_kl.mixing against float64 maths, enumeration and real Trainer loops.

What each test would catch: a refresh before the optimizer step (the reference lags the policy by
one step), ``alpha`` and ``1 - alpha`` swapped, a counter that ignores accumulation or resumes at 0,
a trigger window that does not restart, adapters folded without their scaling or transpose, a
policy changed by the fold, a decision taken on one process's view.
"""

from __future__ import annotations

import copy
import math
import pickle
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.refresh.mixing import mix_, mix_modules_
from _trainers import make_quiet_trainer

V, B, T = 7, 4, 6


class TinyLM(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, 8)
        self.head = nn.Linear(8, V)
        self.register_buffer("temperature", torch.tensor(1.0 + seed / 10))  # a floating buffer: mixed
        self.register_buffer("calls", torch.tensor(seed))  # a counter: copied on a hard reset only

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(tokens))) / self.temperature


def tokens_of_step(i: int) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(i))


def logprobs(model: nn.Module, tokens: Tensor) -> Tensor:
    return lk.token_logprobs(model(tokens[:, :-1]), tokens[:, 1:])


class PolicyAndRef(pl.LightningModule):
    """A policy trained with a KL term toward a separate reference; logs a scripted KL if given."""

    def __init__(self, steps: int, kl_log: Optional[list[float]] = None) -> None:
        super().__init__()
        self.policy = TinyLM(0)
        self.ref = TinyLM(1).requires_grad_(False)
        self.kl = lk.KLPenaltyLoss("k3+", coef=0.1)
        self.steps, self.kl_log, self.calls = steps, kl_log, 0

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader([tokens_of_step(i) for i in range(self.steps)], batch_size=None)

    def training_step(self, tokens: Tensor, batch_idx: int) -> Tensor:
        self.calls += 1
        lp = logprobs(self.policy, tokens)
        with torch.no_grad():
            ref = logprobs(self.ref, tokens)
        if self.kl_log is not None:
            self.log("my/kl", self.kl_log[self.global_step], on_step=True, on_epoch=False)
        return -(lp * (tokens[:, 1:].float() - 3)).mean() + self.kl(lp, ref)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.policy.parameters(), lr=0.05)


class Recorder(Callback):
    """At each batch end (after the callbacks before it): step, counters, copies of the two models."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        refresh = next(c for c in trainer.callbacks if isinstance(c, lk.ReferenceRefresh))
        row = {"step": trainer.global_step, "refreshes": refresh.refreshes, "last_step": refresh.last_step,
               "opt_state": len(trainer.optimizers[0].state)}
        row["policy"] = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}
        if isinstance(getattr(pl_module, "ref", None), nn.Module):
            row["ref"] = {k: v.detach().clone() for k, v in pl_module.ref.state_dict().items()}
        self.rows.append(row)


def fit(root: Path, module: pl.LightningModule, *callbacks: Callback, **kwargs: Any) -> pl.Trainer:
    trainer = make_quiet_trainer(root, max_epochs=1, callbacks=list(callbacks), **kwargs)
    trainer.fit(module)
    return trainer


# ---------------------------------------------------------------------------------------------
# the maths


def test_mix_equals_the_float64_formula_and_alpha_one_copies_bitwise() -> None:
    ref, pol = TinyLM(1), TinyLM(2)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    alpha = 0.3
    assert mix_modules_(ref, pol, alpha) == 4  # 3 parameters + the floating buffer; the counter stays
    for name, value in ref.state_dict().items():
        if name == "calls":
            assert value.item() == 1
            continue
        want = alpha * pol.state_dict()[name].double() + (1 - alpha) * before[name].double()
        assert_close(value.double(), want, rtol=0, atol=4e-7)  # one float32 rounding from float64
        assert not torch.equal(value, pol.state_dict()[name])
    assert mix_modules_(ref, pol, 1.0) == 5
    for name, value in ref.state_dict().items():
        assert torch.equal(value, pol.state_dict()[name])  # bitwise, the counter too


def test_mix_computes_a_half_precision_reference_in_float32() -> None:
    ref, pol = torch.full((3,), 1.0, dtype=torch.bfloat16), torch.tensor([2.0, 1.0 + 2**-9, 0.0])
    mix_(ref, pol, 0.5)  # in float32, rounded once to bf16
    assert ref.tolist() == torch.tensor([1.5, 1.0 + 2**-10, 0.5]).to(torch.bfloat16).tolist()


def test_models_that_differ_are_named() -> None:
    with pytest.raises(ValueError, match="only in the policy: \\['extra'\\]"):
        pol = TinyLM(0)
        pol.extra = nn.Parameter(torch.zeros(1))
        mix_modules_(TinyLM(1), pol, 0.5)
    ref = TinyLM(1)
    ref.head = nn.Linear(8, V + 1)
    with pytest.raises(ValueError, match=r"`head.weight` has shape \(8, 8\) in the reference and \(7, 8\)"):
        mix_modules_(ref, TinyLM(0), 1.0)


# ---------------------------------------------------------------------------------------------
# a separate reference in a Trainer


def test_hard_reset_in_a_trainer_gives_kl_exactly_zero_and_bitwise_logprobs(tmp_path: Path) -> None:
    module, rec = PolicyAndRef(steps=5), Recorder()
    initial_ref = copy.deepcopy(module.ref.state_dict())
    refresh = lk.ReferenceRefresh(every_n_steps=3)
    fit(tmp_path, module, refresh, rec)
    assert [(r["step"], r["refreshes"], r["last_step"]) for r in rec.rows] == [
        (1, 0, -1), (2, 0, -1), (3, 1, 3), (4, 1, 3), (5, 1, 3)]
    for row in rec.rows[:2]:  # untouched before the first refresh
        assert all(torch.equal(row["ref"][k], v) for k, v in initial_ref.items())
    at3 = rec.rows[2]
    # the policy *after* step 3's optimizer step, bitwise (a refresh before the step would lag)
    assert all(torch.equal(at3["ref"][k], v) for k, v in at3["policy"].items())
    assert not torch.equal(rec.rows[4]["ref"]["head.weight"], rec.rows[4]["policy"]["head.weight"])
    # right after a refresh: the same log-probs, bitwise, and every estimator's KL exactly 0
    probe = TinyLM(0)
    probe.load_state_dict(at3["policy"])
    ref = TinyLM(0)
    ref.load_state_dict(at3["ref"])
    tokens = tokens_of_step(99)
    lp, ref_lp = logprobs(probe, tokens), logprobs(ref, tokens).detach()
    assert torch.equal(lp, ref_lp)
    for estimator in ("k1", "k2", "k3", "abs", "low_var_kl"):
        assert torch.count_nonzero(lk.kl_penalty(lp, ref_lp, estimator)) == 0


def test_ema_in_a_trainer_follows_the_formula_at_the_right_steps(tmp_path: Path) -> None:
    module, rec = PolicyAndRef(steps=6), Recorder()
    ref = {k: v.double() for k, v in module.ref.state_dict().items() if k != "calls"}
    fit(tmp_path, module, lk.ReferenceRefresh(every_n_steps=2, alpha=0.25), rec)
    for row in rec.rows:
        if row["step"] % 2 == 0:  # ref := 0.25 * policy + 0.75 * ref, from float64 maths
            ref = {k: 0.25 * row["policy"][k].double() + 0.75 * v for k, v in ref.items()}
        for k, v in ref.items():
            assert_close(row["ref"][k].double(), v, rtol=0, atol=1e-6)
        assert row["ref"]["calls"].item() == 1  # a counter is not mixed
    assert rec.rows[-1]["refreshes"] == 3


# the loss is there for the KL trigger, not for its gradient under accumulation: its warning is expected
@pytest.mark.filterwarnings("ignore:KLPenaltyLoss\\(agg='token-mean'\\) is accumulating gradients")
def test_steps_count_optimizer_steps_under_accumulation_and_epochs_trigger_too(tmp_path: Path) -> None:
    module, rec = PolicyAndRef(steps=8), Recorder()
    fit(tmp_path, module, lk.ReferenceRefresh(every_n_steps=2, every_n_epochs=1), rec, accumulate_grad_batches=2)
    # 8 batches = 4 optimizer steps: refreshes after steps 2 and 4; the epoch's end at step 4 is not a second one
    assert [(r["step"], r["refreshes"]) for r in rec.rows] == [(0, 0), (1, 0), (1, 0), (2, 1), (2, 1), (3, 1), (3, 1), (4, 2)]
    module, rec = PolicyAndRef(steps=3), Recorder()
    refresh = lk.ReferenceRefresh(every_n_epochs=1)
    fit(tmp_path, module, refresh, rec)
    assert (refresh.refreshes, refresh.last_step) == (1, 3)
    assert all(torch.equal(module.ref.state_dict()[k], v) for k, v in module.policy.state_dict().items())


def test_every_n_steps_counts_the_steps_of_a_manual_optimization_batch(tmp_path: Path) -> None:
    class ThreeSteps(PolicyAndRef):
        def __init__(self, steps: int) -> None:
            super().__init__(steps)
            self.automatic_optimization = False

        def training_step(self, tokens: Tensor, batch_idx: int) -> None:
            opt = self.optimizers()
            for _ in range(3):  # PPO-style: several optimizer steps on one rollout batch
                opt.zero_grad()
                self.manual_backward(super().training_step(tokens, batch_idx))
                opt.step()

    module, rec = ThreeSteps(steps=3), Recorder()
    fit(tmp_path, module, lk.ReferenceRefresh(every_n_steps=4), rec)
    # steps 3, 6, 9 after the batches: multiples of 4 are crossed in batches 2 (4) and 3 (8); `step % 4 == 0` never holds
    assert [(r["step"], r["refreshes"], r["last_step"]) for r in rec.rows] == [(3, 0, -1), (6, 1, 6), (9, 2, 9)]


KL_LOG = [0.5, 2.0, 2.0, 0.5, 2.0, float("nan"), 2.0, 2.0, 2.0, 2.0]


def test_kl_trigger_by_enumeration_with_the_optimizer_reset(tmp_path: Path) -> None:
    # above 1.0 at steps 2 3 5 7 8 9 10 (NaN at 6 is not above); window 2, restarted by each refresh:
    # counts 0 1 2* 0 1 0 1 2* 1 2*  ->  refreshes after steps 3, 8 and 10
    module, rec = PolicyAndRef(steps=10, kl_log=KL_LOG), Recorder()
    refresh = lk.ReferenceRefresh(kl_threshold=1.0, kl_window=2, kl_metric="my/kl", reset_optimizer=True)
    fit(tmp_path, module, refresh, rec)
    assert [r["last_step"] for r in rec.rows] == [-1, -1, 3, 3, 3, 3, 3, 8, 8, 10]
    # Adam's state is empty right after each refresh, and only then
    assert [r["step"] for r in rec.rows if r["opt_state"] == 0] == [3, 8, 10]


def test_kl_trigger_on_a_kl_penalty_loss_metric_which_is_exactly_zero_after_each_hard_reset(tmp_path: Path) -> None:
    class LogsLossMetric(PolicyAndRef):
        def training_step(self, tokens: Tensor, batch_idx: int) -> Tensor:
            loss = super().training_step(tokens, batch_idx)
            self.log("train/kl", self.kl.metric, on_step=True, on_epoch=False)  # this step's k3 estimate
            return loss

    kls: list[float] = []

    class KL(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            kls.append(float(trainer.callback_metrics["train/kl"]))

    # any KL > 0 counts; window 2. The step after a hard reset computes its loss with policy == reference:
    # KL exactly 0, which restarts the window: refreshes after steps 2 and 5, KL 0 at steps 3 and 6
    refresh = lk.ReferenceRefresh(kl_threshold=1e-12, kl_window=2, kl_metric="train/kl")
    rec = Recorder()
    fit(tmp_path, LogsLossMetric(steps=6), refresh, rec, KL())
    assert [r["last_step"] for r in rec.rows] == [-1, 2, 2, 2, 5, 5]
    assert [kl == 0.0 for kl in kls] == [False, False, True, False, False, True]


def test_kl_trigger_reads_the_kl_reward_callback_and_restores_its_coefficient(tmp_path: Path) -> None:
    class Rollouts(PolicyAndRef):
        def train_dataloader(self) -> Any:
            # k1 KL of batch i: its constant log-ratio d_i (all tokens valid)
            data = [{"scores": torch.zeros(B), "logprobs": torch.zeros(B, T), "ref_logprobs": torch.full((B, T), -d),
                     "mask": torch.ones(B, T, dtype=torch.bool)} for d in (0.1, 0.9, 0.9, 0.1, 0.9)]
            return torch.utils.data.DataLoader(data, batch_size=None)

        def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
            return super().training_step(tokens_of_step(batch_idx), batch_idx) + 0 * batch["rewards"].sum()

    coefs: list[float] = []

    class Coef(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            coefs.append(reward.controller.value)

    reward = lk.KLRewardCallback("k1", lk.AdaptiveKLController(0.2, target_kl=0.5, horizon=10))
    refresh = lk.ReferenceRefresh(kl_threshold=0.5, kl_window=2, kl_metric=reward, reset_controller=True)
    assert refresh.kl_metric == "kl/value"
    fit(tmp_path, Rollouts(steps=5), reward, refresh, Coef())
    assert (refresh.refreshes, refresh.last_step) == (1, 3)  # KL above 0.5 at steps 2 and 3
    # beta *= 1 + clip(KL / 0.5 - 1, +-0.2) * 4 / 10 per batch, and back to 0.2 at the refresh
    want, beta = [], 0.2
    for step, d in enumerate((0.1, 0.9, 0.9, 0.1, 0.9), start=1):
        beta *= 1 + max(min(d / 0.5 - 1, 0.2), -0.2) * B / 10
        beta = 0.2 if step == 3 else beta
        want.append(beta)
    assert coefs == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# bad configuration


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(every_n_steps=1, alpha=0.0), r"`alpha` must be a number in \(0, 1\].*got 0.0"),
        (dict(every_n_steps=1, alpha=1.5), r"`alpha` must be a number in \(0, 1\].*got 1.5"),
        (dict(every_n_steps=1, alpha=-0.1), r"got -0.1"),
        (dict(every_n_steps=1, alpha=float("nan")), r"got nan"),
        (dict(every_n_steps=1, alpha=True), r"got True"),
        (dict(), "needs a trigger: set `every_n_steps`"),
        (dict(alpha=0.5), "needs a trigger"),
        (dict(every_n_steps=0), "`every_n_steps` must be None or a positive integer, got 0"),
        (dict(every_n_epochs=2.5), "`every_n_epochs` must be None or a positive integer, got 2.5"),
        (dict(kl_threshold=0.0), "`kl_threshold` must be None or a finite number > 0"),
        (dict(kl_threshold=1.0, kl_window=0), "`kl_window` must be a positive integer"),
        (dict(kl_threshold=1.0, kl_metric=""), "`kl_metric` must be a logged metric's name"),
        (dict(every_n_steps=1, reference="policy"), "set reference=None"),
        (dict(every_n_steps=1, policy=""), "`policy` must be the name of a LightningModule attribute"),
        (dict(every_n_steps=1, reset_optimizer="yes"), "`reset_optimizer` must be True or False"),
    ],
)
def test_bad_configuration_fails_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lk.ReferenceRefresh(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(every_n_steps=1, reference="reference"), "PolicyAndRef has no attribute 'reference'"),
        (dict(every_n_steps=1, reference="kl"), "only in the reference"),
        (dict(every_n_steps=1, reference=None), "TinyLM has no peft LoRA layer"),
        (dict(kl_threshold=1.0), "no KLRewardCallback in this Trainer logs it"),
    ],
)
def test_bad_models_or_sources_fail_before_the_first_step(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    module = PolicyAndRef(steps=2)
    with pytest.raises(ValueError, match=match):
        fit(tmp_path, module, lk.ReferenceRefresh(**kwargs))
    assert module.calls == 0


def test_a_kl_metric_nobody_logs_stops_the_run_at_the_first_step(tmp_path: Path) -> None:
    module = PolicyAndRef(steps=3, kl_log=[1.0] * 3)
    with pytest.raises(ValueError, match=r"'train/kl' was not logged by the first optimizer step; the run logs \['my/kl'"):
        fit(tmp_path, module, lk.ReferenceRefresh(kl_threshold=0.5, kl_metric="train/kl"))
    assert module.calls == 1


# ---------------------------------------------------------------------------------------------
# resume


# a mid-epoch resume with fresh callbacks on purpose: Lightning's two reminders are expected
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`", "ignore:You're resuming from a checkpoint that ended before")
def test_resume_mid_window_reproduces_the_refresh_steps_and_the_reference(tmp_path: Path) -> None:
    # KL above 1 at steps 3 4 5 (window 3: refresh after 5) and every 7 steps; checkpoint after step 4,
    # inside the window: a resume that forgets the window refreshes at step 7 only (or late)
    kl_log = [0.0, 0.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0]

    def callbacks() -> list[Callback]:
        return [lk.ReferenceRefresh(every_n_steps=7, kl_threshold=1.0, kl_window=3, kl_metric="my/kl", alpha=0.5), Recorder()]

    def checkpoint() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=4, save_top_k=-1)

    class StepData(PolicyAndRef):  # the data of step s whatever the loader's position (it restarts on resume)
        def training_step(self, tokens: Tensor, batch_idx: int) -> Tensor:
            return super().training_step(tokens_of_step(self.global_step), batch_idx)

    full = StepData(steps=8, kl_log=kl_log)
    first = callbacks()
    fit(tmp_path / "a", full, *first, checkpoint(), enable_checkpointing=True)
    assert [r["last_step"] for r in first[1].rows] == [-1, -1, -1, -1, 5, 5, 7, 7]

    resumed = StepData(steps=8, kl_log=kl_log)
    second = callbacks()
    trainer = make_quiet_trainer(tmp_path / "b", max_epochs=1, callbacks=second)
    trainer.fit(resumed, ckpt_path=tmp_path / "ckpt" / "step=4.ckpt")
    assert [(r["step"], r["last_step"]) for r in second[1].rows] == [(5, 5), (6, 5), (7, 7), (8, 7)]
    assert second[0].state_dict() == first[0].state_dict()
    for k, v in full.ref.state_dict().items():
        assert torch.equal(resumed.ref.state_dict()[k], v)


def test_state_key_and_pickle() -> None:
    a = lk.ReferenceRefresh(every_n_steps=3, reference="ref")
    b = lk.ReferenceRefresh(every_n_steps=3, reference="ref_b", log_prefix="ref_b/")
    assert a.state_key != b.state_key
    a.refreshes, a.steps_above = 2, 1
    c = pickle.loads(pickle.dumps(a))
    assert c.state_dict() == a.state_dict() and (c.alpha, c.every_n_steps) == (1.0, 3)


# ---------------------------------------------------------------------------------------------
# two processes


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from _ddp import run_ddp_worker

    return run_ddp_worker(Path(__file__).with_name("_refresh_ddp_worker.py"), tmp_path_factory.mktemp("two_ranks"))


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_every_rank_holds_the_same_reference_after_refreshes(two_ranks: list[dict[str, Any]], mode: str) -> None:
    records = [r[mode] for r in two_ranks]
    # the ranks logged 2.0 / 0.0 at steps 1 and 3: their mean 1.0 > 0.5 refreshes both ranks there; at
    # step 2, 1.0 / 0.0: the mean is exactly the threshold (no refresh) while the sum, 1.0, is above it
    assert [r["last_steps"] for r in records] == [[1, 1, 3]] * 2
    assert records[0]["policy"] == records[1]["policy"]  # the ranks trained one policy on different data
    assert records[0]["ref"] == records[1]["ref"]  # and hold one reference, exactly
    assert records[0]["ref"] != records[0]["policy"]  # alpha = 0.5: a mix, not a copy
    assert max(r["ema_error"] for r in records) < 1e-6  # the formula's float64 maths, from the start
    # each rank mixed its own shards under FSDP2
    assert set(records[0]["sharded"]) == ({"DTensor"} if mode == "fsdp2" else {"Parameter"})


def test_a_kl_exactly_at_the_threshold_does_not_trigger() -> None:
    # "exceeds": a KL equal to kl_threshold restarts the window; the next float above it counts
    refresh = lk.ReferenceRefresh(kl_threshold=0.5, kl_window=1)
    assert not refresh.kl_triggers(0.5) and refresh.steps_above == 0
    assert refresh.kl_triggers(math.nextafter(0.5, 1.0))
