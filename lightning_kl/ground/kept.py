r"""The kept set a sampler drew each token from, recorded at rollout time and replayed later.

A truncating sampler (top-k, top-p, min-p) draws token :math:`y` of a position from the tempered
softmax renormalized on a kept set :math:`K`. Off-policy (PPO epochs > 1, mini-batches, stale rollouts)
the current policy's own kept set moves, and a sampled token can leave it. Replay keeps the
rollout's :math:`K` and renormalizes the current policy on it:

.. math::
    \log \tilde p_y = \frac{z_y}{T} - \operatorname{lse}_{j \in K}\Big(\frac{z_j}{T}\Big), \qquad
    \frac{\partial \log \tilde p_y}{\partial z_j} = \frac{[j = y] - [j \in K]\, \tilde p_j}{T},

finite for every sampled token (it lies in its own :math:`K`). ``lk.token_logprobs(x, tokens,
sampling=s, return_kept=True)`` records, ``lk.token_logprobs(x, tokens, sampling=s, kept=kept)`` replays.

**Why ragged ids.** A recorded set must be stored as the token ids themselves (or a mask of them): a
rank threshold on the sorted scores would need the old logits to rank again, and replay has only the
new ones. Of ids and masks, the ids are smaller for the sets samplers keep: at
:math:`V = 151{,}936` a packed bitmask costs :math:`V/8 = 18{,}992` bytes per token whatever the set,
while ragged ids cost :math:`4|K| + 8` bytes (int32 ids, one int64 offset): 208 bytes for top-k 50,
12 for a nucleus of one token, 1,155 on average for top-p 0.9 at T = 0.9 over logits ``4 N(0, 1)``
(a flat distribution: 287 tokens kept on average); the mask wins only past :math:`|K| = 4{,}746`
(3.1% of the vocabulary).

:class:`KeptSets` holds ``n`` positions' sets in the compressed-row form an inference engine can give
too: position ``i`` (row-major over ``shape``, the tokens' shape) keeps
``ids[offsets[i]:offsets[i + 1]]``.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_kl.ground.checks import check_temperature, check_values

__all__ = ["KeptSets", "as_kept_sets", "check_nonempty", "report_missing"]


def _position(shape: torch.Size, flat: int) -> tuple[int, ...]:
    """The index over ``shape`` of the row-major position ``flat``."""
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if len(shape) else ()


class KeptSets:
    r"""The kept sets of the positions of a ``tokens`` tensor: ragged ids, one set per position.

    Position ``i`` (row-major over ``shape``) keeps the ids ``ids[offsets[i]:offsets[i + 1]]`` of a
    vocabulary of ``vocab`` entries (an id repeated in one set counts once). Returned by
    ``lk.token_logprobs(..., return_kept=True)`` and ``lk.hf.response_logprobs(..., return_kept=True)``;
    an inference engine's record in this form is accepted as ``KeptSets(ids, offsets, shape, vocab)``
    (or as the plain pair ``(ids, offsets)``, shaped like the tokens it is replayed with). Positions
    that are not scored (``ignore_index``, after EOS) may hold any set, the empty one included.

    Memory: ``4 |K| + 8`` bytes per position (int32 ids, int64 offsets), against ``V / 8`` for a bitmask.

    Args:
        ids: ``[nnz]`` integer ids in ``[0, vocab)`` (stored as int32).
        offsets: ``[n + 1]`` integer offsets, ``offsets[0] = 0``, non-decreasing, ``offsets[n] = nnz``
            (stored as int64, on the ids' device).
        shape: the tokens' shape (``n`` its number of elements).
        vocab: the vocabulary size ``V``.
        temperature: optional, the sampler's temperature when the sets were chosen (a record made by
            ``return_kept=True`` holds it): a replay at another temperature is refused, since the sets
            were chosen for this one. None (an engine's record that does not say): not checked.

    Raises:
        TypeError: for ids or offsets that are not integer tensors.
        ValueError: for a malformed record, naming the first bad position: offsets of the wrong length,
            decreasing, not starting at 0 or not ending at ``nnz``; an id outside ``[0, vocab)``.
            Validation reads the record on the host once, at construction.

    Example:
        >>> k = KeptSets(torch.tensor([2, 0, 1]), torch.tensor([0, 1, 3]), (2,), vocab=4)
        >>> k.to_mask()
        tensor([[False, False,  True, False],
                [ True,  True, False, False]])
        >>> k.sizes()
        tensor([1, 2])
    """

    __slots__ = ("ids", "offsets", "shape", "vocab", "temperature", "_host")

    def __init__(
        self, ids: Tensor, offsets: Tensor, shape: Union[Sequence[int], torch.Size], vocab: int, temperature: Optional[float] = None
    ) -> None:
        for name, t in (("ids", ids), ("offsets", offsets)):
            if not isinstance(t, Tensor) or t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
                got = t.dtype if isinstance(t, Tensor) else type(t).__name__
                raise TypeError(f"kept sets: `{name}` must be an integer tensor, got {got}.")
            if t.dim() != 1:
                raise ValueError(f"kept sets: `{name}` must be 1-D, got shape {tuple(t.shape)}.")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"kept sets: `vocab` must be an integer >= 1, got {vocab!r}.")
        if vocab > 2**31 - 1:
            raise ValueError(f"kept sets: `vocab` must be below 2**31 (ids are int32), got {vocab}.")
        try:
            shape = torch.Size(int(s) for s in shape)
        except (TypeError, ValueError):
            raise ValueError(f"kept sets: `shape` must be a sequence of integers, got {shape!r}.") from None
        n = math.prod(shape)
        if offsets.numel() != n + 1:
            raise ValueError(
                f"kept sets: `offsets` must have n + 1 = {n + 1} entries for {n} positions (shape {tuple(shape)}), "
                f"got {offsets.numel()}."
            )
        off = offsets.to("cpu", torch.int64, copy=True)
        if int(off[0]) != 0:
            raise ValueError(f"kept sets: `offsets` must start at 0, got {int(off[0])}.")
        if int(off[-1]) != ids.numel():
            raise ValueError(f"kept sets: `offsets` must end at the number of ids, {ids.numel()}, got {int(off[-1])}.")
        down = (off[1:] < off[:-1]).nonzero()
        if down.numel():
            i = int(down[0])
            raise ValueError(
                f"kept sets: `offsets` decrease at position {_position(shape, i)} ({int(off[i])} then {int(off[i + 1])}): "
                "they must be non-decreasing."
            )
        bad = ((ids < 0) | (ids >= vocab)).nonzero()
        if bad.numel():
            k = int(bad[0])
            i = int(torch.searchsorted(off, torch.tensor(k), right=True)) - 1
            raise ValueError(
                f"kept sets: id {int(ids[k])} at position {_position(shape, i)} is out of range for a vocabulary of V={vocab}."
            )
        self.ids = ids.to(torch.int32)
        self.offsets = off.to(ids.device)
        self._host = off.numpy()  # the offsets on the host: replay reads its chunks' bounds with no device sync
        self.shape = shape
        self.vocab = vocab
        if temperature is not None:
            temperature = check_temperature(temperature)
        self.temperature = temperature

    def __repr__(self) -> str:
        return (
            f"KeptSets(shape={tuple(self.shape)}, vocab={self.vocab}, temperature={self.temperature}, ids={self.ids.numel()}, "
            f"device={self.ids.device})"
        )

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def to(self, device: Union[str, torch.device]) -> "KeptSets":
        """The same record on ``device`` (no validation again: the offsets' host copy is shared)."""
        out = object.__new__(KeptSets)
        out.ids, out.offsets, out.shape, out.vocab, out.temperature, out._host = (
            self.ids.to(device), self.offsets.to(device), self.shape, self.vocab, self.temperature, self._host
        )
        return out

    def sizes(self) -> Tensor:
        """``[*shape]`` the number of ids of each position's set (int64)."""
        return (self.offsets[1:] - self.offsets[:-1]).view(self.shape)

    def nbytes(self) -> int:
        """Bytes held: the ids and the offsets."""
        return self.ids.numel() * self.ids.element_size() + self.offsets.numel() * self.offsets.element_size()

    def bounds(self, start: int, stop: int) -> tuple[int, int]:
        """Where the ids of positions ``[start, stop)`` lie in ``ids`` (from the host copy of the offsets)."""
        return int(self._host[start]), int(self._host[stop])

    def _rows(self) -> Tensor:
        """``[nnz]`` int64: the flat position of each id."""
        counts = self.offsets[1:] - self.offsets[:-1]
        return torch.repeat_interleave(torch.arange(counts.numel(), device=self.device), counts, output_size=self.ids.numel())

    def to_mask(self) -> Tensor:
        """``[*shape, vocab]`` bool, True on the kept ids (for small vocabularies and tests)."""
        mask = torch.zeros(math.prod(self.shape), self.vocab, dtype=torch.bool, device=self.device)
        mask[self._rows(), self.ids.long()] = True
        return mask.view(*self.shape, self.vocab)

    @classmethod
    def from_mask(cls, mask: Tensor) -> "KeptSets":
        """From a ``[..., V]`` bool mask, True on the kept ids (a host read: the sizes depend on the values)."""
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() < 1:
            raise TypeError(f"kept sets: a mask must be a [..., V] bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}.")
        flat = mask.reshape(-1, mask.shape[-1])
        counts = flat.sum(-1)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        return cls(flat.nonzero()[:, 1], offsets, mask.shape[:-1], mask.shape[-1])

    @classmethod
    def from_scores(cls, scores: Union[Sequence[Tensor], Tensor]) -> "KeptSets":
        """From ``generate``'s processed scores (``out.scores`` of ``generate(..., output_scores=True,
        return_dict_in_generate=True)``: ``t`` tensors ``[b, V]``, or one ``[b, t, V]``): the finite
        entries of each step are the kept set the sampler drew from. Shape ``[b, t]``."""
        if not isinstance(scores, Tensor):
            scores = torch.stack(list(scores), dim=1)
        if scores.dim() != 3 or not scores.is_floating_point():
            raise ValueError(
                f"kept sets: generate's scores must be t tensors [b, V] or one [b, t, V] float tensor, got shape {tuple(scores.shape)}."
            )
        return cls.from_mask(scores > float("-inf"))

    def __getitem__(self, index: Any) -> "KeptSets":
        """The sets of ``positions[index]``, indexed as the tokens are (``kept[rows]``, ``kept[:, :-1]``): mini-batches of a rollout."""
        n = math.prod(self.shape)
        pos = torch.arange(n, device=self.device).view(self.shape)[index]
        return self._take(pos.reshape(-1), pos.shape)

    def _take(self, pos: Tensor, shape: torch.Size) -> "KeptSets":
        start, stop = self.offsets[pos], self.offsets[pos + 1]
        counts = stop - start
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        total = int(offsets[-1])
        within = torch.arange(total, device=self.device) - torch.repeat_interleave(offsets[:-1], counts, output_size=total)
        ids = self.ids[torch.repeat_interleave(start, counts, output_size=total) + within]
        return KeptSets(ids, offsets, shape, self.vocab, self.temperature)


def as_kept_sets(kept: Any, shape: torch.Size, vocab: int, device: torch.device, temperature: Optional[float] = None) -> KeptSets:
    """``kept=`` checked against the tokens' ``shape``, the vocabulary and the device: a :class:`KeptSets`,
    or a pair ``(ids, offsets)`` shaped like the tokens.

    Raises:
        TypeError: for another type.
        ValueError: for a record of another shape, vocabulary or device (named), or a malformed one.
    """
    if isinstance(kept, KeptSets):
        if kept.shape != shape:
            raise ValueError(f"`kept` holds the sets of positions of shape {tuple(kept.shape)}, but the tokens have shape {tuple(shape)}.")
        if temperature is not None and kept.temperature is not None and kept.temperature != temperature:
            raise ValueError(
                f"`kept` was recorded by a sampler at temperature {kept.temperature}, but it is replayed at {temperature}: "
                "the kept sets were chosen at the sampler's temperature. Replay with the rollout's sampling=."
            )
        if kept.vocab != vocab:
            raise ValueError(f"`kept` was recorded over a vocabulary of V={kept.vocab}, but the logits have V={vocab}.")
    elif isinstance(kept, (tuple, list)) and len(kept) == 2 and all(isinstance(t, Tensor) for t in kept):
        kept = KeptSets(kept[0], kept[1], shape, vocab)
    else:
        raise TypeError(
            "`kept` must be the kept sets returned with return_kept=True (lightning_kl.ground.kept.KeptSets) or a "
            f"pair (ids, offsets) of integer tensors, got {type(kept).__name__}."
        )
    if kept.device != device:
        raise ValueError(f"`kept` is on {kept.device} but the logits are on {device}.")
    return kept


def report_missing(missing: Tensor, tokens: Tensor) -> None:
    """Fail on a sampled token that is not in its own recorded set (``missing``, bool like ``tokens``):
    the record is not these tokens'. Named on the CPU; a device-side assertion elsewhere (no host read)."""
    def named() -> ValueError:
        where = tuple(missing.nonzero()[0].tolist())
        return ValueError(
            f"{int(missing.sum())} sampled token(s) are not in their own recorded kept set (`kept`), the first at position "
            f"{where} (id {int(tokens[where])}): a sampler draws only from its kept set, so this record belongs to other "
            "tokens (another rollout, or positions shifted: `kept` is indexed as `tokens` is)."
        )

    check_values(missing, named, "every sampled token must lie in its own recorded kept set (`kept`): the record belongs to other tokens")


def check_nonempty(kept: KeptSets, mask: Any) -> None:
    """Fail if a valid position (``mask`` True, or every position for None) has an empty recorded set:
    no distribution to take the entropy of. Named on the CPU; a device-side assertion elsewhere."""
    empty = kept.sizes() == 0
    if mask is not None:
        empty = empty & mask
    check_values(
        empty,
        lambda: ValueError(
            f"`kept` holds an empty set at position {tuple(empty.nonzero()[0].tolist())}, which the mask says is valid: "
            "every scored position needs its kept set."
        ),
        "every valid position needs a non-empty recorded kept set (`kept`)",
    )
