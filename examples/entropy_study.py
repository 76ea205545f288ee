r"""Entropy control on the toy: no bonus, a fixed bonus, a target entropy, and the 80/20 token mask.

    python examples/entropy_study.py --out runs/entropy_study --png docs/entropy_toy.png
    python examples/entropy_study.py --config examples/configs/entropy_hf.yaml --png docs/entropy_hf.png

The toy of ``examples/toy_rlhf.py`` (GRPO, ``k3+`` in the loss) rewards the share of 7s in the
response: the all-7 answer is the optimum, so the policy's entropy collapses as it learns. Six arms,
each for every seed:

* ``none``: no entropy term;
* ``fixed``: ``lk.EntropyBonus(coef=FIXED)`` added to the loss;
* ``target``: ``lk.EntropyBonus(coef=lk.TargetEntropyController(TARGET, init_coef=FIXED))`` (dual ascent);
* ``target-floor``: the same with ``coef_min=0.05``;
* ``target-additive``: the same with TRL's additive rule (``rule="additive"``, ``coef_delta=0.02``);
* ``top20``: no bonus; the policy gradient only on the 20 % of tokens of highest entropy
  (``lk.high_entropy_mask(entropy, mask, top=0.2)``, "Beyond the 80/20 rule").

The entropy logged is the token-mean entropy of the policy's sampling distribution over the
rollout's response tokens (``EntropyBonus.metric`` where there is a bonus, the same quantity from
``lk.token_entropy`` otherwise). Writes ``out/entropy_study.csv`` (one row per run: the entropy and
the reward over the last quarter of the rollouts, the final coefficient, the seconds), per-step
series in ``out/series.json``, and with ``--png`` a plot of entropy and reward over the rollouts
(mean over seeds, the band their range). Runs already in the CSV are not run again.

With ``--config``, the Hugging Face example instead (``examples/hf_grpo.py`` through its own CLI, as
``examples/kl_control_study.py`` drives it): the YAML names the example's base configuration and its
overrides, the seeds, the output folder, the target drawn on the plot, and the arms, each a mapping of
the model's arguments (``entropy_coef``: a number or a ``TargetEntropyController`` by ``class_path``;
``top_entropy``). The entropy is the example's ``train/entropy`` (the rollout's token-mean entropy of
the sampling distribution), the reward its accuracy (``train/acc``); the same CSV and plot.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import os
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

import lightning_kl as lk  # noqa: E402
import toy_rlhf  # noqa: E402

ARMS = ("none", "fixed", "target", "target-floor", "target-additive", "top20")
FIXED, TARGET = 0.1, 0.8  # the bonus's coefficient (and the controllers' start); the target, nats per token
FIELDS = ("arm", "seed", "entropy_last", "reward_last", "entropy_first", "coef_final", "kept_fraction", "rollouts", "seconds")


class EntropyToy(toy_rlhf.ToyRLHF):
    """The toy's GRPO step with an optional :class:`lightning_kl.EntropyBonus` and the high-entropy mask.

    Args:
        entropy_bonus: None, or the bonus added to the loss.
        top_entropy: the fraction of the rollout's valid tokens, by entropy, that the policy
            gradient is taken on (1: all; TRL's ``top_entropy_quantile``).
        kwargs: :class:`toy_rlhf.ToyRLHF`'s.
    """

    def __init__(self, entropy_bonus: Optional[lk.EntropyBonus] = None, top_entropy: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.entropy_bonus = entropy_bonus
        self.top_entropy = top_entropy
        self.series: dict[str, list[float]] = {"reward": [], "entropy": [], "coef": [], "kept": []}

    def save_hyperparameters(self, *args: Any, ignore: Any = None, frame: Any = None, logger: bool = True) -> None:
        """The toy's ``save_hyperparameters()`` (called in its ``__init__``), less ``entropy_bonus``: a module,
        saved with the state dict (Lightning warns about an ``nn.Module`` among the hyperparameters)."""
        ignore = ["entropy_bonus", *([ignore] if isinstance(ignore, str) else list(ignore or []))]
        frame = frame if frame is not None else inspect.currentframe().f_back  # the caller's, as Lightning reads it
        super().save_hyperparameters(*args, ignore=ignore, frame=frame, logger=logger)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        opt = self.optimizers()
        adv = self.advantages(batch)
        prompt_len = batch["tokens"].shape[1] - batch["mask"].shape[1]
        response = batch["tokens"][:, prompt_len:]
        mask = batch["mask"]
        logits = toy_rlhf.response_logits(self.policy, batch["tokens"], prompt_len)
        logprobs = toy_rlhf.token_logprobs(logits, response)
        if self.entropy_bonus is not None:
            coef = self.entropy_bonus.coef  # the coefficient this step uses
            bonus = self.entropy_bonus(logits, mask)
            entropy = float(self.entropy_bonus.metric.compute())
            self.entropy_bonus.metric.reset()
        else:
            coef, bonus = 0.0, logprobs.new_zeros(())
            entropy = float(lk.aggregate(lk.token_entropy(logits.detach(), mask), mask))
        pg_mask = mask
        if self.top_entropy < 1.0:
            pg_mask = lk.high_entropy_mask(lk.token_entropy(logits.detach(), mask), mask, top=self.top_entropy)
        pg_loss, _ = toy_rlhf.clipped_policy_loss(logprobs, batch["logprobs"], adv, pg_mask, self.hparams.clip_eps)
        kl_loss = self.kl_term(logprobs, batch["ref_logprobs"], mask, batch["logprobs"], logits, batch["ref_logits"])
        loss = pg_loss + kl_loss + bonus
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")
        opt.step()
        self.series["reward"].append(float(batch["scores"].mean()))
        self.series["entropy"].append(entropy)
        self.series["coef"].append(coef)
        self.series["kept"].append(float(pg_mask.sum() / mask.sum()))
        return loss.detach()


def make_bonus(arm: str) -> Optional[lk.EntropyBonus]:
    if arm == "fixed":
        return lk.EntropyBonus(coef=FIXED)
    if arm == "target":
        return lk.EntropyBonus(coef=lk.TargetEntropyController(TARGET, init_coef=FIXED, step_size=0.3))
    if arm == "target-floor":  # the same with a floor: the coefficient cannot wind down while the entropy is high
        return lk.EntropyBonus(coef=lk.TargetEntropyController(TARGET, init_coef=FIXED, step_size=0.3, coef_min=0.05))
    if arm == "target-additive":
        return lk.EntropyBonus(coef=lk.TargetEntropyController(TARGET, init_coef=FIXED, rule="additive", coef_delta=0.02))
    return None


def run(arm: str, seed: int, rollouts: int, out: Path, pretrain_steps: int = 400) -> tuple[dict[str, Any], dict[str, list[float]]]:
    pl.seed_everything(seed, verbose=False)
    model = EntropyToy(entropy_bonus=make_bonus(arm), top_entropy=0.2 if arm == "top20" else 1.0,
                       kl_estimator="k3+", kl_coef=0.05, pretrain_steps=pretrain_steps,
                       cache_dir=str(out.parent / "toy_rlhf" / "reference"))
    data = toy_rlhf.RolloutDataModule(prompts_per_rollout=8, group_size=8, rollouts=rollouts)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, default_root_dir=str(out))
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    s = model.series
    q = max(1, len(s["reward"]) // 4)
    row = {
        "arm": arm, "seed": seed,
        "entropy_last": sum(s["entropy"][-q:]) / q, "reward_last": sum(s["reward"][-q:]) / q,
        "entropy_first": s["entropy"][0], "coef_final": s["coef"][-1],
        "kept_fraction": sum(s["kept"]) / len(s["kept"]), "rollouts": len(s["reward"]), "seconds": round(seconds, 1),
    }
    return row, s


# ---------------------------------------------------------------------------------------------
# the Hugging Face example (--config)

HF_KEYS = {"base_config", "overrides", "out", "target", "seeds", "arms"}


def load_hf(path: str | Path) -> dict[str, Any]:
    """The HF study's YAML, checked: its keys, and each arm a mapping of the model's arguments."""
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, dict) or set(raw) - HF_KEYS or {"base_config", "arms"} - set(raw):
        raise ValueError(f"{path}: a mapping with the keys {sorted(HF_KEYS)} (base_config and arms required).")
    if not isinstance(raw["arms"], dict) or not all(isinstance(a, dict) for a in raw["arms"].values()):
        raise ValueError(f"{path}: `arms` must map each arm's name to the model's arguments, got {raw['arms']!r}.")
    raw.setdefault("seeds", [0])
    raw.setdefault("overrides", {})
    raw["out"] = Path(raw.get("out") or "runs/entropy_study/hf")
    return raw


def run_hf(study: dict[str, Any], arm: str, seed: int) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """One run of ``examples/hf_grpo.py`` for ``arm`` and ``seed``; its row and its series."""
    import importlib

    import yaml

    import _runs
    import frontier

    with open(study["base_config"]) as f:
        config = frontier.merge(yaml.safe_load(f), study["overrides"])
    out = study["out"]
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
              "init_args": {"save_dir": str(out / "runs"), "name": arm, "version": f"seed{seed}"}}
    config = frontier.merge(config, {"seed_everything": seed, "model": study["arms"][arm],
                                     "trainer": {"logger": logger, "default_root_dir": str(out)}})
    path = out / "configs" / f"{arm}-seed{seed}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    start = time.perf_counter()
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        cli = importlib.import_module("hf_grpo").main(["fit", "--config", str(path)])
    finally:
        sys.argv = argv
    seconds = time.perf_counter() - start
    m = _runs.read_metrics(Path(_runs.find_csv_logger(cli.trainer.loggers).log_dir) / "metrics.csv")
    s = {"entropy": _runs.values(m["train/entropy"]), "reward": _runs.values(m["train/acc"])}
    n = len(s["reward"])
    bonus = cli.model.entropy
    # the coefficient each step used: the controller's as logged, a number's, or none
    s["coef"] = _runs.values(m["entropy/coef"]) if "entropy/coef" in m else [bonus.coef if bonus is not None else 0.0] * n
    s["kept"] = _runs.values(m["train/pg_tokens"]) if "train/pg_tokens" in m else [1.0] * n
    q = max(1, n // 4)
    row = {
        "arm": arm, "seed": seed,
        "entropy_last": sum(s["entropy"][-q:]) / q, "reward_last": sum(s["reward"][-q:]) / q,
        "entropy_first": s["entropy"][0], "coef_final": s["coef"][-1],
        "kept_fraction": sum(s["kept"]) / n, "rollouts": n, "seconds": round(seconds, 1),
    }
    return row, s


def plot(series: dict[str, dict[str, list[float]]], rows: list[dict[str, Any]], png: Path,
         arms: tuple[str, ...] = ARMS, target: float = TARGET,
         title: str = "toy GRPO (k3+ 0.05 in the loss)", reward: str = "reward (share of 7s)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    palette = {"none": "black", "fixed": "tab:blue", "target": "tab:green", "target-floor": "tab:purple",
               "target-additive": "tab:olive", "top20": "tab:red"}
    colors = {arm: palette.get(arm, f"C{i}") for i, arm in enumerate(arms)}
    for arm in arms:
        runs = [v for k, v in series.items() if k.split("/")[0] == arm]
        if not runs:
            continue
        for ax, key in zip(axes, ("entropy", "reward", "coef")):
            if key == "coef" and not any(c for r in runs for c in r["coef"]):  # no bonus in this arm
                continue
            n = min(len(r[key]) for r in runs)
            stacked = torch.tensor([r[key][:n] for r in runs])
            x = range(n)
            ax.plot(x, stacked.mean(0), color=colors[arm], label=arm)
            ax.fill_between(x, stacked.min(0).values, stacked.max(0).values, color=colors[arm], alpha=0.15)
    axes[0].axhline(target, color="gray", ls="--", lw=1, label=f"target {target}")
    axes[0].set(title="policy entropy (nats/token, token-mean)", xlabel="rollout")
    axes[1].set(title=reward, xlabel="rollout")
    axes[2].set(title="entropy coefficient applied", xlabel="rollout")
    axes[2].set_yscale("symlog", linthresh=1e-3)
    axes[0].legend(fontsize=8)
    seeds = len({int(r["seed"]) for r in rows})
    fig.suptitle(f"{title}, {seeds} seeds: mean and range")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/entropy_study")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--rollouts", type=int, default=50)
    p.add_argument("--png", default=None)
    p.add_argument("--pretrain-steps", type=int, default=400, help="the toy reference's pretraining (cached)")
    p.add_argument("--config", default=None, help="the Hugging Face example's study (e.g. examples/configs/entropy_hf.yaml); "
                                                  "--out, --seeds, --arms, --rollouts are the YAML's then")
    args = p.parse_args(argv)
    study = load_hf(args.config) if args.config else None
    arms = tuple(study["arms"]) if study else ARMS
    if study:
        args.out, args.seeds, args.arms = study["out"], study["seeds"], list(arms)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table, store = out / "entropy_study.csv", out / "series.json"
    rows = list(csv.DictReader(open(table))) if table.exists() else []
    series: dict[str, Any] = json.loads(store.read_text()) if store.exists() else {}
    for seed in args.seeds:  # every arm of a seed, then the next seed
        for arm in args.arms:
            if f"{arm}/{seed}" in series:
                continue
            row, s = run_hf(study, arm, seed) if study else run(arm, seed, args.rollouts, out, args.pretrain_steps)
            print(f"[entropy_study] {arm:>15} seed {seed}: entropy {row['entropy_first']:.3f} -> {row['entropy_last']:.3f}, "
                  f"reward {row['reward_last']:.3f}, coef {row['coef_final']:.4f}, {row['seconds']} s", flush=True)
            rows.append(row)
            series[f"{arm}/{seed}"] = s
            with open(table, "w", newline="") as f:
                writer = csv.DictWriter(f, FIELDS)
                writer.writeheader()
                writer.writerows(rows)
            store.write_text(json.dumps(series))
    summary = []
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        if mine:
            mean = {k: sum(float(r[k]) for r in mine) / len(mine) for k in ("entropy_last", "reward_last", "coef_final", "kept_fraction")}
            summary.append(f"| {arm} | {len(mine)} | {mean['entropy_last']:.3f} | {mean['reward_last']:.3f} | "
                           f"{mean['coef_final']:.4f} | {mean['kept_fraction']:.2f} |")
    print("| arm | seeds | entropy, last quarter | reward, last quarter | final coef | tokens with gradient |")
    print("|---|---|---|---|---|---|")
    print("\n".join(summary))
    if args.png and study:
        plot(series, rows, Path(args.png), arms, float(study.get("target", TARGET)),
             "Hugging Face example, GRPO (Qwen2 + LoRA, k3+ 0.3 per response in the loss)", "accuracy")
    elif args.png:
        plot(series, rows, Path(args.png))


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    main()
