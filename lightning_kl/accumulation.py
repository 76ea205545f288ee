r"""Gradient accumulation: the optimizer step's totals, so that ``k`` micro-batches give one batch's gradient.

With ``Trainer(accumulate_grad_batches=k)`` Lightning divides each micro-batch's loss by ``k`` and sums
the ``k`` gradients. A loss that divides by its micro-batch's own count of valid tokens (``token-mean``)
or sequences (``seq-mean-*``) then weighs the micro-batches equally, not the tokens: with uneven
micro-batches the accumulated gradient is not the gradient of the step's batch (the bug that
``transformers`` fixed in 2024 by passing the step's token count to the loss). The exact recipe:
divide every micro-batch by the *step's* totals, from :func:`step_totals`, and multiply by ``k``
(``KLPenaltyLoss(...)(..., num_tokens=, num_seqs=, accumulate_grad_batches=k)`` does both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_kl.ground.checks import check_mask
from lightning_kl.inputs import check_accumulate_grad_batches  # noqa: F401  (checked with a call's inputs; named here for 0.2's callers)
from lightning_kl.reduce import mask_counts

__all__ = ["step_totals"]


def step_totals(masks: Sequence[Optional[Tensor]] | Tensor) -> dict[str, Tensor]:
    r"""The totals of an optimizer step over its micro-batches' masks: ``num_tokens`` and ``num_seqs``.

    .. math::
        \texttt{num\_tokens} = \sum_{j} \sum_{i,t} m^{(j)}_{it}, \qquad
        \texttt{num\_seqs} = \sum_j \#\{i : \textstyle\sum_t m^{(j)}_{it} > 0\}

    over the micro-batches :math:`j` of one optimizer step (one process's: with
    ``KLPenaltyLoss(global_batch=True)`` the loss sums them over the data parallel group itself, so
    each data parallel replica counts once: under tensor parallelism the ranks of a replica hold
    the same micro-batches and give the same totals, and are not summed). The counts are
    those that :func:`~lightning_kl.aggregate` divides by, so that passing them to every
    micro-batch's loss (``**step_totals(masks)``) gives each micro-batch its exact share of the
    step's ``token-mean`` or ``seq-mean-*`` loss. Every leading dimension is a sequence dimension.

    Args:
        masks: the micro-batches' ``[..., t]`` masks (bool, or 0/1 numbers; ``t`` may differ between
            micro-batches), all on one device; or one mask.

    Returns:
        ``{"num_tokens": n, "num_seqs": s}``: 0-d int64 tensors on the masks' device (no host read).

    Raises:
        ValueError: for no mask, or a mask that is a scalar or not a tensor.

    Example:
        >>> m1 = torch.tensor([[True, True, False], [False, False, False]])
        >>> m2 = torch.tensor([[True, True, True, True]])
        >>> step_totals([m1, m2])  # 2 + 4 tokens; the empty sequence does not count
        {'num_tokens': tensor(6), 'num_seqs': tensor(2)}
    """
    if isinstance(masks, Tensor):
        masks = [masks]
    if len(masks) == 0:
        raise ValueError("`step_totals` needs the masks of at least one micro-batch, got none.")
    tokens, seqs = [], []
    for i, mask in enumerate(masks):
        if not isinstance(mask, Tensor) or mask.ndim == 0:
            got = type(mask).__name__ if not isinstance(mask, Tensor) else "a 0-d tensor"
            raise ValueError(f"`step_totals`: micro-batch {i}'s mask must be a [..., t] tensor, got {got}.")
        m = check_mask(mask.detach(), mask, "mask")
        assert m is not None
        n_tokens, n_seqs = mask_counts(m)
        tokens.append(n_tokens)
        seqs.append(n_seqs)
    return {"num_tokens": torch.stack(tokens).sum(), "num_seqs": torch.stack(seqs).sum()}

