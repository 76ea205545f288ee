"""The loss's state across fits and checkpoints, the callback that steps it, and the entry point that adds it.

Each test fails on the mistake named in its docstring (planted by hand when written)."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

import lightning_kl as lk
from lightning_kl.coefficient import UNSTEPPED_FORWARDS


def _batch(seed: int, b: int = 3, t: int = 5) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"logprob": -torch.rand(b, t, generator=g) - 0.1, "ref": -torch.rand(b, t, generator=g) - 0.1, "mask": torch.rand(b, t, generator=g) > 0.3}


def _controller() -> lk.KLController:
    return lk.TargetKLController(target_kl=0.1, init_kl_coef=0.3, step_size=0.5, max_kl_coef=2.0)  # no clipping: the KL counts


class Policy(pl.LightningModule):
    """Per-position offsets on fixed log-probs and a controlled KL loss; fails at ``fail_at`` (a micro-batch)."""

    def __init__(self, coef: Any = None, n: int = 12, fail_at: int = -1, build_in_configure_model: bool = False) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(5))
        self.coef_arg = _controller() if coef is None else coef
        self.kl: Any = None if build_in_configure_model else lk.KLPenaltyLoss("k3+", coef=self.coef_arg, agg="token-sum")
        self.n, self.fail_at = n, fail_at

    def configure_model(self) -> None:
        if self.kl is None:
            self.kl = lk.KLPenaltyLoss("k3+", coef=self.coef_arg, agg="token-sum")

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader([_batch(i) for i in range(self.n)], batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logprob = (batch["logprob"] + self.shift).clamp(max=0.0)
        loss = self.kl(logprob, batch["ref"], batch["mask"])
        if batch_idx == self.fail_at:
            raise RuntimeError("stopped inside an accumulation window")
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(tmp_path: Any, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(**{**dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                               enable_model_summary=False, default_root_dir=tmp_path), **kwargs})


def test_a_fit_stopped_inside_an_accumulation_window_leaves_nothing_for_the_next_fit(tmp_path: Any) -> None:
    """F3: without the reset at fit start/end, the next fit's first update mixes in the stopped fit's sums."""
    model = Policy(fail_at=4)  # micro-batches 3 and 4 of step 2 (of 3 each) are in the loss when it stops
    with pytest.raises(RuntimeError, match="accumulation window"):
        _trainer(tmp_path, max_steps=4, accumulate_grad_batches=3).fit(model)
    clean = Policy()
    clean.load_state_dict(model.state_dict())  # the same parameters and controller, no open step
    for m in (model, clean):
        m.fail_at = -1
        _trainer(tmp_path, max_steps=1, accumulate_grad_batches=3).fit(m)
    assert model.kl.coef == clean.kl.coef  # exactly: the same step's sums, nothing more
    assert model.kl.coef != pytest.approx(0.3)  # and the step moved it


class ManualTwo(Policy):
    """Manual optimization with two optimizers: one optimizer step each per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.other = nn.Parameter(torch.zeros(1))
        self.automatic_optimization = False

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        logprob = (batch["logprob"] + self.shift).clamp(max=0.0)
        loss = self.kl(logprob, batch["ref"], batch["mask"]) + self.other.square().sum()
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([self.shift], lr=0.1), torch.optim.SGD([self.other], lr=0.1)


class Recorder(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []
        self.coefs: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if "kl/value" in trainer.callback_metrics:  # logged at the end of an optimizer step
            self.values.append(float(trainer.callback_metrics["kl/value"]))
            self.coefs.append(float(trainer.callback_metrics["kl/coef"]))


def test_only_the_first_optimizer_closes_the_loss_step(tmp_path: Any) -> None:
    """Survivor 13: a step closed for every optimizer gives the second an empty step, logged as NaN."""
    model, rec = ManualTwo(), Recorder()
    _trainer(tmp_path, max_steps=8, callbacks=[rec]).fit(model)  # 4 batches, 2 optimizer steps each
    assert len(rec.values) == 4 and all(math.isfinite(v) for v in rec.values), rec.values
    assert len(set(rec.coefs)) == 4  # one update per batch: each batch used a new coefficient


def test_a_users_callback_beside_the_entry_points_steps_the_loss_once(tmp_path: Any) -> None:
    """Survivor 14: two instances that both act close every step twice; the second logs NaN."""
    alone, rec_alone = Policy(n=4), Recorder()
    _trainer(tmp_path, max_steps=4, callbacks=[rec_alone]).fit(alone)
    twice, rec_twice = Policy(n=4), Recorder()
    trainer = _trainer(tmp_path, max_steps=4, callbacks=[lk.KLLossCallback(), rec_twice])
    assert sum(isinstance(cb, lk.KLLossCallback) for cb in trainer.callbacks) == 2  # the user's and the entry point's
    trainer.fit(twice)
    assert all(math.isfinite(v) for v in rec_twice.values), rec_twice.values
    assert rec_twice.values == rec_alone.values and twice.kl.coef == alone.kl.coef


def test_a_loss_built_in_configure_model_is_attached_and_stepped(tmp_path: Any) -> None:
    model, rec = Policy(n=6, build_in_configure_model=True), Recorder()
    seen: list[Any] = []

    class Peek(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            seen.append(pl_module.kl._trainer_accumulation())

    _trainer(tmp_path, max_steps=3, accumulate_grad_batches=2, callbacks=[rec, Peek()]).fit(model)
    assert seen == [2] * 6  # it reads the Trainer's k: attached
    assert model.kl.coef != pytest.approx(0.3) and len(set(rec.values)) == 3 and all(math.isfinite(v) for v in rec.values)


def test_a_controller_that_never_moves_in_a_plain_loop_warns_once_naming_the_fix() -> None:
    """F5: a loop that never calls update_coef()."""
    loss = lk.KLPenaltyLoss("k3+", coef=_controller())
    b = _batch(0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(UNSTEPPED_FORWARDS + 10):
            loss(b["logprob"], b["ref"], b["mask"])
    mine = [w for w in record if "has not moved" in str(w.message)]
    assert len(mine) == 1 and "update_coef()" in str(mine[0].message) and "KLLossCallback" in str(mine[0].message)
    assert mine[0].filename == __file__  # at the user's line
    # a loop that closes its steps is never told
    loss = lk.KLPenaltyLoss("k3+", coef=_controller())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(UNSTEPPED_FORWARDS + 10):
            loss(b["logprob"], b["ref"], b["mask"])
            loss.update_coef()
    assert not [w for w in record if "has not moved" in str(w.message)]
    # nor are validation forwards (eval mode) counted
    loss = lk.KLPenaltyLoss("k3+", coef=_controller()).eval()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(UNSTEPPED_FORWARDS + 10):
            loss(b["logprob"], b["ref"], b["mask"])
    assert not [w for w in record if "has not moved" in str(w.message)]


def test_a_trainer_without_the_callback_warns_that_the_controller_never_moves(tmp_path: Any) -> None:
    """F6: a Trainer whose KLLossCallback is gone (a source tree without the entry point, or removed)."""
    model = Policy(n=UNSTEPPED_FORWARDS + 2)
    trainer = _trainer(tmp_path, max_steps=UNSTEPPED_FORWARDS + 2)
    trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, lk.KLLossCallback)]
    with pytest.warns(UserWarning, match="has not moved"):
        trainer.fit(model)
    assert model.kl.coef == pytest.approx(0.3)  # indeed never moved


# -- E1: only state that exists is in the state_dict; checkpoints of 0.2 and of the development version load


class Holder(nn.Module):
    def __init__(self, coef: Any) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.arange(3.0))
        self.kl = lk.KLPenaltyLoss("k3+", coef=coef)


class Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(3))


def test_a_copied_or_unpickled_loss_is_found_by_the_callback(tmp_path: Any) -> None:
    import pickle

    original = Policy(n=4)
    copies = [copy.deepcopy(original), pickle.loads(pickle.dumps(original))]
    del original
    import gc

    gc.collect()
    for model in copies:
        seen: list[Any] = []

        class Peek(Callback):
            def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
                seen.append(pl_module.kl._trainer_accumulation())

        _trainer(tmp_path, max_steps=2, accumulate_grad_batches=2, callbacks=[Peek()]).fit(model)
        assert seen == [2] * 4


def test_a_number_coef_adds_nothing_to_the_state_dict() -> None:
    state = Holder(0.1).state_dict()
    assert list(state) == ["shift"]
    Bare().load_state_dict(state, strict=True)  # a model without the loss takes it
    assert "kl._extra_state" in Holder(_controller()).state_dict()  # a controller's state does exist


def test_checkpoints_of_0_2_and_of_the_development_version_load_strictly() -> None:
    shift = torch.arange(3.0)
    v0_2 = {"shift": shift}  # 0.2: the loss kept no state
    main_number = {"shift": shift, "kl._extra_state": {}}  # before this change: {} for a number coef
    ctl = _controller()
    ctl.update(0.5, 4)
    main_controller = {"shift": shift, "kl._extra_state": {"controller_class": "TargetKLController", "controller": ctl.state_dict()}}
    for saved in (v0_2, main_number):
        m = Holder(0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m.load_state_dict(copy.deepcopy(saved), strict=True)
        assert torch.equal(m.shift, shift) and m.kl.coef == 0.1
    m = Holder(_controller())
    m.load_state_dict(copy.deepcopy(main_controller), strict=True)
    assert m.kl.coef == pytest.approx(ctl.value, rel=0, abs=0)
    m = Holder(_controller())
    with pytest.warns(UserWarning, match="holds no controller state"):  # 0.2 had no controller: the configured one stays
        m.load_state_dict(copy.deepcopy(v0_2), strict=True)
    assert m.kl.coef == pytest.approx(0.3)


# -- the entry point


_PROBE = r"""
import importlib.metadata, json, sys, time, warnings
pre = %s
if pre:
    import lightning_kl
before = set(sys.modules)
t0 = time.perf_counter()
(ep,) = [e for e in importlib.metadata.entry_points(group="lightning.pytorch.callbacks_factory") if e.name == "lightning_kl"]
out = ep.load()()
ms = (time.perf_counter() - t0) * 1e3
new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("lightning_kl", "_lightning_kl_entry"))
print(json.dumps({"new": new, "out": [type(c).__name__ for c in out], "ms": ms}))
"""


def _probe(pre: bool) -> dict[str, Any]:
    run = subprocess.run([sys.executable, "-c", _PROBE % pre], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_entry_point_is_light_and_adds_nothing_to_a_program_that_does_not_use_the_package() -> None:
    unused = _probe(pre=False)
    assert unused["out"] == []  # Lightning then logs no "Adding 1 callbacks"
    package = [m for m in unused["new"] if m.startswith("lightning_kl")]
    assert len(package) <= 3 and not any("kernels" in m for m in package), unused["new"]
    used = _probe(pre=True)
    assert used["out"] == ["KLLossCallback"]
    assert not any("kernels" in m for m in used["new"])


def test_the_entry_point_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import _lightning_kl_entry as entry

    monkeypatch.setitem(sys.modules, "lightning_kl.callbacks.kl_loss", None)  # its import now fails
    monkeypatch.setattr(entry, "_warned", [False])
    with pytest.warns(RuntimeWarning, match="could not add KLLossCallback"):
        assert entry.callbacks_factory() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert entry.callbacks_factory() == []  # one warning, then quiet
