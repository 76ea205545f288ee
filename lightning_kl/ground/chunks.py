r"""The one chunk runner: every chunked kernel hands its chunks to :func:`run_chunks`, which runs them in order.

A plain loop in the calling thread, on every device: each chunk's ops use torch's own intra-op
threads on CPU, and on CUDA the calling thread queues the chunks' kernels on the caller's current
stream, which keeps the device busy with one thread.

There was a pool of Python threads here (each running single-threaded ops) until
``benchmarks/bench_cpu_machinery.py`` measured it against this loop on the project's 2-core machine:
forward+backward of ``token_logprobs`` and ``full_kl`` at ``[512, 32768]`` and ``[1024, 37984]``,
float32 and bf16, the pool was 0.92x-1.22x and 0.98x-1.21x the loop's speed in two runs at low load,
and 0.90x-1.21x under a load of 8 with ``OMP_WAIT_POLICY=PASSIVE``, short of the 1.3x it had to show. Its only
large win (2x to 30x, under a load of 8 to 10) came from libgomp's default wait policy: torch's
OpenMP threads spin at every barrier, and on oversubscribed cores they spin in place of the thread
that has work. ``OMP_WAIT_POLICY=PASSIVE`` in the environment (read when torch is imported) removes
that for every op, not only the package's (``docs/performance.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, TypeVar

import torch

__all__ = ["run_chunks"]

_Item = TypeVar("_Item")
_State = TypeVar("_State")


def run_chunks(
    work: Callable[[_Item, Any], None],
    items: Sequence[_Item],
    device: torch.device,
    make_state: Optional[Callable[[], _State]] = None,
) -> None:
    """``work(item, state)`` for every item, in order, in the calling thread.

    ``state`` is ``make_state()``, called once per call (scratch buffers reused by every chunk), or
    ``None``. An exception from ``work`` propagates at once; the later items do not run.

    Args:
        work: called once per item, with the item and the state.
        items: the chunks, in order.
        device: the tensors' device (every device runs the chunks the same way).
        make_state: optional factory of the state.
    """
    state = make_state() if make_state is not None else None
    for item in items:
        work(item, state)
