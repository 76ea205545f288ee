"""Token log-probs from logits and from hidden states, against float64 maths written from the formula.

Reference: ``lp = z_y / T - log sum_v exp(z_v / T)`` in float64 from the same logits (for the hidden
path, the logits the head makes in the inputs' dtype, as a model would), differentiated by autograd
in float64. Every gradient the kernels return is compared with it.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_kl as lk
from _vocab import kl_from_hidden, logprobs_from_hidden
from lightning_kl.kernels import engine as kernel

# gradients toward the reference are checked here on purpose: its warning is expected
pytestmark = pytest.mark.filterwarnings("ignore:`ref_[a-z]*` requires grad")

# value and gradient tolerances per input dtype: the value is computed in float32 from the exact
# input values, so it is float32-exact; a gradient is rounded once to the input's dtype
TOL = {
    torch.float64: dict(value=(1e-12, 1e-12), grad=(1e-12, 1e-12)),
    torch.float32: dict(value=(1e-5, 1e-6), grad=(1e-5, 1e-6)),
    torch.bfloat16: dict(value=(1e-5, 1e-6), grad=(1e-2, 1e-2)),
    torch.float16: dict(value=(1e-5, 1e-6), grad=(1e-3, 1e-3)),
}
DTYPES = list(TOL)
IGNORE = -100


def reference(logits64: Tensor, tokens: Tensor, temperature: float = 1.0, ignore_index=None) -> Tensor:
    """float64 ``z_y / T - logsumexp(z / T)``, 0 where ``tokens == ignore_index``."""
    z = logits64 / temperature
    ids = tokens if ignore_index is None else tokens.masked_fill(tokens == ignore_index, 0)
    lp = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    if ignore_index is not None:
        lp = torch.where(tokens == ignore_index, torch.zeros_like(lp), lp)
    return lp


def make(shape, vocab, dtype, seed=0, ignore_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, vocab, shape, generator=g)
    if ignore_frac:
        tokens = tokens.masked_fill(torch.rand(shape, generator=g) < ignore_frac, IGNORE)
    upstream = torch.randn(shape, generator=g, dtype=torch.float64)
    return logits, tokens, upstream


def check_against_reference(logits, tokens, upstream, temperature=1.0, ignore_index=None, chunk_size=None):
    """Value and logits gradient of the kernel vs the float64 reference."""
    x = logits.detach().clone().requires_grad_()
    lp = lk.token_logprobs(x, tokens, sampling=lk.Sampling(temperature), ignore_index=ignore_index, chunk_size=chunk_size)
    assert lp.shape == tokens.shape
    assert lp.dtype == (torch.float64 if logits.dtype == torch.float64 else torch.float32)
    lp.backward(upstream.to(lp.dtype))
    x64 = logits.detach().double().requires_grad_()
    ref = reference(x64, tokens, temperature, ignore_index)
    ref.backward(upstream)
    tol = TOL[logits.dtype]
    torch.testing.assert_close(lp.double(), ref.detach(), rtol=tol["value"][0], atol=tol["value"][1])
    assert x.grad is not None and x.grad.dtype == logits.dtype
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol["grad"][0], atol=tol["grad"][1])
    return x.grad


# ---------------------------------------------------------------------------------------------
# from logits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [None, 1, 4, 7, 64])  # 4 does not divide 14 rows; 7 does
def test_logits_match_float64_maths(dtype, temperature, chunk_size):
    logits, tokens, upstream = make((2, 7), 11, dtype)
    check_against_reference(logits, tokens, upstream, temperature, chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_logits_non_contiguous_inputs_are_read_in_place(dtype, chunk_size):
    logits, tokens, upstream = make((3, 6), 13, dtype, seed=1)
    # the shifted view of a causal LM, and a transposed one: neither can be viewed as [n, V]
    grad = check_against_reference(logits[:, :-1], tokens[:, 1:], upstream[:, 1:], chunk_size=chunk_size)
    assert grad.shape == (3, 5, 13)
    check_against_reference(logits.transpose(0, 1), tokens.T, upstream.T, temperature=1.3, chunk_size=chunk_size)
    # a stride on the vocabulary dimension
    wide, _, _ = make((3, 6), 26, dtype, seed=2)
    check_against_reference(wide[..., ::2], tokens, upstream, chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logits_ignore_index_gives_zero_and_zero_gradient_even_on_nan(dtype):
    logits, tokens, upstream = make((4, 5), 9, dtype, seed=3, ignore_frac=0.4)
    ignored = tokens == IGNORE
    assert ignored.any() and (~ignored).any()
    logits[ignored] = float("nan")  # junk at ignored positions must not leak
    x = logits.clone().requires_grad_()
    lp = lk.token_logprobs(x, tokens, ignore_index=IGNORE, chunk_size=3)
    lp.backward(upstream.to(lp.dtype))
    assert (lp[ignored] == 0).all()
    assert (x.grad[ignored] == 0).all()
    clean = torch.where(ignored.unsqueeze(-1), torch.zeros_like(logits), logits)
    check_against_reference(clean, tokens, upstream, ignore_index=IGNORE, chunk_size=3)


def test_ignore_index_may_be_a_valid_id():
    # a pad id inside [0, V): its positions are ignored, other ids are unaffected
    logits, tokens, upstream = make((2, 8), 6, torch.float32, seed=4)
    check_against_reference(logits, tokens, upstream, ignore_index=0)
    assert (tokens == 0).any()


def test_logits_gradient_of_a_nan_valid_token_is_nan():
    logits, tokens, _ = make((1, 3), 5, torch.float32, seed=5)
    logits[0, 1, 2] = float("nan")
    x = logits.requires_grad_()
    lp = lk.token_logprobs(x, tokens)
    assert lp[0, 1].isnan() and not lp[0, 0].isnan()
    lp.sum().backward()
    assert x.grad[0, 1].isnan().all() and not x.grad[0, 0].isnan().any()


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)])
def test_empty_batch(shape):
    logits = torch.randn(*shape, 7, requires_grad=True)
    tokens = torch.zeros(shape, dtype=torch.long)
    lp = lk.token_logprobs(logits, tokens, ignore_index=IGNORE)
    assert lp.shape == shape
    lp.sum().backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape
    hidden = torch.randn(*shape, 4, requires_grad=True)
    weight = torch.randn(7, 4, requires_grad=True)
    lp = logprobs_from_hidden(hidden, weight, tokens)
    assert lp.shape == shape
    lp.sum().backward()
    assert hidden.grad.shape == hidden.shape and (weight.grad == 0).all()


def test_no_full_size_float32_copy_is_kept_for_backward():
    # what the forward saves: the logits themselves (not a copy) and O(n) numbers
    logits = torch.randn(64, 1000, dtype=torch.bfloat16, requires_grad=True)
    lp = lk.token_logprobs(logits, torch.randint(0, 1000, (64,)))
    saved = lp.grad_fn.saved_tensors
    big = [t for t in saved if t is not None and t.numel() >= logits.numel()]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr() and big[0].dtype == torch.bfloat16
    assert sum(t.numel() for t in saved if t is not None) <= logits.numel() + 3 * 64


def test_inference_mode_and_no_grad_keep_nothing():
    logits, tokens, _ = make((3, 4), 9, torch.bfloat16, seed=30)
    want = lk.token_logprobs(logits, tokens)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            got = lk.token_logprobs(logits.requires_grad_(), tokens, chunk_size=2)
        assert got.grad_fn is None
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        logits.requires_grad_(False)


def test_from_hidden_keeps_no_logits_for_backward():
    # what the forwards save: the inputs (the head is [V, d], d < n here) and O(n) numbers, never [n, V]
    hidden, weight, bias = make_head((8,), 4, 300, torch.float32, seed=34)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    tokens = torch.randint(0, 300, (8,))
    lp = logprobs_from_hidden(h, w, tokens, bias, vocab_chunk_size=64)
    kl = kl_from_hidden(h, w, hidden.detach(), weight.detach() * 0.5, chunk_size=3)
    for out in (lp, kl):
        saved = [t for t in out.grad_fn.saved_tensors if t is not None]
        assert saved and max(t.numel() for t in saved) == w.numel() < 8 * 300


def test_full_from_hidden_empty_batch():
    h = torch.randn(0, 3, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    kl = kl_from_hidden(h, w, torch.randn(0, 3), torch.randn(5, 3))
    kl.sum().backward()
    assert kl.shape == (0,) and h.grad.shape == (0, 3) and (w.grad == 0).all()


def test_default_chunks_split_the_rows(monkeypatch):
    # with a small element budget the defaults make many chunks; values stay exact
    monkeypatch.setattr(kernel, "CPU_CHUNK_ELEMENTS", 20)
    logits, tokens, upstream = make((5,), 7, torch.float32, seed=6)  # 2 rows per chunk: 3 chunks
    check_against_reference(logits, tokens, upstream)


# ---------------------------------------------------------------------------------------------
# bad inputs


def test_bad_ids_name_the_id_and_the_vocabulary():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match=r"token id 7 is out of range for a vocabulary of V=5"):
        lk.token_logprobs(logits, torch.tensor([[0, 7, 1], [2, 3, 4]]))
    with pytest.raises(ValueError, match=r"token id -100 .*V=5.*ignore_index"):
        lk.token_logprobs(logits, torch.tensor([[0, 1, 1], [2, 3, -100]]))
    with pytest.raises(ValueError, match=r"token id -1 .*V=5"):
        lk.token_logprobs(logits, torch.tensor([[0, -1, 1], [2, 3, -100]]), ignore_index=-100)
    with pytest.raises(ValueError, match=r"token id 5 .*V=5"):
        logprobs_from_hidden(torch.randn(2, 3, 4), torch.randn(5, 4), torch.tensor([[0, 1, 1], [2, 3, 5]]))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(tokens=torch.zeros(2, 4, dtype=torch.long)), ValueError, r"tokens \(2, 4\) and logits \(2, 3, '...'\)"),
        (dict(tokens=torch.zeros(2, 3)), TypeError, "integer tensor of token ids, got dtype torch.float32"),
        (dict(tokens=torch.zeros(2, 3, dtype=torch.bool)), TypeError, "got dtype torch.bool"),
        (dict(tokens=[[0, 1, 2], [0, 1, 2]]), TypeError, "got list"),
        (dict(logits=torch.zeros(2, 3, 5, dtype=torch.long)), TypeError, "`logits` must be a floating point tensor"),
        (dict(logits=torch.tensor(1.0), tokens=torch.tensor(0)), ValueError, r"V >= 1 entries, got shape \(\)"),
        (dict(logits=torch.zeros(2, 3, 0)), ValueError, r"V >= 1 entries, got shape \(2, 3, 0\)"),
        (dict(temperature=0.0), ValueError, "`temperature` must be a finite number > 0, got 0.0"),
        (dict(temperature=float("inf")), ValueError, "`temperature`"),
        (dict(chunk_size=0), ValueError, "`chunk_size` must be a positive integer or None, got 0"),
        (dict(ignore_index=True), TypeError, "`ignore_index` must be an int or None, got True"),
        (dict(sampling=0.7), TypeError, "`sampling` must be an lk.Sampling or None, got float"),
        (dict(outside="drop"), ValueError, "`outside` must be one of"),
    ],
)
def test_bad_logits_inputs(kwargs, error, match):
    args = dict(logits=torch.randn(2, 3, 5), tokens=torch.zeros(2, 3, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        if "temperature" in args:  # the sampler is validated when it is built
            args["sampling"] = lk.Sampling(args.pop("temperature"))
        lk.token_logprobs(args.pop("logits"), **args)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(weight=torch.randn(5, 3)), ValueError, r"`weight` must be the LM head `\[V, d\]`.*\(5, 3\).*\(2, 3, 4\)"),
        (dict(weight=torch.randn(5)), ValueError, r"`weight` must be the LM head"),
        (dict(weight=torch.randn(0, 4)), ValueError, r"`weight` must be the LM head `\[V, d\]` with V >= 1"),
        (dict(weight=torch.randn(5, 4, dtype=torch.float64)), ValueError, "one dtype: got torch.float32 and torch.float64"),
        (dict(bias=torch.randn(4)), ValueError, r"`bias` must be `\[V\]` = \(5,\)"),
        (dict(bias=torch.randn(5, dtype=torch.float64)), ValueError, "`bias` must have the dtype and device"),
        (dict(bias=torch.zeros(5, dtype=torch.long)), TypeError, "`bias` must be a floating point tensor"),
        (dict(hidden=torch.randn(2, 3, 4).long()), TypeError, "`hidden` must be a floating point tensor"),
        (dict(tokens=torch.zeros(3, 2, dtype=torch.long)), ValueError, r"tokens \(3, 2\) and hidden"),
        (dict(chunk_size=-1), ValueError, "`chunk_size` must be a positive integer"),
    ],
)
def test_bad_hidden_inputs(kwargs, error, match):
    args = dict(hidden=torch.randn(2, 3, 4), weight=torch.randn(5, 4), tokens=torch.zeros(2, 3, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        logprobs_from_hidden(**args)


# ---------------------------------------------------------------------------------------------
# from hidden states


def hidden_reference(hidden, weight, bias, tokens, upstream, temperature=1.0, ignore_index=None):
    """float64 value and gradients, from the logits the head makes in the inputs' dtype."""
    with torch.no_grad():
        logits = F.linear(hidden, weight, bias)  # what the kernel's matmul yields, rounded alike
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    b64 = None if bias is None else bias.double().requires_grad_()
    exact = F.linear(h64, w64, b64)
    # value from the dtype's logits; gradient through the float64 head (same d/dz, exact matmuls)
    z = exact + (logits.double() - exact).detach()
    ref = reference(z, tokens, temperature, ignore_index)
    ref.backward(upstream)
    return ref.detach(), h64.grad, w64.grad, None if b64 is None else b64.grad


def make_head(shape, d, vocab, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, d, generator=g).to(dtype)
    weight = torch.randn(vocab, d, generator=g).to(dtype)
    b = (torch.randn(vocab, generator=g)).to(dtype) if bias else None
    return hidden, weight, b


def check_hidden(hidden, weight, bias, tokens, upstream, temperature=1.0, ignore_index=None, **chunks):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    lp = logprobs_from_hidden(h, w, tokens, b, temperature=temperature, ignore_index=ignore_index, **chunks)
    assert lp.shape == tokens.shape
    lp.backward(upstream.to(lp.dtype))
    ref, gh, gw, gb = hidden_reference(hidden, weight, bias, tokens, upstream, temperature, ignore_index)
    tol = TOL[hidden.dtype]
    torch.testing.assert_close(lp.double(), ref, rtol=tol["value"][0], atol=tol["value"][1])
    # a half gradient is a sum of half products: compare at the scale of the gradient
    rtol, atol = tol["grad"]
    for got, want in ((h.grad, gh), (w.grad, gw), (None if b is None else b.grad, gb)):
        if want is None:
            assert got is None
            continue
        assert got.dtype == hidden.dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize(
    "chunks",
    [dict(), dict(chunk_size=4, vocab_chunk_size=5), dict(chunk_size=3, vocab_chunk_size=1), dict(chunk_size=15, vocab_chunk_size=13)],
    ids=["default", "4x5", "3x1", "15x13"],  # 4 and 5 divide neither 15 rows nor 13 entries
)
def test_hidden_matches_float64_maths(dtype, temperature, chunks):
    hidden, weight, bias = make_head((3, 5), 6, 13, dtype)
    _, tokens, upstream = make((3, 5), 13, torch.float32, seed=7, ignore_frac=0.2)
    check_hidden(hidden, weight, bias, tokens, upstream, temperature, IGNORE, **chunks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hidden_without_bias_non_contiguous(dtype):
    hidden, weight, _ = make_head((4, 6), 5, 9, dtype, seed=8, bias=False)
    _, tokens, upstream = make((4, 6), 9, torch.float32, seed=9)
    # the shifted view, and a head stored transposed (tied embeddings are often views)
    w_t = weight.T.contiguous().T
    check_hidden(hidden[:, :-1], w_t, None, tokens[:, 1:], upstream[:, 1:], chunk_size=4, vocab_chunk_size=4)


def test_hidden_nan_at_ignored_positions_stays_out():
    hidden, weight, bias = make_head((2, 4), 3, 7, torch.float32, seed=10)
    tokens = torch.tensor([[1, IGNORE, 2, 3], [IGNORE, 0, 6, 5]])
    hidden[tokens == IGNORE] = float("nan")
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    lp = logprobs_from_hidden(h, w, tokens, b, ignore_index=IGNORE, chunk_size=3, vocab_chunk_size=4)
    lp.sum().backward()
    assert (lp[tokens == IGNORE] == 0).all() and not lp.isnan().any()
    assert not w.grad.isnan().any() and not b.grad.isnan().any() and (h.grad[tokens == IGNORE] == 0).all()


def test_frozen_head_gets_no_gradient():
    hidden, weight, bias = make_head((2, 5), 4, 11, torch.float32, seed=11)
    _, tokens, upstream = make((2, 5), 11, torch.float32, seed=12)
    # a reference model: nothing needs a gradient, so no graph at all
    ref = logprobs_from_hidden(hidden, weight, tokens, bias)
    assert not ref.requires_grad and ref.grad_fn is None
    with torch.no_grad():
        assert logprobs_from_hidden(hidden, weight, tokens, bias).grad_fn is None
    # a frozen head under a trainable trunk: the hidden states' gradient only, and no dW matmul
    h = hidden.clone().requires_grad_()
    lp = logprobs_from_hidden(h, weight, tokens, bias, chunk_size=4, vocab_chunk_size=3)
    lp.backward(upstream.float())
    assert weight.grad is None and bias.grad is None
    _, gh, _, _ = hidden_reference(hidden, weight, bias, tokens, upstream)
    torch.testing.assert_close(h.grad.double(), gh, rtol=1e-5, atol=1e-6)


def count_matmuls(monkeypatch, hidden, weight, tokens, **chunks) -> int:
    """Matmuls (``torch.mm``, ``torch.addmm``) run by the backward; patched globally, so every thread counts."""
    calls = []
    for name in ("mm", "addmm"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    lp = logprobs_from_hidden(hidden, weight, tokens, **chunks)
    lp.sum().backward()
    monkeypatch.undo()
    return len(calls)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_frozen_head_skips_the_weight_matmuls(monkeypatch, chunk_size):
    hidden, weight, _ = make_head((2, 5), 4, 11, torch.float32, seed=11, bias=False)
    tokens = torch.randint(0, 11, (2, 5))
    chunks = dict(chunk_size=chunk_size, vocab_chunk_size=3)
    n_tiles = 3 if chunk_size else 1  # chunks of rows over the whole vocabulary: 10 rows by 4, or one chunk
    frozen = count_matmuls(monkeypatch, hidden.clone().requires_grad_(), weight, tokens, **chunks)
    both = count_matmuls(monkeypatch, hidden.clone().requires_grad_(), weight.clone().requires_grad_(), tokens, **chunks)
    head_only = count_matmuls(monkeypatch, hidden, weight.clone().requires_grad_(), tokens, **chunks)
    # one matmul per chunk for dh, one for dW: a frozen head costs exactly the dh ones
    assert (frozen, both, head_only) == (n_tiles, 2 * n_tiles, n_tiles)


def test_hidden_agrees_with_logits_path():
    hidden, weight, bias = make_head((3, 4), 8, 17, torch.float32, seed=13)
    _, tokens, _ = make((3, 4), 17, torch.float32, seed=14)
    a = logprobs_from_hidden(hidden, weight, tokens, bias, temperature=0.9, chunk_size=5, vocab_chunk_size=6)
    b = lk.token_logprobs(F.linear(hidden, weight, bias), tokens, sampling=lk.Sampling(0.9))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# a Lightning loop that trains through both


class TinyLM(L.LightningModule):
    """A bigram LM: embedding -> head; the loss is the negative log-likelihood of the next token."""

    def __init__(self, from_hidden: bool, vocab: int = 12, d: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.from_hidden = from_hidden
        self.embed = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)
        self.ref_head = nn.Linear(d, vocab).requires_grad_(False)  # a frozen reference
        self.kl = lk.KLPenaltyLoss("full", coef=0.3)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        hidden = self.embed(batch["input_ids"])[:, :-1]
        labels = batch["labels"][:, 1:]  # shifted by one, -100 on padding
        valid = labels != -100
        if self.from_hidden:
            lp = logprobs_from_hidden(hidden, self.head.weight, labels, self.head.bias, ignore_index=-100)
            kl = self.kl(
                lk.FromHidden(hidden, self.head.weight, self.head.bias),
                lk.FromHidden(hidden.detach(), self.ref_head.weight, self.ref_head.bias),
                valid,
            )
        else:
            lp = lk.token_logprobs(self.head(hidden), labels, ignore_index=-100)
            kl = self.kl(self.head(hidden), self.ref_head(hidden.detach()), valid)
        return -lp[valid].mean() + kl

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def lm_batches(n=2):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 12, (n, 4, 7), generator=g)
    labels = ids.clone()
    labels[:, :, -2:] = -100  # padding
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]


@pytest.mark.parametrize("from_hidden", [False, True], ids=["logits", "hidden"])
def test_lightning_loop_trains_exactly_like_the_naive_loss(tmp_path, from_hidden):
    model = TinyLM(from_hidden)
    batches = lm_batches()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer = L.Trainer(
        fast_dev_run=True, logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path
    )
    trainer.fit(model, DataLoader(batches, batch_size=None))
    # the same SGD step from the naive float64 loss
    naive = TinyLM(from_hidden).double()
    batch = batches[0]
    logits = naive.head(naive.embed(batch["input_ids"])[:, :-1])
    labels = batch["labels"][:, 1:]
    valid = labels != -100
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logq = torch.log_softmax(naive.ref_head(naive.embed(batch["input_ids"])[:, :-1].detach()), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    (-lp[valid].mean() + 0.3 * kl[valid].mean()).backward()
    for k, p in model.named_parameters():
        grad = dict(naive.named_parameters())[k].grad
        if k.startswith("ref_head"):
            assert grad is None and torch.equal(p.detach(), before[k])
            continue
        expected = before[k].double() - 0.5 * grad
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)
        assert not torch.equal(p.detach(), before[k])


# ---------------------------------------------------------------------------------------------
# the exact full-vocabulary KL from hidden states


def full_reference(z64: Tensor, q64: Tensor, temperature: float = 1.0) -> Tensor:
    """float64 ``sum_v p_v (log p_v - log q_v)`` from the formula."""
    logp = torch.log_softmax(z64 / temperature, -1)
    logq = torch.log_softmax(q64 / temperature, -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def check_full_hidden(dtype, temperature=1.0, mask=None, ref_grad=False, shape=(3, 5), d=6, vocab=13, **kw):
    pol = make_head(shape, d, vocab, dtype, seed=20)
    ref = make_head(shape, d + 1, vocab, dtype, seed=21)
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in pol] + [x.clone().requires_grad_(ref_grad) for x in ref]
    kl = kl_from_hidden(*leaves[0:2], *leaves[3:5], mask, bias=leaves[2], ref_bias=leaves[5], temperature=temperature, **kw)
    assert kl.shape == shape and kl.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    kl.backward(upstream.to(kl.dtype))
    # reference: the logits each head makes in its dtype, gradients through float64 heads
    leaves64 = [x.double().requires_grad_() for x in (*pol, *ref)]
    with torch.no_grad():
        z, q = F.linear(*pol), F.linear(*ref)
    z64, q64 = F.linear(*leaves64[:3]), F.linear(*leaves64[3:])
    z64 = z64 + (z.double() - z64).detach()
    q64 = q64 + (q.double() - q64).detach()
    want = full_reference(z64, q64, temperature)
    if mask is not None:
        want = torch.where(mask, want, torch.zeros_like(want))
    want.backward(upstream)
    tol = TOL[dtype]
    torch.testing.assert_close(kl.double(), want.detach(), rtol=tol["value"][0] * 10, atol=tol["value"][1] * 10)
    for got, leaf64, leaf in zip((x.grad for x in leaves), leaves64, leaves):
        if not leaf.requires_grad:
            assert got is None
            continue
        want_g = leaf64.grad
        assert got.dtype == dtype and got.shape == want_g.shape
        rtol, atol = tol["grad"]
        torch.testing.assert_close(got.double(), want_g, rtol=rtol * 10, atol=atol * 10 * max(1.0, want_g.abs().max().item()))
    return kl, leaves


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_size", [None, 1, 4])  # 4 does not divide 15 rows
def test_full_from_hidden_matches_float64_maths(dtype, chunk_size):
    check_full_hidden(dtype, chunk_size=chunk_size)


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_full_from_hidden_temperature_mask_and_reference_gradient(temperature):
    mask = torch.rand(3, 5, generator=torch.Generator().manual_seed(23)) < 0.6
    kl, leaves = check_full_hidden(torch.float32, temperature, mask=mask, ref_grad=True, chunk_size=2)
    assert (kl[~mask] == 0).all() and (leaves[0].grad[~mask] == 0).all() and (leaves[3].grad[~mask] == 0).all()


def test_full_from_hidden_never_reads_masked_positions():
    pol, ref = make_head((2, 4), 3, 7, torch.float32, seed=24), make_head((2, 4), 3, 7, torch.float32, seed=25)
    mask = torch.tensor([[True, False, True, True], [False, True, True, False]])
    h = pol[0].clone()
    h[~mask] = float("nan")
    h.requires_grad_()
    w = pol[1].clone().requires_grad_()
    kl = kl_from_hidden(h, w, ref[0], ref[1], mask, chunk_size=3)
    kl.sum().backward()
    assert not kl.isnan().any() and not w.grad.isnan().any() and (h.grad[~mask] == 0).all()


def test_full_from_hidden_equals_full_of_the_logits_and_reads_layouts():
    (h, w, b), (hr, wr, br) = make_head((4, 6), 5, 9, torch.float32, seed=26), make_head((4, 6), 5, 9, torch.float32, seed=27)
    got = kl_from_hidden(h[:, :-1], w, hr[:, :-1], wr, bias=b, ref_bias=br, chunk_size=3)
    want = lk.full_kl(F.linear(h, w, b)[:, :-1], F.linear(hr, wr, br)[:, :-1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_loss_takes_hidden_states_for_full():
    (h, w, b), (hr, wr, br) = make_head((2, 5), 4, 11, torch.float32, seed=28), make_head((2, 5), 4, 11, torch.float32, seed=29)
    mask = torch.tensor([[True, True, False, True, True], [True, False, False, True, True]])
    loss_fn = lk.KLPenaltyLoss("full", coef=0.2, agg="seq-mean-token-sum", sampling=lk.Sampling(temperature=0.8))
    w1, w2 = w.clone().requires_grad_(), w.clone().requires_grad_()
    a = loss_fn(lk.FromHidden(h, w1, b), lk.FromHidden(hr, wr, br), mask)
    b_ = lk.KLPenaltyLoss("full", coef=0.2, agg="seq-mean-token-sum", sampling=lk.Sampling(temperature=0.8))(F.linear(h, w2, b), F.linear(hr, wr, br), mask)
    torch.testing.assert_close(a, b_)
    a.backward()
    b_.backward()
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-7)
    assert loss_fn.metric.compute() > 0


def test_loss_rejects_mixed_or_sampled_hidden_inputs():
    h, w, _ = make_head((2, 3), 4, 5, torch.float32)
    with pytest.raises(TypeError, match=r"'full' estimator with one for each model, got 'full' with FromHidden and Tensor"):
        lk.KLPenaltyLoss("full")(lk.FromHidden(h, w), F.linear(h, w))
    with pytest.raises(TypeError, match=r"got 'k3\+'.*token_logprobs\(lk.FromHidden"):
        lk.KLPenaltyLoss("k3+")(lk.FromHidden(h, w), lk.FromHidden(h, w))
    with pytest.raises(ValueError, match=r"logits of one shape.*ref_weight \(6, 4\)"):
        kl_from_hidden(h, w, h, torch.randn(6, 4))
    with pytest.raises(ValueError, match=r"`mask` must have the shape of `hidden` without the hidden dimension"):
        kl_from_hidden(h, w, h, w, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"`ref_weight` must be the LM head"):
        kl_from_hidden(h, w, h, torch.randn(5, 3))


def test_hugging_face_causal_lm_shifted_labels_match_its_own_loss():
    # the README's training_step: logits[:, :-1] against labels[:, 1:], -100 on prompt and padding
    # (transformers is not a test dependency: skipped where it is not installed)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    model = transformers.Qwen2ForCausalLM(config)
    input_ids = torch.randint(0, 40, (2, 7))
    labels = input_ids.clone()
    labels[:, :2] = -100  # the prompt
    labels[1, 5:] = -100  # padding
    out = model(input_ids=input_ids, labels=labels, output_hidden_states=True)
    targets = labels[:, 1:]
    valid = targets != -100
    lp = lk.token_logprobs(out.logits[:, :-1], targets, ignore_index=-100)
    torch.testing.assert_close(-lp[valid].mean(), out.loss)  # HF's mean cross-entropy over valid labels
    hidden = out.hidden_states[-1][:, :-1]  # after the final norm: lm_head(hidden) are the logits
    lp_h = logprobs_from_hidden(hidden, model.lm_head.weight, targets, ignore_index=-100)
    torch.testing.assert_close(lp_h, lp, rtol=1e-5, atol=1e-6)
    (g_logits,) = torch.autograd.grad(-lp[valid].mean(), model.lm_head.weight, retain_graph=True)
    (g_hidden,) = torch.autograd.grad(-lp_h[valid].mean(), model.lm_head.weight)
    torch.testing.assert_close(g_hidden, g_logits, rtol=1e-5, atol=1e-7)


def test_loss_from_hidden_at_the_sequence_level_equals_the_logits_path():
    (h, w, b), (hr, wr, br) = make_head((2, 5), 4, 11, torch.float32, seed=31), make_head((2, 5), 4, 11, torch.float32, seed=32)
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(33))
    mask = torch.tensor([[True, True, True, False, False], [True, True, True, True, True]])
    grads = []
    for from_hidden in (True, False):
        wl = w.clone().requires_grad_()
        logits = F.linear(h, wl, b)
        sampled = lk.token_logprobs(logits, tokens)
        loss_fn = lk.KLPenaltyLoss("full", coef=0.5, agg="seq-mean-token-sum", level="sequence")
        if from_hidden:
            loss = loss_fn(lk.FromHidden(h, wl, b), lk.FromHidden(hr, wr, br), mask, sampled_logprob=sampled)
        else:
            loss = loss_fn(logits, F.linear(hr, wr, br), mask, sampled_logprob=sampled)
        loss.backward()
        grads.append((loss.detach(), wl.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="needs `sampled_logprob`"):
        lk.KLPenaltyLoss("full", agg="token-sum", level="sequence")(lk.FromHidden(h, w), lk.FromHidden(hr, wr), mask)
