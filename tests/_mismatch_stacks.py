"""The other stacks' own rollout-correction code, loaded from their installed packages with their
framework imports stubbed, for ``tests/test_mismatch_stacks.py``.

Each stack is installed without its dependencies, either into a folder (``pip install --no-deps
--target DIR verl==0.9.1 trl==1.16.0 openrlhf==0.11.2``: nothing else imports them from there) or into
the environment; a loader skips the calling test when the package or the pinned version is missing.
The folder is the environment variable ``LIGHTNING_KL_STACKS`` when it is set, else ``.stacks`` at the
repository's root, where the README's install command puts them. (Installed into the environment
without its dependencies, ``trl`` imports but its modules do not, which ``benchmarks/gpu.py`` reports
as an error of its TRL anchor: prefer the folder.) Nothing here copies their code: the files are read
from the installed package and executed as they are.

* verl: ``verl/trainer/ppo/rollout_corr_helper.py`` and ``verl/utils/torch_functional.py`` as
  modules, ``verl/trainer/config/algorithm.py`` for the presets of ``RolloutCorrectionConfig``;
  stubbed: ``tensordict``, ``verl.utils.device``, ``verl.protocol``, ``verl.base_config``,
  ``verl.workers.config.actor``.
* TRL: two blocks of ``GRPOTrainer`` (``trl/trainer/grpo_trainer.py``) taken out by their syntax tree:
  the importance sampling of ``_generate_and_score_completions`` (the ``if`` that computes
  ``vllm_importance_sampling_ratio``) as a function, and the static ``get_off_policy_mask``.
* OpenRLHF: ``openrlhf/models/loss.py`` with ``openrlhf/models/utils.py``'s ``masked_mean`` (its module
  imports deepspeed: the function is taken out by its syntax tree).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import math
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

VERSIONS = {"verl": "0.9.1", "trl": "1.16.0", "openrlhf": "0.11.2"}


#: where the README's install command puts the stacks (``pip install --no-deps --target .stacks ...``)
DEFAULT_STACKS = Path(__file__).resolve().parent.parent / ".stacks"


def stacks_folder() -> str:
    """``LIGHTNING_KL_STACKS`` when set, else the repository's ``.stacks`` when it exists, else ''."""
    stacks = os.environ.get("LIGHTNING_KL_STACKS")
    if stacks:
        return stacks
    return str(DEFAULT_STACKS) if DEFAULT_STACKS.is_dir() else ""


def package_root(name: str) -> Path:
    """The installed package's folder, or skip the test (not installed, or another version)."""
    stacks = stacks_folder()
    if stacks:
        for dist in importlib.metadata.distributions(path=[stacks]):
            if dist.metadata["Name"].lower() == name:
                if dist.version != VERSIONS[name]:
                    pytest.skip(f"{name} {dist.version} is in {stacks}; these tests read {name} {VERSIONS[name]}")
                return Path(stacks) / name
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            f"{name} is not installed (the README's install command: pip install --no-deps --target .stacks "
            f"{name}=={VERSIONS[name]}; or another DIR and LIGHTNING_KL_STACKS=DIR)"
        )
    if version != VERSIONS[name]:
        pytest.skip(f"{name} {version} is installed; these tests read {name} {VERSIONS[name]}")
    spec = importlib.util.find_spec(name)  # finds the folder without running the package's __init__
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0])


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so that submodules resolve
    module.__dict__.update(attrs)
    return module


def _exec_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _Stubbed:
    """Put stub modules into ``sys.modules`` for the duration, then take every new entry out again."""

    def __init__(self, stubs: dict[str, types.ModuleType]) -> None:
        self.stubs = stubs

    def __enter__(self) -> "_Stubbed":
        self.before = set(sys.modules)
        for name, module in self.stubs.items():
            assert name not in sys.modules or name.startswith("verl"), f"{name} is already imported"
            sys.modules[name] = module
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in set(sys.modules) - self.before:
            if name.split(".")[0] in ("verl", "tensordict"):
                del sys.modules[name]


def load_verl() -> tuple[types.ModuleType, type]:
    """verl's ``rollout_corr_helper`` module and its ``RolloutCorrectionConfig`` class (with the presets)."""
    root = package_root("verl")

    class BaseConfig:  # verl.base_config.BaseConfig: a dataclass with a dict-like read
        def get(self, key: str, default: Any = None) -> Any:
            return getattr(self, key, default)

    class DataProto:  # verl.protocol.DataProto.from_dict, all the helper asks of it
        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            self.batch = tensors

        @classmethod
        def from_dict(cls, tensors: dict[str, torch.Tensor]) -> "DataProto":
            return cls(tensors)

    stubs = {
        "tensordict": _module("tensordict", TensorDict=dict),
        "verl": _module("verl"),
        "verl.utils": _module("verl.utils"),
        "verl.utils.device": _module("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu),
        "verl.protocol": _module("verl.protocol", DataProto=DataProto),
        "verl.base_config": _module("verl.base_config", BaseConfig=BaseConfig),
        "verl.trainer": _module("verl.trainer"),
        "verl.trainer.config": _module("verl.trainer.config"),
        "verl.trainer.ppo": _module("verl.trainer.ppo"),
        "verl.workers": _module("verl.workers"),
        "verl.workers.config": _module("verl.workers.config"),
        "verl.workers.config.actor": _module("verl.workers.config.actor", PolicyLossConfig=dict),
    }
    with _Stubbed(stubs):
        tf = _exec_file("verl.utils.torch_functional", root / "utils" / "torch_functional.py")
        stubs["verl.utils"].torch_functional = tf
        algorithm = _exec_file("verl.trainer.config.algorithm", root / "trainer" / "config" / "algorithm.py")
        helper = _exec_file("verl.trainer.ppo.rollout_corr_helper", root / "trainer" / "ppo" / "rollout_corr_helper.py")
    return helper, algorithm.RolloutCorrectionConfig


def load_verl_bypass_loss(helper: types.ModuleType) -> Callable[..., dict[str, Any]]:
    """verl's ``compute_policy_loss_bypass_mode`` (``verl/trainer/ppo/core_algos.py``, taken out by its
    syntax tree), its two policy losses replaced by a recorder: ``f(cfg, log_prob, rollout_log_prob,
    response_mask)`` returns which loss it chose (``"loss_type"``), the ``rollout_is_weights`` and the
    ``response_mask`` it passed to it, and its metrics. ``helper`` is :func:`load_verl`'s module."""
    root = package_root("verl")
    fn = _function(_tree(root / "trainer" / "ppo" / "core_algos.py"), "compute_policy_loss_bypass_mode")
    seen: dict[str, Any] = {}

    def recorder(name: str) -> Callable[..., Any]:
        def loss(**kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            seen.update(loss_type=name, rollout_is_weights=kwargs["rollout_is_weights"], response_mask=kwargs["response_mask"])
            return torch.zeros(()), {}

        return loss

    namespace: dict[str, Any] = {
        "torch": torch, "Any": Any, "Optional": __import__("typing").Optional, "ActorConfig": object,
        "compute_policy_loss_vanilla": recorder("ppo_clip"), "compute_policy_loss_reinforce": recorder("reinforce"),
    }  # fmt: skip
    bypass = _compile(fn, namespace)
    stubs = {name: _module(name) for name in ("verl", "verl.trainer", "verl.trainer.ppo")}
    stubs["verl.trainer.ppo.rollout_corr_helper"] = helper

    def call(cfg: dict[str, Any], log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        seen.clear()
        config = types.SimpleNamespace(policy_loss={"rollout_correction": cfg})
        with _Stubbed(stubs):  # the function imports the helper by its name
            _, metrics = bypass(
                old_log_prob=rollout_log_prob, log_prob=log_prob, advantages=torch.ones_like(log_prob),
                response_mask=mask, config=config,
            )  # fmt: skip
        return {**seen, "metrics": metrics}

    return call


def verl_presets(config_class: type) -> dict[str, Any]:
    """Every preset classmethod of ``RolloutCorrectionConfig``, called with its defaults."""
    out = {}
    for name in sorted(vars(config_class)):
        if name.startswith(("decoupled_", "bypass_")) and isinstance(vars(config_class)[name], classmethod):
            out[name] = getattr(config_class, name)()
    return out


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"no function {name} in the installed file")


def _compile(fn: ast.FunctionDef, namespace: dict[str, Any]) -> Callable:
    fn = ast.FunctionDef(
        name=fn.name, args=fn.args, body=fn.body, decorator_list=[], returns=None, type_comment=None, type_params=[]
    )
    module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
    exec(compile(module, "<installed stack code>", "exec"), namespace)
    return namespace[fn.name]


def load_trl() -> tuple[Callable, Callable]:
    """TRL's importance sampling block as ``f(self, completion_mask, old, sampling) -> ratio`` and its
    static ``get_off_policy_mask``."""
    root = package_root("trl")
    tree = _tree(root / "trainer" / "grpo_trainer.py")
    block = None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and ast.unparse(node.test) == "self.use_vllm and self.vllm_importance_sampling_correction"
            and "per_token_logps_diff" in ast.unparse(node)
        ):
            block = node
            break
    assert block is not None, "the importance sampling block of GRPOTrainer was not found"
    fn = ast.parse(
        "def trl_importance_sampling(self, completion_mask, tool_mask, old_per_token_logps, sampling_per_token_logps):\n"
        "    return vllm_importance_sampling_ratio\n"
    ).body[0]
    assert isinstance(fn, ast.FunctionDef)
    fn.body = block.body + fn.body
    namespace: dict[str, Any] = {"torch": torch, "math": math}
    weights = _compile(fn, namespace)
    mask = _compile(_function(tree, "get_off_policy_mask"), {"torch": torch})
    return weights, mask


def load_openrlhf() -> type:
    """OpenRLHF's ``PolicyLoss`` class, its ``aggregate_loss`` replaced by the identity (per-token loss)."""
    root = package_root("openrlhf")
    masked_mean = _compile(_function(_tree(root / "models" / "utils.py"), "masked_mean"), {"torch": torch})
    stubs = {
        "openrlhf": _module("openrlhf"),
        "openrlhf.models": _module("openrlhf.models"),
        "openrlhf.models.utils": _module("openrlhf.models.utils", masked_mean=masked_mean),
    }
    before = set(sys.modules)
    sys.modules.update(stubs)
    try:
        loss = _exec_file("openrlhf.models.loss", root / "models" / "loss.py")
    finally:
        for name in set(sys.modules) - before:
            if name.startswith("openrlhf"):
                del sys.modules[name]
    loss.aggregate_loss = lambda loss, mask, **kwargs: loss  # the per-token loss, before any reduction
    return loss.PolicyLoss
