"""On-policy distillation with the sampled estimators: a teacher's log-probs of the student's own tokens
in place of the reference's (lk.kl_penalty, KLRewardCallback with ref_logprobs_key=), the OPD reward
-(log pi - log pi_T) at discount 0, in a real Lightning loop; and the served top-k side in a loop."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk

V, T = 6, 3


def _teacher_logits() -> torch.Tensor:
    return torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -2.0], [0.0, 3.0, 0.0, 0.0, -1.0, 1.0], [1.0, 1.0, 1.0, -3.0, 2.0, 0.0]])


def test_k1_of_the_teachers_sampled_logprobs_is_an_unbiased_reverse_kl_and_its_negative_the_opd_reward():
    """By enumeration over the student's draws: E_{y ~ p}[log p(y) - log q(y)] = KL(p || q) per position, and
    kl_penalty('k1') with the teacher's log-probs is that per-token value; -k1 is the OPD reward."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(T, V, generator=g, dtype=torch.float64)
    lp_all, lq_all = z.log_softmax(-1), _teacher_logits().double().log_softmax(-1)
    ids = torch.arange(V).expand(T, V)  # every token at every position: the enumeration
    lp, lq = lp_all.gather(-1, ids), lq_all.gather(-1, ids)
    k1 = lk.kl_penalty(lp, lq, "k1")
    assert_close(k1, lp - lq, rtol=0, atol=0)
    expected = (lp_all.exp() * k1).sum(-1)
    full = (lp_all.exp() * (lp_all - lq_all)).sum(-1)
    assert_close(expected, full, rtol=1e-12, atol=0)
    # k3 is unbiased too, with the k3+ gradient d: the same estimators as toward a reference
    assert_close((lp_all.exp() * lk.kl_penalty(lp, lq, "k3")).sum(-1), full, rtol=1e-12, atol=0)


def test_sequence_level_keeps_the_values_and_adds_the_kl_to_go_to_the_gradient():
    """level='sequence' with a teacher's log-probs: the token values are the token level's; the gradient of
    token t gains sum_{s > t} d_s (the KL of whole responses), what the discount-0 reward leaves out."""
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(2, 4, generator=g, dtype=torch.float64)).requires_grad_()
    lq = -torch.rand(2, 4, generator=g, dtype=torch.float64)
    tok = lk.kl_penalty(lp, lq, "k1", level="token")
    seq = lk.kl_penalty(lp, lq, "k1", level="sequence")
    assert_close(tok, seq, rtol=0, atol=0)
    g_tok, = torch.autograd.grad(tok.sum(), lp)
    g_seq, = torch.autograd.grad(seq.sum(), lp)
    d = (lp - lq).detach()
    to_go = d.flip(-1).cumsum(-1).flip(-1) - d  # sum over s > t
    assert_close(g_seq - g_tok, to_go, rtol=1e-12, atol=1e-14)


class _Student(pl.LightningModule):
    """A per-position categorical student (logits [T, V]), trained by REINFORCE on the OPD reward that
    KLRewardCallback writes into each rollout batch: advantage = reward of the token itself (discount 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(T, V))
        self.seen: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append({k: v.detach().clone() for k, v in batch.items()})
        tokens = batch["tokens"]
        lp = self.logits.log_softmax(-1)[torch.arange(T).expand_as(tokens), tokens]  # [b, T]
        adv = batch["rewards"].detach()
        return lk.aggregate(-(adv * lp), batch["mask"], "token-mean")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _Rollouts(torch.utils.data.IterableDataset):
    """On-policy batches: tokens drawn from the student's current distribution, with the student's log-probs
    (the behaviour policy's) and the teacher's log-probs of the same tokens, as a server would return them."""

    def __init__(self, module: _Student, steps: int, batch: int = 64) -> None:
        self.module, self.steps, self.batch = module, steps, batch
        self.teacher = _teacher_logits().log_softmax(-1)

    def __iter__(self):
        g = torch.Generator().manual_seed(7)
        for _ in range(self.steps):
            with torch.no_grad():
                lp_all = self.module.logits.log_softmax(-1)
                tokens = torch.stack([torch.multinomial(lp_all[t].exp(), self.batch, replacement=True, generator=g) for t in range(T)], -1)
                pos = torch.arange(T).expand_as(tokens)
                mask = torch.ones_like(tokens, dtype=torch.bool)
                mask[: self.batch // 4, -1] = False  # some responses one token shorter
                yield {
                    "tokens": tokens, "mask": mask, "scores": torch.zeros(self.batch),
                    "logprobs": lp_all[pos, tokens], "teacher_logprobs": self.teacher[pos, tokens],
                }


def _kl_to_teacher(module: _Student) -> float:
    p = module.logits.detach().log_softmax(-1)
    q = _teacher_logits().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def test_opd_as_a_reward_through_kl_reward_callback_in_a_trainer(quiet_trainer):
    """KLRewardCallback('k1', FixedKLController(1.0), ref_logprobs_key='teacher_logprobs') writes the OPD
    reward -(log pi - log pi_T) per token (0 on padding), and REINFORCE on it at discount 0 brings the student
    to the teacher: the exact KL(student || teacher) falls from log-uniform's to near 0."""
    module = _Student()
    callback = lk.KLRewardCallback("k1", lk.FixedKLController(1.0), ref_logprobs_key="teacher_logprobs", log_prefix="opd/")
    start = _kl_to_teacher(module)
    trainer = quiet_trainer(max_steps=150, callbacks=[callback])
    loader = torch.utils.data.DataLoader(_Rollouts(module, 150), batch_size=None)
    trainer.fit(module, loader)
    first = module.seen[0]
    want = -(first["logprobs"] - first["teacher_logprobs"]).masked_fill(~first["mask"], 0)
    assert_close(first["rewards"], want, rtol=0, atol=1e-6)
    assert (first["rewards"][~first["mask"]] == 0).all()
    end = _kl_to_teacher(module)
    assert start > 1.0 and end < 0.05 * start, (start, end)


def test_opd_reward_in_a_fast_dev_run_logs_the_global_kl(quiet_trainer):
    module = _Student()
    callback = lk.KLRewardCallback("k1", lk.FixedKLController(1.0), ref_logprobs_key="teacher_logprobs", log_prefix="opd/")
    trainer = quiet_trainer(fast_dev_run=1, callbacks=[callback])
    trainer.fit(module, torch.utils.data.DataLoader(_Rollouts(module, 1), batch_size=None))
    batch = module.seen[0]
    kl = (batch["logprobs"] - batch["teacher_logprobs"]).masked_fill(~batch["mask"], 0)
    per_seq = kl.sum(-1) / batch["mask"].sum(-1)
    assert float(trainer.callback_metrics["opd/value"]) == pytest.approx(float(per_seq.mean()), rel=1e-5)
    assert float(trainer.callback_metrics["opd/coef"]) == 1.0


class _TopKStudent(pl.LightningModule):
    """The student trained on the exact reverse KL to a served teacher's top-2 and its tail (lk.TopK)."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(T, V))

    def training_step(self, batch, batch_idx):
        topk = lk.TopK(batch["topk_ids"][0], batch["topk_logprobs"][0])
        kl = lk.full_kl(self.logits, topk, divergence="reverse")
        self.log("kl", kl.mean())
        return kl.mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def test_a_served_top_k_teacher_in_a_trainer_loop(quiet_trainer):
    """From a served top-2 per position (and its tail) the student learns the teacher's cells: its mass
    on the two ids and on the rest matches the teacher's (the coarsened KL goes to 0; within the tail the
    teacher says nothing, and the student's spread there is free)."""
    lq_all = _teacher_logits().log_softmax(-1)
    lq, ids = lq_all.topk(2, dim=-1)
    data = [{"topk_ids": ids, "topk_logprobs": lq}] * 200
    module = _TopKStudent()
    trainer = quiet_trainer(max_steps=200)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1))
    p = module.logits.detach().softmax(-1)
    assert_close(p.gather(-1, ids), lq.exp(), rtol=0, atol=2e-3)
    assert float(lk.full_kl(module.logits.detach(), lk.TopK(ids, lq)).max()) < 1e-4
    assert math.isfinite(float(trainer.callback_metrics["kl"]))
