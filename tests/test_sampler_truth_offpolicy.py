"""Rollouts reused off-policy under a truncating sampler (issue 40, C1 and C2).

* The error for a sampled token outside the kept set names both causes: a sampler the scorer does not
  match (on-policy), and a policy that moved since the rollout (PPO epochs > 1, mini-batches, stale
  rollouts), with what to do for each, and ``ignore_index`` for padding after EOS.
* ``outside="extend"``: the log-prob on the kept set extended by the sampled token, against float64
  maths from the formula (values and gradients, from logits, from a head with a bias and a soft cap,
  and with ``kept_from=``); bitwise the processed log-prob wherever the token is still kept; continuous
  where the token alone leaves the kept set (``-inf`` jumps there).
* The issue's case: two PPO epochs over one rollout with ``top_p=0.9`` raise at the second epoch by
  default, and run with finite values and gradients with ``outside="extend"``.
"""

from __future__ import annotations

import math

import pytest
import torch

import lightning_kl as lk
from lightning_kl.ground.sampler import process_scores

NINF = float("-inf")


def _extended64(z: torch.Tensor, tokens: torch.Tensor, sampling: lk.Sampling, chooser: torch.Tensor | None = None,
                ignore_index: int | None = None) -> torch.Tensor:
    """``z_y / T - lse_{K + y}(z / T)`` in float64 from the formula (``z`` float64 with grad), ``K``
    chosen by the float32 scores (a selection, given alike to every computation)."""
    t = tokens.clamp(min=0)
    base = (z.detach().float() if chooser is None else chooser.float()) / sampling.temperature
    keep = (process_scores(base, sampling) != NINF).scatter(-1, t[..., None], True)
    value = torch.log_softmax((z / sampling.temperature).masked_fill(~keep, NINF), -1).gather(-1, t[..., None])[..., 0]
    return value if ignore_index is None else torch.where(tokens == ignore_index, 0.0, value)


def _moved(seed: int = 0, b: int = 4, t: int = 6, v: int = 30) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rollout logits, tokens drawn from their top-p 0.9 nucleus at T = 0.8, and the logits of a policy that moved."""
    g = torch.Generator().manual_seed(seed)
    z0 = 3 * torch.randn(b, t, v, generator=g)
    probs = torch.softmax(process_scores(z0 / 0.8, lk.Sampling(temperature=0.8, top_p=0.9)), -1)
    tokens = torch.multinomial(probs.view(-1, v), 1, generator=g).view(b, t)
    z1 = z0 + 3.0 * torch.randn(b, t, v, generator=g)
    return z0, tokens, z1


SAMPLER = lk.Sampling(temperature=0.8, top_p=0.9)


def test_the_error_names_the_policy_that_moved_and_what_to_do() -> None:
    z0, tokens, z1 = _moved()
    lk.token_logprobs(z0, tokens, sampling=SAMPLER)  # on-policy: every token kept
    with pytest.raises(ValueError) as err:
        lk.token_logprobs(z1, tokens, sampling=SAMPLER)
    msg = str(err.value)
    for words in ("the policy moved since the rollout", "PPO epochs > 1", "mini-batches", "stale",
                  "outside='extend'", "outside='-inf' and drop those tokens from the mask",
                  "the sampler and the scorer disagree", "top_k=50", "ignore_index", "docs/sampling.md"):
        assert words in msg, words
    # the first position it names is a token outside the moved policy's kept set
    out = lk.token_logprobs(z1, tokens, sampling=SAMPLER, outside="-inf") == NINF
    first = tuple(out.nonzero()[0].tolist())
    assert f"the first at position {first}" in msg


def test_padding_after_eos_is_reported_with_ignore_index_and_ignore_index_scores_it() -> None:
    # C2: the README's sampled log-probs on padded responses; the padding id is outside every kept set
    z0, tokens, _ = _moved()
    mask = torch.arange(tokens.shape[1]) < torch.tensor([6, 2, 4, 1])[:, None]
    peak = z0.clone()
    peak[..., 0] = -20.0  # the padding id 0: never kept
    padded = tokens.masked_fill(~mask, 0)
    with pytest.raises(ValueError, match=r"padding after EOS.*`ignore_index` \(tokens.masked_fill\(~mask, -100\), ignore_index=-100\)"):
        lk.token_logprobs(peak, padded, sampling=SAMPLER)
    lp = lk.token_logprobs(peak, padded.masked_fill(~mask, -100), sampling=SAMPLER, ignore_index=-100)
    assert torch.isfinite(lp).all() and (lp[~mask] == 0).all()


@pytest.mark.parametrize("sampling", [SAMPLER, lk.Sampling(temperature=1.3, top_k=5), lk.Sampling(min_p=0.1),
                                      lk.Sampling(temperature=0.7, top_k=8, top_p=0.8, min_p=0.05)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extend_is_the_log_prob_on_the_kept_set_and_the_token_from_logits(sampling: lk.Sampling, dtype: torch.dtype) -> None:
    _, tokens, z1 = _moved()
    tokens = tokens.clone()
    tokens[0, 0] = -100
    z = z1.to(dtype).clone().requires_grad_()
    lp = lk.token_logprobs(z, tokens, sampling=sampling, outside="extend", ignore_index=-100)
    lp_inf = lk.token_logprobs(z.detach(), tokens, sampling=sampling, outside="-inf", ignore_index=-100)
    outside = lp_inf == NINF
    assert outside.any() and (~outside).any()  # both kinds of token in the batch
    assert torch.isfinite(lp).all() and lp[0, 0] == 0
    assert torch.equal(lp.detach()[~outside], lp_inf[~outside])  # still kept: the processed log-prob, bitwise
    z64 = z1.double().requires_grad_()
    want = _extended64(z64, tokens, sampling, z1, ignore_index=-100)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(lp.double(), want.detach(), rtol=0, atol=tol)
    g = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (lp.double() * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(z.grad.double(), z64.grad, rtol=0, atol=tol)
    assert z.grad[0, 0].abs().max() == 0  # the ignored position: exactly 0


def test_extend_from_a_head_with_a_bias_and_a_soft_cap() -> None:
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    w = (torch.randn(30, 8, generator=g) * 2).requires_grad_()
    bias = torch.randn(30, generator=g, requires_grad=True)
    tokens = torch.randint(0, 30, (2, 5), generator=g)
    x = lk.FromHidden(h, w, bias, logit_scale=1.5, softcap=20.0)
    lp = lk.token_logprobs(x, tokens, sampling=SAMPLER, outside="extend")
    assert (lk.token_logprobs(x, tokens, sampling=SAMPLER, outside="-inf") == NINF).any()
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (h, w, bias))
    z64 = torch.tanh(1.5 * (h64 @ w64.T + b64) / 20.0) * 20.0
    want = _extended64(z64, tokens, SAMPLER, z64.detach())
    torch.testing.assert_close(lp.double(), want.detach(), rtol=0, atol=2e-5)
    gr = torch.randn(2, 5, generator=g, dtype=torch.float64)
    (lp.double() * gr).sum().backward()
    (want * gr).sum().backward()
    for got, ref in ((h, h64), (w, w64), (bias, b64)):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=0, atol=2e-5)


def test_extend_on_the_policys_kept_set_for_a_reference() -> None:
    z0, tokens, z1 = _moved()
    ref = z0 - 0.7 * torch.randn(z0.shape, generator=torch.Generator().manual_seed(5))
    lp = lk.token_logprobs(ref, tokens, sampling=SAMPLER, kept_from=z1, outside="extend")
    assert torch.isfinite(lp).all()
    want = _extended64(ref.double(), tokens, SAMPLER, chooser=z1)
    torch.testing.assert_close(lp.double(), want, rtol=0, atol=2e-6)


def test_extend_is_continuous_where_the_token_alone_leaves_the_kept_set() -> None:
    # min-p removes token 1 alone when its probability falls below min_p x the top's: at z_1 = log(0.2) + z_0
    sampling = lk.Sampling(min_p=0.2)
    edge = math.log(0.2) + 2.0
    tokens = torch.tensor([1, 1])
    z = torch.tensor([[2.0, edge + 1e-4, 0.0, -1.0], [2.0, edge - 1e-4, 0.0, -1.0]])  # kept, then not
    inf = lk.token_logprobs(z, tokens, sampling=sampling, outside="-inf")
    assert math.isfinite(inf[0]) and inf[1] == NINF  # the processed log-prob jumps to -inf
    ext = lk.token_logprobs(z, tokens, sampling=sampling, outside="extend")
    assert abs(float(ext[0] - ext[1])) < 2e-4  # and the extension does not
    # temperature-only scoring jumps by the log of the kept mass
    full = lk.token_logprobs(z, tokens, sampling=lk.Sampling())
    assert abs(float(full[1] - ext[1])) > 0.05


def test_extend_with_the_entropy_in_one_pass() -> None:
    _, tokens, z1 = _moved()
    lp, ent = lk.token_logprobs_and_entropy(z1, tokens, sampling=SAMPLER, outside="extend")
    torch.testing.assert_close(lp, lk.token_logprobs(z1, tokens, sampling=SAMPLER, outside="extend"), rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, lk.token_entropy(z1, sampling=SAMPLER), rtol=0, atol=1e-6)


def test_two_ppo_epochs_over_one_rollout_with_top_p() -> None:
    """The issue's case: the second epoch raises by default; with outside='extend' every number is finite."""
    torch.manual_seed(0)
    b, t, v, d = 8, 5, 40, 16
    head = torch.nn.Linear(d, v)
    with torch.no_grad():
        head.weight.mul_(8)
    hidden = torch.randn(b, t, d)
    with torch.no_grad():
        z0 = head(hidden)
        probs = torch.softmax(process_scores(z0 / 0.8, SAMPLER), -1)
        tokens = torch.multinomial(probs.view(-1, v), 1).view(b, t)
        old = lk.token_logprobs(z0, tokens, sampling=SAMPLER)
        ref = lk.token_logprobs(z0 + torch.randn(z0.shape), tokens, sampling=lk.Sampling(temperature=0.8))
    adv = torch.randn(b, 1)
    mask = torch.ones(b, t, dtype=torch.bool)
    kl = lk.KLPenaltyLoss("k3+", coef=0.1)
    opt = torch.optim.SGD(head.parameters(), lr=5.0)

    def epoch(outside: str) -> torch.Tensor:
        lp = lk.token_logprobs(head(hidden), tokens, sampling=SAMPLER, outside=outside)
        ratio = torch.exp(lp - old)
        pg = lk.aggregate(-torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv), mask, "token-mean")
        return pg + kl(lp, ref, mask, old_logprob=old)

    loss = epoch("raise")  # epoch 1: on-policy
    loss.backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(ValueError, match="the policy moved since the rollout"):
        epoch("raise")  # epoch 2: some sampled token left the moved policy's nucleus
    loss = epoch("extend")
    assert torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in head.parameters())
    # with -inf the sampled KL estimators are NaN unless those tokens leave the mask
    with torch.no_grad():
        lp = lk.token_logprobs(head(hidden), tokens, sampling=SAMPLER, outside="-inf")
    assert torch.isnan(kl(lp, ref, mask, old_logprob=old))
    kept = mask & (lp > NINF)
    assert torch.isfinite(kl(lp, ref, kept, old_logprob=old))


def test_extend_is_accepted_by_the_hf_scorers_and_a_bad_mode_is_named() -> None:
    with pytest.raises(ValueError, match=r"`outside` must be one of \('raise', '-inf', 'extend'\)"):
        lk.token_logprobs(torch.zeros(2, 3), torch.tensor([0, 1]), sampling=lk.Sampling(top_k=1), outside="drop")


def test_extend_reads_only_the_rows_outside_of_a_strided_input_and_one_token() -> None:
    _, tokens, z1 = _moved()
    wide = torch.cat([z1, z1[:, :1]], 1)  # logits[:, :-1] of a longer output: a view, not contiguous
    view = wide[:, :-1]
    assert not view.is_contiguous()
    torch.testing.assert_close(lk.token_logprobs(view, tokens, sampling=SAMPLER, outside="extend"),
                               lk.token_logprobs(z1, tokens, sampling=SAMPLER, outside="extend"), rtol=0, atol=1e-6)
    out = lk.token_logprobs(z1, tokens, sampling=SAMPLER, outside="-inf") == NINF
    i, j = out.nonzero()[0].tolist()
    one = lk.token_logprobs(z1[i, j], tokens[i, j], sampling=SAMPLER, outside="extend")
    assert one.dim() == 0 and torch.isfinite(one)
    torch.testing.assert_close(one, lk.token_logprobs(z1, tokens, sampling=SAMPLER, outside="extend")[i, j], rtol=0, atol=1e-6)
