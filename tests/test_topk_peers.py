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


def test_nemos_zero_outside_topk_forward_is_ours_on_the_renormalized_payload():
    """NeMo-RL (not pinned: its formula as ``DistillationLossFn`` and ``get_distillation_topk_logprobs_from_logits``
    state it at commit 7ea279ab, written here): with ``zero_outside_topk=True`` and ``kl_type="forward"`` the
    student's full-vocabulary log-probs at the teacher's ids against the ``log_softmax`` of the teacher's top-k
    logits, ``sum q (log q - log p)``; ours on that renormalized payload (teacher tail 0, counted as its floor)."""
    g = torch.Generator().manual_seed(2)
    z = 2 * torch.randn(64, 50, generator=g, dtype=torch.float64)
    topk_logits, ids = (2 * torch.randn(64, 50, generator=g, dtype=torch.float64)).topk(8, dim=-1)
    q = topk_logits.log_softmax(-1)
    p = z.log_softmax(-1).gather(-1, ids)
    nemo = (q.exp() * (q - p)).sum(-1)
    assert_close(lk.full_kl(z, lk.TopK(ids, q), divergence="forward"), nemo, rtol=0, atol=1e-12)
    assert_close(lk.full_kl(z.float(), lk.TopK(ids, q.float()), divergence="forward").double(), nemo, rtol=0, atol=1e-4)
    # its default (zero_outside_topk=False) renormalizes the student on the ids too: not ours, which keeps a tail
    p_cond = z.gather(-1, ids).log_softmax(-1)
    default = (q.exp() * (q - p_cond)).sum(-1)
    assert (lk.full_kl(z, lk.TopK(ids, q), divergence="forward") - default).abs().max() > 1e-2


def test_the_migration_guides_distillation_calls_run():
    """Every call in the distillation section of docs/migration.md runs on consistent tensors (a renamed
    argument, a wrong divergence name or a shape the call refuses fails here) and gives finite ``[b, t]`` values."""
    import re

    from _snippets import ROOT

    text = (ROOT / "docs" / "migration.md").read_text().split("## On-policy distillation")[1].split("\n## ")[0]
    spans = re.findall(r"`([^`]*\blk\.\w+\([^`]*)`", text)
    assert len(spans) >= 12, spans
    g = torch.Generator().manual_seed(3)
    b, t, v, d, k = 2, 3, 11, 4, 5
    h, w = torch.randn(b, t, d, generator=g), torch.randn(v, d, generator=g)
    h_t, w_t = torch.randn(b, t, d, generator=g), torch.randn(v, d, generator=g)
    logits, teacher_logits = h @ w.T, h_t @ w_t.T
    teacher_topk_logits, ids = teacher_logits.topk(k, dim=-1)
    ns = {"lk": lk, "h": h, "w": w, "h_t": h_t, "w_t": w_t, "logits": logits, "teacher_logits": teacher_logits,
          "ids": ids, "logprobs": teacher_logits.log_softmax(-1).gather(-1, ids), "teacher_topk_logits": teacher_topk_logits,
          "mask": torch.tensor([[True, True, False], [True, True, True]]),
          "logprob": torch.randn(b, t, generator=g) - 2, "teacher_logprob": torch.randn(b, t, generator=g) - 2,
          "value": torch.rand(b, t, generator=g), "advantages": torch.randn(b, t, generator=g),
          "beta": 1.0, "mixed_kl_weight": 0.5, "opd_kl_coef": 1.0, "T": 0.9}  # fmt: skip  (the stacks' defaults; T any)
    for span in spans:
        code = span if "=" in span.split("(")[0] else f"_out = {span}"
        out = dict(ns)
        exec(code, out)
        result = out[code.split("=")[0].strip()]
        if isinstance(result, torch.Tensor) and result.dim() > 0:
            assert result.shape == (b, t) and torch.isfinite(result).all(), span
