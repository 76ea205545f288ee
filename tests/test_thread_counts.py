"""Nothing the package computes depends on torch's thread count, bit for bit (one exception, stated).

``tests/_threads_worker.py`` computes every public path (the vocabulary engine from logits and from a
head, whole and truncated, values and gradients; the estimators, the loss in every mode and the metric
on tensors past torch's parallel grain size; the high-entropy mask; the bonus's controller step; the
rollout correction) in a fresh process at 1 and at 3 threads. The engine's chunks write their own rows
and sum along rows (one thread per row), so its results are the same bits at any thread count.

The exception: the rollout correction's diagnostic metrics (chi2, the mismatch KLs, the effective
sample size...) are whole-tensor sums, which torch splits over threads past its grain size (32,768
values): another thread count adds the same numbers in another order, equal to rounding (float64,
relative 1e-15 here; tolerance 1e-13). Its weights and mask are exact.

The whole suite can also be run at a given thread count: ``LIGHTNING_KL_TEST_THREADS=n``
(``tests/conftest.py``); `.ci/run` runs the tests that compare two paths bit for bit at 1 and 3.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.testing import assert_close

WORKER = Path(__file__).with_name("_threads_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def _run(threads: int, out: Path) -> dict[str, list[torch.Tensor]]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(threads), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def test_every_result_has_the_same_bits_at_1_and_3_threads(tmp_path: Path) -> None:
    one, three = _run(1, tmp_path / "1.pt"), _run(3, tmp_path / "3.pt")
    assert one.keys() == three.keys() and len(one) > 25
    for name in one:
        for i, (a, b) in enumerate(zip(one[name], three[name])):
            if name == "correction_metrics":  # whole-tensor sums split over threads: equal to rounding (module doc)
                assert_close(a, b, rtol=1e-13, atol=0, equal_nan=True, msg=name)
            else:
                assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()), (name, i)
                assert torch.equal(a.nan_to_num(), b.nan_to_num()), (name, i)
