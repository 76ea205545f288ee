"""``examples/topk_bias.py``, the top-k bias table of ``docs/distillation.md``, at its smallest configuration
(``--quick``: V = 256, 32 rows, k = 1, 8, 64 and V, one seed): the properties the table's text states, each
recomputed here from the formula in float64 rather than taken from the script.

* the full divergence ``D`` and the coarsened ``D_I`` are the formulas' (the ``k + 1`` cells written out; on
  the rows whose two tails are resolved, above float64's rounding);
* ``0 <= D_I <= D`` on every row and direction, ``D_I = D`` at ``k = V``, ``D_I < D`` somewhere below;
* verl 0.9.1's ``forward_kl_topk`` on the same rows is ``max(0, D_I - T)`` with the tail term
  ``T = Q_t log(Q_t / P_t)``: below ``D_I`` exactly where ``T > 0``, so neither a lower bound of ``D_I`` nor of
  ``D``: on these rows it exceeds ``D_I`` and also ``D`` (the table's columns), and its clamp is active at k = 1;
* TRL 1.16.0's tail-bucket forward KL is ``D_I`` (rows with both tails above its clamp); its top-1 support for
  ``beta > 0`` is a coarsening too, so at most ``D``.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from _mismatch_stacks import package_root
from _snippets import ROOT

V, N, KS = 256, 32, [1, 8, 64, 256]


def _script():
    spec = importlib.util.spec_from_file_location("lk_examples_topk_bias", ROOT / "examples" / "topk_bias.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _script()


@pytest.fixture(scope="module")
def results(script):
    return script.run([0], N, V, KS)


def _div(p: Tensor, q: Tensor, name: str) -> Tensor:
    """The divergence between rows of probabilities, from its formula, 0 log 0 = 0."""

    def kl(a: Tensor, b: Tensor) -> Tensor:
        return torch.where(a > 0, a * (a.log() - b.log()), torch.zeros_like(a)).sum(-1)

    if name == "forward":
        return kl(q, p)
    if name == "reverse":
        return kl(p, q)
    m = 0.5 * p + 0.5 * q  # TRL's convention at beta = 0.5: beta KL(q || m) + (1 - beta) KL(p || m)
    return 0.5 * kl(q, m) + 0.5 * kl(p, m)


def test_the_table_is_the_formula_and_d_i_is_a_lower_bound_equal_at_k_v(script, results):
    z, zt = script.rows(0, N, V)
    p, q = z.softmax(-1), zt.softmax(-1)
    for name, _ in script.DIVERGENCES:
        full = _div(p, q, name)
        for k in KS:
            r = results[(name, k)]
            ids = zt.topk(k, dim=-1).indices
            pi, qi = p.gather(-1, ids), q.gather(-1, ids)
            cells_p = torch.cat([pi, (1 - pi.sum(-1, keepdim=True)).clamp_min(0)], -1)
            cells_q = torch.cat([qi, (1 - qi.sum(-1, keepdim=True)).clamp_min(0)], -1)
            assert_close(r["D"], full, rtol=1e-10, atol=1e-12)
            # rows whose tails are both resolved: a tail within float64's rounding of 0 (at k = V, or a teacher
            # with all its mass on the ids) counts as the library's floor, which no formula here reproduces
            resolved = (cells_p[:, -1] > 1e-12) & (cells_q[:, -1] > 1e-12)
            if k < V:
                assert resolved.sum() >= N // 2, (name, k)
                assert_close(r["D_I"][resolved], _div(cells_p, cells_q, name)[resolved], rtol=1e-8, atol=1e-10)
            assert (r["D_I"] >= 0).all(), (name, k)
            assert (r["D_I"] <= r["D"] + 1e-12).all(), (name, k)
            if k == V:
                assert_close(r["D_I"], r["D"], rtol=0, atol=1e-12)
            else:
                assert (r["D_I"] < r["D"] - 1e-6).any(), (name, k)  # a bias there is to see
    script.checks(results, V)  # the script's own asserts pass on the same rows


def test_verls_clamped_top_k_sum_is_d_i_less_the_tail_term_and_bounds_neither(results):
    package_root("verl")
    seen_above_d = False
    for k in KS:
        r = results[("forward", k)]
        qt, pt, di = r["Q_t"], r["P_t"], r["D_I"]
        assert torch.equal(r["verl"], r["verl_raw"].clamp_min(0.0))
        if k == V:
            assert_close(r["verl"], r["D"], rtol=1e-5, atol=1e-5)  # no tail: verl's float32 sum is the full KL
            continue
        tail = qt * (qt.log() - pt.log())
        assert_close(r["verl_raw"], di - tail, rtol=1e-5, atol=1e-5)  # verl sums in float32
        clear = tail.abs() > 1e-4
        assert clear.any()
        assert torch.equal((r["verl_raw"] < di)[clear], (tail > 0)[clear])  # below D_I exactly where T > 0
        assert (r["verl"] > di + 1e-4).any(), k  # not a lower bound of ours ...
        seen_above_d |= bool((r["verl"] > r["D"] + 1e-4).any())
    assert seen_above_d  # ... nor of the full divergence
    assert (results[("forward", 1)]["verl_raw"] < 0).any()  # its clamp_min(0.0) is active at k = 1


def test_trls_tail_bucket_is_d_i_and_its_top_1_support_is_at_most_d(script, results):
    package_root("trl")
    for k in KS[:-1]:
        r = results[("forward", k)]
        keep = (r["Q_t"] > 1e-6) & (r["P_t"] > 1e-6)  # TRL clamps the top-k log-sum at -1e-7: rows above it
        assert keep.sum() >= N // 4, k
        assert_close(r["trl"][keep], r["D_I"][keep], rtol=1e-9, atol=1e-12)
    for name in ("reverse", "jsd"):
        r = results[(name, 1)]
        assert (r["trl"] >= -1e-12).all() and (r["trl"] <= r["D"] + 1e-9).all(), name
        assert all("trl" not in results[(name, k)] for k in KS[1:])  # TRL refuses loss_top_k > 1 with beta > 0


def test_the_tables_print_every_k_and_direction(script, results):
    for name, _ in script.DIVERGENCES:
        text = script.table(results, name, V)
        lines = text.splitlines()
        assert len(lines) == 2 + len(KS)
        assert lines[-1].startswith("| V | 1.0000 |") and "| 0.0% |" in lines[-1]
        assert not math.isnan(float(lines[2].split("|")[4]))
