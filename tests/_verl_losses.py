"""verl 0.9.1's own policy losses, for ``tests/test_trust_region.py``, ``tests/test_cov_select.py`` and ``tests/test_verl_dro.py``.

From the installed package (``.stacks`` or ``LIGHTNING_KL_STACKS``, found as ``tests/_mismatch_stacks.py``
finds it; the test skips where it is missing): ``compute_policy_loss_dppo_tv``, ``_dppo_kl``, ``_kl_cov``,
``_clip_cov``, ``_dro`` and ``agg_loss`` of ``verl/trainer/ppo/core_algos.py``, and ``masked_sum`` / ``masked_mean``
of ``verl/utils/torch_functional.py``, taken out by their syntax tree and executed as they are (the
module itself imports omegaconf, numpy and verl's configs). Nothing here copies their code.

:func:`verl_config` is the ``config`` those functions read: verl's ``ActorConfig`` fields
(``clip_ratio``, ``clip_ratio_low`` / ``_high``, ``clip_ratio_c``, ``policy_loss``, a dict-like ``get``)
and ``global_batch_info`` (empty: one process, ``agg_loss``'s defaults).
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch

from _mismatch_stacks import _compile, _function, _tree, package_root

LOSSES = ("compute_policy_loss_dppo_tv", "compute_policy_loss_dppo_kl", "compute_policy_loss_kl_cov",
          "compute_policy_loss_clip_cov", "compute_policy_loss_dro")  # fmt: skip


class _Config(types.SimpleNamespace):
    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def verl_config(**fields: Any) -> _Config:
    """An ``ActorConfig`` stand-in: ``clip_ratio*``, ``clip_ratio_c``, ``policy_loss`` (a namespace of
    ``PolicyLossConfig`` fields, with verl's defaults), ``global_batch_info``."""
    loss = {"loss_mode": "vanilla", "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
            "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1, "dro_beta": None}  # fmt: skip
    loss.update(fields.pop("policy_loss", {}))
    base = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "global_batch_info": {}}
    base.update(fields)
    return _Config(policy_loss=_Config(**loss), **base)


def load_verl_losses() -> dict[str, Callable[..., Any]]:
    """``{"dppo_tv": f, "dppo_kl": f, "kl_cov": f, "clip_cov": f, "dro": f, "agg_loss": agg}``; each ``f(old_log_prob,
    log_prob, advantages, response_mask, loss_agg_mode, config)`` returns verl's ``(pg_loss, metrics)``; ``agg`` is
    verl's ``agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
    loss_scale_factor=None)``."""
    root = package_root("verl")
    tf = _tree(root / "utils" / "torch_functional.py")
    base = {"torch": torch}
    verl_f = types.SimpleNamespace(masked_sum=_compile(_function(tf, "masked_sum"), dict(base)))
    verl_f.masked_mean = _compile(_function(tf, "masked_mean"), {"torch": torch, "masked_sum": verl_f.masked_sum})
    core = _tree(root / "trainer" / "ppo" / "core_algos.py")
    namespace: dict[str, Any] = {
        "torch": torch, "verl_F": verl_f, "Any": Any, "Optional": Optional, "ActorConfig": object,
        "AlgoConfig": type("AlgoConfig", (), {}),
    }  # fmt: skip
    namespace["agg_loss"] = _compile(_function(core, "agg_loss"), namespace)
    losses = {name.removeprefix("compute_policy_loss_"): _compile(_function(core, name), namespace) for name in LOSSES}
    return {**losses, "agg_loss": namespace["agg_loss"]}
