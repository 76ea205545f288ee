"""The one chunk runner (lightning_kl.ground.chunks): what every chunked kernel relies on."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import textwrap
import threading
import time
from queue import Empty

import pytest
import torch

import lightning_kl as lk
import lightning_kl.ground.chunks as chunks
from lightning_kl.estimators import parse_estimator
from lightning_kl.kernels import fused

CPU = torch.device("cpu")
POOLED = torch.get_num_threads() > 1 and chunks._openmp_backend()
needs_pool = pytest.mark.skipif(not POOLED, reason="the pool needs more than one torch thread and the OpenMP backend")


@pytest.mark.parametrize("pooled", [True, False])
def test_every_item_once_with_one_state_per_worker(pooled, monkeypatch):
    monkeypatch.setattr(chunks, "CPU_THREAD_POOL", pooled)
    seen: list[int] = []
    states: list[list[int]] = []
    owner: dict[int, set[int]] = {}

    def make_state() -> list[int]:
        states.append([])
        return states[-1]

    def work(item: int, state: list[int]) -> None:
        state.append(item)
        seen.append(item)
        owner.setdefault(id(state), set()).add(threading.get_ident())

    chunks.run_chunks(work, list(range(100)), CPU, make_state)
    assert sorted(seen) == list(range(100))
    assert sorted(i for s in states for i in s) == list(range(100))  # each item in exactly one state
    assert all(len(t) == 1 for t in owner.values())  # a state serves one thread
    threads = set().union(*owner.values())
    if pooled and POOLED:
        assert 1 <= len(states) <= torch.get_num_threads() and threading.get_ident() not in threads
        assert all(s == sorted(s) for s in states)  # a worker takes its items in order
    else:
        assert states == [list(range(100))] and threads == {threading.get_ident()}


@pytest.mark.parametrize("device", [torch.device("meta"), torch.device("cuda")])  # no tensor is made: any device
def test_off_the_cpu_every_item_runs_in_order_in_the_calling_thread_with_one_state(device):
    assert not chunks.pool_active(device)
    seen: list[tuple[int, int, int]] = []
    made: list[int] = []

    def make_state() -> int:
        made.append(1)
        return len(made)

    chunks.run_chunks(lambda i, s: seen.append((i, s, threading.get_ident())), list(range(50)), device, make_state)
    assert seen == [(i, 1, threading.get_ident()) for i in range(50)] and made == [1]


@needs_pool
def test_one_torch_thread_runs_in_the_calling_thread(monkeypatch):
    """As in a DataLoader worker (``set_num_threads(1)``): no pool."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert not chunks.pool_active(CPU)
        got: list[int] = []
        chunks.run_chunks(lambda _i, _s: got.append(threading.get_ident()), list(range(10)), CPU)
        assert got == [threading.get_ident()] * 10
    finally:
        torch.set_num_threads(before)


def test_without_a_state_factory_the_state_is_none_and_no_items_is_no_call():
    got: list[object] = []
    chunks.run_chunks(lambda item, state: got.append((item, state)), ["a", "b"], CPU)
    assert sorted(got) == [("a", None), ("b", None)]
    chunks.run_chunks(lambda item, state: got.append(item), [], CPU)
    assert len(got) == 2


@needs_pool
def test_a_worker_error_is_raised_after_every_worker_stopped():
    running = []

    def work(item: int, _state: None) -> None:
        running.append(item)
        if item in (3, 5):
            raise RuntimeError(f"chunk {item} failed")

    with pytest.raises(RuntimeError, match="chunk 3 failed"):  # the first by item order
        chunks.run_chunks(work, list(range(1000)), CPU)
    assert 3 in running and len(running) < 1000  # the others stopped at their next chunk
    after = len(running)
    time.sleep(0.05)
    assert len(running) == after  # nothing still runs once the call has returned


@pytest.mark.parametrize("mode", ["no_grad", "inference", "grad", "autocast"])
def test_grad_inference_and_autocast_modes_travel_into_the_workers(mode):
    found = []

    def work(_item: int, _state: None) -> None:
        found.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

    ctx = {
        "no_grad": torch.no_grad(),
        "inference": torch.inference_mode(),
        "grad": torch.enable_grad(),
        "autocast": torch.autocast("cpu", dtype=torch.float16),
    }[mode]
    with ctx:
        want = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        chunks.run_chunks(work, list(range(16)), CPU)
    assert set(found) == {want}


def test_a_kernel_called_inside_a_worker_runs_serially_there():
    inner: list[bool] = []

    def work(_item: int, _state: None) -> None:
        me = threading.get_ident()
        chunks.run_chunks(lambda _i, _s: inner.append(threading.get_ident() == me), [0, 1, 2], CPU)

    chunks.run_chunks(work, list(range(4)), CPU)
    assert inner == [True] * 12


# ---------------------------------------------------------------------------------------------
# no process-wide state; forked children


THREAD_STATE = textwrap.dedent(
    r"""
    import json, sys, threading
    import torch
    import lightning_kl as lk

    def in_new_thread():
        got = []
        t = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
        t.start(); t.join()
        return got[0]

    if sys.argv[1] != "default":
        torch.set_num_threads(int(sys.argv[1]))
    waiting = threading.Event(); late = []
    early = threading.Thread(target=lambda: (waiting.wait(), late.append(torch.get_num_threads())))
    early.start()  # a thread started before, that sets up its torch threads after the call
    before = (torch.get_num_threads(), in_new_thread())
    z = torch.randn(64, 4096, requires_grad=True)
    lk.full_kl(z, torch.randn(64, 4096), chunk_size=4).sum().backward()
    lp = (-torch.rand(70_000)).requires_grad_()
    lk.kl_penalty(lp, -torch.rand(70_000), "k3+").sum().backward()
    waiting.set(); early.join()
    after = (torch.get_num_threads(), in_new_thread(), late[0])
    pool = sorted(t.name for t in threading.enumerate() if t.name.startswith("lightning_kl"))
    print(json.dumps({"before": before, "after": after, "pool": pool}))
    """
)


@pytest.mark.parametrize("threads", ["default", "2", "3"])
def test_no_thread_count_changes_for_the_caller_nor_for_threads_started_later(threads):
    out = subprocess.run([sys.executable, "-c", THREAD_STATE, threads], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    n = got["before"][0]
    assert got["before"] == [n, n] and got["after"] == [n, n, n]
    if n > 1:
        assert len(got["pool"]) == n  # the pool did run (else this test tests nothing)


def _fused_in_child(queue, x, zeros, one_thread) -> None:  # pragma: no cover - runs in a forked child
    # only the fused kernel runs here: torch's own intra-op (OpenMP) pool does not survive a fork once
    # the parent has used it, so the inputs are made and the result checked in the parent
    if one_thread:
        torch.set_num_threads(1)  # as a DataLoader worker does
    out = fused.fused_kl_value(x, zeros, parse_estimator("k3"), None, torch.float32, chunk=1 << 15)
    pool = sorted(t.name for t in threading.enumerate() if t.name.startswith("lightning_kl"))
    queue.put((out.numpy().tobytes(), pool))


@needs_pool
@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
@pytest.mark.parametrize("one_thread", [False, True])
def test_a_forked_child_builds_its_own_pool_or_none(one_thread):
    """A DataLoader worker is a fork: it inherits the pool object but not its threads."""
    chunks.run_chunks(lambda _i, _s: None, list(range(8)), CPU)  # the parent's pool exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    x = torch.linspace(-3, 3, 5 * (1 << 15))
    child = ctx.Process(target=_fused_in_child, args=(queue, x, torch.zeros_like(x), one_thread))
    child.start()
    try:
        got, pool = queue.get(timeout=60)  # before join: a large item is flushed only once it is read
    except Empty:
        child.kill()
        pytest.fail("the forked child hung on the inherited pool")
    child.join(timeout=60)
    assert child.exitcode == 0
    out = torch.frombuffer(bytearray(got), dtype=torch.float32)
    assert (out - (torch.expm1(-x) + x)).abs().max() < 1e-5
    assert len(pool) == (0 if one_thread else torch.get_num_threads())


# ---------------------------------------------------------------------------------------------
# results: the same bits on every run, and those of the loop to rounding


def _runs(f, pooled: bool, monkeypatch) -> list[list[torch.Tensor]]:
    monkeypatch.setattr(chunks, "CPU_THREAD_POOL", pooled)
    return [f() for _ in range(3)]


def _logits_paths() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(40, 3000, generator=g) * 3).requires_grad_()
    ref = (torch.randn(40, 3000, generator=g) * 3).requires_grad_()
    tokens = torch.randint(0, 3000, (40,), generator=g)
    w = torch.randn(40, generator=g)
    s = lk.Sampling(temperature=0.7, top_k=50)
    total = (lk.full_kl(z, ref, chunk_size=3) * w).sum() + (lk.token_logprobs(z, tokens, chunk_size=3) * w).sum()
    total = total + (lk.token_entropy(z, sampling=s, chunk_size=3) * w).sum() + (lk.token_logprobs(z, z.argmax(-1), sampling=s, chunk_size=3) * w).sum()
    lp = (-torch.rand(300, 200, generator=g)).requires_grad_()
    k3 = lk.kl_penalty(lp, -torch.rand(300, 200, generator=g), "k3+")
    total.backward()
    (k3 * torch.randn(300, 200, generator=g)).sum().backward()
    return [total.detach(), z.grad, ref.grad, k3.detach(), lp.grad]


def _head_path() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, 20, 32, generator=g).requires_grad_()
    w = (torch.randn(500, 32, generator=g) * 0.3).requires_grad_()
    b = torch.randn(500, generator=g).requires_grad_()
    tokens = torch.nn.functional.linear(h, w, b).argmax(-1)  # in the kept set
    s = lk.Sampling(top_k=20)  # truncated: chunks of rows (7 here), each adding into dW and db
    (lk.token_logprobs(lk.FromHidden(h, w, b), tokens, sampling=s, chunk_size=7) * torch.randn(6, 20, generator=g)).sum().backward()
    return [h.grad, w.grad, b.grad]


@needs_pool
@pytest.mark.filterwarnings("ignore:`ref_logits` requires grad")
def test_every_chunked_result_has_the_same_bits_on_every_run_and_those_of_the_loop_to_rounding(monkeypatch):
    pooled, loop = _runs(_logits_paths, True, monkeypatch), _runs(_logits_paths, False, monkeypatch)
    for run in pooled[1:]:
        for a, b in zip(pooled[0], run):
            assert torch.equal(a, b)
    for a, b in zip(pooled[0], loop[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_pool
def test_a_heads_gradients_to_rounding_and_the_hidden_states_to_the_bit(monkeypatch):
    """dW and db add up over the chunks in the order they finish (not bitwise); dh rows are each a chunk's own."""
    pooled, loop = _runs(_head_path, True, monkeypatch), _runs(_head_path, False, monkeypatch)
    for run in pooled[1:]:
        assert torch.equal(pooled[0][0], run[0])
    for a, b in zip(pooled[0], loop[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
