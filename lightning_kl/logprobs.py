r"""Token log-probabilities: ``log softmax(logits / T)[tokens]``, exact, in bounded memory.

Shapes: ``...`` any leading dims (``[b, t]`` for a batch of sequences), ``V`` the vocabulary,
``d`` the hidden size.

* :func:`token_logprobs` takes logits ``[..., V]`` and ``tokens [...]``.
* :func:`token_logprobs_from_hidden` takes the last hidden states ``[..., d]`` and the LM head
  (``weight [V, d]``, optional ``bias [V]``) instead: the logits never exist at full size.

Both return ``[...]`` log-probabilities in float32 (float64 for float64 inputs), differentiable
w.r.t. every floating input, with the gradients in each input's own dtype. The usual
``torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])`` holds float32 copies of the
whole ``[..., V]`` logits from forward to backward (six times the bf16 logits at peak); here the
work runs over chunks (:mod:`lightning_kl.kernels.logprobs`), and beyond the inputs and their
gradients only a few chunk-sized buffers and ``O(n)`` numbers are held. ``python
benchmarks/bench_logprobs.py`` measures both.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_kl.ground.checks import check_chunk_size, check_floating, check_head, check_temperature, check_tokens
from lightning_kl.ground.vocab_shards import VocabShard, is_vocab_parallel
from lightning_kl.kernels.logprobs import token_logprobs_from_hidden_kernel, token_logprobs_kernel
from lightning_kl.kernels.processing import check_processing
from lightning_kl.kernels.vocab_parallel import vocab_parallel_token_logprobs, vocab_parallel_token_logprobs_from_hidden
from lightning_kl.sampling import processed_logprobs, processed_logprobs_from_hidden

__all__ = ["FromHidden", "token_logprobs", "token_logprobs_from_hidden"]


def _refuse_truncation_on_shards(top_k: Any, top_p: Any, min_p: Any) -> None:
    """Top-k, top-p and min-p over a vocabulary split across ranks are not built: refuse them clearly."""
    if check_processing(1.0, top_k, top_p, min_p).truncates:
        raise ValueError(
            f"top_k={top_k!r}, top_p={top_p!r}, min_p={min_p!r}: the sampler's truncation is not supported on "
            "logits or heads split over the vocabulary (its kept set needs a selection across the shards). "
            "Pass the temperature alone, or gather the logits of these rows (`logits.full_tensor()`) to score "
            "a truncated sampler."
        )


class FromHidden(NamedTuple):
    r"""Logits given as the last hidden states and the LM head: ``hidden @ weight.T + bias``.

    Pass one for each model in place of the logits to ``KLPenaltyLoss("full")``, so that the exact
    KL is computed chunk by chunk from the hidden states (:func:`lightning_kl.full_kl_from_hidden`)
    and the ``[..., V]`` logits never exist::

        kl_loss = self.kl(lk.FromHidden(hidden, self.policy.lm_head.weight),
                          lk.FromHidden(ref_hidden, self.ref.lm_head.weight), mask)

    Attributes:
        hidden: ``[..., d]`` the last hidden states (after the final norm).
        weight: ``[V, d]`` the LM head.
        bias: optional ``[V]`` head bias.
    """

    hidden: Tensor
    weight: Tensor
    bias: Optional[Tensor] = None



def token_logprobs(
    logits: Tensor | VocabShard,
    tokens: Tensor,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    *,
    chunk_size: Optional[int] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
) -> Tensor:
    r"""Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``.

    .. math::
        \ell_{\dots} = \frac{z_{\dots, y}}{T} - \log \sum_{v} e^{z_{\dots, v} / T}, \qquad y = \mathrm{tokens}_{\dots}

    Exact and chunked over rows: the forward keeps only the per-token log-sum-exp (float32); the
    backward recomputes the softmax chunk by chunk and writes the gradient once, in the logits'
    dtype. No ``[..., V]`` float32 copy of the logits is ever made.

    Args:
        logits: ``[..., V]`` floating point (float16, bfloat16, float32, float64); any layout
            (``logits[:, :-1]`` is read in place, never copied whole). Or logits split over the
            vocabulary across a tensor parallel group, never gathered: a DTensor with ``Shard(-1)``
            or a :class:`~lightning_kl.VocabShard` (see :mod:`lightning_kl.kernels.vocab_parallel`).
        tokens: ``[...]`` integer ids in ``[0, V)``.
        temperature: :math:`T > 0`, the sampling temperature.
        ignore_index: an id whose positions get log-prob 0 and exactly zero gradient (Hugging
            Face's label padding is ``-100``), even where the logits hold NaN.
        chunk_size: rows per chunk (default: about :math:`2^{19}` elements per chunk on CPU,
            :math:`2^{25}` on GPU).
        top_k, top_p, min_p: the sampler's truncation, as ``generate`` names it (None, or 0, 1.0
            and 0.0: off): the log-probs of the truncated, renormalized distribution, from
            :func:`lightning_kl.processed_logprobs` (a token outside the kept set raises).

    Returns:
        ``[...]`` log-probabilities, float32 (float64 for float64 logits), differentiable w.r.t. ``logits``.

    Raises:
        TypeError: for logits that are not floating point, or tokens that are not integers.
        ValueError: for shapes or devices that do not match (named), an id outside ``[0, V)`` that
            is not ``ignore_index`` (the id and ``V`` named), a bad temperature or chunk size.

    Example:
        >>> logits = torch.tensor([[0.0, 0.0], [2.0, 1.0]], requires_grad=True)
        >>> lp = token_logprobs(logits, torch.tensor([1, -100]), ignore_index=-100)
        >>> lp  # log(1/2); the ignored token gives 0
        tensor([-0.6931,  0.0000], grad_fn=<_TokenLogprobsBackward>)
        >>> lp.sum().backward(); logits.grad[0]  # one-hot minus softmax
        tensor([-0.5000,  0.5000])
        >>> bool((logits.grad[1] == 0).all())  # the ignored token: zero gradient
        True
    """
    if is_vocab_parallel(logits):  # split over the vocabulary (docs/scale.md): never gathered
        _refuse_truncation_on_shards(top_k, top_p, min_p)
        return vocab_parallel_token_logprobs(logits, tokens, check_temperature(temperature), ignore_index, check_chunk_size(chunk_size))
    if (top_k, top_p, min_p) != (None, None, None):
        return processed_logprobs(logits, tokens, temperature, top_k, top_p, min_p, ignore_index, chunk_size=chunk_size).logprobs
    check_floating("logits", logits)
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise ValueError(f"`logits` must be `[..., V]` with a vocabulary of V >= 1 entries, got shape {tuple(logits.shape)}.")
    temperature = check_temperature(temperature)
    check_chunk_size(chunk_size)
    ids, ignored = check_tokens(tokens, logits.shape[:-1], logits.shape[-1], logits.device, "logits", ignore_index)
    return token_logprobs_kernel(logits, ids, ignored, temperature, chunk_size)


def token_logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor | VocabShard,
    tokens: Tensor,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    *,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
) -> Tensor:
    r"""Log-probabilities of ``tokens`` under ``softmax((hidden @ weight.T + bias) / temperature)``.

    The same as ``token_logprobs(F.linear(hidden, weight, bias), tokens, ...)`` without ever
    making the ``[..., V]`` logits: blocks of ``chunk_size`` rows times tiles of the vocabulary are
    made in forward and again in backward (one extra matmul), with exact gradients w.r.t.
    ``hidden``, ``weight`` and ``bias``. A frozen head (``weight`` without grad, e.g. a reference
    model's) costs no gradient work for it, and under ``torch.no_grad()`` nothing is kept.

    The matmul runs in the inputs' dtype (the logits the model itself would make), the softmax in
    float32. For half precision weights that need a gradient and more than ``chunk_size`` rows,
    the weight's gradient is summed over the blocks in a ``[V, d]`` float32 buffer.

    Args:
        hidden: ``[..., d]`` the last hidden states (after the final norm).
        weight: ``[V, d]`` the LM head (``lm_head.weight``), the dtype and device of ``hidden``; or
            a :class:`~lightning_kl.VocabShard` of this rank's rows ``[V_local, d]`` of a
            column-parallel head (``bias`` then its ``[V_local]`` slice, ``chunk_size`` rows per
            chunk): the vocabulary is never gathered (:mod:`lightning_kl.kernels.vocab_parallel`).
        tokens: ``[...]`` integer ids in ``[0, V)``.
        bias: optional ``[V]`` head bias.
        temperature: :math:`T > 0`, the sampling temperature.
        ignore_index: an id whose positions get log-prob 0 and exactly zero gradient (``-100``).
        chunk_size: rows per block (default 4096).
        vocab_chunk_size: vocabulary entries per tile (default: about :math:`2^{22}` logits per tile on
            CPU, :math:`2^{26}` on GPU).
        top_k, top_p, min_p: the sampler's truncation (None: off), from
            :func:`lightning_kl.processed_logprobs_from_hidden` (whole-vocabulary chunks of
            ``chunk_size`` rows; ``vocab_chunk_size`` does not apply).

    Returns:
        ``[...]`` log-probabilities, float32 (float64 for float64 inputs).

    Raises:
        TypeError: for inputs that are not floating point, or tokens that are not integers.
        ValueError: for shapes, dtypes or devices that do not match (named), an id outside
            ``[0, V)`` that is not ``ignore_index`` (the id and ``V`` named), a bad temperature or chunk size.

    Example:
        >>> hidden = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
        >>> weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], requires_grad=True)
        >>> lp = token_logprobs_from_hidden(hidden, weight, torch.tensor([0, 1]))
        >>> lp  # logits [1, 0, 0] and [0, 2, 0]: 1 - log(e + 2), 2 - log(e^2 + 2)
        tensor([-0.5514, -0.2395], grad_fn=<_TokenLogprobsFromHiddenBackward>)
        >>> lp.sum().backward(); weight.grad  # sum over rows of outer(one-hot - softmax, hidden)
        tensor([[ 0.4239, -0.2130],
                [-0.2119,  0.4260],
                [-0.2119, -0.2130]])
    """
    if isinstance(weight, VocabShard):
        _refuse_truncation_on_shards(top_k, top_p, min_p)
    elif (top_k, top_p, min_p) != (None, None, None):
        return processed_logprobs_from_hidden(
            hidden, weight, tokens, bias, temperature, top_k, top_p, min_p, ignore_index, chunk_size=chunk_size
        ).logprobs
    check_head(hidden, weight, bias)
    temperature = check_temperature(temperature)
    check_chunk_size(chunk_size)
    check_chunk_size(vocab_chunk_size, "vocab_chunk_size")
    if isinstance(weight, VocabShard):  # a column-parallel head's rows (docs/scale.md)
        return vocab_parallel_token_logprobs_from_hidden(hidden, weight, bias, tokens, temperature, ignore_index, chunk_size)
    ids, ignored = check_tokens(tokens, hidden.shape[:-1], weight.shape[0], hidden.device, "hidden", ignore_index)
    return token_logprobs_from_hidden_kernel(hidden, weight, bias, ids, ignored, temperature, chunk_size, vocab_chunk_size)
