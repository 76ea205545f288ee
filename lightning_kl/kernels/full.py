r"""The engine's inputs: logits, vocabulary shards and LM heads resolved to a source and a partition.

Every entry point over the vocabulary (:func:`lightning_kl.token_logprobs`, :func:`lightning_kl.full_kl`,
:func:`lightning_kl.token_entropy`, the loss) turns what it was given into the engine's
:class:`~lightning_kl.kernels.engine.Tensors` and :class:`~lightning_kl.kernels.engine.Partition`
here: plain logits or a plain head cover the whole vocabulary; a vocabulary-sharded DTensor
(``Shard(-1)``) or an :class:`~lightning_kl.VocabShard` (of logits, or of a column-parallel head's
rows) is this rank's columns of a vocabulary split over its group. Nothing here communicates.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_kl.ground.kept import KeptSets
from lightning_kl.ground.sampler import Sampling
from lightning_kl.ground.vocab_shards import VocabShard, as_vocab_shard, is_vocab_parallel
from lightning_kl.kernels.engine import PLAIN, WHOLE, Head, Partition, Tensors, full_kl_kernel

__all__ = ["full_kl_compute", "full_kl_from_hidden_compute", "head_source", "logits_source", "same_partition"]


def _partition(shard: VocabShard) -> Partition:
    return Partition(shard.group, shard.offset, torch.distributed.get_world_size(shard.group), split=True)


def logits_source(x: Any, name: str) -> tuple[Tensors, Partition]:
    """Logits ``[..., V]``, or a vocabulary shard of them (checked by :func:`as_vocab_shard`), as a source."""
    if is_vocab_parallel(x):
        shard = as_vocab_shard(x, name)
        return Tensors(shard.local), _partition(shard)
    return Tensors(x), WHOLE


def head_source(
    hidden: Tensor, weight: Any, bias: Optional[Tensor], name: str = "weight", head: Head = PLAIN
) -> tuple[Tensors, Partition]:
    """Hidden states and a head ``[V, d]``, or this rank's rows of a column-parallel head (a :class:`VocabShard`),
    with what the head does after its matmul (``head``: a logit scale, a soft cap; elementwise, so a shard's
    columns take it alike)."""
    if isinstance(weight, VocabShard):
        shard = as_vocab_shard(weight, name)
        return Tensors(hidden, shard.local, bias, head), _partition(shard)
    return Tensors(hidden, weight, bias, head), WHOLE


def same_partition(a: Partition, a_name: str, b: Partition, b_name: str) -> Partition:
    """The partition of two sources that must split the vocabulary alike, else an error naming both."""
    if a.split != b.split:
        split, plain = (a_name, b_name) if a.split else (b_name, a_name)
        raise TypeError(
            f"`{split}` is split over the vocabulary but `{plain}` is not: split the policy's and the reference's the "
            "same way (both DTensors with Shard(-1) on one mesh, or both lk.VocabShard with one group and offset)."
        )
    if a.group is not b.group or a.offset != b.offset:
        groups = "one group" if a.group is b.group else "two different groups"
        raise ValueError(
            f"`{a_name}` and `{b_name}` must be split the same way (one group, one offset): got offsets {a.offset} and "
            f"{b.offset} on {groups}."
        )
    return a


def full_kl_compute(
    logits: Any, ref_logits: Any, mask: Optional[Tensor], sampling: Sampling = Sampling(), chunk_size: Optional[int] = None,
    divergence: tuple[str, Optional[float]] = ("reverse", None), replay: Optional[KeptSets] = None,
) -> Tensor:
    """The exact KL of the processed policy to the unprocessed reference, from checked logits (or
    shards; ``mask`` bool or None): the way in of ``kl_penalty("full")`` and the loss; ``divergence``, a
    checked ``(divergence, beta)``, another divergence (:mod:`lightning_kl.kernels.divergence`); ``replay``, checked
    recorded kept sets of the policy (:func:`~lightning_kl.kernels.engine.full_kl_kernel`)."""
    (src, part), (ref, ref_part) = logits_source(logits, "logits"), logits_source(ref_logits, "ref_logits")
    part = same_partition(part, "logits", ref_part, "ref_logits")
    invalid = None if mask is None else ~mask.reshape(-1)
    return full_kl_kernel(src, ref, invalid, sampling, "unprocessed", part, chunk_size, *divergence, replay=replay)


def full_kl_from_hidden_compute(
    hidden: Tensor, weight: Any, bias: Optional[Tensor], ref_hidden: Tensor, ref_weight: Any, ref_bias: Optional[Tensor],
    mask: Optional[Tensor], sampling: Sampling = Sampling(), chunk_size: Optional[int] = None,
    head: Head = PLAIN, ref_head: Head = PLAIN, divergence: tuple[str, Optional[float]] = ("reverse", None),
    replay: Optional[KeptSets] = None,
) -> Tensor:
    """:func:`full_kl_compute` of the logits made from checked hidden states and heads (``head``,
    ``ref_head``: each head's logit scale and soft cap)."""
    src, part = head_source(hidden, weight, bias, "weight", head)
    ref, ref_part = head_source(ref_hidden, ref_weight, ref_bias, "ref_weight", ref_head)
    part = same_partition(part, "weight", ref_part, "ref_weight")
    invalid = None if mask is None else ~mask.reshape(-1)
    return full_kl_kernel(src, ref, invalid, sampling, "unprocessed", part, chunk_size, *divergence, replay=replay)
