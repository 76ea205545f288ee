r"""The one chunk runner: every chunked kernel hands its chunks to :func:`run_chunks`.

**On CPU** the chunks run on a pool of ``torch.get_num_threads()`` Python threads, each running
*single-threaded* torch ops (torch releases the GIL inside an op), taking chunks in order from one
shared list. Why not torch's own intra-op threads: a call is hundreds of short ops (a dozen per
chunk), and an OpenMP region per op waits at its end for its slowest thread. libgomp's threads spin
at that barrier by default; on cores shared with other busy processes (a shared machine, one DDP
process per core) the spinning threads take the core from the thread that has work: a token log-prob
call at ``[1024, 151936]`` took 11-17 s without the pool against 0.6 s with it, at a load of 1.5-3
(``benchmarks/compare.py`` measures both ways against a git ref; ``docs/performance.md``). The pool's threads wait for nobody but the end of the call: a worker
the OS preempts delays only the chunk it holds, the others keep taking chunks. One barrier per call
instead of one per op. What the workers still share is the GIL, taken between ops: on heavily
oversubscribed cores a worker preempted while holding it stalls the others, so the kernels' CPU
chunks are large (2^20 elements: ``kernels/engine.py`` and ``kernels/fused.py`` give the figures).

No process-wide state changes. torch keeps OpenMP's and MKL's thread counts per thread: each worker
calls ``torch.set_num_threads(1)`` for itself, once, when the pool starts; that call also sets the
default that threads started later read, which the runner puts back, from a thread of its own, to
the value a new thread read before (the calling thread is never touched). The caller's grad mode,
inference mode and CPU autocast state hold in the workers. A forked child (a DataLoader worker)
inherits the pool object but not its threads: the pool is keyed by process id and rebuilt there. A
kernel called from inside a worker runs its chunks in that worker, in order.

Chunks must write disjoint outputs; results do not depend on which worker ran a chunk, except where
several chunks add into one buffer (a head's weight gradient, under a lock in the order the chunks
finish: equal to rounding, not bitwise).

**On CUDA (and any device that is not the CPU) there is no pool, by design**, and the chunks run in
order in the calling thread. That thread only queues kernels, which the device runs in stream order
while the thread goes on queueing: one thread keeps the device busy. A worker would also be wrong
there: torch's current stream and device are per thread, so it would launch on the default stream
of the default device rather than on the caller's stream. Without torch's OpenMP backend, with one
thread (``torch.set_num_threads(1)``, as DataLoader workers set), or with a single chunk, the chunks
run in the calling thread too.
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

#: Run CPU chunks on the pool (see the module's notes). Set False to run every chunk in the calling
#: thread with torch's intra-op threads instead (the tests compare both).
CPU_THREAD_POOL = True

_Item = TypeVar("_Item")
_State = TypeVar("_State")

_lock = threading.Lock()
_pool: Optional[tuple[int, int, ThreadPoolExecutor]] = None  # (pid, threads, executor)
_local = threading.local()
_openmp: Optional[bool] = None


def _after_fork() -> None:
    global _lock, _pool
    _lock, _pool = threading.Lock(), None  # the parent's threads are not in the child (nor its lock's holder)


os.register_at_fork(after_in_child=_after_fork)


def pool_active(device: torch.device) -> bool:
    """Whether chunks on ``device`` run on the thread pool: only on the CPU, with more than one
    thread, torch's OpenMP backend, and outside a worker."""
    return (
        CPU_THREAD_POOL
        and device.type == "cpu"
        and not getattr(_local, "worker", False)
        and torch.get_num_threads() > 1
        and _openmp_backend()
    )


def run_chunks(
    work: Callable[[_Item, Any], None],
    items: Sequence[_Item],
    device: torch.device,
    make_state: Optional[Callable[[], _State]] = None,
) -> None:
    """``work(item, state)`` for every item; on CPU, spread over the thread pool.

    Items are taken in order from one shared list by whichever worker is free. ``state`` is
    ``make_state()``, called once per worker taking part (scratch buffers it reuses for all its
    chunks), or ``None``; in the calling thread, once per call. Chunks must write disjoint outputs:
    they may run concurrently. An exception from ``work`` stops the other workers at their next
    chunk and is raised here once every worker has stopped (the first one, by item order).

    Args:
        work: called once per item, with the item and the worker's state.
        items: the chunks, in the order a serial run would take them.
        device: the tensors' device: only CPU work goes to the pool.
        make_state: optional factory of per-worker state.
    """
    threads = torch.get_num_threads() if pool_active(device) else 1
    workers = min(threads, len(items))
    if workers <= 1:
        state = make_state() if make_state is not None else None
        for item in items:
            work(item, state)
        return
    pool = _executor(threads)
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    autocast, autocast_dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    taken = itertools.count()  # next() on a count is atomic under the GIL: a shared work list
    stop = threading.Event()
    errors: list[tuple[int, BaseException]] = []

    def worker() -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad), torch.autocast("cpu", autocast_dtype, autocast):
            state = make_state() if make_state is not None else None
            for i in taken:
                if i >= len(items) or stop.is_set():
                    return
                try:
                    work(items[i], state)
                except BaseException as error:  # noqa: BLE001 - raised in the calling thread below
                    errors.append((i, error))
                    stop.set()
                    return

    for future in [pool.submit(worker) for _ in range(workers)]:
        future.result()  # waits for every worker (worker() itself raises nothing)
    if errors:
        raise min(errors, key=lambda e: e[0])[1]


def _openmp_backend() -> bool:
    global _openmp
    if _openmp is None:
        _openmp = "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
    return _openmp


def _executor(threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` workers, started (or restarted at another size) on demand."""
    global _pool
    with _lock:
        if _pool is None or _pool[1] != threads:
            if _pool is not None:
                _pool[2].shutdown(wait=False)
            _pool = (os.getpid(), threads, _start(threads))
        return _pool[2]


def _start(threads: int) -> ThreadPoolExecutor:
    default: list[int] = []
    init_lock = threading.Lock()

    def init() -> None:
        _local.worker = True  # a kernel called from a worker runs its chunks there, in order
        with init_lock:
            # the first read is what a thread started now gets (torch's lazy per-thread set-up,
            # from the process-wide default); set_num_threads(1) then sets this thread's OpenMP
            # and MKL counts, and the process-wide default too
            default.append(torch.get_num_threads())
            torch.set_num_threads(1)

    executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lightning_kl", initializer=init)
    barrier = threading.Barrier(threads)  # every task waits for all: each worker starts its own thread
    list(executor.map(lambda _: barrier.wait(), range(threads)))
    # the process-wide default back as it was, set from a thread of its own: the caller's counts
    # (which may differ from the default) stay untouched
    restore = threading.Thread(target=torch.set_num_threads, args=(default[0],))
    restore.start()
    restore.join()
    return executor
