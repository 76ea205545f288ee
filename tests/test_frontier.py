"""The frontier sweep (examples/frontier.py): its configuration, its runs, resuming, the CSV, plot and summary.

The machinery, not the science: a two-coefficient sweep of two choices on a tiny toy model.
"""

from __future__ import annotations

import csv
import doctest
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = [
    pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined"),
    # a stopped run is run again in its own folder, over what it had logged (the resume test does it)
    pytest.mark.filterwarnings("ignore:Experiment logs directory .* exists and is not empty"),
]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _load(name: str):
    if name in sys.modules:  # another test module loaded it: one class per name for jsonargparse
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


frontier = _load("frontier")

LOSS = {"name": "k3+ sequence", "loss": "k3+", "level": "sequence"}
REWARD = {"name": "k1 in the reward", "reward": "k1"}


def _sweep_yaml(tmp_path: Path, **changes) -> Path:
    """A tiny toy sweep: 2 choices x 2 coefficients x 1 seed, a 1-layer model, 3 rollouts of 4 sequences."""
    raw = {
        "example": "toy",
        "base_config": str(EXAMPLES / "configs" / "grpo_k3plus.yaml"),
        "overrides": {
            "trainer": {"enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False},
            "model": {"d_model": 16, "n_layer": 1, "n_head": 2, "pretrain_steps": 3, "pretrain_batch_size": 8,
                      "cache_dir": str(tmp_path / "reference")},
            "data": {"prompts_per_rollout": 2, "group_size": 2, "max_new_tokens": 4, "reference_samples": 16,
                     "rollouts": 3},
        },
        "out": str(tmp_path / "sweep"),
        "coefs": [0.01, 0.5],
        "seeds": [0],
        "matched_kl": [0.01],
        "choices": [LOSS, REWARD],
        **changes,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["frontier.py"])  # LightningCLI reads args=, not pytest's argv
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rows(sweep) -> list[dict[str, str]]:
    with open(sweep.out / "frontier.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_sweep_runs_in_parts_resumes_and_reports(tmp_path):
    path = _sweep_yaml(tmp_path)
    # a sweep stopped after its first run ...
    sweep = frontier.main(["--config", str(path), "--limit", "1"])
    first = _rows(sweep)
    assert len(first) == 1 and first[0]["choice"] == "k3+ sequence" and first[0]["coef"] == "0.01"
    # ... continues where it was: the 3 missing runs, the first row untouched; a run stopped midway
    # left part of its log, which does not leak into its rerun (the CSVLogger writes its file anew)
    stale = sweep.out / "runs" / "k3plus_sequence" / "coef0.5-seed0"
    stale.mkdir(parents=True)
    (stale / "metrics.csv").write_text("epoch,step,train/reward\n" + "0,0,9.0\n" * 10)
    frontier.main(["--config", str(path)])
    rows = _rows(sweep)
    assert rows[0] == first[0]
    assert [(r["choice"], float(r["coef"])) for r in rows] == [
        ("k3+ sequence", 0.01), ("k3+ sequence", 0.5), ("k1 in the reward", 0.01), ("k1 in the reward", 0.5)]
    assert len({r["key"] for r in rows}) == 4
    for r in rows:
        assert r["status"] == "ok", r
        assert int(float(r["steps"])) == 3  # one row per rollout, all of them
        assert 0.0 <= float(r["reward"]) <= 1.0 and float(r["kl_response"]) >= 0.0
        assert float(r["kl_token"]) <= float(r["kl_response"]) + 1e-9  # a response has at least one token
    # the coefficient reached the run, in the loss or in the reward: read back from the run's own log
    for r, key in zip(rows, ["train/kl_loss_coef", "train/kl_loss_coef", "kl/coef", "kl/coef"]):
        version = f"coef{float(r['coef']):g}-seed0"
        series = frontier._runs.read_metrics(sweep.out / "runs" / frontier.Choice(r["choice"]).slug / version / "metrics.csv")
        assert [v for _, v in series[key]] == pytest.approx([float(r["coef"])] * 3)
        assert ("kl/coef" in series) == (r["choice"] == "k1 in the reward")  # no callback on a loss run
    # a row written twice (two processes raced on one run) counts once
    with open(sweep.out / "frontier.csv", "a", newline="") as f:
        csv.DictWriter(f, fieldnames=frontier.CSV_FIELDS).writerow(rows[1])
    assert frontier.report(sweep).startswith("4 runs (4 ok)")
    rows = _rows(sweep)
    # a third call runs nothing
    assert frontier.pending(sweep) == []
    assert frontier.run_sweep(sweep) == 0 and _rows(sweep) == rows
    # the plot and the summary
    assert (sweep.out / "sweep.png").stat().st_size > 10_000  # named after the YAML file
    text = (sweep.out / "sweep.md").read_text()
    assert "| k3+ sequence |" in text and "| k1 in the reward |" in text and "coef 0.5" in text
    # a changed sweep runs only what is new: another seed, here only for one choice
    more = frontier.load_sweep(_sweep_yaml(tmp_path, seeds=[0, 1]))
    with pytest.raises(ValueError, match=r"--only \['k3\+ token'\]: not choices of the sweep; they are \['k3\+ sequence'"):
        frontier.run_sweep(more, only=["k3+ token"])
    assert sorted((c.name, coef, seed) for c, coef, seed, _, _ in frontier.pending(more)) == [
        ("k1 in the reward", 0.01, 1), ("k1 in the reward", 0.5, 1), ("k3+ sequence", 0.01, 1), ("k3+ sequence", 0.5, 1)]
    assert frontier.run_sweep(more, only=["k1 in the reward"]) == 2
    assert [(c.name, coef, seed) for c, coef, seed, _, _ in frontier.pending(more)] == [
        ("k3+ sequence", 0.01, 1), ("k3+ sequence", 0.5, 1)]
    assert frontier.report(more).startswith("**Incomplete:** 2 of the sweep's 8 runs not run yet.")
    # a row of another sweep (another budget) in the same CSV is not this sweep's
    fewer = frontier.load_sweep(_sweep_yaml(tmp_path, coefs=[0.01]))
    assert frontier.report(fewer).startswith("2 runs (2 ok)")


def test_run_config_places_the_choice_and_the_coefficient(tmp_path):
    sweep = frontier.load_sweep(_sweep_yaml(tmp_path))
    loss, reward = sweep.choices
    cfg = frontier.run_config(sweep, loss, 0.5, 3)
    assert cfg["seed_everything"] == 3 and cfg["trainer"]["callbacks"] == []
    assert {k: cfg["model"][k] for k in ("kl_estimator", "kl_level", "kl_coef", "kl_agg")} == {
        "kl_estimator": "k3+", "kl_level": "sequence", "kl_coef": 0.5, "kl_agg": "seq-mean-token-sum"}
    assert cfg["model"]["d_model"] == 16 and cfg["data"]["rollouts"] == 3  # the overrides, merged
    assert cfg["data"]["target_token"] == 7  # the base config kept where not overridden
    cfg = frontier.run_config(sweep, reward, 0.01, 0)
    assert cfg["model"]["kl_estimator"] is None  # no KL in the loss
    (callback,) = cfg["trainer"]["callbacks"]
    assert callback["init_args"] == {"estimator": "k1", "controller": {
        "class_path": "lightning_kl.FixedKLController", "init_args": {"kl_coef": 0.01}}}
    plain = frontier.parse_choice({"name": "k3", "loss": "k3", "weights": False}, frontier.EXAMPLES["toy"])
    assert frontier.run_config(sweep, plain, 0.5, 0)["model"]["kl_old_logprob"] is False
    assert "kl_old_logprob" not in frontier.run_config(sweep, loss, 0.5, 0)["model"]  # the default: keys unchanged
    hf = frontier.load_sweep(_sweep_yaml(tmp_path, example="hf", choices=[REWARD]))
    assert frontier.run_config(hf, hf.choices[0], 0.1, 0)["model"]["kl_coef"] == 0.0
    # the HF example takes `full` in the loss and turns its importance weights off by the same key
    hf_plain = frontier.parse_choice({"name": "k3", "loss": "k3", "weights": False}, frontier.EXAMPLES["hf"])
    assert frontier.run_config(hf, hf_plain, 0.5, 0)["model"]["kl_old_logprob"] is False
    hf_full = frontier.parse_choice({"name": "full", "loss": "full", "level": "sequence"}, frontier.EXAMPLES["hf"])
    assert frontier.run_config(hf, hf_full, 0.5, 0)["model"]["kl_estimator"] == "full"


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"example": "gpt5"}, r"`example` 'gpt5' is not one of \['hf', 'toy'\]"),
        ({"coefs": [-1]}, "`coefs` must be"),
        ({"chocies": []}, r"unknown keys \['chocies'\]"),
        ({"choices": [{"name": "x", "loss": "k4"}]}, r"`loss` 'k4' is not one of \['k1'"),
        ({"choices": [{"name": "x", "loss": "k3+", "level": "seq"}]}, r"`level` 'seq' is not one of \['token', 'sequence'\]"),
        ({"choices": [{"name": "x", "reward": "full"}]}, r"`reward` 'full' is not one of \["),
        ({"choices": [{"name": "x", "reward": "k1", "loss": "k2"}]}, "exactly one of `loss` and `reward`"),
        ({"choices": [REWARD, {"name": "k1 in the reward!", "reward": "k3"}]}, "two choices share a name"),
        ({"base_config": "nope.yaml"}, "'nope.yaml' is not a file"),
        ({"choices": [{"name": "x", "reward": "k1", "weights": False}]}, "`weights` is a setting of the loss"),
    ],
)
def test_bad_sweeps_fail_before_any_run(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        frontier.load_sweep(_sweep_yaml(tmp_path, **changes))
    assert not (tmp_path / "sweep").exists()


def test_reward_at_matched_kl_per_seed():
    # seed 0: coef 1 -> (KL 0, reward 0), coef 0.1 -> (KL 2, reward 0.4): at KL 1, reward 0.2 (linear: a KL of 0)
    # seed 1: coef 1 -> (KL 1, reward 0.3), coef 0.1 -> (KL 3, reward 0.5): at KL 1, reward 0.3
    rows = [
        {"choice": "a", "coef": 1.0, "seed": 0, "kl_response": 0.0, "reward": 0.0, "status": "ok"},
        {"choice": "a", "coef": 0.1, "seed": 0, "kl_response": 2.0, "reward": 0.4, "status": "ok"},
        {"choice": "a", "coef": 1.0, "seed": 1, "kl_response": 1.0, "reward": 0.3, "status": "ok"},
        {"choice": "a", "coef": 0.1, "seed": 1, "kl_response": 3.0, "reward": 0.5, "status": "ok"},
        {"choice": "a", "coef": 0.01, "seed": 1, "kl_response": math.nan, "reward": math.nan, "status": "error: x"},
    ]
    mean, sd, n = frontier.matched(rows, "a", 1.0)
    assert (mean, sd, n) == (pytest.approx(0.25), pytest.approx(0.05), 2)
    # seed 0 never reaches 2.5; seed 1 is log(2.5) / log(3) of the way from KL 1 to KL 3
    assert frontier.matched(rows, "a", 2.5) == (pytest.approx(0.3 + 0.2 * math.log(2.5) / math.log(3)), 0.0, 1)
    (p1, p2, p3) = frontier.frontier_points(rows, "a")
    assert (p3["coef"], p3["n"], p3["failed"]) == (1.0, 2, 0) and p3["kl"] == pytest.approx(0.5)
    assert (p1["coef"], p1["n"], p1["failed"]) == (0.01, 0, 1)
    assert doctest.testmod(frontier).failed == 0  # the docstring examples (examples/ is outside --doctest-modules)


@pytest.mark.parametrize("weights", [True, False])
def test_toy_kl_old_logprob_switches_the_importance_weights(weights):
    # on-policy (old = logprob), with weights k3's gradient is k3+'s, d per token; without, (1 - exp(-d)).
    # coef 0.5 and seq-mean-token-sum over b = 2 responses: each token's gradient is 0.5 / 2 times that
    toy = _load("toy_rlhf")
    module = toy.ToyRLHF(d_model=16, n_layer=1, n_head=2, kl_estimator="k3", kl_coef=0.5,
                         kl_agg="seq-mean-token-sum", kl_old_logprob=weights)
    logprob = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.5, -0.7]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -0.2, -1.0], [-0.3, -2.5, -0.1]], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    module.kl_term(logprob, ref, mask, logprob.detach(), None, None).backward()
    d = (logprob - ref).detach()
    torch.testing.assert_close(logprob.grad, 0.25 * (d if weights else 1 - torch.exp(-d)))


def test_hf_sweep_runs_the_loss_and_the_reward(tmp_path):
    # hf_grpo.py through the same machinery: its metrics' names, its KL off in the loss for a reward choice
    path = _sweep_yaml(
        tmp_path, example="hf", base_config=str(EXAMPLES / "configs" / "hf_grpo_lora.yaml"), coefs=[0.2],
        overrides={
            "trainer": {"enable_progress_bar": False, "enable_model_summary": False},
            "model": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 32,
                      "pretrain_steps": 2, "pretrain_batch_size": 8, "lora_r": 2, "lora_alpha": 4,
                      "cache_dir": str(tmp_path / "reference")},
            "data": {"max_operand": 2, "prompts_per_rollout": 2, "group_size": 2, "rollouts": 2, "reference_samples": 8},
        },
    )
    sweep = frontier.main(["--config", str(path)])
    rows = _rows(sweep)
    assert [(r["choice"], r["status"], int(float(r["steps"]))) for r in rows] == [
        ("k3+ sequence", "ok", 2), ("k1 in the reward", "ok", 2)]
    for r in rows:
        assert 0.0 <= float(r["reward"]) <= 1.0 and float(r["kl_response"]) >= 0.0 and 0.0 <= float(r["ref_reward"]) <= 1.0
    reward_log = frontier._runs.read_metrics(sweep.out / "runs" / "k1_in_the_reward" / "coef0.2-seed0" / "metrics.csv")
    assert [v for _, v in reward_log["kl/coef"]] == pytest.approx([0.2, 0.2])
    # and the loss's coefficient: the sweep's on the loss run, 0 on the reward run (the KL is only measured)
    for slug, coef in [("k3plus_sequence", 0.2), ("k1_in_the_reward", 0.0)]:
        hparams = yaml.safe_load((sweep.out / "runs" / slug / "coef0.2-seed0" / "hparams.yaml").read_text())
        assert hparams["kl_coef"] == coef
