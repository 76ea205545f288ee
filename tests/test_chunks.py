"""The one chunk runner (lightning_kl.ground.chunks): what every chunked kernel relies on."""

from __future__ import annotations

import multiprocessing
from queue import Empty
import threading
import time

import pytest
import torch

import lightning_kl.ground.chunks as chunks
from lightning_kl.kernels import fused
from lightning_kl.estimators import parse_estimator

CPU = torch.device("cpu")
POOLED = torch.get_num_threads() > 1 and chunks._openmp_backend()


@pytest.mark.parametrize("pooled", [True, False])
def test_every_item_once_with_one_state_per_worker(pooled, monkeypatch):
    monkeypatch.setattr(chunks, "CPU_THREAD_POOL", pooled)
    seen: list[tuple[int, int]] = []
    states: list[list[int]] = []
    threads: set[str] = set()

    def make_state() -> list[int]:
        state: list[int] = []
        states.append(state)
        return state

    def work(item: int, state: list[int]) -> None:
        state.append(item)
        seen.append((item, id(state)))
        threads.add(threading.current_thread().name)

    chunks.run_chunks(work, list(range(100)), CPU, make_state)
    assert sorted(i for i, _ in seen) == list(range(100))
    assert sorted(i for s in states for i in s) == list(range(100))  # each item in exactly one state
    if pooled and POOLED:
        assert 1 <= len(states) <= torch.get_num_threads()
        assert all(name.startswith("lightning_kl") for name in threads)
    else:
        assert len(states) == 1 and threads == {threading.current_thread().name}


def test_a_worker_error_is_raised_after_every_worker_stopped(monkeypatch):
    monkeypatch.setattr(chunks, "CPU_THREAD_POOL", True)
    running = []

    def work(item: int, _state: None) -> None:
        running.append(item)
        if item == 3:
            raise RuntimeError("chunk 3 failed")

    with pytest.raises(RuntimeError, match="chunk 3 failed"):
        chunks.run_chunks(work, list(range(1000)), CPU)
    # the others stopped at their next chunk instead of running the whole list
    assert 3 in running and len(running) < 1000
    after = len(running)
    time.sleep(0.05)
    assert len(running) == after  # nothing still runs once the call has returned


@pytest.mark.parametrize("mode", ["no_grad", "inference", "grad"])
def test_grad_and_inference_modes_travel_into_the_workers(mode, monkeypatch):
    monkeypatch.setattr(chunks, "CPU_THREAD_POOL", True)
    found = []

    def work(_item: int, _state: None) -> None:
        found.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))

    ctx = {"no_grad": torch.no_grad(), "inference": torch.inference_mode(), "grad": torch.enable_grad()}[mode]
    with ctx:
        want = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        chunks.run_chunks(work, list(range(16)), CPU)
    assert set(found) == {want}


def test_a_kernel_called_inside_a_worker_runs_serially_there(monkeypatch):
    monkeypatch.setattr(chunks, "CPU_THREAD_POOL", True)
    inner: list[str] = []

    def work(_item: int, _state: None) -> None:
        me = threading.current_thread().name
        chunks.run_chunks(lambda _i, _s: inner.append(threading.current_thread().name == me), [0, 1, 2], CPU)

    chunks.run_chunks(work, list(range(4)), CPU)
    assert inner == [True] * 12


def _fused_in_child(queue, x, zeros) -> None:  # pragma: no cover - runs in a forked child
    # only the fused kernel runs here: its chunks are single-threaded ops on the pool's threads. The
    # inputs are made and the result checked in the parent, since torch's own intra-op (OpenMP) pool
    # does not survive a fork once the parent has used it (a whole-tensor op here could hang)
    out = fused.fused_kl_value(x, zeros, parse_estimator("k3"), None, torch.float32)
    queue.put(out.numpy().tobytes())


@pytest.mark.skipif(not POOLED or "fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_forked_child_builds_its_own_pool(monkeypatch):
    """A DataLoader worker is a fork: it inherits the pool object but not its threads."""
    monkeypatch.setattr(chunks, "CPU_THREAD_POOL", True)
    chunks.run_chunks(lambda _i, _s: None, list(range(8)), CPU)  # the parent's pool exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    x = torch.linspace(-3, 3, 5 * fused.CHUNK)
    child = ctx.Process(target=_fused_in_child, args=(queue, x, torch.zeros_like(x)))
    child.start()
    try:
        got = queue.get(timeout=60)  # before join: a large item is flushed only once it is read
    except Empty:
        child.kill()
        pytest.fail("the forked child hung on the inherited pool")
    child.join(timeout=60)
    assert child.exitcode == 0, "the forked child hung or failed on the inherited pool"
    out = torch.frombuffer(bytearray(got), dtype=torch.float32)
    assert (out - (torch.expm1(-x) + x)).abs().max() < 1e-5
