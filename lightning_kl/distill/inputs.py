r"""The checks of a :class:`~lightning_kl.KLPenaltyLoss` or :func:`~lightning_kl.kl_penalty` call whose other side
is a served teacher's :class:`~lightning_kl.TopK`: :func:`check_topk_inputs`, in place of
:func:`lightning_kl.inputs.check_kl_inputs` (same arguments, same :class:`~lightning_kl.inputs.KLInputs`).

Here: where the ``TopK`` may stand (the other side of ``"full"`` at ``level="token"``), the counts, and the mask
against the student's positions. The student, the payload's shape and its values are checked with the student by
:func:`~lightning_kl.distill.topk.topk_divergence`, at the compute step (:func:`lightning_kl.compute.full_kl_values`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_kl.distill.topk import TopK
from lightning_kl.estimators import EstimatorSpec
from lightning_kl.ground.checks import check_mask
from lightning_kl.ground.vocab_shards import local_part
from lightning_kl.inputs import KLInputs, check_accumulate_grad_batches, check_count
from lightning_kl.logprobs import FromHidden

__all__ = ["check_topk_inputs"]


def check_topk_inputs(
    logprob: Any,
    ref_logprob: Any,
    spec: EstimatorSpec,
    mask: Any,
    old_logprob: Any,
    sampled_logprob: Any,
    level: str,
    sampling: Any = None,
    num_tokens: Any = None,
    num_seqs: Any = None,
    accumulate_grad_batches: Any = None,
) -> KLInputs:
    """Check one call with a teacher's ``TopK`` as ``ref_logprob`` beside the student's logits, vocabulary shard or
    ``lk.FromHidden``.

    Raises:
        TypeError: for a ``TopK`` with a sampled estimator, in the student's place, or beside a student of another form.
        ValueError: at ``level="sequence"``, for ``old_logprob`` or ``sampled_logprob``, a bad count, a mask that does
            not fit the student's positions (the shapes named).
    """
    if spec.base != "full":
        raise TypeError(
            f"`lk.TopK` (a teacher's top-k log-probs) is the other side of the 'full' estimator, got {spec.name!r}: the "
            "sampled estimators take the teacher's log-probs of the sampled tokens as `ref_logprob` `[..., t]`. Valid with "
            "a TopK: estimator='full', `(student logits or lk.FromHidden, lk.TopK(ids, logprobs), mask)`."
        )
    if isinstance(logprob, TopK):
        raise TypeError(
            "`lk.TopK` is the other side (the teacher), the second argument: pass the student's logits or lk.FromHidden "
            "first, `(logits, lk.TopK(ids, logprobs), mask)`."
        )
    if level == "sequence":
        raise ValueError(
            "a teacher's `lk.TopK` takes level='token' only: the sequence level's KL-to-go is the score function "
            "gradient of the responses' full reverse KL, which a top-k payload does not give. Valid with a TopK: "
            "level='token'."
        )
    for name, value in (("old_logprob", old_logprob), ("sampled_logprob", sampled_logprob)):
        if value is not None:
            raise ValueError(
                f"`{name}` does not apply beside a teacher's `lk.TopK`: the 'full' estimator sums over the student's "
                "whole distribution at level='token'. Drop it."
            )
    check_count("num_tokens", num_tokens)
    check_count("num_seqs", num_seqs)
    k = None if accumulate_grad_batches is None else check_accumulate_grad_batches(accumulate_grad_batches)
    hidden = isinstance(logprob, FromHidden)
    like = logprob.hidden if hidden else local_part(logprob)
    if not isinstance(like, Tensor):
        raise TypeError(
            "the student beside an `lk.TopK` must be logits `[..., V]` (a tensor, a vocabulary shard) or lk.FromHidden, "
            f"got {type(logprob).__name__}."
        )
    mask = check_mask(mask, like, "hidden" if hidden else "logits", without="the last dimension")
    student = logprob.weight if hidden else like
    dtype = torch.promote_types(torch.promote_types(student.dtype, ref_logprob.logprobs.dtype), torch.float32)
    return KLInputs(logprob, ref_logprob, mask, None, None, dtype, num_tokens, num_seqs, k)
