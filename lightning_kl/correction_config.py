r"""Each training stack's rollout-correction settings, read verbatim, as :class:`~lightning_kl.RolloutCorrection`'s
arguments: verl's ``algorithm.rollout_correction`` block (and its actor's DPPO loss modes), TRL's ``GRPOConfig``
and OpenRLHF's ``algo.advantage`` (``RolloutCorrection.from_verl`` / ``from_trl`` / ``from_openrlhf`` document
each mapping)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

__all__ = [
    "OPENRLHF_DEFAULTS", "TRL_DEFAULTS", "TRL_MODES", "VERL_ACTOR_DEFAULTS", "VERL_DEFAULTS", "VERL_LOSS_MODES",
    "check_choice", "check_number", "openrlhf_arguments", "read_settings", "trl_arguments", "verl_arguments",
    "verl_dppo_arguments",
]  # fmt: skip

#: the keys of verl's ``algorithm.rollout_correction`` block (verl 0.9.1), with verl's defaults
VERL_DEFAULTS: dict[str, Any] = {
    "rollout_is": None,
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": None,
    "bypass_mode": False,
    "loss_type": "ppo_clip",
}
#: the settings of verl's actor (``actor_rollout_ref.actor``, verl 0.9.1) read by ``from_verl(..., actor=)``,
#: with the defaults of verl's ``ActorConfig`` / ``PolicyLossConfig``
VERL_ACTOR_DEFAULTS: dict[str, Any] = {
    "policy_loss": {"loss_mode": "vanilla"},
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "clip_ratio_c": 3.0,
}
#: verl 0.9.1's registered policy losses (``core_algos.register_policy_loss``)
VERL_LOSS_MODES = (
    "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo",
    "bypass_mode",
)  # fmt: skip
#: TRL's ``GRPOConfig`` fields read by :meth:`RolloutCorrection.from_trl` (TRL 1.16), with TRL's defaults
TRL_DEFAULTS: dict[str, Any] = {
    "use_vllm": False,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_cap": None,
    "off_policy_mask_threshold": None,
}
TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
#: OpenRLHF's ``algo.advantage`` settings read by :meth:`RolloutCorrection.from_openrlhf` (OpenRLHF 0.11.2)
OPENRLHF_DEFAULTS: dict[str, Any] = {
    "is_correction_level": "off",
    "is_correction_mode": "mask",
    "is_correction_gating": "ratio",
    "is_correction_threshold": (0.5, 5.0),
}


def check_number(name: str, value: Any, allow_none: bool = True) -> Optional[float]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a number{' or None' if allow_none else ''}, got {value!r}.")
    value = float(value)
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"`{name}` must be positive and finite, got {value!r}.")
    return value


def check_choice(name: str, value: Any, valid: tuple[Any, ...]) -> Any:
    if value not in valid:
        raise ValueError(f"unknown `{name}` {value!r}; valid values: {', '.join(repr(v) for v in valid)}.")
    return value


def read_settings(cfg: Any, defaults: dict[str, Any], who: str, strict: bool) -> dict[str, Any]:
    """The settings of ``cfg`` (a mapping or an object with attributes), verbatim, over ``defaults``."""
    out = dict(defaults)
    if isinstance(cfg, Mapping):
        extra = sorted(str(k) for k in cfg if k not in defaults and k != "_target_")
        if strict and extra:
            raise ValueError(f"unknown key(s) {extra} in {who}'s configuration; valid keys: {', '.join(defaults)}.")
        out.update({k: cfg[k] for k in cfg if k in defaults})
    elif cfg is not None:
        out.update({k: getattr(cfg, k) for k in defaults if hasattr(cfg, k)})
    return out


def verl_dppo_arguments(actor: Any, block: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The constructor's arguments for verl's DPPO policy loss (``from_verl(..., actor=)``), or None for
    another loss mode."""
    a = read_settings(actor, VERL_ACTOR_DEFAULTS, "verl's actor", strict=False)
    loss = a["policy_loss"]
    mode = loss.get("loss_mode", "vanilla") if isinstance(loss, Mapping) else getattr(loss, "loss_mode", "vanilla")
    mode = check_choice("policy_loss.loss_mode", mode, VERL_LOSS_MODES)
    if mode not in ("dppo_tv", "dppo_kl"):
        return None
    if block["bypass_mode"]:
        raise ValueError(
            f"loss_mode={mode!r} with bypass_mode=True: verl replaces the loss mode by 'bypass_mode' there "
            "(rollout_corr_helper.setup_bypass_mode), so no DPPO gate applies; set bypass_mode=False, or drop the "
            "DPPO loss mode to load the bypass correction."
        )
    if block["rollout_is"] is not None or block["rollout_rs"] is not None:
        raise ValueError(
            f"loss_mode={mode!r} with rollout_is/rollout_rs: verl multiplies two ratios (the old policy's to the "
            "sampler's, the current policy's to the old one's), which one correction does not hold: build "
            "RolloutCorrection.from_verl(block) for the first (called with the old and the sampler's log-probs) and "
            "RolloutCorrection.from_verl({}, actor=actor) for the second (the current and the old log-probs)."
        )
    clip = a["clip_ratio"]
    low = clip if a["clip_ratio_low"] is None else a["clip_ratio_low"]
    high = clip if a["clip_ratio_high"] is None else a["clip_ratio_high"]
    return {
        "weights": "token", "mode": "truncate", "lower": None, "upper": a["clip_ratio_c"], "bypass": True,
        "trust_region": "binary_tv" if mode == "dppo_tv" else "binary_kl", "trust_region_threshold": (low, high),
    }  # fmt: skip


def verl_arguments(cfg: Any, actor: Any = None) -> dict[str, Any]:
    """:class:`~lightning_kl.RolloutCorrection`'s arguments from verl's ``algorithm.rollout_correction`` block
    (and, optionally, its actor's settings): ``RolloutCorrection.from_verl``."""
    c = read_settings(cfg, VERL_DEFAULTS, "verl's rollout_correction", strict=True)
    level = check_choice("rollout_is", c["rollout_is"], (None, "token", "sequence"))
    check_choice("loss_type", c["loss_type"], ("ppo_clip", "reinforce"))
    if actor is not None:
        dppo = verl_dppo_arguments(actor, c)
        if dppo is not None:
            return dppo
    threshold = c["rollout_is_threshold"]
    args: dict[str, Any] = {"weights": None if threshold is None else level, "upper": None}
    if args["weights"] is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
            raise TypeError(f"`rollout_is_threshold` must be a number or a 'lower_upper' string, got {threshold!r}.")
        text = str(threshold).strip()
        try:
            if "_" in text:
                lo, hi = text.split("_", 1)
                args.update(mode="mask", lower=float(lo), upper=float(hi))
            else:
                args.update(mode="truncate", upper=float(text))
        except ValueError:
            raise ValueError(f"invalid `rollout_is_threshold` {threshold!r}: a number or 'lower_upper'.") from None
        args["batch_normalize"] = bool(c["rollout_is_batch_normalize"])
    args.update(rejection=c["rollout_rs"], rejection_threshold=c["rollout_rs_threshold"] if c["rollout_rs"] else None)
    args["bypass"] = bool(c["bypass_mode"])
    if args["bypass"] and c["loss_type"] == "ppo_clip" and args["weights"] is not None:
        args["return_weights"] = False  # verl: "DO NOT apply IS weights - would be double-counting!"
    return args


def trl_arguments(cfg: Any) -> dict[str, Any]:
    """:class:`~lightning_kl.RolloutCorrection`'s arguments from TRL's ``GRPOConfig``: ``RolloutCorrection.from_trl``."""
    c = read_settings(cfg, TRL_DEFAULTS, "TRL", strict=False)
    if not isinstance(c["use_vllm"], bool):
        raise TypeError(f"`use_vllm` must be a bool, got {c['use_vllm']!r}.")
    mode = check_choice("vllm_importance_sampling_mode", c["vllm_importance_sampling_mode"], TRL_MODES)
    upper = c["vllm_importance_sampling_clip_max"]
    if c["vllm_importance_sampling_cap"] is not None:
        upper = c["vllm_importance_sampling_cap"]
    level, how = mode.split("_")
    args: dict[str, Any] = {"weights": None, "upper": None}
    if c["use_vllm"] and c["vllm_importance_sampling_correction"]:
        args = {"weights": level, "mode": how, "lower": c["vllm_importance_sampling_clip_min"], "upper": upper}
    return {**args, "offpolicy_mask_threshold": c["off_policy_mask_threshold"]}


def openrlhf_arguments(cfg: Any) -> dict[str, Any]:
    """:class:`~lightning_kl.RolloutCorrection`'s arguments from OpenRLHF's ``algo.advantage`` settings:
    ``RolloutCorrection.from_openrlhf``."""
    algo = getattr(cfg, "algo", None)
    if algo is not None and hasattr(algo, "advantage"):
        cfg = algo.advantage
    c = read_settings(cfg, OPENRLHF_DEFAULTS, "OpenRLHF", strict=False)
    level = check_choice("is_correction_level", c["is_correction_level"], ("off", "token", "seq"))
    how = check_choice("is_correction_mode", c["is_correction_mode"], ("mask", "clip"))
    check_choice("is_correction_gating (implemented here)", c["is_correction_gating"], ("ratio",))
    threshold = list(c["is_correction_threshold"])
    if len(threshold) == 1:
        threshold.insert(0, 0.0)  # one value is an upper bound only, as OpenRLHF's command line reads it
    if len(threshold) != 2:
        raise ValueError(f"`is_correction_threshold` takes [high] or [low, high], got {c['is_correction_threshold']!r}.")
    low, high = (float(x) for x in threshold)
    lower = low if low > 0 else None
    if level == "off":
        return {"weights": None, "upper": None}
    if level == "token":
        return {"weights": "token", "mode": "truncate" if how == "clip" else "mask", "lower": lower, "upper": high}
    if how == "clip":
        raise ValueError("is_correction_mode='clip' needs is_correction_level='token' (as OpenRLHF requires).")
    bounds = f"{1.0 / high!r}_{(1.0 / low if low > 0 else math.inf)!r}"
    return {"weights": "token", "upper": None, "rejection": "seq_mean_k1", "rejection_threshold": bounds}
