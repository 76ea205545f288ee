"""The one chunk runner (lightning_kl.ground.chunks): every item once, in order, in the calling thread."""

from __future__ import annotations

import threading

import pytest
import torch

import lightning_kl.ground.chunks as chunks

DEVICES = [torch.device("cpu"), torch.device("meta"), torch.device("cuda")]  # no tensor is made: any device


@pytest.mark.parametrize("device", DEVICES)
def test_every_item_once_in_order_in_the_calling_thread_with_one_state(device):
    seen: list[int] = []
    states: list[list[int]] = []
    threads: set[int] = set()

    def make_state() -> list[int]:
        states.append([])
        return states[-1]

    def work(item: int, state: list[int]) -> None:
        assert state is states[0]
        state.append(item)
        seen.append(item)
        threads.add(threading.get_ident())

    chunks.run_chunks(work, list(range(100)), device, make_state)
    assert seen == list(range(100)) and states == [list(range(100))]
    assert threads == {threading.get_ident()}


def test_without_a_state_factory_the_state_is_none_and_no_items_is_no_call():
    got: list[object] = []
    chunks.run_chunks(lambda item, state: got.append((item, state)), ["a", "b"], torch.device("cpu"))
    assert got == [("a", None), ("b", None)]
    made: list[int] = []
    chunks.run_chunks(lambda item, state: got.append(item), [], torch.device("cpu"), lambda: made.append(1))
    assert len(got) == 2 and made == [1]  # the state is made once per call, even for no items


def test_an_error_stops_the_loop_and_propagates():
    ran: list[int] = []

    def work(item: int, _state: None) -> None:
        ran.append(item)
        if item == 3:
            raise RuntimeError("chunk 3 failed")

    with pytest.raises(RuntimeError, match="chunk 3 failed"):
        chunks.run_chunks(work, list(range(10)), torch.device("cpu"))
    assert ran == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["no_grad", "inference", "grad"])
def test_grad_and_inference_modes_are_the_callers(mode):
    found = []
    ctx = {"no_grad": torch.no_grad(), "inference": torch.inference_mode(), "grad": torch.enable_grad()}[mode]
    with ctx:
        want = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        chunks.run_chunks(lambda _i, _s: found.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled())), [0, 1], torch.device("cpu"))
    assert found == [want, want]


def test_the_package_starts_no_thread_of_its_own():
    """No pool: a full KL and a fused estimator leave the process's Python threads as they were."""
    import lightning_kl as lk

    before = set(threading.enumerate())
    z = torch.randn(64, 100, requires_grad=True)
    lk.full_kl(z, torch.randn(64, 100), chunk_size=4).sum().backward()
    lp = (-torch.rand(70_000)).requires_grad_()  # log-probs: <= 0
    lk.kl_penalty(lp, -torch.rand(70_000), "k3+").sum().backward()
    assert not set(threading.enumerate()) - before  # none new (another test's may have ended meanwhile)
