"""The quiet CPU Trainer every Lightning loop in the suite runs on (the DDP worker script too).

Tests take it through the ``quiet_trainer`` fixture of ``conftest.py``; module-scoped fixtures and
the DDP worker, which cannot take a function-scoped fixture, call :func:`make_quiet_trainer`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

#: A Trainer that writes nothing and prints nothing: CPU, no logger, no progress bar, no checkpoints,
#: no model summary.
QUIET: dict[str, Any] = dict(
    accelerator="cpu",
    logger=False,
    enable_progress_bar=False,
    enable_checkpointing=False,
    enable_model_summary=False,
)


def make_quiet_trainer(root: Path | str, **kwargs: Any) -> pl.Trainer:
    """A :data:`QUIET` Trainer under ``root``; ``kwargs`` add to or override its settings."""
    return pl.Trainer(**{**QUIET, "default_root_dir": root, **kwargs})
