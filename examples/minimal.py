"""The smallest complete use of lightning-kl: a KL term in the loss, KL reward shaping, YAML config.

The policy is a product of categoricals (one per position) over a small vocabulary; the reward
counts the sampled tokens equal to 0. Rollouts are sampled from the current policy inside the data
pipeline, so ``KLRewardCallback`` shapes ``rewards`` before ``training_step`` sees the batch.

    python examples/minimal.py fit --config examples/configs/minimal.yaml
    python examples/minimal.py fit --config examples/configs/minimal.yaml --model.estimator low_var_kl+
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_kl as lk


class PositionPolicy(nn.Module):
    """``length`` independent categoricals over ``vocab`` tokens."""

    def __init__(self, vocab: int, length: int) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(length, vocab))

    def logprob(self, tokens: Tensor) -> Tensor:
        """``[b, t]`` log-probabilities of ``tokens`` ``[b, t]``."""
        return lk.token_logprobs(self.logits.expand(tokens.shape[0], -1, -1), tokens)

    def sample(self, batch_size: int) -> Tensor:
        return torch.distributions.Categorical(logits=self.logits).sample((batch_size,))


class KLBandit(pl.LightningModule):
    """REINFORCE with a mean baseline, a KL term in the loss, and rewards from ``KLRewardCallback``."""

    def __init__(
        self,
        estimator: lk.EstimatorName = "k3+",  # `--help` lists the names
        kl_coef: float = 0.05,
        vocab: int = 8,
        length: int = 6,
        batch_size: int = 32,
        num_batches: int = 50,
        lr: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.policy = PositionPolicy(vocab, length)
        self.ref = copy.deepcopy(self.policy).requires_grad_(False)
        self.kl = lk.KLPenaltyLoss(estimator, coef=kl_coef)  # a bad name fails here, before training

    @torch.no_grad()
    def rollout(self) -> dict[str, Tensor]:
        """One rollout batch sampled from the current policy."""
        batch_size = self.hparams.batch_size
        tokens = self.policy.sample(batch_size)
        # responses of random length: padded positions hold junk that must never matter
        lengths = torch.randint(1, tokens.shape[1] + 1, (batch_size,))
        mask = torch.arange(tokens.shape[1]) < lengths[:, None]
        logprobs = self.policy.logprob(tokens).masked_fill(~mask, float("nan"))
        ref_logprobs = self.ref.logprob(tokens).masked_fill(~mask, -1e10)
        scores = ((tokens == 0) & mask).float().sum(-1)  # one score per sequence
        return {"tokens": tokens, "mask": mask, "logprobs": logprobs, "ref_logprobs": ref_logprobs, "scores": scores}

    def train_dataloader(self) -> DataLoader:
        # OnPolicyRollouts has a length, so Lightning does not fetch a batch ahead: each rollout is
        # sampled from the policy that the previous training_step left behind (truly on-policy)
        return DataLoader(lk.OnPolicyRollouts(self.rollout, self.hparams.num_batches), batch_size=None)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        mask = batch["mask"]
        logprob = self.policy.logprob(batch["tokens"])
        # rewards come from KLRewardCallback when it is configured, else the raw scores
        rewards = batch["rewards"] if "rewards" in batch else batch["scores"]
        returns = rewards.sum(-1) if rewards.ndim == 2 else rewards
        advantages = (returns - returns.mean()).detach()
        policy_loss = -lk.aggregate(advantages[:, None] * logprob, mask, "token-mean")
        loss = policy_loss + self.kl(logprob, batch["ref_logprobs"], mask)
        self.log("train/kl", self.kl.metric, prog_bar=True)
        self.log("train/score", batch["scores"].mean(), prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.policy.parameters(), lr=self.hparams.lr)


def main() -> None:
    LightningCLI(KLBandit)


if __name__ == "__main__":
    main()
