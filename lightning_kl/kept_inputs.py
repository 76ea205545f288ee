"""The replay record's checks (``kept=``), against the inputs it is scored with: the policy's logits, a
vocabulary shard or an ``lk.FromHidden`` (:func:`check_kept`), and the loss's checked inputs
(:func:`check_loss_kept`). The record itself is :class:`~lightning_kl.ground.kept.KeptSets`."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from lightning_kl.estimators import EstimatorSpec
from lightning_kl.ground.kept import KeptSets, as_kept_sets, check_nonempty
from lightning_kl.ground.vocab_shards import VocabShard, is_vocab_parallel, local_part
from lightning_kl.inputs import KLInputs, is_from_hidden

__all__ = ["check_kept", "check_loss_kept"]


def check_kept(kept: Any, x: Any, mask: Optional[Tensor], temperature: float) -> KeptSets:
    """``kept=`` (replay) of a call that scores the policy's whole distribution (``full_kl``, the loss's
    ``"full"``), checked against the policy's input ``x`` (logits, a vocabulary shard, or an
    ``lk.FromHidden``): its positions, vocabulary, device and temperature (:func:`~lightning_kl.ground.kept.as_kept_sets`),
    and a non-empty set at every valid position (``mask`` bool or None): a distribution to score.

    Raises:
        TypeError: for a record that is not a ``KeptSets`` or an ``(ids, offsets)`` pair (a ``KeptSets`` only on a
            vocabulary shard, which names the vocabulary size).
        ValueError: for a record of other positions, another vocabulary, device or temperature, a malformed one, or an
            empty set at a valid position (named).
    """
    if is_from_hidden(x):
        lead, split = x.hidden, isinstance(x.weight, VocabShard)
        vocab = None if split else x.weight.shape[0]
    else:
        split = is_vocab_parallel(x)
        lead = local_part(x)
        vocab = None if split else lead.shape[-1]
    if split:
        if not isinstance(kept, KeptSets):
            raise TypeError("on a vocabulary shard `kept` must be a KeptSets (lightning_kl.ground.kept), which names the vocabulary size.")
        vocab = kept.vocab
    kept = as_kept_sets(kept, lead.shape[:-1], vocab, lead.device, temperature)
    check_nonempty(kept, mask)
    return kept


def check_loss_kept(kept: Any, inputs: KLInputs, spec: EstimatorSpec, forward_kl: bool, temperature: float) -> Optional[KeptSets]:
    """``kept=`` of :class:`~lightning_kl.KLPenaltyLoss` (and ``kl_penalty``): for ``"full"`` only, whose reference is
    unprocessed, so not with a divergence that holds the forward KL (``forward_kl``: +inf wherever the reference has
    mass outside the recorded set); then :func:`check_kept` against the checked inputs. None stays None.

    Raises:
        ValueError: for a sampled estimator, a divergence holding the forward KL, or a bad record (:func:`check_kept`).
    """
    if kept is None:
        return None
    if spec.base != "full":
        raise ValueError(
            f"`kept` (replay) applies to estimator='full' (logits or lk.FromHidden), got {spec.name!r}: a sampled estimator "
            "takes log-probs, so replay the record where they are scored, `lk.token_logprobs(logits, tokens, sampling=s, "
            "kept=kept)`, and pass those log-probs."
        )
    if forward_kl:
        raise ValueError(
            "`kept` (replay) with a divergence that holds the forward KL KL(ref || policy): the loss's reference is "
            "unprocessed, with mass outside the recorded kept set, so the value is +inf at every token whose set is not "
            "the whole vocabulary. Valid with `kept`: divergence='reverse', or 'jsd' with 0 < beta < 1; or "
            "lk.full_kl(..., kept=kept, reference='policy_kept') for the forward KL on the recorded set."
        )
    return check_kept(kept, inputs.logprob, inputs.mask, temperature)
