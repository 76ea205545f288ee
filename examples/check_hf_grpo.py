r"""Check the Hugging Face GRPO example's claims from the CSV files its runs wrote.

    python examples/hf_grpo.py fit --config examples/configs/hf_grpo_lora.yaml
    python examples/hf_grpo.py fit --config examples/configs/hf_grpo_lora.yaml \
        --model.kl_coef=0 --trainer.logger.init_args.name=hf_grpo_lora_kl0
    python examples/check_hf_grpo.py runs/hf_grpo

For each run the newest ``version_*`` folder under ``RUNS_DIR/<name>/`` is read (``metrics.csv``).
Rollouts count from the start of RL (``train/elapsed_s``; the reference's pretraining and the
measurement of its accuracy are not counted). The claims, for ``hf_grpo_lora``:

1. **accuracy**: over the last quarter of the rollouts that ended within ``--seconds`` (180) of RL,
   the mean accuracy of the sampled answers is at least ``--gain`` (0.2) above the reference's.
2. **KL bounded**: the exact KL to the reference per response (the per-token exact KL summed over
   the response, averaged over a rollout) never exceeds ``--max-kl`` (2.0 nats) within that time.

With the contrast run ``hf_grpo_lora_kl0`` (same config, ``kl_coef: 0``) present, a third claim:

3. **KL term**: the KL run ends (last quarter) with a smaller exact KL than the ``kl_coef: 0`` run.

Prints a table and one line per claim; exits 1 if a claim fails or the main run is missing.
Needs only the standard library; ``--plot FILE.png`` (matplotlib) draws the runs side by side.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests): find the siblings
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runs  # noqa: E402  (examples/_runs.py: the metrics CSV, claims)

MAIN, CONTRAST = "hf_grpo_lora", "hf_grpo_lora_kl0"


def read_rows(csv_path: Path) -> list[dict[str, float]]:
    """The rows of a CSVLogger ``metrics.csv`` that hold a training step's metrics."""
    return [row for row in _runs.read_rows(csv_path) if "train/acc" in row]


latest_version = _runs.latest_version
last_quarter_mean = _runs.last_quarter_mean


def summarize(log_dir: Path, seconds: float) -> dict:
    rows = read_rows(log_dir / "metrics.csv")
    within = [r for r in rows if r["train/elapsed_s"] <= seconds] or rows[:1]
    return {
        "dir": log_dir,
        "steps": len(within),
        "elapsed": within[-1]["train/elapsed_s"],
        "ref_acc": rows[0]["train/ref_acc"],
        "acc": last_quarter_mean([r["train/acc"] for r in within]),
        "kl": last_quarter_mean([r["train/kl_seq"] for r in within]),
        "kl_max": max(r["train/kl_seq"] for r in within),
        "rows": rows,
    }


def plot_runs(runs: dict[str, dict], out: Path) -> None:
    """Accuracy and exact KL per response against the rollout, every run in both panels.

    Against rollouts rather than seconds: on shared cores, the same run's speed varies with the load.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, r in runs.items():
        steps = list(range(1, len(r["rows"]) + 1))
        axes[0].plot(steps, [row["train/acc"] for row in r["rows"]], label=name, alpha=0.85)
        axes[1].plot(steps, [row["train/kl_seq"] for row in r["rows"]], label=name, alpha=0.85)
    ref = next(iter(runs.values()))["ref_acc"]
    axes[0].axhline(ref, color="gray", ls="--", label="reference (adapters off)")
    axes[0].set_ylim(0, 1)
    axes[0].set_title("accuracy of sampled answers")
    axes[1].set_title("exact KL(policy || reference) per response, nats")
    for ax in axes:
        ax.set_xlabel("rollout (one GRPO step each)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", nargs="?", default="runs/hf_grpo", type=Path)
    parser.add_argument("--seconds", type=float, default=180.0, help="RL time budget (s)")
    parser.add_argument("--gain", type=float, default=0.2, help="accuracy gain over the reference")
    parser.add_argument("--max-kl", type=float, default=2.0, help="bound on the exact KL per response (nats)")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the runs here (needs matplotlib)")
    parser.add_argument("--overwrite", action="store_true", help="let --plot replace an existing file")
    args = parser.parse_args(argv)
    if args.plot is not None and args.plot.exists() and not args.overwrite:
        parser.error(f"--plot {args.plot} exists (the docs' figure is a tracked file); pass --overwrite to replace it")

    runs = {}
    for name in (MAIN, CONTRAST):
        log_dir = latest_version(args.runs_dir / name)
        if log_dir is not None:
            runs[name] = summarize(log_dir, args.seconds)

    print(f"{'run':<18} {'steps':>5} {'RL s':>6} {'ref acc':>7} {'acc':>6} {'KL/resp':>8} {'KL max':>7}  "
          f"(last quarter within {args.seconds:g} s)")
    for name, r in runs.items():
        print(f"{name:<18} {r['steps']:>5} {r['elapsed']:>6.1f} {r['ref_acc']:>7.3f} {r['acc']:>6.3f} "
              f"{r['kl']:>8.3f} {r['kl_max']:>7.3f}  {r['dir']}")
    print()

    claim = _runs.Claims()

    main_run = runs.get(MAIN)
    if main_run is None:
        claim(False, f"missing run: no {args.runs_dir / MAIN}/version_*/metrics.csv "
                     "(python examples/hf_grpo.py fit --config examples/configs/hf_grpo_lora.yaml)")
    else:
        r = main_run
        claim(r["acc"] >= r["ref_acc"] + args.gain,
              f"accuracy {MAIN}: {r['acc']:.3f} >= reference {r['ref_acc']:.3f} + {args.gain:g} "
              f"within {r['elapsed']:.0f} s of RL")
        claim(r["kl_max"] <= args.max_kl,
              f"KL       {MAIN}: exact KL per response at most {r['kl_max']:.3f} <= {args.max_kl:g} nats")
        contrast = runs.get(CONTRAST)
        if contrast is not None:
            claim(r["kl"] < contrast["kl"],
                  f"KL term  {MAIN}: KL {r['kl']:.3f} < {contrast['kl']:.3f} of {CONTRAST} (kl_coef 0)")
        else:
            print(f"(no {CONTRAST} run: the KL-term contrast is not checked)")
    if args.plot is not None and runs:
        plot_runs(runs, args.plot)
        print(f"plot: {args.plot}")
    return claim.verdict()


if __name__ == "__main__":
    sys.exit(main())
