r"""Row readers: a ``[n, V]`` matrix of logits read by chunks of rows, never whole.

A kernel that works on chunks of rows asks a reader for the rows ``idx`` (a slice of flat row
positions, or a tensor of them) and gets a ``[c, V]`` tensor. :class:`Rows` reads them from a
``[..., V]`` logits tensor in place; :class:`LinearRows` makes them from hidden states and an LM
head, ``hidden[idx] @ weight.T + bias``, so that the full logits never exist.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LinearRows", "Rows"]


class Rows:
    """A ``[..., V]`` tensor read by chunks of flat row indices, without copying it whole.

    A chunk is a slice of the ``[n, V]`` view when the leading dims can be viewed as one, else it is
    gathered (``index_select``, or multi-dimensional indices for a slice like ``logits[:, :-1]``).
    ``flat`` is None in the second case: callers then pass index tensors, not slices.
    """

    def __init__(self, x: Tensor) -> None:
        self.x = x
        self.lead = x.shape[:-1]
        self.vocab = x.shape[-1]
        self.dtype = x.dtype
        try:
            self.flat: Optional[Tensor] = x.view(-1, x.shape[-1])
        except RuntimeError:
            self.flat = None

    def read(self, idx: slice | Tensor) -> tuple[Tensor, bool]:
        """The rows ``idx`` as ``[c, V]``, and whether that is a fresh copy (ours to overwrite)."""
        if isinstance(idx, slice):
            assert self.flat is not None
            return self.flat[idx], False
        if self.flat is not None:
            return self.flat.index_select(0, idx), True
        return self.x[torch.unravel_index(idx, self.lead)], True


class LinearRows:
    """The logits ``hidden @ weight.T + bias`` of ``hidden [..., d]``, made chunk by chunk.

    ``weight`` is ``[V, d]``, ``bias`` ``[V]`` or None. A chunk is computed in the inputs' dtype (as
    the model's own ``nn.Linear`` head computes it) and is always a fresh tensor. The hidden states
    are viewed (or, when their layout does not allow it, copied: they are ``V / d`` times smaller
    than the logits) as ``[n, d]``, so ``flat`` is never None.
    """

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.lead = hidden.shape[:-1]
        self.vocab = weight.shape[0]
        self.dtype = hidden.dtype
        self.flat: Tensor = hidden.reshape(-1, hidden.shape[-1])

    def read(self, idx: slice | Tensor) -> tuple[Tensor, bool]:
        """The logits of rows ``idx`` as ``[c, V]`` (always fresh)."""
        h = self.flat[idx] if isinstance(idx, slice) else self.flat.index_select(0, idx)
        return F.linear(h, self.weight, self.bias), True

    def hidden_rows(self, idx: slice | Tensor) -> Tensor:
        """The hidden states of rows ``idx``, ``[c, d]``."""
        return self.flat[idx] if isinstance(idx, slice) else self.flat.index_select(0, idx)
