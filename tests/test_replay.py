"""Replay of a rollout's kept set: ``lk.token_logprobs(..., return_kept=True)`` records, ``kept=`` replays.

Against: today's processed log-probs (on-policy: the same bits, value and gradient), float64 maths written
from the formula ``log p~_y = z_y / T - lse_{j in K} z_j / T`` with the gradient
``([j = y] - [j in K] p~_j) / T`` (off-policy), the processing's own kept set (``process_scores``), records
built by hand (ties at the boundary, malformed records), and a plain PPO loop with the library's estimators.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.ground.kept import KeptSets
from lightning_kl.ground.sampler import process_scores

SAMPLERS = [
    dict(top_k=5),
    dict(top_p=0.8),
    dict(top_p=1e-6),  # only the most likely token
    dict(top_p=0.0),
    dict(min_p=0.1),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.3, top_k=8, top_p=0.9, min_p=0.02),
    dict(temperature=0.05, top_k=3),  # near greedy: exact at every temperature
]
IDS = ["top_k", "top_p", "top_p_tiny", "top_p_0", "min_p", "T+p", "T+k+p+min_p", "T_small+k"]
B, L, V, D = 3, 9, 41, 6


def rollout(z: torch.Tensor, s: lk.Sampling, seed: int = 0) -> torch.Tensor:
    """Tokens drawn from the processed distribution of ``z`` (as generate draws)."""
    scores = process_scores(z.double() / s.temperature, s)
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(scores.reshape(-1, scores.shape[-1]), -1)
    return torch.multinomial(probs, 1, generator=g).view(z.shape[:-1])


def formula(z: torch.Tensor, y: torch.Tensor, keep: torch.Tensor, temperature: float) -> torch.Tensor:
    """float64 ``log p~_y`` on a fixed kept set ``keep``."""
    zt = z.double() / temperature
    return zt.gather(-1, y[..., None]).squeeze(-1) - torch.logsumexp(zt.masked_fill(~keep, float("-inf")), -1)


def formula_grad(z: torch.Tensor, y: torch.Tensor, keep: torch.Tensor, temperature: float, g: torch.Tensor) -> torch.Tensor:
    """The gradient written out: ``g * ([j = y] - [j in K] p~_j) / T``, in float64."""
    p = torch.softmax((z.double() / temperature).masked_fill(~keep, float("-inf")), -1)
    onehot = torch.nn.functional.one_hot(y, z.shape[-1]).double()
    return g.double()[..., None] * (onehot - p * keep) / temperature


def logits(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(B, L, V, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


# ---------------------------------------------------------------------------------------------
# recording


@pytest.mark.parametrize("kw", SAMPLERS, ids=IDS)
def test_the_record_is_the_processings_kept_set_with_empty_sets_at_ignored_positions(kw):
    s = lk.Sampling(**kw)
    z = logits()
    y = rollout(z, s)
    y[0, -3:] = -100
    lp, kept = lk.token_logprobs(z, y, sampling=s, ignore_index=-100, return_kept=True)
    assert isinstance(kept, KeptSets) and kept.shape == y.shape and kept.vocab == V
    want = process_scores(z / s.temperature, s) > float("-inf")
    want[0, -3:] = False
    assert torch.equal(kept.to_mask(), want)
    assert kept.nbytes() == 4 * int(want.sum()) + 8 * (y.numel() + 1)
    # several chunks and a non-contiguous layout record the same sets
    _, again = lk.token_logprobs(z.transpose(0, 1), y.T, sampling=s, ignore_index=-100, return_kept=True, chunk_size=2)
    assert torch.equal(again.to_mask(), want.transpose(0, 1))


def test_without_truncation_there_is_nothing_to_record():
    z, s = logits(), lk.Sampling(0.7, top_p=1.0)  # top_p=1 keeps every token: no truncation
    y = rollout(z, s)
    lp, kept = lk.token_logprobs(z, y, sampling=s, return_kept=True)
    assert kept is None
    assert torch.equal(lp, lk.token_logprobs(z, y, sampling=s, kept=kept))
    lp2, log_kept, kept2 = lk.token_logprobs(z, y, sampling=lk.Sampling(top_k=3), return_log_kept=True, return_kept=True, outside="-inf")
    assert log_kept.shape == y.shape and kept2.sizes().eq(3).all()


# ---------------------------------------------------------------------------------------------
# on-policy: replay is today's processed log-prob, the same bits (the same ops on the same numbers)


@pytest.mark.parametrize("kw", SAMPLERS, ids=IDS)
@pytest.mark.parametrize("source", ["logits", "strided", "chunks", "bf16", "float64", "hidden", "softcap"])
def test_on_policy_replay_is_the_processed_logprob_bitwise_value_and_gradient(kw, source):
    s = lk.Sampling(**kw)
    g = torch.Generator().manual_seed(1)
    chunk = 2 if source == "chunks" else None
    if source in ("hidden", "softcap"):
        h = torch.randn(B, L, D, generator=g)
        w = torch.randn(V, D, generator=g) * 2
        b = torch.randn(V, generator=g)
        cap = dict(softcap=4.0, logit_scale=1.5) if source == "softcap" else {}

        def make():
            leaves = [h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
            return leaves, lk.FromHidden(*leaves, **cap)

        with torch.no_grad():
            z = make()[1]
            zz = z.hidden @ z.weight.T + z.bias
            zz = 4.0 * torch.tanh(1.5 * zz / 4.0) if cap else zz
    else:
        dtype = {"bf16": torch.bfloat16, "float64": torch.float64}.get(source, torch.float32)
        base = logits(1, dtype)
        if source == "strided":  # logits[:, :-1] of a [L + 1, B, V] buffer: read in place, not viewable flat
            base = torch.cat([base, base[:, :1]], 1).transpose(0, 1).contiguous().transpose(0, 1)

        def make():
            leaf = base.clone().requires_grad_()
            return [leaf], (leaf[:, :-1] if source == "strided" else leaf)

        zz = (base[:, :-1] if source == "strided" else base).float()
    y = rollout(zz, s, seed=2)
    y[1, 0] = -100
    gout = torch.randn(B, L, generator=g)
    leaves1, x1 = make()
    lp, log_kept, kept = lk.token_logprobs(x1, y, sampling=s, ignore_index=-100, return_log_kept=True, return_kept=True, chunk_size=chunk)
    (lp * gout).sum().backward()
    leaves2, x2 = make()
    lp2, log_kept2 = lk.token_logprobs(x2, y, sampling=s, ignore_index=-100, return_log_kept=True, kept=kept, chunk_size=chunk)
    (lp2 * gout).sum().backward()
    assert torch.equal(lp2, lp)
    for a, b in zip(leaves1, leaves2):
        assert torch.equal(a.grad, b.grad)
    # log S: the kept mass through logsumexp instead of log(sum(exp)): equal to rounding
    assert_close(log_kept2, log_kept, rtol=0, atol=1e-5 if lp.dtype == torch.float32 else 1e-12)


# ---------------------------------------------------------------------------------------------
# off-policy: finite for every sampled token, exact value and gradient against float64


@pytest.mark.parametrize("kw", SAMPLERS, ids=IDS)
def test_off_policy_replay_is_finite_and_exact_against_float64(kw):
    s = lk.Sampling(**kw)
    old = logits(3)
    y = rollout(old, s, seed=4)
    _, kept = lk.token_logprobs(old, y, sampling=s, return_kept=True)
    new = (old + 2.0 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5))).requires_grad_()
    # the policy moved: today's scorer finds tokens outside the new kept sets (where the sampler truncates to > 1)
    today = lk.token_logprobs(new.detach(), y, sampling=s, outside="-inf")
    if kept.sizes().gt(1).float().mean() > 0.5:
        assert (today == float("-inf")).any()
    lp = lk.token_logprobs(new, y, sampling=s, kept=kept)
    assert lp.isfinite().all()
    keep = kept.to_mask()
    assert_close(lp.double(), formula(new.detach(), y, keep, s.temperature), rtol=1e-6, atol=1e-5)
    gout = torch.randn(B, L, generator=torch.Generator().manual_seed(6))
    (lp * gout).sum().backward()
    assert_close(new.grad.double(), formula_grad(new.detach(), y, keep, s.temperature, gout), rtol=1e-5, atol=1e-6)
    # in float64 the same maths to float64 rounding
    new64 = new.detach().double().requires_grad_()
    lp64 = lk.token_logprobs(new64, y, sampling=s, kept=kept)
    (lp64 * gout.double()).sum().backward()
    assert_close(lp64, formula(new64.detach(), y, keep, s.temperature), rtol=0, atol=1e-12)
    assert_close(new64.grad, formula_grad(new64.detach(), y, keep, s.temperature, gout), rtol=0, atol=1e-12)


def test_off_policy_replay_from_a_head_has_exact_gradients_for_hidden_weight_and_bias():
    s = lk.Sampling(0.8, top_p=0.7)
    g = torch.Generator().manual_seed(7)
    h, w, b = torch.randn(B, L, D, generator=g), torch.randn(V, D, generator=g) * 2, torch.randn(V, generator=g)
    y = rollout(h @ w.T + b, s, seed=8)
    _, kept = lk.token_logprobs(lk.FromHidden(h, w, b), y, sampling=s, return_kept=True)
    w2 = w + torch.randn(V, D, generator=g)
    leaves = [t.double().requires_grad_() for t in (h, w2, b)]
    lp = lk.token_logprobs(lk.FromHidden(*leaves, softcap=5.0), y, sampling=s, kept=kept)
    assert lp.isfinite().all()
    lp.sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in leaves]
    z = 5.0 * torch.tanh((ref[0] @ ref[1].T + ref[2]) / 5.0)
    formula(z, y, kept.to_mask(), s.temperature).sum().backward()  # the selection is fixed: autograd of the formula
    for a, r in zip(leaves, ref):
        assert_close(a.grad, r.grad, rtol=0, atol=1e-11)


def test_a_recorded_set_that_leaves_out_the_current_top_is_exact_at_a_small_temperature():
    # off-policy the current argmax can lie outside the record: the shift is the largest recorded logit
    z = torch.tensor([[50.0, 1.0, 0.5, -3.0]], dtype=torch.float64, requires_grad=True)
    kept = KeptSets(torch.tensor([1, 2]), torch.tensor([0, 2]), (1,), 4)
    lp = lk.token_logprobs(z, torch.tensor([2]), sampling=lk.Sampling(0.01, top_k=1), kept=kept)
    lp.backward()
    keep = torch.tensor([[False, True, True, False]])
    assert_close(lp, formula(z.detach(), torch.tensor([2]), keep, 0.01), rtol=0, atol=1e-12)  # -50.0: finite
    assert_close(z.grad, formula_grad(z.detach(), torch.tensor([2]), keep, 0.01, torch.ones(1)), rtol=0, atol=1e-12)
    assert z.grad[0, 0] == 0 and z.grad[0, 3] == 0


# ---------------------------------------------------------------------------------------------
# ties at the boundary follow the record


def test_ties_at_the_boundary_follow_the_recorded_set_not_a_recomputed_one():
    # top-k 2 on [3, 1, 1, 0]: generate keeps both tied 1s (3 tokens); an engine that broke the tie kept {0, 1}
    z = torch.tensor([[3.0, 1.0, 1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    s = lk.Sampling(top_k=2)
    _, ours = lk.token_logprobs(z.detach(), torch.tensor([1]), sampling=s, return_kept=True)
    assert ours.to_mask().tolist() == [[True, True, True, False]]
    engine = KeptSets(torch.tensor([0, 1]), torch.tensor([0, 2]), (1,), 4)
    lp = lk.token_logprobs(z, torch.tensor([1]), sampling=s, kept=engine)
    keep = torch.tensor([[True, True, False, False]])
    assert_close(lp, formula(z.detach(), torch.tensor([1]), keep, 1.0), rtol=0, atol=1e-15)
    lp.backward()
    assert z.grad[0, 2] == 0 and z.grad[0, 3] == 0  # the tied token outside the record: no mass, no gradient
    # top-p splits tied scores by sort order: the record keeps exactly what the sampler kept
    zt = torch.tensor([[2.0, 1.0, 1.0, 1.0, -5.0]])
    s = lk.Sampling(top_p=0.75)
    _, rec = lk.token_logprobs(zt, torch.tensor([0]), sampling=s, return_kept=True)
    assert torch.equal(rec.to_mask(), process_scores(zt, s) > float("-inf"))
    assert torch.equal(lk.token_logprobs(zt, torch.tensor([0]), sampling=s, kept=rec), lk.token_logprobs(zt, torch.tensor([0]), sampling=s))


# ---------------------------------------------------------------------------------------------
# records from elsewhere: the plain pair, masks, generate's scores, mini-batches


def test_an_engines_pair_a_mask_and_a_mini_batch_of_the_record_replay_alike():
    s = lk.Sampling(0.9, top_p=0.85)
    z = logits(9)
    y = rollout(z, s, seed=10)
    lp, kept = lk.token_logprobs(z, y, sampling=s, return_kept=True)
    assert torch.equal(lk.token_logprobs(z, y, sampling=s, kept=(kept.ids.long(), kept.offsets)), lp)
    assert torch.equal(lk.token_logprobs(z, y, sampling=s, kept=kept.to("cpu")), lp)
    import copy
    import pickle

    assert torch.equal(lk.token_logprobs(z, y, sampling=s, kept=pickle.loads(pickle.dumps(kept))), lp)  # a replay buffer's copy
    assert torch.equal(lk.token_logprobs(z, y, sampling=s, kept=copy.deepcopy(kept)), lp)
    again, same = lk.token_logprobs(z, y, sampling=s, kept=kept, return_kept=True)  # a replay returns its record
    assert same is kept and torch.equal(again, lp)
    assert torch.equal(lk.token_logprobs(z, y, sampling=s, kept=KeptSets.from_mask(kept.to_mask())), lp)
    rows = torch.tensor([2, 0])
    assert torch.equal(lk.token_logprobs(z[rows], y[rows], sampling=s, kept=kept[rows]), lp[rows])
    assert torch.equal(lk.token_logprobs(z[:, 2:7], y[:, 2:7], sampling=s, kept=kept[:, 2:7]), lp[:, 2:7])
    assert torch.equal(KeptSets.from_scores(list(process_scores(z / 0.9, s).unbind(1))).to_mask(), kept.to_mask())


# ---------------------------------------------------------------------------------------------
# bad records fail with the position named


def test_bad_records_fail_naming_the_position():
    ids, off = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 4])
    KeptSets(ids, off, (3,), 4)
    with pytest.raises(ValueError, match=r"id 7 at position \(1, 0\) is out of range for a vocabulary of V=4"):
        KeptSets(torch.tensor([0, 7, 2, 3]), off, (3, 1), 4)
    with pytest.raises(ValueError, match=r"id -1 at position \(2,\)"):
        KeptSets(torch.tensor([0, 1, 2, -1]), off, (3,), 4)
    with pytest.raises(ValueError, match=r"n \+ 1 = 4 entries for 3 positions"):
        KeptSets(ids, torch.tensor([0, 4]), (3,), 4)
    with pytest.raises(ValueError, match=r"decrease at position \(1,\) \(3 then 2\)"):
        KeptSets(ids, torch.tensor([0, 3, 2, 4]), (3,), 4)
    with pytest.raises(ValueError, match="must start at 0"):
        KeptSets(ids, torch.tensor([1, 1, 2, 4]), (3,), 4)
    with pytest.raises(ValueError, match="must end at the number of ids, 4, got 3"):
        KeptSets(ids, torch.tensor([0, 1, 2, 3]), (3,), 4)
    with pytest.raises(TypeError, match="`ids` must be an integer tensor"):
        KeptSets(ids.float(), off, (3,), 4)
    with pytest.raises(ValueError, match="`vocab` must be an integer >= 1"):
        KeptSets(ids, off, (3,), 0)
    z = torch.randn(2, 3, 4)
    y = torch.tensor([[0, 1, 2], [3, 0, 1]])
    good = KeptSets.from_mask(torch.ones(2, 3, 4, dtype=torch.bool))
    s = lk.Sampling(top_k=2)
    with pytest.raises(ValueError, match=r"positions of shape \(2, 3\), but the tokens have shape \(3, 2\)"):
        lk.token_logprobs(z.transpose(0, 1), y.T, sampling=s, kept=good)
    with pytest.raises(ValueError, match="recorded over a vocabulary of V=4, but the logits have V=5"):
        lk.token_logprobs(torch.randn(2, 3, 5), y, sampling=s, kept=good)
    with pytest.raises(TypeError, match=r"`kept` must be the kept sets .* got Tensor"):
        lk.token_logprobs(z, y, sampling=s, kept=torch.ones(2, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"`kept` \(replay\) and `kept_from` choose the kept set each: pass one"):
        lk.token_logprobs(z, y, sampling=s, kept=good, kept_from=z)
    # a record made at one temperature replayed at another: refused (an engine's record without one: not checked)
    _, at07 = lk.token_logprobs(z, y, sampling=lk.Sampling(0.7, top_k=2), return_kept=True, outside="-inf")
    assert at07.temperature == 0.7 and at07[:1].temperature == 0.7 and at07.to("cpu").temperature == 0.7
    with pytest.raises(ValueError, match="recorded by a sampler at temperature 0.7, but it is replayed at 1.0"):
        lk.token_logprobs(z, y.masked_fill(~at07.to_mask().gather(-1, y[..., None])[..., 0], -100), sampling=s, ignore_index=-100, kept=at07)
    with pytest.raises(ValueError, match="`temperature` must be a finite number > 0"):
        KeptSets(ids, off, (3,), 4, temperature=0.0)
    # a sampled token missing from its own set: position and id named, whatever `outside` says
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    mask[1, 2, 1] = False
    for outside in ("raise", "-inf"):
        with pytest.raises(ValueError, match=r"1 sampled token\(s\) are not in their own recorded kept set .* position \(1, 2\) \(id 1\)"):
            lk.token_logprobs(z, y, sampling=s, kept=KeptSets.from_mask(mask), outside=outside)
    # ... but an ignored position may hold any set, the empty one included
    mask[1, 2] = False
    lp = lk.token_logprobs(z, y.masked_fill(torch.tensor([[False] * 3, [False, False, True]]), -100), sampling=s,
                           ignore_index=-100, kept=KeptSets.from_mask(mask))
    assert lp[1, 2] == 0 and lp.isfinite().all()


# ---------------------------------------------------------------------------------------------
# the PPO ratio and the sampled KL estimators from replayed log-probs, in a plain loop


def test_ppo_epochs_on_replayed_logprobs_stay_finite_where_todays_scorer_raises():
    torch.manual_seed(11)
    s = lk.Sampling(0.8, top_p=0.7)
    policy = torch.nn.Linear(D, V)
    ref = torch.nn.Linear(D, V)
    ref.load_state_dict(policy.state_dict())
    with torch.no_grad():
        policy.weight.mul_(4)
        ref.weight.mul_(4)
    h = torch.randn(B * 4, L, D)
    with torch.no_grad():
        y = rollout(policy(h), s, seed=12)
        old, kept = lk.token_logprobs(policy(h), y, sampling=s, return_kept=True)
        ref_lp = lk.token_logprobs(ref(h), y, sampling=s, kept=kept)
    mask = torch.ones(y.shape, dtype=torch.bool)
    adv = torch.randn(y.shape[0], 1).expand(y.shape)
    kl_loss = lk.KLPenaltyLoss("k3", coef=0.1)
    correction = lk.RolloutCorrection("token", upper=2.0, bypass=True)  # the engine's log-probs: the rollout's replayed ones
    opt = torch.optim.SGD(policy.parameters(), lr=2.0)
    raised = False
    for epoch in range(4):
        for mb in (slice(0, 6), slice(6, 12)):  # mini-batches: kept[mb] replays their rows
            z = policy(h[mb])
            lp = lk.token_logprobs(z, y[mb], sampling=s, kept=kept[mb])
            assert lp.isfinite().all()
            try:
                lk.token_logprobs(z.detach(), y[mb], sampling=s)
            except ValueError as err:
                raised = True
                assert "outside the kept set" in str(err)
            fixed = correction(lp, old[mb], mask[mb])
            assert fixed.weights.isfinite().all() and fixed.mask.all()
            ratio = torch.exp(lp - fixed.old_logprob)
            if epoch == 0 and mb.start == 0:
                assert torch.equal(ratio, torch.ones_like(ratio))  # on-policy: exactly 1
            pg = -(fixed.weights * torch.min(ratio * adv[mb], ratio.clamp(0.8, 1.2) * adv[mb]))[mask[mb]].mean()
            kl = kl_loss(lp, ref_lp[mb], mask[mb], old[mb])  # importance-weighted by the replayed ratio
            assert kl.isfinite()
            opt.zero_grad()
            (pg + kl).backward()
            assert all(p.grad.isfinite().all() for p in policy.parameters())
            opt.step()
    assert raised  # the policy moved: some sampled token left its current nucleus
    # the sequence-level k3 from the same replayed log-probs
    with torch.no_grad():
        lp = lk.token_logprobs(policy(h), y, sampling=s, kept=kept)
    seq = lk.KLPenaltyLoss("k3", coef=1.0, level="sequence", agg="seq-mean-token-sum")(lp, ref_lp, mask)
    assert seq.isfinite()


# ---------------------------------------------------------------------------------------------
# Hugging Face: generate's own record, response_logprobs' record and replay


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("transformers")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "hf_grpo.py"
    spec = importlib.util.spec_from_file_location("hf_grpo_for_replay", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    torch.manual_seed(0)
    model = ex.build_model("qwen2", 16, 1, 2, 1, 32, 32).eval()
    with torch.no_grad():  # peakier logits than the default init, so that truncation bites
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(6)
    enc = ex.build_tokenizer()([ex.prompt_text(a, b) for a, b in [(3, 4), (12, 1), (7, 7), (0, 9)]], return_tensors="pt", padding=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ex, model, enc
    torch.set_num_threads(threads)


def test_hf_generates_record_and_response_logprobs_record_replay_on_and_off_policy(tiny):
    ex, model, enc = tiny
    s = lk.Sampling(0.9, top_p=0.8)
    torch.manual_seed(3)
    out = model.generate(**enc, max_new_tokens=6, pad_token_id=ex.PAD_ID, eos_token_id=ex.EOS_ID,
                         output_scores=True, return_dict_in_generate=True, **s.generate_kwargs(model))
    p = enc["input_ids"].shape[1]
    seq = out.sequences
    mask = lk.hf.response_mask(seq[:, p:], ex.EOS_ID)
    am, _ = lk.hf.sequence_inputs(enc["attention_mask"], mask)
    engine = KeptSets.from_scores(out.scores)  # what generate's sampler kept, position by position
    with torch.no_grad():
        lp, logits, kept = lk.hf.response_logprobs(model, seq, am, p, sampling=s, return_logits=True, return_kept=True)
        assert torch.equal(kept.to_mask()[mask], engine.to_mask()[mask])
        assert (kept.sizes()[~mask] == 0).all()  # after EOS: not sampled, nothing recorded
        assert torch.equal(lk.hf.response_logprobs(model, seq, am, p, sampling=s, kept=kept), lp)
        replayed = lk.hf.response_logprobs(model, seq, am, p, sampling=s, kept=engine)
        assert_close(replayed, lp, rtol=0, atol=1e-5)
        assert (replayed[~mask] == 0).all()
        moved = {n: t + 2.0 * torch.randn_like(t) for n, t in model.state_dict().items() if t.dim() > 1}
        old = {n: model.state_dict()[n].clone() for n in moved}
        model.load_state_dict(moved, strict=False)
        try:
            off = lk.hf.response_logprobs(model, seq, am, p, sampling=s, kept=kept)
            today = lk.hf.response_logprobs(model, seq, am, p, sampling=s, outside="-inf")
        finally:
            model.load_state_dict(old, strict=False)
    assert off.isfinite().all() and (today[mask] == float("-inf")).any()


# ---------------------------------------------------------------------------------------------
# the entropy on the recorded sets


@pytest.mark.parametrize("kw", SAMPLERS[:3] + SAMPLERS[5:], ids=IDS[:3] + IDS[5:])
def test_the_entropy_replays_bitwise_on_policy_and_exactly_off_policy(kw):
    s = lk.Sampling(**kw)
    z = logits(12)
    y = rollout(z, s, seed=13)
    _, kept = lk.token_logprobs(z, y, sampling=s, return_kept=True)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[2, 4:] = False
    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    h1, h2 = lk.token_entropy(a, mask, sampling=s), lk.token_entropy(b, mask, sampling=s, kept=kept)
    gout = torch.randn(B, L, generator=torch.Generator().manual_seed(14))
    (h1 * gout).sum().backward()
    (h2 * gout).sum().backward()
    assert torch.equal(h1, h2) and torch.equal(a.grad, b.grad)
    # off-policy: -sum p~ log p~ on the record, and its gradient, against float64 autograd of the formula
    new = (z + torch.randn(z.shape, generator=torch.Generator().manual_seed(15))).double().requires_grad_()
    lp, h = lk.token_logprobs_and_entropy(new, y, sampling=s, kept=kept)
    assert torch.equal(lp, lk.token_logprobs(new, y, sampling=s, kept=kept)) and torch.equal(h, lk.token_entropy(new, sampling=s, kept=kept))
    (lp.sum() + (h * gout).sum()).backward()
    ref = new.detach().clone().requires_grad_()
    logp = torch.log_softmax((ref / s.temperature).masked_fill(~kept.to_mask(), float("-inf")), -1)
    want_h = -(logp.exp() * logp.masked_fill(~kept.to_mask(), 0)).sum(-1)
    (logp.gather(-1, y[..., None]).sum() + (want_h * gout.double()).sum()).backward()
    assert_close(h, want_h.detach(), rtol=0, atol=1e-12)
    assert_close(new.grad, ref.grad, rtol=0, atol=1e-12)
    empty = kept.to_mask()
    empty[1, 3] = False
    with pytest.raises(ValueError, match=r"empty set at position \(1, 3\)"):
        lk.token_entropy(z, sampling=s, kept=KeptSets.from_mask(empty))
    h = lk.token_entropy(z, mask & (torch.arange(L) != 3), sampling=s, kept=KeptSets.from_mask(empty))
    assert h[1, 3] == 0 and h.isfinite().all()


def test_the_study_script_is_exact_on_policy():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "replay_study.py"
    spec = importlib.util.spec_from_file_location("replay_study", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    r = study.study(0.9, 1.0, 0.0, 20, 16, 2.0, 0)
    assert r["replay_bias"] == 0 and r["replay_off"] == 0 and r["dropped"] == 0
    # temperature-only scoring is off by the log of the kept mass, log S, on-policy: E_mu[log S]
    g = torch.Generator().manual_seed(0)
    old = torch.randn(20, 16, generator=g, dtype=torch.float64) * 2.0
    s = lk.Sampling(1.0, top_p=0.9)
    keep = process_scores(old, s) > float("-inf")
    log_s = torch.logsumexp(old.masked_fill(~keep, float("-inf")), -1) - torch.logsumexp(old, -1)
    assert abs(r["temp_bias"] - float(log_s.mean())) < 1e-12  # each context's weights sum to 1
    moved = study.study(0.9, 1.0, 0.3, 20, 16, 2.0, 0)
    assert moved["dropped"] > 0


# ---------------------------------------------------------------------------------------------
# replay reads nothing on the host (as on a GPU): the same values and gradients as the host form


def test_replay_reads_nothing_on_the_host_and_a_missing_token_still_fails(monkeypatch):
    from test_no_host_sync import device_form

    s = lk.Sampling(0.8, top_p=0.8)
    z = logits(16)
    y = rollout(z, s, seed=17)
    y[0, 0] = -100
    _, kept = lk.token_logprobs(z, y, sampling=s, ignore_index=-100, return_kept=True)
    new = z + torch.randn(z.shape, generator=torch.Generator().manual_seed(18))
    a, b = new.clone().requires_grad_(), new.clone().requires_grad_()
    want = lk.token_logprobs(a, y, sampling=s, ignore_index=-100, kept=kept, chunk_size=4)
    want.sum().backward()
    bad = kept.to_mask()
    bad[1, 2, y[1, 2]] = False
    bad = KeptSets.from_mask(bad)
    with device_form(monkeypatch):
        got = lk.token_logprobs(b, y, sampling=s, ignore_index=-100, kept=kept, chunk_size=4)
        got.sum().backward()
        with pytest.raises(RuntimeError, match="must lie in its own recorded kept set"):
            lk.token_logprobs(new, y, sampling=s, ignore_index=-100, kept=bad)
    assert torch.equal(got, want) and torch.equal(b.grad, a.grad)


# ---------------------------------------------------------------------------------------------
# vocabulary shards: 2 gloo processes against one process on the whole logits


def test_replay_on_vocabulary_shards_equals_one_process(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    worker = Path(__file__).resolve().parent / "_replay_shard_worker.py"
    try:
        proc = subprocess.run([sys.executable, str(worker), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the 2-process replay run did not finish in {err.timeout} s:\n{err.stderr}")
    for rank in range(2):
        path = tmp_path / f"rank{rank}.json"
        assert proc.returncode == 0 and path.exists(), f"worker failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
        record = json.loads(path.read_text())
        assert "failure" not in record, record["failure"]
        errors = record["errors"]
        # 3 splits (6 + 5, 3 + 8, 11 + 0) x (log-prob, log S, gradient, entropy), a column-parallel head x 3, finiteness;
        # full_kl: 3 divergences x 3 splits x (value, both gradients), the loss, both models' column-parallel heads x 3
        assert len(errors) == 16 + 27 + 1 + 3
        assert all(v <= 1e-12 for v in errors.values()), errors
        assert "reference='processed' with `kept` (replay)" in record["raised"]["processed"]
        assert "not in their own recorded kept set" in record["raised"]["missing"] and "position (1, 4)" in record["raised"]["missing"]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft on transformers 5
def test_hf_reference_replays_the_rollouts_record_as_kept_from_does_on_policy(tiny):
    peft = pytest.importorskip("peft")
    import copy

    ex, model, enc = tiny
    policy = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(2)
    with torch.no_grad():  # adapters that change the model
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)
    policy.eval()
    s = lk.Sampling(top_p=0.8)
    torch.manual_seed(3)
    seq = policy.generate(**enc, max_new_tokens=4, pad_token_id=ex.PAD_ID, eos_token_id=ex.EOS_ID, **s.generate_kwargs(policy))
    p = enc["input_ids"].shape[1]
    mask = lk.hf.response_mask(seq[:, p:], ex.EOS_ID)
    am, _ = lk.hf.sequence_inputs(enc["attention_mask"], mask)
    with torch.no_grad():
        _, logits, kept = lk.hf.response_logprobs(policy, seq, am, p, sampling=s, return_logits=True, return_kept=True)
    got = lk.hf.reference_logprobs(policy, seq, am, p, sampling=s, kept=kept)
    assert torch.equal(got, lk.hf.reference_logprobs(policy, seq, am, p, sampling=s, kept_from=logits))
    assert got.isfinite().all() and (got[~mask] == 0).all()
    # without a record or kept_from: the reference's softmax at the sampler's temperature, another number
    assert not torch.equal(got, lk.hf.reference_logprobs(policy, seq, am, p, sampling=s))
