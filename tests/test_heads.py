"""Real LM heads: ``lk.FromHidden(hidden, weight, bias, *, logit_scale=, softcap=)``.

The logits are :math:`z = c \\tanh(s (h W^T + b) / c)` (:math:`z = s (h W^T + b)` without a cap): Gemma 2/3's
``final_logit_softcapping`` and Cohere's ``logit_scale``. Every quantity of the engine (token log-probs,
the exact KL with a capped policy and/or reference, the entropy), with and without a truncating sampler,
chunked and walked by vocabulary tiles, is checked here in value and in every gradient (hidden states,
head, bias, both models) against float64 maths written from the formula and differentiated by autograd.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import lightning_kl as lk
from lightning_kl.ground import chunks
from lightning_kl.kernels import engine
from lightning_kl.ground.sampler import process_scores

N, D, V = 15, 6, 13  # 15 rows: chunk_size=4 cuts them into 4 chunks


def _head(seed: int, dtype: torch.dtype = torch.float64, spread: float = 3.0, d: int = D) -> tuple[Tensor, Tensor, Tensor]:
    """Hidden states, head and bias whose pre-activations reach a few units: the cap bends them.

    Multiples of 1/16: every matmul is exact in float32 whatever its blocking (chunks of rows make it
    differently), so float32 runs differ from float64 maths by what follows the matmul alone."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g, dtype=torch.float64)
    w = torch.randn(V, d, generator=g, dtype=torch.float64) * spread / d**0.5
    b = torch.randn(V, generator=g, dtype=torch.float64)
    return tuple((t * 16).round().div(16).to(dtype) for t in (h, w, b))  # type: ignore[return-value]


def _logits64(h: Tensor, w: Tensor, b: Tensor, scale: float, cap: Optional[float]) -> Tensor:
    """The formula, in float64: z = c tanh(s a / c), or s a."""
    a = F.linear(h, w, b) * scale
    return a if cap is None else cap * torch.tanh(a / cap)


def _log_probs64(z: Tensor, sampling: lk.Sampling) -> tuple[Tensor, Tensor]:
    """``log p~`` of the processed distribution (0 off the kept set, where ``kept`` is False) and ``kept``."""
    s = z / sampling.temperature
    kept = process_scores(s.detach(), sampling) > float("-inf") if sampling.truncates else torch.ones_like(s, dtype=torch.bool)
    s = s.masked_fill(~kept, float("-inf"))
    logp = torch.log_softmax(s, -1)
    return torch.where(kept, logp, torch.zeros_like(logp)), kept  # no -inf anywhere autograd looks


def _quantity64(what: str, z: Tensor, zr: Optional[Tensor], tokens: Tensor, sampling: lk.Sampling, reference: str) -> Tensor:
    logp, kept = _log_probs64(z, sampling)
    if what == "logprobs":
        return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    p = logp.exp() * kept
    if what == "entropy":
        return -(p * logp).sum(-1)
    assert zr is not None
    if reference == "policy_kept":
        logq = torch.log_softmax((zr / sampling.temperature).masked_fill(~kept, float("-inf")), -1)
        logq = torch.where(kept, logq, torch.zeros_like(logq))
    else:
        logq = torch.log_softmax(zr / sampling.temperature, -1)
    return (p * (logp - logq)).sum(-1)


def _engine(what: str, x: lk.FromHidden, ref: Optional[lk.FromHidden], tokens: Tensor, sampling: lk.Sampling, reference: str, mask: Optional[Tensor] = None, **kw: Any) -> Tensor:
    if what == "logprobs":
        return lk.token_logprobs(x, tokens, sampling=sampling, **kw)
    if what == "entropy":
        return lk.token_entropy(x, mask, sampling=sampling, **kw)
    assert ref is not None
    return lk.full_kl(x, ref, mask, sampling=sampling, reference=reference, **kw)


def _tokens(sampling: lk.Sampling, z: Tensor) -> Tensor:
    """A token in the kept set of every row (the most likely one, and others where kept)."""
    _, kept = _log_probs64(z.detach(), sampling)
    pick = torch.arange(N) % V
    return torch.where(kept.gather(-1, pick.unsqueeze(-1)).squeeze(-1), pick, z.detach().argmax(-1))


HEADS = {
    "scale+cap": (0.5, 3.0),
    "cap": (1.0, 2.0),
    "scale": (2.0, None),
    "plain": (1.0, None),
}
SAMPLINGS = {
    "T1": lk.Sampling(),
    "T0.7": lk.Sampling(0.7),
    "top_k+top_p": lk.Sampling(0.8, top_k=6, top_p=0.9),
    "min_p": lk.Sampling(1.3, min_p=0.05),
}
CASES = [  # (quantity, policy head, reference head, reference)
    ("logprobs", "scale+cap", None, "unprocessed"),
    ("logprobs", "cap", None, "unprocessed"),
    ("logprobs", "scale", None, "unprocessed"),
    ("entropy", "scale+cap", None, "unprocessed"),
    ("entropy", "scale", None, "unprocessed"),
    ("kl", "scale+cap", "cap", "unprocessed"),  # each its own scale and cap
    ("kl", "cap", "plain", "unprocessed"),  # a capped policy, a plain reference
    ("kl", "plain", "scale+cap", "unprocessed"),  # a plain policy, a capped reference
    ("kl", "scale", "cap", "policy_kept"),
]


def _run_case(what: str, pol: str, refh: Optional[str], reference: str, sampling: lk.Sampling, dtype: torch.dtype, **kw: Any) -> None:
    s, c = HEADS[pol]
    leaves = [t.clone().requires_grad_() for t in _head(1, dtype)]
    ref_leaves = [t.clone().requires_grad_() for t in _head(2, dtype, spread=4.0)]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    ref64 = [t.detach().double().requires_grad_() for t in ref_leaves]
    z64 = _logits64(*leaves64, s, c)
    zr64 = None if refh is None else _logits64(*ref64, *HEADS[refh])
    tokens = _tokens(sampling, z64)
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    x = lk.FromHidden(*leaves, logit_scale=s, softcap=c)
    ref = None if refh is None else lk.FromHidden(*ref_leaves, logit_scale=HEADS[refh][0], softcap=HEADS[refh][1])
    got = _engine(what, x, ref, tokens, sampling, reference, **kw)
    got.backward(upstream.to(got.dtype))
    want = _quantity64(what, z64, zr64, tokens, sampling, reference)
    want.backward(upstream)

    names = ("value", "hidden", "weight", "bias", "ref_hidden", "ref_weight", "ref_bias")
    ours = [got.detach()] + [t.grad for t in leaves + (ref_leaves if ref is not None else [])]
    exact = [want.detach()] + [t.grad for t in leaves64 + (ref64 if ref is not None else [])]
    assert all(t is not None and t.dtype == dtype for t in ours[1:])
    if dtype == torch.float64:
        for name, a, b in zip(names, ours, exact):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12 * max(1.0, float(b.abs().max())), msg=lambda m: f"{name}: {m}")
        return
    # float32: the engine's own rounding from logits is test_engine_matrix.py's business (against the
    # plain composition); here a wrong chain rule or a cap applied twice would be off by O(1)
    for name, a, b in zip(names, ours, exact):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5 * max(1.0, float(b.abs().max())), msg=lambda m: f"{name}: {m}")


@pytest.mark.filterwarnings("ignore:`ref_hidden` requires grad")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=str)
@pytest.mark.parametrize("what, pol, refh, reference", CASES, ids=lambda v: str(v))
def test_values_and_every_gradient_match_float64_maths(what, pol, refh, reference, sampling, dtype):
    _run_case(what, pol, refh, reference, SAMPLINGS[sampling], dtype, chunk_size=4)


@pytest.mark.filterwarnings("ignore:`ref_hidden` requires grad")
@pytest.mark.parametrize("what, pol, refh, reference", CASES, ids=lambda v: str(v))
def test_vocabulary_tiles_take_the_cap_tile_by_tile(what, pol, refh, reference, monkeypatch):
    """Without truncation a head's rows are walked by vocabulary tiles: 60 elements over 15 rows, tiles of 4 columns."""
    monkeypatch.setattr(engine, "HIDDEN_CPU_TILE_ELEMENTS", 60)
    assert len(engine.Source(engine.Tensors(torch.empty(N, D), torch.empty(V, D))).tiles(N, True)) == 4
    _run_case(what, pol, refh, reference, lk.Sampling(0.9), torch.float64)


def test_the_slope_made_again_equals_the_one_kept_by_the_read(monkeypatch):
    """The backward's read keeps each chunk's dz/da for the gradient; if no read kept it (another order of
    reads and writes), the head's gradient makes it again from the pre-activation: the same bits."""
    leaves = [t.float().clone().requires_grad_() for t in _head(4)]
    tokens = torch.arange(N) % V
    # the chunks in order: on the CPU pool a head's dW and db add up in the order chunks finish (equal to
    # rounding, not bitwise), and this test compares bits
    monkeypatch.setattr(chunks, "CPU_THREAD_POOL", False)

    def grads() -> list[Tensor]:
        for t in leaves:
            t.grad = None
        lk.token_logprobs(lk.FromHidden(*leaves, logit_scale=0.7, softcap=2.5), tokens, chunk_size=4).sum().backward()
        return [t.grad.clone() for t in leaves]

    kept = grads()
    made: list[int] = []
    original = engine.Source.slope

    def counted(self, idx, cols):
        made.append(int(getattr(self.slopes, "last", None) is None))
        return original(self, idx, cols)

    monkeypatch.setattr(engine.Source, "slope", counted)
    assert all(torch.equal(a, b) for a, b in zip(kept, grads())) and made and not any(made)  # every slope was kept
    made.clear()
    monkeypatch.setattr(engine.Source, "keep_slopes", lambda self: None)
    again = grads()
    assert made and all(made)  # none kept: every one made again
    assert all(torch.equal(a, b) for a, b in zip(kept, again))


def test_a_saturated_cap_keeps_the_gradients_digits():
    """Far into the cap dz/da = s sech^2(u) is tiny; 1 - tanh^2(u), as autograd's tanh backward forms it,
    loses every digit there in float32. The engine forms it from u: relative error ~1e-6 per weight row."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(1, D, generator=g)
    w = torch.randn(V, D, generator=g)
    w = w * (torch.linspace(1.0, 9.0, V) / (F.linear(h, w).abs().squeeze(0) + 1e-3)).unsqueeze(1)  # |a| from 1 to 9
    cap = 1.0
    leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    lk.token_logprobs(lk.FromHidden(*leaves, softcap=cap), torch.tensor([0])).sum().backward()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    torch.log_softmax(_logits64(h64, w64, None, 1.0, cap), -1)[0, 0].backward()
    h32, w32 = h.clone().requires_grad_(), w.clone().requires_grad_()
    torch.log_softmax(cap * torch.tanh(F.linear(h32, w32) / cap), -1)[0, 0].backward()
    rel = lambda got: float(((got.double() - w64.grad).norm(dim=1) / w64.grad.norm(dim=1)).max())  # noqa: E731
    assert rel(leaves[1].grad) < 1e-5
    assert rel(w32.grad) > 1e-2  # the plain float32 composition: the check above can fail


@pytest.mark.parametrize("scale, cap", [(0.0625, None), (1.0, 30.0), (0.5, 3.0), (1.0, 0.5)])
def test_the_heads_logits_and_chain_rule_are_as_exact_as_float32_allows(scale, cap):
    """The head alone, float32 against float64: its logits (``Source.read``) and its gradients for a given
    ``dL/dz`` (``HeadGrad``) within 4x the error of the same formula composed in float32 by autograd."""
    h, w, b = (t.float() for t in _head(12, spread=12.0))
    g = torch.randn(N, V, generator=torch.Generator().manual_seed(13))
    src = engine.Source(engine.Tensors(h, w, b, engine.Head(scale, cap)))
    writer = engine.HeadGrad(src, (True, True, True), torch.float32, None)
    z, fresh = src.read(slice(0, N))
    assert fresh and z.dtype == torch.float32
    writer.put(slice(0, N), slice(0, N), g)
    ours = [z, *writer.result(engine.WHOLE)]
    leaves64 = [t.double().requires_grad_() for t in (h, w, b)]
    z64 = _logits64(*leaves64, scale, cap)
    z64.backward(g.double())
    leaves32 = [t.clone().requires_grad_() for t in (h, w, b)]
    z32 = _logits64(*leaves32, scale, cap)
    z32.backward(g)
    for name, a, p, want in zip(("z", "hidden", "weight", "bias"), ours, [z32.detach()] + [t.grad for t in leaves32], [z64.detach()] + [t.grad for t in leaves64]):
        err, plain = float((a.double() - want).abs().max()), float((p.double() - want).abs().max())
        assert err <= 4 * plain + 1e-7 * float(want.abs().max()), (name, err, plain)


def test_invalid_rows_with_nan_hidden_states_get_zero_gradient():
    h, w, b = _head(6)
    mask = torch.ones(N, dtype=torch.bool)
    mask[[2, 9]] = False
    h = h.clone()
    h[~mask] = float("nan")
    for what in ("kl", "entropy", "logprobs"):
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        x = lk.FromHidden(*leaves, logit_scale=0.5, softcap=2.0)
        if what == "kl":
            out = lk.full_kl(x, lk.FromHidden(*_head(7), softcap=3.0), mask, chunk_size=4)
        elif what == "entropy":
            out = lk.token_entropy(x, mask, chunk_size=4)
        else:
            out = lk.token_logprobs(x, torch.where(mask, torch.arange(N) % V, -100), ignore_index=-100, chunk_size=4)
        out.sum().backward()
        assert torch.all(out[~mask] == 0) and out[mask].isfinite().all(), what
        assert all(t.grad.isfinite().all() for t in leaves), what
        assert torch.all(leaves[0].grad[~mask] == 0), what


def test_the_loss_and_kl_penalty_take_capped_heads_at_both_levels():
    """``KLPenaltyLoss("full")`` and ``kl_penalty(..., "full")`` reach the same kernel with each head's scale and cap."""
    (h, w, b), (rh, rw, rb) = _head(8), _head(9)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    x = lk.FromHidden(h.view(3, 5, D).requires_grad_(), w, b, logit_scale=0.5, softcap=3.0)
    ref = lk.FromHidden(rh.view(3, 5, D), rw, rb, softcap=2.0)
    z = _logits64(h, w, b, 0.5, 3.0).view(3, 5, V)
    zr = _logits64(rh, rw, rb, 1.0, 2.0).view(3, 5, V)
    torch.testing.assert_close(lk.kl_penalty(x, ref, "full", mask=mask), lk.full_kl(z, zr, mask), rtol=1e-12, atol=1e-12)
    tokens = torch.arange(15).view(3, 5) % V
    sampled = lk.token_logprobs(x, tokens)
    torch.testing.assert_close(sampled, lk.token_logprobs(z, tokens), rtol=1e-12, atol=1e-12)
    loss = lk.KLPenaltyLoss("full", coef=1.0, agg="token-sum", level="sequence")(x, ref, mask, sampled_logprob=sampled)
    torch.testing.assert_close(loss, lk.full_kl(z, zr, mask).sum(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"logit_scale": 0}, ValueError, r"`logit_scale` must be a finite number > 0, got 0\."),
        ({"logit_scale": -0.0625}, ValueError, r"`logit_scale` must be a finite number > 0, got -0\.0625"),
        ({"logit_scale": float("inf")}, ValueError, r"`logit_scale` must be a finite number > 0, got inf"),
        ({"logit_scale": float("nan")}, ValueError, r"`logit_scale` must be a finite number > 0, got nan"),
        ({"logit_scale": None}, TypeError, r"`logit_scale` must be a real number, got NoneType None"),
        ({"logit_scale": True}, TypeError, r"`logit_scale` must be a real number, got bool True"),
        ({"softcap": 0.0}, ValueError, r"`softcap` must be a finite number > 0 or None \(no cap\), got 0\.0"),
        ({"softcap": -30.0}, ValueError, r"`softcap` must be a finite number > 0 or None \(no cap\), got -30\.0"),
        ({"softcap": float("inf")}, ValueError, r"`softcap` must be a finite number > 0 or None \(no cap\), got inf"),
        ({"softcap": "30"}, TypeError, r"`softcap` must be a real number or None, got str '30'"),
    ],
)
def test_bad_scale_or_cap_fails_at_construction_naming_it(kw, error, match):
    h, w, b = _head(0)
    with pytest.raises(error, match=match):
        lk.FromHidden(h, w, b, **kw)


def test_from_hidden_keeps_its_keywords_through_copy_pickle_and_replace():
    h, w, b = _head(0)
    x = lk.FromHidden(h, w, b, logit_scale=0.0625, softcap=30)
    assert (x.logit_scale, x.softcap) == (0.0625, 30.0) and isinstance(x.softcap, float)
    assert x[:3] == (h, w, b) and x.hidden is h  # still a tuple of its fields
    for y in (copy.copy(x), copy.deepcopy(x), pickle.loads(pickle.dumps(x)), x._replace(hidden=h)):
        assert type(y) is lk.FromHidden and (y.logit_scale, y.softcap) == (0.0625, 30.0)
    with pytest.raises(ValueError, match="softcap"):
        x._replace(softcap=0)
    with pytest.raises(TypeError):
        lk.FromHidden(h, w, b, 0.0625)  # keyword only: a 4th positional would be read silently otherwise
    plain = lk.FromHidden(h, w)
    assert (plain.bias, plain.logit_scale, plain.softcap) == (None, 1.0, None)


def test_a_plain_head_is_unchanged_bit_for_bit():
    """``logit_scale=1.0, softcap=None`` takes the plain path: the logits are the matmul itself."""
    h, w, b = (t.float() for t in _head(10))
    tokens = torch.arange(N) % V
    ids = torch.arange(N) % V
    plain = lk.token_logprobs(lk.FromHidden(h, w, b), tokens)
    explicit = lk.token_logprobs(lk.FromHidden(h, w, b, logit_scale=1, softcap=None), ids)
    assert torch.equal(plain, explicit)
    torch.testing.assert_close(plain, lk.token_logprobs(F.linear(h, w, b), tokens), rtol=1e-6, atol=1e-6)


def test_bfloat16_heads_cap_in_float32_with_bfloat16_gradients():
    """A bf16 head makes ``a`` in bf16, as the model's ``nn.Linear`` does; the scale and the cap run in float32."""
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in _head(11)]
    x = lk.FromHidden(*leaves, logit_scale=0.5, softcap=2.0)
    tokens = torch.arange(N) % V
    lp = lk.token_logprobs(x, tokens)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 for t in leaves)
    with torch.no_grad():
        a = F.linear(*leaves).double()  # the bf16 matmul's values
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    a64 = F.linear(*leaves64)
    a64 = a64 + (a - a64).detach()
    z64 = 2.0 * torch.tanh(0.5 * a64 / 2.0)
    want = torch.log_softmax(z64, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    want.sum().backward()
    torch.testing.assert_close(lp.double(), want.detach(), rtol=1e-6, atol=1e-6)
    for leaf, leaf64 in zip(leaves, leaves64):
        torch.testing.assert_close(leaf.grad.double(), leaf64.grad, rtol=1e-2, atol=1e-2 * float(leaf64.grad.abs().max()))


# ---------------------------------------------------------------------------------------------
# lk.hf reads the scale and the cap from a transformers model's config: tiny models built in code


def _tiny(kind: str) -> Any:
    tf = pytest.importorskip("transformers")
    common = dict(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    config, model = {
        "gemma2": (lambda: tf.Gemma2Config(final_logit_softcapping=2.0, **common), tf.Gemma2ForCausalLM),
        "gemma3": (lambda: tf.Gemma3TextConfig(final_logit_softcapping=2.0, **common), tf.Gemma3ForCausalLM),
        "cohere": (lambda: tf.CohereConfig(logit_scale=0.5, **common), tf.CohereForCausalLM),
        "cohere2": (lambda: tf.Cohere2Config(logit_scale=0.0625, eos_token_id=1, **common), tf.Cohere2ForCausalLM),
        "granite": (lambda: tf.GraniteConfig(logits_scaling=4.0, **common), tf.GraniteForCausalLM),
    }[kind]
    torch.manual_seed(0)
    m = model(config()).double().eval()
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(25.0)  # logits of several units: well into a cap of 2
    return m


@pytest.mark.parametrize(
    "kind, want",
    [
        ("gemma2", {"logit_scale": 1.0, "softcap": 2.0}),
        ("gemma3", {"logit_scale": 1.0, "softcap": 2.0}),
        ("cohere", {"logit_scale": 0.5, "softcap": None}),
        ("cohere2", {"logit_scale": 0.0625, "softcap": None}),
        ("granite", {"logit_scale": 0.25, "softcap": None}),
    ],
)
def test_hf_from_hidden_gives_the_models_own_log_probs_and_gradients(kind, want):
    """From the last hidden states, the engine's log-probs, entropy and KL equal those of the model's own
    logits (float64 model), and so do the gradients w.r.t. the hidden states and the head."""
    model = _tiny(kind)
    assert lk.hf.logit_transform(model) == want
    ids = torch.randint(0, 48, (2, 7), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, output_hidden_states=True)
    last = out.hidden_states[-1]  # after the final norm: the tensor the model's logits are made from
    logits, hidden = out.logits[:, :-1], last[:, :-1]
    if want["softcap"] is not None:
        assert logits.abs().max() < want["softcap"] < F.linear(hidden, model.get_output_embeddings().weight).abs().max()  # the cap bends
    targets = ids[:, 1:]
    x = lk.hf.from_hidden(model, hidden)
    assert isinstance(x, lk.FromHidden) and x.weight is model.get_output_embeddings().weight
    head = model.get_output_embeddings().weight
    for sampling in (lk.Sampling(), lk.Sampling(0.7, top_k=5)):
        got = lk.token_logprobs(x, targets, sampling=sampling, outside="-inf")
        want_lp = lk.token_logprobs(logits, targets, sampling=sampling, outside="-inf")
        torch.testing.assert_close(got, want_lp, rtol=1e-12, atol=1e-12)
        finite = want_lp.isfinite()
        if finite.any():
            g_h, g_w = torch.autograd.grad(got[finite].sum(), (last, head), retain_graph=True)
            w_h, w_w = torch.autograd.grad(want_lp[finite].sum(), (last, head), retain_graph=True)
            torch.testing.assert_close(g_h, w_h, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(g_w, w_w, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(lk.token_entropy(x, sampling=sampling), lk.token_entropy(logits, sampling=sampling), rtol=1e-12, atol=1e-12)
    # the plain composition, float64: log_softmax of the model's logits
    torch.testing.assert_close(
        lk.token_logprobs(x, targets), torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1), rtol=1e-12, atol=1e-12
    )
    # the full KL to a reference that is the same model with another head: each FromHidden its own transform
    ref_hidden = hidden.detach() * 0.9
    kl = lk.full_kl(x, lk.hf.from_hidden(model, ref_hidden), torch.ones(2, 6, dtype=torch.bool))
    with torch.no_grad():
        ref_logits = model.lm_head(ref_hidden) * want["logit_scale"]
        if want["softcap"] is not None:
            ref_logits = want["softcap"] * torch.tanh(ref_logits / want["softcap"])
    torch.testing.assert_close(kl, lk.full_kl(logits, ref_logits, torch.ones(2, 6, dtype=torch.bool)), rtol=1e-10, atol=1e-12)


def test_hf_refuses_a_scale_it_does_not_know_how_the_model_applies():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match=r"model type 'hyperclovax' sets logits_scaling=2\.0, which lk.hf does not know"):
        lk.hf.logit_transform(SimpleNamespace(model_type="hyperclovax", logits_scaling=2.0))
    with pytest.raises(ValueError, match=r"model type 'mpt' sets logit_scale=0\.5"):
        lk.hf.logit_transform(SimpleNamespace(model_type="mpt", logit_scale=0.5))
    assert lk.hf.logit_transform(SimpleNamespace(model_type="mpt", logit_scale=None)) == {"logit_scale": 1.0, "softcap": None}
    with pytest.raises(ValueError, match=r"`softcap` must be a finite number > 0"):
        lk.hf.logit_transform(SimpleNamespace(model_type="gemma2", final_logit_softcapping=0.0))
    with pytest.raises(TypeError, match=r"no LM head to read"):
        lk.hf.from_hidden(SimpleNamespace(config=SimpleNamespace(model_type="gemma2")), torch.zeros(1, 2))
