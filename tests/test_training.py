"""Every estimator name trains in a real Lightning loop: through the loss and through the callback.

Also the YAML path of the README: LightningCLI builds the model and the callback with its
controller from a config file, and a bad name fails before any training step.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import _reference as reference
import yaml
from lightning.pytorch.cli import LightningCLI
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.estimators import SAMPLED_ESTIMATORS

# the example's OnPolicyRollouts has a length on purpose (no prefetch): Lightning's remark about it is expected
pytestmark = pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")

ROOT = Path(__file__).resolve().parents[1]
SAMPLED = SAMPLED_ESTIMATORS


def _load_minimal():
    spec = importlib.util.spec_from_file_location("lk_examples_minimal", ROOT / "examples" / "minimal.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


minimal = _load_minimal()


class RecordingBandit(minimal.KLBandit):
    """The README's module, recording what training_step saw."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[dict] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        self.seen.append({k: v.clone() for k, v in batch.items()})
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


@pytest.mark.parametrize("estimator", SAMPLED)
def test_every_estimator_trains_through_the_loss(estimator, quiet_trainer):
    pl.seed_everything(0)
    model = RecordingBandit(estimator=estimator, kl_coef=1.0, batch_size=8)
    # start away from the reference so that the KL and its gradient are not zero
    with torch.no_grad():
        model.policy.logits.normal_()
    before = model.policy.logits.detach().clone()
    trainer = quiet_trainer(fast_dev_run=4, enable_checkpointing=True)
    trainer.fit(model)
    assert len(model.losses) == 4
    assert all(torch.isfinite(torch.tensor(model.losses)))
    assert not torch.equal(before, model.policy.logits.detach())
    assert torch.isfinite(trainer.callback_metrics["train/kl"])


@pytest.mark.parametrize("estimator", SAMPLED)
def test_loss_gradient_in_a_step_is_the_estimators(estimator):
    """The KL term's gradient on the policy logits, through the module, against float64 maths of the formula."""
    model = minimal.KLBandit(estimator=estimator, kl_coef=1.0, batch_size=8)
    with torch.no_grad():
        model.policy.logits.normal_(generator=torch.Generator().manual_seed(3))
    batch = next(iter(model.train_dataloader()))
    logprob = model.policy.logprob(batch["tokens"])
    loss = model.kl(logprob, batch["ref_logprobs"], batch["mask"])
    (grad,) = torch.autograd.grad(loss, model.policy.logits, retain_graph=True)
    m = batch["mask"]
    # independent of the library: log_softmax gathered in float64, then the chain rule with the
    # estimator table's d(loss)/d(logprob) = k'(d) / (number of valid tokens) on valid tokens
    logits64 = model.policy.logits.detach().double().requires_grad_()
    tokens = batch["tokens"]
    lp64 = torch.log_softmax(logits64, -1).expand(tokens.shape[0], -1, -1).gather(-1, tokens[..., None])[..., 0]
    d = torch.where(m, lp64.detach() - batch["ref_logprobs"].double(), 0.0)
    upstream = torch.where(m, reference.grad(estimator, d), 0.0) / m.sum()
    (want,) = torch.autograd.grad(lp64, logits64, grad_outputs=upstream)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert_close(grad.double(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("estimator", SAMPLED)
def test_every_estimator_trains_through_the_callback(estimator, quiet_trainer):
    pl.seed_everything(0)
    controller = lk.AdaptiveKLController(init_kl_coef=0.5, target_kl=0.01, horizon=100)
    callback = lk.KLRewardCallback(estimator=estimator, controller=controller)
    model = RecordingBandit(estimator="k1", kl_coef=0.0, batch_size=8)
    with torch.no_grad():
        model.policy.logits.normal_()
    coefs = []
    original = callback.update_controller
    callback.update_controller = lambda s, n: (coefs.append(controller.value), original(s, n))[1]
    quiet_trainer(fast_dev_run=4, enable_checkpointing=True, callbacks=[callback]).fit(model)
    assert len(model.seen) == 4
    for batch, coef in zip(model.seen, coefs):
        # the rewards training_step saw: scores at the last valid token minus beta * kl, 0 on padding
        kl = lk.kl_penalty(batch["logprobs"], batch["ref_logprobs"], estimator, mask=batch["mask"])
        last = batch["mask"].sum(-1) - 1
        want = -coef * kl
        want[torch.arange(len(last)), last] += batch["scores"]
        assert_close(batch["rewards"], want)
        assert torch.isfinite(batch["rewards"]).all()
    # the KL is far above its target, so the adaptive coefficient rises at every step
    assert controller.value > coefs[-1] > coefs[0] == 0.5


def test_callback_logs_coef_and_value(quiet_trainer):
    logged = {}

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.update({k: v.item() for k, v in trainer.callback_metrics.items()})

    callback = lk.KLRewardCallback("k3", controller=lk.FixedKLController(0.25))
    model = minimal.KLBandit(batch_size=4)
    with torch.no_grad():
        model.policy.logits.normal_()
    quiet_trainer(fast_dev_run=1, enable_checkpointing=True, callbacks=[callback, Spy()]).fit(model)
    assert logged["kl/coef"] == 0.25
    assert logged["kl/value"] > 0
    assert "train/kl" in logged


def test_callback_missing_key_names_it():
    callback = lk.KLRewardCallback()
    batch = {"scores": torch.zeros(2), "logprobs": torch.zeros(2, 3), "mask": torch.ones(2, 3, dtype=torch.bool)}
    with pytest.raises(KeyError, match=r"no key 'ref_logprobs'.*\['logprobs', 'mask', 'scores'\]"):
        callback.shape_rewards(batch)
    batch["ref_logprobs"] = torch.zeros(2, 3)
    batch["scores"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"\(2, 3\), or per sequence \(2,\); got \(3,\)"):
        callback.shape_rewards(batch)
    with pytest.raises(TypeError, match="mutable mapping"):
        callback.shape_rewards((torch.zeros(2),))


def _write_config(tmp_path, model_estimator="k3+", callback_estimator="k1"):
    config = yaml.safe_load((ROOT / "examples" / "configs" / "minimal.yaml").read_text())
    config["model"]["estimator"] = model_estimator
    config["model"]["num_batches"] = 3
    config["trainer"].update(default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False,
                             enable_checkpointing=False, enable_model_summary=False)
    config["trainer"]["callbacks"][0]["init_args"]["estimator"] = callback_estimator
    path = tmp_path / "input.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class _CountingBandit(minimal.KLBandit):
    steps = 0

    def training_step(self, batch, batch_idx):
        type(self).steps += 1
        return super().training_step(batch, batch_idx)


def test_yaml_config_builds_and_trains(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["minimal.py"])
    _CountingBandit.steps = 0
    cli = LightningCLI(_CountingBandit, args=["fit", "--config", str(_write_config(tmp_path, "low_var_kl+", "k3+"))])
    assert _CountingBandit.steps == 3
    assert cli.model.kl.estimator == "low_var_kl+"
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, lk.KLRewardCallback)]
    assert callback.estimator == "k3+"
    assert isinstance(callback.controller, lk.AdaptiveKLController)
    assert callback.controller.target_kl == 0.5
    assert callback.controller.value != 0.1  # it was updated by training


@pytest.mark.parametrize("where", ["model", "callback"])
def test_yaml_bad_estimator_fails_before_training(where, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["minimal.py"])
    _CountingBandit.steps = 0
    names = {"model_estimator": "k3 +"} if where == "model" else {"callback_estimator": "k3 +"}
    with pytest.raises(ValueError, match=r"Unknown KL estimator 'k3 \+'.*Valid names: 'k1'.*'low_var_kl\+'"):
        LightningCLI(_CountingBandit, args=["fit", "--config", str(_write_config(tmp_path, **names))])
    assert _CountingBandit.steps == 0


def test_minimal_rollouts_are_on_policy(quiet_trainer):
    """Each batch's behaviour log-probs are the policy's as training_step sees it (no prefetch)."""
    gaps = []

    class Checking(minimal.KLBandit):
        def training_step(self, batch, batch_idx):
            m = batch["mask"]
            now = self.policy.logprob(batch["tokens"]).detach()
            gaps.append((now[m] - batch["logprobs"][m]).abs().max().item())
            return super().training_step(batch, batch_idx)

    model = Checking(batch_size=8, lr=0.5, num_batches=5)
    # a plain run, not fast_dev_run: a limit on the batches would hide Lightning's prefetch
    quiet_trainer(max_epochs=1).fit(model)
    assert len(gaps) == 5 and max(gaps) < 1e-6, gaps
