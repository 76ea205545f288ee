"""``lk.mismatch_metrics``, ``lk.MismatchMetric`` and ``lk.RolloutCorrection`` against float64 maths
written from the formulas of ``docs/mismatch.md`` (a loop over sequences and tokens, no masks), their
edges (a value exactly at a bound, padding holding junk, empty rows and batches), their refusals, no
host read, and a real Lightning loop that puts the weights and the mask into the loss."""

from __future__ import annotations

import math
import pickle
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.mismatch import METRIC_KEYS, REJECTION_OPTIONS
from test_no_host_sync import device_form

F64 = torch.float64


def _batch(seed: int = 0, b: int = 6, t: int = 7, scale: float = 0.4) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[1] = 0
    mask = torch.arange(t) < lengths[:, None]
    ro = -3.0 * torch.rand(b, t, generator=g, dtype=F64)
    lp = ro + scale * torch.randn(b, t, generator=g, dtype=F64) + scale * torch.randn(b, 1, generator=g, dtype=F64)
    lp = -lp.abs()  # log-probs: <= 0 (a log-prob above 0 is refused)
    lp = torch.where(mask, lp, math.nan)
    ro = torch.where(mask, ro, torch.tensor([math.inf, -math.inf, math.nan], dtype=F64).repeat(t)[:t])
    return lp, ro, mask


def _sequences(lp: Tensor, ro: Tensor, mask: Tensor) -> list[tuple[list[float], list[float]]]:
    """The valid tokens of every sequence that has one, as Python floats."""
    out = []
    for i in range(lp.shape[0]):
        idx = [j for j in range(lp.shape[1]) if bool(mask[i, j])]
        if idx:
            out.append(([float(lp[i, j]) for j in idx], [float(ro[i, j]) for j in idx]))
    return out


def reference_metrics(lp: Tensor, ro: Tensor, mask: Tensor) -> dict[str, float]:
    """Every key of docs/mismatch.md's table, from its formula, token by token."""
    seqs = _sequences(lp, ro, mask)
    ells = [a - b for p, r in seqs for a, b in zip(p, r)]
    n, bn = len(ells), len(seqs)
    mean_p = [sum(p) / len(p) for p, _ in seqs]
    mean_r = [sum(r) / len(r) for _, r in seqs]
    diff = [b - a for a, b in zip(mean_p, mean_r)]
    clamp = lambda x: max(-20.0, min(20.0, x))  # noqa: E731
    return {
        "training_ppl": sum(math.exp(-m) for m in mean_p) / bn,
        "training_log_ppl": sum(-m for m in mean_p) / bn,
        "kl": sum(-e for e in ells) / n,
        "k3_kl": sum(math.exp(e) - e - 1 for e in ells) / n,
        "rollout_ppl": sum(math.exp(-m) for m in mean_r) / bn,
        "rollout_log_ppl": sum(-m for m in mean_r) / bn,
        "log_ppl_diff": sum(diff) / bn,
        "log_ppl_abs_diff": sum(abs(x) for x in diff) / bn,
        "log_ppl_diff_max": max(diff),
        "log_ppl_diff_min": min(diff),
        "ppl_ratio": sum(math.exp(x) for x in diff) / bn,
        "chi2_token": sum(math.exp(2 * clamp(e)) for e in ells) / n - 1,
        "chi2_seq": sum(math.exp(2 * clamp(sum(p) - sum(r))) for p, r in seqs) / bn - 1,
        "token_mult_prob_error": sum(math.exp(abs(e)) for e in ells) / n,
        "gen_kl_error": sum(math.exp(e) - e - 1 for e in ells) / n,
        "policy_kl_error": sum(math.exp(-e) + e - 1 for e in ells) / n,
        "logp_abs_diff_mean": sum(abs(e) for e in ells) / n,
        "logp_abs_diff_max": max(abs(e) for e in ells),
        "ratio_min": math.exp(min(ells)),
        "ratio_mean": sum(math.exp(e) for e in ells) / n,
        "ratio_max": math.exp(max(ells)),
    }


@pytest.mark.parametrize("seed", range(3))
def test_every_metric_equals_its_formula_and_padding_never_leaks(seed: int) -> None:
    lp, ro, mask = _batch(seed)
    got = lk.mismatch_metrics(lp, ro, mask)
    want = reference_metrics(lp, ro, mask)
    assert tuple(got) == METRIC_KEYS and set(want) == set(METRIC_KEYS)
    for key in METRIC_KEYS:
        assert got[key].dtype == F64 and got[key].ndim == 0
        assert_close(got[key], torch.tensor(want[key], dtype=F64), rtol=1e-12, atol=1e-14, msg=lambda m: f"{key}: {m}")


def test_an_empty_row_or_a_leading_dimension_changes_nothing() -> None:
    lp, ro, mask = _batch(4)
    base = lk.mismatch_metrics(lp, ro, mask)
    keep = mask.any(-1)
    for args in (
        (lp[keep], ro[keep], mask[keep]),  # the empty row removed
        (lp.reshape(2, 3, -1), ro.reshape(2, 3, -1), mask.reshape(2, 3, -1)),  # [2, 3, t]
    ):
        other = lk.mismatch_metrics(*args)
        for key in METRIC_KEYS:
            assert_close(other[key], base[key], rtol=1e-14, atol=0)


def test_no_valid_token_is_nan_not_zero_and_no_mask_means_every_token() -> None:
    lp, ro, mask = _batch(5)
    empty = lk.mismatch_metrics(lp, ro, torch.zeros_like(mask))
    assert all(torch.isnan(v) for v in empty.values())
    assert all(torch.isnan(v) for v in lk.mismatch_metrics(lp[:0], ro[:0], mask[:0]).values())
    full = torch.ones_like(mask)
    lp0, ro0 = torch.where(mask, lp, -1.0), torch.where(mask, ro, -1.5)
    a, b = lk.mismatch_metrics(lp0, ro0), lk.mismatch_metrics(lp0, ro0, full)
    assert all(torch.equal(a[k], b[k]) for k in METRIC_KEYS)


def test_identical_log_probs_measure_no_mismatch() -> None:
    lp, _, mask = _batch(6)
    got = lk.mismatch_metrics(lp, lp.clone(), mask)
    zeros = ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq", "gen_kl_error")
    assert all(float(got[k]) == 0.0 for k in zeros + ("policy_kl_error", "logp_abs_diff_max"))
    assert all(float(got[k]) == 1.0 for k in ("ppl_ratio", "token_mult_prob_error", "ratio_min", "ratio_max"))
    assert_close(got["training_ppl"], got["rollout_ppl"], rtol=0, atol=0)


def test_bad_inputs_are_refused_with_their_shapes() -> None:
    lp, ro, mask = _batch(0)
    with pytest.raises(ValueError, match=r"same shape: got logprob \(6, 7\) and rollout_logprob \(6, 6\)"):
        lk.mismatch_metrics(lp, ro[:, :6], mask)
    with pytest.raises(ValueError, match=r"`mask` must have the shape of `logprob`: got mask \(6, 6\)"):
        lk.mismatch_metrics(lp, ro, mask[:, :6])
    with pytest.raises(TypeError, match="floating point"):
        lk.mismatch_metrics(lp.long(), ro, mask)
    with pytest.raises(ValueError, match="token dimension"):
        lk.mismatch_metrics(lp[0, 0], ro[0, 0])


# =================================================================================================
# the metric: accumulation equals one call on the concatenated batches


def test_metric_accumulates_exactly_and_resets() -> None:
    metric = lk.MismatchMetric()
    parts = [_batch(s, b=3 + s, t=4 + 2 * s) for s in range(3)]
    for lp, ro, mask in parts:
        metric.update(lp, ro, mask)
    t = max(p[0].shape[1] for p in parts)
    pad = lambda x, v: torch.nn.functional.pad(x, (0, t - x.shape[1]), value=v)  # noqa: E731
    whole = lk.mismatch_metrics(
        torch.cat([pad(p[0], math.nan) for p in parts]),
        torch.cat([pad(p[1], math.nan) for p in parts]),
        torch.cat([pad(p[2], False) for p in parts]),
    )
    got = metric.compute()
    for key in METRIC_KEYS:
        assert_close(got[key], whole[key], rtol=1e-12, atol=1e-14, msg=lambda m: f"{key}: {m}")
    batch = metric(*parts[0])  # forward: this batch's values, and accumulates
    assert_close(batch["kl"], lk.mismatch_metrics(*parts[0])["kl"], rtol=1e-12, atol=0)
    metric.reset()
    with pytest.warns(UserWarning, match="was called before the ``update`` method"):
        assert all(torch.isnan(v) for v in metric.compute().values())
    pickle.loads(pickle.dumps(metric))


# =================================================================================================
# RolloutCorrection: weights and masks from their formulas, bounds exactly at a value


def _reference_weight(p: list[float], r: list[float], level: str) -> list[float]:
    ells = [a - b for a, b in zip(p, r)]
    clamp = lambda x: max(-20.0, min(20.0, x))  # noqa: E731
    if level == "token":
        return [math.exp(clamp(e)) for e in ells]
    total = sum(ells) if level == "sequence" else sum(ells) / len(ells)
    return [math.exp(clamp(total))] * len(ells)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode,lower,upper", [("truncate", None, 2.0), ("truncate", 0.5, 1.5), ("mask", 0.5, 2.0), ("mask", None, 1.2), ("truncate", None, None)])
def test_weights_equal_their_formula(level: str, mode: str, lower: Any, upper: Any) -> None:
    lp, ro, mask = _batch(7, scale=0.3)
    out = lk.RolloutCorrection(level, mode=mode, lower=lower, upper=upper)(lp, ro, mask)
    assert out.weights is not None
    rows = [i for i in range(lp.shape[0]) if mask[i].any()]
    for i, (p, r) in zip(rows, _sequences(lp, ro, mask)):
        raw = _reference_weight(p, r, level)
        if mode == "truncate":
            want = [min(max(w, lower if lower is not None else -math.inf), upper if upper is not None else math.inf) for w in raw]
        else:
            want = [w if (lower is None or w >= lower) and (upper is None or w <= upper) else 0.0 for w in raw]
        assert_close(out.weights[i][mask[i]], torch.tensor(want, dtype=F64), rtol=1e-12, atol=0)
    assert (out.weights[~mask] == 0).all() and torch.equal(out.mask, mask)


def test_a_weight_exactly_at_a_bound_is_kept_and_one_beyond_is_not() -> None:
    lp = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64)
    ro = torch.tensor([[0.0, 1e-9, -1e-9]], dtype=F64)  # ratios 1, just above 1, just below 1
    fix = lk.RolloutCorrection("token", mode="mask", lower=1.0, upper=1.0)  # lower == upper: only ratio 1
    assert fix(lp, ro).weights.tolist() == [[1.0, 0.0, 0.0]]
    fix = lk.RolloutCorrection("token", mode="truncate", lower=1.0, upper=1.0)
    assert fix(lp, ro).weights.tolist() == [[1.0, 1.0, 1.0]]
    # rejection: a statistic exactly at its bound passes (k2 = l^2 / 2 = 0.5 at l = 1; k1 bounds in logs)
    lp = torch.tensor([[-1.0, -2.0], [-1.0 + 1e-9, -2.0], [-2.0, -2.0]], dtype=F64)
    ro = torch.full_like(lp, -2.0)
    out = lk.RolloutCorrection(None, rejection="token_k2", rejection_threshold=0.5)(lp, ro)
    assert out.mask.tolist() == [[True, True], [False, True], [True, True]]
    out = lk.RolloutCorrection(None, rejection="seq_max_k2", rejection_threshold=0.5)(lp, ro)
    assert out.mask.tolist() == [[True, True], [False, False], [True, True]]
    out = lk.RolloutCorrection(None, rejection="token_k1", rejection_threshold="1.0_1.0")(lp, ro)
    assert out.mask.tolist() == [[False, True], [False, True], [True, True]]


def test_rejection_and_offpolicy_mask_follow_their_formulas() -> None:
    lp, ro, mask = _batch(8, scale=0.3)
    adv = torch.tensor([0.0, -1.0, -0.5, -0.1, -2.0, -3.0], dtype=F64)
    fix = lk.RolloutCorrection(None, rejection="seq_sum_k3,token_k1", rejection_threshold="0.3,0.6_1.8", offpolicy_mask_threshold=-0.05)
    out = fix(lp, ro, mask, advantages=adv)
    rows = [i for i in range(lp.shape[0]) if mask[i].any()]
    for i, (p, r) in zip(rows, _sequences(lp, ro, mask)):
        ells = [a - b for a, b in zip(p, r)]
        seq_ok = sum(math.exp(e) - 1 - e for e in ells) <= 0.3
        off_ok = float(adv[i]) >= 0 or sum(-e for e in ells) / len(ells) <= -0.05
        want = [seq_ok and off_ok and math.log(0.6) <= -e <= math.log(1.8) for e in ells]
        assert out.mask[i][mask[i]].tolist() == want, i
    assert not out.mask[~mask].any()
    assert 0 < float(out.metrics["rollout_rs_masked_fraction"]) < 1
    assert 0 < float(out.metrics["offpolicy_seq_masked_fraction"]) < 1


def test_weights_are_detached_and_computed_in_float32_for_half_inputs() -> None:
    lp, ro, mask = _batch(9)
    lp = torch.where(mask, lp, 0.0).float().requires_grad_()
    out = lk.RolloutCorrection("sequence", bypass=True)(lp, ro.float(), mask)
    assert not out.weights.requires_grad and out.weights.dtype == torch.float32
    half = lk.RolloutCorrection("token")(lp.detach().bfloat16(), ro.bfloat16(), mask)
    assert half.weights.dtype == torch.float32


def test_batch_normalize_divides_by_the_mean_weight() -> None:
    lp, ro, mask = _batch(10)
    for level in ("token", "sequence"):
        plain = lk.RolloutCorrection(level, upper=3.0)(lp, ro, mask).weights
        norm = lk.RolloutCorrection(level, upper=3.0, batch_normalize=True)(lp, ro, mask)
        if level == "token":
            mean = plain[mask].mean()
        else:
            mean = plain[mask.any(-1), 0].mean()  # one weight per non-empty sequence
        assert_close(norm.weights, plain / mean, rtol=1e-12, atol=0)
        assert_close(norm.metrics["rollout_is_batch_norm_factor"], mean, rtol=1e-12, atol=0)


BAD = [
    (dict(weights="seq"), ValueError, r"unknown `weights` 'seq'; valid values: 'token', 'sequence', 'geometric', None"),
    (dict(mode="clip"), ValueError, r"unknown `mode` 'clip'; valid values: 'truncate', 'mask'"),
    (dict(upper=0.0), ValueError, r"`upper` must be positive and finite, got 0.0"),
    (dict(upper=math.inf), ValueError, r"`upper` must be positive and finite"),
    (dict(lower=True), TypeError, r"`lower` must be a number or None, got True"),
    (dict(lower=3.0, upper=2.0), ValueError, r"`lower` \(3.0\) must not exceed `upper` \(2.0\)"),
    (dict(mode="mask", upper=None), ValueError, r"give `lower`, `upper` or both"),
    (dict(weights=None, batch_normalize=True), ValueError, r"`weights` is None"),
    (dict(rejection="seq_k3", rejection_threshold=1.0), ValueError, "valid options: " + ", ".join(REJECTION_OPTIONS)),
    (dict(rejection="token_k2", rejection_threshold="0.1_0.2"), ValueError, r"one upper bound, not the range '0.1_0.2'"),
    (dict(rejection="token_k1", rejection_threshold="2.0_0.5"), ValueError, r"lower > upper"),
    (dict(rejection="token_k1,token_k2", rejection_threshold="1,2,3"), ValueError, r"3 rejection thresholds for 2 options"),
    (dict(rejection="token_k2", rejection_threshold=-1.0), ValueError, r"must be positive"),
    (dict(rejection_threshold=1.0), ValueError, r"given without `rejection`"),
    (dict(offpolicy_mask_threshold="0.5"), TypeError, r"`offpolicy_mask_threshold` must be a number"),
    (dict(bypass=1), TypeError, r"`bypass` must be a bool"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD)
def test_bad_configuration_fails_at_construction_naming_the_valid_values(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        lk.RolloutCorrection(**kwargs)


def test_bad_advantages_are_refused_with_their_shape() -> None:
    lp, ro, mask = _batch(0)
    fix = lk.RolloutCorrection(offpolicy_mask_threshold=0.1)
    with pytest.raises(ValueError, match=r"`advantages` must be \[...\], \[..., 1\] or \[..., t\] for log-probs \(6, 7\), got \(7,\)"):
        fix(lp, ro, mask, advantages=torch.zeros(7))


def test_yaml_builds_it_from_plain_values() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(lk.RolloutCorrection, "fix")
    cfg = parser.parse_string(
        "fix:\n  weights: sequence\n  mode: mask\n  lower: 0.5\n  upper: 5.0\n"
        "  rejection: [token_k1, seq_mean_k3]\n  rejection_threshold: ['0.5_2.0', 0.01]\n"
    )
    fix = lk.RolloutCorrection(**cfg.fix)
    assert (fix.weights, fix.mode, fix.lower, fix.upper) == ("sequence", "mask", 0.5, 5.0)
    assert [(o.name, o.lower, o.upper) for o in fix.rejection] == [("token_k1", 0.5, 2.0), ("seq_mean_k3", None, 0.01)]
    again = pickle.loads(pickle.dumps(fix))  # a module that checkpoints and spawned processes can carry
    assert (again.weights, again.mode, again.rejection) == (fix.weights, fix.mode, fix.rejection)


# =================================================================================================
# no host read, as on a GPU


def test_nothing_is_read_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    lp, ro, mask = _batch(12)
    adv = torch.randn(lp.shape[0], dtype=F64)
    fix = lk.RolloutCorrection("token", mode="mask", lower=0.5, upper=2.0, batch_normalize=True,
                               rejection="token_k1,seq_max_k3", rejection_threshold="0.5_2.0,0.2", offpolicy_mask_threshold=0.0)  # fmt: skip
    host = fix(lp, ro, mask, advantages=adv)
    host_metrics = lk.mismatch_metrics(lp, ro, mask)
    metric = lk.MismatchMetric()
    with device_form(monkeypatch):
        dev = fix(lp, ro, mask, advantages=adv)
        dev_metrics = lk.mismatch_metrics(lp, ro, mask)
        metric.update(lp, ro, mask)
        from_metric = metric.compute()
    assert torch.equal(dev.weights, host.weights) and torch.equal(dev.mask, host.mask)
    for key, value in host.metrics.items():
        assert torch.equal(dev.metrics[key], value) or (value.isnan() and dev.metrics[key].isnan()), key
    for key in METRIC_KEYS:
        assert torch.equal(dev_metrics[key], host_metrics[key]) and torch.equal(from_metric[key], host_metrics[key])


# =================================================================================================
# a real Lightning loop: weights and kept mask into the policy loss and KLPenaltyLoss


class _Corrected(pl.LightningModule):
    """A tabular policy trained on rollouts of a stale "engine" copy, with the recipe of docs/mismatch.md."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(5, 3, dtype=F64))
        self.correction = lk.RolloutCorrection("token", upper=2.0, rejection="seq_mean_k3", rejection_threshold=0.5)
        self.kl = lk.KLPenaltyLoss("k3", coef=0.1)
        self.mismatch = lk.MismatchMetric()
        self.seen: list[dict[str, Any]] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        tokens, mask = batch["tokens"], batch["mask"]
        logprob = torch.log_softmax(self.logits, -1).expand(tokens.shape[0], -1, -1).gather(-1, tokens[..., None])[..., 0]
        fix = self.correction(logprob.detach(), batch["rollout_logprobs"], mask)  # decoupled: old = trainer's
        ratio = torch.exp(logprob - fix.old_logprob)
        policy = lk.aggregate(-fix.weights * ratio * batch["advantages"][:, None], fix.mask, "token-mean")
        # the KL term's sampler is the engine: its weight pi / mu is the whole chain (docs/mismatch.md)
        kl = self.kl(logprob, batch["ref_logprobs"], fix.mask, old_logprob=batch["rollout_logprobs"])
        self.mismatch.update(logprob, batch["rollout_logprobs"], mask)
        self.log_dict({f"mismatch/{k}": v for k, v in fix.metrics.items() if k in ("kl", "rollout_is_mean")})
        self.seen.append({"kept": int(fix.mask.sum()), "tokens": int(mask.sum())})
        return policy + kl

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _rollouts(n: int = 4) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    engine = torch.log_softmax(torch.randn(5, 3, generator=g, dtype=F64) * 0.3, -1)  # the stale copy
    out = []
    for _ in range(n):
        tokens = torch.multinomial(engine.exp(), 8, replacement=True, generator=g).T  # [8, 5]
        mask = torch.arange(5) < torch.randint(2, 6, (8, 1), generator=g)
        ro = engine.expand(8, -1, -1).gather(-1, tokens[..., None])[..., 0]
        out.append({
            "tokens": tokens, "mask": mask, "rollout_logprobs": torch.where(mask, ro, math.nan),
            "ref_logprobs": torch.full((8, 5), math.log(1 / 3), dtype=F64),
            "advantages": torch.randn(8, generator=g, dtype=F64),
        })  # fmt: skip
    return out


def test_a_lightning_loop_trains_with_the_corrected_loss(quiet_trainer: Any) -> None:
    module = _Corrected()
    data = _rollouts()
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    before = module.logits.detach().clone()
    quiet_trainer(max_epochs=1).fit(module, loader)
    assert not torch.equal(module.logits.detach(), before)
    assert len(module.seen) == len(data) and all(0 < s["kept"] <= s["tokens"] for s in module.seen)
    got = module.mismatch.compute()
    assert torch.isfinite(got["kl"]) and float(got["k3_kl"]) > 0  # k3 >= 0, and the copies differ


# =================================================================================================
# the exact-enumeration study of docs/mismatch.md: its claims, recomputed


def test_the_study_figures_of_the_docs_hold() -> None:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "mismatch_study.py"
    spec = importlib.util.spec_from_file_location("lk_mismatch_study", path)
    assert spec is not None and spec.loader is not None
    study = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = study
    spec.loader.exec_module(study)
    results = study.study()
    bias = {eps: {name: r["bias"] for name, r in per.items()} for eps, per in results.items()}
    # uncorrected: off in proportion to the mismatch (docs: 1.8%, 6.1%, 18%, 57%)
    assert [round(bias[e]["none"], 3) for e in study.EPSILONS] == [0.018, 0.061, 0.184, 0.569]
    for eps in study.EPSILONS:
        # untruncated sequence weights are exact at every size; token weights are not
        assert bias[eps]["sequence IS (no cap)"] < 1e-12
        assert 0.7 * bias[eps]["none"] < bias[eps]["token IS (no cap)"] < 0.85 * bias[eps]["none"]
    for eps in (0.03, 0.1):  # every sequence weight inside [0.5, 2]: truncation and masking change nothing
        assert bias[eps]["sequence TIS (c = 2)"] < 1e-12 and bias[eps]["sequence MIS [0.5, 2]"] < 1e-12
    assert round(bias[0.3]["sequence TIS (c = 2)"], 3) == 0.019
    # the price of the untruncated sequence weight: its noise at the largest mismatch
    assert results[1.0]["sequence IS (no cap)"]["std"] > 4 * results[1.0]["none"]["std"]


# =================================================================================================
# the Hugging Face mismatch example parses, and refuses a bad engine or correction before any step


def _hf_mismatch() -> Any:
    import importlib.util
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    root = Path(__file__).resolve().parent.parent
    if "hf_mismatch" in sys.modules:
        return sys.modules["hf_mismatch"]
    spec = importlib.util.spec_from_file_location("hf_mismatch", root / "examples" / "hf_mismatch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_mismatch"] = module  # jsonargparse finds classes by module name
    spec.loader.exec_module(module)
    return module


def test_hf_mismatch_example_parses_its_engine_and_correction(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    from pathlib import Path

    ex = _hf_mismatch()
    monkeypatch.setattr(sys, "argv", ["hf_mismatch.py"])  # LightningCLI reads args=, not pytest's argv

    config = Path(__file__).resolve().parent.parent / "examples" / "configs" / "hf_grpo_lora.yaml"
    base = ["--config", str(config), "--trainer.logger=false", f"--model.cache_dir={tmp_path}", "--data.sampling.top_p=1.0"]
    cli = ex.main([*base, "--data.engine=stale", "--data.engine_lag=2", "--model.correction=seq_tis"], run=False)
    assert (cli.datamodule.engine, cli.datamodule.engine_lag) == ("stale", 2)
    assert (cli.model.correction.weights, cli.model.correction.upper) == ("sequence", 2.0)
    with pytest.raises(ValueError, match=r"unknown `engine` 'fp8'; valid engines: policy, bfloat16, stale"):
        ex.main([*base, "--data.engine=fp8"], run=False)
    with pytest.raises(ValueError, match=r"unknown `correction` 'tis'; valid: none, token_tis, seq_tis"):
        ex.main([*base, "--model.correction=tis"], run=False)
    assert not list(Path(tmp_path).iterdir())  # refused before any pretraining
