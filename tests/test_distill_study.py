"""examples/distill_study.py at its smallest: every arm runs on the toy, the table has a row per arm, and the
OPD students close on the teacher: their exact KL to it falls, below the RL student's after the same steps."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _study():
    spec = importlib.util.spec_from_file_location("distill_study", EXAMPLES / "distill_study.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")
@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_the_smallest_study_runs_every_arm_and_the_opd_students_close_on_the_teacher(tmp_path, capsys):
    study = _study()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out, png = tmp_path / "study", tmp_path / "study.png"
        rows = study.main(["--out", str(out), "--seeds", "0", "--steps", "6", "--teacher-steps", "8",
                           "--pretrain-steps", "60", "--prompts", "4", "--group", "4", "--eval-samples", "32",
                           "--png", str(png)])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    # the table: its header and one row per arm, every cell a mean ± spread
    table = [line for line in printed.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| arm |") and [line.split(" | ")[0][2:] for line in table[1:]] == list(study.ARMS)
    assert all(line.count(" ± ") == 4 and line.count("|") == table[0].count("|") for line in table[1:])
    assert png.exists() and len(list(csv.DictReader(open(out / "distill_study.csv")))) == len(study.ARMS)
    series = json.loads((out / "series.json").read_text())
    assert set(series) == {f"{arm}/0" for arm in study.ARMS}
    by_arm = {r["arm"]: r for r in rows}
    # every student starts from the reference: the same first rollout, the same KL to the teacher
    assert len({series[f"{arm}/0"]["rkl"][0] for arm in study.ARMS}) == 1
    start = by_arm["rl"]["rkl_first"]
    assert start > 0.05  # the teacher is not the reference
    rl = series["rl/0"]["rkl"][-1]  # RL moves toward the teacher too (the same reward), more slowly
    for arm in ("opd-k1", "reverse", "forward", "jsd"):  # each OPD loss pulls the student onto the teacher
        s = series[f"{arm}/0"]
        assert s["rkl"][-1] < 0.7 * start and s["fkl"][-1] < 0.7 * s["fkl"][0], (arm, s["rkl"], s["fkl"])
        assert s["rkl"][-1] < rl, (arm, s["rkl"], rl)
    # a teacher that is the reference: the OPD signal is exactly 0 at the start (k1's reward on every token,
    # the reverse and forward KLs' gradients), so no OPD student moves; the RL student does. (Not the JSD:
    # its gradient at p = q is 0 only to float32 rounding, ~1e-8, and AdamW scales any gradient to a step.)
    args = study.parse_args(["--out", str(out), "--steps", "2", "--pretrain-steps", "60", "--prompts", "4", "--group", "4"])
    reference = study.reference_state(args, out / "reference")
    for arm in ("rl", "opd-k1", "reverse", "forward"):
        _, s = study.run(arm, 1, args, reference, out / "reference")
        if arm == "rl":
            assert s["rkl"][0] < 1e-6 < s["rkl"][-1], s["rkl"]
        else:
            assert max(s["rkl"]) < 1e-6 and max(s["fkl"]) < 1e-6, (arm, s["rkl"], s["fkl"])


def test_a_bad_arm_fails_at_construction_naming_the_arms():
    study = _study()
    with pytest.raises(ValueError, match=r"`arm` must be one of \['rl', 'opd-k1', 'reverse', 'forward', 'jsd'\], got 'kl'"):
        study.DistillToy("kl", {})
