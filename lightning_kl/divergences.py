r"""``lk.full_kl``: the exact divergence between the policy and another model over the vocabulary, per token.

The other model is a second source of the engine (logits, vocabulary shards, an LM head: the reference, a local
teacher), or a served teacher's top-k log-probs (:class:`~lightning_kl.TopK`, :mod:`lightning_kl.distill.topk`);
the divergence is any of :mod:`lightning_kl.kernels.divergence`. The token quantities over the vocabulary (log-probs,
the entropy) are in :mod:`lightning_kl.logprobs`, whose input resolution this module shares.
"""

from __future__ import annotations

from typing import Any, Optional

import torch  # noqa: F401 (the examples in the docstrings use it)
from torch import Tensor

from lightning_kl.distill.topk import TopK, topk_divergence
from lightning_kl.ground.sampler import Sampling
from lightning_kl.ground.vocab_shards import VocabShard, is_vocab_parallel
from lightning_kl.inputs import check_chunk_size, check_full_hidden_inputs, check_full_inputs
from lightning_kl.kept_inputs import check_kept
from lightning_kl.kernels.divergence import Divergence, check_divergence
from lightning_kl.kernels.engine import REFERENCES, full_kl_kernel
from lightning_kl.kernels.full import same_partition
from lightning_kl.logprobs import FromHidden, sampler_of, source_of

__all__ = ["full_kl"]


def full_kl(
    x: Tensor | VocabShard | FromHidden,
    ref_x: Tensor | VocabShard | FromHidden,
    mask: Optional[Tensor] = None,
    *,
    sampling: Optional[Sampling] = None,
    reference: str = "unprocessed",
    divergence: Divergence = "reverse",
    beta: Optional[float] = None,
    chunk_size: Optional[int] = None,
    kept: Any = None,
    **legacy: Any,
) -> Tensor:
    r"""Exact per-token :math:`\mathrm{KL}(\tilde\pi \,\|\, \pi_{\mathrm{ref}})` over the vocabulary, or another divergence.

    .. math::
        \mathrm{KL} = \sum_{i \in K} \tilde p_i (\log \tilde p_i - \log q_i)

    :math:`\tilde p`: the policy's distribution, ``softmax(z / T)``, or with a truncating sampler its
    processed distribution on the kept set :math:`K`. The reference :math:`q` (``reference=``), always
    at the same temperature (the three are one without truncation):

    * ``"unprocessed"`` (default): ``softmax(z_ref / T)``, the whole vocabulary; finite.
    * ``"policy_kept"``: the reference renormalized on the policy's kept set: the two models compared
      among the tokens the sampler can draw; finite, 0 whenever :math:`K` is a single token.
    * ``"processed"``: the reference processed by the same rule on its own logits. ``+inf`` where the
      policy keeps a token the reference removes; a backward through such a token raises.

    ``divergence=`` (``beta=`` for the last two, in [0, 1], default 0.5), between :math:`\tilde p` and
    the other model's :math:`q` (a reference, a teacher), sums over the whole vocabulary with
    :math:`0 \log 0 = 0`:

    * ``"reverse"`` (default), mode seeking, the KL above:

      .. math::
          D = \mathrm{KL}(\tilde p \,\|\, q) = \sum_i \tilde p_i (\log \tilde p_i - \log q_i)

    * ``"forward"``, mass covering (on-policy distillation's "forward KL"):

      .. math::
          D = \mathrm{KL}(q \,\|\, \tilde p) = \sum_i q_i (\log q_i - \log \tilde p_i)

      ``+inf`` where :math:`q` has mass outside :math:`K`: with a truncating sampler take
      ``reference="policy_kept"`` (or ``"processed"`` where the other model keeps less).

    * ``"jsd"``, the generalized Jensen-Shannon divergence of GKD, TRL's convention (its
      ``generalized_jsd_loss``): ``beta = 0`` is the forward KL, ``beta = 1`` the reverse KL, and between

      .. math::
          m = (1 - \beta)\, \tilde p + \beta\, q, \qquad
          D = \beta\, \mathrm{KL}(q \,\|\, m) + (1 - \beta)\, \mathrm{KL}(\tilde p \,\|\, m)

      finite for :math:`0 < \beta < 1`, at most :math:`\log 2` at ``beta = 0.5``.

    * ``"mixed"``, NeMo-RL's ``mixed_kl_weight`` :math:`w` (which weighs the forward KL) as
      :math:`\beta = 1 - w`, the same ends as ``"jsd"``:

      .. math::
          D = (1 - \beta)\, \mathrm{KL}(q \,\|\, \tilde p) + \beta\, \mathrm{KL}(\tilde p \,\|\, q)

    No sampling noise; exact gradients w.r.t. both models' inputs (the kept sets are selections), for
    the reverse KL :math:`\tilde p_i (\log \tilde p_i - \log q_i - \mathrm{KL}) / T` and :math:`(q_i - \tilde p_i) / T`;
    for the others :math:`(g_i - \tilde p_i \sum_j g_j) / T` with :math:`g = \partial D / \partial \log \tilde p`
    (forward: :math:`(\tilde p_i - q_i) / T`), and the other side's the same with the roles swapped. The
    other side requires no gradient unless it is meant to train: one that does gets its exact gradient,
    with the warning that it requires grad. Chunked, one engine for every divergence: beyond the
    inputs and their gradients a few chunk-sized temporaries and ``O(n)`` numbers. The JSD strictly
    between its ends reads a head's vocabulary tiles, or a split vocabulary's shards, twice in forward
    (its mixture needs both models' global log-sums first).

    Args:
        x, ref_x: the policy's and the reference's ``[..., V]`` logits, both split over the vocabulary
            the same way (DTensors ``Shard(-1)`` or :class:`~lightning_kl.VocabShard`), or both
            :class:`FromHidden`.
        mask: optional ``[...]``, True on valid tokens: value 0 and gradient exactly 0 elsewhere, even
            where the inputs hold NaN.
        sampling: the policy's sampler (None: ``softmax(z)``); truncation refused on a split vocabulary.
        reference: one of :data:`REFERENCES`.
        divergence: one of :data:`~lightning_kl.kernels.divergence.DIVERGENCES` (above).
        beta: ``"jsd"`` and ``"mixed"`` only: a number in [0, 1], default 0.5.
        chunk_size: rows per chunk.
        kept: replay: the policy's recorded kept sets (above); None: the sampler's own kept sets.

    **Replay** (``kept=``): the rollout's recorded kept sets (``return_kept=True`` at rollout time, or an
    inference engine's record: :class:`~lightning_kl.ground.kept.KeptSets`, or the pair ``(ids, offsets)``
    shaped like ``mask``). :math:`\tilde p` is then ``softmax(z / T)`` renormalized on each position's
    recorded set :math:`K`, not on the kept set the sampler would choose from the current logits (which
    moves off-policy: PPO epochs > 1, stale rollouts); ties at its boundary follow the record. The
    reference, with a replayed set:

    * ``"unprocessed"``: ``softmax(z_ref / T)``, as without a record.
    * ``"policy_kept"``: the reference renormalized on the recorded :math:`K` (the two models compared
      among the tokens the rollout's sampler could draw).
    * ``"processed"``: the reference processed by ``sampling``'s rule on its own logits, its kept set
      recomputed (a frozen reference's set does not move between epochs); ``+inf`` where the record holds a
      token it removes. It needs whole rows: refused with ``kept=`` on a split vocabulary.

    On-policy (the record is the policy's own kept sets) value and gradients are those without ``kept=``,
    bit for bit (the same ops on the same numbers); from two heads whose vocabulary spans several tiles,
    the record is read tile by tile (the processing reads whole rows): the same value to float rounding.
    Off-policy the gradients are the formulas above with :math:`K` the recorded set (a selection), finite
    wherever the value is; the reverse KL against ``"unprocessed"`` or ``"policy_kept"``, the JSD with
    ``0 < beta < 1`` and every divergence on ``"policy_kept"`` are finite. Logits, :class:`FromHidden`,
    a head's tiles and vocabulary shards (there a ``KeptSets``, the same on every rank). Every valid
    position needs a non-empty set (named otherwise); a record of other positions, vocabulary, device or
    temperature is refused. With an :class:`~lightning_kl.TopK` teacher (below) the student's cells are its
    log-probs on the recorded sets (``reference="unprocessed"``).

    ``ref_x`` may be a teacher's top-k log-probs, :class:`~lightning_kl.TopK`: the divergence between both
    models coarsened onto its ids and a tail (:func:`lightning_kl.distill.topk.topk_divergence`, which takes
    ``divergence=``, ``beta=`` and ``return_tails=``).

    The deprecated ``temperature=`` keyword still works, with a ``DeprecationWarning``.

    Returns:
        ``[...]`` KL per token, float32 (float64 for float64 inputs), the same on every rank of a split.

    Raises:
        TypeError: for inputs that are not floating point tensors, a mix of forms (named).
        ValueError: for shapes or devices that do not match (named), a bad reference, divergence, beta,
            sampler, chunk size or record (``kept``) (named); in backward, for a ``+inf`` value with a gradient.

    Example:
        >>> z = torch.tensor([[0.0, 0.0], [2.0, -1.0]], requires_grad=True)
        >>> ref = torch.tensor([[1.0, -1.0], [2.0, -1.0]])
        >>> kl = full_kl(z, ref)
        >>> kl  # row 0: 0.5 log(0.5/0.8808) + 0.5 log(0.5/0.1192); row 1: identical distributions
        tensor([0.4338, 0.0000], grad_fn=<_FullKLBackward>)
        >>> kl.sum().backward(); z.grad  # p (log p - log q - KL): 0.5 (-0.5662 - 0.4338), ...
        tensor([[-0.5000,  0.5000],
                [ 0.0000,  0.0000]])
        >>> full_kl(torch.tensor([[2.0, 1.0, 0.0]]), torch.tensor([[0.0, 1.0, 2.0]]), sampling=Sampling(top_k=2), reference="processed")
        tensor([inf])
        >>> full_kl(z.detach(), ref, divergence="forward")  # row 0: 0.8808 log(0.8808/0.5) + 0.1192 log(0.1192/0.5)
        tensor([0.3278, 0.0000])
    """
    if isinstance(ref_x, TopK):  # a teacher's top-k log-probs: the divergence coarsened onto its ids and a tail
        return topk_divergence(
            x, ref_x, mask, sampling=sampling, reference=reference, divergence=divergence, beta=beta, chunk_size=chunk_size,
            kept=kept, **legacy
        )
    proc = sampler_of(sampling, legacy, "full_kl")
    if reference not in REFERENCES:
        raise ValueError(f"`reference` must be one of {REFERENCES}, got {reference!r}.")
    # replay: the record replaces the policy's truncation; the reference is processed by the sampler only under "processed"
    own = proc if kept is None else Sampling(proc.temperature)
    ref_proc = proc if kept is None or reference == "processed" else own
    divergence, beta = check_divergence(divergence, beta)
    check_chunk_size(chunk_size)
    hidden = isinstance(x, FromHidden), isinstance(ref_x, FromHidden)
    if hidden[0] != hidden[1]:
        raise TypeError("`x` and `ref_x` must both be logits (or vocabulary shards) or both lk.FromHidden, not one of each.")
    if hidden[0]:
        mask = check_full_hidden_inputs(x.hidden, x.weight, x.bias, ref_x.hidden, ref_x.weight, ref_x.bias, mask)
    else:
        mask = check_full_inputs(x, ref_x, mask)
    if kept is not None and ref_proc.truncates and (isinstance(x.weight, VocabShard) if hidden[0] else is_vocab_parallel(x)):
        raise ValueError(
            f"reference='processed' with `kept` (replay) processes the reference's own logits by {proc!r}, which needs whole "
            "rows: not on a vocabulary split over processes. Valid there with `kept`: reference='unprocessed' or "
            "'policy_kept' (the reference renormalized on the recorded set)."
        )
    (src, part, _), (ref, ref_part, _) = source_of(x, "x" if hidden[0] else "logits", own), source_of(ref_x, "ref_x" if hidden[0] else "ref_logits", ref_proc)
    part = same_partition(part, "weight" if hidden[0] else "logits", ref_part, "ref_weight" if hidden[0] else "ref_logits")
    if kept is not None:
        kept = check_kept(kept, x, mask, proc.temperature)
    return full_kl_kernel(
        src, ref, None if mask is None else ~mask.reshape(-1), proc, reference, part, chunk_size, divergence, beta, replay=kept
    )
