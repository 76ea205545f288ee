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

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_kl.ground.checks import check_floating, check_temperature
from lightning_kl.kernels.logprobs import token_logprobs_from_hidden_kernel, token_logprobs_kernel

__all__ = ["check_head", "check_tokens", "token_logprobs", "token_logprobs_from_hidden"]


def _check_size(name: str, value: Any) -> Optional[int]:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"`{name}` must be a positive integer or None, got {value!r}.")
    return value


def check_tokens(
    tokens: Any, lead: torch.Size, vocab: int, device: torch.device, like: str, ignore_index: Any
) -> tuple[Tensor, Optional[Tensor]]:
    """Check ``tokens`` (integer ids of shape ``lead``) against a vocabulary of ``vocab`` entries.

    Returns the flat ``int64`` ids (ignored ones replaced by 0, so that they index safely) and the
    flat bool mask of ignored tokens (None without ``ignore_index``). Costs one min/max over the ids
    (a device sync on GPU).

    Raises:
        TypeError: for ``tokens`` that are not an integer tensor, or a bad ``ignore_index``.
        ValueError: for a shape or device that does not match ``like`` (both named), or an id
            outside ``[0, vocab)`` that is not ``ignore_index`` (the id and ``V`` named).
    """
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"`ignore_index` must be an int or None, got {ignore_index!r}.")
    if not isinstance(tokens, Tensor):
        raise TypeError(f"`tokens` must be a torch.Tensor of token ids, got {type(tokens).__name__}.")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise TypeError(f"`tokens` must be an integer tensor of token ids, got dtype {tokens.dtype}.")
    if tokens.shape != lead:
        raise ValueError(
            f"`tokens` must have the shape of `{like}` without its last dimension: got tokens "
            f"{tuple(tokens.shape)} and {like} {tuple(lead) + ('...',)} (expected tokens {tuple(lead)})."
        )
    if tokens.device != device:
        raise ValueError(f"`tokens` is on {tokens.device} but `{like}` is on {device}.")
    ids = tokens.reshape(-1).long()
    ignored = None
    if ignore_index is not None:
        ignored = ids == ignore_index
        ids = ids.masked_fill(ignored, 0)
    if ids.numel() > 0:
        lo, hi = torch.aminmax(ids)
        if lo.item() < 0 or hi.item() >= vocab:
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            hint = f" or `ignore_index` ({ignore_index})" if ignore_index is not None else " (set `ignore_index` for label padding such as -100)"
            raise ValueError(f"token id {bad} is out of range for a vocabulary of V={vocab}: ids must be in [0, {vocab}){hint}.")
    return ids, ignored


def check_head(hidden: Any, weight: Any, bias: Any, prefix: str = "") -> None:
    """Check ``hidden [..., d]``, ``weight [V, d]`` and ``bias [V]`` (or None): one dtype, one device.

    ``prefix`` names a second head in messages (``"ref_"`` gives ``ref_hidden``...).

    Raises:
        TypeError: for inputs that are not floating point tensors.
        ValueError: for shapes, dtypes or devices that do not match (all named).
    """
    hn, wn, bn = f"{prefix}hidden", f"{prefix}weight", f"{prefix}bias"
    check_floating(hn, hidden)
    check_floating(wn, weight)
    if hidden.ndim == 0:
        raise ValueError(f"`{hn}` must be `[..., d]` with a hidden dimension, got a scalar.")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"`{wn}` must be the LM head `[V, d]` with d = {hn}.shape[-1]: got {wn} {tuple(weight.shape)} "
            f"and {hn} {tuple(hidden.shape)}."
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"`{hn}` and `{wn}` must have one dtype: got {hidden.dtype} and {weight.dtype}.")
    if weight.device != hidden.device:
        raise ValueError(f"`{hn}` is on {hidden.device} but `{wn}` is on {weight.device}.")
    if bias is not None:
        check_floating(bn, bias)
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"`{bn}` must be `[V]` = ({weight.shape[0]},) for {wn} {tuple(weight.shape)}, got {tuple(bias.shape)}.")
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise ValueError(
                f"`{bn}` must have the dtype and device of `{wn}`: got {bias.dtype} on {bias.device} and "
                f"{weight.dtype} on {weight.device}."
            )


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    *,
    chunk_size: Optional[int] = None,
) -> Tensor:
    r"""Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``.

    .. math::
        \ell_{\dots} = \frac{z_{\dots, y}}{T} - \log \sum_{v} e^{z_{\dots, v} / T}, \qquad y = \mathrm{tokens}_{\dots}

    Exact and chunked over rows: the forward keeps only the per-token log-sum-exp (float32); the
    backward recomputes the softmax chunk by chunk and writes the gradient once, in the logits'
    dtype. No ``[..., V]`` float32 copy of the logits is ever made.

    Args:
        logits: ``[..., V]`` floating point (float16, bfloat16, float32, float64); any layout
            (``logits[:, :-1]`` is read in place, never copied whole).
        tokens: ``[...]`` integer ids in ``[0, V)``.
        temperature: :math:`T > 0`, the sampling temperature.
        ignore_index: an id whose positions get log-prob 0 and exactly zero gradient (Hugging
            Face's label padding is ``-100``), even where the logits hold NaN.
        chunk_size: rows per chunk (default: about :math:`2^{19}` elements per chunk on CPU,
            :math:`2^{25}` on GPU).

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
        >>> lp.sum().backward(); logits.grad  # one-hot minus softmax; zero on the ignored token
        tensor([[-0.5000,  0.5000],
                [ 0.0000,  0.0000]])
    """
    check_floating("logits", logits)
    if logits.ndim == 0:
        raise ValueError("`logits` must be `[..., V]` with a vocabulary dimension, got a scalar.")
    temperature = check_temperature(temperature)
    _check_size("chunk_size", chunk_size)
    ids, ignored = check_tokens(tokens, logits.shape[:-1], logits.shape[-1], logits.device, "logits", ignore_index)
    return token_logprobs_kernel(logits, ids, ignored, temperature, chunk_size)


def token_logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    *,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
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
        weight: ``[V, d]`` the LM head (``lm_head.weight``), the dtype and device of ``hidden``.
        tokens: ``[...]`` integer ids in ``[0, V)``.
        bias: optional ``[V]`` head bias.
        temperature: :math:`T > 0`, the sampling temperature.
        ignore_index: an id whose positions get log-prob 0 and exactly zero gradient (``-100``).
        chunk_size: rows per block (default 4096).
        vocab_chunk_size: vocabulary entries per tile (default: about :math:`2^{22}` logits per tile on
            CPU, :math:`2^{26}` on GPU).

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
    check_head(hidden, weight, bias)
    temperature = check_temperature(temperature)
    _check_size("chunk_size", chunk_size)
    _check_size("vocab_chunk_size", vocab_chunk_size)
    ids, ignored = check_tokens(tokens, hidden.shape[:-1], weight.shape[0], hidden.device, "hidden", ignore_index)
    return token_logprobs_from_hidden_kernel(hidden, weight, bias, ids, ignored, temperature, chunk_size, vocab_chunk_size)
