"""The fused estimators against the plain composition and against float64 maths from the estimator table (docs/estimators.md).

Every sampled-token name, values and gradients w.r.t. both inputs, with masks whose padded positions
hold NaN/inf, in float32/bfloat16/float16, on non-contiguous inputs, sizes that are not multiples of
the chunk, and empty tensors.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import _reference as reference
import lightning_kl as lk
from lightning_kl.kernels import fused as _fused
from lightning_kl.estimators import SAMPLED_ESTIMATORS, parse_estimator
from lightning_kl.functional import kl_penalty_compute

# gradients toward the reference are checked here on purpose: its warning is expected
pytestmark = pytest.mark.filterwarnings("ignore:`ref_[a-z]*` requires grad")

SAMPLED = SAMPLED_ESTIMATORS


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Many chunks on small tensors (every chunk loop runs; the tests stay fast)."""
    monkeypatch.setattr(_fused, "CHUNK", 1000)
    monkeypatch.setattr(_fused, "MIN_ELEMENTS", 1000)


def formula(name: str, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Value and d(value)/d(logprob) in float64, written from the table (clamp ends inclusive)."""
    d = d.double()
    base, plus = parse_estimator(name).base, name.endswith("+")
    if base == "k1":
        value, grad = d, torch.ones_like(d)
    elif base == "abs":
        value, grad = d.abs(), torch.sign(d)
    elif base == "k2":
        value, grad = d * d / 2, d
    else:
        c = d.clamp(-20, 20)
        value = torch.exp(-c) + c - 1
        grad = torch.where(d.abs() <= 20, 1 - torch.exp(-d), 0.0)
        if base == "low_var_kl":
            grad = torch.where(value.abs() <= 10, grad, 0.0)
            value = value.clamp(-10, 10)
    return value, (d if plus else grad)


def run(name, logprob, ref, mask=None, fused=True, upstream=None, monkeypatch=None):
    """Value (compute dtype) and the gradients of ``sum(upstream * value)`` w.r.t. both inputs."""
    lp = logprob.detach().clone().requires_grad_()
    rf = ref.detach().clone().requires_grad_()
    old = _fused.ENABLED
    _fused.ENABLED = fused
    try:
        out = kl_penalty_compute(lp, rf, parse_estimator(name), mask)
    finally:
        _fused.ENABLED = old
    if upstream is None:
        out.sum().backward()  # a broadcast (stride 0) incoming gradient
    else:
        out.backward(upstream)
    return out.detach(), lp.grad, rf.grad


def make_inputs(n, dtype=torch.float32, seed=0, edges=True):
    g = torch.Generator().manual_seed(seed)
    logprob = -torch.rand(n, generator=g, dtype=torch.float64) * 8
    ref = -torch.rand(n, generator=g, dtype=torch.float64) * 8
    if edges:
        # far-drifted tokens on both sides of every clamp, and the clamp ends themselves (exact in
        # every dtype, so that d is exactly -20 or 20, not one rounding away)
        d = torch.tensor([-25.0, -20.0, -12.0, -3.0, 0.0, 3.0, 11.0, 20.0, 21.0], dtype=torch.float64)
        k = min(n, len(d))
        ref[:k] = -1.0 - d[:k].clamp(min=0)  # log-probs: both <= 0
        logprob[:k] = ref[:k] + d[:k]
    return logprob.to(dtype), ref.to(dtype)


def with_junk(logprob, ref, mask):
    """Put NaN and +-inf at the padded positions."""
    junk = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=logprob.dtype)
    idx = (~mask).nonzero().flatten()
    logprob, ref = logprob.clone(), ref.clone()
    logprob[idx] = junk[torch.arange(len(idx)) % 3]
    ref[idx] = junk[(torch.arange(len(idx)) + 1) % 3]
    return logprob, ref


@pytest.mark.parametrize("name", SAMPLED)
def test_fused_matches_composition_and_formula_with_junk_padding(name):
    n = 3 * _fused.CHUNK + 77  # several chunks, the last one partial
    logprob, ref = make_inputs(n)
    mask = torch.rand(n, generator=torch.Generator().manual_seed(1)) > 0.2
    mask[:9] = True
    logprob, ref = with_junk(logprob, ref, mask)

    value, g_lp, g_ref = run(name, logprob, ref, mask)
    c_value, c_lp, c_ref = run(name, logprob, ref, mask, fused=False)
    # same operations in the same order: bitwise the composition's value
    assert_close(value, c_value, rtol=0, atol=0)
    assert_close(g_lp, c_lp, rtol=1e-6, atol=1e-6)
    assert_close(g_ref, c_ref, rtol=1e-6, atol=1e-6)

    d = torch.where(mask, logprob.double() - ref.double(), 0.0)
    want_value, want_grad = formula(name, d)
    want_grad = torch.where(mask, want_grad, 0.0)
    assert_close(value.double(), want_value, rtol=1e-5, atol=1e-5)
    assert_close(g_lp.double(), want_grad, rtol=1e-5, atol=1e-5)
    assert_close(g_ref.double(), -want_grad, rtol=1e-5, atol=1e-5)
    # padding: exactly zero value and gradients, whatever it held
    assert (value[~mask] == 0).all() and (g_lp[~mask] == 0).all() and (g_ref[~mask] == 0).all()
    assert torch.isfinite(g_lp).all() and torch.isfinite(g_ref).all()


@pytest.mark.parametrize("name", SAMPLED)
def test_random_upstream_gradient_and_no_mask(name):
    logprob, ref = make_inputs(2500, seed=2)
    upstream = torch.randn(2500, generator=torch.Generator().manual_seed(3))
    value, g_lp, g_ref = run(name, logprob, ref, upstream=upstream)
    want_value, want_grad = formula(name, logprob.double() - ref.double())
    assert_close(value.double(), want_value, rtol=1e-5, atol=1e-5)
    assert_close(g_lp.double(), upstream.double() * want_grad, rtol=1e-5, atol=1e-5)
    assert_close(g_ref.double(), -upstream.double() * want_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["k1", "abs", "k2", "k3", "low_var_kl", "k3+", "low_var_kl+", "abs+"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_computed_in_float32_gradients_in_input_dtype(name, dtype):
    logprob, ref = make_inputs(2 * _fused.CHUNK + 5, dtype=dtype, seed=4)
    mask = torch.ones(logprob.shape, dtype=torch.bool)
    mask[-50:] = False
    logprob, ref = with_junk(logprob, ref, mask)
    value, g_lp, g_ref = run(name, logprob, ref, mask)
    assert value.dtype == torch.float32
    assert g_lp.dtype == dtype and g_ref.dtype == dtype
    c_value, c_lp, c_ref = run(name, logprob, ref, mask, fused=False)
    assert_close(value, c_value, rtol=0, atol=0)
    # the composition's gradient is cast once, from float32: so is ours; both within an ulp
    assert_close(g_lp, c_lp, rtol=torch.finfo(dtype).eps, atol=1e-6)
    assert_close(g_ref, c_ref, rtol=torch.finfo(dtype).eps, atol=1e-6)
    d = torch.where(mask, logprob.double() - ref.double(), 0.0)
    want_value, want_grad = formula(name, d)
    want_grad = torch.where(mask, want_grad, 0.0)
    assert_close(value.double(), want_value, rtol=1e-5, atol=1e-5)  # float32 maths, not half
    half_ulp = torch.finfo(dtype).eps / 2 * (1 + 1e-3)
    big = want_grad.abs() < torch.finfo(dtype).max  # float16 overflows exp(20)
    assert_close(g_lp.double()[big], want_grad[big], rtol=half_ulp, atol=1e-7)
    assert_close(g_ref.double()[big], -want_grad[big], rtol=half_ulp, atol=1e-7)


def test_mixed_dtypes_give_each_input_its_own_gradient_dtype():
    logprob, ref = make_inputs(2500, seed=5)
    lp16 = logprob.to(torch.bfloat16)
    for name in ["k3", "k3+"]:
        value, g_lp, g_ref = run(name, lp16, ref)
        assert value.dtype == torch.float32 and g_lp.dtype == torch.bfloat16 and g_ref.dtype == torch.float32
        want_value, want_grad = formula(name, lp16.double() - ref.double())
        assert_close(value.double(), want_value, rtol=1e-5, atol=1e-5)
        # the float32 input's gradient keeps float32 precision (not the bf16 one, negated)
        assert_close(g_ref.double(), -want_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["k1", "abs", "k2+", "k3", "low_var_kl", "low_var_kl+"])
def test_non_contiguous_inputs_and_upstream(name):
    g = torch.Generator().manual_seed(6)
    # [t, b] storage read as [b, t], a strided slice, and a strided mask and upstream gradient
    logprob = (-torch.rand(40, 3000, generator=g) * 8).t()[:, ::2]
    ref = (-torch.rand(40, 3000, generator=g) * 8).t()[:, ::2]
    mask = (torch.rand(3000, 40, generator=g) > 0.3)[:, ::2]
    upstream = torch.randn(40, 3000, generator=g).t()[:, 1::2]
    assert not (logprob.is_contiguous() or mask.is_contiguous() or upstream.is_contiguous())
    logprob[~mask] = float("nan")
    value, g_lp, g_ref = run(name, logprob, ref, mask, upstream=upstream)
    c_value, c_lp, c_ref = run(name, logprob, ref, mask, fused=False, upstream=upstream)
    assert_close(value, c_value, rtol=0, atol=0)
    assert_close(g_lp, c_lp, rtol=1e-6, atol=1e-6)
    assert_close(g_ref, c_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape, chunk", [((1000,), 7), ((13, 17), 5), ((3, 4, 50), 64), ((2, 3), 1), ((), 4)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_any_chunk_size(shape, chunk, contiguous):
    n = max(1, torch.Size(shape).numel())
    logprob, ref = make_inputs(n, seed=7)
    logprob, ref = logprob.reshape(shape), ref.reshape(shape)
    if not contiguous and len(shape) >= 2:
        logprob = logprob.transpose(0, -1).contiguous().transpose(0, -1)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(8)) > 0.3
    for name in ["k3", "low_var_kl+"]:
        spec = parse_estimator(name)
        lp, rf = logprob.clone().requires_grad_(), ref.clone().requires_grad_()
        out = _fused.fused_kl_value(lp, rf, spec, mask, torch.float32, chunk=chunk)
        out.sum().backward()
        d = torch.where(mask, logprob.double() - ref.double(), 0.0)
        want_value, want_grad = formula(name, d)
        assert_close(out.double(), want_value, rtol=1e-5, atol=1e-5)
        assert_close(lp.grad.double(), torch.where(mask, want_grad, 0.0), rtol=1e-5, atol=1e-5)
        assert_close(rf.grad.double(), -torch.where(mask, want_grad, 0.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5)])
def test_empty_tensors(shape):
    lp = torch.zeros(shape, requires_grad=True)
    ref = torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.zeros(shape, dtype=torch.bool)
    out = _fused.fused_kl_value(lp, ref, parse_estimator("k3+"), mask, torch.float32)
    assert out.shape == shape and out.dtype == torch.float32
    out.sum().backward()
    assert lp.grad.shape == shape and ref.grad.shape == shape and ref.grad.dtype == torch.bfloat16
    assert lk.kl_penalty(lp, ref, "k3", mask=mask).shape == shape


def test_inputs_without_grad_have_no_autograd_node():
    logprob, ref = make_inputs(3000)
    out = lk.kl_penalty(logprob, ref, "k3+")
    assert out.grad_fn is None and not out.requires_grad
    lp = logprob.clone().requires_grad_()
    with torch.no_grad():
        assert lk.kl_penalty(lp, ref, "k3+").grad_fn is None
    assert type(lk.kl_penalty(lp, ref, "k3+").grad_fn).__name__ == "FusedKLPenaltyBackward"


@pytest.mark.parametrize("which", ["logprob", "ref_logprob"])
def test_gradient_only_for_the_input_that_requires_it(which):
    logprob, ref = make_inputs(3000, seed=9)
    lp = logprob.clone().requires_grad_(which == "logprob")
    rf = ref.clone().requires_grad_(which == "ref_logprob")
    lk.kl_penalty(lp, rf, "k3").sum().backward()
    _, want_grad = formula("k3", logprob.double() - ref.double())
    if which == "logprob":
        assert rf.grad is None
        assert_close(lp.grad.double(), want_grad, rtol=1e-5, atol=1e-5)
    else:
        assert lp.grad is None
        assert_close(rf.grad.double(), -want_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["k3", "k3+", "abs"])
def test_double_backward_goes_through_the_composition(name):
    logprob, ref = make_inputs(2500, seed=12, edges=False)
    lp = logprob.clone().requires_grad_()
    out = lk.kl_penalty(lp, ref, name)
    (grad,) = torch.autograd.grad(out.sum(), lp, create_graph=True)
    (second,) = torch.autograd.grad(grad.sum(), lp)
    d = logprob.double() - ref.double()
    assert_close(grad.double(), formula(name, d)[1], rtol=1e-5, atol=1e-6)
    # d2/dlogprob2: k3 -> exp(-d), k2 gradient d -> 1, abs -> 0
    want = {"k3": torch.exp(-d), "k3+": torch.ones_like(d), "abs": torch.zeros_like(d)}[name]
    assert_close(second.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["k1", "k3", "k2", "k3+"])
def test_old_logprob_importance_weight_on_the_fused_value(name):
    logprob, ref = make_inputs(2500, seed=10, edges=False)  # w * (k + k') cancels badly at large |d|
    old = (logprob - 0.1 * torch.randn(2500, generator=torch.Generator().manual_seed(11))).clamp(max=0)
    mask = torch.arange(2500) < 2300
    results = []
    for enabled in (True, False):
        lp = logprob.clone().requires_grad_()
        _fused.ENABLED = enabled
        try:
            out = lk.kl_penalty(lp, ref, name, mask=mask, old_logprob=old)
        finally:
            _fused.ENABLED = True
        out.sum().backward()
        results.append((out.detach(), lp.grad))
    assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    # (1 - exp(-d)) * g against g - g * exp(-d): float32 rounding apart
    assert_close(results[0][1], results[1][1], rtol=2e-5, atol=1e-5)
    # and the fused path against float64 maths of the formulas: value w * k(d) with w = pi / pi_old,
    # gradient w * (k + k') for a differentiable weight (k1: w * (d + 1); k3: w * d) and w * d for
    # a detached one (k2, k3+); 0 on padding
    d = logprob.double() - ref.double()
    w = torch.exp(logprob.double() - old.double())
    want_grad = w * (d + 1) if name == "k1" else w * d
    zero = torch.zeros((), dtype=torch.float64)
    assert_close(results[0][0].double(), torch.where(mask, w * reference.value(name, d), zero), rtol=1e-5, atol=1e-6)
    assert_close(results[0][1].double(), torch.where(mask, want_grad, zero), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threshold", [None, 1000])
def test_fewer_than_min_elements_take_the_composition(threshold, monkeypatch):
    if threshold is None:
        monkeypatch.undo()  # the package's own constants: [8, 4096] is fused, one element fewer is not
        assert _fused.MIN_ELEMENTS == 8 * 4096
    spec = parse_estimator("k3+")
    assert not _fused.use_fused(spec, torch.zeros(_fused.MIN_ELEMENTS - 1))
    assert _fused.use_fused(spec, torch.zeros(_fused.MIN_ELEMENTS))
    assert not _fused.use_fused(parse_estimator("k3+"), torch.zeros(0))


def _graph_names(t: torch.Tensor) -> set[str]:
    names, seen, todo = set(), set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and id(fn) not in seen:
            seen.add(id(fn))
            names.add(type(fn).__name__)
            todo.extend(f for f, _ in fn.next_functions)
    return names


def test_loss_and_callback_use_the_fused_path(monkeypatch):
    calls = []
    forward = _fused._forward
    monkeypatch.setattr(_fused, "_forward", lambda *a: calls.append(a[3]) or forward(*a))
    logprob, ref = make_inputs(4000)
    lp = logprob.view(4, 1000).clone().requires_grad_()
    mask = torch.ones(4, 1000, dtype=torch.bool)
    kl = lk.KLPenaltyLoss("k3+", coef=1.0)
    loss = kl(lp, ref.view(4, 1000), mask)
    assert "FusedKLPenaltyBackward" in _graph_names(loss)
    loss.backward()
    d = (logprob - ref).double().view(4, 1000)
    assert_close(loss.double(), formula("k3", d)[0].mean(), rtol=1e-5, atol=1e-6)
    assert_close(lp.grad.double(), d / 4000, rtol=1e-5, atol=1e-8)
    assert_close(kl.metric.compute().double(), formula("k3", d)[0].mean(), rtol=1e-5, atol=1e-6)

    batch = {"scores": torch.zeros(4, 1000), "logprobs": logprob.view(4, 1000), "ref_logprobs": ref.view(4, 1000)}
    batch["mask"] = mask
    callback = lk.KLRewardCallback("k1", controller=lk.FixedKLController(0.5))
    rewards, _, _ = callback.shape_rewards(batch)
    assert calls == ["k3", "k1"]
    assert_close(rewards.double(), -0.5 * d, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", SAMPLED)
def test_nan_on_a_valid_token_as_the_composition(name):
    """Not padding: NaN at valid positions gives what the composition gives (NaN or 0), no more."""
    logprob, ref = make_inputs(2500, seed=14)
    logprob[[20, 700]] = float("nan")
    ref[[1500]] = float("nan")
    value, g_lp, g_ref = run(name, logprob, ref)
    c_value, c_lp, c_ref = run(name, logprob, ref, fused=False)
    assert_close(value, c_value, rtol=0, atol=0, equal_nan=True)
    assert_close(g_lp, c_lp, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert_close(g_ref, c_ref, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("mode", ["inference", "one_thread"])
def test_inference_mode_and_a_single_thread(mode):
    """Several chunks under inference_mode (Lightning's eval loops), or with one torch thread."""
    logprob, ref = make_inputs(5 * _fused.CHUNK + 3, seed=13)
    mask = torch.arange(logprob.numel()) % 7 != 0
    want_value, _ = formula("low_var_kl", torch.where(mask, logprob.double() - ref.double(), 0.0))
    threads = torch.get_num_threads()
    try:
        if mode == "inference":
            with torch.inference_mode():
                out = lk.kl_penalty(logprob, ref, "low_var_kl", mask=mask)
            assert out.is_inference()
        else:
            torch.set_num_threads(1)
            out = lk.kl_penalty(logprob, ref, "low_var_kl", mask=mask)
    finally:
        torch.set_num_threads(threads)
    assert_close(out.double(), want_value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["abs", "k3", "low_var_kl", "k2+"])
def test_float64_inputs_stay_float64(name):
    logprob, ref = make_inputs(2500, dtype=torch.float64, seed=15)
    mask = torch.arange(2500) % 5 != 0
    logprob, ref = with_junk(logprob, ref, mask)
    value, g_lp, g_ref = run(name, logprob, ref, mask)
    assert value.dtype == g_lp.dtype == g_ref.dtype == torch.float64
    d = torch.where(mask, logprob - ref, 0.0)
    want_value, want_grad = formula(name, d)
    want_grad = torch.where(mask, want_grad, 0.0)
    assert_close(value, want_value, rtol=1e-12, atol=1e-12)
    assert_close(g_lp, want_grad, rtol=1e-12, atol=1e-12)
    assert_close(g_ref, -want_grad, rtol=1e-12, atol=1e-12)
