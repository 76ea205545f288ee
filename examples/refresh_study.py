r"""Reference refresh, measured: the same run with a fixed reference, a hard reset and an EMA.

    python examples/refresh_study.py                 # both examples (8-10 min on a shared 2-core CPU)
    python examples/refresh_study.py --example toy   # the toy GPT only (examples/toy_rlhf.py)

For each example, three or four runs from one seed, identical but for :class:`lightning_kl.ReferenceRefresh`:

* ``toy`` (``examples/toy_rlhf.py``, GRPO with ``k3+`` in the loss, a separate reference model):
  ``grpo_k3plus.yaml`` (fixed reference), ``grpo_k3plus_refresh_hard.yaml`` (hard reset every 50
  steps, Adam's state cleared), ``grpo_k3plus_refresh_ema.yaml`` (``alpha=0.2`` every 10 steps) and
  ``grpo_k3plus_refresh_kl.yaml`` (a hard reset when the exact KL stays above 0.4 for 20 steps);
* ``hf`` (``examples/hf_grpo.py``, a Qwen2 with LoRA, the reference = the adapters-off model):
  ``hf_grpo_lora.yaml``, ``hf_grpo_lora_refresh_hard.yaml`` (adapters merged and restarted every
  100 steps) and ``hf_grpo_lora_refresh_ema.yaml`` (a share 0.2 folded every 20 steps).

It prints, per phase between the hard run's resets, the mean reward and the mean exact KL per
token to the reference *of that moment* (from the logits, ``train/kl``), the parameter memory of
each reference mode, and plots both to ``docs/refresh_study.png``. The runs write under
``runs/refresh_study/``; the pretrained references are cached where the examples cache them.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import _runs  # noqa: E402

RUNS = {  # example -> (module, reward column, hard-reset period, configs: label -> file)
    "toy": ("toy_rlhf", "train/reward", 50, {
        "fixed reference": "grpo_k3plus.yaml",
        "hard reset / 50": "grpo_k3plus_refresh_hard.yaml",
        "EMA 0.2 / 10": "grpo_k3plus_refresh_ema.yaml",
        "KL > 0.4 x 20": "grpo_k3plus_refresh_kl.yaml",
    }),
    "hf": ("hf_grpo", "train/acc", 100, {
        "fixed reference": "hf_grpo_lora.yaml",
        "hard reset / 100": "hf_grpo_lora_refresh_hard.yaml",
        "EMA 0.2 / 20": "hf_grpo_lora_refresh_ema.yaml",
    }),
}


def run(example: str, label: str, config: str, root: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, int]]:
    """One run through the example's CLI; its metrics and the parameter bytes of policy and reference."""
    module_name = RUNS[example][0]
    main = __import__(module_name).main
    name = Path(config).stem
    cli = main(args=["fit", "--config", str(HERE / "configs" / config),
                     f"--trainer.default_root_dir={root}", f"--trainer.logger.init_args.save_dir={root}",
                     f"--trainer.logger.init_args.name={name}"])
    log_dir = _runs.latest_version(root / name)
    assert log_dir is not None, f"{label}: no metrics.csv under {root / name}"
    model = cli.model
    if example == "toy":
        nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
        memory = {"policy": nbytes(model.policy), "reference": nbytes(model.ref)}
    else:
        memory = {"policy": model.memory["base"] + model.memory["adapters"], "reference": 0}
    return _runs.read_metrics(log_dir / "metrics.csv"), memory


def phase_means(points: list[tuple[int, float]], period: int, n_steps: int) -> list[float]:
    """The mean of ``points`` over each phase ``[k * period, (k + 1) * period)`` of the logged steps."""
    out = []
    for start in range(0, n_steps, period):
        vals = [v for s, v in points if start <= s < start + period]
        out.append(sum(vals) / len(vals) if vals else float("nan"))
    return out


def smooth(vals: list[float], k: int = 9) -> list[float]:
    return [sum(vals[max(0, i - k + 1) : i + 1]) / len(vals[max(0, i - k + 1) : i + 1]) for i in range(len(vals))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--example", choices=["toy", "hf", "both"], default="both")
    parser.add_argument("--out", default=str(HERE.parent / "docs" / "refresh_study.png"))
    parser.add_argument("--root", default="runs/refresh_study")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    examples = ["toy", "hf"] if args.example == "both" else [args.example]
    results: dict[str, dict[str, Any]] = {}
    for example in examples:
        _, reward_key, period, configs = RUNS[example]
        results[example] = {}
        for label, config in configs.items():
            series, memory = run(example, label, config, Path(args.root) / example)
            results[example][label] = (series, memory)

    for example in examples:
        _, reward_key, period, configs = RUNS[example]
        print(f"\n[{example}] per phase of {period} steps: mean reward / mean exact KL per token to the reference of the moment")
        for label, (series, memory) in results[example].items():
            n = max(s for s, _ in series["train/kl"]) + 1
            rewards = phase_means(series[reward_key], period, n)
            kls = phase_means(series["train/kl"], period, n)
            cells = "  ".join(f"{r:.3f} / {k:.4f}" for r, k in zip(rewards, kls))
            steps = sorted({int(v) for _, v in series.get("ref/last_step", []) if v >= 0})
            shown = ", ".join(map(str, steps)) if len(steps) <= 4 else f"{len(steps)} refreshes"
            print(f"  {label:18s} {cells}   (refreshed at: {shown or 'none'})")
        for label, (series, memory) in results[example].items():
            extra = memory["reference"] / max(memory["policy"], 1)
            print(f"  memory {label:18s}: policy {memory['policy'] / 2**20:.3f} MiB, reference adds "
                  f"{memory['reference'] / 2**20:.3f} MiB ({extra:.2f} x the policy)")

    plt = _runs.pyplot()
    fig, axes = plt.subplots(2, len(examples), figsize=(6 * len(examples), 6.5), squeeze=False)
    for col, example in enumerate(examples):
        _, reward_key, period, configs = RUNS[example]
        for label, (series, _) in results[example].items():
            for row, key in enumerate((reward_key, "train/kl")):
                steps, vals = zip(*series[key])
                axes[row][col].plot(steps, smooth(list(vals)), label=label)
        for row, what in enumerate(("reward" if example == "toy" else "accuracy", "exact KL to the current reference (nats/token)")):
            ax = axes[row][col]
            n = max(s for s, _ in next(iter(results[example].values()))[0]["train/kl"]) + 1
            for x in range(period, n, period):
                ax.axvline(x, color="grey", lw=0.6, ls="--")
            ax.set_ylabel(what)
            ax.set_xlabel("optimizer step")
            ax.set_title(f"{RUNS[example][0]}: {what.split(' (')[0]}", fontsize=9)
        axes[0][col].legend(fontsize=8)
    _runs.save_figure(fig, "reference refresh: fixed reference, hard reset, EMA (smoothed over 9 steps)", args.out)
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
    main()
