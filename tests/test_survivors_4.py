"""Bugs that survived the tests of the module they were planted in (the fourth hour's 14), one test each.

Each test names its plant: the wrong implementation that was put in by hand, seen to fail the test, and
taken out again. They are grouped by the module the bug was planted in.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.ground import checks
from lightning_kl.kernels import engine

F64 = torch.float64
INF = float("inf")


def _entropy64(z: Tensor) -> Tensor:
    """-sum p log p over the support (0 log 0 = 0), float64."""
    lp = torch.log_softmax(z.double(), -1)
    return -torch.where(lp > -INF, lp.exp() * lp, 0.0).sum(-1)


def _reverse_kl64(z: Tensor, zr: Tensor) -> Tensor:
    """sum_i p_i (log p_i - log q_i) over the policy's support, float64."""
    lp, lq = torch.log_softmax(z.double(), -1), torch.log_softmax(zr.double(), -1)
    return torch.where(lp > -INF, lp.exp() * (lp - lq), 0.0).sum(-1)


# ---------------------------------------------------------------------------------------------
# kernels/engine.py


def test_off_the_cpu_a_token_off_the_policys_support_counts_0_log_0_as_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: ``_row_sums``'s device form without ``nan_to_num`` (its ``p * e`` of 0 * -inf stays NaN).

    The device form (one ``nan_to_num``, no host read) is the one every accelerator and ``torch.compile``
    run; switching off the CPU's host reads runs it here."""
    g = torch.Generator().manual_seed(0)
    z, zr = torch.randn(4, 9, generator=g, dtype=F64), torch.randn(4, 9, generator=g, dtype=F64)
    z[:, 2] = -INF  # off the policy's support in every row
    z[1, 5] = -INF
    want_h, want_kl = _entropy64(z), _reverse_kl64(z, zr)
    monkeypatch.setattr(checks, "HOST_READ_DEVICES", frozenset())
    assert not checks.host_reads(z.device)
    assert_close(lk.token_entropy(z), want_h, rtol=1e-12, atol=1e-14)
    assert_close(lk.full_kl(z, zr), want_kl, rtol=1e-12, atol=1e-14)
    h, w = torch.randn(4, 3, generator=g, dtype=F64), torch.randn(9, 3, generator=g, dtype=F64)
    b = torch.zeros(9, dtype=F64)
    b[2] = -INF  # from a head: the bias takes token 2 off the support
    assert_close(lk.token_entropy(lk.FromHidden(h, w, b)), _entropy64(h @ w.T + b), rtol=1e-12, atol=1e-14)


def test_a_vocabulary_tile_without_mass_adds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: ``_Rows``'s whole rows keep ``c = NaN`` (log_softmax of a tile of -inf) instead of ``-inf``.

    A head's vocabulary is read in tiles of columns (here 3 tiles of 4, the tile size made small); a
    bias of -inf over the first tile leaves it without mass, which must add nothing to the rows."""
    monkeypatch.setattr(engine, "HIDDEN_CPU_TILE_ELEMENTS", 6 * 4)  # 6 rows: tiles of 4 columns
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(2, 3, 5, generator=g, dtype=F64), torch.randn(12, 5, generator=g, dtype=F64)
    b = torch.randn(12, generator=g, dtype=F64)
    b[:4] = -INF
    src = lk.FromHidden(h, w, b)
    assert len(engine.Source(engine.Tensors(h, w, b)).tiles(6, True)) == 3
    z = h @ w.T + b
    tokens = torch.randint(4, 12, (2, 3), generator=g)
    lp, ent = lk.token_logprobs_and_entropy(src, tokens)
    assert_close(lp, torch.log_softmax(z, -1).gather(-1, tokens[..., None]).squeeze(-1), rtol=1e-12, atol=1e-14)
    assert_close(ent, _entropy64(z), rtol=1e-12, atol=1e-14)


def test_a_token_outside_the_kept_set_sends_no_gradient() -> None:
    """Plant: ``_Rows.backward`` without ``masked_fill(outside, 0)`` on the log-prob's gradient (a token
    outside the kept set, value -inf whatever the logits, still sent ``-p`` into its row)."""
    g = torch.Generator().manual_seed(2)
    z = torch.randn(5, 8, generator=g, dtype=F64, requires_grad=True)
    s = lk.Sampling(temperature=0.7, top_k=3)
    inside = z.detach().argmax(-1)
    tokens = torch.where(torch.arange(5) % 2 == 0, inside, z.detach().argmin(-1))  # rows 1, 3: outside
    lp = lk.token_logprobs(z, tokens, sampling=s, outside="-inf")
    assert torch.isinf(lp[1::2]).all() and torch.isfinite(lp[0::2]).all()
    (grad,) = torch.autograd.grad(lp, z, torch.ones(5, dtype=F64))
    assert torch.equal(grad[1::2], torch.zeros(2, 8, dtype=F64))  # a constant: no gradient at all
    # inside: the gradient of log softmax over the kept set, from float64 autograd
    zd = z.detach().clone().requires_grad_()
    scores = zd / 0.7
    kept = scores >= scores.topk(3, -1).values[:, -1:]
    want = torch.log_softmax(scores.masked_fill(~kept, -INF), -1).gather(-1, tokens[:, None]).squeeze(-1)
    want[0::2].sum().backward()
    assert_close(grad[0::2], zd.grad[0::2], rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# ground/parallel.py


def test_sum_or_refuse_raises_nothing_when_no_process_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: the refusal flag inverted (``float(problem is None)``). Where values are read on the host the
    flag only decides whether the messages are gathered (none: nothing raised either way), so this runs
    the device form, where a process that refused nothing asserts on the device that the flag sum is 0.
    A group of 2 whose other process sent ``other`` stands in for the all-reduce."""
    from lightning_kl.ground.parallel import DataParallelGroup, sum_or_refuse

    class Pair(DataParallelGroup):
        def all_reduce_sum(self, tensor: Tensor) -> Tensor:
            return tensor.add_(other)

    dp = Pair(None, 2, "a stand-in pair")
    monkeypatch.setattr(checks, "HOST_READ_DEVICES", frozenset())
    terms = torch.tensor([1.5, 2.0], dtype=F64)
    other = torch.tensor([0.25, 3.0, 0.0], dtype=F64)  # the other process refused nothing
    assert torch.equal(sum_or_refuse(dp, terms, None, terms.device, 2, "who"), torch.tensor([1.75, 5.0], dtype=F64))
    other = torch.tensor([0.0, 0.0, 1.0], dtype=F64)  # the other process refused its inputs
    with pytest.raises(RuntimeError, match="who: another data parallel process refused its inputs"):
        sum_or_refuse(dp, terms, None, terms.device, 2, "who")


# ---------------------------------------------------------------------------------------------
# entropy.py


def test_the_bonus_step_entropy_leaves_padding_out() -> None:
    """Plant: the step's entropy sum over every position (``v.sum()``), padding included."""
    ctl = lk.TargetEntropyController(target_entropy=1.0, init_coef=0.01, step_size=0.1)
    bonus = lk.EntropyBonus(coef=ctl)
    entropy = torch.tensor([[0.5, 0.7, 9.0], [0.3, 9.0, 9.0]], dtype=F64)  # 9.0: padding
    mask = torch.tensor([[True, True, False], [True, False, False]])
    bonus(entropy=entropy, mask=mask)
    coef, h = bonus.update_coef()
    assert_close(h, torch.tensor(1.5 / 3, dtype=F64), rtol=1e-15, atol=0)
    assert ctl.value == pytest.approx(0.01 * math.exp(0.1 * 0.5), rel=1e-14)  # 1 - H / target = 0.5


# ---------------------------------------------------------------------------------------------
# entropy_controller.py


def test_the_dual_rule_on_tensors_clips_the_error_at_minus_one() -> None:
    """Plant: the tensor path's error clipped at 1 only (``error.clamp(max=1.0)``): an entropy of 5x the
    target then lowered log c by 4 eta, not eta."""
    t = lk.TargetEntropyController(target_entropy=0.5, init_coef=0.01, step_size=0.3, coef_min=1e-6)
    t.update(torch.tensor(2.5, dtype=F64), torch.tensor(10.0, dtype=F64))  # 1 - H / target = -4: clipped to -1
    assert float(t.value_tensor()) == pytest.approx(0.01 * math.exp(-0.3), rel=1e-14)
    t.update(torch.tensor(0.0, dtype=F64), torch.tensor(10.0, dtype=F64))  # collapsed: +1, the largest rise
    assert float(t.value_tensor()) == pytest.approx(0.01, rel=1e-14)


def test_the_additive_rule_on_tensors_stops_at_coef_min() -> None:
    """Plant: the tensor path's coefficient clamped at 0 instead of ``coef_min``."""
    ctl = lk.TargetEntropyController(0.4, init_coef=0.012, rule="additive", coef_delta=0.005, coef_min=0.004)
    for _ in range(4):  # above the target: 0.012 -> 0.007 -> 0.004 (the bound) and stays
        ctl.update(torch.tensor(0.9, dtype=F64), torch.tensor(5.0, dtype=F64))
    assert ctl.coef == 0.004
    ctl.update(torch.tensor(0.1, dtype=F64), torch.tensor(5.0, dtype=F64))  # under: up from the bound, applied
    assert ctl.coef == pytest.approx(0.009, abs=1e-15) and ctl.value == ctl.coef


def test_the_additive_rules_coef_min_defaults_to_trls_0() -> None:
    """Plant: ``coef_min`` defaulting to 1e-6 for ``"additive"`` (TRL 1.16's ``entropy_coef_min`` is 0.0);
    the dual rule's default stays 1e-6 (its log needs a bound > 0)."""
    ctl = lk.TargetEntropyController(0.4, init_coef=0.005, rule="additive", coef_delta=0.005)
    assert ctl.coef_min == 0.0
    ctl.update(0.9, 5)
    ctl.update(0.1, 5)
    ctl.update(0.9, 5)
    assert ctl.coef == 0.0  # down to exactly 0, as TRL's
    ctl = lk.TargetEntropyController(0.4, init_coef=0.005, rule="additive", coef_delta=0.005)
    ctl.update(torch.tensor(0.9, dtype=F64), torch.tensor(5.0, dtype=F64))
    assert ctl.coef == 0.0
    assert lk.TargetEntropyController(0.4, init_coef=0.0, rule="additive").value == 0.0  # 0 is a valid start
    assert lk.TargetEntropyController(0.4).coef_min == 1e-6


# ---------------------------------------------------------------------------------------------
# high_entropy.py


@pytest.mark.parametrize("q", [0.0, 0.5, 1.0])
def test_a_nan_among_the_valid_values_makes_the_quantile_nan(q: float) -> None:
    """Plant: ``masked_quantile`` without the NaN check (the sort puts NaN last, so a low quantile read
    a number). ``torch.quantile`` gives NaN; so does the threshold, and no token passes it."""
    from lightning_kl.high_entropy import masked_quantile

    values = torch.tensor([1.0, float("nan"), 3.0, 5.0, 7.0])
    valid = torch.tensor([True, True, True, False, True])
    assert torch.quantile(values[valid], q).isnan()
    assert masked_quantile(values, valid, q).isnan()
    assert not masked_quantile(values, valid & ~values.isnan(), q).isnan()  # the NaN masked out: a number


# ---------------------------------------------------------------------------------------------
# coefficient.py


def test_the_loss_controller_counts_sequences_not_tokens() -> None:
    """Plant: ``close_step`` gave the controller the step's token count (``stats[1]`` at ``token-mean``)
    as ``n_steps``. The adaptive rule's step is proportional to the number of sequences."""
    ctl = lk.AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=20)
    loss = lk.KLPenaltyLoss("k1", coef=ctl, agg="token-mean")
    loss.train()
    lp = torch.tensor([[-1.0, -1.0, -1.0, 0.0], [-1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
    ref = lp - 2.0  # k1 = 2 on every token: error clipped to 0.2
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)  # 2 sequences, 5 tokens
    loss(lp, ref, mask)
    loss.update_coef()
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 2 / 20), rel=1e-14)


# ---------------------------------------------------------------------------------------------
# inputs.py


def test_num_tokens_0_is_a_count_not_an_error() -> None:
    """Plant: ``check_count`` refusing 0 (``not n > 0``): a micro-batch of an accumulation window whose
    step holds no valid token passes ``num_tokens=0``; the loss is then 0."""
    from lightning_kl.inputs import check_count

    for n in (0, 0.0, 3):
        check_count("num_tokens", n)
    for bad in (-1, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="`num_tokens` must be a finite number >= 0"):
            check_count("num_tokens", bad)
    lp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    out = lk.KLPenaltyLoss("k1", agg="token-mean", coef=1.0)(
        lp, lp.detach() - 1.0, torch.zeros(2, 3, dtype=torch.bool), num_tokens=0, accumulate_grad_batches=1
    )
    assert out.item() == 0.0


# ---------------------------------------------------------------------------------------------
# correction.py


def test_from_verl_reads_rollout_is_batch_normalize() -> None:
    """Plant: ``from_verl`` ignoring ``rollout_is_batch_normalize`` (the weights then stay unnormalized)."""
    cfg = {"rollout_is": "token", "rollout_is_threshold": 4.0, "rollout_is_batch_normalize": True}
    rc = lk.RolloutCorrection.from_verl(cfg)
    assert rc.batch_normalize is True
    assert lk.RolloutCorrection.from_verl({**cfg, "rollout_is_batch_normalize": False}).batch_normalize is False
    lp = torch.tensor([[-1.0, -0.5, -2.0]], dtype=F64)
    out = rc(lp, lp - torch.tensor([[0.3, -0.2, 0.1]], dtype=F64))
    assert_close(out.weights.mean(), torch.tensor(1.0, dtype=F64), rtol=1e-14, atol=0)  # normalized to mean 1


def test_the_corrections_old_logprob_carries_no_gradient() -> None:
    """Plant: the decoupled mode's ``old_logprob`` not detached (``logprob`` itself): a PPO ratio
    ``exp(logprob - old)`` built on it then sends gradient into the old policy's log-probs."""
    lp = torch.tensor([[-1.0, -0.5, -2.0]], dtype=F64, requires_grad=True)
    rollout = torch.tensor([[-1.1, -0.4, -2.2]], dtype=F64, requires_grad=True)
    out = lk.RolloutCorrection(weights="token", upper=2.0)(lp, rollout)
    assert not out.old_logprob.requires_grad
    assert torch.equal(out.old_logprob, lp.detach())


# ---------------------------------------------------------------------------------------------
# hf.py


def test_from_hidden_keeps_the_lm_heads_bias() -> None:
    """Plant: ``lk.hf.from_hidden`` without the head's bias (``FromHidden(hidden, head.weight)``)."""
    from types import SimpleNamespace

    torch.manual_seed(3)
    head = torch.nn.Linear(4, 11, bias=True).double()
    with torch.no_grad():
        head.bias.normal_(0.0, 2.0)
    model = SimpleNamespace(get_output_embeddings=lambda: head, config=SimpleNamespace(model_type="llama"))
    hidden = torch.randn(2, 3, 4, dtype=F64)
    tokens = torch.randint(0, 11, (2, 3))
    got = lk.token_logprobs(lk.hf.from_hidden(model, hidden), tokens)
    want = torch.log_softmax(head(hidden).detach(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert_close(got, want, rtol=1e-12, atol=1e-14)
