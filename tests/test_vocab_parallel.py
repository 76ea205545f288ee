"""Vocabulary-parallel log-probs and full KL (logits split over a tensor parallel group, never
gathered), on 2 CPU processes with gloo, against one process on the gathered logits.

One launch of ``tests/_vocab_parallel_worker.py`` runs every check on both ranks (float64): DTensor
``Shard(-1)`` logits with an uneven split (11 = 6 + 5), plain local shards (``lk.VocabShard``) with a
custom split (3 + 8) and with an empty shard (11 + 0), token ids in every shard and at the edges of
the split and of the vocabulary, ``ignore_index``, masks with NaN padding, ``-inf`` policy logits,
temperatures, chunks smaller than the batch, ``kl_penalty("full")`` and ``KLPenaltyLoss("full")`` at
both levels, log-probs and the full KL from hidden states with a column-parallel head, sampled
estimators on ``loss_parallel``'s log-probs; values and gradients (both sides of the KL, the hidden
states, the head's rows and bias) to 1e-12; bfloat16 shards; the device form of the checks with host
reads refused; bad inputs. The tests below read its records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "_vocab_parallel_worker.py"


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("vocab_parallel")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    try:
        proc = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the 2-process vocabulary-parallel run did not finish in {err.timeout} s:\n{err.stderr}")
    found = []
    for rank in range(2):
        path = out / f"rank{rank}.json"
        assert proc.returncode == 0 and path.exists(), f"worker failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
        found.append(json.loads(path.read_text()))
    for record in found:
        assert "failure" not in record, record["failure"]
    return found


def _errors(records: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    out = {f"rank{r['rank']}:{k}": v for r in records for k, v in r["errors"].items() if k.startswith(prefix)}
    assert out, f"no check named {prefix}* ran"
    return out


@pytest.mark.parametrize(
    "prefix, count",
    [
        ("logprobs_dtensor_", 10),  # 2 temperatures x (value, grad) x (kernel on the gathered logits, formula) + type
        ("logprobs_shard_", 6),  # 2 splits x (value, grad, zero grad of rows not read)
        ("full_kl_dtensor_", 12),  # 2 temperatures x (value, grad, grad_ref) x (kernel, formula)
        ("loss_full_", 10),  # 2 levels x (loss, penalty, grad, grad_ref, metric)
        ("hidden_logprobs_", 8),  # column-parallel head: 2 temperatures x (value, grads of hidden, weight rows, bias)
        ("hidden_full_kl_", 14),  # 2 x (value, loss with FromHidden, grads of hidden, weight, bias, ref_hidden, ref_weight)
        ("sampled_loss_parallel_", 4),  # loss_parallel's replicated log-probs in sampled estimators: 2 levels x (loss, grad)
        ("entropy_", 14),  # 2 temperatures x (value, grad) x (one process, formula), an empty shard, a column-parallel head
        ("one_pass_dtensor_", 6),  # token_logprobs_and_entropy: 2 temperatures x (log-prob, entropy, grad of a mix)
        ("capped_", 22),  # heads with a logit scale and a soft cap: 2 x (value, formula, 5 grads, 4 grads against the formula)
        ("kl_reference_", 2),  # without truncation "processed" and "policy_kept" are the plain KL
        ("bf16_", 4),  # bfloat16 shards: dtypes, value (float32 maths, 1e-5), gradients (a bf16 rounding, 4e-3) as excesses
    ],
)
def test_equal_to_one_process_on_the_gathered_logits(records: list[dict[str, Any]], prefix: str, count: int) -> None:
    errors = _errors(records, prefix)
    assert len(errors) == 2 * count
    bad = {k: v for k, v in errors.items() if not v <= 1e-12}
    assert not bad, bad


def test_no_host_reads_with_the_device_checks(records: list[dict[str, Any]]) -> None:
    # token_logprobs and full_kl forward and backward ran with every Tensor read into Python refused
    _errors(records, "no_host_reads_ran")
    for r in records:
        assert "every token id must be owned by exactly one vocabulary shard" in r["raised"]["device_check_out_of_range"]


@pytest.mark.parametrize(
    "tag, match",
    [
        ("error_out_of_range", "ValueError: token id 11 is owned by 0 vocabulary shards"),
        ("error_overlap", "ValueError: token id 0 is owned by 2 vocabulary shards"),
        ("error_replicated", r"ValueError: .*placements \(Replicate\(\),\).*pass `x.to_local\(\)`"),
        ("error_mixed", "TypeError: `logits` is split over the vocabulary but `ref_logits` is a plain tensor"),
        ("error_offsets", "ValueError: `logits` and `ref_logits` must be split the same way .* offsets 0 and 1"),
    ],
)
def test_bad_inputs_raise_on_every_rank(records: list[dict[str, Any]], tag: str, match: str) -> None:
    import re

    for r in records:
        assert tag in r["raised"], f"rank {r['rank']} did not raise for {tag}"
        assert re.search(match, r["raised"][tag]), r["raised"][tag]
