r"""Reward-vs-exact-KL frontiers: a sweep of KL coefficients for a list of choices, several seeds each.

    python examples/frontier.py --config examples/configs/frontier_toy.yaml
    python examples/frontier.py --config examples/configs/frontier_hf.yaml --limit 10   # in parts

A single run gives one operating point (a reward and a KL), which cannot say which KL choice is better:
another coefficient moves both numbers. The frontier can: for each choice (an estimator in the loss at
a level, or an estimator in the reward), the final reward against the final *exact* KL per response
(from both models' logits, no estimator noise) over a sweep of coefficients, with the spread over seeds.

The sweep drives the examples through their own configuration (``toy_rlhf.py`` or ``hf_grpo.py``,
in this process, one ``fit`` per run): the example's YAML (``base_config``), the sweep's ``overrides``,
then per run the choice, the coefficient, the seed and a ``CSVLogger`` under ``out/runs/``. Every run
uses the same coefficient scale, the KL *per response* (``kl_agg: seq-mean-token-sum`` in the loss; in
the reward, ``KLRewardCallback`` with a ``FixedKLController(coef)`` charges ``coef`` per token of KL,
summed over the response by the example's advantages), so the choices sweep the same numbers.

Writes, under ``out`` (from the YAML, or ``--out``; the runs' keys include it, so a sweep moved to
another folder runs again):

* ``frontier.csv``: one row per run (choice, coefficient, seed; final reward and exact KL, the means
  over the last quarter of the rollouts; steps; seconds; ``status``), appended as each run ends.
  **Resumable**: a run whose row is there (same configuration, by its key) is not run again, so a
  sweep that was stopped continues where it was, ``--limit N`` runs it in parts, and ``--only CHOICE``
  lets several processes share a sweep (the CSV is read again before each run).
* ``<name>.png`` (``<name>``: the YAML file's name without ``.yaml``, so sweeps that share a folder
  and its runs keep their own report): reward against exact KL, one curve per choice, a point per
  coefficient at the mean over seeds with error bars of one standard deviation over seeds (both
  axes); beside it, each choice's reward minus the first choice's at the same KL.
* ``<name>.md``: the same numbers as tables, and each choice's reward at matched exact KL
  (``matched_kl``): per seed, interpolation along its curve, linear in log KL (the first crossing in
  the order of decreasing coefficient), then mean and spread over the seeds that reach that KL.

The YAML (see ``examples/configs/frontier_toy.yaml``)::

    example: toy                 # toy (toy_rlhf.py) or hf (hf_grpo.py)
    base_config: examples/configs/grpo_k3plus.yaml
    overrides: {data: {rollouts: 100}}   # merged into the base config for every run
    out: runs/frontier/toy
    coefs: [0.02, 0.03, 0.05, 0.1, 0.2]   # per response, in the loss and in the reward alike
    seeds: [0, 1, 2]
    matched_kl: [1.0, 2.0]       # nats per response
    choices:
      - {name: k3+ token, loss: k3+, level: token}
      - {name: k3 no weights, loss: k3, level: token, weights: false}   # no old_logprob
      - {name: k1 in the reward, reward: k1}
"""

from __future__ import annotations

import argparse
import copy
import csv
import importlib
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests): find the siblings
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runs  # noqa: E402  (examples/_runs.py: config keys, the runs' CSVs, plots)


@dataclass(frozen=True)
class Example:
    """How to drive one example: its module, the metrics it logs, how it turns the loss's KL off."""

    module: str
    reward_key: str  # the reward (or accuracy) of the rollouts, logged every step
    kl_key: str  # the exact KL per response, logged every step
    ref_key: str  # the reference's reward, for the plot
    no_loss_kl: dict[str, Any]  # model settings with no KL in the loss (a reward choice)
    reward_label: str
    full: bool  # whether ``full`` (both models' logits) can be the loss's estimator
    weights_key: Optional[str]  # the model setting that turns the loss's importance weights off, if any


EXAMPLES = {
    "toy": Example("toy_rlhf", "train/reward", "train/kl_response", "train/ref_reward", {"kl_estimator": None},
                   "reward (share of 7s)", True, "kl_old_logprob"),
    "hf": Example("hf_grpo", "train/acc", "train/kl_seq", "train/ref_acc", {"kl_coef": 0.0},
                  "accuracy", True, "kl_old_logprob"),
}
CSV_FIELDS = ("choice", "coef", "seed", "reward", "kl_response", "kl_token", "ref_reward", "steps", "seconds",
              "status", "key")
SWEEP_KEYS = {"example", "base_config", "overrides", "out", "coefs", "seeds", "matched_kl", "choices"}


# ---------------------------------------------------------------------------------------------
# the sweep's configuration


@dataclass(frozen=True)
class Choice:
    """One way to use the KL: ``loss`` (an estimator at ``level``) or ``reward`` (an estimator).

    ``weights: false`` gives the loss no ``old_logprob`` (no importance weights): the plain estimator
    of frameworks without them. With them (the default), ``k1`` and ``k3`` get an exact expected
    gradient, and on-policy ``k3``'s is ``k3+``'s token by token.
    """

    name: str
    loss: Optional[str] = None
    level: str = "token"
    reward: Optional[str] = None
    weights: bool = True

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "_", self.name.replace("+", "plus")).strip("_")


def parse_choice(raw: Any, example: Example) -> Choice:
    """A :class:`Choice` from its YAML mapping; the names are checked here, before any run."""
    import lightning_kl as lk
    from lightning_kl.estimators import ESTIMATORS, SAMPLED_ESTIMATORS
    from lightning_kl.sequence import LEVELS

    if not isinstance(raw, dict) or set(raw) - {"name", "loss", "level", "reward", "weights"} or "name" not in raw:
        raise ValueError(f"a choice is a mapping with `name` and `loss` (and `level`, `weights`) or `reward`, got {raw!r}.")
    choice = Choice(**raw)
    if (choice.loss is None) == (choice.reward is None):
        raise ValueError(f"choice {choice.name!r}: give exactly one of `loss` and `reward`, got {raw!r}.")
    if choice.loss is not None:
        if choice.loss not in ESTIMATORS:
            raise ValueError(f"choice {choice.name!r}: `loss` {choice.loss!r} is not one of {list(ESTIMATORS)}.")
        if choice.level not in LEVELS:
            raise ValueError(f"choice {choice.name!r}: `level` {choice.level!r} is not one of {list(LEVELS)}.")
        if not choice.weights and example.weights_key is None:
            raise ValueError(f"choice {choice.name!r}: this example always passes `old_logprob`; drop `weights: false`.")
        if choice.loss == "full" and not example.full:
            raise ValueError(f"choice {choice.name!r}: this example cannot use `full` in the loss; "
                             f"use one of {sorted(SAMPLED_ESTIMATORS)}.")
    elif not choice.weights:
        raise ValueError(f"choice {choice.name!r}: `weights` is a setting of the loss; the reward has none.")
    elif choice.reward not in SAMPLED_ESTIMATORS:
        raise ValueError(
            f"choice {choice.name!r}: `reward` {choice.reward!r} is not one of {sorted(SAMPLED_ESTIMATORS)}."
        )
    return choice


@dataclass(frozen=True)
class Sweep:
    example: str
    base_config: Path
    overrides: dict[str, Any]
    out: Path
    coefs: tuple[float, ...]
    seeds: tuple[int, ...]
    matched_kl: tuple[float, ...]
    choices: tuple[Choice, ...]
    name: str = "frontier"  # the report's file names


def load_sweep(path: str | Path, out: Optional[str | Path] = None) -> Sweep:
    """The sweep of the YAML at ``path`` (``out`` overrides its ``out``), checked before any run."""
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a sweep is a mapping with the keys {sorted(SWEEP_KEYS)}.")
    unknown = set(raw) - SWEEP_KEYS
    missing = {"example", "base_config", "coefs", "seeds", "choices"} - set(raw)
    if unknown or missing:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}; "
                         f"the keys are {sorted(SWEEP_KEYS)}.")
    if raw["example"] not in EXAMPLES:
        raise ValueError(f"{path}: `example` {raw['example']!r} is not one of {sorted(EXAMPLES)}.")
    example = EXAMPLES[raw["example"]]
    coefs = tuple(float(c) for c in raw["coefs"])
    if not coefs or any(not c >= 0 for c in coefs):
        raise ValueError(f"{path}: `coefs` must be a non-empty list of numbers >= 0, got {raw['coefs']!r}.")
    seeds = tuple(int(s) for s in raw["seeds"])
    if not seeds:
        raise ValueError(f"{path}: `seeds` must be a non-empty list of integers, got {raw['seeds']!r}.")
    choices = tuple(parse_choice(c, example) for c in raw["choices"])
    slugs = [c.slug for c in choices]
    if len(set(slugs)) != len(slugs):
        raise ValueError(f"{path}: two choices share a name (up to punctuation): {[c.name for c in choices]}.")
    base = Path(raw["base_config"])
    if not base.is_file():
        raise ValueError(f"{path}: `base_config` {str(base)!r} is not a file.")
    return Sweep(raw["example"], base, raw.get("overrides") or {}, Path(out or raw.get("out") or "runs/frontier"),
                 coefs, seeds, tuple(float(k) for k in raw.get("matched_kl") or ()), choices, Path(path).stem)


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in: mappings recursively, anything else (lists too) replaced."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def run_config(sweep: Sweep, choice: Choice, coef: float, seed: int) -> dict[str, Any]:
    """The example's full configuration for one run: base, overrides, choice, coefficient, seed, logger."""
    import yaml

    example = EXAMPLES[sweep.example]
    with open(sweep.base_config) as f:
        config = merge(yaml.safe_load(f), sweep.overrides)
    if choice.loss is not None:
        model = {"kl_estimator": choice.loss, "kl_level": choice.level, "kl_coef": coef, "kl_agg": "seq-mean-token-sum"}
        if not choice.weights:  # only then: the other runs' keys do not change
            model[example.weights_key] = False
        callbacks: list[Any] = []
    else:
        model = dict(example.no_loss_kl)
        controller = {"class_path": "lightning_kl.FixedKLController", "init_args": {"kl_coef": coef}}
        callbacks = [{"class_path": "lightning_kl.KLRewardCallback",
                      "init_args": {"estimator": choice.reward, "controller": controller}}]
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
              "init_args": {"save_dir": str(sweep.out / "runs"), "name": choice.slug, "version": f"coef{coef:g}-seed{seed}"}}
    return merge(config, {"seed_everything": seed, "model": model,
                          "trainer": {"callbacks": callbacks, "logger": logger, "default_root_dir": str(sweep.out)}})


# ---------------------------------------------------------------------------------------------
# one run, and the CSV of all runs


def run_one(sweep: Sweep, config: dict[str, Any], config_path: Path) -> dict[str, Any]:
    """Fit the example once with ``config`` (written to ``config_path``); the row's measured fields."""
    import yaml

    example = EXAMPLES[sweep.example]
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    module = importlib.import_module(example.module)
    start = time.perf_counter()
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI reads args=, not the sweep's own arguments
    try:
        cli = module.main(["fit", "--config", str(config_path)])
    finally:
        sys.argv = argv
    seconds = time.perf_counter() - start
    csv_logger = _runs.find_csv_logger(cli.trainer.loggers)
    series = _runs.read_metrics(Path(csv_logger.log_dir) / "metrics.csv")
    reward = _runs.values(series[example.reward_key])
    kl = _runs.values(series[example.kl_key])
    finite = all(math.isfinite(v) for v in reward + kl)
    return {
        "reward": _runs.last_quarter_mean(reward),
        "kl_response": _runs.last_quarter_mean(kl),
        "kl_token": _runs.last_quarter_mean(_runs.values(series["train/kl"])),
        "ref_reward": series[example.ref_key][0][1],
        "steps": len(reward),
        "seconds": round(seconds, 2),
        "status": "ok" if finite else "non-finite",
    }


def read_results(path: Path) -> list[dict[str, Any]]:
    """The rows of a sweep's ``frontier.csv`` (numbers as floats), or ``[]`` when there is none."""
    if not path.is_file():
        return []
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for k in ("coef", "reward", "kl_response", "kl_token", "ref_reward", "steps", "seconds"):
                row[k] = float(row[k]) if row.get(k) not in (None, "") else math.nan
            row["seed"] = int(row["seed"])
            rows.append(row)
    return rows


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Append ``row`` to the CSV at ``path`` (with the header if the file is new), flushed at once."""
    new = not path.is_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        writer.writerow({k: row.get(k, "") for k in CSV_FIELDS})


def plan(sweep: Sweep) -> list[tuple[Choice, float, int, dict[str, Any], str]]:
    """Every run of ``sweep``: ``(choice, coef, seed, config, key)``, the key that of the whole config.

    So a changed budget or model is a new run, and a row of another sweep in the CSV is not counted.
    """
    out = []
    for choice in sweep.choices:
        for coef in sweep.coefs:
            for seed in sweep.seeds:
                config = run_config(sweep, choice, coef, seed)
                out.append((choice, coef, seed, config, _runs.config_key(config)))
    return out


def pending(sweep: Sweep) -> list[tuple[Choice, float, int, dict[str, Any], str]]:
    """The runs of :func:`plan` whose key ``frontier.csv`` lacks."""
    done = {row["key"] for row in read_results(sweep.out / "frontier.csv")}
    return [run for run in plan(sweep) if run[-1] not in done]


def run_sweep(sweep: Sweep, limit: Optional[int] = None, only: Optional[list[str]] = None) -> int:
    """Run the runs of ``sweep`` that ``frontier.csv`` lacks (at most ``limit``); returns how many ran.

    ``only``: the names of the choices to run (default: all). Before each run the CSV is read again,
    so several processes can share a sweep (give them different ``only``).
    """
    names = [c.name for c in sweep.choices]
    if only is not None and set(only) - set(names):
        raise ValueError(f"--only {sorted(set(only) - set(names))}: not choices of the sweep; they are {names}.")
    csv_path = sweep.out / "frontier.csv"
    total = len(sweep.choices) * len(sweep.coefs) * len(sweep.seeds)
    missing = pending(sweep)
    todo = [run for run in missing if only is None or run[0].name in only]
    part = f" ({', '.join(only)})" if only is not None else ""
    print(f"[frontier] {total} runs in the sweep, {total - len(missing)} already in {csv_path}, "
          f"{len(todo)} to run here{part}{f', at most {limit}' if limit is not None and limit < len(todo) else ''}")
    todo = todo[:limit] if limit is not None else todo
    ran = 0
    for i, (choice, coef, seed, config, key) in enumerate(todo):
        if any(row["key"] == key for row in read_results(csv_path)):  # another process of the sweep ran it
            continue
        ran += 1
        path = sweep.out / "configs" / choice.slug / f"coef{coef:g}-seed{seed}.yaml"
        try:
            measured = run_one(sweep, config, path)
        except Exception as err:  # a run that breaks is a result too (the claim "unstable"): keep going
            measured = {"status": f"error: {type(err).__name__}: {err}"[:200]}
        row = {"choice": choice.name, "coef": coef, "seed": seed, "key": key, **measured}
        append_row(csv_path, row)
        print(f"[frontier] {i + 1}/{len(todo)} {choice.name}, coef {coef:g}, seed {seed}: "
              f"reward {row.get('reward', math.nan):.3f}, exact KL {row.get('kl_response', math.nan):.3f} nats/response, "
              f"{row.get('seconds', math.nan):.1f} s, {row['status']}", flush=True)
    return ran


# ---------------------------------------------------------------------------------------------
# the frontier: summaries and the plot


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation of ``xs`` (NaN, NaN when empty)."""
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def reward_at_kl(points: list[tuple[float, float, float]], kl: float) -> float:
    """The reward where the curve through ``points`` ``[(coef, kl, reward)...]`` first reaches ``kl``.

    The points are taken in the order of decreasing coefficient (weak KL control last) and joined
    by straight lines in log KL (the frontiers are close to straight there; linear in KL where a KL
    is 0); the result is the reward where the first segment crosses ``kl`` (NaN if none does).

    Example:
        >>> round(reward_at_kl([(1.0, 0.5, 0.1), (0.1, 2.0, 0.3), (0.01, 3.0, 0.6)], 1.0), 12)  # halfway in log KL
        0.2
        >>> reward_at_kl([(1.0, 0.0, 0.1), (0.1, 2.0, 0.3)], 1.0)  # a KL of 0: linear
        0.2
        >>> math.isnan(reward_at_kl([(1.0, 0.5, 0.1), (0.1, 1.5, 0.3)], 2.0))
        True
    """
    pts = sorted(points, key=lambda p: -p[0])
    for (_, k0, r0), (_, k1, r1) in zip(pts, pts[1:]):
        if min(k0, k1) <= kl <= max(k0, k1):
            if k1 == k0:
                return max(r0, r1)
            t = math.log(kl / k0) / math.log(k1 / k0) if min(k0, k1) > 0 else (kl - k0) / (k1 - k0)
            return r0 + (r1 - r0) * t
    return math.nan


def frontier_points(rows: list[dict[str, Any]], choice: str) -> list[dict[str, Any]]:
    """Per coefficient of ``choice``: mean and std over seeds of reward and KL, the seeds, the failures."""
    out = []
    for coef in sorted({r["coef"] for r in rows if r["choice"] == choice}):
        runs = [r for r in rows if r["choice"] == choice and r["coef"] == coef]
        ok = [r for r in runs if r["status"] == "ok"]
        reward, reward_sd = mean_std([r["reward"] for r in ok])
        kl, kl_sd = mean_std([r["kl_response"] for r in ok])
        out.append({"coef": coef, "reward": reward, "reward_sd": reward_sd, "kl": kl, "kl_sd": kl_sd,
                    "n": len(ok), "failed": len(runs) - len(ok)})
    return out


def matched(rows: list[dict[str, Any]], choice: str, kl: float) -> tuple[float, float, int]:
    """Mean and std over seeds of ``choice``'s reward at exact KL ``kl``, and the number of seeds that reach it."""
    per_seed = []
    for seed in sorted({r["seed"] for r in rows if r["choice"] == choice}):
        pts = [(r["coef"], r["kl_response"], r["reward"]) for r in rows
               if r["choice"] == choice and r["seed"] == seed and r["status"] == "ok"]
        value = reward_at_kl(pts, kl)
        if math.isfinite(value):
            per_seed.append(value)
    return (*mean_std(per_seed), len(per_seed))


def summary(sweep: Sweep, rows: list[dict[str, Any]]) -> str:
    """The markdown tables of the frontier: per choice and coefficient, and at matched exact KL."""
    names = [c.name for c in sweep.choices if any(r["choice"] == c.name for r in rows)]
    ref = mean_std([r["ref_reward"] for r in rows if r["status"] == "ok"])[0]
    seconds = sorted(r["seconds"] for r in rows if math.isfinite(r["seconds"]))
    timing = (f"{sum(seconds):.0f} s of runs (a run {seconds[0]:.1f} s at best, {seconds[len(seconds) // 2]:.1f} s "
              f"the median, {seconds[-1]:.1f} s at worst)") if seconds else "no timings"
    lines = [f"{len(rows)} runs ({sum(r['status'] == 'ok' for r in rows)} ok), {timing}; "
             f"reference reward {ref:.3f}. Mean ± std over seeds.", "",
             "| choice | " + " | ".join(f"coef {c:g}" for c in sweep.coefs) + " |",
             "|---|" + "---|" * len(sweep.coefs)]
    for name in names:
        cells = {p["coef"]: p for p in frontier_points(rows, name)}
        row = []
        for c in sweep.coefs:
            p = cells.get(c)
            if p is None or p["n"] == 0:
                row.append("failed" if p else "")
                continue
            fail = f" ({p['failed']} failed)" if p["failed"] else ""
            row.append(f"{p['reward']:.3f}±{p['reward_sd']:.3f} at KL {p['kl']:.2f}±{p['kl_sd']:.2f}{fail}")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    if sweep.matched_kl:
        lines += ["", "Reward at matched exact KL (nats per response; seeds that reach it in brackets):", "",
                  "| choice | " + " | ".join(f"KL {k:g}" for k in sweep.matched_kl) + " |",
                  "|---|" + "---|" * len(sweep.matched_kl)]
        for name in names:
            cells = []
            for k in sweep.matched_kl:
                m, sd, n = matched(rows, name, k)
                cells.append(f"{m:.3f}±{sd:.3f} [{n}]" if n else "not reached")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(sweep: Sweep, rows: list[dict[str, Any]], out: Path) -> None:
    """Two panels: reward against exact KL per response, one curve per choice, bars = std over seeds;
    and each choice's reward minus the first choice's at the same KL (its mean curve, interpolated)."""
    plt = _runs.pyplot()
    example = EXAMPLES[sweep.example]
    fig, (ax, dax) = plt.subplots(1, 2, figsize=(14, 5))
    markers = "osD^vP*Xh"
    base_choice = sweep.choices[0].name
    base = [(p["coef"], p["kl"], p["reward"]) for p in frontier_points(rows, base_choice) if p["n"]]
    gaps: list[float] = []
    for i, choice in enumerate(sweep.choices):
        pts = [p for p in frontier_points(rows, choice.name) if p["n"]]
        if not pts:
            continue
        pts.sort(key=lambda p: -p["coef"])
        style = dict(marker=markers[i % len(markers)], capsize=2, ls="--" if choice.reward is not None else "-",
                     label=choice.name, color=f"C{i}")
        kl, reward = [p["kl"] for p in pts], [p["reward"] for p in pts]
        ax.errorbar(kl, reward, xerr=[p["kl_sd"] for p in pts], yerr=[p["reward_sd"] for p in pts], **style)
        gap = [r - reward_at_kl(base, k) for k, r in zip(kl, reward)]
        gaps += [g for g in gap if math.isfinite(g)]
        dax.errorbar(kl, gap, yerr=[p["reward_sd"] for p in pts], **style)
    ref = [r["ref_reward"] for r in rows if r["status"] == "ok"]
    if ref:
        ax.axhline(sum(ref) / len(ref), color="gray", ls=":", label="reference")
    dax.axhline(0.0, color="gray", lw=0.8)
    kls = [r["kl_response"] for r in rows if r["status"] == "ok"]
    for a, data in ((ax, kls), (dax, gaps)):
        if data and kls and min(kls) > 0:  # a log axis needs some data and no KL of 0
            a.set_xscale("log")
        a.set_xlabel("exact KL(policy || reference) per response, nats (last quarter of the run)")
        a.grid(alpha=0.3)
    ax.set_ylabel(f"{example.reward_label} (last quarter of the run)")
    dax.set_ylabel(f"minus {base_choice}'s at the same KL")
    dax.set_title(f"gap to {base_choice} (its curve interpolated; blank outside its range)", fontsize=10)
    ax.legend(fontsize=8)
    n_seeds = len({r["seed"] for r in rows})
    _runs.save_figure(fig, f"{sweep.example}: reward vs exact KL over {len(sweep.coefs)} coefficients, "
                      f"{n_seeds} seed(s) (bars: std over seeds)", out)


def report(sweep: Sweep, png: Optional[Path] = None) -> str:
    """Write ``<name>.md`` and the plot ``<name>.png`` (and ``png``) from ``frontier.csv``; the summary."""
    keys = {run[-1] for run in plan(sweep)}
    seen, rows = set(), []
    for row in read_results(sweep.out / "frontier.csv"):
        if row["key"] in keys and row["key"] not in seen:  # this sweep's runs, the first row of each
            seen.add(row["key"])
            rows.append(row)
    if not rows:
        raise FileNotFoundError(f"no runs of this sweep in {sweep.out / 'frontier.csv'}: run the sweep first.")
    text = summary(sweep, rows)
    if len(rows) < len(keys):
        text = f"**Incomplete:** {len(keys) - len(rows)} of the sweep's {len(keys)} runs not run yet.\n\n{text}"
    (sweep.out / f"{sweep.name}.md").write_text(text + "\n")
    plot(sweep, rows, sweep.out / f"{sweep.name}.png")
    if png is not None:
        plot(sweep, rows, png)
    return text


def main(argv: Optional[list[str]] = None) -> Sweep:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the sweep's YAML (examples/configs/frontier_*.yaml)")
    parser.add_argument("--out", help="the output folder (default: the YAML's `out`)")
    parser.add_argument("--limit", type=int, help="run at most this many of the missing runs (a sweep in parts)")
    parser.add_argument("--only", action="append", metavar="CHOICE",
                        help="run only this choice (by name; repeat for more): a part of a sweep, e.g. in another process")
    parser.add_argument("--report-only", action="store_true", help="no runs: the plot and summary from the CSV")
    parser.add_argument("--png", help="also write the plot here (e.g. docs/frontier_toy.png)")
    args = parser.parse_args(argv)
    sweep = load_sweep(args.config, args.out)
    if not args.report_only:
        run_sweep(sweep, args.limit, args.only)
    print(report(sweep, Path(args.png) if args.png else None))
    print(f"[frontier] files: {sweep.out / 'frontier.csv'}, {sweep.out / sweep.name}.png, {sweep.out / sweep.name}.md")
    return sweep


if __name__ == "__main__":
    import os

    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # tiny matrices on a shared CPU: see toy_rlhf.py
    main()
