"""``lk.mismatch_metrics`` and ``lk.RolloutCorrection`` against the stacks' own code, in float64.

The code is the installed packages' (verl 0.9.1, TRL 1.16.0, OpenRLHF 0.11.2, loaded by
``tests/_mismatch_stacks.py`` with their framework imports stubbed); each test skips when its
package is not installed at that version. Inputs: random log-probs with padding, NaN and infinities
at padded positions, and fully masked rows. The stacks count a fully masked row as a sequence (verl:
of perplexity 1 and weight 1); ours drops it, so the stacks get the batch without those rows and
ours the whole batch, on whose other rows everything must agree to 1e-6 relative.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

import lightning_kl as lk
from _mismatch_stacks import load_openrlhf, load_trl, load_verl, load_verl_bypass_loss, package_root, verl_presets
from lightning_kl.correction import TRL_DEFAULTS

RTOL, ATOL = 1e-6, 1e-12


def _batch(seed: int, scale: float = 0.3, b: int = 10, t: int = 12, empty: bool = True) -> dict[str, Tensor]:
    """Log-probs of the trainer and the engine (float64), padding holding junk, rows 2 and 7 empty."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    if empty:
        lengths[[2, 7]] = 0
    mask = torch.arange(t) < lengths[:, None]
    rollout = -3.0 * torch.rand(b, t, generator=g, dtype=torch.float64)
    drift = scale * 0.5 * torch.randn(b, 1, generator=g, dtype=torch.float64)
    logprob = -(rollout + drift + scale * torch.randn(b, t, generator=g, dtype=torch.float64)).abs()  # <= 0
    junk = torch.tensor([math.nan, math.inf, -math.inf, -1e10], dtype=torch.float64).repeat(t)[:t].expand(b, t)
    return {
        "logprob": torch.where(mask, logprob, junk),
        "rollout": torch.where(mask, rollout, junk.flip(-1)),
        "mask": mask,
        "advantages": torch.randn(b, generator=g, dtype=torch.float64),
    }


def _nonempty(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    keep = batch["mask"].any(-1)
    return {k: v[keep] for k, v in batch.items()}


def _assert_metrics(ours: dict[str, Tensor], theirs: dict[str, Any], prefix: str = "", must: tuple[str, ...] = ()) -> None:
    theirs = {k.removeprefix(prefix): v for k, v in theirs.items()}
    common = sorted(set(ours) & set(theirs))
    missing = [k for k in must if k not in common]
    assert not missing, f"keys not compared: {missing}"
    for key in common:
        want = torch.as_tensor(theirs[key], dtype=torch.float64)
        assert_close(ours[key].to(torch.float64), want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")


# =================================================================================================
# verl 0.9.1: verl/trainer/ppo/rollout_corr_helper.py


@pytest.fixture(scope="module")
def verl() -> Any:
    helper, config = load_verl()
    return SimpleNamespace(helper=helper, config=config)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale", [0.02, 0.4])
def test_mismatch_metrics_equal_verl_compute_offpolicy_metrics(verl: Any, seed: int, scale: float) -> None:
    batch = _batch(seed, scale)
    ne = _nonempty(batch)
    theirs = verl.helper.compute_offpolicy_metrics(
        old_log_prob=ne["logprob"], rollout_log_prob=ne["rollout"], response_mask=ne["mask"].double()
    )
    ours = lk.mismatch_metrics(batch["logprob"], batch["rollout"], batch["mask"])
    assert set(theirs) <= set(ours)
    _assert_metrics(ours, theirs, must=tuple(theirs))


IS_OPTIONS = [
    (level, threshold, normalize)
    for level in ("token", "sequence")
    for threshold in (2.0, 1.5, "3.0", "0.5_5.0", "0.8_1.25")
    for normalize in (False, True)
]
IS_METRICS = (
    "rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_std", "rollout_is_eff_sample_size",
    "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low",
)  # fmt: skip


@pytest.mark.parametrize("level,threshold,normalize", IS_OPTIONS)
@pytest.mark.parametrize("seed", range(2))
def test_weights_equal_verl_compute_rollout_correction_weights(
    verl: Any, level: str, threshold: Any, normalize: bool, seed: int
) -> None:
    batch = _batch(seed)
    ne = _nonempty(batch)
    w_theirs, m_theirs = verl.helper.compute_rollout_correction_weights(
        ne["logprob"] - ne["rollout"], ne["mask"].double(), level, threshold, normalize
    )
    fix = lk.RolloutCorrection.from_verl(
        {"rollout_is": level, "rollout_is_threshold": threshold, "rollout_is_batch_normalize": normalize}
    )
    out = fix(batch["logprob"], batch["rollout"], batch["mask"])
    keep = batch["mask"].any(-1)
    assert out.weights is not None and not out.weights.requires_grad
    # verl's token weights are NaN at padded positions that hold NaN (NaN * 0): compare the valid ones
    assert_close(out.weights[keep][ne["mask"]], w_theirs[ne["mask"]], rtol=RTOL, atol=ATOL)
    assert (out.weights[~batch["mask"]] == 0).all()
    must = IS_METRICS + (("rollout_is_oob_ratio",) if "_" in str(threshold) else ())
    must += ("rollout_is_batch_norm_factor",) if normalize else ()
    _assert_metrics(out.metrics, m_theirs, must=must)
    assert torch.equal(out.mask, batch["mask"])


RS_CASES = [
    ("token_k1", "0.5_2.0"), ("token_k1", 1.5), ("token_k2", 0.05), ("token_k3", 0.05),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k1", 3.0), ("seq_sum_k2", 0.4), ("seq_sum_k3", 0.4),
    ("seq_mean_k1", "0.9_1.1"), ("seq_mean_k1", 1.2), ("seq_mean_k2", 0.05), ("seq_mean_k3", 0.05),
    ("seq_max_k2", 0.1), ("seq_max_k3", 0.1),
    ("token_k1,seq_mean_k3,seq_max_k2", "0.4_2.5,0.06,0.5"), ("seq_sum_k3,token_k3,seq_sum_k3", 0.3),
]  # fmt: skip


@pytest.mark.parametrize("options,threshold", RS_CASES)
@pytest.mark.parametrize("seed", range(2))
def test_rejection_equals_verl_compute_rollout_rejection_mask(verl: Any, options: str, threshold: Any, seed: int) -> None:
    batch = _batch(seed)
    ne = _nonempty(batch)
    mask_theirs, m_theirs = verl.helper.compute_rollout_rejection_mask(
        ne["logprob"] - ne["rollout"], ne["mask"].double(), options, threshold
    )
    out = lk.RolloutCorrection(weights=None, rejection=options, rejection_threshold=threshold)(
        batch["logprob"], batch["rollout"], batch["mask"]
    )
    assert out.weights is None
    keep = batch["mask"].any(-1)
    assert torch.equal(out.mask[keep], mask_theirs.bool()) and not out.mask[~keep].any()
    rejected = 0 < mask_theirs.sum() < ne["mask"].sum()
    assert rejected or "," in options, "the case rejects nothing or everything: choose another threshold"
    names = dict.fromkeys(o.strip() for o in options.split(","))
    must = ("rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction")
    for name in names:
        must += tuple(f"rollout_rs_{name}_{s}" for s in ("mean", "max", "min", "masked_fraction", "seq_masked_fraction"))
    _assert_metrics(out.metrics, m_theirs, must=must)


def _verl_fields(cfg: Any) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def test_every_verl_preset_is_read_by_from_verl(verl: Any) -> None:
    presets = verl_presets(verl.config)
    assert len(presets) >= 18, sorted(presets)
    for name, cfg in presets.items():
        batch = _batch(11, scale=0.05)
        ne = _nonempty(batch)
        fields = _verl_fields(cfg)
        w_theirs, mask_theirs, m_theirs = verl.helper.compute_rollout_correction_and_rejection_mask(
            ne["logprob"], ne["rollout"], ne["mask"].double(),
            rollout_is=fields["rollout_is"], rollout_is_threshold=fields["rollout_is_threshold"],
            rollout_is_batch_normalize=fields["rollout_is_batch_normalize"],
            rollout_rs=fields["rollout_rs"], rollout_rs_threshold=fields["rollout_rs_threshold"],
        )  # fmt: skip
        for source in (cfg, fields):  # the config object, and the same block as a mapping (YAML)
            fix = lk.RolloutCorrection.from_verl(source)
            assert fix.bypass == fields["bypass_mode"], name
            out = fix(batch["logprob"], batch["rollout"], batch["mask"])
            keep = batch["mask"].any(-1)
            assert torch.equal(out.mask[keep], mask_theirs.bool()), name
            if w_theirs is None:
                assert out.weights is None, name
            else:
                assert out.weights is not None, name
                w = w_theirs.batch["rollout_is_weights"]
                assert_close(out.weights[keep][ne["mask"]], w[ne["mask"]], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
            _assert_metrics(out.metrics, m_theirs, prefix="rollout_corr/", must=("kl", "chi2_seq", "training_ppl"))
            if fix.bypass:  # the engine's log-probs are the old ones
                assert out.old_logprob is batch["rollout"], name
            else:
                assert_close(out.old_logprob, batch["logprob"], rtol=0, atol=0, equal_nan=True)


def test_the_docs_loss_recipes_run_with_every_verl_preset_and_equal_verls_loss(verl: Any) -> None:
    # docs/mismatch.md's recipes, run as written: the decoupled one for decoupled_* presets, the reinforce
    # one for bypass_* presets with loss_type reinforce; some weigh nothing (fix.weights is None)
    from _snippets import snippet

    decoupled = snippet("docs/mismatch.md", "# weights pi_old / mu")
    reinforce = snippet("docs/mismatch.md", "verl's loss_type: reinforce")
    batch = _batch(5, scale=0.0005, empty=False)  # close enough for verl's geometric bounds (1 +- 0.001) to keep some
    mask = batch["mask"]
    clean = {k: torch.where(mask, batch[k], -1.0) for k in ("logprob", "rollout")}
    ran = []
    for name, cfg in verl_presets(verl.config).items():
        fields = _verl_fields(cfg)
        if fields["bypass_mode"] and fields["loss_type"] != "reinforce":
            continue  # ppo_clip in bypass mode: the clipped ratio and no weights (the prose of the page)
        correction = lk.RolloutCorrection.from_verl(cfg)
        logprob = clean["logprob"].clone().requires_grad_()
        adv = batch["advantages"]
        ns = {"torch": torch, "lk": lk, "eps": 0.2, "mask": mask, "logprob": logprob,
              "old_logprob": clean["logprob"], "self": SimpleNamespace(correction=correction, kl=lk.KLPenaltyLoss("k3+")),
              "batch": {"rollout_logprobs": clean["rollout"], "advantages": adv, "ref_logprobs": clean["rollout"]}}
        exec(reinforce if fields["bypass_mode"] else decoupled, ns)
        # verl: its own weights and mask, then -A * w * (log pi, or the clipped surrogate), token-mean
        w_theirs, mask_theirs, _ = verl.helper.compute_rollout_correction_and_rejection_mask(
            clean["logprob"], clean["rollout"], mask.double(),
            rollout_is=fields["rollout_is"], rollout_is_threshold=fields["rollout_is_threshold"],
            rollout_is_batch_normalize=fields["rollout_is_batch_normalize"],
            rollout_rs=fields["rollout_rs"], rollout_rs_threshold=fields["rollout_rs_threshold"],
        )  # fmt: skip
        w = 1.0 if w_theirs is None else w_theirs.batch["rollout_is_weights"]
        a = adv[:, None]
        if fields["bypass_mode"]:
            losses = -a * logprob.detach() * w
        else:
            ratio = torch.exp(logprob.detach() - clean["logprob"])
            losses = -w * torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
        keep = mask_theirs.bool()
        assert keep.any(), name
        want = losses[keep].sum() / keep.sum()
        assert_close(ns["policy_loss"].detach(), want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
        ran.append((name, w_theirs is None))
    assert any(none for _, none in ran) and any(not none for _, none in ran), ran
    assert "bypass_pg_geo_rs" in dict(ran)


BYPASS_CASES = [
    {"rollout_is": "token", "loss_type": "ppo_clip"},
    {"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0", "loss_type": "ppo_clip"},
    {"rollout_is": "token", "rollout_is_batch_normalize": True, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.05},
    {"rollout_is": None, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.9_1.1", "loss_type": "ppo_clip"},
    {"rollout_is": "token", "loss_type": "reinforce"},
    {"rollout_is": "sequence", "rollout_rs": "token_k2", "rollout_rs_threshold": 0.05, "loss_type": "reinforce"},
    {"rollout_is": None, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.9_1.1", "loss_type": "reinforce"},
]  # fmt: skip


@pytest.mark.parametrize("cfg", BYPASS_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_bypass_weights_are_those_verl_applies(verl: Any, cfg: dict[str, Any]) -> None:
    # verl 0.9.1's compute_policy_loss_bypass_mode: ppo_clip measures the weights (metrics) and passes
    # none to its loss (the ratio pi_theta / mu is the weight); reinforce passes them
    cfg = {**cfg, "bypass_mode": True}
    batch = _batch(5, scale=0.3)
    ne = _nonempty(batch)
    theirs = load_verl_bypass_loss(verl.helper)(cfg, ne["logprob"], ne["rollout"], ne["mask"].double())
    assert theirs["loss_type"] == cfg.get("loss_type", "ppo_clip")
    fix = lk.RolloutCorrection.from_verl(cfg)
    out = fix(batch["logprob"], batch["rollout"], batch["mask"])
    keep = batch["mask"].any(-1)
    if theirs["rollout_is_weights"] is None:
        assert out.weights is None
    else:
        assert out.weights is not None
        w = theirs["rollout_is_weights"]
        assert_close(out.weights[keep][ne["mask"]], w[ne["mask"]], rtol=RTOL, atol=ATOL)
    assert torch.equal(out.mask[keep], theirs["response_mask"].bool())
    assert out.old_logprob is batch["rollout"]
    must = ("rollout_is_mean", "rollout_is_eff_sample_size") if cfg["rollout_is"] else ()
    must += ("rollout_is_batch_norm_factor",) if cfg.get("rollout_is_batch_normalize") else ()
    _assert_metrics(out.metrics, theirs["metrics"], prefix="rollout_corr/", must=must + ("kl", "chi2_seq"))


def test_verl_defaults_and_bad_verl_blocks(verl: Any) -> None:
    # verl's YAML defaults: no weights, no rejection (metrics only)
    fix = lk.RolloutCorrection.from_verl({})
    assert fix.weights is None and fix.rejection is None and not fix.bypass
    # the dataclass default (rollout_is="sequence", threshold 2.0): sequence TIS
    fix = lk.RolloutCorrection.from_verl(verl.config())
    assert (fix.weights, fix.mode, fix.upper) == ("sequence", "truncate", 2.0)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rollout_is_treshold'\].*rollout_is_threshold"):
        lk.RolloutCorrection.from_verl({"rollout_is": "token", "rollout_is_treshold": 3.0})
    with pytest.raises(ValueError, match=r"unknown `rollout_is` 'geometric'.*None, 'token', 'sequence'"):
        lk.RolloutCorrection.from_verl({"rollout_is": "geometric"})
    with pytest.raises(ValueError, match=r"unknown rejection option 'seq_max_k1'; valid options: token_k1"):
        lk.RolloutCorrection.from_verl({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0})
    with pytest.raises(ValueError, match=r"needs a `rejection_threshold`"):
        lk.RolloutCorrection.from_verl({"rollout_rs": "token_k2"})
    with pytest.raises(ValueError, match=r"unknown `loss_type` 'ppo'.*'ppo_clip', 'reinforce'"):
        lk.RolloutCorrection.from_verl({"loss_type": "ppo"})


# =================================================================================================
# TRL 1.16.0: GRPOTrainer's importance sampling block and get_off_policy_mask


@pytest.fixture(scope="module")
def trl() -> Any:
    weights, mask = load_trl()
    return SimpleNamespace(weights=weights, mask=mask)


TRL_CASES = [
    {"vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_min": lo, "vllm_importance_sampling_clip_max": hi}
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    for lo, hi in ((None, 3.0), (0.5, 2.0), (0.8, None))
]


@pytest.mark.parametrize("cfg", TRL_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_weights_equal_trl_importance_sampling(trl: Any, cfg: dict[str, Any]) -> None:
    batch = _batch(4, scale=0.6)
    ne = _nonempty(batch)
    self = SimpleNamespace(
        vllm_importance_sampling_mode=cfg["vllm_importance_sampling_mode"],
        vllm_importance_sampling_clip_min=cfg["vllm_importance_sampling_clip_min"],
        vllm_importance_sampling_clip_max=cfg["vllm_importance_sampling_clip_max"],
    )
    # TRL multiplies the difference by the mask (NaN * 0 stays NaN, then nan_to_num makes it 0 but an
    # inf stays): its engines' padding is finite, so TRL gets zeros there
    lp = torch.where(ne["mask"], ne["logprob"], 0.0)
    ro = torch.where(ne["mask"], ne["rollout"], 0.0)
    theirs = trl.weights(self, ne["mask"].double(), None, lp, ro).expand_as(lp)
    out = lk.RolloutCorrection.from_trl({**cfg, "use_vllm": True})(batch["logprob"], batch["rollout"], batch["mask"])
    keep = batch["mask"].any(-1)
    assert out.weights is not None
    assert_close(out.weights[keep][ne["mask"]], theirs[ne["mask"]], rtol=RTOL, atol=ATOL)
    assert (out.weights[~batch["mask"]] == 0).all()
    lr = lp - ro
    if cfg["vllm_importance_sampling_mode"].startswith("sequence"):
        lr = lr.sum(-1, keepdim=True).expand_as(lr)
    changed = theirs[ne["mask"]] != torch.exp(lr)[ne["mask"]]
    assert changed.any() and not changed.all(), "the bounds must bite on some tokens only"


@pytest.mark.parametrize("seed", range(3))
def test_offpolicy_mask_equals_trl_get_off_policy_mask(trl: Any, seed: int) -> None:
    batch = _batch(seed, scale=0.4, b=16)
    ne = _nonempty(batch)
    lp = torch.where(ne["mask"], ne["logprob"], 0.0)
    ro = torch.where(ne["mask"], ne["rollout"], 0.0)
    # the threshold halfway between two of the negative-advantage sequences' mean log(mu / pi)
    seq_kl = ((ro - lp).sum(-1) / ne["mask"].sum(-1)).sort().values
    threshold = float(seq_kl[len(seq_kl) // 2 - 1 : len(seq_kl) // 2 + 1].mean())
    theirs = trl.mask(ne["advantages"][:, None], lp, ro, ne["mask"].double(), threshold)  # (B, 1)
    fix = lk.RolloutCorrection.from_trl(
        {"vllm_importance_sampling_correction": False, "off_policy_mask_threshold": threshold}
    )
    assert fix.weights is None
    out = fix(batch["logprob"], batch["rollout"], batch["mask"], advantages=batch["advantages"])
    keep = batch["mask"].any(-1)
    assert torch.equal(out.mask[keep], ne["mask"] & theirs.bool())
    assert 0 < theirs.sum() < len(theirs), "the threshold must drop some sequences only"
    with pytest.raises(ValueError, match="pass `advantages`"):
        fix(batch["logprob"], batch["rollout"], batch["mask"])


def test_trl_defaults_and_names() -> None:
    # TRL 1.16's defaults: no vLLM (use_vllm=False), so GRPOTrainer computes no importance weight
    assert lk.RolloutCorrection.from_trl({}).weights is None
    fix = lk.RolloutCorrection.from_trl({"use_vllm": True})  # with vLLM: sequence_mask, clip_max 3.0
    assert (fix.weights, fix.mode, fix.lower, fix.upper) == ("sequence", "mask", None, 3.0)
    assert lk.RolloutCorrection.from_trl({"use_vllm": True, "vllm_importance_sampling_cap": 2.5}).upper == 2.5
    with pytest.raises(ValueError, match=r"unknown `vllm_importance_sampling_mode` 'token'.*'token_truncate'"):
        lk.RolloutCorrection.from_trl({"vllm_importance_sampling_mode": "token"})
    args = SimpleNamespace(use_vllm=True, vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5)
    fix = lk.RolloutCorrection.from_trl(args)  # a GRPOConfig-like object, missing fields at TRL's defaults
    assert (fix.weights, fix.mode, fix.lower, fix.upper) == ("token", "mask", 0.5, 3.0)
    # without vLLM the off-policy sequence mask still applies (TRL's _compute_loss reads it either way)
    fix = lk.RolloutCorrection.from_trl({"off_policy_mask_threshold": 0.5})
    assert fix.weights is None and fix.offpolicy_mask_threshold == 0.5


def _trl_field_defaults() -> dict[str, Any]:
    """The defaults of ``GRPOConfig``'s fields, read from TRL's installed source (its syntax tree)."""
    tree = ast.parse((package_root("trl") / "trainer" / "grpo_config.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "GRPOConfig")
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(node.value, ast.Call):
            for kw in node.value.keywords:
                if kw.arg == "default":
                    out[node.target.id] = ast.literal_eval(kw.value)
    return out


def test_from_trl_reads_trl_defaults_and_weights_only_with_vllm() -> None:
    defaults = _trl_field_defaults()
    assert defaults["use_vllm"] is False  # TRL 1.16: generation by the trained model, no mismatch to correct
    for key, value in TRL_DEFAULTS.items():
        assert defaults[key] == value, key
    # GRPOTrainer computes (and applies) the importance sampling ratio only under this condition
    source = (package_root("trl") / "trainer" / "grpo_trainer.py").read_text()
    assert "if self.use_vllm and self.vllm_importance_sampling_correction:" in source
    for use_vllm in (False, True):
        for correction in (False, True):
            fix = lk.RolloutCorrection.from_trl({"use_vllm": use_vllm, "vllm_importance_sampling_correction": correction})
            assert (fix.weights is not None) == (use_vllm and correction), (use_vllm, correction)
    with pytest.raises(TypeError, match="`use_vllm` must be a bool, got 'yes'"):
        lk.RolloutCorrection.from_trl({"use_vllm": "yes"})


# =================================================================================================
# OpenRLHF 0.11.2: PolicyLoss (openrlhf/models/loss.py), correction coefficient and vllm_kl


@pytest.fixture(scope="module")
def openrlhf() -> Any:
    return load_openrlhf()


OPENRLHF_CASES = [
    ("token", "clip", [0.5, 5.0]), ("token", "clip", [0.8, 1.2]), ("token", "mask", [0.5, 5.0]),
    ("token", "mask", [0.8, 1.2]), ("token", "mask", [1.2]), ("seq", "mask", [0.9, 1.1]), ("seq", "mask", [1.05]),
]  # fmt: skip


@pytest.mark.parametrize("level,mode,threshold", OPENRLHF_CASES)
def test_weights_equal_openrlhf_policy_loss(openrlhf: type, level: str, mode: str, threshold: list[float]) -> None:
    batch = _batch(7, scale=0.6)
    ne = _nonempty(batch)
    # OpenRLHF's masked_mean multiplies by the mask (NaN * 0 = NaN): it gets finite padding
    lp = torch.where(ne["mask"], ne["logprob"], -1.0)
    ro = torch.where(ne["mask"], ne["rollout"], -2.0)
    low_high = [0.0, *threshold] if len(threshold) == 1 else threshold
    loss_fn = openrlhf(is_correction_level=level, is_correction_mode=mode, is_correction_threshold=low_high)
    # ratio 1 (log_probs = old_log_probs) and advantage -1: the per-token loss is the coefficient
    coef, _, _, vllm_kl, _ = loss_fn(lp, lp, -torch.ones_like(lp), ne["mask"].double(), rollout_log_probs=ro)
    cfg = {"is_correction_level": level, "is_correction_mode": mode, "is_correction_threshold": threshold}
    out = lk.RolloutCorrection.from_openrlhf(cfg)(batch["logprob"], batch["rollout"], batch["mask"])
    keep = batch["mask"].any(-1)
    assert out.weights is not None
    # a sequence OpenRLHF drops has coefficient 0; ours drops it from the mask (its weights stay)
    ours = torch.where(out.mask, out.weights, 0.0)[keep]
    assert_close(ours[ne["mask"]], coef[ne["mask"]], rtol=RTOL, atol=ATOL)
    assert_close(-out.metrics["kl"], -vllm_kl, rtol=RTOL, atol=ATOL)  # vllm_kl is verl's kl
    bite = coef[ne["mask"]] != torch.exp(lp - ro)[ne["mask"]]
    assert bite.any() and not bite.all(), "the bounds must bite on some tokens only"


def test_openrlhf_settings_and_refusals() -> None:
    assert lk.RolloutCorrection.from_openrlhf({}).weights is None  # is_correction_level="off"
    args = SimpleNamespace(algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="token")))
    fix = lk.RolloutCorrection.from_openrlhf(args)  # the parsed command line
    assert (fix.weights, fix.mode, fix.lower, fix.upper) == ("token", "mask", 0.5, 5.0)
    with pytest.raises(ValueError, match=r"is_correction_gating \(implemented here\)` 'tv'.*'ratio'"):
        lk.RolloutCorrection.from_openrlhf({"is_correction_level": "seq", "is_correction_gating": "tv"})
    with pytest.raises(ValueError, match="needs is_correction_level='token'"):
        lk.RolloutCorrection.from_openrlhf({"is_correction_level": "seq", "is_correction_mode": "clip"})
    with pytest.raises(ValueError, match=r"unknown `is_correction_level` 'sequence'.*'off', 'token', 'seq'"):
        lk.RolloutCorrection.from_openrlhf({"is_correction_level": "sequence"})
