"""Runners of the ```python blocks of ``docs/recipes_stacks.md``, for ``tests/test_doc_snippets.py``.

TRL's and verl's dependencies are not installed here: their blocks run against small stand-ins of the
few names they import (a ``GRPOTrainer`` with TRL 1.16's private methods' signatures and contract, a
``RayPPOTrainer`` whose ``init_workers`` makes a worker group), and ``tests/test_docs_truth_recipes.py``
checks that every one of those names exists, so, in the pinned TRL and verl sources. What runs for real:
lightning-kl, ``transformers.TrainerCallback``, and the arithmetic of each recipe against float64 maths.
"""

from __future__ import annotations

import contextlib
import math
import sys
import textwrap
import types
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from torch import nn

import lightning_kl as lk

V, P, C = 7, 2, 4  # vocabulary, prompt and completion lengths


def _exec(code: str, ns: dict[str, Any]) -> dict[str, Any]:
    exec(compile(textwrap.dedent(code), "<recipes_stacks.md>", "exec"), ns)
    return ns


def _k3(lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    """The token mean of k3 over the valid tokens, float64 from the formula (k3+ has k3's value)."""
    d = (ref.double() - lp.double())[mask]
    return math.fsum(float(x) for x in torch.exp(d) - d - 1) / int(mask.sum())


def _replayed_coef(kls: list[tuple[float, int]]) -> float:
    """The docs' TargetKLController after updates with each step's (global KL, sequences)."""
    controller = lk.TargetKLController(target_kl=0.1, init_kl_coef=0.05)
    for kl, n in kls:
        controller.update(kl, n)
    return controller.value


# ---------------------------------------------------------------------------------------------
# a loop of your own


def run_plain_loop(code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    theta = nn.Parameter(torch.randn(2, 5, V, generator=g, dtype=torch.float64))
    ref_logits = torch.randn(2, 5, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (2, 5), generator=g)
    masks = [torch.tensor([[True] * 5, [True, True, False, False, False]]), torch.tensor([[True] * 3 + [False] * 2, [True] * 5])]
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    ns: dict[str, Any] = {"lk": lk, "n_steps": 3, "micro_batches": [0, 1]}

    def policy_loss(i: int) -> torch.Tensor:
        # the micro-batch's log-probs, the names the block reads next (`lp`, `ref_lp`, `mask`)
        lp = torch.log_softmax(theta, -1).gather(-1, tokens[..., None])[..., 0] * (1 + 0.1 * i)
        ref_lp = torch.log_softmax(ref_logits, -1).gather(-1, tokens[..., None])[..., 0]
        ns.update(lp=lp, ref_lp=ref_lp, mask=masks[i])
        seen.append((lp.detach(), ref_lp, masks[i]))
        return 0.0 * lp.sum()

    optimizer = torch.optim.SGD([theta], lr=0.5)
    ns.update(policy_loss=policy_loss, optimizer=optimizer)
    _exec(code, ns)
    steps = []
    for s in range(3):  # each step: its 2 micro-batches' tokens, one token mean (agg="token-mean")
        batch = seen[2 * s : 2 * s + 2]
        total = sum(_k3(lp, ref, m) * int(m.sum()) for lp, ref, m in batch)
        count = sum(int(m.sum()) for _, _, m in batch)
        steps.append((total / count, sum(int(m.any(-1).sum()) for _, _, m in batch)))
    assert ns["kl_loss"].coef == pytest.approx(_replayed_coef(steps), rel=1e-12)
    assert ns["kl_loss"].coef != 0.05


# ---------------------------------------------------------------------------------------------
# TRL's GRPOTrainer


class TinyPeftLM(nn.Module):
    """A causal LM of one embedding and one head, with an 'adapter' that ``use_adapter(m, None)`` turns off."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.embed = nn.Parameter(torch.randn(V, V, generator=g, dtype=torch.float64))
        self.adapter = nn.Parameter(0.3 * torch.randn(V, V, generator=g, dtype=torch.float64))
        self.adapters_on = True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[input_ids] + (self.adapter[input_ids] if self.adapters_on else 0.0)


@contextlib.contextmanager
def use_adapter(model: TinyPeftLM, adapter_name: Optional[str]) -> Any:
    assert adapter_name is None  # the recipe's reference: every adapter off
    model.adapters_on = False
    try:
        yield
    finally:
        model.adapters_on = True


def _logps(model: nn.Module, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    logits = model(input_ids)[:, -logits_to_keep - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, -logits_to_keep:, None])[..., 0]


class StandInGRPOTrainer:
    """TRL 1.16's ``GRPOTrainer`` as far as the recipe reads it (the names are checked in its source)."""

    def __init__(self, model: nn.Module, beta: float = 0.0, accumulation: int = 2) -> None:
        self.model, self.beta = model, beta
        self.current_gradient_accumulation_steps = accumulation
        self._metrics: dict[str, Any] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.callbacks: list[Any] = []
        self.accelerator = SimpleNamespace(unwrap_model=lambda m: m)

    def add_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def _get_per_token_logps_and_entropies(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, **_: Any
    ) -> tuple[torch.Tensor, None, None]:
        return _logps(model, input_ids, logits_to_keep), None, None

    def _generate_and_score_completions(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(inputs)  # prompt_ids, prompt_mask, completion_ids, completion_mask, advantages

    def _compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        logps, _, _ = self._get_per_token_logps_and_entropies(model, ids, None, inputs["completion_ids"].size(1))
        m = inputs["completion_mask"].double()
        loss = -(logps * inputs["advantages"][:, None] * m).sum() / m.sum()
        return loss / self.current_gradient_accumulation_steps  # TRL divides itself (HF's division is off)


def run_trl_recipe(code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    trl = types.ModuleType("trl")
    trl.GRPOTrainer = StandInGRPOTrainer  # type: ignore[attr-defined]
    trl_trainer = types.ModuleType("trl.trainer")
    trl_utils = types.ModuleType("trl.trainer.utils")
    trl_utils.use_adapter = use_adapter  # type: ignore[attr-defined]
    for name, module in (("trl", trl), ("trl.trainer", trl_trainer), ("trl.trainer.utils", trl_utils)):
        monkeypatch.setitem(sys.modules, name, module)
    ns = _exec(code, {"lk": lk})
    model = TinyPeftLM()
    kl_loss = lk.KLPenaltyLoss("k3+", coef=lk.TargetKLController(target_kl=0.1, init_kl_coef=0.05), agg="token-mean")
    trainer = ns["KLGRPOTrainer"](model, kl_loss=kl_loss)
    with pytest.raises(ValueError, match="beta=0.0"):
        ns["KLGRPOTrainer"](model, beta=0.04, kl_loss=kl_loss)
    g = torch.Generator().manual_seed(2)
    steps = []
    for _ in range(2):  # optimizer steps, each 2 micro-batches of 2 sequences
        rollout = {
            "prompt_ids": torch.randint(0, V, (4, P), generator=g), "prompt_mask": torch.ones(4, P, dtype=torch.long),
            "completion_ids": torch.randint(0, V, (4, C), generator=g),
            "completion_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]]),
            "advantages": torch.randn(4, generator=g, dtype=torch.float64),
        }  # fmt: skip
        out = trainer._generate_and_score_completions(rollout)
        ids = torch.cat([rollout["prompt_ids"], rollout["completion_ids"]], 1)
        with torch.no_grad():  # the reference: the same model with its adapter off, scored by TRL's scorer
            model.adapters_on = False
            want_ref = _logps(model, ids, C)
            model.adapters_on = True
        torch.testing.assert_close(out["ref_per_token_logps"], want_ref, rtol=0, atol=0)
        total, count, seqs = 0.0, 0, 0
        for half in (slice(0, 2), slice(2, 4)):
            micro = {k: v[half] for k, v in out.items()}
            coef = kl_loss.coef
            loss = trainer._compute_loss(model, micro)
            trl_only = StandInGRPOTrainer._compute_loss(trainer, model, micro)
            mask = micro["completion_mask"].bool()
            with torch.no_grad():
                lp = _logps(model, torch.cat([micro["prompt_ids"], micro["completion_ids"]], 1), C)
            kl = _k3(lp, micro["ref_per_token_logps"], mask)
            assert float((loss - trl_only).detach()) == pytest.approx(coef * kl / 2, rel=1e-9)  # TRL's division by 2 steps
            assert trainer._metrics["train"]["kl"][-1] == pytest.approx(kl, rel=1e-9)
            loss.backward()
            total, count, seqs = total + kl * int(mask.sum()), count + int(mask.sum()), seqs + int(mask.any(-1).sum())
        for callback in trainer.callbacks:  # Hugging Face's Trainer, before optimizer.step()
            callback.on_pre_optimizer_step(None, None, None)
        steps.append((total / count, seqs))
    assert kl_loss.coef == pytest.approx(_replayed_coef(steps), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# verl


class StandInData:
    """verl's TensorDict of the micro-batch, as far as the recipe reads it."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def select(self, *keys: str) -> "StandInData":
        return StandInData({k: self.tensors[k] for k in keys})

    def to_padded_tensor(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


def run_verl_recipe(code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made: dict[str, Any] = {}

    class WorkerGroup:
        def set_loss_fn(self, loss_fn: Any) -> None:
            made["loss_fn"] = loss_fn

    class RayPPOTrainer:
        def __init__(self, config: Any) -> None:
            self.config = config

        def init_workers(self) -> None:
            self.actor_rollout_wg = WorkerGroup()

    def ppo_loss(config: Any, model_output: Any, data: Any, dp_group: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
        made["ppo_loss_config"] = config
        return model_output["log_probs"].sum() * 0.0 + 1.5, {"actor/pg_loss": 1.5}

    stubs = {
        "verl.trainer.ppo.ray_trainer": {"RayPPOTrainer": RayPPOTrainer},
        "verl.utils.config": {"omega_conf_to_dataclass": lambda cfg: SimpleNamespace(source=cfg)},
        "verl.workers.utils.losses": {"ppo_loss": ppo_loss},
        "verl.workers.utils.padding": {"no_padding_2_padding": lambda tensor, data: tensor},
    }
    for name, attrs in stubs.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    ns = _exec(code, {})
    actor_cfg = {"use_kl_loss": True, "kl_loss_coef": 0.0}
    trainer = ns["LKPPOTrainer"](SimpleNamespace(actor_rollout_ref=SimpleNamespace(actor=actor_cfg)))
    trainer.init_workers()
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    ref = (lp - 0.5 * torch.randn(3, 5, generator=g, dtype=torch.float64)).clamp(max=0.0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    data = StandInData({"response_mask": mask, "ref_log_prob": ref, "old_log_probs": lp})
    loss, metrics = made["loss_fn"](model_output={"log_probs": lp}, data=data)
    assert made["ppo_loss_config"].source is actor_cfg
    # low_var_kl+ has verl's k3 value (clamped at 10, not reached here), coef 0.001, token mean
    assert float(loss) == pytest.approx(1.5 + 0.001 * _k3(lp, ref, mask.bool()), rel=1e-12)
    assert metrics == {"actor/pg_loss": 1.5}
