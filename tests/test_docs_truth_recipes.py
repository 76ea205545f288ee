"""``docs/recipes_stacks.md``: every name of TRL, verl and transformers that the recipes use exists, so,
in the pinned TRL 1.16 and verl 0.9.1 sources (``.stacks``, read as text and by ``ast``: their
dependencies are not installed) and in the installed transformers. The recipes' blocks themselves run
against stand-ins of those names in ``tests/test_doc_snippets.py`` (``tests/_recipes_stacks.py``).
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from _mismatch_stacks import package_root
from _snippets import ROOT, all_snippets

PAGE = ROOT / "docs" / "recipes_stacks.md"


def _class(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text())
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name]
    assert len(found) == 1, f"class {name} in {path}: {len(found)}"
    return found[0]


def _method_args(cls: ast.ClassDef, name: str) -> list[str]:
    (fn,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return [a.arg for a in fn.args.args]


def _function_args(path: Path, name: str) -> list[str]:
    tree = ast.parse(path.read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return [a.arg for a in fn.args.args]


def test_the_page_is_in_the_toctree() -> None:
    assert "\nrecipes_stacks\n" in (ROOT / "docs" / "index.md").read_text()
    assert sorted(k[1] for k in all_snippets() if k[0] == "docs/recipes_stacks.md") == [0, 1, 2]


def test_trl_names_of_the_recipe_exist_in_trl_1_16() -> None:
    trl = package_root("trl")
    trainer_py = trl / "trainer" / "grpo_trainer.py"
    src = trainer_py.read_text()
    grpo = _class(trainer_py, "GRPOTrainer")
    assert _method_args(grpo, "_generate_and_score_completions") == ["self", "inputs"]
    assert _method_args(grpo, "_get_per_token_logps_and_entropies")[:5] == [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep",
    ]  # fmt: skip
    assert _method_args(grpo, "_compute_loss") == ["self", "model", "inputs"]
    assert "return logps, entropies, aux_loss" in src  # the scorer returns three things
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "old_per_token_logps"):
        assert f'"{key}"' in src, key
    for attribute in ("self.beta", "self._metrics[mode]", "self.current_gradient_accumulation_steps", "self.accelerator.unwrap_model"):
        assert attribute in src, attribute
    # TRL divides its loss by the accumulation steps itself (the recipe divides the KL likewise)
    assert re.search(r"normalizer = self\.current_gradient_accumulation_steps if mode == \"train\" else 1\.0\n\s+policy_loss = loss\.detach\(\)\n\s+loss = loss / normalizer", src)
    # beta=0: TRL scores no reference
    assert "if self.beta != 0.0:\n                if self.ref_model is not None:" in src
    assert _function_args(trl / "trainer" / "utils.py", "use_adapter") == ["model", "adapter_name"]
    assert '"GRPOTrainer"' in (trl / "__init__.py").read_text()
    config = (trl / "trainer" / "grpo_config.py").read_text()
    assert re.search(r"    beta: float = field\(\n        default=0\.0,", config)


def test_hugging_face_calls_on_pre_optimizer_step_before_the_optimizer_steps() -> None:
    transformers = pytest.importorskip("transformers")
    assert callable(getattr(transformers.TrainerCallback, "on_pre_optimizer_step", None))
    loop = inspect.getsource(transformers.Trainer)
    hook = loop.index("self.callback_handler.on_pre_optimizer_step(")
    assert hook < loop.index("self.optimizer.step()", hook)


def test_verl_names_of_the_recipe_exist_in_verl_0_9_1() -> None:
    verl = package_root("verl")
    workers = verl / "workers" / "engine_workers.py"
    assert _method_args(_class(workers, "ActorRolloutRefWorker"), "set_loss_fn") == ["self", "loss_fn"]
    assert "self.actor.set_loss_fn(self.loss_fn)" in workers.read_text()  # its own ppo_loss, replaceable
    assert _function_args(verl / "workers" / "utils" / "losses.py", "ppo_loss") == ["config", "model_output", "data", "dp_group"]
    assert _function_args(verl / "workers" / "utils" / "padding.py", "no_padding_2_padding") == ["tensor", "data"]
    assert _function_args(verl / "utils" / "config.py", "omega_conf_to_dataclass")[0] == "config"
    ray_trainer = verl / "trainer" / "ppo" / "ray_trainer.py"
    assert _method_args(_class(ray_trainer, "RayPPOTrainer"), "init_workers") == ["self"]
    assert "self.actor_rollout_wg = all_wg[" in ray_trainer.read_text()
    # the reference's log-probs only when a KL is in use
    utils = (verl / "trainer" / "ppo" / "utils.py").read_text()
    assert 'config.algorithm.get("use_kl_in_reward", False) or config.actor_rollout_ref.actor.use_kl_loss' in utils
    losses = (verl / "workers" / "utils" / "losses.py").read_text()
    assert '"ref_log_prob" in data' in losses and "policy_loss += kl_loss * config.kl_loss_coef" in losses
    # the verl.plugins entry point group, loaded at `import verl` unless VERL_USE_EXTERNAL_PLUGINS=none
    init = (verl / "__init__.py").read_text()
    assert '_entry_points(group="verl.plugins")' in init and 'os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto")' in init
    assert _function_args(verl / "trainer" / "ppo" / "core_algos.py", "register_policy_loss") == ["name"]
    text = PAGE.read_text()
    for name in ("set_loss_fn", "verl.plugins", "VERL_USE_EXTERNAL_PLUGINS", "register_policy_loss", "kl_loss_coef=0"):
        assert name in text, name
