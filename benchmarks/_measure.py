"""Peak resident memory and time of a forward+backward step, measured in a child process (Linux).

Shared by ``bench_logprobs.py``, ``bench_full_kl.py`` and ``bench_estimators.py``, which import it
from their own folder. A benchmark re-runs itself with ``--child ...`` for each variant, so every
variant starts from a fresh process; the child prints one JSON line, which :func:`run_child` reads.
Standard library only.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from typing import Any, Callable, Optional


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB: ``VmRSS`` (resident now) or ``VmHWM`` (its peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current resident size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_and_time(step: Callable[[], None], clear: Callable[[], None], reps: int) -> tuple[float, float]:
    """``(peak extra MiB, median seconds)`` of ``step()``, after a warm-up; ``clear()`` after each.

    The peak is the first measured step's resident high-water mark above the resident size before it
    (the warm-up pays threads, the allocator and first-touch of code paths); the time is the median
    over ``reps`` steps.
    """
    step()  # warm-up: threads, allocator, first-touch of code paths
    clear()
    reset_peak()
    base_kib = status_kib("VmRSS")
    times = []
    peak_kib: Optional[int] = None
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        if peak_kib is None:
            peak_kib = status_kib("VmHWM")
        clear()
    assert peak_kib is not None
    return (peak_kib - base_kib) / 1024, statistics.median(times)


def run_child(cmd: list[str], fixed_mmap_threshold: bool = False) -> Any:
    """Run ``cmd`` and return the JSON of the last line it printed.

    ``fixed_mmap_threshold``: every large block is mapped on malloc and unmapped on free, so resident
    memory follows the live tensors (glibc's adaptive threshold would otherwise serve some of them
    from a heap that keeps freed memory resident, depending on history).
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536") if fixed_mmap_threshold else None
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])
