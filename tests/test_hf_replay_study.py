"""examples/hf_replay_study.py: the exact ratio by enumeration, and the three scorers on the HF example.

The enumeration (``ratio_errors``) is checked against float64 maths written here from the definitions
(the top-p kept set from "the mass of the more likely tokens is below top_p", no library call); the
study's smallest configuration (a barely pretrained reference, 2 rollouts of 4 x 4) is run for each
scorer: replay equals the processed log-probs on-policy and is finite off-policy, temperature-only
scoring is off by ``log S``, ``drop`` removes exactly the tokens outside the current kept set, and
top-p 1.0 gives temperature-only scoring zero bias.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

import lightning_kl as lk

pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")]
pytest.importorskip("transformers")
pytest.importorskip("peft")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
_spec = importlib.util.spec_from_file_location("hf_replay_study", EXAMPLES / "hf_replay_study.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def kept_mask(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus from its definition (no ties in random float64 logits): a token is kept when the
    mass of the tokens more likely than it is below ``top_p``."""
    p = torch.softmax(z, -1)
    before = (p[..., None, :] > p[..., :, None]).double() @ p[..., :, None]  # [n, V, 1]: mass of the more likely
    return before[..., 0] < top_p


def formula(old: torch.Tensor, new: torch.Tensor, T: float, top_p: float) -> dict[str, float]:
    """The study's figures from the definitions, float64."""
    ko, kn = kept_mask(old / T, top_p), kept_mask(new / T, top_p)
    ninf = float("-inf")

    def log_on(z, k):  # log of the softmax of z / T renormalized on k (ninf off k)
        s = (z / T).masked_fill(~k, ninf)
        return s - torch.logsumexp(s, -1, keepdim=True)

    log_mu, exact = log_on(old, ko), log_on(new, kn) - log_on(old, ko)
    mu, n = log_mu.exp(), old.shape[0]
    inside = ko & kn
    w = mu / n
    temp = torch.log_softmax(new / T, -1) - torch.log_softmax(old / T, -1)
    replay = log_on(new, ko) - log_mu
    out = {"dropped": float(w[ko & ~kn].sum())}
    for name, lr in (("replay", replay), ("temp_only", temp), ("temp_vs_sampler", torch.log_softmax(new / T, -1) - log_mu)):
        out[f"{name}_bias"] = float((w * (lr - exact))[inside].sum() / w[inside].sum())
    return out


def logits(n: int, v: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


@pytest.mark.parametrize("T", [0.7, 1.0])
def test_enumeration_on_policy_replay_and_drop_are_exact_temperature_only_is_off_by_log_s(T):
    z = logits(30, 15, 0)
    s = lk.Sampling(T, top_p=0.9)
    r = study.ratio_errors(z, z, s)
    for name in ("replay", "drop", "temp_only"):  # the PPO ratio on-policy: 1 for each, the exact one too
        assert r[f"{name}_bias"] == 0 and r[f"{name}_abs"] == 0 and r[f"{name}_off"] == 0, name
    assert r["dropped"] == 0
    keep = kept_mask(z / T, 0.9)
    log_s = torch.logsumexp((z / T).masked_fill(~keep, float("-inf")), -1) - torch.logsumexp(z / T, -1)
    assert float(log_s.max()) < 0
    # against the sampler: log S at every token (each position's weights sum to 1)
    assert r["temp_vs_sampler_bias"] == pytest.approx(float(log_s.mean()), abs=1e-12)
    assert r["temp_vs_sampler_off"] == 1.0  # log S <= log 0.9 here: every token outside [0.99, 1.01]
    assert r["kept"] == pytest.approx(float(keep.sum(-1).double().mean()), abs=0)


def test_enumeration_off_policy_against_the_formula():
    old = logits(40, 15, 1)
    new = old + 0.5 * logits(40, 15, 2, scale=1.0)
    s = lk.Sampling(0.9, top_p=0.8)
    r, want = study.ratio_errors(old, new, s), formula(old, new, 0.9, 0.8)
    assert want["dropped"] > 0.005  # kept sets moved: the case that matters
    for key, value in want.items():
        assert r[key] == pytest.approx(value, abs=1e-12), key
    assert abs(r["drop_bias"]) < 1e-12 and r["drop_abs"] < 1e-12  # the exact ratio where it is defined (rounding)
    assert r["replay_bias"] != 0 and r["replay_finite"] == 1 and r["temp_only_finite"] == 1


def test_enumeration_top_p_one_gives_temperature_only_no_bias():
    old = logits(30, 15, 3)
    new = old + 0.5 * logits(30, 15, 4, scale=1.0)
    for o, n in ((old, old), (old, new)):
        r = study.ratio_errors(o, n, lk.Sampling(0.9, top_p=1.0))
        for name in ("replay", "temp_only", "drop", "temp_vs_sampler"):  # the library against the formula: rounding
            assert abs(r[f"{name}_bias"]) < 1e-12 and r[f"{name}_abs"] < 1e-12 and r[f"{name}_off"] == 0, name
        assert r["dropped"] == 0 and r["log_kept"] == 0 and r["kept"] == 15


def test_enumeration_refuses_mismatched_logits():
    with pytest.raises(ValueError, match=r"\[n, V\] logits of one shape, got \(3, 15\) and \(3, 14\)"):
        study.ratio_errors(logits(3, 15, 0), logits(3, 14, 0), lk.Sampling(0.9, top_p=0.9))


# ---------------------------------------------------------------------------------------------
# the HF example, smallest configuration


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield study.parse(["--pretrain-steps", "20", "--cache-dir", str(tmp_path_factory.mktemp("reference")),
                       "--prompts", "4", "--group-size", "4", "--out", ""])
    torch.set_num_threads(threads)


def test_the_scorers_on_a_real_rollout(args):
    module, dm = study.build(args, 0.9)
    policy = study.fresh_policy(module, dm)
    batch = study.rollout(policy, dm, torch.Generator().manual_seed(0))
    mask, s = batch["mask"], dm.sampling
    rows = torch.arange(mask.shape[0])
    with torch.no_grad():
        got = {m: study.scored(m, policy, batch, rows, s) for m in study.METHODS}
    # on-policy: replay and drop are the rollout's processed log-probs, every token kept
    for m in ("replay", "drop"):
        lp, old, keep, _ = got[m]
        assert torch.equal(keep, mask) and torch.equal(old, batch["processed"])
        torch.testing.assert_close(lp[mask], old[mask], rtol=0, atol=1e-5)
    # temperature-only: off by log S at every token, on both sides of the ratio
    lp, old, keep, logits = got["temp_only"]
    log_s = torch.logsumexp(study.process_scores(batch["logits"].double() / s.temperature, s), -1) - torch.logsumexp(
        batch["logits"].double() / s.temperature, -1)
    torch.testing.assert_close(old[mask].double(), batch["processed"][mask].double() + log_s[mask], rtol=0, atol=1e-5)
    assert float(log_s[mask].max()) < -1e-3 and torch.equal(keep, mask)
    torch.testing.assert_close(lp[mask], old[mask], rtol=0, atol=1e-5)
    # off-policy (the adapters moved): drop takes out of the loss the tokens outside the new kept set, and only
    # those; replay keeps every token with a finite log-prob
    with torch.no_grad():
        for name, q in policy.named_parameters():
            if "lora_B" in name:
                q.add_(torch.randn(q.shape, generator=torch.Generator().manual_seed(1)))
        lp, old, keep, z = study.scored("drop", policy, batch, rows, s)
        replay = study.scored("replay", policy, batch, rows, s)[0]
    tokens = batch["tokens"]
    removed = study.process_scores(z.double() / s.temperature, s).gather(-1, tokens.clamp(min=0)[..., None])[..., 0] == float("-inf")
    outside = removed & mask
    assert outside.any() and torch.equal(keep, mask & ~outside)
    assert lp[keep].isfinite().all() and torch.equal(lp[outside], old[outside])  # no -inf into the ratio
    assert replay[mask].isfinite().all()


@pytest.mark.parametrize("method", study.METHODS)
def test_the_smallest_study_run(args, method):
    log = study.train(method, 0, 0.9, 2, args)
    assert len(log["reward"]) == 2 and len(log["off/replay_bias"]) == 2
    # the first step of a rollout is on-policy: replay's ratio is the exact one (1), up to the
    # float32 forward of the rows in another order
    assert max(log["on/replay_abs"]) < 1e-5 and max(log["on/drop_abs"]) < 1e-5 and max(log["on/temp_only_abs"]) < 1e-5
    assert min(log["on/temp_vs_sampler_bias"]) < -1e-3  # log S < 0 at top_p 0.9
    # off-policy: finite for every token the sampler can draw
    assert min(log["off/replay_finite"]) == 1 and min(log["off/temp_only_finite"]) == 1
    assert all(math.isfinite(v) for v in log["off/replay_bias"])
    if method != "drop":
        assert log["loss_dropped"] == [0.0, 0.0]
    assert len(log["clipped"]) == 2 and all(0 <= c <= 1 for c in log["clipped"])


def test_top_p_one_run_has_no_temperature_only_bias(args):
    log = study.train("replay", 0, 1.0, 1, args)
    # no truncation: the kept mass is 1 exactly, and every scorer is the exact one up to float64 rounding
    # (the library's log-softmax against the formula's, of the same float32 logits)
    assert log["on/log_kept"] == [0.0] and log["off/dropped"] == [0.0] and log["on/kept"] == [15.0]
    for key in ("on/temp_vs_sampler_bias", "on/temp_only_bias", "off/temp_only_bias", "off/temp_vs_sampler_bias",
                "off/replay_bias", "off/temp_only_abs", "off/temp_vs_sampler_abs"):
        assert abs(log[key][0]) < 1e-12, key


def test_bad_configurations_fail_at_the_parse():
    with pytest.raises(SystemExit, match="must be >= 2"):
        study.parse(["--epochs", "1"])
    with pytest.raises(SystemExit, match=r"top_p must be in \(0, 1\]"):
        study.parse(["--top-ps", "0.9", "1.5"])
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        study.train("ppo", 0, 0.9, 1, study.parse([]))
