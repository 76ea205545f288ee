"""The example configs with a reference refresh: they parse into the documented callback and refresh.

The toy configs run a few tiny rollouts (EMA every 10 steps: one refresh in 10 rollouts; hard reset:
a refresh at step 50 would need 50, and the KL trigger 20 steps above 0.4, so those runs are cut at 2
and check the parsed callback and that the KL it reads is logged);
the Hugging Face configs are parsed without training (``main(run=False)``).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import lightning_kl as lk
from test_example import QUIET, TINY_ARGS, _params, cache_dir, one_thread, toy  # noqa: F401  (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")
CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"


def _refresh(trainer) -> lk.ReferenceRefresh:
    (cb,) = [cb for cb in trainer.callbacks if isinstance(cb, lk.ReferenceRefresh)]
    return cb


@pytest.mark.parametrize(("name", "alpha", "every", "rollouts"), [("hard", 1.0, 50, 2), ("ema", 0.2, 10, 10), ("kl", 1.0, None, 2)])
def test_toy_refresh_configs(tmp_path: Path, cache_dir: str, name: str, alpha: float, every: int, rollouts: int) -> None:
    cli = toy.main(
        ["fit", "--config", str(CONFIGS / f"grpo_k3plus_refresh_{name}.yaml"), "--trainer.logger=false",
         f"--trainer.default_root_dir={tmp_path}", f"--model.cache_dir={cache_dir}", f"--data.rollouts={rollouts}",
         *TINY_ARGS, *QUIET]
    )
    refresh = _refresh(cli.trainer)
    assert (refresh.alpha, refresh.every_n_steps, refresh.policy, refresh.reference) == (alpha, every, "policy", "ref")
    assert refresh.reset_optimizer == (name != "ema")
    assert refresh.refreshes == (rollouts // every if every else 0) and cli.trainer.global_step == rollouts
    if name == "kl":  # read from the exact KL the module logs, every step (a missing name would stop the run)
        assert (refresh.kl_threshold, refresh.kl_window, refresh.kl_metric) == (0.4, 20, "train/kl")
        assert 0 <= refresh.steps_above <= rollouts
    if name == "ema":  # one refresh, at the last step: the reference moved toward the policy
        assert not torch.equal(_params(cli.model.ref), _params(cli.model.policy))
        assert cli.trainer.callback_metrics["ref/last_step"] == 10


@pytest.mark.parametrize(("name", "alpha", "every"), [("hard", 1.0, 100), ("ema", 0.2, 20)])
def test_hf_refresh_configs_parse_into_a_lora_refresh(name: str, alpha: float, every: int) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from test_hf import ex

    cli = ex.main(["--config", str(CONFIGS / f"hf_grpo_lora_refresh_{name}.yaml")], run=False)
    refresh = _refresh(cli.trainer)
    assert (refresh.alpha, refresh.every_n_steps, refresh.policy, refresh.reference) == (alpha, every, "policy", None)


@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")
def test_hf_hard_reset_config_makes_the_next_rollouts_reference_the_policy(tmp_path: Path, monkeypatch) -> None:
    # the config's wiring (LoRA policy, reference = adapters off) with the period cut to 2 steps: the
    # rollout after the reset scores its tokens with the policy and the adapters-off model alike
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import sys

    from test_hf import QUIET_CLI, TINY_ARGS as HF_TINY_ARGS, ex

    monkeypatch.setattr(sys, "argv", ["hf_grpo.py"])
    gaps: list[float] = []

    class Gap(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            gaps.append(float((batch["logprobs"] - batch["ref_logprobs"])[batch["mask"]].abs().max()))

    cli = ex.main(["--config", str(CONFIGS / "hf_grpo_lora_refresh_hard.yaml"), *HF_TINY_ARGS, *QUIET_CLI,
                   f"--model.cache_dir={tmp_path}", f"--trainer.default_root_dir={tmp_path}",
                   "--trainer.fast_dev_run=4", "--data.rollouts=4"], run=False)
    refresh = _refresh(cli.trainer)
    refresh.every_n_steps = 2
    cli.trainer.callbacks.append(Gap())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert refresh.refreshes == 2 and cli.trainer.global_step == 4
    # batch 1: B = 0 at the start; batch 2: one step away; batch 3: right after the reset at step 2
    assert gaps[0] == 0 and gaps[1] > 1e-4 and gaps[2] == 0 and gaps[3] > 1e-4, gaps  # B = 0: exactly
    assert all(torch.count_nonzero(p) == 0 for n, p in cli.model.policy.named_parameters() if "lora_B" in n)
