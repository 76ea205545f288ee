"""Shared test fixtures, and the thread count of the test process.

``LIGHTNING_KL_TEST_THREADS=n`` runs the tests at ``torch.set_num_threads(n)`` (default: torch's own,
one thread per core): a test that compares two computation paths bit for bit must hold at any thread
count, and `.ci/run` runs those tests again at 1 and 3 threads. (Multi-process workers run at 1 thread,
``tests/_ddp.py``.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import lightning.pytorch as pl
import pytest
import torch
from _trainers import make_quiet_trainer


def pytest_configure(config: pytest.Config) -> None:
    threads = os.environ.get("LIGHTNING_KL_TEST_THREADS")
    if threads:
        if not threads.isdigit() or int(threads) < 1:
            raise pytest.UsageError(f"LIGHTNING_KL_TEST_THREADS must be a positive integer, got {threads!r}.")
        torch.set_num_threads(int(threads))


def pytest_report_header(config: pytest.Config) -> str:
    return f"torch threads: {torch.get_num_threads()}, CPU capability: {torch.backends.cpu.get_cpu_capability()}"


@pytest.fixture
def quiet_trainer(tmp_path: Path) -> Callable[..., pl.Trainer]:
    """``quiet_trainer(**kwargs)``: the quiet CPU Trainer of ``_trainers.py`` in the test's ``tmp_path``."""
    return lambda **kwargs: make_quiet_trainer(tmp_path, **kwargs)
