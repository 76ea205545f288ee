r"""What the RL examples and their check scripts share: the reference, rollouts, the run's CSV, plots, claims.

Used by ``toy_rlhf.py``, ``hf_grpo.py``, ``check_run.py`` and ``check_hf_grpo.py``, which import it
from their own folder. Imports only the standard library at the top (the check scripts need no torch);
torch and Lightning are imported inside the functions that need them.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

# ---------------------------------------------------------------------------------------------
# the pretrained reference, cached by its configuration


def config_key(config: dict[str, Any]) -> str:
    """A 12-hex-digit key of a JSON-able configuration (the cache file's name)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


def load_or_pretrain(
    cache_dir: str | Path, config: dict[str, Any], pretrain: Callable[[], dict[str, Any]], tag: str
) -> tuple[dict[str, Any], Path, bool, float]:
    """The state dict cached under ``cache_dir`` for ``config``, or ``pretrain()``'s, then cached.

    Returns ``(state, path, cached, seconds)``: ``cached`` is True when the file was loaded, and
    ``seconds`` is the time spent loading or pretraining. ``tag`` prefixes the log lines.
    """
    import torch
    from lightning.pytorch.utilities import rank_zero_info

    path = Path(cache_dir) / f"reference-{config_key(config)}.pt"
    start = time.perf_counter()
    cached = path.exists()
    if cached:
        state = torch.load(path, map_location="cpu", weights_only=True)
        rank_zero_info(f"[{tag}] reference loaded from the cache: {path}")
    else:
        state = pretrain()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a concurrent run (another DDP rank) never reads half a file
        rank_zero_info(f"[{tag}] reference pretrained and cached: {path}")
    return state, path, cached, time.perf_counter() - start


def group_advantages(returns: Any, group: Any, eps: float = 1e-6) -> Any:
    """GRPO: each sequence's return minus its group's mean, over the group's std: ``[b]`` -> ``[b]``.

    ``group [b]`` is the prompt index of each sequence. A group whose returns are all equal gets 0
    (nothing to learn from it).
    """
    import torch

    n = torch.bincount(group).clamp(min=1).to(returns.dtype)
    mean = torch.bincount(group, returns) / n
    std = (torch.bincount(group, (returns - mean[group]) ** 2) / n).sqrt()
    return (returns - mean[group]) / (std[group] + eps)


def pretrain(
    build: Callable[[], Any], batch_loss: Callable[[Any, Any], Any], *, steps: int, lr: float, seed: int, tag: str
) -> dict[str, Any]:
    """Pretrain ``build()``'s fresh model, ``steps`` AdamW steps (one-cycle learning rate up to ``lr``).

    ``batch_loss(model, generator)`` draws a batch with ``generator`` and returns its loss. The model's
    init and the batches come from ``seed`` alone (the global RNG is left as it was), so the result is
    a function of the configuration: what the cache relies on. Returns the state dict on the CPU.
    """
    import torch
    from lightning.pytorch.utilities import rank_zero_info

    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1))
    for step in range(steps):
        loss = batch_loss(model, generator)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % max(steps // 4, 1) == 0:
            rank_zero_info(f"[{tag}] pretraining the reference: step {step + 1}/{steps}, loss {loss.item():.3f}")
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def rollout_loader(sample: Callable[[], Any], n_rollouts: int) -> Any:
    """A DataLoader of ``n_rollouts`` batches, each ``sample()``'d from the current policy when fetched."""
    import lightning_kl as lk
    from torch.utils.data import DataLoader

    # batch_size=None: the dataset yields whole batches; num_workers=0: rollouts must see the
    # policy's current weights, which live in this process
    return DataLoader(lk.OnPolicyRollouts(sample, n_rollouts), batch_size=None, num_workers=0)


# ---------------------------------------------------------------------------------------------
# the CSV a run wrote


def read_rows(csv_path: str | Path) -> list[dict[str, float]]:
    """The rows of a CSVLogger ``metrics.csv``, each ``{column: value}`` without its empty cells."""
    with open(csv_path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def read_metrics(csv_path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{column: [(step, value), ...]}`` of a CSVLogger ``metrics.csv`` (empty cells skipped)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in read_rows(csv_path):
        step = int(row["step"])
        for key, value in row.items():
            if key not in ("step", "epoch"):
                series.setdefault(key, []).append((step, value))
    return series


def values(points: list[tuple[int, float]]) -> list[float]:
    """The values of ``[(step, value), ...]``."""
    return [v for _, v in points]


def last_quarter_mean(values: list[float]) -> float:
    """The mean over the last quarter of ``values`` (at least the last one)."""
    k = max(len(values) // 4, 1)
    return sum(values[-k:]) / k


def latest_version(run_dir: Path) -> Optional[Path]:
    """The ``version_N`` folder with the largest N that holds a ``metrics.csv``."""
    versions = []
    for d in run_dir.glob("version_*"):
        suffix = d.name.removeprefix("version_")
        if suffix.isdigit() and (d / "metrics.csv").is_file():
            versions.append((int(suffix), d))
    return max(versions)[1] if versions else None


def finished_run(trainer: Any, tag: str, seconds: float) -> Optional[tuple[Any, dict[str, list[tuple[int, float]]]]]:
    """The Trainer's CSVLogger and the metrics it wrote, or None (with a note) when it has none."""
    from lightning.pytorch.utilities import rank_zero_info

    csv_logger = find_csv_logger(trainer.loggers)
    if csv_logger is None:
        rank_zero_info(f"[{tag}] done in {seconds:.1f} s (no CSVLogger: no plot, no summary)")
        return None
    return csv_logger, read_metrics(Path(csv_logger.log_dir) / "metrics.csv")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, title: str, out: str | Path) -> None:
    """Title, lay out, write ``fig`` as a PNG and close it."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def find_csv_logger(loggers: list[Any]) -> Any:
    """The first ``CSVLogger`` among ``loggers``, or None."""
    from lightning.pytorch.loggers import CSVLogger

    return next((lg for lg in loggers if isinstance(lg, CSVLogger)), None)


# ---------------------------------------------------------------------------------------------
# the check scripts' verdicts


class Claims:
    """Prints ``PASS``/``FAIL`` per claim and collects the failures; :meth:`verdict` is the exit status."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def __call__(self, ok: bool, text: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
        if not ok:
            self.failures.append(text)

    def verdict(self) -> int:
        print(f"\n{'all claims hold' if not self.failures else f'{len(self.failures)} claim(s) failed'}")
        return 1 if self.failures else 0
