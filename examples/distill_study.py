r"""On-policy distillation (OPD) against RL on the same budget, and the three directions of the OPD loss.

    python examples/distill_study.py --png docs/distill_study.png     # the table in docs/distillation.md

The toy of ``examples/toy_rlhf.py``: a tiny GPT pretrained on counting digit strings (the reference),
rewarded for the share of 7s in its 10-token response. Three stages, every model built in this file:

1. **The reference**, pretrained (cached under ``out/reference``, as the toy caches it).
2. **The teacher**: the reference trained by RL for ``--teacher-steps`` rollouts (GRPO, ``k3+`` to the
   reference in the loss at ``--kl-coef``, 0.3 as in ``examples/configs/grpo_k3plus.yaml``: the toy's
   recipe, run five times longer than the students; cached the same way). At 0.3 the teacher keeps the
   reference's spread (a reward near 0.3, some 7s among counting digits); ``--kl-coef 0.05`` gives a
   teacher that has collapsed onto the all-7 answer.
3. **The students**, each a fresh copy of the reference, every arm for every seed, ``--steps`` rollouts of
   ``--prompts x --group`` responses sampled from the student (the same samples, the same optimizer steps):

   * ``rl``: the teacher's own recipe on the task reward (GRPO, ``k3+`` at ``--kl-coef`` to the reference);
   * ``opd-k1``: OPD as a reward: ``KLRewardCallback("k1", ref_logprobs_key="teacher_logprobs")`` writes
     the per-token reward ``-(log pi - log pi_T)`` of the student's sampled tokens (no task score),
     each token's advantage its own reward (discount 0), the policy gradient on it;
   * ``reverse``, ``forward``, ``jsd``: OPD as the exact loss over the vocabulary,
     ``KLPenaltyLoss("full", divergence=...)`` (``lk.full_kl``) on the student's logits and the
     teacher's at the student's sampled prefixes: ``KL(pi || pi_T)``, ``KL(pi_T || pi)`` and the
     generalized JSD at ``beta = 0.5``.

Logged for every rollout, before its update: the task reward (the rollout's mean score), and the exact
``KL(pi || pi_T)`` and ``KL(pi_T || pi)`` to the teacher, token-means over the rollout's response tokens
(``lk.full_kl``). Writes ``out/distill_study.csv`` (one row per run), the series in ``out/series.json``,
with ``--png`` a plot (mean over seeds, the band their range), and prints the markdown table (mean and
sample standard deviation over the seeds).
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import lightning.pytorch as pl  # noqa: E402

import _runs  # noqa: E402
import lightning_kl as lk  # noqa: E402
import toy_rlhf  # noqa: E402

ARMS = ("rl", "opd-k1", "reverse", "forward", "jsd")
LOSSES = {
    "rl": "GRPO on the task reward, k3+ to the reference",
    "opd-k1": "OPD reward -(log pi - log pi_T), KLRewardCallback k1",
    "reverse": 'KLPenaltyLoss("full"), KL(pi ‖ pi_T)',
    "forward": 'KLPenaltyLoss("full", divergence="forward"), KL(pi_T ‖ pi)',
    "jsd": 'KLPenaltyLoss("full", divergence="jsd", beta=0.5)',
}
TEACHER_SEED = 1000  # the teacher's run: its own seed, one teacher for every student seed
FIELDS = ("arm", "seed", "reward_first", "reward_last", "rkl_first", "rkl_last", "fkl_last", "steps", "seconds")


def _trainer(callbacks: Optional[list[Any]] = None) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, callbacks=callbacks)


def _data(args: argparse.Namespace, rollouts: int) -> "DistillData":
    return DistillData(prompts_per_rollout=args.prompts, group_size=args.group, rollouts=rollouts,
                       reference_samples=args.eval_samples)


# ---------------------------------------------------------------------------------------------
# the teacher: the toy's RL run, much longer


def train_teacher(args: argparse.Namespace, cache: Path) -> tuple[dict[str, Tensor], bool, float]:
    """The teacher's state dict (trained, or loaded from ``cache``), whether it was loaded, and the seconds."""
    config = {"teacher": [args.teacher_steps, args.prompts, args.group, args.kl_coef, TEACHER_SEED],
              "reference": args.pretrain_steps, "format": 1}

    def fit() -> dict[str, Tensor]:
        pl.seed_everything(TEACHER_SEED, verbose=False)
        model = toy_rlhf.ToyRLHF(kl_estimator="k3+", kl_coef=args.kl_coef, pretrain_steps=args.pretrain_steps,
                                 cache_dir=str(cache))
        _trainer().fit(model, datamodule=toy_rlhf.RolloutDataModule(
            prompts_per_rollout=args.prompts, group_size=args.group, rollouts=args.teacher_steps, reference_samples=1))
        return {k: v.detach().clone() for k, v in model.policy.state_dict().items()}

    state, _, cached, seconds = _runs.load_or_pretrain(cache, config, fit, "distill_study")
    return state, cached, seconds


# ---------------------------------------------------------------------------------------------
# the students


class DistillData(toy_rlhf.RolloutDataModule):
    """The toy's rollouts with the teacher's side: ``teacher_logits [b, t, V]``, ``teacher_logprobs [b, t]``
    (the teacher's log-probs of the student's sampled tokens, as a server would return them) and
    ``opd_scores [b]`` (zeros: the OPD reward holds no task score)."""

    @torch.no_grad()
    def rollout(self, module: "DistillToy", n_prompts: Optional[int] = None) -> dict[str, Tensor]:
        batch = super().rollout(module, n_prompts)
        response = batch["tokens"][:, self.prompt_len:]
        teacher_logits = toy_rlhf.response_logits(module.teacher, batch["tokens"], self.prompt_len)
        batch["teacher_logits"] = teacher_logits
        batch["teacher_logprobs"] = toy_rlhf.token_logprobs(teacher_logits, response)
        batch["opd_scores"] = torch.zeros_like(batch["scores"])
        return batch


class DistillToy(toy_rlhf.ToyRLHF):
    """A student: the toy's policy and reference, a frozen teacher, and one arm's update (one step a rollout).

    Args:
        arm: one of :data:`ARMS`.
        teacher_state: the teacher's state dict (a :class:`toy_rlhf.TinyGPT` of the same shape).
        kwargs: :class:`toy_rlhf.ToyRLHF`'s.
    """

    def __init__(self, arm: str, teacher_state: dict[str, Tensor], **kwargs: Any) -> None:
        if arm not in ARMS:
            raise ValueError(f"`arm` must be one of {list(ARMS)}, got {arm!r}.")
        rl = arm == "rl"
        super().__init__(kl_estimator="k3+" if rl else None, **kwargs)
        self.arm = arm
        h = self.hparams
        self.teacher = toy_rlhf.TinyGPT(h.d_model, h.n_layer, h.n_head, h.block_size).requires_grad_(False)
        self.teacher.load_state_dict(teacher_state)
        self.opd_loss = None
        if arm in ("reverse", "forward", "jsd"):
            self.opd_loss = lk.KLPenaltyLoss("full", coef=1.0, divergence=arm, beta=0.5 if arm == "jsd" else None)
        self.series: dict[str, list[float]] = {"reward": [], "rkl": [], "fkl": []}

    def save_hyperparameters(self, *args: Any, ignore: Any = None, frame: Any = None, logger: bool = True) -> None:
        """The toy's, less ``teacher_state`` (tensors, loaded into ``self.teacher``)."""
        ignore = ["teacher_state", *([ignore] if isinstance(ignore, str) else list(ignore or []))]
        frame = frame if frame is not None else inspect.currentframe().f_back
        super().save_hyperparameters(*args, ignore=ignore, frame=frame, logger=logger)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        opt = self.optimizers()
        prompt_len = batch["tokens"].shape[1] - batch["mask"].shape[1]
        response, mask = batch["tokens"][:, prompt_len:], batch["mask"]
        logits = toy_rlhf.response_logits(self.policy, batch["tokens"], prompt_len)
        teacher_logits = batch["teacher_logits"]
        with torch.no_grad():  # the student as it sampled the rollout: the exact KLs to the teacher, both ways
            rkl = lk.aggregate(lk.full_kl(logits.detach(), teacher_logits, mask), mask)
            fkl = lk.aggregate(lk.full_kl(logits.detach(), teacher_logits, mask, divergence="forward"), mask)
        if self.opd_loss is not None:  # the exact divergence over the vocabulary at the student's prefixes
            loss = self.opd_loss(logits, teacher_logits, mask)
        else:
            logprobs = toy_rlhf.token_logprobs(logits, response)
            if self.arm == "rl":
                adv = self.advantages(batch)  # GRPO on the task score
            else:  # opd-k1: the rewards KLRewardCallback wrote, -(log pi - log pi_T); discount 0
                adv = batch["rewards"]
            loss, _ = toy_rlhf.clipped_policy_loss(logprobs, batch["logprobs"], adv, mask, self.hparams.clip_eps)
            loss = loss + self.kl_term(logprobs, batch["ref_logprobs"], mask, batch["logprobs"], logits, batch["ref_logits"])
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")
        opt.step()
        self.series["reward"].append(float(batch["scores"].mean()))
        self.series["rkl"].append(float(rkl))
        self.series["fkl"].append(float(fkl))
        return loss.detach()


def run(
    arm: str, seed: int, args: argparse.Namespace, teacher: dict[str, Tensor], cache: Path
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """One student: ``arm`` from ``seed``, ``args.steps`` rollouts; its table row and its series."""
    pl.seed_everything(seed, verbose=False)
    model = DistillToy(arm, teacher, kl_coef=args.kl_coef, pretrain_steps=args.pretrain_steps, cache_dir=str(cache))
    callbacks = []
    if arm == "opd-k1":
        callbacks.append(lk.KLRewardCallback("k1", lk.FixedKLController(1.0), scores_key="opd_scores",
                                             ref_logprobs_key="teacher_logprobs", log_prefix="opd/"))
    start = time.perf_counter()
    _trainer(callbacks).fit(model, datamodule=_data(args, args.steps))
    s = model.series
    q = max(1, len(s["reward"]) // 4)
    row = {"arm": arm, "seed": seed,
           "reward_first": sum(s["reward"][:q]) / q, "reward_last": sum(s["reward"][-q:]) / q,
           "rkl_first": s["rkl"][0], "rkl_last": sum(s["rkl"][-q:]) / q, "fkl_last": sum(s["fkl"][-q:]) / q,
           "steps": len(s["reward"]), "seconds": round(time.perf_counter() - start, 1)}
    return row, s


# ---------------------------------------------------------------------------------------------
# the table and the plot


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table(rows: list[dict[str, Any]], arms: tuple[str, ...]) -> list[str]:
    """The markdown table: per arm, mean ± sample std over its seeds."""
    lines = ["| arm | the student's update | seeds | reward, first quarter | reward, last quarter | "
             "KL(pi ‖ pi_T), last quarter | KL(pi_T ‖ pi), last quarter |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        cells = []
        for key in ("reward_first", "reward_last", "rkl_last", "fkl_last"):
            m, sd = mean_std([float(r[key]) for r in mine])
            cells.append(f"{m:.3f} ± {sd:.3f}")
        lines.append(f"| {arm} | {LOSSES[arm]} | {len(mine)} | " + " | ".join(cells) + " |")
    return lines


def plot(
    series: dict[str, dict[str, list[float]]], arms: tuple[str, ...], marks: dict[str, float], png: Path, seeds: int
) -> None:
    plt = _runs.pyplot()
    colors = {"rl": "black", "opd-k1": "tab:orange", "reverse": "tab:blue", "forward": "tab:green", "jsd": "tab:red"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for arm in arms:
        runs = [v for k, v in series.items() if k.split("/")[0] == arm]
        if not runs:
            continue
        for ax, key in zip(axes, ("reward", "rkl", "fkl")):
            n = min(len(r[key]) for r in runs)
            stacked = torch.tensor([r[key][:n] for r in runs])
            x = range(1, n + 1)
            ax.plot(x, stacked.mean(0), color=colors[arm], label=arm)
            ax.fill_between(x, stacked.min(0).values, stacked.max(0).values, color=colors[arm], alpha=0.15)
    axes[0].axhline(marks["teacher"], color="gray", ls="--", lw=1, label=f"teacher {marks['teacher']:.2f}")
    axes[0].axhline(marks["reference"], color="gray", ls=":", lw=1, label=f"reference {marks['reference']:.2f}")
    axes[0].set(title="task reward (share of 7s, rollout mean)", xlabel="rollout (one optimizer step each)")
    axes[1].set(title="exact KL(student ‖ teacher), nats/token", xlabel="rollout", yscale="log")
    axes[2].set(title="exact KL(teacher ‖ student), nats/token", xlabel="rollout", yscale="log")
    axes[0].legend(fontsize=8)
    png.parent.mkdir(parents=True, exist_ok=True)
    _runs.save_figure(fig, f"toy: OPD against RL and the three directions, {seeds} seeds (mean, band: range)", png)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/distill_study")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--steps", type=int, default=30, help="rollouts (one optimizer step each) per student")
    p.add_argument("--teacher-steps", type=int, default=150, help="the teacher's RL rollouts (cached)")
    p.add_argument("--kl-coef", type=float, default=0.3,
                   help="the RL recipe's k3+ coefficient toward the reference: the teacher's and the rl arm's")
    p.add_argument("--pretrain-steps", type=int, default=400, help="the reference's pretraining (cached)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    p.add_argument("--group", type=int, default=8, help="responses per prompt")
    p.add_argument("--eval-samples", type=int, default=1024, help="samples scoring the teacher and the reference")
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    for name in ("steps", "teacher_steps", "prompts", "group", "eval_samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def reference_state(args: argparse.Namespace, cache: Path) -> dict[str, Tensor]:
    """The pretrained reference's state dict (from the cache, or pretrained into it)."""
    toy = toy_rlhf.ToyRLHF(pretrain_steps=args.pretrain_steps, cache_dir=str(cache))
    toy.load_or_pretrain_reference(_data(args, 1))
    return toy.ref.state_dict()


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "reference"
    start = time.perf_counter()
    teacher, teacher_cached, teacher_seconds = train_teacher(args, cache)
    arms = tuple(a for a in ARMS if a in args.arms)
    rows, series = [], {}
    marks: dict[str, float] = {}
    for seed in args.seeds:
        for arm in arms:
            row, s = run(arm, seed, args, teacher, cache)
            print(f"[distill_study] {arm:>8} seed {seed}: reward {row['reward_first']:.3f} -> {row['reward_last']:.3f}, "
                  f"KL(pi || pi_T) {row['rkl_first']:.4f} -> {row['rkl_last']:.4f}, {row['seconds']} s", flush=True)
            rows.append(row)
            series[f"{arm}/{seed}"] = s
    with open(out / "distill_study.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "series.json").write_text(json.dumps(series))
    # the two marks of the plot: the teacher's and the reference's mean reward, from their own samples
    pl.seed_everything(TEACHER_SEED + 1, verbose=False)
    scorer = _data(args, 1)
    probe = toy_rlhf.TinyGPT()
    probe.load_state_dict(reference_state(args, cache))
    marks["reference"] = scorer.mean_score(probe)
    probe.load_state_dict(teacher)
    marks["teacher"] = scorer.mean_score(probe)
    total = time.perf_counter() - start
    how = "loaded from the cache" if teacher_cached else f"trained in {teacher_seconds:.1f} s"
    print(f"\nteacher: {args.teacher_steps} RL rollouts, k3+ {args.kl_coef:g} to the reference ({how}), "
          f"reward {marks['teacher']:.3f}; reference {marks['reference']:.3f} ({args.eval_samples} samples each)")
    print(f"students: {args.steps} rollouts of {args.prompts} x {args.group} responses each, seeds {args.seeds}; "
          f"{total:.0f} s in all on {platform.machine()} ({torch.get_num_threads()} thread(s))\n")
    print("\n".join(table(rows, arms)))
    if args.png:
        plot(series, arms, marks, Path(args.png), len(args.seeds))
    return rows


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    main()
