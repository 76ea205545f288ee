"""The second hour's silent mistakes: each is now an error or a one-time warning, with no host read per step
on an accelerator (the check runs on the device, or once).

| mistake | now |
|---|---|
| logits gathered at the tokens passed as log-probs | ``ValueError`` (CPU), a device-side assert elsewhere |
| reference scored at another temperature than the policy | not visible in log-probs: ``sampling=`` goes to ``"full"`` only (it applies it to both models); a sampled estimator with a sampler is refused, and the docs say both log-probs come from one ``Sampling`` |
| ``old_logprob`` that requires grad | detached, with a warning at the user's line |
| explicit ``agg="token-mean"`` at ``level="sequence"`` with lengths that vary | a warning, once |
| ``"full"`` given ``[b, t]`` log-probs and no mask | ``ValueError`` |
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.functional import DEFAULT_LOGPROB_SLACK, LOGPROB_SLACK
from lightning_kl.ground import checks

F64 = torch.float64


def _batch(seed: int = 0, b: int = 4, t: int = 6, v: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g)
    ref_logits = logits + 0.5 * torch.randn(b, t, v, generator=g)
    tokens = torch.randint(0, v, (b, t), generator=g)
    return {"logits": logits, "ref_logits": ref_logits, "tokens": tokens}


# ---------------------------------------------------------------------------------------------
# gathered logits where log-probs belong


@pytest.mark.parametrize("which", ["policy", "both"])
def test_gathered_logits_passed_as_log_probs_are_refused(which: str) -> None:
    data = _batch()
    gathered = data["logits"].gather(-1, data["tokens"].unsqueeze(-1)).squeeze(-1)
    ref_gathered = data["ref_logits"].gather(-1, data["tokens"].unsqueeze(-1)).squeeze(-1)
    ref_lp = lk.token_logprobs(data["ref_logits"], data["tokens"])
    ref = ref_gathered if which == "both" else ref_lp
    mask = torch.ones(4, 6, dtype=torch.bool)
    match = r"`logprob` must hold log-probabilities \(<= 0\): logits gathered at the tokens are not log-probs.*Got \d"
    with pytest.raises(ValueError, match=match):
        lk.kl_penalty(gathered, ref, "k3+", mask=mask)
    with pytest.raises(ValueError, match=match):
        lk.KLPenaltyLoss("k3+")(gathered, ref, mask)
    # the reference alone, and old_logprob, are checked the same way
    lp = lk.token_logprobs(data["logits"], data["tokens"])
    with pytest.raises(ValueError, match=r"`ref_logprob` must hold log-probabilities"):
        lk.kl_penalty(lp, ref_gathered, "k3+", mask=mask)
    with pytest.raises(ValueError, match=r"`old_logprob` must hold log-probabilities"):
        lk.kl_penalty(lp, ref_lp, "k3", mask=mask, old_logprob=gathered)
    # log-softmax outputs pass
    lk.KLPenaltyLoss("k3+")(lp, ref_lp, mask)


def test_the_log_prob_check_is_at_its_threshold_and_ignores_padding() -> None:
    for dtype in (torch.float32, F64, torch.bfloat16, torch.float16):
        slack = LOGPROB_SLACK.get(dtype, DEFAULT_LOGPROB_SLACK)
        at = torch.tensor([[-1.0, slack]], dtype=dtype)  # the slack itself, in the dtype (compared in the dtype)
        lk.kl_penalty(at, torch.full_like(at, -1.0), "k1")  # rounding of a log-softmax near 0: accepted
        above = torch.tensor([[-1.0, slack * 1.05]], dtype=dtype)
        assert above[0, 1] > at[0, 1]
        with pytest.raises(ValueError, match="must hold log-probabilities"):
            lk.kl_penalty(above, torch.full_like(above, -1.0), "k1")
    # a positive number at a masked position is padding: never read
    lp = torch.tensor([[-1.0, 5.0, float("nan")]])
    mask = torch.tensor([[True, False, False]])
    lk.KLPenaltyLoss("k1")(lp, lp.clone(), mask)
    # NaN and -inf at valid positions are not this check's business (they poison the loss, as documented)
    assert torch.isnan(lk.kl_penalty(torch.tensor([float("nan")]), torch.tensor([-1.0]), "k1")).all()
    # ...but a NaN does not hide a positive value at another valid position (the CPU's one-pass max is NaN there)
    with pytest.raises(ValueError, match="must hold log-probabilities"):
        lk.kl_penalty(torch.tensor([float("nan"), 0.5, -1.0]), torch.full((3,), -1.0), "k1")


def test_the_log_prob_check_runs_on_the_device_off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # the accelerator form (no host read): a device-side assertion, run here on the CPU
    monkeypatch.setattr(checks, "HOST_READ_DEVICES", frozenset())
    with pytest.raises(RuntimeError, match="must hold log-probabilities"):
        lk.kl_penalty(torch.tensor([[0.5, -1.0]]), torch.tensor([[-1.0, -1.0]]), "k3+")
    lk.kl_penalty(torch.tensor([[-0.5, -1.0]]), torch.tensor([[-1.0, -1.0]]), "k3+")


def test_full_at_the_sequence_level_checks_its_sampled_log_prob() -> None:
    data = _batch()
    mask = torch.ones(4, 6, dtype=torch.bool)
    gathered = data["logits"].gather(-1, data["tokens"].unsqueeze(-1)).squeeze(-1)
    with pytest.raises(ValueError, match="`sampled_logprob` must hold log-probabilities"):
        lk.KLPenaltyLoss("full", agg="token-sum", level="sequence")(data["logits"], data["ref_logits"], mask, sampled_logprob=gathered)


# ---------------------------------------------------------------------------------------------
# "full" given [b, t] log-probs and no mask


def test_full_given_b_t_log_probs_and_no_mask_is_refused() -> None:
    data = _batch()
    lp = lk.token_logprobs(data["logits"], data["tokens"])
    ref = lk.token_logprobs(data["ref_logits"], data["tokens"])
    match = r"'full' takes the logits of every position `\[b, t, V\]` and a mask `\[b, t\]`; got logits \(4, 6\) and no mask"
    with pytest.raises(ValueError, match=match):
        lk.kl_penalty(lp, ref, "full")
    with pytest.raises(ValueError, match=match):
        lk.KLPenaltyLoss("full")(lp, ref)
    # with the mask the shapes say it (the mask would be [4]); [b, t, V] logits need no mask
    with pytest.raises(ValueError, match=r"expected mask \(4,\)"):
        lk.KLPenaltyLoss("full")(lp, ref, torch.ones(4, 6, dtype=torch.bool))
    lk.kl_penalty(data["logits"], data["ref_logits"], "full")
    # flat rows [n, V] with a mask are fine
    lk.kl_penalty(data["logits"][0], data["ref_logits"][0], "full", mask=torch.ones(6, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------
# old_logprob that requires grad


def test_an_old_logprob_that_requires_grad_is_detached_with_a_warning() -> None:
    g = torch.Generator().manual_seed(2)
    base = -torch.rand(3, 5, generator=g, dtype=F64) * 2
    ref = -torch.rand(3, 5, generator=g, dtype=F64) * 2
    mask = torch.rand(3, 5, generator=g) > 0.2
    for call in (
        lambda lp, old: lk.kl_penalty(lp, ref, "k3", mask=mask, old_logprob=old).sum(),
        lambda lp, old: lk.KLPenaltyLoss("k3", coef=1.0, agg="token-sum")(lp, ref, mask, old_logprob=old),
        lambda lp, old: lk.KLPenaltyLoss("k3", coef=1.0, agg="token-sum", level="sequence")(lp, ref, mask, old_logprob=old),
    ):
        lp = base.clone().requires_grad_()
        with pytest.warns(UserWarning, match=r"`old_logprob` requires grad.*It is detached here") as record:
            loss = call(lp, lp * 1.0)  # the usual slip: the policy's own log-probs, graph and all
        assert record[0].filename == __file__
        (got,) = torch.autograd.grad(loss, lp)
        lp2 = base.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            (want,) = torch.autograd.grad(call(lp2, lp2.detach()), lp2)
        assert_close(got, want, rtol=0, atol=0)  # exactly the gradient with old_logprob detached
    lp = base.clone().requires_grad_()
    d = torch.where(mask, base - ref, 0.0)
    with pytest.warns(UserWarning, match="`old_logprob` requires grad"):
        (got,) = torch.autograd.grad(lk.kl_penalty(lp, ref, "k3", mask=mask, old_logprob=lp * 1.0).sum(), lp)
    assert_close(got, d, rtol=1e-12, atol=1e-12)  # w d with w = 1: the formula


# ---------------------------------------------------------------------------------------------
# an explicit token-mean at the sequence level


def test_an_explicit_token_mean_at_the_sequence_level_warns_once_when_lengths_vary() -> None:
    lp = -torch.rand(2, 4)
    ragged = torch.tensor([[True, True, False, False], [True, True, True, True]])
    even = torch.tensor([[True, True, True, False], [True, True, True, False]])
    loss = lk.KLPenaltyLoss("k3+", agg="token-mean", level="sequence")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss(lp, lp - 0.1, even)  # one length: exact
        loss(lp, lp - 0.1, ragged, num_tokens=6, accumulate_grad_batches=1)  # a fixed divisor: exact
    with pytest.warns(UserWarning, match=r"level='sequence', agg='token-mean'\) got responses of different lengths") as record:
        loss(lp, lp - 0.1, ragged)
        loss(lp, lp - 0.1, ragged)
    assert sum("different lengths" in str(w.message) for w in record) == 1
    # the token level, and the other modes, never warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lk.KLPenaltyLoss("k3+", agg="token-mean")(lp, lp - 0.1, ragged)
        lk.KLPenaltyLoss("k3+", agg="seq-mean-token-sum", level="sequence")(lp, lp - 0.1, ragged)
    # without agg the constructor warned already: not twice
    with pytest.warns(UserWarning, match="without `agg`") as record:
        lk.KLPenaltyLoss("k3+", level="sequence")(lp, lp - 0.1, ragged)
    assert not any("different lengths" in str(w.message) for w in record)


# ---------------------------------------------------------------------------------------------
# the reference at another temperature


def test_the_sampler_goes_to_full_which_applies_it_to_both_models() -> None:
    # a sampled estimator cannot see at which temperature each log-prob was scored: it refuses a
    # sampler (the docs: both models' log-probs from the same lk.Sampling); "full" applies it to both
    data = _batch()
    sampling = lk.Sampling(temperature=0.7)
    with pytest.raises(ValueError, match="compute the policy's and the reference's under the same sampler"):
        lk.KLPenaltyLoss("k3+", sampling=sampling)
    mask = torch.ones(4, 6, dtype=torch.bool)
    got = lk.kl_penalty(data["logits"], data["ref_logits"], "full", mask=mask, sampling=sampling)
    p = torch.log_softmax(data["logits"].double() / 0.7, -1)
    q = torch.log_softmax(data["ref_logits"].double() / 0.7, -1)
    assert_close(got.double(), (p.exp() * (p - q)).sum(-1), rtol=1e-5, atol=1e-6)


def test_the_log_prob_check_keeps_kl_penalty_compilable_in_one_graph() -> None:
    # inside torch.compile the check is the device-side assertion (a host read would break the graph)
    g = torch.Generator().manual_seed(4)
    lp, ref = -torch.rand(4, 8, generator=g), -torch.rand(4, 8, generator=g)
    m = torch.rand(4, 8, generator=g) > 0.3
    fn = torch.compile(lambda lp, ref, m: lk.aggregate(lk.kl_penalty(lp, ref, "k3+", mask=m), m, "token-mean"), fullgraph=True, backend="eager")
    assert_close(fn(lp, ref, m), lk.aggregate(lk.kl_penalty(lp, ref, "k3+", mask=m), m, "token-mean"))
    with pytest.raises(RuntimeError, match="`logprob` must hold log-probabilities"):
        fn(lp + 1, ref, m)
