r"""Check the toy RLHF example's claims from the CSV files its runs wrote.

    python examples/toy_rlhf.py fit --config examples/configs/grpo_k3plus.yaml
    python examples/toy_rlhf.py fit --config examples/configs/ppo_adaptive_k1.yaml
    python examples/toy_rlhf.py fit --config examples/configs/ppo_fixed_k1.yaml
    python examples/check_run.py runs/toy_rlhf

For each config the newest ``version_*`` folder under ``RUNS_DIR/<config name>/`` is read
(``metrics.csv`` and the ``config.yaml`` that LightningCLI saved next to it). "Last quarter" is the
last 25% of the rollout steps. The claims:

1. **reward**: in ``grpo_k3plus`` and ``ppo_adaptive_k1``, the policy's reward over the last
   quarter is at least ``--reward-factor`` (3) times the reference's; in ``ppo_fixed_k1``, whose
   point is a small KL, it is above the reference's.
2. **adaptive**: in ``ppo_adaptive_k1``, the KL that ``KLRewardCallback`` measured (``kl/value``,
   the quantity the controller steers) averages within a factor ``--kl-factor`` (2) of
   ``target_kl`` over the last quarter.
3. **fixed**: ``ppo_fixed_k1``, whose fixed coefficient is larger than where the adaptive run's
   coefficient ended, keeps a smaller KL than ``ppo_adaptive_k1`` over the last quarter (both runs
   measure it with the same estimator).

Prints a table of the figures and one line per claim; exits 1 if a claim fails or a run is
missing. Needs only the standard library and PyYAML (no torch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import yaml

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests): find the siblings
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runs  # noqa: E402  (examples/_runs.py: the metrics CSV, claims)

RUNS = ("grpo_k3plus", "ppo_adaptive_k1", "ppo_fixed_k1")


def read_metrics(csv_path: Path) -> dict[str, list[float]]:
    """``{column: [value per logged step, ...]}`` of a CSVLogger ``metrics.csv`` (empty cells skipped)."""
    return {key: _runs.values(points) for key, points in _runs.read_metrics(csv_path).items()}


last_quarter_mean = _runs.last_quarter_mean
latest_version = _runs.latest_version


def reward_controller(config_path: Path) -> dict:
    """``init_args`` (with the class name) of the KLRewardCallback's controller in a saved config."""
    if not config_path.is_file():
        return {}
    config = yaml.safe_load(config_path.read_text()) or {}
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    if isinstance(callbacks, dict):
        callbacks = [callbacks]
    for cb in callbacks:
        if str(cb.get("class_path", "")).endswith("KLRewardCallback"):
            ctl = (cb.get("init_args") or {}).get("controller") or {}
            return {"class": str(ctl.get("class_path", "")).rsplit(".", 1)[-1], **(ctl.get("init_args") or {})}
    return {}


def summarize(log_dir: Path) -> dict:
    s = read_metrics(log_dir / "metrics.csv")
    out = {
        "dir": log_dir,
        "steps": len(s.get("train/reward", [])),
        "ref_reward": s["train/ref_reward"][0],
        "reward": last_quarter_mean(s["train/reward"]),
        "kl_exact": last_quarter_mean(s["train/kl"]),
        "kl_exact_mean": sum(s["train/kl"]) / len(s["train/kl"]),
        "controller": reward_controller(log_dir / "config.yaml"),
    }
    if "kl/value" in s:
        out["kl_value"] = last_quarter_mean(s["kl/value"])
        out["coef_last"] = s["kl/coef"][-1]
        out["coef_lq"] = last_quarter_mean(s["kl/coef"])
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", nargs="?", default="runs/toy_rlhf", type=Path)
    parser.add_argument("--reward-factor", type=float, default=3.0)
    parser.add_argument("--kl-factor", type=float, default=2.0)
    args = parser.parse_args(argv)

    runs, claim = {}, _runs.Claims()
    for name in RUNS:
        log_dir = latest_version(args.runs_dir / name)
        if log_dir is None:
            claim.failures.append(f"missing run: no {args.runs_dir / name}/version_*/metrics.csv "
                                  f"(python examples/toy_rlhf.py fit --config examples/configs/{name}.yaml)")
            continue
        runs[name] = summarize(log_dir)

    print(f"{'run':<16} {'steps':>5} {'ref reward':>10} {'reward':>7} {'KL exact':>9} {'KL est.':>8} {'beta':>8}  (last quarter)")
    for name, r in runs.items():
        kl_est = f"{r['kl_value']:.4f}" if "kl_value" in r else "-"
        beta = f"{r['coef_lq']:.4f}" if "coef_lq" in r else "-"
        print(f"{name:<16} {r['steps']:>5} {r['ref_reward']:>10.3f} {r['reward']:>7.3f} {r['kl_exact']:>9.4f} {kl_est:>8} {beta:>8}  {r['dir']}")
    print()

    for name, r in runs.items():
        if name == "ppo_fixed_k1":  # its point is a small KL; the reward only has to rise
            claim(r["reward"] > r["ref_reward"], f"reward  {name}: {r['reward']:.3f} > reference {r['ref_reward']:.3f}")
        else:
            claim(r["reward"] >= args.reward_factor * r["ref_reward"],
                  f"reward  {name}: {r['reward']:.3f} >= {args.reward_factor:g} x reference {r['ref_reward']:.3f}")

    adaptive = runs.get("ppo_adaptive_k1")
    if adaptive is not None:
        target = adaptive["controller"].get("target_kl")
        if adaptive["controller"].get("class") != "AdaptiveKLController" or target is None or "kl_value" not in adaptive:
            claim(False, "adaptive ppo_adaptive_k1: no AdaptiveKLController in its KLRewardCallback")
        else:
            lo, hi = target / args.kl_factor, target * args.kl_factor
            claim(lo <= adaptive["kl_value"] <= hi,
                  f"adaptive ppo_adaptive_k1: KL {adaptive['kl_value']:.4f} within [{lo:g}, {hi:g}] "
                  f"(target {target:g}, factor {args.kl_factor:g}); beta settled at {adaptive['coef_last']:.4f}")

    fixed = runs.get("ppo_fixed_k1")
    if fixed is not None and adaptive is not None and "kl_value" in fixed and "kl_value" in adaptive:
        claim(fixed["coef_last"] > adaptive["coef_last"],
              f"fixed   ppo_fixed_k1: beta {fixed['coef_last']:.4f} > adaptive run's final beta {adaptive['coef_last']:.4f}")
        claim(fixed["kl_value"] < adaptive["kl_value"],
              f"fixed   ppo_fixed_k1: KL {fixed['kl_value']:.4f} < ppo_adaptive_k1's {adaptive['kl_value']:.4f} "
              f"(exact: {fixed['kl_exact']:.4f} vs {adaptive['kl_exact']:.4f})")

    for text in claim.failures:
        if text.startswith("missing"):
            print(f"FAIL  {text}")
    return claim.verdict()


if __name__ == "__main__":
    sys.exit(main())
