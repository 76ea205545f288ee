"""lk.ReferenceRefresh with a LoRA policy whose reference is the model with its adapters off (peft).

A fold must keep the policy (to float tolerance) and make the adapters-off model
``alpha * policy + (1 - alpha) * reference`` (float64 maths from the effective weights), with the
LoRA scaling and, for GPT-2's Conv1D, the transpose; a hard reset in a Trainer must make the next
reference the pre-reset policy; what cannot be folded exactly is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.refresh.mixing import check_foldable, fold_adapters_
from lightning_kl import hf
from test_refresh import B, T, fit

transformers = pytest.importorskip("transformers")  # the `test` extra installs it: CI never skips
peft = pytest.importorskip("peft")
from test_hf import _lora, _tiny  # noqa: E402  (a tiny Qwen2 / GPT-2 and its LoRA, B made non-zero)

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _logits(model: nn.Module, tokens: Tensor) -> Tensor:
    return model(input_ids=tokens).logits


def _effective_weights(policy: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
    """(base W, W + s B A) of every LoRA layer, in float64."""
    out = {}
    for name, m in policy.named_modules():
        if hasattr(m, "lora_A") and "default" in m.lora_A:
            w = m.base_layer.weight.double()
            delta = m.lora_B["default"].weight.double() @ m.lora_A["default"].weight.double() * m.scaling["default"]
            out[name] = (w, w + (delta.T if m.fan_in_fan_out else delta))
    return out


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])  # gpt2: Conv1D, fan_in_fan_out
@pytest.mark.parametrize("alpha", [1.0, 0.25])
def test_fold_keeps_the_policy_and_moves_the_adapters_off_model_by_the_formula(arch: str, alpha: float) -> None:
    policy = _lora(_tiny(arch), arch)
    tokens = torch.randint(3, 12, (3, 6), generator=torch.Generator().manual_seed(0))
    before_logits = _logits(policy, tokens).detach()
    before = _effective_weights(policy)
    b_before = {n: m.lora_B["default"].weight.clone() for n, m in policy.named_modules() if hasattr(m, "lora_B") and "default" in m.lora_B}
    assert fold_adapters_(policy, alpha) == len(before) > 0
    after = _effective_weights(policy)
    for name, (w0, p0) in before.items():
        w1, p1 = after[name]
        assert_close(w1, alpha * p0 + (1 - alpha) * w0, rtol=0, atol=1e-5)  # reference := alpha pi + (1 - alpha) ref
        assert_close(p1, p0, rtol=0, atol=1e-5)  # the policy is unchanged
    for name, m in policy.named_modules():
        if name in b_before:  # B *= 1 - alpha, exactly (one multiply)
            assert torch.equal(m.lora_B["default"].weight, b_before[name] * (1 - alpha))
    assert_close(_logits(policy, tokens), before_logits, rtol=1e-5, atol=1e-4)
    if alpha == 1.0:  # the adapters-off model is today's policy
        with hf.adapters_disabled(policy):
            assert_close(_logits(policy, tokens), before_logits, rtol=1e-5, atol=1e-4)


def test_layers_that_cannot_be_folded_exactly_are_refused() -> None:
    dora = peft.get_peft_model(_tiny(), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="cannot fold the LoRA adapters of `.*q_proj`.*LoRA variant"):
        check_foldable(dora)
    bias = peft.get_peft_model(_tiny(seed=1), peft.LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True))
    with pytest.raises(ValueError, match="has a LoRA bias"):
        fold_adapters_(bias, 1.0)


class LoRAModule(pl.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.policy = _lora(_tiny())
        self.steps = steps

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(
            [torch.randint(3, 12, (B, T), generator=torch.Generator().manual_seed(i)) for i in range(self.steps)],
            batch_size=None,
        )

    def training_step(self, tokens: Tensor, batch_idx: int) -> Tensor:
        lp = lk.token_logprobs(_logits(self.policy, tokens)[:, :-1], tokens[:, 1:])
        return -(lp * (tokens[:, 1:].float() - 7)).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.policy.parameters() if p.requires_grad], lr=0.01)


@pytest.mark.filterwarnings("ignore:Found [0-9]* module\\(s\\) in eval mode")  # the tiny HF model, dropout off
def test_lora_hard_reset_in_a_trainer_the_next_reference_is_the_pre_reset_policy(tmp_path: Path) -> None:
    probe = torch.randint(3, 12, (3, 6), generator=torch.Generator().manual_seed(7))
    seen: dict[str, list[Tensor]] = {"pre": [], "post": [], "post_ref": []}

    class Probe(Callback):
        def __init__(self, when: str) -> None:
            self.when = when

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            if trainer.global_step % 2:
                return
            with torch.no_grad():
                seen[self.when].append(lk.token_logprobs(_logits(module.policy, probe)[:, :-1], probe[:, 1:]))
                if self.when == "post":
                    with hf.adapters_disabled(module.policy):
                        seen["post_ref"].append(lk.token_logprobs(_logits(module.policy, probe)[:, :-1], probe[:, 1:]))

    module = LoRAModule(steps=4)
    base = {n: p.clone() for n, p in module.policy.named_parameters() if not p.requires_grad}
    refresh = lk.ReferenceRefresh(every_n_steps=2, reference=None, reset_optimizer=True)
    fit(tmp_path, module, Probe("pre"), refresh, Probe("post"))
    assert refresh.refreshes == 2 and len(seen["pre"]) == 2
    for pre, post, post_ref in zip(seen["pre"], seen["post"], seen["post_ref"]):
        assert_close(post, pre, rtol=0, atol=1e-5)  # the reset does not change the policy
        assert_close(post_ref, pre, rtol=0, atol=1e-5)  # the reference is the pre-reset policy
        assert torch.equal(post_ref, post)  # B = 0: policy and reference are one function, bit for bit
    assert all(torch.count_nonzero(p) == 0 for n, p in module.policy.named_parameters() if "lora_B" in n)
    moved = [n for n, p in module.policy.named_parameters() if n in base and not torch.equal(p, base[n])]
    assert moved and all("q_proj" in n or "v_proj" in n for n in moved)  # only the adapted weights moved


@pytest.mark.filterwarnings(
    "ignore:Found [0-9]* module\\(s\\) in eval mode",  # the tiny HF model, dropout off
    "ignore:You're resuming from a checkpoint that ended before",  # a mid-epoch resume on purpose
    "ignore:Checkpoint directory .* exists and is not empty",  # the second run writes where the first did
)
def test_lora_resume_restores_the_folded_base_weights_and_the_schedule(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from _trainers import make_quiet_trainer

    class StepData(LoRAModule):  # the data of step s whatever the loader's position (it restarts on resume)
        def training_step(self, tokens: Tensor, batch_idx: int) -> Tensor:
            g = torch.Generator().manual_seed(self.global_step)
            return super().training_step(torch.randint(3, 12, (B, T), generator=g), batch_idx)

    def run(root: Path, ckpt: Any = None) -> tuple[nn.Module, lk.ReferenceRefresh]:
        module, refresh = StepData(steps=6), lk.ReferenceRefresh(every_n_steps=2, alpha=0.5, reference=None)
        save = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
        trainer = make_quiet_trainer(root, max_epochs=1, callbacks=[refresh, save], enable_checkpointing=True)
        trainer.fit(module, ckpt_path=ckpt)
        return module, refresh

    full, first = run(tmp_path / "a")  # folds after steps 2, 4, 6; a checkpoint after step 3
    resumed, second = run(tmp_path / "b", tmp_path / "ckpt" / "step=3.ckpt")
    assert first.state_dict() == second.state_dict() and second.refreshes == 3 and second.last_step == 6
    want = dict(full.policy.named_parameters())
    for name, param in resumed.policy.named_parameters():  # base weights (folded twice after the resume) and adapters
        assert torch.equal(param, want[name]), name
