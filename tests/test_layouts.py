"""Every rank decides alike, on 4 gloo processes (one launch of tests/_layout_worker.py), against one process.

What a layout gives (the metric's token-mean and synced token count, the loss under
``global_batch=True``) is compared with float64 maths over the same data in this process; every
refusal must be raised on every rank, with the same message (a refusal on some ranks only leaves the
others waiting in their next collective).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk

ROOT = Path(__file__).resolve().parents[1]
WORKER_PATH = Path(__file__).with_name("_layout_worker.py")
_spec = importlib.util.spec_from_file_location("_layout_worker", WORKER_PATH)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)
WORLD = worker.WORLD


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("layouts")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    try:
        proc = subprocess.run([sys.executable, str(WORKER_PATH), str(out)], env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the {WORLD}-process layout run did not finish in {err.timeout} s:\n{err.stderr}")
    found = []
    for rank in range(WORLD):
        path = out / f"rank{rank}.json"
        assert proc.returncode == 0 and path.exists(), f"worker failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
        found.append(json.loads(path.read_text()))
    for record in found:
        assert "failure" not in record, record["failure"]
    return found


def _value(records: list[dict[str, Any]], name: str) -> list[Any]:
    for r in records:
        assert name in r["values"], f"rank {r['rank']} raised in {name}: {r['raised'].get(name)}"
    return [r["values"][name] for r in records]


def _sums(indices: list[int]) -> tuple[float, int]:
    """Float64 masked sum of k3 over the batches ``indices``, and their valid-token count."""
    total, count = 0.0, 0
    for i in indices:
        lp, ref, mask = worker.batch(i)
        total += float(worker.k3(lp, ref)[mask].sum())
        count += int(mask.sum())
    return total, count


def _check_metric(got: list[Any], indices: list[int], name: str) -> None:
    total, count = _sums(indices)
    value, dtype, synced = got
    assert_close(value, total / count, rtol=1e-13, atol=0, msg=name)
    assert (dtype, synced) == ("torch.float64", count), name


def _check_loss(got: float, index: int, indices: list[int], agg: str, name: str) -> None:
    # each replica's loss is its share times the group's size (their mean is the group's batch loss)
    local, _ = _sums([index])
    _, count = _sums(indices)
    want = len(indices) * local / (count if agg == "token-mean" else 1)
    assert_close(got, want, rtol=1e-13, atol=0, msg=name)


@pytest.mark.parametrize(
    "layout", ["ddp_extra_group", "hsdp_metric_found", "hsdp_metric_world", "hsdp_metric_flat_mesh"]
)
def test_every_process_its_own_data_whatever_groups_exist(records: list[dict[str, Any]], layout: str) -> None:
    # plain DDP with a group of the user's on ranks 0, 1 (once: 0, 1 raised, 2, 3 hung); a hybrid-sharded
    # mesh ("replicate", "shard"), found, or given as the world or as a flat mesh (once: all refused)
    name = layout if layout.startswith("hsdp") else f"{layout}_metric"
    for got in _value(records, name):
        _check_metric(got, list(range(WORLD)), name)
    loss = {"ddp_extra_group": "ddp_extra_group_loss"}.get(layout, layout.replace("metric", "loss"))
    for rank, got in enumerate(_value(records, loss)):
        _check_loss(got, rank, list(range(WORLD)), "token-mean", loss)


def test_a_data_parallel_group_smaller_than_the_world_given(records: list[dict[str, Any]]) -> None:
    # {0, 1} and {2, 3}: each reduces over its own half, and the multiplier is 2, not 4
    for rank in range(WORLD):
        half = [0, 1] if rank < 2 else [2, 3]
        _check_metric(records[rank]["values"]["subgroup_metric"], half, "subgroup_metric")
        _check_loss(records[rank]["values"]["subgroup_loss_mean"], rank, half, "token-mean", "subgroup_loss_mean")
        _check_loss(records[rank]["values"]["subgroup_loss_sum"], rank, half, "token-sum", "subgroup_loss_sum")


def test_the_data_parallel_dimension_of_a_2d_mesh_and_its_size(records: list[dict[str, Any]]) -> None:
    # ("data_parallel", "tensor_parallel") = [[0, 1], [2, 3]]: ranks 0, 1 hold replica 0, ranks 2, 3 replica 1;
    # the data parallel groups are {0, 2} and {1, 3}; over the world each batch would count twice
    groups = _value(records, "dp_mesh_group")
    assert groups == [[2, [0, 2]], [2, [1, 3]], [2, [0, 2]], [2, [1, 3]]]
    for rank in range(WORLD):
        values = records[rank]["values"]
        for how in ("given", "found"):
            _check_metric(values[f"dp_mesh_metric_{how}"], [0, 1], f"dp_mesh_metric_{how}")
            _check_loss(values[f"dp_mesh_loss_{how}"], rank // 2, [0, 1], "token-sum", f"dp_mesh_loss_{how}")


def _same_everywhere(records: list[dict[str, Any]], name: str) -> str:
    messages = [r["raised"].get(name) for r in records]
    assert all(m is not None for m in messages), f"{name}: raised on ranks {[i for i, m in enumerate(messages) if m]} only"
    assert len(set(messages)) == 1, messages
    return messages[0]


def test_a_model_parallel_mesh_found_is_refused_alike_and_a_group_given_wins(records: list[dict[str, Any]]) -> None:
    for name in ("tp_mesh_metric_found", "tp_mesh_loss_found"):
        message = _same_everywhere(records, name)
        assert "ValueError: a device mesh has dimensions ['tp']" in message and "none named 'data_parallel'" in message
    # ("dp", "tp") = [[0, 1], [2, 3]]: the "dp" groups {0, 2}, {1, 3}, each rank its own batch
    for rank, got in enumerate(_value(records, "tp_mesh_loss_given")):
        _check_loss(got, rank, [rank % 2, rank % 2 + 2], "token-sum", "tp_mesh_loss_given")


def test_a_refusal_on_one_rank_is_raised_on_every_rank(records: list[dict[str, Any]]) -> None:
    message = _same_everywhere(records, "agree_rank_1_only")
    assert message == "ValueError: rank 1 found a problem (found on rank 1; every rank raises this error)"
    assert _value(records, "agree_none") == [None] * WORLD


# -- logits split over the vocabulary ----------------------------------------------------------------


def _grad_of(fn: Any, z: torch.Tensor) -> torch.Tensor:
    z = z.clone().requires_grad_()
    fn(z).backward()
    assert z.grad is not None
    return z.grad


def test_none_and_the_default_group_are_one_group(records: list[dict[str, Any]]) -> None:
    z, zr, tokens, mask = worker.logits()
    kl = lk.full_kl(z, zr, mask)
    grad = _grad_of(lambda x: lk.full_kl(x, zr, mask).sum(), z)
    lp = lk.token_logprobs(z, tokens)
    for rank, (got_kl, got_grad, got_lp) in enumerate(_value(records, "vocab_none_and_world")):
        lo, hi = worker.SPLIT[rank], worker.SPLIT[rank + 1]
        assert_close(torch.tensor(got_kl, dtype=torch.float64), kl, rtol=1e-12, atol=1e-12)
        assert_close(torch.tensor(got_grad, dtype=torch.float64), grad[..., lo:hi], rtol=1e-12, atol=1e-12)
        assert_close(torch.tensor(got_lp, dtype=torch.float64), lp, rtol=1e-12, atol=1e-12)


def test_replicate_shard_logits_on_a_2d_mesh(records: list[dict[str, Any]]) -> None:
    # (Replicate(), Shard(-1)): the vocabulary split over the second mesh dimension, not the first
    z, zr, tokens, mask = worker.logits()
    lp, kl = lk.token_logprobs(z, tokens), lk.full_kl(z, zr, mask)
    grad = _grad_of(lambda x: lk.token_logprobs(x, tokens).sum() + lk.full_kl(x, zr, mask).sum(), z)
    offsets = []
    for got_lp, got_kl, offset, got_grad in _value(records, "vocab_replicate_shard"):
        offsets.append(offset)
        assert_close(torch.tensor(got_lp, dtype=torch.float64), lp, rtol=1e-12, atol=1e-12)
        assert_close(torch.tensor(got_kl, dtype=torch.float64), kl, rtol=1e-12, atol=1e-12)
        local = torch.tensor(got_grad, dtype=torch.float64)
        assert_close(local, grad[..., offset : offset + local.shape[-1]], rtol=1e-12, atol=1e-12)
    assert offsets == [0, 5, 0, 5]


def test_a_row_minus_inf_on_every_rank(records: list[dict[str, Any]]) -> None:
    # masked: KL 0 there, and no NaN in any value or gradient; its log-probs NaN, as in one process
    z, zr, tokens, _ = worker.logits()
    zi, mi = worker.with_inf_row(z)
    kl = lk.full_kl(zi, zr, mi)
    grad = _grad_of(lambda x: lk.full_kl(x, zr, mi).sum(), zi)
    lp = lk.token_logprobs(zi, tokens)
    assert kl[0, 1] == 0 and lp[0, 1].isnan() and not grad.isnan().any()
    for rank, (got_kl, got_grad, got_lp) in enumerate(_value(records, "vocab_inf_row")):
        lo, hi = worker.SPLIT[rank], worker.SPLIT[rank + 1]
        assert_close(torch.tensor(got_kl, dtype=torch.float64), kl, rtol=1e-12, atol=1e-12)
        assert_close(torch.tensor(got_grad, dtype=torch.float64), grad[..., lo:hi], rtol=1e-12, atol=1e-12)
        got = torch.tensor([[float("nan") if v is None else v for v in row] for row in got_lp], dtype=torch.float64)
        assert_close(got, lp, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize(
    "name, split",
    [("vocab_split_reference_plain_policy", "ref_logits"), ("vocab_split_policy_plain_reference", "logits")],
)
def test_one_model_split_and_the_other_plain_is_refused_on_every_rank(records: list[dict[str, Any]], name: str, split: str) -> None:
    message = _same_everywhere(records, name)
    assert message.startswith(f"TypeError: `{split}` is split over the vocabulary but")


# -- ReferenceRefresh with FSDP2-sharded models ------------------------------------------------------


def test_a_reference_sharded_on_the_policys_ranks_is_refreshed_exactly(records: list[dict[str, Any]]) -> None:
    # another mesh object over the same processes in the same order: accepted, a hard reset copies
    assert _value(records, "refresh_same_ranks") == [0.0] * WORLD


@pytest.mark.parametrize("name, layer", [("refresh_other_mesh_even", "0"), ("refresh_other_mesh_uneven", "1")])
def test_a_reference_sharded_over_other_ranks_is_refused_on_every_rank(records: list[dict[str, Any]], name: str, layer: str) -> None:
    # [0, 2, 1, 3] against [0, 1, 2, 3]: same placements (and, for the even layer, the same local shapes),
    # but ranks 1 and 2 hold each other's rows: once mixed silently (even) or refused on ranks 1, 2 only (uneven)
    message = _same_everywhere(records, name)
    assert f"`{layer}.weight` is sharded over the processes [0, 2, 1, 3] in the reference and [0, 1, 2, 3] in the policy" in message
