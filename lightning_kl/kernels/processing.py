r"""The sampler's processing (temperature, top-k, top-p, min-p): which tokens a sampler keeps.

Notation: ``n`` tokens (flattened leading dims), ``V`` the vocabulary, :math:`z` one token's logits,
:math:`T` the temperature. A sampler that processes the logits draws from

.. math::
    \tilde p_i = \frac{[i \in K]\, e^{z_i / T}}{\sum_{j \in K} e^{z_j / T}}, \qquad
    \log \tilde p_y = \frac{z_y}{T} - \operatorname{lse}_{j \in K}\Big(\frac{z_j}{T}\Big)

where the kept set :math:`K` is chosen by :func:`process_scores`, which applies the processors in
the order and with the tie rules of ``transformers``' ``generate`` (temperature, then top-k, then
top-p, then min-p; each one sees the scores the previous one left, with ``-inf`` on what it removed):

* top-k keeps every token whose score is ``>=`` the k-th largest (ties at the boundary are all kept);
* top-p sorts the scores ascending (``torch.sort``), and removes the tokens whose cumulative
  probability, summed from the least likely, is ``<= 1 - top_p``; the most likely token is always kept;
* min-p removes the tokens with probability ``< min_p`` times the largest probability.

The kept set is a selection: it does not move under a small change of the logits, so the gradient
flows through the kept tokens' logits and the normalizer only,

.. math::
    \frac{\partial \log \tilde p_y}{\partial z_i} = \frac{[i = y] - [i \in K]\, \tilde p_i}{T}.

The kept set's log-probs, the KL and the entropy of this distribution are computed chunk by chunk in
:mod:`lightning_kl.kernels.engine`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_kl.ground.sampler import Sampling

__all__ = ["Processing", "check_processing", "process_scores"]

#: The validated sampler (public as ``lk.Sampling``); the kernels' historical name for it.
Processing = Sampling


def check_processing(temperature: Any = 1.0, top_k: Any = None, top_p: Any = None, min_p: Any = None) -> Sampling:
    """Validate the sampler's processing, with ``generate``'s names and neutral values (see :class:`Sampling`).

    Raises:
        ValueError: naming the bad value and the valid range.
    """
    return Sampling(temperature, top_k, top_p, min_p)


def process_scores(scores: Tensor, proc: Processing) -> Tensor:
    """``generate``'s top-k, top-p and min-p on tempered scores ``[..., V]``: removed entries -> ``-inf``.

    The same ops as ``transformers``' ``TopKLogitsWarper``, ``TopPLogitsWarper`` and
    ``MinPLogitsWarper`` (``min_tokens_to_keep=1``, sampling without beams), in that order, so that
    on the same scores the same tokens are kept, ties and rounding included. Returns a new tensor.
    """
    ninf = float("-inf")
    if proc.top_k is not None:
        k = min(proc.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], ninf)
    if proc.top_p is not None:
        sorted_scores, order = torch.sort(scores, descending=False)
        remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - proc.top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(-1, order, remove), ninf)
    if proc.min_p is not None:
        probs = torch.softmax(scores, dim=-1)
        remove = probs < proc.min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        scores = scores.masked_fill(remove, ninf)
    return scores
