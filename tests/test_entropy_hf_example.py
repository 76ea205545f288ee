"""The entropy options of the Hugging Face example (examples/hf_grpo.py): ``entropy_coef`` and ``top_entropy``.

Two fits from the same seed draw the same first rollout from the same weights, so their first
losses differ by exactly the option's term, recomputed here in float64 from the policy's logits:
``-coef`` times the token-mean entropy for the bonus; for the mask, the policy gradient on the
tokens at or above the ``1 - top`` quantile of the entropies against that on every token. An
option the example ignored leaves the two losses equal.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import lightning_kl as lk
from lightning_kl import hf

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined"),
]
pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "hf_grpo_lora.yaml"
_spec = importlib.util.spec_from_file_location("_hf_ddp_worker", Path(__file__).with_name("_hf_ddp_worker.py"))
_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_worker)
ex = _worker.load_example()
TINY = [f"--model.{k}={v}" for k, v in _worker.TINY_MODEL.items()] + [
    f"--data.{k}={v}" for k, v in _worker.TINY_DATA.items()
]
# the plain softmax: the entropy is that of softmax(logits), the formula below
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.logger=false",
         "--data.sampling.temperature=1.0", "--data.sampling.top_p=1.0", "--data.rollouts=2"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("reference"))


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["hf_grpo.py"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fit(tmp_path, cache_dir, args, steps=1):
    """Fit ``steps`` steps of the tiny example; per step: the loss, the batch, the policy's response logits."""
    seen: list[dict] = []

    class Capture(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
            with torch.no_grad():
                _, logits = hf.response_logprobs(module.policy, seq, am, seq.shape[1] - mask.shape[1], return_logits=True)
            seen.append({"logits": logits.double(), "batch": {k: v.clone() for k, v in batch.items()}})

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen[-1]["loss"] = float(outputs["loss"])

    cli = ex.main(["--config", str(CONFIG), *TINY, *QUIET, f"--model.cache_dir={cache_dir}",
                   f"--trainer.default_root_dir={tmp_path}", f"--trainer.fast_dev_run={steps}", *args], run=False)
    cli.trainer.callbacks.append(Capture())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert len(seen) == steps
    return seen, cli.model


def _entropy(logits):
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def test_the_defaults_add_no_entropy_term(tmp_path, cache_dir, one_thread):
    seen, module = _fit(tmp_path, cache_dir, [])
    assert module.entropy is None and module.hparams.top_entropy == 1.0
    assert "entropy" in seen[0]["batch"]  # the rollout's entropy is logged either way


@pytest.mark.parametrize("coef", [0.5, 2.0])
def test_entropy_coef_adds_minus_coef_times_the_token_mean_entropy(tmp_path, cache_dir, one_thread, coef):
    (base,), _ = _fit(tmp_path / "off", cache_dir, [])
    (on,), module = _fit(tmp_path / "on", cache_dir, [f"--model.entropy_coef={coef}"])
    assert isinstance(module.entropy, lk.EntropyBonus)
    assert torch.equal(base["batch"]["sequences"], on["batch"]["sequences"])  # the same rollout
    mask = on["batch"]["mask"]
    h = _entropy(on["logits"])[mask].mean()
    assert float(h) > 0.05
    assert on["loss"] - base["loss"] == pytest.approx(-coef * float(h), rel=1e-4, abs=1e-6)
    # the rollout's logged entropy is the same quantity (the same weights)
    assert float(lk.aggregate(on["batch"]["entropy"].double(), mask)) == pytest.approx(float(h), rel=1e-5)


def test_a_target_entropy_controller_by_class_path_moves_once_per_step(tmp_path, cache_dir, one_thread):
    target, init, step = 5.0, 0.1, 0.3  # far above the entropy: the coefficient rises each step
    ctl = {"class_path": "lightning_kl.TargetEntropyController",
           "init_args": {"target_entropy": target, "init_coef": init, "step_size": step}}
    seen, module = _fit(tmp_path, cache_dir, [f"--model.entropy_coef={json.dumps(ctl)}"], steps=2)
    assert type(module.entropy.controller) is lk.TargetEntropyController
    c = init
    for s in seen:  # the dual rule from each step's token-mean entropy
        h = float(_entropy(s["logits"])[s["batch"]["mask"]].mean())
        c = min(max(c * math.exp(step * max(-1.0, min(1.0, 1 - h / target))), module.entropy.controller.coef_min),
                module.entropy.controller.coef_max)
    assert c > init
    assert module.entropy.coef == pytest.approx(c, rel=1e-6)


def test_top_entropy_takes_the_policy_gradient_on_the_high_entropy_tokens_only(tmp_path, cache_dir, one_thread):
    top = 0.2
    seed = ["--seed_everything=2"]  # a first rollout whose groups' rewards differ (advantages not all 0)
    (base,), _ = _fit(tmp_path / "all", cache_dir, seed)
    (on,), _ = _fit(tmp_path / "top", cache_dir, [*seed, f"--model.top_entropy={top}"])
    batch = on["batch"]
    assert torch.equal(base["batch"]["sequences"], batch["sequences"])
    mask = batch["mask"]
    h = _entropy(on["logits"])
    threshold = torch.quantile(h[mask], 1 - top)  # TRL's rule, by hand
    keep = mask & (h >= threshold)
    assert 0 < int(keep.sum()) < int(mask.sum())
    adv = ex.group_advantages(batch["scores"].double(), batch["group"])[:, None].expand_as(h)
    # the first step over a rollout: ratio 1, the policy gradient loss is -mean(adv) over its tokens
    expected = float(-adv[keep].mean() + adv[mask].mean())
    assert abs(expected) > 1e-3
    assert on["loss"] - base["loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("bad", [0, 1.5, -0.2, True])
def test_a_bad_top_entropy_fails_at_construction(bad):
    with pytest.raises(ValueError, match=r"`top_entropy` must be a number in \(0, 1\]"):
        ex.HFGRPO(top_entropy=bad)


def test_a_bad_entropy_coef_fails_at_construction():
    with pytest.raises(ValueError, match="`coef` must be a finite number >= 0"):
        ex.HFGRPO(entropy_coef=-0.1)


# --- examples/entropy_study.py --config: the HF study, tiny ----------------------------------------


def _study_yaml(tmp_path, **changes):
    import yaml

    raw = {
        "base_config": str(CONFIG),
        "overrides": {
            "trainer": {"enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False},
            "model": {**_worker.TINY_MODEL, "cache_dir": str(tmp_path / "reference")},
            "data": {**_worker.TINY_DATA, "rollouts": 2, "sampling": {"temperature": 1.0, "top_p": 1.0}},
        },
        "out": str(tmp_path / "study"),
        "target": 5.0,
        "seeds": [0],
        "arms": {
            "target": {"entropy_coef": {"class_path": "lightning_kl.TargetEntropyController",
                                        "init_args": {"target_entropy": 5.0, "init_coef": 0.1, "step_size": 0.3}}},
            "top20": {"top_entropy": 0.2},
        },
    }
    raw.update(changes)
    path = tmp_path / "entropy_hf_test.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _study_module():
    spec = importlib.util.spec_from_file_location("entropy_study", ROOT / "examples" / "entropy_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("changes, match", [
    ({"arms": ["none"]}, "`arms` must map each arm's name to the model's arguments"),
    ({"rollouts": 3}, "a mapping with the keys"),
])
def test_a_bad_hf_study_fails_before_any_run(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        _study_module().load_hf(_study_yaml(tmp_path, **changes))
    assert not (tmp_path / "study").exists()


def test_a_tiny_hf_entropy_study_runs_reports_and_resumes(tmp_path, one_thread, capsys):
    import csv

    study = _study_module()
    args = ["--config", str(_study_yaml(tmp_path)), "--png", str(tmp_path / "hf.png")]
    study.main(args)
    with open(tmp_path / "study" / "entropy_study.csv", newline="") as f:
        rows = {r["arm"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == ["target", "top20"] and (tmp_path / "hf.png").stat().st_size > 0
    for r in rows.values():
        assert int(r["rollouts"]) == 2 and 0 < float(r["entropy_last"]) < math.log(ex.VOCAB_SIZE)
    assert float(rows["target"]["coef_final"]) > 0.1  # far under its target: the controller raised it
    assert float(rows["target"]["kept_fraction"]) == 1.0
    assert 0.15 < float(rows["top20"]["kept_fraction"]) < 0.6  # a fifth of the tokens (ties kept)
    capsys.readouterr()
    study.main(args)  # every run is in the CSV: nothing runs again
    assert "[entropy_study]" not in capsys.readouterr().out
