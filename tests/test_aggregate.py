"""aggregate() against plain-Python loops over sequences and tokens, and its masking guarantees."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.functional import AGG_MODES


def loop_reference(values: torch.Tensor, mask: torch.Tensor, mode: str, norm=None) -> float:
    rows = values.reshape(-1, values.shape[-1]).tolist()
    masks = mask.reshape(-1, mask.shape[-1]).tolist()
    sums = [sum(v for v, m in zip(r, mr) if m) for r, mr in zip(rows, masks)]
    counts = [sum(mr) for mr in masks]
    nonempty = [i for i, c in enumerate(counts) if c > 0]
    if mode == "token-sum":
        return sum(sums)
    if mode == "token-mean":
        return sum(sums) / sum(counts) if sum(counts) else 0.0
    if mode == "seq-mean-token-sum":
        return sum(sums[i] for i in nonempty) / len(nonempty) if nonempty else 0.0
    if mode == "seq-mean-token-mean":
        return sum(sums[i] / counts[i] for i in nonempty) / len(nonempty) if nonempty else 0.0
    if mode == "seq-mean-token-sum-norm":
        return sum(sums) / (values.shape[-1] if norm is None else norm)
    raise AssertionError(mode)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(3, 4, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 4, 7, generator=g) > 0.4
    mask[0, 1] = False  # an empty sequence
    mask[2, 3] = True  # a full one
    return values, mask


@pytest.mark.parametrize("mode", AGG_MODES)
def test_modes_match_loops(mode, batch):
    values, mask = batch
    got = lk.aggregate(values, mask, mode)
    assert got.ndim == 0 and got.dtype == torch.float64
    assert_close(got.item(), loop_reference(values, mask, mode))
    all_valid = torch.ones_like(mask)
    assert_close(lk.aggregate(values, None, mode).item(), loop_reference(values, all_valid, mode))


def test_sum_norm_uses_the_constant(batch):
    values, mask = batch
    got = lk.aggregate(values, mask, "seq-mean-token-sum-norm", norm=512)
    assert_close(got.item(), loop_reference(values, mask, "seq-mean-token-sum-norm", norm=512))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_junk_at_padding_never_reaches_result_or_gradient(mode, batch):
    values, mask = batch
    clean = values.clone().requires_grad_()
    dirty_data = values.clone()
    junk = torch.tensor([float("nan"), float("inf"), float("-inf"), -1e10], dtype=torch.float64)
    pad_idx = (~mask).nonzero(as_tuple=True)
    dirty_data[pad_idx] = junk.repeat(len(pad_idx[0]) // 4 + 1)[: len(pad_idx[0])]
    dirty = dirty_data.requires_grad_()
    a = lk.aggregate(clean, mask, mode)
    b = lk.aggregate(dirty, mask, mode)
    assert_close(a, b, rtol=0, atol=0)
    a.backward()
    b.backward()
    assert torch.isfinite(dirty.grad).all()
    assert_close(clean.grad, dirty.grad, rtol=0, atol=0)
    assert (dirty.grad[~mask] == 0).all()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fully_padded_batch_gives_zero_and_zero_gradient(mode):
    values = torch.full((2, 5), float("nan"), requires_grad=True)
    out = lk.aggregate(values, torch.zeros(2, 5, dtype=torch.bool), mode)
    assert out.item() == 0.0
    out.backward()
    assert (values.grad == 0).all()


def test_half_values_are_reduced_in_float32():
    values = torch.full((4096,), 0.1, dtype=torch.bfloat16)
    out = lk.aggregate(values, None, "token-sum")
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor(4096 * values[0].float().item()))


def test_numeric_masks_are_read_as_nonzero(batch):
    values, mask = batch
    assert_close(lk.aggregate(values, mask.float(), "token-mean"), lk.aggregate(values, mask, "token-mean"))


def test_errors_name_what_was_given():
    with pytest.raises(ValueError, match="Unknown aggregation mode 'mean'.*'token-mean'"):
        lk.aggregate(torch.zeros(2), None, "mean")
    with pytest.raises(ValueError, match=r"mask \(3,\) and values \(2,\)"):
        lk.aggregate(torch.zeros(2), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="at least one"):
        lk.aggregate(torch.tensor(1.0))
    with pytest.raises(ValueError, match="Unknown aggregation mode"):
        lk.KLPenaltyLoss("k3+", agg="seq-mean")
