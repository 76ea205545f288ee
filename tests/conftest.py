"""Shared test fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import lightning.pytorch as pl
import pytest
from _trainers import make_quiet_trainer


@pytest.fixture
def quiet_trainer(tmp_path: Path) -> Callable[..., pl.Trainer]:
    """``quiet_trainer(**kwargs)``: the quiet CPU Trainer of ``_trainers.py`` in the test's ``tmp_path``."""
    return lambda **kwargs: make_quiet_trainer(tmp_path, **kwargs)
