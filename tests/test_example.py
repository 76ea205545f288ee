"""The RL fine-tuning example (examples/toy_rlhf.py): its configs, its data pipeline, every estimator."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import lightning_kl as lk
from lightning_kl.estimators import ESTIMATORS, SAMPLED_ESTIMATORS

# the example's dataset has a length on purpose and is read in-process: Lightning's warning about it does not apply
pytestmark = pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIG_NAMES = ("grpo_k3plus", "grpo_k3plus_seq", "ppo_adaptive_k1", "ppo_fixed_k1")
CONFIGS = [EXAMPLES / "configs" / f"{name}.yaml" for name in CONFIG_NAMES]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # jsonargparse and pickle look classes up by module name
    spec.loader.exec_module(module)
    return module


toy = _load("toy_rlhf")
check_run = _load("check_run")

# tiny sizes: a 1-layer model, 4 sequences of 4 response tokens, 3 pretraining steps
TINY_MODEL = dict(d_model=16, n_layer=1, n_head=2, pretrain_steps=3, pretrain_batch_size=8)
TINY_DATA = dict(prompts_per_rollout=2, group_size=2, max_new_tokens=4, reference_samples=16)
TINY_ARGS = [f"--model.{k}={v}" for k, v in TINY_MODEL.items()] + [f"--data.{k}={v}" for k, v in TINY_DATA.items()]
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["toy_rlhf.py"])  # LightningCLI reads args=, not pytest's argv
    # tiny matrices: a second intra-op thread only adds spin-waiting when the cores are shared
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    # one reference for the whole module: the cache is keyed by config, so later tests reuse it
    return str(tmp_path_factory.mktemp("reference"))


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ---------------------------------------------------------------------------------------------
# the configs, through LightningCLI


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_config_fast_dev_run(config: Path, tmp_path: Path, cache_dir: str):
    cli = toy.main(
        ["fit", "--config", str(config), "--trainer.fast_dev_run=true", "--trainer.logger=false",
         f"--trainer.default_root_dir={tmp_path}", f"--model.cache_dir={cache_dir}", *TINY_ARGS, *QUIET]
    )
    module, trainer = cli.model, cli.trainer
    assert trainer.fit_loop.epoch_loop.batch_progress.total.completed == 1
    # one rollout, at least one optimizer step: the policy left the reference
    assert not torch.equal(_params(module.policy), _params(module.ref))
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    reward_cbs = [cb for cb in trainer.callbacks if isinstance(cb, lk.KLRewardCallback)]
    if config.stem.startswith("grpo_k3plus"):
        assert module.kl.estimator == "k3+" and module.hparams.advantage == "grpo" and not reward_cbs
        assert module.kl.level == ("sequence" if config.stem.endswith("_seq") else "token")
        assert "train/kl_est" in trainer.callback_metrics
    else:
        assert module.kl is None and module.hparams.ppo_epochs == 2
        (cb,) = reward_cbs
        assert cb.estimator == "k1"
        expected = lk.AdaptiveKLController if config.stem == "ppo_adaptive_k1" else lk.FixedKLController
        assert isinstance(cb.controller, expected)
        assert {"kl/coef", "kl/value"} <= set(trainer.callback_metrics)


def test_a_short_run_writes_csv_plot_and_reuses_the_reference(tmp_path: Path, cache_dir: str, capsys):
    config = EXAMPLES / "configs" / "ppo_adaptive_k1.yaml"
    args = ["fit", "--config", str(config), "--data.rollouts=4", f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.enable_checkpointing=false",
            f"--model.cache_dir={tmp_path / 'ref'}", *TINY_ARGS, *QUIET]
    first = toy.main(args)
    assert not first.model.reference_cached
    log_dir = tmp_path / "ppo_adaptive_k1" / "version_0"
    assert (log_dir / "toy_rlhf.png").stat().st_size > 0
    assert "reward : reference" in capsys.readouterr().out
    summary = check_run.summarize(log_dir)
    assert summary["steps"] == 4
    assert summary["controller"]["class"] == "AdaptiveKLController" and summary["controller"]["target_kl"] == 0.3
    assert math.isfinite(summary["kl_value"]) and summary["ref_reward"] == pytest.approx(first.model.ref_reward)

    second = toy.main(args)
    assert second.model.reference_cached
    assert torch.equal(_params(second.model.ref), _params(first.model.ref))
    assert check_run.latest_version(tmp_path / "ppo_adaptive_k1").name == "version_1"


def test_a_bad_estimator_name_fails_before_training(tmp_path: Path):
    with pytest.raises(ValueError, match="Valid names"):
        toy.main(["fit", "--config", str(EXAMPLES / "configs" / "grpo_k3plus.yaml"), "--model.kl_estimator=k4",
                  f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"])


# ---------------------------------------------------------------------------------------------
# every estimator name trains, in the loss and in the reward


class _Moved(toy.ToyRLHF):
    """Starts the policy a little away from the reference, so that d = logprob - ref_logprob != 0
    and every estimator's KL gradient is nonzero (at d = 0 those of k2, k3 and the ``+`` names
    vanish, and a tiny rollout often has all-equal rewards, hence zero advantages)."""

    def setup(self, stage):
        super().setup(stage)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))

    def on_train_start(self):
        self.start = _params(self.policy)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_trains_one_step_in_the_loss(estimator: str, quiet_trainer, cache_dir: str):
    module = _Moved(**TINY_MODEL, cache_dir=cache_dir, kl_estimator=estimator, kl_coef=1.0)
    trainer = quiet_trainer(fast_dev_run=1)
    trainer.fit(module, toy.RolloutDataModule(**TINY_DATA, rollouts=1))
    assert module.kl.estimator == estimator
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert torch.isfinite(trainer.callback_metrics["train/kl_est"])
    assert not torch.equal(_params(module.policy), module.start)


@pytest.mark.parametrize("estimator", ["k3+", "k1", "full"])
def test_the_sequence_level_trains_one_step_in_the_loss(estimator: str, quiet_trainer, cache_dir: str):
    module = _Moved(**TINY_MODEL, cache_dir=cache_dir, kl_estimator=estimator, kl_coef=1.0,
                    kl_agg="seq-mean-token-sum", kl_level="sequence")
    trainer = quiet_trainer(fast_dev_run=1)
    trainer.fit(module, toy.RolloutDataModule(**TINY_DATA, rollouts=1))
    assert module.kl.level == "sequence"
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert torch.isfinite(trainer.callback_metrics["train/kl_response"])
    assert not torch.equal(_params(module.policy), module.start)


@pytest.mark.parametrize("estimator", SAMPLED_ESTIMATORS)  # `full` needs logits, which the batch lacks
def test_every_sampled_estimator_trains_one_step_in_the_reward(estimator: str, quiet_trainer, cache_dir: str):
    module = _Moved(**TINY_MODEL, cache_dir=cache_dir, kl_estimator=None, advantage="rtg", ppo_epochs=2)
    callback = lk.KLRewardCallback(estimator, lk.AdaptiveKLController(0.1, target_kl=1e-6, horizon=100))
    trainer = quiet_trainer(fast_dev_run=1, callbacks=[callback])
    trainer.fit(module, toy.RolloutDataModule(**TINY_DATA, rollouts=1))
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert torch.isfinite(trainer.callback_metrics["kl/value"])
    assert callback.controller.value != 0.1  # the controller saw the batch (k1 may come out < 0)
    assert not torch.equal(_params(module.policy), module.start)


# ---------------------------------------------------------------------------------------------
# the data pipeline is on-policy


class _OnPolicyCheck(_Moved):
    """Records, before its update, how far each rollout's logprobs are from the current policy's."""

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            prompt_len = batch["tokens"].shape[1] - batch["mask"].shape[1]
            logits = toy.response_logits(self.policy, batch["tokens"], prompt_len)
            now = toy.token_logprobs(logits, batch["tokens"][:, prompt_len:])
        self.gaps.append(float((now - batch["logprobs"])[batch["mask"]].abs().max()))
        self.snapshots.append(_params(self.policy))
        return super().training_step(batch, batch_idx)


def test_each_rollout_is_sampled_by_the_current_policy(quiet_trainer, cache_dir: str):
    # Lightning prefetches one batch of an iterable without a length: rollout k + 1 would then be
    # sampled before update k, and its logprobs would differ from the policy that trains on it
    module = _OnPolicyCheck(**TINY_MODEL, cache_dir=cache_dir, lr=0.05, ppo_epochs=2)
    module.gaps, module.snapshots = [], []
    quiet_trainer(max_epochs=1).fit(module, toy.RolloutDataModule(**TINY_DATA, rollouts=3))
    assert len(module.gaps) == 3
    assert not torch.equal(module.snapshots[0], module.snapshots[1])  # the policy moved between rollouts
    assert max(module.gaps) < 1e-4, module.gaps


# ---------------------------------------------------------------------------------------------
# the plain functions, against hand-computed values


def test_corpus_lines_are_well_formed():
    lines = toy.sample_corpus(64, p_step=1.0, min_digits=3, max_digits=6, generator=torch.Generator().manual_seed(0))
    assert lines.shape == (64, 8)
    assert (lines[:, 0] == toy.BOS).all()
    for line in lines.tolist():
        end = line.index(toy.EOS)
        digits = line[1:end]
        assert 3 <= len(digits) <= 6 and all(p == toy.PAD for p in line[end + 1 :])
        # p_step=1: the chain always counts up
        assert all((b - a) % 10 == 1 for a, b in zip(digits, digits[1:]))


def test_generate_masks_after_the_first_eos():
    class Scripted(torch.nn.Module):
        """Emits 7, then EOS, then 7s: the position decides the next token."""

        def forward(self, tokens):
            nxt = torch.full(tokens.shape[:1], 7)
            if tokens.shape[1] == 3:
                nxt[0] = toy.EOS
            return torch.nn.functional.one_hot(nxt, toy.VOCAB_SIZE).float()[:, None].expand(-1, tokens.shape[1], -1) * 1e4

    prompts = torch.full((2, 2), toy.BOS)
    tokens, mask = toy.generate(Scripted(), prompts, 4)
    assert tokens[:, 2:].tolist() == [[7, toy.EOS, toy.PAD, toy.PAD], [7, 7, 7, 7]]
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    # share of the 4 slots that hold a 7
    assert toy.count_score(tokens[:, 2:], mask, 7).tolist() == [0.25, 1.0]


def test_group_advantages_normalize_within_groups():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [2.0, 0.0], [2.0, 0.0]])
    mask = torch.ones(4, 2, dtype=torch.bool)
    adv = toy.group_advantages(rewards, mask, torch.tensor([0, 0, 1, 1]))
    # group 0: returns 1 and 3, mean 2, std 1 -> -1, +1; group 1: equal returns -> 0
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1.0, 1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    assert (adv[:, 0] == adv[:, 1]).all()


def test_returns_to_go_charge_only_what_follows():
    rewards = torch.tensor([[-0.1, -0.2, 1.0], [-0.1, 0.5, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = toy.whitened_returns_to_go(rewards, mask)
    rtg = torch.tensor([0.7, 0.8, 1.0, 0.4, 0.5], dtype=torch.float64)  # the padded 9.0 never counts
    expected = (rtg - rtg.mean()) / rtg.std(unbiased=False)
    torch.testing.assert_close(adv[mask].double(), expected, atol=1e-5, rtol=0)
    assert adv[1, 2] == 0


def test_exact_kl_matches_the_formula():
    logits, ref = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    p, q = logits.softmax(-1), ref.softmax(-1)
    expected = (p * (p / q).log()).sum(-1)
    torch.testing.assert_close(toy.exact_kl(logits, ref).double(), expected, atol=1e-5, rtol=0)
