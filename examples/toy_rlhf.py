r"""RL fine-tuning of a small language model with KL control, end to end on a CPU.

    python examples/toy_rlhf.py fit --config examples/configs/grpo_k3plus.yaml

Two stages, one command:

1. **Reference.** A tiny GPT (pre-LN decoder blocks, causal self-attention, a 13-token vocabulary)
   is pretrained for a few hundred steps on a synthetic corpus that this file generates: digit
   strings from a Markov chain that mostly counts up (``3 4 5 6 ...``). The result is cached under
   ``runs/toy_rlhf/reference/`` keyed by its configuration, frozen as the reference, and copied into
   the policy.
2. **RL.** The policy is fine-tuned on-policy toward a reward of our choice: the share of the
   response that is the digit ``7`` (``score = count(7) / max_new_tokens``, in ``[0, 1]``). The
   reference scores about 0.06; the all-7 answer scores 1 but is far from the reference, so the
   reward and the KL pull in opposite directions and the KL control decides where the policy lands.

Rollouts are sampled from the *current* policy inside the data pipeline
(:class:`lightning_kl.OnPolicyRollouts`, served by :class:`RolloutDataModule`). Each batch is a dict with ``logprobs``, ``ref_logprobs``,
``scores``, ``mask`` (and more), so a :class:`lightning_kl.KLRewardCallback` in the Trainer shapes
``rewards`` before ``training_step`` sees the batch. The dataset has a length, which makes
Lightning fetch each batch just in time (no prefetch): every rollout comes from the policy as it
is after the previous update.

Notation: ``b`` sequences in a rollout batch, ``p`` prompt length (with BOS), ``t`` response length
(``max_new_tokens``), ``V`` vocabulary size.

The configs in ``examples/configs/``:

* ``grpo_k3plus.yaml``: group-relative advantages (8 samples per prompt), KL **in the loss** with
  ``k3+`` (k3's value, the k2 gradient) through :class:`lightning_kl.KLPenaltyLoss`.
* ``ppo_adaptive_k1.yaml``: KL **in the reward** with ``k1`` through ``KLRewardCallback``, its
  coefficient steered by ``AdaptiveKLController`` toward a target KL. A critic-free PPO: each
  token's advantage is its return-to-go (the score at the end minus the KL penalties from that
  token on), whitened over the batch; PPO's clipped ratio over 2 epochs x 2 minibatches per rollout.
* ``ppo_fixed_k1.yaml``: the same with a larger fixed coefficient.
* ``grpo_k3plus_refresh_hard.yaml``, ``grpo_k3plus_refresh_ema.yaml``: ``grpo_k3plus.yaml`` with a moving
  reference (:class:`lightning_kl.ReferenceRefresh`: a hard reset every 50 steps, or an EMA of the
  policy); measured by ``examples/refresh_study.py``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_kl as lk

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests): find the siblings
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runs  # noqa: E402  (examples/_runs.py: pretraining and its cache, rollout loader, metrics CSV, plots)

# ---------------------------------------------------------------------------------------------
# vocabulary and the synthetic corpus

N_DIGITS = 10
BOS, EOS, PAD = 10, 11, 12
VOCAB_SIZE = 13


def sample_corpus(
    n: int,
    *,
    p_step: float,
    min_digits: int,
    max_digits: int,
    generator: torch.Generator,
) -> Tensor:
    """``n`` corpus lines ``BOS d1 .. dL EOS PAD..`` as a ``[n, max_digits + 2]`` long tensor.

    The digits follow a Markov chain: the next digit is ``prev + 1 (mod 10)`` with probability
    ``p_step`` and uniform otherwise; the length ``L`` is uniform in ``[min_digits, max_digits]``.
    """
    width = max_digits + 2
    digits = torch.empty(n, max_digits, dtype=torch.long)
    digits[:, 0] = torch.randint(N_DIGITS, (n,), generator=generator)
    step = torch.rand(n, max_digits, generator=generator) < p_step
    jump = torch.randint(N_DIGITS, (n, max_digits), generator=generator)
    for i in range(1, max_digits):
        digits[:, i] = torch.where(step[:, i], (digits[:, i - 1] + 1) % N_DIGITS, jump[:, i])
    lengths = torch.randint(min_digits, max_digits + 1, (n,), generator=generator)
    out = torch.full((n, width), PAD, dtype=torch.long)
    out[:, 0] = BOS
    pos = torch.arange(max_digits).expand(n, -1)
    out[:, 1:-1] = torch.where(pos < lengths[:, None], digits, PAD)
    out.scatter_(1, (lengths + 1)[:, None], EOS)
    return out


# ---------------------------------------------------------------------------------------------
# the language model


class Block(nn.Module):
    """A pre-LN decoder block: causal multi-head self-attention and an MLP, both residual."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style causal LM: token + learned position embeddings, decoder blocks, tied output.

    ``forward(tokens [b, n]) -> logits [b, n, V]``; position ``i`` predicts token ``i + 1``.
    """

    def __init__(self, d_model: int = 64, n_layer: int = 2, n_head: int = 4, block_size: int = 32) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"`d_model` ({d_model}) must be divisible by `n_head` ({n_head}).")
        self.block_size = block_size
        self.tok = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        n = tokens.shape[1]
        if n > self.block_size:
            raise ValueError(f"sequence of {n} tokens is longer than block_size={self.block_size}.")
        x = self.tok(tokens) + self.pos(torch.arange(n, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.T


# ---------------------------------------------------------------------------------------------
# rollout maths: plain functions


@torch.no_grad()
def generate(model: nn.Module, prompts: Tensor, max_new_tokens: int) -> tuple[Tensor, Tensor]:
    """Sample ``max_new_tokens`` tokens after ``prompts [b, p]`` at temperature 1.

    Returns ``tokens [b, p + t]`` (PAD after a sequence's EOS) and ``mask [b, t]``: True on the
    response tokens up to and including the first EOS.
    """
    tokens = prompts
    done = torch.zeros(prompts.shape[0], dtype=torch.bool, device=prompts.device)
    masks = []
    for _ in range(max_new_tokens):
        probs = torch.softmax(model(tokens)[:, -1].float(), dim=-1)
        nxt = torch.multinomial(probs, 1).squeeze(-1)
        masks.append(~done)
        nxt = torch.where(done, PAD, nxt)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        done = done | (nxt == EOS)
    return tokens, torch.stack(masks, dim=1)


def response_logits(model: nn.Module, tokens: Tensor, prompt_len: int) -> Tensor:
    """Logits ``[b, t, V]`` of the response tokens ``tokens[:, prompt_len:]`` (one forward pass)."""
    return model(tokens[:, :-1])[:, prompt_len - 1 :]


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log softmax(logits)[..., tokens]``: ``[b, t, V]`` and ``[b, t]`` -> ``[b, t]`` (float32).

    Chunked and exact (:func:`lightning_kl.token_logprobs`): no float32 copy of the logits is kept
    for backward. PAD after a sequence's EOS is a valid id; the mask drops those positions later.
    """
    return lk.token_logprobs(logits, tokens)


def exact_kl(logits: Tensor, ref_logits: Tensor) -> Tensor:
    r"""Per-token :math:`\sum_v \pi(v) (\log \pi(v) - \log \pi_{ref}(v))`: ``[b, t, V]`` -> ``[b, t]``.

    The exact KL of the next-token distributions, a diagnostic that no estimator choice affects.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def count_score(tokens: Tensor, mask: Tensor, target: int) -> Tensor:
    """The reward: the share of the ``t`` response slots holding ``target``: ``[b, t]`` -> ``[b]``."""
    return ((tokens == target) & mask).sum(-1).float() / tokens.shape[-1]


def group_advantages(rewards: Tensor, mask: Tensor, group: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: each sequence's return, normalized within its group, on every token: ``[b, t]``.

    ``rewards [b, t]`` (0 on padding), ``group [b]`` the prompt index of each sequence.
    A group whose returns are all equal gets advantage 0.
    """
    ret = torch.where(mask, rewards, 0.0).sum(-1)
    return _runs.group_advantages(ret, group, eps)[:, None].expand_as(rewards)


def whitened_returns_to_go(rewards: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE with a batch baseline: ``G_t = sum_{s >= t} r_s``, whitened over valid tokens.

    A token is credited only with the rewards (and KL penalties) that come after it.
    """
    r = torch.where(mask, rewards, 0.0)
    rtg = r.flip(-1).cumsum(-1).flip(-1)
    valid = rtg[mask]
    adv = (rtg - valid.mean()) / (valid.std(unbiased=False) + eps)
    return torch.where(mask, adv, 0.0)


def clipped_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate, token-mean over ``mask``; returns the loss and the clipped fraction."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    loss = lk.aggregate(-torch.minimum(unclipped, clipped), mask, "token-mean")
    clipfrac = lk.aggregate((clipped < unclipped).float(), mask, "token-mean")
    return loss, clipfrac.detach()


# ---------------------------------------------------------------------------------------------
# the data pipeline: rollouts from the current policy


class RolloutDataModule(pl.LightningDataModule):
    """The environment: the corpus, the prompts, the reward, and the rollout stream.

    Args:
        p_step: probability that the corpus' next digit is the previous one plus 1.
        min_digits, max_digits: corpus line lengths.
        prompt_digits: digits of a corpus line given as the prompt (after BOS).
        max_new_tokens: response length ``t``.
        target_token: the digit the reward counts.
        prompts_per_rollout, group_size: a rollout batch is ``group_size`` samples of each of
            ``prompts_per_rollout`` prompts.
        rollouts: rollout batches per epoch (one ``training_step`` each).
        reference_samples: samples drawn from the reference at the start to measure its reward.
    """

    def __init__(
        self,
        p_step: float = 0.6,
        min_digits: int = 6,
        max_digits: int = 14,
        prompt_digits: int = 4,
        max_new_tokens: int = 10,
        target_token: int = 7,
        prompts_per_rollout: int = 16,
        group_size: int = 8,
        rollouts: int = 150,
        reference_samples: int = 1024,
    ) -> None:
        super().__init__()
        if not 0 <= p_step <= 1:
            raise ValueError(f"`p_step` must be in [0, 1], got {p_step!r}.")
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits!r} and {max_digits!r}.")
        if not 1 <= prompt_digits <= min_digits:
            raise ValueError(f"`prompt_digits` must be in [1, min_digits={min_digits}], got {prompt_digits!r}.")
        if not 0 <= target_token < N_DIGITS:
            raise ValueError(f"`target_token` must be a digit in [0, {N_DIGITS - 1}], got {target_token!r}.")
        for name, value in [("max_new_tokens", max_new_tokens), ("prompts_per_rollout", prompts_per_rollout),
                            ("group_size", group_size), ("rollouts", rollouts),
                            ("reference_samples", reference_samples)]:
            if not value >= 1:
                raise ValueError(f"`{name}` must be >= 1, got {value!r}.")
        self.save_hyperparameters()

    def corpus_config(self) -> dict[str, Any]:
        h = self.hparams
        return {"p_step": h.p_step, "min_digits": h.min_digits, "max_digits": h.max_digits}

    def sample_corpus(self, n: int, generator: torch.Generator) -> Tensor:
        return sample_corpus(n, generator=generator, **self.corpus_config())

    @property
    def prompt_len(self) -> int:
        return 1 + self.hparams.prompt_digits

    def prompts(self, n: int, device: torch.device) -> Tensor:
        """``n`` prompts ``[n, p]``: BOS and the first digits of fresh corpus lines."""
        generator = torch.Generator().manual_seed(int(torch.randint(2**62, ())))
        return self.sample_corpus(n, generator)[:, : self.prompt_len].to(device)

    @torch.no_grad()
    def rollout(self, module: "ToyRLHF", n_prompts: Optional[int] = None) -> dict[str, Tensor]:
        """One rollout batch from ``module.policy``'s current weights (``b = n_prompts * group_size``).

        A dict: ``tokens [b, p + t]``, ``mask [b, t]`` (bool), ``logprobs [b, t]`` (the sampling
        policy's), ``ref_logprobs [b, t]``, ``ref_logits [b, t, V]``, ``scores [b]``, ``group [b]``
        (prompt index), ``true_kl [b, t]`` (exact per-token KL, a diagnostic).
        """
        h = self.hparams
        n_prompts = h.prompts_per_rollout if n_prompts is None else n_prompts
        prompts = self.prompts(n_prompts, module.device).repeat_interleave(h.group_size, dim=0)
        tokens, mask = generate(module.policy, prompts, h.max_new_tokens)
        response = tokens[:, self.prompt_len :]
        logits = response_logits(module.policy, tokens, self.prompt_len)
        ref_logits = response_logits(module.ref, tokens, self.prompt_len)
        return {
            "tokens": tokens,
            "mask": mask,
            "logprobs": token_logprobs(logits, response),
            "ref_logprobs": token_logprobs(ref_logits, response),
            "ref_logits": ref_logits,
            "scores": count_score(response, mask, h.target_token),
            "group": torch.arange(n_prompts, device=tokens.device).repeat_interleave(h.group_size),
            "true_kl": torch.where(mask, exact_kl(logits, ref_logits), 0.0),
        }

    @torch.no_grad()
    def mean_score(self, model: nn.Module, n: Optional[int] = None) -> float:
        """The mean reward of ``n`` (default ``reference_samples``) samples from ``model``."""
        n = self.hparams.reference_samples if n is None else n
        device = next(model.parameters()).device
        tokens, mask = generate(model, self.prompts(n, device), self.hparams.max_new_tokens)
        return float(count_score(tokens[:, self.prompt_len :], mask, self.hparams.target_token).mean())

    def train_dataloader(self) -> DataLoader:
        module = self.trainer.lightning_module if self.trainer is not None else None
        if not isinstance(module, ToyRLHF):
            raise RuntimeError("RolloutDataModule samples from the policy of a ToyRLHF module attached to the Trainer.")
        return _runs.rollout_loader(functools.partial(self.rollout, module), self.hparams.rollouts)


# ---------------------------------------------------------------------------------------------
# the LightningModule


class ToyRLHF(pl.LightningModule):
    """A policy, its frozen reference, and a clipped policy-gradient step with an optional KL loss.

    Args:
        d_model, n_layer, n_head, block_size: the :class:`TinyGPT` shape.
        pretrain_steps, pretrain_batch_size, pretrain_lr, pretrain_seed: stage 1, the reference.
        cache_dir: where the pretrained reference is cached, one file per configuration.
        lr: the RL learning rate (AdamW).
        kl_estimator: the KL estimator of the loss (one of ``lightning_kl.EstimatorName``), or None
            for no KL in the loss (KL in the reward only, through ``KLRewardCallback``).
        kl_coef, kl_agg: the loss coefficient and aggregation of :class:`lightning_kl.KLPenaltyLoss`;
            the coefficient is a number or a controller (``class_path: lightning_kl.TargetKLController``
            in the YAML), moved once per optimizer step by the KL of that step.
        kl_level: ``"token"`` (each token's KL given its prefix) or ``"sequence"`` (the KL of whole
            responses: the loss adds the KL-to-go gradient term; see :mod:`lightning_kl.sequence`).
        advantage: ``"grpo"`` (returns normalized within each prompt's group) or ``"rtg"``
            (returns-to-go whitened over the batch, so a token is charged only the KL that follows it).
        ppo_epochs, minibatches: optimizer steps per rollout = ``ppo_epochs * minibatches``.
        clip_eps: PPO's ratio clip (only bites after the first optimizer step on a rollout).
        max_grad_norm: gradient clipping.
        kl_old_logprob: pass the sampler's log-probs to the KL loss as ``old_logprob`` (importance
            weights: every sampled estimator's expected gradient is then exact, ``k1`` and ``k3``
            included); False: the plain estimator, as frameworks without the weights use it.
    """

    def __init__(
        self,
        d_model: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        block_size: int = 32,
        pretrain_steps: int = 400,
        pretrain_batch_size: int = 128,
        pretrain_lr: float = 3e-3,
        pretrain_seed: int = 0,
        cache_dir: str = "runs/toy_rlhf/reference",
        lr: float = 1e-3,
        kl_estimator: Optional[lk.EstimatorName] = "k3+",
        kl_coef: Union[float, lk.KLController] = 0.3,
        kl_agg: lk.AggMode = "token-mean",
        kl_level: lk.Level = "token",
        advantage: str = "grpo",
        ppo_epochs: int = 1,
        minibatches: int = 1,
        clip_eps: float = 0.2,
        max_grad_norm: float = 1.0,
        kl_old_logprob: bool = True,
    ) -> None:
        super().__init__()
        if advantage not in ("grpo", "rtg"):
            raise ValueError(f"`advantage` must be 'grpo' or 'rtg', got {advantage!r}.")
        for name, value, least in [("pretrain_steps", pretrain_steps, 0), ("ppo_epochs", ppo_epochs, 1),
                                   ("minibatches", minibatches, 1)]:
            if not (isinstance(value, int) and value >= least):
                raise ValueError(f"`{name}` must be an integer >= {least}, got {value!r}.")
        self.save_hyperparameters()
        self.automatic_optimization = False  # several optimizer steps per rollout (PPO epochs)
        self.policy = TinyGPT(d_model, n_layer, n_head, block_size)
        self.ref = TinyGPT(d_model, n_layer, n_head, block_size).requires_grad_(False)
        # built (and the name validated) here, before any training step
        self.kl = (
            lk.KLPenaltyLoss(kl_estimator, coef=kl_coef, agg=kl_agg, level=kl_level) if kl_estimator is not None else None
        )
        self.ref_reward = float("nan")
        self.pretrain_seconds = 0.0
        self.reference_path: Optional[Path] = None
        self.reference_cached = False

    # -- stage 1: the reference ----------------------------------------------------------------

    def reference_config(self, corpus: dict[str, Any]) -> dict[str, Any]:
        """What the pretrained reference is a function of (its cache key)."""
        h = self.hparams
        return {
            "model": [h.d_model, h.n_layer, h.n_head, h.block_size],
            "pretrain": [h.pretrain_steps, h.pretrain_batch_size, h.pretrain_lr, h.pretrain_seed],
            "corpus": corpus,
            "format": 1,
        }

    def pretrain(self, dm: RolloutDataModule) -> dict[str, Tensor]:
        """Train a fresh TinyGPT on the corpus; a function of the configuration alone (own RNG)."""
        h = self.hparams

        def batch_loss(model: nn.Module, generator: torch.Generator) -> Tensor:
            lines = dm.sample_corpus(h.pretrain_batch_size, generator).to(self.device)
            logits = model(lines[:, :-1])
            return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), lines[:, 1:].reshape(-1), ignore_index=PAD)

        return _runs.pretrain(lambda: TinyGPT(h.d_model, h.n_layer, h.n_head, h.block_size).to(self.device),
                              batch_loss, steps=h.pretrain_steps, lr=h.pretrain_lr, seed=h.pretrain_seed, tag="toy_rlhf")

    def load_or_pretrain_reference(self, dm: RolloutDataModule) -> None:
        max_len = max(dm.hparams.max_digits + 2, dm.prompt_len + dm.hparams.max_new_tokens)
        if max_len > self.hparams.block_size:
            raise ValueError(f"`block_size` {self.hparams.block_size} is too small for sequences of {max_len} tokens.")
        state, self.reference_path, self.reference_cached, self.pretrain_seconds = _runs.load_or_pretrain(
            self.hparams.cache_dir, self.reference_config(dm.corpus_config()), lambda: self.pretrain(dm), "toy_rlhf"
        )
        self.ref.load_state_dict(state)
        self.policy.load_state_dict(state)

    def setup(self, stage: str) -> None:
        if stage != "fit":
            return
        dm = self.trainer.datamodule
        if not isinstance(dm, RolloutDataModule):
            raise RuntimeError("ToyRLHF is trained with a RolloutDataModule (it holds the corpus and the reward).")
        self.load_or_pretrain_reference(dm)

    def on_fit_start(self) -> None:
        self.ref_reward = self.trainer.datamodule.mean_score(self.ref)

    # -- stage 2: RL ---------------------------------------------------------------------------

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.policy.parameters(), lr=self.hparams.lr, weight_decay=0.0)

    def kl_term(
        self,
        logprobs: Tensor,
        ref_logprobs: Tensor,
        mask: Tensor,
        old_logprobs: Tensor,
        logits: Tensor,
        ref_logits: Tensor,
    ) -> Tensor:
        """The KL term of the loss (0 when the KL is in the reward only).

        ``logprobs``, ``ref_logprobs``, ``old_logprobs`` (the sampling policy's), ``mask``: ``[b, t]``;
        ``logits`` (the policy's, differentiable), ``ref_logits``: ``[b, t, V]`` over the response,
        for estimators that need whole distributions (``full``). ``old_logprobs`` importance
        weights a sampled estimate (see :func:`lightning_kl.kl_penalty`): the weights are 1 on the
        first, on-policy, step over a rollout and correct the later PPO epochs.
        """
        if self.kl is None:
            return logprobs.new_zeros(())
        if self.kl.spec.base == "full":
            # the exact KL over the vocabulary, from both models' logits (no sampled tokens, so no
            # importance weights); temperature 1, as in the sampling
            # at the sequence level, the sampled tokens' log-probs carry the KL-to-go term
            sampled = logprobs if self.kl.level == "sequence" else None
            return self.kl(logits, ref_logits, mask, sampled_logprob=sampled)
        return self.kl(logprobs, ref_logprobs, mask, old_logprob=old_logprobs if self.hparams.kl_old_logprob else None)

    def advantages(self, batch: dict[str, Tensor]) -> Tensor:
        mask = batch["mask"]
        rewards = batch.get("rewards")  # written by KLRewardCallback: scores - beta * kl
        if rewards is None:
            # no callback: the sequence's score at its last valid token, as the callback does
            last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask
            rewards = torch.where(last, batch["scores"][:, None], 0.0)
        if self.hparams.advantage == "grpo":
            return group_advantages(rewards, mask, batch["group"])
        return whitened_returns_to_go(rewards, mask)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        h = self.hparams
        opt = self.optimizers()
        adv = self.advantages(batch)
        prompt_len = batch["tokens"].shape[1] - batch["mask"].shape[1]
        response = batch["tokens"][:, prompt_len:]
        n, device = response.shape[0], response.device
        for _ in range(h.ppo_epochs):
            order = torch.randperm(n, device=device) if h.minibatches > 1 else torch.arange(n, device=device)
            for idx in order.chunk(h.minibatches):
                logits = response_logits(self.policy, batch["tokens"][idx], prompt_len)
                logprobs = token_logprobs(logits, response[idx])
                mask = batch["mask"][idx]
                pg_loss, clipfrac = clipped_policy_loss(logprobs, batch["logprobs"][idx], adv[idx], mask, h.clip_eps)
                kl_loss = self.kl_term(
                    logprobs, batch["ref_logprobs"][idx], mask, batch["logprobs"][idx], logits, batch["ref_logits"][idx]
                )
                loss = pg_loss + kl_loss
                opt.zero_grad()
                self.manual_backward(loss)
                self.clip_gradients(opt, gradient_clip_val=h.max_grad_norm, gradient_clip_algorithm="norm")
                opt.step()

        mask = batch["mask"]
        self.log("train/reward", batch["scores"].mean(), prog_bar=True)
        self.log("train/kl", lk.aggregate(batch["true_kl"], mask, "token-mean"), prog_bar=True)
        # the KL of whole responses: the sum of the exact per-token KLs (its mean over responses is exact)
        self.log("train/kl_response", lk.aggregate(batch["true_kl"], mask, "seq-mean-token-sum"))
        self.log("train/ref_reward", self.ref_reward)
        self.log("train/loss", loss.detach())
        self.log("train/clipfrac", clipfrac)
        self.log("train/response_len", mask.sum(-1).float().mean())
        if self.kl is not None:
            self.log("train/kl_loss_coef", self.kl.coef)
            self.log("train/kl_est", self.kl.metric)
        return loss.detach()


# ---------------------------------------------------------------------------------------------
# the end of a run: plot and summary (from the CSV the run wrote)


def plot_run(
    series: dict[str, list[tuple[int, float]]], out: str | Path, title: str, target_kl: Optional[float] = None
) -> None:
    """Reward, KL and coefficient against the rollout step, in three panels, as a PNG."""
    plt = _runs.pyplot()

    def xy(key: str) -> tuple[list[int], list[float]]:
        pts = series.get(key, [])
        return [s for s, _ in pts], [v for _, v in pts]

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    ax = axes[0]
    ax.plot(*xy("train/reward"), label="policy (rollout mean)")
    if series.get("train/ref_reward"):
        ax.axhline(series["train/ref_reward"][0][1], color="gray", ls="--", label="reference")
    ax.set_title("reward (share of 7s)")
    ax.legend()
    ax = axes[1]
    ax.plot(*xy("train/kl"), label="exact KL (from logits)")
    if "kl/value" in series:
        ax.plot(*xy("kl/value"), alpha=0.7, label="the controller's KL (estimate)")
    if "train/kl_est" in series:
        ax.plot(*xy("train/kl_est"), alpha=0.7, label="KLPenaltyLoss estimate")
    if target_kl is not None:
        ax.axhline(target_kl, color="gray", ls="--", label="target")
    ax.set_title("KL(policy || reference)")
    ax.legend()
    ax = axes[2]
    if "kl/coef" in series:
        ax.plot(*xy("kl/coef"), label="the controlled coefficient")
    if "train/kl_loss_coef" in series:
        ax.plot(*xy("train/kl_loss_coef"), label="coef in the loss")
    ax.set_title("KL coefficient")
    ax.legend()
    for ax in axes:
        ax.set_xlabel("rollout step")
    _runs.save_figure(fig, title, out)


def find_target_kl(trainer: pl.Trainer) -> Optional[float]:
    loss = getattr(trainer.lightning_module, "kl", None)
    ctl = getattr(loss, "controller", None)
    ctl = getattr(ctl, "controller", ctl)  # a KLSchedule's controller
    if isinstance(ctl, (lk.AdaptiveKLController, lk.TargetKLController)):
        return ctl.target_kl
    for cb in trainer.callbacks:
        if isinstance(cb, lk.KLRewardCallback) and isinstance(cb.controller, lk.AdaptiveKLController):
            return cb.controller.target_kl
    return None


class ToyRLHFCLI(LightningCLI):
    """LightningCLI that adds TensorBoard next to the CSV logger when installed, and reports at the end."""

    def before_fit(self) -> None:
        self._start = time.perf_counter()
        loggers = self.trainer.loggers
        csv_logger = _runs.find_csv_logger(loggers)
        if csv_logger is None:
            return
        try:
            from lightning.pytorch.loggers import TensorBoardLogger

            import tensorboard  # noqa: F401
        except ImportError:
            return
        if not any(isinstance(lg, TensorBoardLogger) for lg in loggers):
            tb = TensorBoardLogger(
                save_dir=csv_logger.save_dir, name=csv_logger.name, version=csv_logger.version, sub_dir="tensorboard"
            )
            self.trainer.loggers = [*loggers, tb]

    def after_fit(self) -> None:
        seconds = time.perf_counter() - self._start
        trainer, module = self.trainer, self.model
        if trainer.fast_dev_run or not isinstance(module, ToyRLHF):
            return
        run = _runs.finished_run(trainer, "toy_rlhf", seconds)
        if run is None:
            return
        csv_logger, series = run
        log_dir = Path(csv_logger.log_dir)
        target_kl = find_target_kl(trainer)
        png = log_dir / "toy_rlhf.png"
        plot_run(series, png, f"{csv_logger.name}: estimator {self._estimator_label()}", target_kl)
        reward = _runs.last_quarter_mean(_runs.values(series["train/reward"]))
        kl = _runs.values(series["train/kl"])
        how = "loaded from cache" if module.reference_cached else "pretrained"
        lines = [
            f"[toy_rlhf] {len(kl)} rollouts in {seconds:.1f} s (reference {how} in {module.pretrain_seconds:.1f} s)",
            f"  reward : reference {module.ref_reward:.3f} -> final {reward:.3f} (mean over the last quarter of rollouts)",
            f"  KL     : mean {sum(kl) / len(kl):.4f}, last quarter {_runs.last_quarter_mean(kl):.4f} "
            "nats/token (exact, from logits)",
        ]
        if "train/kl_response" in series:
            lines.append(f"           last quarter {_runs.last_quarter_mean(_runs.values(series['train/kl_response'])):.4f} nats/response (exact)")
        if target_kl is not None and "kl/value" in series:
            lines.append(
                f"  control: target {target_kl:g}; the controller's KL over the last quarter "
                f"{_runs.last_quarter_mean(_runs.values(series['kl/value'])):.4f}, beta {series['kl/coef'][0][1]:.4f} -> {series['kl/coef'][-1][1]:.4f}"
            )
        lines += [
            f"  files  : metrics {log_dir / 'metrics.csv'}",
            f"           plot    {png}",
            f"           config  {log_dir / 'config.yaml'}",
            *[f"           tensorboard {lg.log_dir}" for lg in trainer.loggers if lg is not csv_logger],
            f"           reference {module.reference_path}",
            f"  check  : python examples/check_run.py {Path(csv_logger.save_dir)}",
        ]
        print("\n".join(lines))

    def _estimator_label(self) -> str:
        parts = []
        if isinstance(self.model, ToyRLHF) and self.model.kl is not None:
            level = ", sequence level" if self.model.kl.level == "sequence" else ""
            parts.append(f"{self.model.kl.estimator} in the loss{level}")
        for cb in self.trainer.callbacks:
            if isinstance(cb, lk.KLRewardCallback):
                parts.append(f"{cb.estimator} in the reward ({type(cb.controller).__name__})")
        return ", ".join(parts) or "none"


def main(args: Optional[list[str]] = None) -> ToyRLHFCLI:
    # the rollout dataset has a length on purpose (no prefetch, see lk.OnPolicyRollouts) and is read in
    # this process (num_workers=0), so Lightning's warning about lengths and workers does not apply
    warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")
    return ToyRLHFCLI(ToyRLHF, RolloutDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        # the matrices are tiny: a second intra-op thread buys little, and two OpenMP threads
        # that spin-wait on a busy 2-core machine can make a run ten times slower
        torch.set_num_threads(1)
    main()
