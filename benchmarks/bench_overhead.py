"""What the KL machinery adds to a training step: ``KLRewardCallback`` plus ``KLPenaltyLoss`` and its metric.

A small causal LM (``nn.TransformerEncoder`` with a causal mask: ``--layers`` layers, width
``--width``, vocabulary 64, 32 tokens, batch 32) is trained by a Lightning ``Trainer`` on fixed
rollout batches (dicts with ``tokens``, ``mask``, ``logprobs``, ``ref_logprobs``, ``scores``,
``rewards``), two ways:

* **baseline**: ``training_step`` computes the response log-probabilities and a REINFORCE loss from
  ``batch["rewards"]`` (precomputed); it logs the loss.
* **with KL**: the same, plus a ``KLRewardCallback("k1")`` with an ``AdaptiveKLController`` that
  rewrites ``batch["rewards"]`` before the step, plus ``KLPenaltyLoss("k3+")`` in the loss with its
  ``KLMetric`` logged by ``self.log("train/kl", self.kl.metric)``.

The time of a step runs from the first ``on_train_batch_start`` hook (a timing callback placed
before ``KLRewardCallback``) to ``on_train_batch_end`` (after backward and the optimizer step). The
two variants alternate, ``--rounds`` fits of ``--steps`` steps each; the first steps of every fit are
dropped; the overhead is the median over rounds of each round's ratio of median steps (paired by
round, as both variants of a round ran under the same load).

Run: ``python benchmarks/bench_overhead.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

import lightning_kl as lk

VOCAB, LENGTH, BATCH = 64, 32, 32


class CausalLM(nn.Module):
    """Token + position embeddings, a causal ``nn.TransformerEncoder``, a linear head: ``[b, n] -> [b, n, V]``."""

    def __init__(self, width: int, layers: int, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(LENGTH, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(LENGTH), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        n = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(n, device=tokens.device))
        return self.head(self.body(x, mask=self.causal[:n, :n], is_causal=True))


class Policy(pl.LightningModule):
    def __init__(self, width: int, layers: int, variant: str) -> None:
        super().__init__()
        self.model = CausalLM(width, layers)
        self.kl = lk.KLPenaltyLoss("k3+", coef=0.01) if variant == "kl" else None
        self.extra_logs = variant == "logs"

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        tokens, mask = batch["tokens"], batch["mask"]
        logits = self.model(tokens[:, :-1])
        logprob = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        rewards = batch["rewards"]
        returns = torch.where(mask, rewards, 0.0).flip(-1).cumsum(-1).flip(-1)
        advantages = returns - lk.aggregate(returns, mask)
        loss = lk.aggregate(-advantages.detach() * logprob, mask)
        if self.kl is not None:
            loss = loss + self.kl(logprob, batch["ref_logprobs"], mask)
            self.log("train/kl", self.kl.metric)
        if self.extra_logs:  # as many self.log calls as the KL variant adds, and nothing else
            self.log("kl/coef", 0.05)
            self.log("kl/value", 0.1)
            self.log("kl/empty_seqs", 0.0)
            self.log("train/kl", loss.detach())
        self.log("train/loss", loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Rollouts(Dataset):
    """Fixed rollout batches: sampled once, served as dicts (what a rollout pipeline would yield)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            lengths = torch.randint(LENGTH // 2, LENGTH + 1, (BATCH,), generator=g)
            mask = torch.arange(LENGTH)[None] < lengths[:, None]
            scores = torch.rand(BATCH, generator=g)
            rewards = torch.zeros(BATCH, LENGTH).scatter_(1, (lengths - 1)[:, None], scores[:, None])
            self.items.append(
                {
                    "tokens": torch.randint(VOCAB, (BATCH, LENGTH + 1), generator=g),
                    "mask": mask,
                    "logprobs": -torch.rand(BATCH, LENGTH, generator=g) * 4,
                    "ref_logprobs": -torch.rand(BATCH, LENGTH, generator=g) * 4,
                    "scores": scores,
                    "rewards": rewards,  # the baseline's; the callback overwrites it
                }
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return self.items[i]


class StepTimer(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._t0)


def fit(variant: str, steps: int, width: int, layers: int, data: Rollouts) -> list[float]:
    torch.manual_seed(0)
    timer = StepTimer()
    callbacks: list[Callback] = [timer]
    if variant == "kl":
        controller = lk.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.5, horizon=1000)
        callbacks.append(lk.KLRewardCallback("k1", controller=controller))
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=os.path.join("runs", "bench_overhead"),
    )
    loader = DataLoader(data, batch_size=None, shuffle=False)
    trainer.fit(Policy(width, layers, variant), loader)
    return timer.times[min(5, steps // 4) :]  # drop the warm-up steps of every fit


def _us(f, reps: int = 300) -> float:
    for _ in range(20):
        f()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t0) / reps * 1e6


def library_breakdown(data: Rollouts) -> dict[str, float]:
    """The library's own work per step, outside a Trainer (microseconds): where the overhead goes."""
    batch = dict(data[0])
    callback = lk.KLRewardCallback("k1", controller=lk.AdaptiveKLController(0.05, 0.5, 1000))
    kl = lk.KLPenaltyLoss("k3+", coef=0.01)
    logprob = batch["logprobs"].clone().requires_grad_()

    def loss_step() -> None:
        kl(logprob, batch["ref_logprobs"], batch["mask"]).backward()

    def update() -> None:
        _, kl_sum, n_seqs = callback.shape_rewards(batch)
        callback.update_controller(*torch.stack([kl_sum, n_seqs]).tolist())

    return {
        "KLRewardCallback.shape_rewards + controller update": _us(update),
        "KLPenaltyLoss forward (with KLMetric.forward) + backward": _us(loss_step),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per fit")
    parser.add_argument("--rounds", type=int, default=8, help="fits of each variant, alternated")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 12 steps")
    args = parser.parse_args()
    steps, rounds = (12, 2) if args.quick else (args.steps, args.rounds)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    data = Rollouts(steps)
    variants = ("baseline", "kl", "logs")
    times: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {"kl": [], "logs": []}
    for _ in range(rounds):
        per_round = {}
        for variant in variants:
            steps_s = fit(variant, steps, args.width, args.layers, data)
            times[variant] += steps_s
            per_round[variant] = statistics.median(steps_s)
        # paired by round: the variants of a round ran under the same load on this shared machine
        for variant in ratios:
            ratios[variant].append(per_round[variant] / per_round["baseline"])
    median = {v: statistics.median(ts) for v, ts in times.items()}
    overhead = statistics.median(ratios["kl"]) - 1
    log_overhead = statistics.median(ratios["logs"]) - 1
    print(
        f"causal LM: {args.layers} layers, width {args.width}, vocab {VOCAB}, {LENGTH} tokens, batch {BATCH}; "
        f"{torch.get_num_threads()} threads; {rounds} alternated rounds of {steps} steps; "
        f"load average {os.getloadavg()[0]:.1f}\n"
    )
    print("| training step | median ms | overhead (median over rounds) |\n|---|---:|---:|")
    print(f"| baseline | {median['baseline'] * 1e3:.2f} | |")
    print(f"| with KLRewardCallback + KLPenaltyLoss + KLMetric | {median['kl'] * 1e3:.2f} | {100 * overhead:+.1f}% |")
    print(f"| baseline + 4 plain self.log calls (no KL) | {median['logs'] * 1e3:.2f} | {100 * log_overhead:+.1f}% |")
    print()
    print("per-round overhead of the KL parts: " + ", ".join(f"{100 * (r - 1):+.1f}%" for r in ratios["kl"]))
    verdict = "met" if overhead < 0.05 else "MISSED"
    base = median["baseline"]
    print(f"overhead: {100 * overhead:+.1f}% of a step, {1e3 * overhead * base:.2f} ms ({verdict}: target < 5%)")
    parts = library_breakdown(data)
    print("the library's own work per step, timed alone:")
    for what, us in parts.items():
        print(f"  {what}: {us:.0f} us ({100 * us * 1e-6 / base:.1f}% of a step)")
    print(
        f"the 4 self.log calls the KL parts make (kl/coef, kl/value, kl/empty_seqs, train/kl) cost {100 * log_overhead:+.1f}% "
        "by themselves, in Lightning"
    )

if __name__ == "__main__":
    main()
