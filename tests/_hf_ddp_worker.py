"""The Hugging Face GRPO example (examples/hf_grpo.py) for a few steps as 2 DDP processes (CPU, gloo).

``python tests/_hf_ddp_worker.py OUT_DIR CACHE_DIR`` runs ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``
on the example's ``HFGRPO`` module and ``ArithmeticDataModule`` at tiny sizes, with a
``KLRewardCallback`` in the Trainer, and each rank writes ``OUT_DIR/rank{r}.json``:
its LoRA adapter weights after training, whether its base weights still equal the pretrained
reference (cached in CACHE_DIR), its first rollout's sequences, its reference accuracy and the callback's
coefficient. ``tests/test_hf.py`` runs it in a subprocess with a timeout and compares the ranks.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _trainers import make_quiet_trainer  # noqa: E402

import lightning_kl as lk  # noqa: E402
from _ddp import write_rank_record

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_grpo.py"
WORLD = 2
STEPS = 2
TINY_MODEL = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32,
                  pretrain_steps=40, pretrain_batch_size=16, pretrain_lr=0.03, lora_r=2, lora_alpha=4, lr=0.05,
                  kl_estimator="k3+", kl_coef=0.1)
# operands 0 and 1: 40 pretraining steps make a reference that is right about a quarter of the time,
# so that the groups' rewards differ and the adapters get a gradient at the first step
TINY_DATA = dict(max_operand=2, max_new_tokens=3, prompts_per_rollout=2, group_size=4, rollouts=STEPS,
                 reference_samples=8)


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("hf_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_grpo"] = module
    spec.loader.exec_module(module)
    return module


def _flat(params: list[torch.Tensor]) -> list[float]:
    return torch.cat([p.detach().flatten() for p in params]).tolist() if params else []


def main(out_dir: str, cache_dir: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    ex = load_example()
    torch.manual_seed(0)
    model = ex.HFGRPO(cache_dir=cache_dir, **TINY_MODEL)
    dm = ex.ArithmeticDataModule(**TINY_DATA)
    record: dict[str, Any] = {}

    class Probe(lk.KLRewardCallback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            if batch_idx == 0:
                record["first_sequences"] = batch["sequences"].tolist()

    callback = Probe("k1", controller=lk.AdaptiveKLController(init_kl_coef=0.2, target_kl=0.01, horizon=10))
    trainer = make_quiet_trainer(out_dir, devices=WORLD, strategy="ddp", max_steps=STEPS, callbacks=[callback])
    trainer.fit(model, datamodule=dm)
    policy = model.policy
    state = torch.load(model.reference_path, map_location="cpu", weights_only=True)
    record.update(
        rank=trainer.global_rank,
        world_size=trainer.world_size,
        adapters=_flat([p for n, p in policy.named_parameters() if "lora_" in n]),
        adapters_b_nonzero=any(bool(p.abs().sum() > 0) for n, p in policy.named_parameters() if "lora_B" in n),
        base_equal_reference=all(
            torch.equal(p.detach(), state[n.replace("base_model.model.", "").replace("base_layer.", "")])
            for n, p in policy.named_parameters() if "lora_" not in n
        ),
        ref_acc=model.ref_acc,
        coef=callback.controller.value,
    )
    write_rank_record(out_dir, record)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
