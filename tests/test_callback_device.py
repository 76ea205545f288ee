"""KLRewardCallback reads nothing from the device in its per-step hook, and its device-side faults
are raised where the host reads anyway; the controller trajectory it produces, in process.

On CPU a host read cannot stall, so the test makes every way of reading a tensor's value into Python
(``item``, ``tolist``, ``__float__``, ``__int__``, ``__bool__``, ``__index__``) raise while the hook
runs. On CUDA, where available, ``torch.cuda.set_sync_debug_mode("error")`` checks the same.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

import lightning_kl as lk
import lightning_kl.ground.checks as ground_checks

B, T, STEPS = 4, 5, 6
TARGET, HORIZON, INIT = 0.3, 20.0, 0.5
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


@contextlib.contextmanager
def no_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(name: str) -> Any:
        def read(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"Tensor.{name} called: a host read inside the per-step hook")

        return read

    with monkeypatch.context() as m:
        # the form that runs on an accelerator: value checks on the device (on the CPU they read the host)
        m.setattr(ground_checks, "HOST_READ_DEVICES", frozenset())
        for name in READS:
            m.setattr(Tensor, name, refuse(name))
        yield


def rollout(step: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(step)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 2] = True  # every sequence has a valid token, not all at a prefix (holes)
    logprobs = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    ref = logprobs - (0.4 + 0.3 * (step % 3)) * torch.rand(B, T, generator=g, dtype=torch.float64)
    return {
        "scores": torch.randn(B, T, generator=g, dtype=torch.float64),  # per token, nonzero
        "logprobs": logprobs,
        "ref_logprobs": torch.where(mask, ref, float("nan")),
        "mask": mask,
    }


class Rollouts(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros((), dtype=torch.float64))
        self.seen: list[dict[str, Tensor]] = []

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader([rollout(s) for s in range(STEPS)], batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.seen.append({k: v.clone() for k, v in batch.items()})
        return (self.w * batch["rewards"].sum()) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class GuardedCallback(lk.KLRewardCallback):
    """The library's callback, its per-step hook run with every host read refused."""

    monkeypatch: pytest.MonkeyPatch

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        with no_host_reads(self.monkeypatch):
            super().on_train_batch_start(*args, **kwargs)


class Spy(pl.Callback):
    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def reference(estimator: str) -> tuple[list[float], list[Tensor]]:
    """Float64 from the documented formulas: the coefficient used for each batch and each batch's rewards."""
    value, coefs, rewards = INIT, [], []
    for step in range(STEPS):
        r = rollout(step)
        d = torch.where(r["mask"], r["logprobs"] - r["ref_logprobs"], 0.0)
        k = d if estimator == "k1" else torch.where(r["mask"], torch.exp(-d) + d - 1, 0.0)
        coefs.append(value)
        rewards.append(r["scores"] - value * k)
        seq = [float(k[i][r["mask"][i]].mean()) for i in range(B)]
        kl = sum(seq) / len(seq)
        value *= 1 + min(max(kl / TARGET - 1, -0.2), 0.2) * B / HORIZON
    return coefs + [value], rewards


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_per_step_hook_reads_nothing_and_follows_the_formula(
    estimator: str, quiet_trainer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    callback = GuardedCallback(estimator, lk.AdaptiveKLController(INIT, target_kl=TARGET, horizon=HORIZON))
    callback.monkeypatch = monkeypatch
    model, spy = Rollouts(), Spy()
    quiet_trainer(max_epochs=1, callbacks=[callback, spy], log_every_n_steps=STEPS).fit(model)
    coefs, rewards = reference(estimator)
    assert len(set(coefs)) == STEPS + 1  # the trajectory moved at every step
    # the coefficient logged for a batch is the one its rewards used (from before its update)
    logged = torch.tensor([row["kl/coef"] for row in spy.logged], dtype=torch.float64)
    assert_close(logged, torch.tensor(coefs[:-1], dtype=torch.float64), rtol=1e-12, atol=0)
    assert callback.controller.value == pytest.approx(coefs[-1], rel=1e-12)
    for seen, want in zip(model.seen, rewards):
        # per-token scores: rewards = scores - beta * k at every valid token, the score alone on padding
        assert_close(seen["rewards"], torch.where(seen["mask"], want, seen["scores"]), rtol=1e-12, atol=1e-14)
        assert not torch.equal(seen["rewards"], seen["scores"])


def test_a_non_finite_kl_leaves_the_coefficient_and_is_raised_at_the_log_step(
    quiet_trainer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    callback = GuardedCallback("k1", lk.AdaptiveKLController(INIT, target_kl=TARGET, horizon=HORIZON))
    callback.monkeypatch = monkeypatch
    model = Rollouts()

    class Poison(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:
                batch["ref_logprobs"][0, 2] = -float("inf")  # a valid token: d = +inf (a log-prob above 0 is refused)

    seen_at: list[int] = []

    class Where(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen_at.append(batch_idx)

    with pytest.raises(ValueError, match=r"non-finite KL \(inf\).*not changed"):
        quiet_trainer(max_epochs=1, callbacks=[Poison(), callback, Where()], log_every_n_steps=3).fit(model)
    assert seen_at == [0, 1]  # raised in batch 2's on_train_batch_end (the log step), not before
    coefs, _ = reference("k1")
    # batch 1's update was skipped: beta = INIT * f0 * f2, each factor f_i depending on batch i alone
    assert callback.controller.value == pytest.approx(coefs[1] * coefs[3] / coefs[2], rel=1e-12)


def test_a_sequence_dropped_by_zeroing_its_mask_is_a_normal_input(
    quiet_trainer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the DAPO habit: a truncated response dropped by zeroing its mask, with per-sequence scores.
    # Its score is dropped with it (never written on padding), it is left out of the KL, counted in
    # kl/empty_seqs, and nothing is raised (an earlier version raised a ValueError steps later)
    callback = GuardedCallback("k1", lk.FixedKLController(0.25))
    callback.monkeypatch = monkeypatch
    spy, model = Spy(), Rollouts()

    class Drop(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            batch["scores"] = batch["scores"][:, 0] + 10.0  # per sequence, nonzero
            batch["mask"][1] = False
            if batch_idx == 2:
                batch["mask"][3] = False

    quiet_trainer(max_epochs=1, callbacks=[Drop(), callback, spy], log_every_n_steps=1).fit(model)
    assert len(model.seen) == STEPS
    for step, (seen, logged) in enumerate(zip(model.seen, spy.logged)):
        mask = seen["mask"]
        assert torch.equal(seen["rewards"][1], torch.zeros(T, dtype=torch.float64))
        d = torch.where(mask, seen["logprobs"] - seen["ref_logprobs"], 0.0)
        kept = [i for i in range(B) if mask[i].any()]
        assert logged["kl/empty_seqs"] == B - len(kept) == (2 if step == 2 else 1)
        want_kl = sum(float(d[i][mask[i]].mean()) for i in kept) / len(kept)
        assert logged["kl/value"] == pytest.approx(want_kl, rel=1e-12)
        for i in kept:  # -beta * d on valid tokens, the score at the last valid one
            want = -0.25 * d[i]
            want[int(torch.nonzero(mask[i])[-1])] += seen["scores"][i]
            assert_close(seen["rewards"][i], want, rtol=1e-12, atol=1e-14)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_synchronization_on_cuda() -> None:
    callback = lk.KLRewardCallback("k3", lk.AdaptiveKLController(INIT, target_kl=TARGET, horizon=HORIZON))

    class Strategy:
        @staticmethod
        def reduce(t: Tensor, reduce_op: str) -> Tensor:
            return t

    class Trainer:
        strategy = Strategy()

    class Module:
        device = torch.device("cuda")

        @staticmethod
        def log(*args: Any, **kwargs: Any) -> None:
            pass

    batches = [{k: v.cuda() for k, v in rollout(s).items()} for s in range(3)]
    callback.on_train_batch_start(Trainer(), Module(), batches[0], 0)  # warm-up: allocations, the first fill
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, batch in enumerate(batches[1:]):
            callback.on_train_batch_start(Trainer(), Module(), batch, i + 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert callback.controller.value != INIT
