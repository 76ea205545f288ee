r"""Logits split over the vocabulary across a tensor parallel group: what a shard is, and how to find one.

A tensor parallel LM head (``ColwiseParallel``) gives each rank of its group the logits of a slice
of the vocabulary. Two forms are accepted wherever the package takes logits:

* a DTensor with placement ``Shard(-1)`` on one mesh dimension (``Replicate()`` on any others), what
  ``ColwiseParallel(use_local_output=False)`` returns and ``torch.distributed.tensor.parallel.loss_parallel``
  takes; its group and this rank's vocabulary offset are read from the mesh (torch's split:
  ``ceil(V / W)`` ids per rank, the last ranks' shards shorter or empty);
* a :class:`VocabShard`: a plain local shard with its group and offset, for code that holds local
  tensors (``use_local_output=True``, Megatron-style layers).

:func:`as_vocab_shard` turns either into a :class:`VocabShard` (the DTensor's local tensor through
``to_local()``, so that gradients flow back into the DTensor). Nothing here communicates.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_kl.ground.parallel import distributed

__all__ = ["VocabShard", "as_vocab_shard", "is_vocab_parallel", "check_split_alike", "local_part", "replicated_local", "sampled_locals"]


class VocabShard(NamedTuple):
    r"""This rank's shard of a vocabulary split across a tensor parallel group: its logits, or its LM head rows.

    Pass one per model in place of the logits to :func:`lightning_kl.token_logprobs`,
    :func:`lightning_kl.full_kl`, :func:`lightning_kl.kl_penalty` (``"full"``) and
    ``KLPenaltyLoss("full")``; or, holding this rank's rows of a column-parallel LM head, in place of
    the head's weight to :class:`lightning_kl.FromHidden`, which those functions take (the bias, if
    any, is this rank's ``[V_local]`` slice; the hidden states are the same on every rank, and their
    gradient is summed over the group). Every rank of ``group`` calls with its own shard; the shards must
    tile the vocabulary ``[0, V)`` without overlap (each token id owned by exactly one rank), which
    :func:`lightning_kl.token_logprobs` checks. The results are the same on every rank of the group
    (plain tensors), and so must be the gradients that flow back into them: compute the same loss
    on every rank of the group, as tensor parallel training does.

    Attributes:
        local: ``[..., V_local]`` this rank's logits for the ids ``offset ... offset + V_local - 1``
            (``V_local`` may be 0), or ``[V_local, d]``, this rank's rows of the LM head.
        group: the tensor parallel process group (``None``: the default group).
        offset: the first vocabulary id of this shard (``rank * V_local`` for an even split).

    Example:
        >>> shard = VocabShard(torch.zeros(2, 3, 4), group=None, offset=8)
        >>> shard.shape, shard.dtype  # the local shard's
        (torch.Size([2, 3, 4]), torch.float32)
    """

    local: Tensor
    group: Any = None
    offset: int = 0

    # read by the shape checks shared with plain logits (the local shard's: its last dim is V_local)
    @property
    def shape(self) -> torch.Size:
        """The local shard's shape (``[..., V_local]`` for logits)."""
        return self.local.shape

    @property
    def ndim(self) -> int:
        """The local shard's number of dimensions."""
        return self.local.ndim

    @property
    def dtype(self) -> torch.dtype:
        """The local shard's dtype."""
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        """The local shard's device."""
        return self.local.device


def _dtensor_type() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def is_vocab_parallel(x: object) -> bool:
    """Whether ``x`` is a :class:`VocabShard` or a DTensor: inputs for :func:`as_vocab_shard`.

    Every DTensor counts, so that one not split over the vocabulary gets the clear error of
    :func:`as_vocab_shard` rather than torch's mixed-tensor errors from inside the kernels.
    """
    dtensor = _dtensor_type()
    return isinstance(x, VocabShard) or (dtensor is not None and isinstance(x, dtensor))


def as_vocab_shard(x: object, name: str) -> VocabShard:
    """``x`` (a :class:`VocabShard` or a DTensor) as a checked :class:`VocabShard`.

    A DTensor must be ``Shard(-1)`` on one mesh dimension and ``Replicate()`` on the others.

    The group ``None`` is returned as the default group (``torch.distributed.group.WORLD``): the
    two spellings are one group everywhere.

    Raises:
        TypeError: for logits that are not a floating point tensor (or are a DTensor inside a
            :class:`VocabShard`), an offset that is not an int.
        ValueError: for other placements (named, with the ones accepted), a negative offset, a
            local shard whose size is not the mesh's split, or no initialized process group.
    """
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(x, dtensor):
        return _from_dtensor(x, name)
    if not isinstance(x, VocabShard):
        raise TypeError(f"`{name}` must be a VocabShard or a DTensor, got {type(x).__name__}.")
    local, group, offset = x
    if not isinstance(local, Tensor) or (dtensor is not None and isinstance(local, dtensor)):
        raise TypeError(f"`{name}.local` must be this rank's local shard, a plain torch.Tensor, got {type(local).__name__}.")
    if not local.is_floating_point():
        raise TypeError(f"`{name}.local` must be a floating point tensor, got dtype {local.dtype}.")
    if local.ndim == 0:
        raise ValueError(f"`{name}.local` must be `[..., V_local]` with a vocabulary dimension, got a scalar.")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"`{name}.offset` must be an int (the shard's first vocabulary id), got {offset!r}.")
    if offset < 0:
        raise ValueError(f"`{name}.offset` must be >= 0 (the shard's first vocabulary id), got {offset}.")
    if not distributed():
        raise ValueError(f"`{name}` is a VocabShard but torch.distributed is not initialized: a shard needs its process group.")
    # None is the default group: one object for both spellings, so that shards compare alike
    return VocabShard(local, _default_group() if group is None else group, offset)


def _default_group() -> Any:
    return torch.distributed.group.WORLD


def _from_dtensor(x: Any, name: str) -> VocabShard:
    from torch.distributed.tensor import Shard

    placements, mesh, ndim = tuple(x.placements), x.device_mesh, x.ndim
    vocab_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim in (-1, ndim - 1)]
    others = [p for i, p in enumerate(placements) if i not in vocab_dims and not p.is_replicate()]
    if len(vocab_dims) != 1 or others or ndim == 0:
        hint = " Replicated logits hold the whole vocabulary on every rank: pass `x.to_local()`." if not vocab_dims else ""
        raise ValueError(
            f"`{name}` is a DTensor with placements {placements} on mesh {tuple(mesh.shape)}: only logits split "
            "over the vocabulary are accepted (Shard(-1) on one mesh dimension, Replicate() on the others: what "
            f"ColwiseParallel(use_local_output=False) gives).{hint}"
        )
    local = x.to_local()  # differentiable: the gradient comes back as a DTensor of the same placements
    dim = vocab_dims[0]
    size, offset = Shard.local_shard_size_and_offset(x.shape[-1], mesh.size(dim), mesh.get_local_rank(dim))
    if local.shape[-1] != size:
        raise ValueError(
            f"`{name}`'s local shard has {local.shape[-1]} vocabulary entries, but torch's split of V={x.shape[-1]} "
            f"over {mesh.size(dim)} ranks gives this rank {size}: pass the local shard as lk.VocabShard(local, group, offset)."
        )
    return VocabShard(local, group=mesh.get_group(dim), offset=int(offset))


def check_split_alike(a_name: str, a: object, b_name: str, b: object) -> None:
    """Both or neither split over the vocabulary (a :class:`VocabShard` or a DTensor); else ``TypeError``."""
    if is_vocab_parallel(a) != is_vocab_parallel(b):
        split, plain = (a_name, b_name) if is_vocab_parallel(a) else (b_name, a_name)
        raise TypeError(
            f"`{split}` is split over the vocabulary but `{plain}` is a plain tensor: split the policy's and the "
            "reference's the same way (both DTensors with Shard(-1) on one mesh, or both lk.VocabShard with one "
            "group and offset)."
        )


def local_part(x: Any) -> Any:
    """The local tensor of a :class:`VocabShard` or a DTensor (for the shape checks), else ``x`` itself."""
    if isinstance(x, VocabShard):
        return x.local
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(x, dtensor):
        return x.to_local()
    return x


def replicated_local(name: str, x: Any) -> Any:
    """A replicated DTensor (``loss_parallel``'s log-probs) as its local tensor, differentiably; else ``x``.

    Sampled estimators compute per token, so a value held whole on every rank is all they need.

    Raises:
        ValueError: for a DTensor that is not replicated (its placements named).
    """
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(x, dtensor):
        return x
    if not all(p.is_replicate() for p in x.placements):
        raise ValueError(
            f"`{name}` is a DTensor with placements {tuple(x.placements)}: sampled estimators take per-token "
            "log-probs held whole on every rank (a plain tensor, or a replicated DTensor such as loss_parallel's "
            "output); pass `x.full_tensor()` or compute them with `lk.token_logprobs` of the sharded logits."
        )
    return x.to_local()


def sampled_locals(logprob: Any, ref_logprob: Any, old_logprob: Any) -> tuple[Any, Any, Any]:
    """:func:`replicated_local` of a sampled estimator's three inputs."""
    return (
        replicated_local("logprob", logprob),
        replicated_local("ref_logprob", ref_logprob),
        replicated_local("old_logprob", old_logprob),
    )
