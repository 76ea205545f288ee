"""A new user's mistakes that once gave no error: each is now an error or a warning that says what to do.

The Trainer's gradient accumulation without the recipe; masks that are weights; logits or hidden states
where log-probs belong; a reference that requires grad; ``level="sequence"`` with the default ``agg``;
``lk.hf`` inputs batched twice by a ``DataLoader``; "no data" logged as a KL of 0; and, from a
LightningCLI YAML file, a bad name whose error is ours, after a ``--help`` that lists the valid ones.
"""

from __future__ import annotations

import copy
import math
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

import jsonargparse
import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from test_accumulation import K, Accumulator, big_batch_grads
from torch import Tensor, nn
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.sequence import LEVELS
from lightning_kl.functional import AGG_MODES
from lightning_kl.estimators import ESTIMATORS, SAMPLED_ESTIMATORS
from lightning_kl.ground.checks import check_mask

F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# Trainer(accumulate_grad_batches=k): the loss reads k itself


class _NoK(Accumulator):
    """Passes the step's totals (or nothing) but never `accumulate_grad_batches`: the loss reads the Trainer's."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        rows = batch["rows"]
        totals = {"num_tokens": batch["num_tokens"], "num_seqs": batch["num_seqs"]} if self.with_totals else {}
        return sum(
            self._one(loss_fn, param, rows, totals) for param, loss_fn in zip(self.logprobs, self.losses)
        )

    def _one(self, loss_fn: nn.Module, param: Tensor, rows: Tensor, totals: dict[str, Any]) -> Tensor:
        # one method deeper than training_step: the lookup walks past it
        return loss_fn(param[rows], self.data["ref_logprob"][rows], self.data["mask"][rows], **totals)


def test_the_loss_reads_the_trainers_accumulation_and_the_totals_alone_are_exact(quiet_trainer: Any) -> None:
    model = _NoK(with_totals=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="KLPenaltyLoss")
        quiet_trainer(max_epochs=1, accumulate_grad_batches=K).fit(model)
    assert len(model.grads) == 1
    for mode, got, want in zip(AGG_MODES, model.grads[0], big_batch_grads()):
        # without k the loss would be k times too small in every mode
        assert_close(got, want, rtol=0, atol=1e-12, msg=lambda m, mode=mode: f"{mode}: {m}")
    # the loss remembers the module it found, weakly: it still pickles and copies (without it)
    for clone in (pickle.loads(pickle.dumps(model.losses[0])), copy.deepcopy(model.losses[0])):
        assert clone(-torch.ones(2, 3), torch.zeros(2, 3)).item() == pytest.approx(0.5 * (math.e - 2), rel=1e-6)  # k3(-1)


def test_forgetting_the_recipe_under_accumulation_is_warned_once_per_mode(quiet_trainer: Any) -> None:
    model = _NoK(with_totals=False)
    with pytest.warns(UserWarning, match=f"accumulating gradients over {K} micro-batches but got no") as record:
        quiet_trainer(max_epochs=1, accumulate_grad_batches=K).fit(model)
    messages = [str(w.message) for w in record if "accumulating gradients" in str(w.message)]
    # the three modes that divide by a count, once each
    assert sorted(m.split("'")[1] for m in messages) == ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"]
    # and outside a Trainer nothing is looked up or warned: k = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lk.KLPenaltyLoss("k3+")(-torch.ones(2, 3), torch.zeros(2, 3))


def test_without_the_totals_the_gradient_is_lightnings_average_of_the_micro_batches(quiet_trainer: Any) -> None:
    # float64 from the formula: k3's gradient w.r.t. logprob is 1 - exp(-d), d = logprob - ref_logprob.
    # Without the step's totals a mode that divides by a count can only divide each micro-batch by its
    # own: the accumulated gradient is then the average over the K micro-batches (Lightning divides by
    # K), not K times it. token-sum and seq-mean-token-sum-norm need no count: the big batch's, exactly.
    from test_accumulation import LENGTHS, MICRO_ROWS, step_data

    model = _NoK(with_totals=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="KLPenaltyLoss")
        quiet_trainer(max_epochs=1, accumulate_grad_batches=K).fit(model)
    data = step_data()
    mask = data["mask"]
    g = torch.where(mask, 1 - torch.exp(-(data["logprob"] - data["ref_logprob"])), 0.0) * 0.5  # coef 0.5
    lengths = torch.tensor(LENGTHS, dtype=F64).unsqueeze(-1)
    want = {mode: torch.zeros_like(g) for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")}
    for rows in MICRO_ROWS:
        r = list(rows)
        n_tok = mask[r].sum()
        n_seq = (lengths[r] > 0).sum()
        want["token-mean"][r] = g[r] / n_tok / K
        want["seq-mean-token-sum"][r] = g[r] / n_seq / K
        want["seq-mean-token-mean"][r] = g[r] / lengths[r].clamp(min=1) / n_seq / K
    big = dict(zip(AGG_MODES, big_batch_grads()))
    want["token-sum"], want["seq-mean-token-sum-norm"] = big["token-sum"], big["seq-mean-token-sum-norm"]
    for mode, got in zip(AGG_MODES, model.grads[0]):
        assert_close(got, want[mode], rtol=0, atol=1e-12, msg=lambda m, mode=mode: f"{mode}: {m}")


# ---------------------------------------------------------------------------------------------
# masks are not weights


@pytest.mark.parametrize("bad", [0.5, 2.0, -1.0, float("nan")])
def test_a_mask_that_is_not_0_or_1_is_refused_everywhere(bad: float) -> None:
    lp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, bad, 1.0]])
    match = r"`mask` must hold only 0 and 1 \(or be bool\), got .* torch.float32 mask: .*not a weight"
    calls = [
        lambda: lk.kl_penalty(lp, lp - 1, "k1", mask=mask),
        lambda: lk.aggregate(lp, mask),
        lambda: lk.KLPenaltyLoss("k3+")(lp, lp - 1, mask),
        lambda: lk.KLMetric().update(lp, mask),
        lambda: lk.step_totals([mask]),
        lambda: lk.full_kl(torch.zeros(2, 3, 5), torch.zeros(2, 3, 5), mask),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call()
    if bad == 2.0:  # integer masks too
        with pytest.raises(ValueError, match=r"got 2 in a torch.int64 mask"):
            lk.aggregate(lp, mask.long())


def test_a_0_1_mask_of_any_dtype_is_read_as_bool_and_a_bool_mask_is_used_as_is() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    bool_mask = torch.tensor([[True, False, True], [False, False, True]])
    for mask in (bool_mask.float(), bool_mask.long(), bool_mask.to(torch.uint8)):
        assert lk.aggregate(values, mask).item() == pytest.approx((1 + 3 + 6) / 3, rel=1e-7)
    assert check_mask(bool_mask, values, "values") is bool_mask  # no copy, no value read


# ---------------------------------------------------------------------------------------------
# logits, hidden states or a reference with a graph where log-probs belong


def test_logits_where_log_probs_belong_are_named_as_logits() -> None:
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match=r"`logprob` \(2, 3, 5\) looks like logits .*lk.token_logprobs\(logits, tokens\).*'full'"):
        lk.kl_penalty(logits, logits, "k3+", mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"looks like logits"):
        lk.KLPenaltyLoss("k3+")(logits, logits, torch.ones(2, 3, dtype=torch.bool))


def test_hidden_states_are_taken_by_full_kl_and_kl_penalty_with_one_for_each_model() -> None:
    h = lk.FromHidden(torch.randn(2, 3, 4), torch.randn(7, 4))
    # lk.full_kl and kl_penalty("full") take them, as the loss does (one model against itself: 0)
    assert torch.equal(lk.full_kl(h, h), torch.zeros(2, 3))
    assert_close(lk.kl_penalty(h, h, "full"), torch.zeros(2, 3))
    with pytest.raises(TypeError, match=r"FromHidden.*with one for each model"):
        lk.kl_penalty(h, torch.randn(2, 3, 7), "full")


def test_a_reference_that_requires_grad_is_warned_about_and_can_be_silenced() -> None:
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], requires_grad=True)
    logits, hidden, w = torch.randn(1, 2, 5), torch.randn(1, 2, 3), torch.randn(5, 3)
    cases = [
        ("ref_logprob", lambda: lk.kl_penalty(lp, ref, "k3+")),
        ("ref_logprob", lambda: lk.KLPenaltyLoss("k3+")(lp, ref)),
        ("ref_logits", lambda: lk.full_kl(logits, logits.clone().requires_grad_())),
        ("ref_logits", lambda: lk.KLPenaltyLoss("full")(logits, logits.clone().requires_grad_())),
        ("ref_hidden", lambda: lk.full_kl(lk.FromHidden(hidden, w), lk.FromHidden(hidden.clone().requires_grad_(), w))),
        ("ref_hidden", lambda: lk.KLPenaltyLoss("full")(lk.FromHidden(hidden, w), lk.FromHidden(hidden.clone().requires_grad_(), w))),
    ]
    for name, call in cases:
        with pytest.warns(UserWarning, match=f"`{name}` requires grad: the KL term would train the reference") as record:
            call()
        # the warning's stack level: the user's line (the lambda's), through nn.Module's call frames too
        assert (record[0].filename, record[0].lineno) == (__file__, call.__code__.co_firstlineno), name
        with warnings.catch_warnings():  # the documented way to say it is intended
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", message=f"`{name}` requires grad")
            call()
    with warnings.catch_warnings():  # a detached reference: nothing
        warnings.simplefilter("error")
        lk.KLPenaltyLoss("k3+")(lp, ref.detach())
        lk.kl_penalty(lp, ref.detach(), "k3+")


# ---------------------------------------------------------------------------------------------
# level="sequence" with the default agg; "no data"


def test_the_sequence_level_with_the_default_agg_warns_and_an_explicit_agg_does_not() -> None:
    with pytest.warns(UserWarning, match=r"level='sequence'\) without `agg` uses agg='token-mean'.*same number of valid tokens"):
        loss = lk.KLPenaltyLoss("k3+", level="sequence")
    assert loss.agg == "token-mean"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for agg in ("token-mean", "seq-mean-token-sum"):
            assert lk.KLPenaltyLoss("k3+", level="sequence", agg=agg).agg == agg
        assert lk.KLPenaltyLoss("k3+").agg == "token-mean"


def test_no_data_is_nan_in_the_metric_and_zero_in_the_loss() -> None:
    # one answer for "no data": the metric (logged per step) is NaN, as KLRewardCallback logs; the loss
    # of a batch with no valid token is 0 with a zero gradient (it contributes nothing)
    loss_fn = lk.KLPenaltyLoss("k3+", coef=1.0)
    lp = torch.zeros(2, 3, requires_grad=True)
    loss = loss_fn(lp, torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros(2, 3))
    assert torch.isnan(loss_fn.metric.compute())
    assert torch.isnan(lk.KLMetric()(torch.ones(3), torch.zeros(3, dtype=torch.bool)))


# ---------------------------------------------------------------------------------------------
# lk.hf


def test_hf_names_a_batch_batched_twice_and_takes_a_tensor_eos_id() -> None:
    seq = torch.tensor([[[3, 4, 5, 2, 0]]])  # [1, b, p + t]: a DataLoader with batch_size=1 over a batch
    with pytest.raises(ValueError, match=r"both be \[b, p \+ t\], got shapes \(1, 1, 5\) and \(1, 1, 5\)\. .*batch_size=None"):
        lk.hf.response_logprobs(None, seq, torch.ones_like(seq), 2)
    with pytest.raises(ValueError, match=r"`responses` must be \[b, t\], got shape \(1, 1, 5\)\. .*batch_size=None"):
        lk.hf.response_mask(seq, 2)
    with pytest.raises(ValueError, match=r"batch_size=None"):
        lk.hf.response_logits(torch.zeros(1, 2, 5, 7), 2)
    responses = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 2, 2, 2]])
    want = lk.hf.response_mask(responses, 2)
    assert torch.equal(lk.hf.response_mask(responses, torch.tensor(2)), want)
    assert torch.equal(lk.hf.response_mask(responses, torch.tensor([2, 7])), lk.hf.response_mask(responses, [2, 7]))
    with pytest.raises(ValueError, match="`eos_token_id` must be an int"):
        lk.hf.response_mask(responses, torch.tensor(2.0))


# ---------------------------------------------------------------------------------------------
# configuration: --help lists the names; a bad name in YAML ends with our message


def _help(cls: type) -> str:
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(cls, "x")
    return parser.format_help()


def test_help_lists_every_valid_estimator_mode_and_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100000")  # one line per option: no name cut at its hyphen
    loss_help = " ".join(_help(lk.KLPenaltyLoss).split())
    for name in (*ESTIMATORS, *AGG_MODES, *LEVELS):
        assert repr(name) in loss_help, name
    callback_help = " ".join(_help(lk.KLRewardCallback).split())
    assert all(repr(name) in callback_help for name in SAMPLED_ESTIMATORS) and "'full'" not in callback_help


class _Configured(pl.LightningModule):
    def __init__(self, estimator: lk.EstimatorName = "k3+", agg: lk.AggMode = "token-mean", level: lk.Level = "token") -> None:
        super().__init__()
        self.kl = lk.KLPenaltyLoss(estimator, agg=agg, level=level)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("estimator", "k3 +", r"Unknown KL estimator 'k3 \+'.*Valid names: 'k1'"),
        ("agg", "token_mean", r"Unknown aggregation mode 'token_mean'. Valid modes: 'token-mean'"),
        ("level", "sequences", r"Unknown KL level 'sequences'. Valid levels: 'token', 'sequence'"),
    ],
)
def test_a_bad_name_in_yaml_fails_with_our_message(key: str, value: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["cli.py"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"seed_everything": 0, "model": {key: value}}))
    with pytest.raises(ValueError, match=message):  # not the parser's SystemExit and usage text
        LightningCLI(_Configured, args=["--config", str(path)], run=False)
