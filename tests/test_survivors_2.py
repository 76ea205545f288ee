"""Planted bugs that survived the suite (issue "The second hour", non-distributed rows), one test each.

Each test names the wrong implementation it catches. Expectations are exact: probabilities that are
dyadic fractions (so ``<=`` and ``<`` differ at a boundary that float arithmetic reaches exactly),
float64 formulas, or a second run that must agree.

The sampler's log-probs go through :func:`sampled_logprobs`, the one place that calls the public
API for them (switch it to ``lk.token_logprobs(..., sampling=)`` when that surface lands).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.refresh.mixing import fold_adapters_, mix_, mix_modules_
from _trainers import make_quiet_trainer

F64 = torch.float64
NEG_INF = -float("inf")


def sampled_logprobs(x: Tensor, tokens: Tensor, sampling: lk.Sampling, *, weight: Optional[Tensor] = None,
                     ignore_index: Optional[int] = None, outside: str = "raise") -> Tensor:
    """The log-probs of ``tokens`` under ``sampling``'s processed distribution: from logits ``x``, or
    from hidden states ``x`` and an LM head ``weight``. The public API, in one place."""
    source = x if weight is None else lk.FromHidden(x, weight)
    return lk.token_logprobs(source, tokens, sampling=sampling, ignore_index=ignore_index, outside=outside)


def every_token(logits: Tensor, sampling: lk.Sampling) -> Tensor:
    """The log-probs of every vocabulary entry of each row of ``logits [n, V]`` -> ``[n, V]`` (-inf: removed)."""
    n, v = logits.shape
    rows = logits[:, None, :].expand(n, v, v)
    return sampled_logprobs(rows, torch.arange(v).expand(n, v), sampling, outside="-inf")


# ---------------------------------------------------------------------------------------------
# the sampler's kept set at its edges


@pytest.mark.parametrize(("v", "top_p", "kept"), [(4, 0.5, 2), (8, 0.25, 2), (8, 0.75, 6), (4, 0.75, 3)])
def test_top_p_removes_a_token_whose_cumulative_mass_is_exactly_one_minus_top_p(v: int, top_p: float, kept: int) -> None:
    # uniform logits: probabilities 1/v and cumulative sums k/v, exact in float. generate's TopP
    # removes where the ascending cumulative sum is <= 1 - top_p: (v=4, top_p=0.5) keeps 2 tokens.
    # Catches `<` (keeps 3) and a kept mass that must exceed top_p instead of reaching it.
    lp = every_token(torch.zeros(1, v, dtype=F64), lk.Sampling(top_p=top_p))
    assert int(torch.isfinite(lp).sum()) == kept
    assert_close(lp[torch.isfinite(lp)], torch.full((kept,), -math.log(kept), dtype=F64), rtol=0, atol=1e-15)


def test_min_p_keeps_a_token_whose_probability_is_exactly_min_p_times_the_largest() -> None:
    # probabilities 1/2, 1/4, 1/4 (exact); min_p=0.5: the floor is 1/4 and generate's MinP removes
    # only probs < floor, so all three stay. Catches `<=` (keeps the first token alone, log-prob 0).
    logits = torch.tensor([[math.log(2.0), 0.0, 0.0]], dtype=F64)
    assert torch.softmax(logits, -1).tolist() == [[0.5, 0.25, 0.25]]  # the boundary is reached exactly
    lp = every_token(logits, lk.Sampling(min_p=0.5))
    assert_close(lp, torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=F64)), rtol=0, atol=1e-15)
    # just above the boundary, the two small tokens go (the test can fail)
    lp = every_token(logits, lk.Sampling(min_p=0.5 + 1e-9))
    assert lp.tolist() == [[0.0, NEG_INF, NEG_INF]]


def test_top_p_zero_keeps_the_most_likely_token_alone() -> None:
    # generate's TopP keeps min_tokens_to_keep=1 (the largest) even when the nucleus is empty.
    # Catches top_p=0 read as "off" (a falsy check: every token kept) and a kept set left empty (NaN).
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.9], [5.0, 0.0, 4.0, 1.0]], dtype=F64)
    lp = every_token(logits, lk.Sampling(top_p=0.0))
    want = torch.full_like(lp, NEG_INF)
    want[0, 1] = want[1, 0] = 0.0
    assert torch.equal(lp, want)


def test_top_p_one_is_off_and_keeps_a_token_whose_probability_underflows() -> None:
    # top_p=1.0 is generate's "off" (its warper is not built): a token whose probability underflows
    # to 0 keeps its finite log-prob. Catches top-p applied at 1.0 (cumulative sum 0 <= 1 - 1 removes it).
    logits = torch.tensor([[0.0, -2e4, 1.0]], dtype=torch.float32)
    assert torch.softmax(logits, -1)[0, 1] == 0  # underflowed
    lp = every_token(logits, lk.Sampling(top_p=1.0))
    assert_close(lp, torch.log_softmax(logits.double(), -1).float(), rtol=0, atol=1e-5)
    assert lk.Sampling(top_p=1.0) == lk.Sampling()


@pytest.mark.parametrize("sampling", [lk.Sampling(top_k=2), lk.Sampling(temperature=0.7, top_p=0.6),
                                      lk.Sampling(min_p=0.3)], ids=["top_k", "top_p", "min_p"])
def test_the_gradient_of_a_token_outside_the_kept_set_is_exactly_zero(sampling: lk.Sampling) -> None:
    # with outside="-inf", a removed token's log-prob is -inf, a constant: no gradient at all.
    # Catches the kept-token formula ([i = y] - p~_i) / T applied to it (nonzero), and NaN from -inf arithmetic.
    torch.manual_seed(0)
    logits = (torch.randn(3, 9, dtype=F64) * 2).requires_grad_(True)
    lp_all = every_token(logits.detach(), sampling)
    outside = [int(torch.nonzero(~torch.isfinite(row))[0]) for row in lp_all]
    kept = [int(row.argmax()) for row in lp_all]
    tokens = torch.tensor([outside, kept]).T  # [3, 2]: per row one removed token, one kept token
    x = logits[:, None, :].expand(3, 2, 9)
    lp = sampled_logprobs(x, tokens, sampling, outside="-inf")
    assert torch.isinf(lp[:, 0]).all() and torch.isfinite(lp[:, 1]).all()
    (grad,) = torch.autograd.grad(lp, logits, grad_outputs=torch.tensor([[1.0, 0.0]] * 3, dtype=F64), retain_graph=True)
    assert torch.equal(grad, torch.zeros_like(grad))
    # the kept token's gradient is the formula's (the test above can fail)
    (grad,) = torch.autograd.grad(lp, logits, grad_outputs=torch.tensor([[0.0, 1.0]] * 3, dtype=F64))
    p = torch.exp(lp_all)
    want = (torch.nn.functional.one_hot(torch.tensor(kept), 9).to(F64) - p) / sampling.temperature
    assert_close(grad, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad", [5, -3, 7])
def test_out_of_range_ids_from_hidden_states_are_refused_in_the_processed_path(bad: int) -> None:
    # catches a gather that wraps a negative id or reads past the head (garbage or an IndexError deep inside)
    hidden, weight = torch.randn(2, 3, 4, dtype=F64), torch.randn(5, 4, dtype=F64)
    tokens = torch.tensor([[0, 1, bad], [1, 2, 3]])
    with pytest.raises(ValueError, match=rf"token id {bad} is out of range for a vocabulary of V=5"):
        sampled_logprobs(hidden, tokens, lk.Sampling(top_p=0.9), weight=weight, outside="-inf")
    # -100 is the ignore index, not an id
    tokens[0, 2] = -100
    lp = sampled_logprobs(hidden, tokens, lk.Sampling(top_p=0.9), weight=weight, ignore_index=-100, outside="-inf")
    assert lp[0, 2] == 0


@pytest.mark.parametrize("sampling", [lk.Sampling(), lk.Sampling(temperature=0.8, top_k=3, top_p=0.9)],
                         ids=["plain", "processed"])
def test_nan_hidden_states_at_ignored_positions_touch_nothing(sampling: lk.Sampling) -> None:
    # padding positions may hold anything (NaN from a masked attention row): their log-prob is 0 and
    # the gradients of the hidden states and the head are those of the run with finite values there.
    # Catches an ignored row computed and multiplied by 0 (NaN * 0 = NaN in the head's gradient).
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 4, 6, dtype=F64), torch.randn(7, 6, dtype=F64)
    tokens = torch.randint(0, 7, (2, 4))
    tokens[0, 3] = tokens[1, 0] = -100
    results = []
    for fill in (0.0, math.nan):
        h = hidden.clone()
        h[0, 3] = h[1, 0] = fill
        h.requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        if sampling.truncates:
            lp = sampled_logprobs(h, tokens, sampling, weight=w, ignore_index=-100, outside="-inf")
        else:
            lp = lk.token_logprobs(lk.FromHidden(h, w), tokens, ignore_index=-100)
        weights = torch.isfinite(lp).to(F64)
        value = (lp.masked_fill(~torch.isfinite(lp), 0) * weights).sum()
        results.append((lp.detach(), *torch.autograd.grad(value, [h, w])))
    (lp0, gh0, gw0), (lp1, gh1, gw1) = results
    assert lp1[0, 3] == 0 and lp1[1, 0] == 0
    assert torch.equal(lp0, lp1)
    assert not gw1.isnan().any() and not gh1.isnan().any()
    assert_close(gw1, gw0, rtol=0, atol=0)
    assert_close(gh1, gh0, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# ReferenceRefresh, mixing and folding

V, B, T = 7, 4, 6


class TinyLM(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, 8)
        self.head = nn.Linear(8, V)
        self.register_buffer("scale", torch.tensor(1.0 + seed / 10))  # a floating buffer
        self.register_buffer("calls", torch.tensor(seed))  # an integer buffer

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(tokens))) / self.scale


def tokens_of_step(i: int) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(i))


class PolicyAndRef(pl.LightningModule):
    """A policy trained with a KL term toward a separate reference; the data of step s is fixed."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.policy = TinyLM(0)
        self.ref = TinyLM(1).requires_grad_(False)
        self.kl = lk.KLPenaltyLoss("k3+", coef=0.1)
        self.steps = steps

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader([tokens_of_step(i) for i in range(self.steps)], batch_size=None)

    def training_step(self, tokens: Tensor, batch_idx: int) -> Tensor:
        tokens = tokens_of_step(self.global_step)  # whatever the loader's position (it restarts on resume)
        lp = lk.token_logprobs(self.policy(tokens[:, :-1]), tokens[:, 1:])
        with torch.no_grad():
            ref = lk.token_logprobs(self.ref(tokens[:, :-1]), tokens[:, 1:])
        return -(lp * (tokens[:, 1:].float() - 3)).mean() + self.kl(lp, ref)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.policy.parameters(), lr=0.05)


class Steps(Callback):
    """The (step, refreshes) pairs at each batch end, after the refresh callback."""

    def __init__(self, refresh: lk.ReferenceRefresh) -> None:
        self.refresh, self.rows = refresh, []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.rows.append((trainer.global_step, self.refresh.refreshes))

    def on_train_epoch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.rows.append(("epoch", trainer.current_epoch, self.refresh.refreshes))


def test_every_n_epochs_two_refreshes_at_the_end_of_epochs_2_and_4_only(tmp_path: Path) -> None:
    # catches (current_epoch % n == 0): a refresh after epochs 1 and 3 instead
    module = PolicyAndRef(steps=2)
    refresh = lk.ReferenceRefresh(every_n_epochs=2)
    rec = Steps(refresh)
    make_quiet_trainer(tmp_path, max_epochs=4, callbacks=[refresh, rec]).fit(module)
    epochs = [row[1:] for row in rec.rows if row[0] == "epoch"]
    assert epochs == [(0, 0), (1, 1), (2, 1), (3, 2)]
    assert (refresh.refreshes, refresh.last_step) == (2, 8)
    assert all(torch.equal(module.ref.state_dict()[k], v) for k, v in module.policy.state_dict().items())


def test_refreshes_are_counted_and_logged_after_fit(tmp_path: Path) -> None:
    # every 2 of 7 steps: 3 refreshes. Catches a count that is not incremented, incremented per
    # batch, or logged before the refresh of the last step
    module = PolicyAndRef(steps=7)
    refresh = lk.ReferenceRefresh(every_n_steps=2, alpha=0.5)
    trainer = make_quiet_trainer(tmp_path, max_epochs=1, callbacks=[refresh])
    trainer.fit(module)
    assert (refresh.refreshes, refresh.last_step) == (3, 6)
    assert float(trainer.callback_metrics["ref/refreshes"]) == 3.0
    assert float(trainer.callback_metrics["ref/last_step"]) == 6.0
    assert refresh.state_dict()["refreshes"] == 3


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")  # the resumed run saves no checkpoint
def test_a_resume_past_every_n_steps_refreshes_at_the_next_multiple_only(tmp_path: Path) -> None:
    # every 3 steps, checkpoint after step 4 (past the first refresh at 3). The resumed run must
    # refresh at 6 only, as the uninterrupted one. Catches a step counter that restarts at 0 on
    # resume (a spurious refresh at step 5: 5 // 3 > 0 // 3) and a count not restored.
    def run(root: Path, ckpt: Optional[Path]) -> tuple[lk.ReferenceRefresh, Steps, PolicyAndRef]:
        module = PolicyAndRef(steps=8)
        refresh = lk.ReferenceRefresh(every_n_steps=3, alpha=0.5)
        rec = Steps(refresh)
        saves = [ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=4, save_top_k=-1)]
        saves = saves if ckpt is None else []  # the resumed run saves nothing
        trainer = make_quiet_trainer(root, max_epochs=1, callbacks=[refresh, rec, *saves], enable_checkpointing=ckpt is None)
        if ckpt is None:
            trainer.fit(module)
        else:
            with pytest.warns(UserWarning, match="resuming from a checkpoint that ended before the epoch ended"):
                trainer.fit(module, ckpt_path=ckpt)
        return refresh, rec, module

    full, full_rec, full_module = run(tmp_path / "a", None)
    assert [r for r in full_rec.rows if r[0] != "epoch"] == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 2), (7, 2), (8, 2)]
    resumed, rec, module = run(tmp_path / "b", tmp_path / "ckpt" / "step=4.ckpt")
    assert [r for r in rec.rows if r[0] != "epoch"] == [(5, 1), (6, 2), (7, 2), (8, 2)]
    assert resumed.state_dict() == full.state_dict()
    for k, v in full_module.ref.state_dict().items():
        assert torch.equal(module.ref.state_dict()[k], v), k


def test_buffers_false_leaves_the_references_floating_buffers_alone(tmp_path: Path) -> None:
    # catches `buffers` ignored (the reference's scale would become the policy's 1.0)
    module = PolicyAndRef(steps=2)
    refresh = lk.ReferenceRefresh(every_n_steps=1, buffers=False)
    make_quiet_trainer(tmp_path, max_epochs=1, callbacks=[refresh]).fit(module)
    assert refresh.refreshes == 2
    assert module.ref.scale.item() == pytest.approx(1.1) and module.policy.scale.item() == 1.0
    assert module.ref.calls.item() == 1
    for name, p in module.policy.named_parameters():
        assert torch.equal(dict(module.ref.named_parameters())[name], p), name
    # and mixed with buffers=True (the default): the test can fail
    ref, pol = TinyLM(1), TinyLM(0)
    mix_modules_(ref, pol, 0.5)
    assert ref.scale.item() == pytest.approx(1.05)


def test_mix_copies_integer_tensors_exactly_and_mix_modules_leaves_them_below_a_hard_reset() -> None:
    # an integer tensor cannot hold a mix: mix_ copies it, with no float round trip (2**53 + 1 is
    # not a float64); mix_modules_ copies a counter on a hard reset only. Catches integers mixed in
    # a float dtype and written back (truncated or rounded), and a counter moved by a soft update.
    big = 2**53 + 1
    ref, pol = torch.tensor([0, 5], dtype=torch.int64), torch.tensor([big, -7], dtype=torch.int64)
    out = mix_(ref, pol, 0.5)
    assert out is ref and ref.dtype == torch.int64 and ref.tolist() == [big, -7]
    r, p = TinyLM(1), TinyLM(0)
    p.calls.fill_(big)
    mix_modules_(r, p, 0.5)
    assert r.calls.item() == 1
    mix_modules_(r, p, 1.0)
    assert r.calls.item() == big


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")  # the resumed run saves no checkpoint
def test_a_reset_controller_after_a_resume_restores_the_coefficient_of_the_start_of_training(tmp_path: Path) -> None:
    # the adaptive coefficient moves from 0.2; checkpoint after step 3; refresh (and restore) at step 4.
    # The resumed run must restore 0.2, the value at the start of training, as the uninterrupted one.
    # Catches initial_coefs taken after the checkpoint's state was loaded (the moved value) or not
    # restored from the checkpoint.
    class Rollouts(PolicyAndRef):
        def train_dataloader(self) -> Any:
            data = [{"scores": torch.zeros(B), "logprobs": torch.zeros(B, T), "ref_logprobs": torch.full((B, T), -0.9),
                     "mask": torch.ones(B, T, dtype=torch.bool)} for _ in range(self.steps)]
            return torch.utils.data.DataLoader(data, batch_size=None)

        def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
            return super().training_step(tokens_of_step(0), batch_idx) + 0 * batch["rewards"].sum()

    def run(root: Path, ckpt: Optional[Path], init: float = 0.2) -> list[float]:
        coefs: list[float] = []
        reward = lk.KLRewardCallback("k1", lk.AdaptiveKLController(init, target_kl=0.5, horizon=10))

        class Coef(Callback):
            def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
                coefs.append(reward.controller.value)

        refresh = lk.ReferenceRefresh(every_n_steps=4, reset_controller=True, kl_metric=reward)
        saves = [ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)]
        saves = saves if ckpt is None else []  # the resumed run saves nothing
        trainer = make_quiet_trainer(root, max_epochs=1, callbacks=[reward, refresh, Coef(), *saves],
                                     enable_checkpointing=ckpt is None)
        if ckpt is None:
            trainer.fit(Rollouts(steps=5))
        else:
            with pytest.warns(UserWarning, match="resuming from a checkpoint that ended before the epoch ended"):
                trainer.fit(Rollouts(steps=5), ckpt_path=ckpt)
        return coefs

    full = run(tmp_path / "a", None)
    assert full[2] != 0.2 and full[3] == 0.2 and full[4] != 0.2  # moved, restored at step 4, moved again
    resumed = run(tmp_path / "b", tmp_path / "ckpt" / "step=3.ckpt")
    assert resumed == pytest.approx(full[3:], rel=1e-12)
    # the start of training is the checkpoint's, even if the resumed callback is built with another value
    resumed = run(tmp_path / "c", tmp_path / "ckpt" / "step=3.ckpt", init=0.5)
    assert resumed == pytest.approx(full[3:], rel=1e-12)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_fold_leaves_an_inactive_second_adapter_alone() -> None:
    # two LoRA adapters, "default" active: the policy is W + s B A of "default" only. Catches a fold
    # of every adapter the layer holds (the inactive one would move the reference and lose its B).
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.Qwen2Config(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    base = transformers.Qwen2ForCausalLM(config).eval()
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, peft.LoraConfig(**lora))
    model.add_adapter("other", peft.LoraConfig(**lora))
    model.set_adapter("default")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and "other" in m.lora_A]
    assert layers
    before = {id(m): (m.base_layer.weight.detach().clone(), m.lora_B["default"].weight.detach().clone(),
                      m.lora_B["other"].weight.detach().clone()) for m in layers}
    assert fold_adapters_(model, 0.5) == len(layers)  # one active adapter per layer
    for m in layers:
        w, b_default, b_other = before[id(m)]
        delta = m.scaling["default"] * (b_default.double() @ m.lora_A["default"].weight.double())
        assert_close(m.base_layer.weight.double(), w.double() + 0.5 * delta, rtol=0, atol=1e-6)
        assert_close(m.lora_B["default"].weight, 0.5 * b_default, rtol=0, atol=0)
        assert torch.equal(m.lora_B["other"].weight, b_other)


def test_a_checkpoint_is_not_saved_after_a_non_finite_kl(tmp_path: Path) -> None:
    # step 2's global KL is NaN (a NaN reference log-prob): the adaptive controller records the fault
    # and leaves beta as it was; the checkpoint after step 2 reads the coefficient and must raise
    # instead of saving a state that hides the fault. Catches a checkpoint path that does not read the
    # fault (the callback's state_dict, which reads the controller's coefficient).
    class Rollouts(PolicyAndRef):
        def train_dataloader(self) -> Any:
            data = [{"scores": torch.zeros(B), "logprobs": torch.zeros(B, T),
                     "ref_logprobs": torch.full((B, T), -0.5 if i != 1 else math.nan),
                     "mask": torch.ones(B, T, dtype=torch.bool)} for i in range(self.steps)]
            return torch.utils.data.DataLoader(data, batch_size=None)

        def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
            return super().training_step(tokens_of_step(0), batch_idx) + 0 * batch["rewards"].nan_to_num().sum()

    reward = lk.KLRewardCallback("k1", lk.AdaptiveKLController(0.2, target_kl=0.5, horizon=10))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    # log_every_n_steps=50: the callback's own check at logging time does not come before the checkpoint
    trainer = make_quiet_trainer(tmp_path, max_epochs=1, callbacks=[reward, ckpt], enable_checkpointing=True,
                                 log_every_n_steps=50)
    with pytest.raises(ValueError, match="non-finite KL"):
        trainer.fit(Rollouts(steps=4))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step=1.ckpt"]
