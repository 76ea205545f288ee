"""Log-probs and KL of the processed sampling distribution (temperature, top-k, top-p, min-p).

Against: ``transformers``' own logits warpers and ``generate``'s processed scores (``output_scores``)
on a tiny model, for each processor and their combinations; float64 maths written from the formula
(value and gradient, the kept set a selection); and the error messages.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.deprecated import REFERENCES
from _vocab import logprobs_from_hidden, processed, processed_from_hidden, processed_kl

# the reference side is differentiated on purpose here: its gradient is checked too
pytestmark = pytest.mark.filterwarnings("ignore:`ref_[a-z]*` requires grad")
from lightning_kl.ground.sampler import Sampling as Processing, process_scores

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

PROCESSINGS = [
    dict(temperature=0.7),
    dict(top_k=3),
    dict(top_p=0.8),
    dict(min_p=0.1),
    dict(temperature=1.3, top_k=5, top_p=0.9),
    dict(temperature=0.6, top_p=0.7, min_p=0.05),
    dict(temperature=0.8, top_k=6, top_p=0.85, min_p=0.02),
]
IDS = ["T", "top_k", "top_p", "min_p", "T+k+p", "T+p+min_p", "all"]


def warpers(temperature=1.0, top_k=None, top_p=None, min_p=None) -> LogitsProcessorList:
    """generate's sampling warpers, in the order generate builds them (generation/utils.py)."""
    out = LogitsProcessorList()
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(float(temperature)))
    if top_k:
        out.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        out.append(MinPLogitsWarper(min_p))
    return out


def formula(z: torch.Tensor, y: torch.Tensor, keep: torch.Tensor, temperature: float) -> torch.Tensor:
    """float64 log p~_y = z_y / T - lse over the kept set (``keep`` a fixed selection)."""
    zt = z / temperature
    return zt.gather(-1, y[..., None]).squeeze(-1) - torch.logsumexp(zt.masked_fill(~keep, float("-inf")), -1)


def sample(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    probs = torch.softmax(scores.reshape(-1, scores.shape[-1]).double(), -1)
    return torch.multinomial(probs, 1, generator=generator).view(scores.shape[:-1])


# ---------------------------------------------------------------------------------------------
# the kept set: generate's rules, ties included


@pytest.mark.parametrize("proc", PROCESSINGS, ids=IDS)
def test_kept_set_is_generates_with_ties(proc):
    g = torch.Generator().manual_seed(0)
    # integer logits: many ties, at the top-k boundary and inside the top-p sort
    z = torch.randint(-3, 4, (64, 20), generator=g).float()
    want = warpers(**proc)(None, z.clone())
    tempered = z / proc.get("temperature", 1.0)
    got = process_scores(tempered, lk.ground.sampler.check_processing(**proc))
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    # top-k keeps every tie of the k-th score: more than k tokens
    if proc == dict(top_k=3):
        assert ((want > float("-inf")).sum(-1) > 3).any()


# ---------------------------------------------------------------------------------------------
# against float64 maths


@pytest.mark.parametrize("proc", PROCESSINGS, ids=IDS)
@pytest.mark.parametrize("layout", ["contiguous", "slice"])
def test_value_gradient_and_kept_mass_match_float64_maths(proc, layout):
    g = torch.Generator().manual_seed(1)
    base = (2 * torch.randn(3, 8, 40, generator=g, dtype=torch.float64)).requires_grad_()
    z = base[:, :-1] if layout == "slice" else base  # read in place, never copied whole
    kept = warpers(**proc)(None, z.detach().reshape(-1, 40).clone()).view(z.shape) > float("-inf")
    y = sample(torch.where(kept, z.detach(), float("-inf")), g)
    lp, log_kept = processed(z, y, **proc, chunk_size=5)
    T = proc.get("temperature", 1.0)
    want = formula(z, y, kept, T)
    assert_close(lp, want, rtol=1e-12, atol=1e-12)
    zt = z.detach() / T
    assert_close(log_kept, torch.logsumexp(zt.masked_fill(~kept, float("-inf")), -1) - torch.logsumexp(zt, -1))
    assert not log_kept.requires_grad and (log_kept <= 1e-12).all()
    w = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad((w * lp).sum(), base)
    (expect,) = torch.autograd.grad((w * want).sum(), base)
    assert_close(got, expect, rtol=1e-10, atol=1e-12)
    # the gradient flows through the kept tokens only (and the sampled one)
    assert (got[:, : z.shape[1]][~kept] == 0).all()
    # token_logprobs takes the same keywords
    assert_close(lk.token_logprobs(z, y, sampling=lk.Sampling(**proc)), lp, rtol=1e-12, atol=0)


@pytest.mark.parametrize("proc", [dict(top_p=0.6), dict(temperature=0.7, top_k=4, top_p=0.8), dict(top_k=3, min_p=0.2)])
def test_gradient_with_tied_scores_at_the_kept_sets_boundary(proc):
    # integer logits: top-p splits tied scores at its boundary in some rows (the kept set is then
    # not a threshold set: the backward runs the processing again there) and not in others
    g = torch.Generator().manual_seed(7)
    z = torch.randint(-3, 4, (200, 12), generator=g).double().requires_grad_()
    kept = warpers(**proc)(None, z.detach().clone()) > float("-inf")
    smallest = torch.where(kept, z.detach(), float("inf")).amin(-1, keepdim=True)
    split = (kept != (z.detach() >= smallest)).any(-1)
    if "top_p" in proc:
        assert split.any() and not split.all()
    y = sample(torch.where(kept, z.detach(), float("-inf")), g)
    lp = processed(z, y, **proc, chunk_size=16).logprobs
    T = proc.get("temperature", 1.0)
    want = formula(z, y, kept, T)
    assert_close(lp, want, rtol=1e-12, atol=1e-12)
    w = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad((w * lp).sum(), z)
    (expect,) = torch.autograd.grad((w * want).sum(), z)
    assert_close(got, expect, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_half_and_single_logits_compute_in_float32(dtype):
    g = torch.Generator().manual_seed(2)
    z = (3 * torch.randn(6, 50, generator=g)).to(dtype).requires_grad_()
    proc = dict(temperature=0.7, top_k=10, top_p=0.9)
    kept = warpers(**proc)(None, z.detach().float()) > float("-inf")  # generate casts to float32
    y = sample(torch.where(kept, z.detach().float(), float("-inf")), g)
    lp = lk.token_logprobs(z, y, sampling=lk.Sampling(**proc))
    assert lp.dtype == torch.float32
    want = formula(z.detach().double(), y, kept, 0.7)
    assert_close(lp.double(), want, rtol=1e-5, atol=1e-5)
    lp.sum().backward()
    assert z.grad.dtype == dtype
    zd = z.detach().double().requires_grad_()
    formula(zd, y, kept, 0.7).sum().backward()
    assert_close(z.grad.double(), zd.grad, rtol=0.02, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_from_hidden_matches_from_logits_with_every_gradient():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = (2 * torch.randn(30, 8, generator=g, dtype=torch.float64)).requires_grad_()
    b = torch.randn(30, generator=g, dtype=torch.float64, requires_grad=True)
    proc = dict(temperature=0.9, top_k=8, top_p=0.8, min_p=0.05)
    logits = torch.nn.functional.linear(h, w, b)
    kept = warpers(**proc)(None, logits.detach().reshape(-1, 30).clone()).view(logits.shape) > float("-inf")
    y = sample(torch.where(kept, logits.detach(), float("-inf")), g)
    y[0, 0] = -100
    got = logprobs_from_hidden(h, w, y, b, ignore_index=-100, chunk_size=4, **proc)
    want = processed(logits, y, ignore_index=-100, **proc).logprobs
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert got[0, 0] == 0
    weights = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((weights * got).sum(), (h, w, b))
    expect = torch.autograd.grad((weights * want).sum(), (h, w, b))
    for a, e in zip(grads, expect):
        assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_ignored_tokens_give_zero_and_zero_gradient_even_with_nan_logits():
    z = torch.randn(3, 10, dtype=torch.float64)
    z[1] = float("nan")
    z.requires_grad_()
    y = torch.tensor([z[0].argmax().item(), -100, z[2].argmax().item()])
    lp, log_kept = processed(z, y, top_k=2, ignore_index=-100)
    assert lp[1] == 0 and log_kept[1] == 0 and torch.isfinite(lp).all()
    lp.sum().backward()
    assert (z.grad[1] == 0).all() and torch.isfinite(z.grad).all()


def test_neutral_values_are_no_processing():
    z = torch.randn(4, 12, dtype=torch.float64)
    y = torch.randint(12, (4,))
    plain = lk.token_logprobs(z, y, sampling=lk.Sampling(0.8))
    for neutral in (dict(top_k=0), dict(top_p=1.0), dict(min_p=0.0), dict(top_k=None, top_p=None, min_p=None)):
        lp, log_kept = processed(z, y, temperature=0.8, **neutral)
        assert_close(lp, plain, rtol=0, atol=1e-14)
        assert (log_kept == 0).all()
    # top_k >= V keeps everything
    lp, log_kept = processed(z, y, temperature=0.8, top_k=100)
    assert_close(lp, plain, rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# against generate's processed scores on the example's tiny model


def _example():
    path = Path(__file__).resolve().parent.parent / "examples" / "hf_grpo.py"
    spec = importlib.util.spec_from_file_location("hf_grpo_for_sampling", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny():
    ex = _example()
    torch.manual_seed(0)
    model = ex.build_model("qwen2", 16, 1, 2, 1, 32, 32).eval()
    with torch.no_grad():  # peakier logits than the default init, so that truncation bites
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(6)
    tok = ex.build_tokenizer()
    enc = tok([ex.prompt_text(a, b) for a, b in [(3, 4), (12, 1), (7, 7), (0, 9)] * 4], return_tensors="pt", padding=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 1-layer model: a second thread only spin-waits on shared cores
    yield ex, model, enc
    torch.set_num_threads(threads)


GENERATE = [
    dict(temperature=0.7, top_k=0),
    dict(top_k=4),
    dict(top_k=0, top_p=0.8),
    dict(top_k=0, min_p=0.2),
    dict(temperature=1.4, top_k=6, top_p=0.9),
    dict(temperature=0.8, top_k=0, top_p=0.85, min_p=0.1),
]


@pytest.mark.parametrize("proc", GENERATE, ids=["T", "top_k", "top_p", "min_p", "T+k+p", "T+p+min_p"])
def test_response_logprobs_are_generates_processed_scores(tiny, proc):
    ex, model, enc = tiny
    torch.manual_seed(5)
    out = model.generate(**enc, do_sample=True, max_new_tokens=6, pad_token_id=ex.PAD_ID, eos_token_id=ex.EOS_ID,
                         output_scores=True, return_dict_in_generate=True, **proc)
    p = enc["input_ids"].shape[1]
    seq = out.sequences
    mask = lk.hf.response_mask(seq[:, p:], ex.EOS_ID)
    am, _ = lk.hf.sequence_inputs(enc["attention_mask"], mask)
    scores = torch.stack(out.scores, 1)  # [b, t, V] generate's processed scores, -inf where removed
    want = torch.log_softmax(scores, -1).gather(-1, seq[:, p:, None]).squeeze(-1)
    kw = {k: v for k, v in proc.items() if k != "temperature"}
    T = proc.get("temperature", 1.0)
    with torch.no_grad():
        lp, logits = lk.hf.response_logprobs(model, seq, am, p, T, return_logits=True, **kw)
    assert_close(lp[mask], want[mask], rtol=0, atol=2e-5)
    assert (lp[~mask] == 0).all()  # after EOS: not sampled, not scored
    # the kept sets are generate's, position by position
    processing = lk.ground.sampler.check_processing(T, **kw)
    kept = process_scores(logits.float() / T, processing) > float("-inf")
    assert torch.equal(kept[mask], (scores > float("-inf"))[mask])
    if processing.truncates:
        assert (kept[mask].sum(-1) < ex.VOCAB_SIZE).float().mean() > 0.5  # most positions truncate
    # the full softmax is off by the kept mass log S
    full = lk.token_logprobs(logits, seq[:, p:], sampling=lk.Sampling(T))
    log_kept = processed(logits, seq[:, p:].masked_fill(~mask, -100), T, ignore_index=-100, **kw).log_kept
    assert_close(full[mask], (lp + log_kept)[mask], rtol=0, atol=1e-5)


def test_a_scorer_with_another_processing_is_reported_not_given_minus_inf(tiny):
    # a scorer given top_k=1 disagrees with a top_k=3 sampler: reported, not -inf
    ex, model, enc = tiny
    torch.manual_seed(0)
    seq = model.generate(**enc, do_sample=True, top_k=3, max_new_tokens=4, pad_token_id=ex.PAD_ID, eos_token_id=ex.EOS_ID)
    p = enc["input_ids"].shape[1]
    mask = lk.hf.response_mask(seq[:, p:], ex.EOS_ID)
    am, _ = lk.hf.sequence_inputs(enc["attention_mask"], mask)
    with pytest.raises(ValueError, match=r"sampled token\(s\) lie outside the kept set .*'top_k': 1.* first at position"):
        lk.hf.response_logprobs(model, seq, am, p, sampling=lk.Sampling(top_k=1))
    lp = lk.hf.response_logprobs(model, seq, am, p, sampling=lk.Sampling(top_k=1), outside="-inf")
    assert (lp == float("-inf")).any() and not torch.isnan(lp).any()


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft on transformers 5
def test_reference_logprobs_take_the_processing_keywords(tiny):
    peft = pytest.importorskip("peft")
    ex, model, enc = tiny
    base = copy.deepcopy(model)
    policy = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(2)
    with torch.no_grad():  # adapters that change the model
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)
    policy.eval()
    torch.manual_seed(3)
    seq = policy.generate(**enc, do_sample=True, top_k=0, top_p=0.8, max_new_tokens=4, pad_token_id=ex.PAD_ID,
                          eos_token_id=ex.EOS_ID)
    p = enc["input_ids"].shape[1]
    mask = lk.hf.response_mask(seq[:, p:], ex.EOS_ID)
    am, _ = lk.hf.sequence_inputs(enc["attention_mask"], mask)
    with torch.no_grad():
        _, logits = lk.hf.response_logprobs(policy, seq, am, p, return_logits=True, sampling=lk.Sampling(top_p=0.8))
        want = lk.hf.response_logprobs(base, seq, am, p, sampling=lk.Sampling(top_p=0.8), kept_from=logits)
    got = lk.hf.reference_logprobs(policy, seq, am, p, sampling=lk.Sampling(top_p=0.8), kept_from=logits)
    assert_close(got, want, rtol=0, atol=1e-6)
    # on the policy's kept set: finite wherever the policy sampled
    assert torch.isfinite(got).all() and (got[~mask] == 0).all()


# ---------------------------------------------------------------------------------------------
# the exact KL of a truncated policy


def _kl_formula(z, zr, keep, keep_ref, T):
    log_p = torch.log_softmax((z / T).masked_fill(~keep, float("-inf")), -1)
    log_q = torch.log_softmax((zr / T).masked_fill(~keep_ref, float("-inf")), -1)
    return (log_p.exp() * (log_p.where(keep, 0) - log_q.where(keep, 0))).sum(-1)


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("proc", PROCESSINGS[1:], ids=IDS[1:])
def test_processed_full_kl_matches_float64_maths(proc, reference):
    g = torch.Generator().manual_seed(4)
    z = (2 * torch.randn(4, 6, 25, generator=g, dtype=torch.float64)).requires_grad_()
    # a reference close to the policy, so that its own kept sets often contain the policy's
    zr = (z.detach() + 0.3 * torch.randn(z.shape, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.rand(4, 6, generator=g) > 0.3
    T = proc.get("temperature", 1.0)

    def kept(x):
        return warpers(**proc)(None, x.detach().reshape(-1, 25).clone()).view(x.shape) > float("-inf")

    keep = kept(z)
    keep_ref = {"unprocessed": torch.ones_like(keep), "processed": kept(zr), "policy_kept": keep}[reference]
    want = _kl_formula(z, zr, keep, keep_ref, T).where(mask, 0)
    junk_z = z.detach().clone().masked_fill(~mask[..., None], float("nan")).requires_grad_()
    got = processed_kl(z, zr, mask, **proc, reference=reference, chunk_size=3)
    assert_close(got, want, rtol=1e-10, atol=1e-12)
    infinite = torch.isinf(want)
    if reference != "processed":  # only a reference with its own kept sets can miss a kept token
        assert not infinite.any()
    # masked tokens are never read: NaN there changes nothing
    assert_close(processed_kl(junk_z, zr, mask, **proc, reference=reference), got, rtol=1e-12, atol=1e-14)
    w = torch.randn(want.shape, generator=g, dtype=torch.float64).where(~infinite, 0)
    grads = torch.autograd.grad((w * got).where(~infinite, 0).sum(), (z, zr))
    # the formula again with a finite stand-in on the infinite rows (weight 0), for NaN-free autograd
    anywhere = torch.isinf(_kl_formula(z, zr, keep, keep_ref, T).detach())  # masked rows too
    finite_want = _kl_formula(z, zr, keep, keep_ref | anywhere[..., None], T).where(mask, 0)
    expect = torch.autograd.grad((w * finite_want).sum(), (z, zr))
    for a, e in zip(grads, expect):
        assert_close(a, e, rtol=1e-9, atol=1e-12)
        assert (a[~mask] == 0).all()


def test_processed_reference_is_infinite_where_the_policy_keeps_what_it_removes():
    z = torch.tensor([[2.0, 1.0, 0.0]], requires_grad=True)
    zr = torch.tensor([[0.0, 1.0, 2.0]])
    kl = processed_kl(z, zr, top_k=2, reference="processed")
    assert kl.item() == float("inf")
    with pytest.raises(ValueError, match=r"\+inf at 1 token\(s\).*reference='policy_kept' or 'unprocessed'"):
        kl.sum().backward()
    # the policy-kept reference: finite, the KL of two 2-token distributions
    kl = processed_kl(z, zr, top_k=2, reference="policy_kept")
    assert torch.isfinite(kl).all()
    # unprocessed = policy-kept - log(reference mass on the kept set)
    q = torch.softmax(zr, -1)
    unp = processed_kl(z, zr, top_k=2, reference="unprocessed")
    assert_close(unp, kl - torch.log(q[:, :2].sum(-1)))


def test_reference_on_the_policys_kept_set_matches_policy_kept_full_kl():
    # the sampled reference log-probs (kept_from=) and the exact KL use the same kept set
    g = torch.Generator().manual_seed(6)
    z = 2 * torch.randn(5, 20, generator=g, dtype=torch.float64)
    zr = 2 * torch.randn(5, 20, generator=g, dtype=torch.float64)
    proc = dict(temperature=0.9, top_p=0.8)
    log_p = processed(z, torch.zeros(5, dtype=torch.long), **proc, outside="-inf")  # any ids
    ids = torch.arange(20).expand(5, 20)
    lp = processed(z[:, None].expand(5, 20, 20), ids, **proc, outside="-inf").logprobs
    lq = processed(zr[:, None].expand(5, 20, 20), ids, **proc, kept_from=z[:, None].expand(5, 20, 20), outside="-inf").logprobs
    p = lp.exp()
    kl = (p * (lp - lq)).where(p > 0, 0).sum(-1)
    assert_close(kl, processed_kl(z, zr, **proc, reference="policy_kept"), rtol=1e-12, atol=1e-14)
    assert log_p.logprobs.shape == (5,)


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(top_k=-1), r"`top_k` must be an integer >= 0 \(0 or None: no top-k\), got -1"),
        (dict(top_k=2.5), r"`top_k` must be an integer >= 0.*got 2.5"),
        (dict(top_k=True), r"`top_k` must be an integer >= 0.*got True"),
        (dict(top_p=1.5), r"`top_p` must be a number in \[0, 1\] or None, got 1.5"),
        (dict(top_p=float("nan")), r"`top_p` must be a number in \[0, 1\] or None, got nan"),
        (dict(min_p=-0.1), r"`min_p` must be a number in \[0, 1\] or None, got -0.1"),
        (dict(temperature=0.0), r"`temperature` must be a finite number > 0, got 0.0"),
        (dict(outside="zero"), r"`outside` must be one of \('raise', '-inf', 'extend'\), got 'zero'"),
    ],
)
def test_bad_processing_fails_with_a_message_naming_it(kw, match):
    z, y = torch.randn(2, 5), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=match):
        processed(z, y, **kw)
    if "outside" not in kw:
        with pytest.raises(ValueError, match=match):
            lk.token_logprobs(z, y, sampling=lk.Sampling(**{"top_k": 2, **kw}))
        with pytest.raises(ValueError, match=match):
            processed_kl(z, z, **kw)


def test_bad_reference_and_kept_from_shape():
    z = torch.randn(2, 5)
    with pytest.raises(ValueError, match=r"`reference` must be one of \('unprocessed', 'processed', 'policy_kept'\), got 'own'"):
        processed_kl(z, z, top_k=2, reference="own")
    with pytest.raises(ValueError, match=r"kept_from"):
        processed(z, torch.tensor([0, 1]), top_k=2, kept_from=torch.randn(2, 6))


def test_bad_processing_fails_before_the_forward_pass():
    class Boom(torch.nn.Module):
        def forward(self, **kw):
            raise AssertionError("the model ran")

    seq, am = torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"`top_p` must be a number in \[0, 1\]"):
        lk.hf.response_logprobs(Boom(), seq, am, 2, top_p=2.0)  # the deprecated keyword: checked before the model runs


def test_a_token_outside_the_kept_set_is_reported_with_its_position():
    z = torch.tensor([[[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]]])
    y = torch.tensor([[0, 0]])  # the second is outside the top-2
    with pytest.raises(ValueError, match=r"1 sampled token\(s\) lie outside the kept set .*first at position \(0, 1\) \(id 0\)"):
        lk.token_logprobs(z, y, sampling=lk.Sampling(top_k=2))
    zg = z.clone().requires_grad_()
    lp = processed(zg, y, top_k=2, outside="-inf").logprobs
    assert lp[0, 1] == float("-inf") and torch.isfinite(lp[0, 0])
    lp[0, 0].backward()  # the -inf token has no gradient path: a constant
    assert (zg.grad[0, 1] == 0).all()


def test_truncation_is_refused_on_a_vocabulary_split_and_the_temperature_alone_is_not():
    # the vocabulary-parallel path has no kept set across shards: top-k / top-p / min-p must not be
    # silently ignored there (the result would be the untruncated log-probs)
    logits, head = torch.randn(2, 3, 5), torch.randn(5, 4)
    tokens = torch.randint(0, 5, (2, 3))
    for kwargs in ({"top_k": 2}, {"top_p": 0.5}, {"min_p": 0.1}):
        with pytest.raises(ValueError, match="not supported on logits or heads split over the vocabulary"):
            lk.token_logprobs(lk.VocabShard(logits, None, 0), tokens, sampling=lk.Sampling(**kwargs))
        with pytest.raises(ValueError, match="not supported on logits or heads split over the vocabulary"):
            logprobs_from_hidden(torch.randn(2, 3, 4), lk.VocabShard(head, None, 0), tokens, **kwargs)
        with pytest.raises(ValueError, match="not supported on logits or heads split over the vocabulary"):
            lk.token_entropy(lk.VocabShard(logits, None, 0), sampling=lk.Sampling(**kwargs))
        with pytest.raises(ValueError, match="not supported on logits or heads split over the vocabulary"):
            lk.full_kl(lk.VocabShard(logits, None, 0), lk.VocabShard(logits, None, 0), sampling=lk.Sampling(**kwargs))


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_bad_chunk_size_is_refused_by_every_processed_function(bad):
    z, w = torch.randn(2, 3, 5), torch.randn(5, 4)
    tokens = z.argmax(-1)
    calls = [
        lambda: processed(z, tokens, top_k=2, chunk_size=bad),
        lambda: processed_from_hidden(torch.randn(2, 3, 4), w, tokens, top_k=2, chunk_size=bad),
        lambda: processed_kl(z, z.flip(-1), top_k=2, chunk_size=bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=rf"`chunk_size` must be a positive integer or None, got {bad!r}"):
            call()
