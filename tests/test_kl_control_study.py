"""examples/kl_control_study.py: its YAML checked before any run, each run's config, and a tiny end-to-end
study on the Hugging Face example (a target run and a fixed run through examples/hf_grpo.py)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
_spec = importlib.util.spec_from_file_location("kl_control_study", EXAMPLES / "kl_control_study.py")
study_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study_mod)
_worker = importlib.util.spec_from_file_location("_hf_ddp_worker", Path(__file__).with_name("_hf_ddp_worker.py"))
ddp_worker = importlib.util.module_from_spec(_worker)
_worker.loader.exec_module(ddp_worker)


def _yaml(tmp_path, **changes):
    raw = {
        "example": "hf",
        "base_config": str(EXAMPLES / "configs" / "hf_grpo_lora.yaml"),
        "overrides": {
            "trainer": {"enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False},
            "model": {**ddp_worker.TINY_MODEL, "cache_dir": str(tmp_path / "reference")},
            "data": {**ddp_worker.TINY_DATA, "rollouts": 4, "sampling": {"temperature": 1.0, "top_p": 1.0}},
        },
        "out": str(tmp_path / "study"),
        "target_kl": 0.05,
        "controller": {"init_kl_coef": 0.2, "step_size": 0.1},
        "choices": [{"name": "full sequence", "loss": "full", "level": "sequence"},
                    {"name": "k3 no weights", "loss": "k3", "weights": False}],
        "fixed": ["full sequence"],
    }
    raw.update(changes)
    path = tmp_path / "kl_control_test.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_hf_run_configs_name_the_controller_and_the_weights_switch(tmp_path):
    study = study_mod.load(_yaml(tmp_path))
    assert study["example"] == "hf"
    full, plain = study["choices"]
    target = study_mod.run_config(study, plain, "target", 1)
    assert target["model"]["kl_coef"] == {"class_path": "lightning_kl.TargetKLController",
                                          "init_args": {"target_kl": 0.05, "init_kl_coef": 0.2, "step_size": 0.1}}
    assert target["model"]["kl_old_logprob"] is False and target["seed_everything"] == 1
    fixed = study_mod.run_config(study, full, "fixed", 0)
    assert fixed["model"]["kl_coef"] == {"class_path": "lightning_kl.FixedKLController", "init_args": {"kl_coef": 0.2}}
    assert "kl_old_logprob" not in fixed["model"] and fixed["model"]["kl_estimator"] == "full"
    assert [(c.name, m) for c, m, _ in study_mod.plan(study)] == [
        ("full sequence", "target"), ("full sequence", "fixed"), ("k3 no weights", "target")]


@pytest.mark.parametrize("changes, match", [
    ({"example": "gpt5"}, r"`example` 'gpt5' is not one of \['hf', 'toy'\]"),
    ({"fixed": ["k1"]}, r"`fixed` names choices that are not in `choices`: \['k1'\]"),
    ({"choices": [{"name": "x", "loss": "k4"}]}, r"`loss` 'k4' is not one of"),
])
def test_bad_studies_fail_before_any_run(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        study_mod.load(_yaml(tmp_path, **changes))
    assert not (tmp_path / "study").exists()


@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")
def test_a_tiny_hf_study_runs_reports_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["kl_control_study.py"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = _yaml(tmp_path, choices=[{"name": "full sequence", "loss": "full", "level": "sequence"}])
        png = tmp_path / "copy.png"
        study_mod.main(["--config", str(path), "--png", str(png)])
        out = tmp_path / "study"
        with open(out / "kl_control.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert [(r["choice"], r["mode"]) for r in rows] == [("full sequence", "target"), ("full sequence", "fixed")]
        for r in rows:
            assert int(r["steps"]) == 4 and float(r["kl_exact"]) >= 0
            # `full` sees the exact KL of the rollouts' softmaxes: the controlled KL is the exact one
            assert float(r["kl_controlled"]) == pytest.approx(float(r["kl_exact"]), rel=1e-4, abs=1e-6)
        assert float(rows[1]["coef_final"]) == 0.2 and float(rows[0]["coef_final"]) != pytest.approx(0.2)
        assert "| full sequence | TargetKLController | 1 |" in (out / "kl_control_test.md").read_text()
        assert png.stat().st_size > 0
        study_mod.main(["--config", str(path)])  # resumed: nothing run again
        assert len((out / "kl_control.csv").read_text().splitlines()) == 3
    finally:
        torch.set_num_threads(threads)
