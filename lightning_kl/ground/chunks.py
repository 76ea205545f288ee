r"""The one chunk runner: every chunked kernel hands its chunks to :func:`run_chunks`.

On CPU the chunks run on a pool of ``torch.get_num_threads()`` Python threads, each running
*single-threaded* torch ops (torch releases the GIL inside an op). Why not torch's own intra-op
parallelism: a chunk is a dozen short ops, and an OpenMP region per op waits for its slowest thread
every time; on cores shared with other busy processes that wait made chunked kernels several times
slower than the plain composition. The pool's threads wait for nobody: a worker that the OS
preempts delays only the chunks it holds, and the others keep taking chunks from the shared list.
One barrier per call instead of one per op.

torch sets OpenMP's thread count per thread: a worker that calls ``set_num_threads(1)`` runs its
ops serially, and only the process-wide default (read by threads that start later) has to be put
back, once, when the pool starts. A forked child (a DataLoader worker) inherits the pool object but
not its threads: the pool is keyed by process id and rebuilt in the child. On other devices, and on
CPU without the pool, the chunks run in order in the calling thread.

**On CUDA (and any device that is not the CPU) there is no pool, by design.** The calling thread
only queues kernels, which the device runs in stream order while the thread goes on queueing: one
thread already keeps the device busy, and more would only contend for the launch path. Worse, a
worker would be wrong there, not just slow: torch's current stream and current device are per
thread, so a worker would launch its chunks on the default stream of the default device rather
than on the caller's stream (``torch.cuda.stream(...)``, a side stream of Lightning or of the
user), racing with the work queued there. So :func:`pool_active` is False for every device but the
CPU, and :func:`run_chunks` runs the chunks in order in the calling thread, with one state. The
kernels size their chunks for the device too: on CPU for the cache (a few MiB a chunk), on a GPU to
fill the device while a chunk's temporaries stay well under its memory (``kernels/*.py`` give the
numbers; ``benchmarks/gpu.py`` measures the default against a quarter and four times it).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, TypeVar

import torch

__all__ = ["CPU_THREAD_POOL", "pool_active", "run_chunks"]

#: Run CPU chunks on a pool of ``torch.get_num_threads()`` Python threads with single-threaded ops
#: (only with torch's OpenMP backend). Set False to run every chunk in the calling thread with
#: torch's intra-op parallelism instead (the tests compare both).
CPU_THREAD_POOL = True

_Item = TypeVar("_Item")
_State = TypeVar("_State")

_lock = threading.Lock()
_pool: Optional[tuple[int, int, ThreadPoolExecutor]] = None  # (pid, threads, executor)
_in_worker = threading.local()
_openmp: Optional[bool] = None


def pool_active(device: torch.device) -> bool:
    """Whether chunks on ``device`` run on the thread pool (kernels size their chunks by it).

    Only on the CPU: never on CUDA or another device (see the module's notes), whatever
    :data:`CPU_THREAD_POOL` says.
    """
    return (
        CPU_THREAD_POOL
        and device.type == "cpu"
        and torch.get_num_threads() > 1
        and _openmp_backend()
        and not getattr(_in_worker, "active", False)
    )


def run_chunks(
    work: Callable[[_Item, Any], None],
    items: Sequence[_Item],
    device: torch.device,
    make_state: Optional[Callable[[], _State]] = None,
) -> None:
    """``work(item, state)`` for every item; on CPU, spread over the thread pool.

    Items are taken in order from one shared list by whichever worker is free. ``state`` is
    ``make_state()``, called once per worker thread (scratch buffers a worker reuses for all its
    chunks), or ``None``. Chunks must write disjoint outputs: they may run concurrently. The
    caller's grad mode and inference mode hold in the workers too (both are per thread in torch).
    A worker's exception is raised here, after every worker has stopped.

    Args:
        work: called once per item, with the item and the worker's state.
        items: the chunks, in the order a serial run would take them.
        device: the tensors' device: only CPU work goes to the pool.
        make_state: optional factory of per-worker state.
    """
    n_workers = min(_pool_size(device), len(items))
    if n_workers <= 1:
        state = make_state() if make_state is not None else None
        for item in items:
            work(item, state)
        return
    pool = _executor()
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    taken = itertools.count()  # next() on a count is atomic under the GIL: a shared work queue
    stop = threading.Event()

    def worker() -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            state = make_state() if make_state is not None else None
            for i in taken:
                if i >= len(items) or stop.is_set():
                    return
                try:
                    work(items[i], state)
                except BaseException:
                    stop.set()  # the others stop at their next chunk
                    raise

    futures = [pool.submit(worker) for _ in range(n_workers)]
    errors = [f.exception() for f in futures]  # waits for every worker
    for error in errors:
        if error is not None:
            raise error


def _pool_size(device: torch.device) -> int:
    return torch.get_num_threads() if pool_active(device) else 1


def _openmp_backend() -> bool:
    global _openmp
    if _openmp is None:
        _openmp = "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
    return _openmp


def _init_worker() -> None:
    _in_worker.active = True  # a kernel called from a worker runs its chunks serially, in that worker
    torch.get_num_threads()  # this thread's lazy OpenMP set-up first, so that the next line sticks
    torch.set_num_threads(1)  # this thread's OpenMP and MKL settings (and, for now, the global default)


def _executor() -> ThreadPoolExecutor:
    global _pool
    n = torch.get_num_threads()
    with _lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] != n:
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)
            executor = ThreadPoolExecutor(max_workers=n, thread_name_prefix="lightning_kl", initializer=_init_worker)
            # start every worker now (each task waits until all n run, so each has its own thread),
            # then restore the process-wide default that the workers' set_num_threads(1) changed
            barrier = threading.Barrier(n)
            list(executor.map(lambda _: barrier.wait(), range(n)))
            torch.set_num_threads(n)
            _pool = (os.getpid(), n, executor)
        return _pool[2]
