"""The top-k divergence beside the pinned stacks' own top-k losses, on the same rows (their functions taken
from the installed files by their syntax trees, as tests/_mismatch_stacks.py does; skipped without them):

* TRL 1.16.0's server distillation: ``_add_tail_bucket`` (a tail per model, its log-sum clamped at -1e-7)
  and ``_jsd_divergence`` on those k + 1 cells: our cells, the same value for the forward KL and for the
  JSD at any ``beta`` (TRL's convention for its ends);
* verl 0.9.1's ``forward_kl_topk``: ``kl_divergence`` over the teacher's top-k of the student's full-vocabulary
  log-probs, no tail, then ``clamp_min(0.0)``: ours is verl's sum plus the tail term, and verl's sum is
  negative on rows where ours is not.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import lightning_kl as lk
from _mismatch_stacks import _compile, _function, _tree, package_root


def _trl():
    path = package_root("trl") / "experimental" / "server_distillation" / "server_distillation_trainer.py"
    tree = _tree(path)
    ns = {"torch": torch, "F": F}
    return _compile(_function(tree, "_add_tail_bucket"), ns), _compile(_function(tree, "_jsd_divergence"), ns)


def _verl():
    path = package_root("verl") / "trainer" / "distillation" / "fsdp" / "losses.py"
    return _compile(_function(_tree(path), "kl_divergence"), {"torch": torch})


def _rows(seed=0, n=64, v=50, k=8):
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(n, v, generator=g, dtype=torch.float64)
    lq, ids = (2 * torch.randn(n, v, generator=g, dtype=torch.float64)).log_softmax(-1).topk(k, dim=-1)
    return z, ids, lq


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9])
def test_trls_tail_bucket_cells_give_our_value(beta):
    add_tail, jsd = _trl()
    z, ids, lq = _rows()
    lp = z.log_softmax(-1).gather(-1, ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    sp, mask = add_tail(lp, valid)
    sq, _ = add_tail(lq, valid)
    theirs = jsd(sp, sq, beta, mask).sum(-1)
    ours = lk.full_kl(z, lk.TopK(ids, lq), divergence="forward" if beta == 0 else "jsd", beta=None if beta == 0 else beta,
                      return_tails=True)
    assert (ours.student_tail > 1e-6).all() and (ours.teacher_tail > 1e-6).all()  # TRL's clamp is not reached
    assert_close(ours.value, theirs, rtol=1e-10, atol=1e-13)


def test_verls_forward_kl_topk_is_ours_without_the_tail_term_and_goes_negative():
    kl_divergence = _verl()
    g = torch.Generator().manual_seed(1)
    zq = 2 * torch.randn(64, 50, generator=g, dtype=torch.float64)
    lq, ids = zq.log_softmax(-1).topk(4, dim=-1)
    z = 1.5 * zq + 0.3 * torch.randn(64, 50, generator=g, dtype=torch.float64)  # a sharper student: more mass on the ids
    lp = z.log_softmax(-1).gather(-1, ids)
    verl = kl_divergence(log_q=lp, log_p=lq)  # before its clamp_min(0.0)
    ours = lk.full_kl(z, lk.TopK(ids, lq), divergence="forward", return_tails=True)
    pt, qt = ours.student_tail.double(), ours.teacher_tail.double()
    assert_close(ours.value, verl.double() + qt * (qt.log() - pt.log()), rtol=1e-6, atol=1e-6)  # verl's sums in float32
    assert (ours.value >= 0).all()
    assert (verl < 0).any()  # what verl's clamp_min(0.0) hides
