"""The exact KL over the vocabulary ('full'): values and gradients against float64 maths, masks,
half precision, chunking, bounded memory, the error paths, and a real Lightning loop."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset

import lightning_kl as lk
from lightning_kl.functional import AGG_MODES
from lightning_kl.estimators import ESTIMATORS, EstimatorSpec, SAMPLED_ESTIMATORS, parse_estimator
from lightning_kl import Sampling, full_kl

# gradients toward the reference are checked here on purpose: its warning is expected
pytestmark = pytest.mark.filterwarnings("ignore:`ref_[a-z]*` requires grad")

F64 = torch.float64


def reference(z: torch.Tensor, zr: torch.Tensor, t: float = 1.0) -> tuple[torch.Tensor, ...]:
    """KL(p || q) per row and both gradients, from the formulas, in float64 with 0 log 0 = 0.

    p = softmax(z / t), q = softmax(zr / t); dKL/dz = p (log p - log q - KL) / t; dKL/dzr = (q - p) / t.
    """
    z, zr = z.to(F64), zr.to(F64)
    logp, logq = torch.log_softmax(z / t, -1), torch.log_softmax(zr / t, -1)
    p, q = logp.exp(), logq.exp()
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros((), dtype=F64))
    kl = terms.sum(-1)
    grad_z = torch.where(p > 0, p * (logp - logq - kl.unsqueeze(-1)), torch.zeros((), dtype=F64)) / t
    grad_zr = (q - p) / t
    return kl, grad_z, grad_zr


def logits(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64) * scale


def test_names():
    assert "full" in ESTIMATORS and "full" not in SAMPLED_ESTIMATORS
    assert set(ESTIMATORS) == set(SAMPLED_ESTIMATORS) | {"full"}
    assert parse_estimator("full") == EstimatorSpec("full", "full", False)
    with pytest.raises(ValueError, match="already the exact gradient"):
        parse_estimator("full+")
    with pytest.raises(ValueError, match="already the exact gradient"):
        lk.KLPenaltyLoss("full+")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_library_matches_autograd_of_the_definition(temperature):
    """kl_penalty(..., "full") and its gradients against float64 autograd of sum_v p (log p - log q),
    independently of the hand-written reference (whose formulas the other tests use)."""
    z64, zr64 = logits(4, 6), logits(4, 6, seed=1)
    w = logits(4, seed=2, scale=1.0)
    mask = torch.tensor([True, False, True, True])
    z, zr = z64.clone().requires_grad_(), zr64.clone().requires_grad_()
    kl = lk.kl_penalty(z, zr, "full", mask=mask, sampling=lk.Sampling(temperature=temperature))
    (kl * w).sum().backward()
    y, yr = z64.clone().requires_grad_(), zr64.clone().requires_grad_()
    logp, logq = torch.log_softmax(y / temperature, -1), torch.log_softmax(yr / temperature, -1)
    want = (logp.exp() * (logp - logq)).sum(-1)
    (torch.where(mask, want, 0.0) * w).sum().backward()
    assert_close(kl, torch.where(mask, want, 0.0).detach(), rtol=1e-12, atol=1e-14)
    assert_close(z.grad, y.grad, rtol=1e-10, atol=1e-13)
    assert_close(zr.grad, yr.grad, rtol=1e-10, atol=1e-13)
    assert z.grad[1].abs().max() == 0 and y.grad.abs().sum() > 0


@pytest.mark.parametrize("shape", [(3, 5, 7), (7,), (2, 1, 3, 11)])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_values_and_gradients_match_float64(shape, temperature, chunk_size):
    z64, zr64 = logits(*shape), logits(*shape, seed=1)
    w = logits(*shape[:-1], seed=2, scale=1.0)  # a weighted sum: each token's gradient is scaled
    z, zr = z64.float().requires_grad_(), zr64.float().requires_grad_()
    kl = full_kl(z, zr, sampling=Sampling(temperature), chunk_size=chunk_size)
    assert kl.shape == shape[:-1] and kl.dtype == torch.float32
    (kl * w.float()).sum().backward()
    want, grad_z, grad_zr = reference(z.detach(), zr.detach(), temperature)
    assert_close(kl.double(), want, rtol=1e-5, atol=2e-6)
    assert_close(z.grad.double(), grad_z * w.unsqueeze(-1), rtol=1e-5, atol=2e-6)
    assert_close(zr.grad.double(), grad_zr * w.unsqueeze(-1), rtol=1e-5, atol=2e-6)


def test_float64_inputs_are_computed_in_float64():
    z, zr = logits(5, 9).requires_grad_(), logits(5, 9, seed=1)
    kl = lk.kl_penalty(z, zr, "full", mask=torch.ones(5, dtype=torch.bool), sampling=lk.Sampling(temperature=1.3))
    assert kl.dtype == F64
    kl.sum().backward()
    want, grad_z, _ = reference(z.detach(), zr, 1.3)
    assert_close(kl, want, rtol=1e-12, atol=1e-12)
    assert_close(z.grad, grad_z, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_size", range(1, 9))
def test_every_chunk_boundary_gives_the_same_answer(chunk_size):
    """7 tokens: chunks of 1 ... 8 tokens (a last chunk of every size, and one chunk for all)."""
    z64, zr64 = logits(7, 13), logits(7, 13, seed=1)
    z, zr = z64.float().requires_grad_(), zr64.float().requires_grad_()
    kl = full_kl(z, zr, chunk_size=chunk_size)
    kl.sum().backward()
    want, grad_z, grad_zr = reference(z.detach(), zr.detach())
    assert_close(kl.double(), want, rtol=1e-5, atol=2e-6)
    assert_close(z.grad.double(), grad_z, rtol=1e-5, atol=2e-6)
    assert_close(zr.grad.double(), grad_zr, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_mask_zeroes_value_and_gradient_whatever_the_padding_holds(chunk_size, mask_dtype):
    z64, zr64 = logits(3, 4, 6), logits(3, 4, 6, seed=1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    z, zr = z64.float(), zr64.float()
    junk = torch.tensor([float("nan"), float("inf"), float("-inf"), -1e30, 1e30, 0.0])
    z[~mask], zr[~mask] = junk, junk.flip(0)
    z.requires_grad_(), zr.requires_grad_()
    kl = lk.kl_penalty(z, zr, "full", mask=mask.to(mask_dtype), sampling=lk.Sampling(temperature=0.8))
    kl.sum().backward()
    want, grad_z, grad_zr = reference(z64[mask], zr64[mask], 0.8)
    assert torch.equal(kl[~mask], torch.zeros(int((~mask).sum())))
    assert torch.equal(z.grad[~mask], torch.zeros_like(z.grad[~mask]))  # exactly 0, not NaN
    assert torch.equal(zr.grad[~mask], torch.zeros_like(zr.grad[~mask]))
    assert_close(kl[mask].double(), want, rtol=1e-5, atol=2e-6)
    assert_close(z.grad[mask].double(), grad_z, rtol=1e-5, atol=2e-6)
    assert_close(zr.grad[mask].double(), grad_zr, rtol=1e-5, atol=2e-6)


def test_inputs_that_are_not_contiguous_are_read_in_place():
    """Shifted logits (``[:, :-1]``) and a transposed layout give the same answer as contiguous ones."""
    z64, zr64 = logits(3, 6, 5), logits(3, 6, 5, seed=1)
    base = z64.float().requires_grad_()
    ref_t = zr64.float().transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not ref_t.is_contiguous()
    mask = torch.tensor([[1, 1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    for m in (None, mask):
        base.grad = None
        kl = full_kl(base[:, :-1], ref_t[:, :-1], m, chunk_size=2)
        kl.sum().backward()
        m_ = torch.ones(3, 5, dtype=torch.bool) if m is None else m
        want, grad_z, _ = reference(z64[:, :-1][m_], zr64[:, :-1][m_])
        assert_close(kl[m_].double(), want, rtol=1e-5, atol=2e-6)
        assert_close(base.grad[:, :-1][m_].double(), grad_z, rtol=1e-5, atol=2e-6)
        assert torch.equal(base.grad[:, -1], torch.zeros(3, 5))  # the unused last position


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_accumulated_in_float32(dtype):
    z = logits(6, 257).to(dtype).requires_grad_()
    zr = logits(6, 257, seed=1).to(dtype).requires_grad_()
    want, grad_z, grad_zr = reference(z.detach(), zr.detach())
    kl32 = full_kl(z, zr, chunk_size=4)  # float32: within float32 precision of the exact answer
    assert kl32.dtype == torch.float32
    assert_close(kl32.double(), want, rtol=1e-5, atol=1e-5)
    kl = lk.kl_penalty(z, zr, "full", mask=torch.ones(6, dtype=torch.bool))  # like the sampled estimators: cast back to the input dtype
    assert kl.dtype == dtype
    kl.float().sum().backward()
    assert z.grad.dtype == dtype and zr.grad.dtype == dtype
    # the gradient is exact in float32 and rounded once to the half dtype
    eps = torch.finfo(dtype).eps
    assert_close(z.grad.double(), grad_z, rtol=eps, atol=1e-6)
    assert_close(zr.grad.double(), grad_zr, rtol=eps, atol=1e-6)


def test_infinite_logits_in_the_vocabulary():
    z64, zr64 = logits(4, 6), logits(4, 6, seed=1)
    ninf = float("-inf")
    z64[0, 2] = zr64[0, 2] = ninf  # a padded vocabulary entry in both models: adds nothing
    z64[1, 3] = ninf  # the policy never emits a token the reference could: 0 log 0 = 0
    zr64[2, 1] = ninf  # the policy can emit a token the reference cannot: KL = +inf
    z64[3, 0] = float("nan")  # NaN logits at a valid token are not hidden
    z, zr = z64.float().requires_grad_(), zr64.float().requires_grad_()
    kl = full_kl(z, zr, chunk_size=3)
    want, grad_z, grad_zr = reference(z64[:2], zr64[:2])
    assert_close(kl[:2].double(), want, rtol=1e-5, atol=2e-6)
    # row 0 is the KL over the vocabulary without its padded entry
    assert_close(kl[0].double(), reference(z64[0, [0, 1, 3, 4, 5]], zr64[0, [0, 1, 3, 4, 5]])[0], rtol=1e-5, atol=2e-6)
    assert kl[2].item() == math.inf and math.isnan(kl[3].item())
    kl[:2].sum().backward()
    assert_close(z.grad[:2].double(), grad_z, rtol=1e-5, atol=2e-6)
    assert_close(zr.grad[:2].double(), grad_zr, rtol=1e-5, atol=2e-6)
    assert z.grad[0, 2] == 0 and zr.grad[0, 2] == 0 and z.grad[1, 3] == 0



@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_a_nan_row_with_a_gradient_gets_nan_gradients_and_the_others_stay_exact(chunk_size):
    """A NaN logit poisons its row's value and, when that row has a gradient, its row of both gradients
    (NaN must not train on quietly); the other rows, a 0 log 0 entry and a masked NaN row are exact."""
    z64, zr64 = logits(5, 6), logits(5, 6, seed=1)
    z64[0, 2] = float("-inf")  # 0 log 0 = 0: its gradient is exactly 0, not NaN
    z64[3, 4] = float("nan")
    zr64[4, 1] = float("nan")  # the reference's NaN reaches the row the same way
    z, zr = z64.float().requires_grad_(), zr64.float().requires_grad_()
    kl = full_kl(z, zr, chunk_size=chunk_size)
    assert kl[3].isnan() and kl[4].isnan() and kl[:3].isfinite().all()
    kl.sum().backward()
    for g in (z.grad, zr.grad):
        assert g[3:].isnan().all() and g[:3].isfinite().all()
    want, grad_z, grad_zr = reference(z64[:3], zr64[:3])
    assert_close(z.grad[:3].double(), grad_z, rtol=1e-5, atol=2e-6)
    assert_close(zr.grad[:3].double(), grad_zr, rtol=1e-5, atol=2e-6)
    assert z.grad[0, 2] == 0
    # the same rows masked: value 0 and gradient exactly 0, the NaN nowhere
    z.grad = zr.grad = None
    mask = torch.tensor([True, True, True, False, False])
    kl = full_kl(z, zr, mask, chunk_size=chunk_size)
    kl.sum().backward()
    assert (kl[3:] == 0).all() and (z.grad[3:] == 0).all() and (zr.grad[3:] == 0).all()
    assert_close(z.grad[:3].double(), grad_z, rtol=1e-5, atol=2e-6)

class _AllocationLog(TorchDispatchMode):
    """Records the number of elements of every new tensor (not a view, not in place) an op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for o in torch.utils._pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                self.sizes.append((str(func), o.numel()))
        return out


@pytest.mark.parametrize("ref_grad", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_forward_and_backward_make_no_tensor_larger_than_a_chunk_but_the_gradients(ref_grad, temperature):
    n, vocab, chunk = 24, 40, 3
    z = logits(n, vocab).float().requires_grad_()
    zr = logits(n, vocab, seed=1).float().requires_grad_(ref_grad)
    mask = torch.arange(n) % 5 != 0
    log = _AllocationLog()
    with log:
        kl = full_kl(z, zr, mask, sampling=Sampling(temperature), chunk_size=chunk)
        kl.sum().backward()
    big = [s for s in log.sizes if s[1] > chunk * vocab]
    assert len(big) == 1 + ref_grad, big  # the gradient buffers, nothing else
    assert all(size == n * vocab for _, size in big)
    # and the plain composition would fail this check
    log = _AllocationLog()
    with log:
        logp, logq = torch.log_softmax(z, -1), torch.log_softmax(zr, -1)
        (logp.exp() * (logp - logq)).sum().backward()
    assert sum(size > chunk * vocab for _, size in log.sizes) >= 4


def test_errors():
    z = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="needs no importance weights"):
        lk.kl_penalty(z, z, "full", old_logprob=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="needs no importance weights"):
        lk.KLPenaltyLoss("full")(z, z, None, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"logits \(2, 3, 5\) and ref_logits \(2, 3, 4\)"):
        lk.kl_penalty(z, torch.zeros(2, 3, 4), "full")
    with pytest.raises(ValueError, match=r"mask \(2, 3, 5\) and logits \(2, 3, 5\) \(expected mask \(2, 3\)\)"):
        lk.kl_penalty(z, z, "full", mask=torch.ones(2, 3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="vocabulary dimension"):
        lk.kl_penalty(torch.zeros(()), torch.zeros(()), "full")
    with pytest.raises(TypeError, match="floating point"):
        lk.kl_penalty(z.long(), z, "full")
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="temperature"):
            lk.kl_penalty(z, z, "full", sampling=lk.Sampling(temperature=bad))
    # sampled estimators take log-probs at the sampling temperature already
    with pytest.raises(ValueError, match=r"'full' estimator \(logits\) only, got Sampling\(temperature=0.7.* with 'k3\+'"):
        lk.kl_penalty(torch.zeros(3), torch.zeros(3), "k3+", sampling=lk.Sampling(temperature=0.7))
    with pytest.raises(ValueError, match=r"'full' estimator \(logits\) only, got Sampling\(temperature=0.7.* with 'k1'"):
        lk.KLPenaltyLoss("k1", sampling=lk.Sampling(temperature=0.7))
    with pytest.raises(ValueError, match="chunk_size"):
        full_kl(z, z, chunk_size=0)
    with pytest.raises(ValueError, match="cannot use the 'full' estimator.*'k1'"):
        lk.KLRewardCallback("full")


@pytest.mark.parametrize("agg", AGG_MODES)
def test_loss_aggregates_the_exact_kl_with_the_mask(agg):
    z64, zr64 = logits(3, 4, 6), logits(3, 4, 6, seed=1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    z, zr = z64.float(), zr64.float()
    z[~mask] = float("nan")
    z.requires_grad_()
    loss_fn = lk.KLPenaltyLoss("full", coef=0.5, agg=agg, sampling=lk.Sampling(temperature=0.9))
    loss = loss_fn(z, zr, mask)
    want, _, _ = reference(z64, zr64, 0.9)
    assert_close(loss.double(), 0.5 * lk.aggregate(want, mask, agg), rtol=1e-5, atol=1e-6)
    loss.backward()
    assert torch.isfinite(z.grad).all() and torch.equal(z.grad[~mask], torch.zeros_like(z.grad[~mask]))
    assert_close(loss_fn.metric.compute().double(), want[mask].mean(), rtol=1e-5, atol=1e-6)
    assert "temperature=0.9" in repr(loss_fn)


def test_inference_mode_and_no_grad():
    z64, zr64 = logits(20, 33), logits(20, 33, seed=1)
    with torch.inference_mode():
        kl = full_kl(z64.float(), zr64.float(), chunk_size=2)
    assert kl.is_inference()
    assert_close(kl.double(), reference(z64, zr64)[0], rtol=1e-5, atol=2e-6)
    with torch.no_grad():
        assert full_kl(z64.float().requires_grad_(), zr64.float(), chunk_size=2).grad_fn is None


# ---------------------------------------------------------------------------------------------
# a real training loop: the model hands its logits to KLPenaltyLoss("full")


class _Prompts(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, 11, (6,), generator=g)
        mask = torch.arange(6) < torch.randint(1, 7, (), generator=g)
        return {"tokens": tokens, "mask": mask}


class _TinyLM(pl.LightningModule):
    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.policy = nn.Sequential(nn.Embedding(vocab, 8), nn.Linear(8, vocab))
        self.ref = nn.Sequential(nn.Embedding(vocab, 8), nn.Linear(8, vocab)).requires_grad_(False)
        self.kl = lk.KLPenaltyLoss("full", coef=1.0, agg="seq-mean-token-mean", sampling=lk.Sampling(temperature=0.7))
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.policy(batch["tokens"])  # [b, t, V]
        with torch.no_grad():
            ref_logits = self.ref(batch["tokens"])
        logits = logits.masked_fill(~batch["mask"].unsqueeze(-1), float("nan"))  # junk on padding
        loss = self.kl(logits, ref_logits, batch["mask"])
        self.log("train/kl", self.kl.metric, on_step=True, on_epoch=False)
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Prompts(), batch_size=8)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.policy.parameters(), lr=0.5)


def test_full_in_a_lightning_training_loop(quiet_trainer):
    model = _TinyLM()
    trainer = quiet_trainer(fast_dev_run=6)
    trainer.fit(model)
    assert len(model.losses) == 6 and all(math.isfinite(x) for x in model.losses)
    # minimizing the exact KL alone pulls the policy toward the reference
    assert model.losses[-1] < 0.8 * model.losses[0]
    assert math.isfinite(float(trainer.callback_metrics["train/kl"]))
