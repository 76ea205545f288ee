r"""A KL budget without a sweep: ``TargetKLController`` in the loss, for several estimators, on the toy
or on the Hugging Face example.

    python examples/kl_control_study.py --config examples/configs/kl_control_toy.yaml --png docs/kl_control_toy.png
    python examples/kl_control_study.py --config examples/configs/kl_control_hf.yaml --png docs/kl_control_hf.png

For each choice of the KL in the loss (an estimator at a level, with or without importance weights, as
in ``examples/frontier.py``), one run of the YAML's ``example`` (``toy``: ``examples/toy_rlhf.py``, the
default; ``hf``: ``examples/hf_grpo.py``, its KL and accuracy in place of the toy's) whose loss coefficient is a
``TargetKLController`` toward ``target_kl`` (nats per response: the loss's ``kl_agg`` is
``seq-mean-token-sum``), from the same starting coefficient; and, for the choices listed in ``fixed``,
one run with that starting coefficient held fixed. A fixed coefficient buys a different KL per
estimator (the frontier study's table); the controller is meant to reach the budget for each.

Writes under ``out``: ``kl_control.csv`` (one row per run: the controlled KL, i.e. the estimator's value
the controller saw, and the exact KL per response from both models' logits, as means over the
last three quarters and the last quarter of the rollouts; the final coefficient; the reward),
``<name>.md`` (the same as a table) and, with ``--png``, a plot of the exact KL and the coefficient
over the steps. Each run's metrics are under ``out/runs/``. Runs already in the CSV are not run again.
"""

from __future__ import annotations

import argparse
import copy
import csv
import sys
from pathlib import Path
from typing import Any, Optional

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runs  # noqa: E402
import frontier  # noqa: E402  (the choices and the config merge of the frontier sweep)

KEYS = {"example", "base_config", "overrides", "out", "target_kl", "controller", "seeds", "choices", "fixed", "frontier"}
FIELDS = ("choice", "mode", "seed", "target_kl", "kl_controlled", "kl_exact", "kl_controlled_last", "kl_exact_last",
          "coef_final", "reward", "steps", "seconds")


def load(path: str | Path) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, dict) or set(raw) - KEYS or {"base_config", "target_kl", "controller", "choices"} - set(raw):
        raise ValueError(f"{path}: a mapping with the keys {sorted(KEYS)} (base_config, target_kl, controller and choices required).")
    raw.setdefault("example", "toy")
    if raw["example"] not in frontier.EXAMPLES:
        raise ValueError(f"{path}: `example` {raw['example']!r} is not one of {sorted(frontier.EXAMPLES)}.")
    raw["choices"] = [frontier.parse_choice(c, frontier.EXAMPLES[raw["example"]]) for c in raw["choices"]]
    names = {c.name for c in raw["choices"]}
    if set(raw.get("fixed") or ()) - names:
        raise ValueError(f"{path}: `fixed` names choices that are not in `choices`: {sorted(set(raw['fixed']) - names)}.")
    raw.setdefault("seeds", [0])
    raw["out"] = Path(raw.get("out") or f"runs/kl_control/{raw['example']}")
    raw["name"] = Path(path).stem
    return raw


def run_config(study: dict[str, Any], choice: Any, mode: str, seed: int) -> dict[str, Any]:
    import yaml

    with open(study["base_config"]) as f:
        config = frontier.merge(yaml.safe_load(f), study.get("overrides") or {})
    ctl = dict(study["controller"])
    if mode == "target":
        coef: Any = {"class_path": "lightning_kl.TargetKLController", "init_args": {"target_kl": study["target_kl"], **ctl}}
    else:  # a FixedKLController, so that the step's KL is logged in the same units (kl/value)
        coef = {"class_path": "lightning_kl.FixedKLController", "init_args": {"kl_coef": float(ctl["init_kl_coef"])}}
    model = {"kl_estimator": choice.loss, "kl_level": choice.level, "kl_coef": coef, "kl_agg": "seq-mean-token-sum"}
    if not choice.weights:
        model[frontier.EXAMPLES[study["example"]].weights_key] = False
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
              "init_args": {"save_dir": str(study["out"] / "runs"), "name": choice.slug, "version": f"{mode}-seed{seed}"}}
    return frontier.merge(config, {"seed_everything": seed, "model": model,
                                   "trainer": {"logger": logger, "default_root_dir": str(study["out"])}})


def tail_mean(points: list[float], start: float) -> float:
    """The mean of ``points`` from the fraction ``start`` of the run on."""
    xs = points[int(len(points) * start):]
    return sum(xs) / len(xs)


def run_one(study: dict[str, Any], choice: Any, mode: str, seed: int) -> dict[str, Any]:
    import time

    import yaml

    config = run_config(study, choice, mode, seed)
    path = study["out"] / "configs" / f"{choice.slug}-{mode}-seed{seed}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    import importlib

    example = frontier.EXAMPLES[study["example"]]
    start = time.perf_counter()
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        cli = importlib.import_module(example.module).main(["fit", "--config", str(path)])
    finally:
        sys.argv = argv
    seconds = time.perf_counter() - start
    log_dir = Path(_runs.find_csv_logger(cli.trainer.loggers).log_dir)
    series = _runs.read_metrics(log_dir / "metrics.csv")
    exact = _runs.values(series[example.kl_key])
    est = _runs.values(series["kl/value"])
    coefs = _runs.values(series["kl/coef"])
    return {
        "choice": choice.name, "mode": mode, "seed": seed, "target_kl": study["target_kl"],
        "kl_controlled": tail_mean(est, 0.25), "kl_exact": tail_mean(exact, 0.25),
        "kl_controlled_last": _runs.last_quarter_mean(est), "kl_exact_last": _runs.last_quarter_mean(exact),
        "coef_final": coefs[-1], "reward": _runs.last_quarter_mean(_runs.values(series[example.reward_key])),
        "steps": len(exact), "seconds": round(seconds, 1), "metrics": str(log_dir / "metrics.csv"),
    }


def plan(study: dict[str, Any]) -> list[tuple[Any, str, int]]:
    fixed = set(study.get("fixed") or ())
    return [(c, mode, s) for s in study["seeds"] for c in study["choices"]
            for mode in (("target", "fixed") if c.name in fixed else ("target",))]


def read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def groups(rows: list[dict[str, Any]]) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """The rows by (choice, mode), in the order of the CSV."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["choice"], r["mode"]), []).append(r)
    return [(c, m, rs) for (c, m), rs in out.items()]


def mean_std(xs: list[float], digits: int = 2) -> str:
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return f"{m:.{digits}f}"
    s = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
    return f"{m:.{digits}f}±{s:.{digits}f}"


def report(study: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    target = float(study["target_kl"])
    lines = [
        f"Target {target:g} nats per response; controller {study['controller']}. Per run, the means over the last "
        "three quarters of the rollouts; mean±std over the seeds; 'within 10%': the seeds whose exact KL is.",
        "",
        "| choice | coefficient | seeds | controlled KL (the estimator's) | exact KL | within 10%: controlled, exact | final coef | reward |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for choice, mode, rs in groups(rows):
        exact = [float(r["kl_exact"]) for r in rs]
        controlled = [float(r["kl_controlled"]) for r in rs]
        ok = sum(abs(x / target - 1) <= 0.1 for x in exact)
        ok_controlled = sum(abs(x / target - 1) <= 0.1 for x in controlled)
        how = "TargetKLController" if mode == "target" else f"fixed {float(study['controller']['init_kl_coef']):g}"
        lines.append(
            f"| {choice} | {how} | {len(rs)} | {mean_std(controlled)} | {mean_std(exact)} | "
            f"{f'{ok_controlled}, {ok} of {len(rs)}' if mode == 'target' else '-'} | "
            f"{mean_std([float(r['coef_final']) for r in rs], 4) if mode == 'target' else '-'} | "
            f"{mean_std([float(r['reward']) for r in rs], 3)} |"
        )
    return "\n".join(lines)


def plot(study: dict[str, Any], rows: list[dict[str, Any]], out: Path) -> None:
    plt = _runs.pyplot()
    frontier_curves = study.get("frontier") or {}
    fig, axes = plt.subplots(1, 3 if frontier_curves else 2, figsize=(17 if frontier_curves else 12, 4.2))
    colors: dict[str, Any] = {}
    for r in [r for r in rows if int(r["seed"]) == int(study["seeds"][0])]:  # the first seed's trajectories
        series = _runs.read_metrics(r["metrics"])
        color = colors.setdefault(r["choice"], f"C{len(colors)}")
        style = "-" if r["mode"] == "target" else ":"
        label = f"{r['choice']} ({'target' if r['mode'] == 'target' else 'fixed'})"
        kl = series[frontier.EXAMPLES[study["example"]].kl_key]
        axes[0].plot([s for s, _ in kl], [v for _, v in kl], style, color=color, label=label, lw=1.2)
        coef = series["kl/coef"]
        axes[1].plot([s for s, _ in coef], [v for _, v in coef], style, color=color, label=label, lw=1.2)
    target = float(study["target_kl"])
    axes[0].axhline(target, color="gray", ls="--", lw=1)
    axes[0].axhspan(0.9 * target, 1.1 * target, color="gray", alpha=0.15, label="target ±10%")
    axes[0].set_yscale("symlog", linthresh=min(1.0, 2 * target))  # linear around a budget below 1 nat
    axes[0].set_title("exact KL per response (from logits)")
    axes[1].set_yscale("log")
    axes[1].set_title("loss coefficient")
    for ax in axes[:2]:
        ax.set_xlabel("optimizer step (rollout)")
        ax.axvline(int(rows[0]["steps"]) / 4 if rows else 0, color="gray", lw=0.5)
    axes[0].legend(fontsize=7)
    if frontier_curves:
        ax = axes[2]
        for name, points in frontier_curves.items():
            color = colors.setdefault(name, f"C{len(colors)}")
            ax.plot([k for k, _ in points], [r for _, r in points], "-", color=color, alpha=0.5, label=f"{name}: frontier")
        right = 2 * max(k for points in frontier_curves.values() for k, _ in points)
        off = []
        for choice, mode, rs in groups(rows):
            marker = "*" if mode == "target" else "o"
            kl = sum(float(r["kl_exact_last"]) for r in rs) / len(rs)  # the last quarter, as the frontier
            reward = sum(float(r["reward"]) for r in rs) / len(rs)
            if kl > right:
                off.append(f"{choice} ({mode}): KL {kl:.1f}, reward {reward:.2f}")
                continue
            ax.plot(kl, reward, marker, color=colors[choice], ms=11 if marker == "*" else 6)
        if off:
            ax.text(0.98, 0.04, "off the panel:\n" + "\n".join(off), transform=ax.transAxes, ha="right", fontsize=7)
        ax.set_xlim(right=right)
        ax.axvspan(0.9 * target, 1.1 * target, color="gray", alpha=0.15)
        ax.set_xscale("log")
        ax.set_xlabel("exact KL per response")
        ax.set_ylabel(frontier.EXAMPLES[study["example"]].reward_label)
        ax.set_title("on the frontier (curves: fixed-coefficient sweep; *: target, o: fixed;\n"
                     "means over seeds of the last quarter)", fontsize=9)
        ax.legend(fontsize=7)
    where = {"toy": "toy", "hf": "Hugging Face example"}[study["example"]]
    _runs.save_figure(fig, f"TargetKLController toward {target:g} nats/response vs a fixed coefficient ({where}, GRPO)", out)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--png", help="also write the plot here (e.g. docs/kl_control_toy.png)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    study = load(args.config)
    csv_path = study["out"] / "kl_control.csv"
    study["out"].mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for choice, mode, seed in plan(study):
            if any(r["choice"] == choice.name and r["mode"] == mode and int(r["seed"]) == seed for r in read(csv_path)):
                continue
            row = run_one(study, choice, mode, seed)
            new = not csv_path.is_file()
            with open(csv_path, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=(*FIELDS, "metrics"))
                if new:
                    writer.writeheader()
                writer.writerow(row)
    rows = read(csv_path)
    text = report(study, rows)
    (study["out"] / f"{study['name']}.md").write_text(text + "\n")
    print(text)
    if rows:
        png = study["out"] / f"{study['name']}.png"
        plot(study, rows, png)
        if args.png:
            import shutil

            shutil.copyfile(png, args.png)
    return study


if __name__ == "__main__":
    import os

    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)
    main()
