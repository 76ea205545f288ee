"""What the chunked kernels do on a device that is not the CPU, checked without one.

The kernels choose by device type: the CPU gets cache-sized chunks, every other device
chunks sized for device memory (every device runs them in order in the calling thread). Tensors on the
``meta`` device (shapes only, no memory) take that non-CPU path; each kernel's hand-over to the one
chunk runner is intercepted, so the chunks it would run are counted without running them. The
counts follow from the documented constants: e.g. 2^25 elements per chunk at V = 151,936 are 220
rows, where the CPU's 2^19 are 3.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lightning_kl.ground.chunks as chunks
from lightning_kl.estimators import parse_estimator
from lightning_kl.kernels import fused
from lightning_kl.ground.sampler import Sampling
from lightning_kl.kernels import engine
from lightning_kl.kernels import full as full_kernel

V, N, D = 151_936, 1000, 64
META, CUDA, CPU = torch.device("meta"), torch.device("cuda"), torch.device("cpu")


class Handed(Exception):
    """Raised by the stand-in runner: the kernel handed its chunks over, and stops there."""


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[Any], torch.device]]:
    """The (items, device) of every hand-over to the chunk runner, in the kernels' modules."""
    seen: list[tuple[list[Any], torch.device]] = []

    def record(work: Any, items: Any, device: torch.device, make_state: Any = None) -> None:
        seen.append((list(items), device))
        raise Handed

    for module in (fused, engine):
        monkeypatch.setattr(module, "run_chunks", record)
    return seen


def _rows(item: Any) -> int:
    pos = item[0]
    return pos.stop - pos.start


def test_off_the_cpu_the_chunks_run_in_order_in_the_calling_thread_with_one_state():
    import threading

    seen, states, threads = [], [], set()

    def work(item: int, state: list[int]) -> None:
        seen.append(item)
        threads.add(threading.current_thread().name)
        assert state is states[0]

    chunks.run_chunks(work, list(range(50)), CUDA, lambda: states.append([]) or states[-1])
    assert seen == list(range(50)) and len(states) == 1
    assert threads == {threading.current_thread().name}


def _logprobs(x, ids, weight=None, sampling=Sampling()):
    return engine.token_logprobs_kernel(engine.Tensors(x, weight), ids, None, sampling)


def test_token_logprobs_chunks_are_sized_for_the_device(handed):
    ids = torch.zeros(N, dtype=torch.long)
    with pytest.raises(Handed):
        _logprobs(torch.empty(N, V, device=META), ids.to(META))
    with pytest.raises(Handed):  # a CPU tensor of that shape without its memory: stride 0
        _logprobs(torch.zeros(()).expand(N, V), ids)
    (gpu_items, gpu_device), (cpu_items, _) = handed
    assert gpu_device == META
    assert [_rows(i) for i in gpu_items] == [220] * 4 + [120]  # 2^25 // V = 220 rows
    assert _rows(cpu_items[0]) == 6 and len(cpu_items) == 167  # 2^20 // V = 6 rows


def test_token_logprobs_from_hidden_chunks_are_sized_for_the_device(handed):
    ids = torch.zeros(N, dtype=torch.long)
    with pytest.raises(Handed):
        _logprobs(torch.empty(N, D, device=META), ids.to(META), torch.empty(V, D, device=META))
    with pytest.raises(Handed):
        _logprobs(torch.zeros(()).expand(N, D), ids, torch.zeros(()).expand(V, D))
    # truncation needs whole rows: max(16, 2^25 // V) = 220 on GPU, max(16, 2^23 // V) = 55 on CPU
    top_k = Sampling(top_k=5)
    with pytest.raises(Handed):
        _logprobs(torch.empty(N, D, device=META), ids.to(META), torch.empty(V, D, device=META), top_k)
    with pytest.raises(Handed):
        _logprobs(torch.zeros(()).expand(N, D), ids, torch.zeros(()).expand(V, D), top_k)
    (gpu_items, _), (cpu_items, _), (gpu_whole, _), (cpu_whole, _) = handed
    assert [_rows(i) for i in gpu_whole] == [220] * 4 + [120]
    assert _rows(cpu_whole[0]) == 55 and len(cpu_whole) == -(-N // 55)
    # else one block of up to 4096 rows (all 1000 here) walked by vocabulary tiles: 2^25 // 1000 =
    # 33,554 columns on GPU, 2^22 // 1000 = 4,194 on CPU
    assert [_rows(i) for i in gpu_items] == [_rows(i) for i in cpu_items] == [N] and engine.HIDDEN_BLOCK_ROWS == 4096
    for device, width in ((META, 33_554), (CPU, 4_194)):
        tiles = engine.Source(engine.Tensors(torch.empty(1, D, device=device), torch.empty(V, D, device=device))).tiles(N, True)
        assert [t.stop - t.start for t in tiles] == [width] * (V // width) + [V % width]


def test_full_kl_chunks_are_sized_for_the_device(handed):
    with pytest.raises(Handed):
        full_kernel.full_kl_compute(torch.empty(N, V, device=META), torch.empty(N, V, device=META), None)
    assert [_rows(i) for i in handed[0][0]] == [220] * 4 + [120]
    with pytest.raises(Handed):
        full_kernel.full_kl_from_hidden_compute(
            torch.empty(N, D, device=META), torch.empty(V, D, device=META), None,
            torch.empty(N, D, device=META), torch.empty(V, D, device=META), None, None,
        )
    assert [_rows(i) for i in handed[1][0]] == [N]  # one block of up to 4096 rows, walked by vocabulary tiles
    with pytest.raises(Handed):
        full_kernel.full_kl_from_hidden_compute(
            torch.empty(N, D, device=META), torch.empty(V, D, device=META), None,
            torch.empty(N, D, device=META), torch.empty(V, D, device=META), None, None, Sampling(top_p=0.9),
        )
    assert [_rows(i) for i in handed[2][0]] == [220] * 4 + [120]  # whole rows for truncation: max(16, 2^25 // V)


def test_fused_estimators_take_the_whole_tensor_as_one_chunk_off_the_cpu(handed):
    spec = parse_estimator("k3+")
    shape = (512, 4096)  # 2,097,152 tokens: 2 chunks of 2^20 on CPU
    lp = torch.empty(shape, device=META)
    assert fused.use_fused(spec, torch.empty(4, device=META))  # even a tiny input: no CPU-side shortcut
    with pytest.raises(Handed):
        fused.fused_kl_value(lp, torch.empty(shape, device=META), spec, None, torch.float32)
    with pytest.raises(Handed):
        fused.fused_kl_value(torch.zeros(()).expand(shape), torch.zeros(()).expand(shape), spec, None, torch.float32)
    (gpu_items, _), (cpu_items, _) = handed
    assert len(gpu_items) == 1 and gpu_items[0][0].shape == shape
    assert len(cpu_items) == 2 and all(c[0].numel() == fused.CHUNK == 2**20 for c in cpu_items)
