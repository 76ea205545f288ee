r"""``covariance_mask``: the tokens KL-Cov penalizes and Clip-Cov drops, over the data parallel group.

Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (arXiv
2505.22617), trace the collapse of the policy's entropy to the tokens whose log-prob and advantage
covary most, and treat a small fraction of them apart. verl 0.9.1 ships both of their losses
(``verl/trainer/ppo/core_algos.py``):

* ``kl_cov`` (``compute_policy_loss_kl_cov``): the ``max(1, floor(fraction * n))`` valid tokens of
  largest covariance :math:`(A_t - \bar A)(\log\pi_t - \overline{\log\pi})` take a penalty
  ``ppo_kl_coef * |log pi - log pi_old|`` on top of the unclipped policy-gradient term;
* ``clip_cov`` (``compute_policy_loss_clip_cov``): among the valid tokens that PPO's clipping leaves
  alone and whose covariance lies strictly inside ``(lower, upper)``, ``min(max(1, floor(fraction * n)),
  count)`` chosen at random (``torch.randperm``) lose their gradient (their loss is multiplied by 0;
  they stay in the denominator).

verl computes the means, ``n`` and the choice on each micro-batch of each process: the number of tokens
treated depends on the micro-batch split and on the number of processes (verl's issue 7829).
:func:`covariance_mask` makes the same choice over the concatenated batch of every process of the
data parallel group: its mask on each process is the one a single process computes on the
concatenation (rows of rank 0, then rank 1, ...), with any number of valid tokens on each, none
included. It gathers every process's valid log-probs and advantages (as
:func:`~lightning_kl.high_entropy_mask` gathers entropies), so every process computes the same
means and the same choice; Clip-Cov's permutation is drawn on the group's first process and
broadcast.

Ties: KL-Cov takes exactly ``k`` tokens; where several tokens share the ``k``-th largest covariance,
the ones first in the concatenated order are taken (a stable sort: ``torch.topk`` leaves the choice
among ties unspecified). Clip-Cov's window is strict on both sides, as verl's: a covariance equal
to ``lower`` or ``upper`` is not a candidate.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_kl.ground.checks import check_floating, check_mask, compute_dtype
from lightning_kl.ground.parallel import DataParallelGroup, agree, check_parallel_args, data_parallel_group

__all__ = ["LOSS_MODES", "clip_cov_select", "clipped_by_ppo", "covariance", "covariance_mask", "kl_cov_select"]

#: the selection rules, by the name of verl's loss mode
LOSS_MODES = ("kl_cov", "clip_cov")
#: verl 0.9.1's ``PolicyLossConfig`` defaults: ``clip_cov_ratio`` / ``kl_cov_ratio``, ``(clip_cov_lb, clip_cov_ub)``
#: and ``clip_ratio`` (low and high)
DEFAULT_FRACTION = 0.0002
DEFAULT_WINDOW = (1.0, 5.0)
DEFAULT_CLIP = 0.2


def covariance(logprob: Tensor, advantages: Tensor) -> Tensor:
    r""":math:`(A_t - \bar A)(\log\pi_t - \overline{\log\pi})` over the given (valid) tokens, ``[n]``."""
    return (advantages - advantages.mean()) * (logprob - logprob.mean())


def kl_cov_select(logprob: Tensor, advantages: Tensor, fraction: float) -> Tensor:
    """KL-Cov's choice among ``n`` valid tokens (``[n]`` each): the ``max(1, floor(fraction * n))`` of
    largest :func:`covariance`, ties to the first; nothing when a covariance is NaN. ``[n]`` bool."""
    n = logprob.numel()
    chosen = torch.zeros(n, dtype=torch.bool, device=logprob.device)
    if n == 0:
        return chosen
    cov = covariance(logprob, advantages)
    k = max(1, int(n * fraction))  # verl: max(1, int(len(cov_lst_all) * kl_cov_ratio))
    order = torch.sort(cov, descending=True, stable=True).indices
    chosen[order[:k]] = True
    return chosen & ~cov.isnan().any()


def clipped_by_ppo(logprob: Tensor, old_logprob: Tensor, advantages: Tensor, low: float, high: float) -> Tensor:
    """The tokens PPO's clipping already holds (verl's ``clip_by_origin``): where
    ``-A * clamp(ratio, 1 - low, 1 + high) > -A * ratio``."""
    ratio = torch.exp(logprob - old_logprob)
    return -advantages * torch.clamp(ratio, 1 - low, 1 + high) > -advantages * ratio


def clip_cov_select(
    logprob: Tensor,
    advantages: Tensor,
    clipped: Tensor,
    fraction: float,
    lower: float,
    upper: float,
    permutation: Any,
) -> Tensor:
    """Clip-Cov's choice among ``n`` valid tokens (``[n]`` each; ``clipped``: :func:`clipped_by_ppo`).

    ``permutation(count)`` returns a permutation of ``range(count)`` (``torch.randperm`` in verl); the
    first ``min(max(1, floor(fraction * n)), count)`` candidates in its order are chosen. ``[n]`` bool.
    """
    n = logprob.numel()
    chosen = torch.zeros(n, dtype=torch.bool, device=logprob.device)
    if n == 0:
        return chosen
    cov = covariance(logprob, advantages)
    candidates = ((cov > lower) & (cov < upper) & ~clipped).nonzero()[:, 0]  # the host read of the count
    count = candidates.numel()
    if count == 0:
        return chosen
    k = max(int(fraction * n), 1)  # verl: max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    perm = permutation(count).to(candidates.device)
    chosen[candidates[perm[: min(k, count)]]] = True
    return chosen


def _check_config(
    loss_mode: Any, fraction: Any, window: Any, clip: Any
) -> tuple[str, float, tuple[float, float], tuple[float, float]]:
    if loss_mode not in LOSS_MODES:
        raise ValueError(f"unknown `loss_mode` {loss_mode!r}; valid values: {', '.join(map(repr, LOSS_MODES))}.")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(
            f"`fraction` must be a fraction of the valid tokens in (0, 1] (verl's {loss_mode}_ratio), got {fraction!r}."
        )
    if loss_mode == "kl_cov":
        given = [name for name, v in (("window", window), ("clip", clip)) if v is not None]
        if given:
            raise ValueError(f"loss_mode='kl_cov' reads no {' or '.join(f'`{g}`' for g in given)} (Clip-Cov's settings).")
        return loss_mode, float(fraction), DEFAULT_WINDOW, (DEFAULT_CLIP, DEFAULT_CLIP)
    window = DEFAULT_WINDOW if window is None else window
    ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
        not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) for v in window
    )
    if not ok or not window[0] < window[1]:
        raise ValueError(f"`window` must be (lower, upper), finite, lower < upper (verl's clip_cov_lb/ub), got {window!r}.")
    clip = DEFAULT_CLIP if clip is None else clip
    pair = list(clip) if isinstance(clip, (tuple, list)) else [clip, clip]
    if len(pair) != 2 or not all(
        not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in pair
    ):
        raise ValueError(f"`clip` must be PPO's clip ratio, a number >= 0 or (low, high), got {clip!r}.")
    return loss_mode, float(fraction), (float(window[0]), float(window[1])), (float(pair[0]), float(pair[1]))


def _check_inputs(logprob: Any, advantages: Any, mask: Any, old_logprob: Any, loss_mode: str) -> tuple[Tensor, Optional[Tensor]]:
    check_floating("logprob", logprob)
    check_floating("advantages", advantages)
    if logprob.ndim == 0:
        raise ValueError("`logprob` needs a token dimension (the last one), got a 0-d tensor.")
    shape = logprob.shape
    if advantages.shape not in (shape, shape[:-1], (*shape[:-1], 1)):
        raise ValueError(
            f"`advantages` must be [...], [..., 1] or [..., t] for log-probs {tuple(shape)}, got {tuple(advantages.shape)}."
        )
    if loss_mode == "clip_cov":
        if old_logprob is None:
            raise ValueError("loss_mode='clip_cov' needs `old_logprob` (PPO's clipping decides which tokens are candidates).")
        check_floating("old_logprob", old_logprob)
        if old_logprob.shape != shape:
            raise ValueError(f"`old_logprob` {tuple(old_logprob.shape)} must have the shape of `logprob` {tuple(shape)}.")
    elif old_logprob is not None:
        raise ValueError("loss_mode='kl_cov' reads no `old_logprob` (its selection is the covariance alone).")
    adv = advantages if advantages.shape == shape else advantages.reshape(*shape[:-1], 1).expand(shape)
    return adv, check_mask(mask, logprob, "logprob")


def covariance_mask(
    logprob: Tensor,
    advantages: Tensor,
    mask: Optional[Tensor] = None,
    *,
    loss_mode: str,
    fraction: float = DEFAULT_FRACTION,
    old_logprob: Optional[Tensor] = None,
    window: Optional[tuple[float, float]] = None,
    clip: Optional[Union[float, tuple[float, float]]] = None,
    generator: Optional[torch.Generator] = None,
    process_group: Any = None,
) -> Tensor:
    r"""The tokens KL-Cov penalizes (``loss_mode="kl_cov"``) or Clip-Cov drops (``"clip_cov"``), chosen
    over the data parallel group (module docstring).

    With :math:`n` the valid tokens of every process of the group and
    :math:`c_t = (A_t - \bar A)(\log\pi_t - \overline{\log\pi})` (means over those :math:`n`):

    * ``"kl_cov"``: the :math:`\max(1, \lfloor \mathrm{fraction}\cdot n\rfloor)` tokens of largest
      :math:`c_t` (ties: the first in the concatenated order). In verl's loss they take
      ``ppo_kl_coef * |logprob - old_logprob|`` on top of ``-A * ratio``.
    * ``"clip_cov"``: the candidates are the tokens with :math:`\mathrm{lower} < c_t < \mathrm{upper}`
      that PPO's clipping (``clip``) leaves alone; :math:`\min(\max(1, \lfloor \mathrm{fraction}\cdot n
      \rfloor), \#)` of them, chosen by ``torch.randperm(#, generator=generator)`` drawn on the group's
      first process. In verl's loss their clipped PPO term is multiplied by 0.

    Equal to verl 0.9.1's own choice on one process (its ``kl_cov``/``clip_cov`` policy losses, with
    the same random state for Clip-Cov), except: a NaN covariance (a NaN log-prob or advantage at a
    valid token) selects nothing (verl's ``topk`` would pick NaNs), and the means are over the
    concatenated valid tokens (verl's Clip-Cov divides by ``n + 1e-8``; the same in float32).
    The maths runs in the inputs' promoted dtype, at least float32 (verl's, for float32 inputs).

    Every process of the group must call it: two ``all_gather`` (the sizes, then the values) and, for
    Clip-Cov with candidates, one ``broadcast`` of the permutation. The host reads the sizes and the
    number of valid tokens and candidates (as verl does, with its ``.item()`` and ``.cpu()``).

    Args:
        logprob: ``[..., t]`` the current policy's log-probs of the sampled tokens (used detached).
        advantages: ``[..., t]``, ``[...]`` or ``[..., 1]``.
        mask: optional ``[..., t]``, True on valid tokens (bool, or 0/1 numbers).
        loss_mode: ``"kl_cov"`` or ``"clip_cov"`` (verl's ``policy_loss.loss_mode``).
        fraction: in ``(0, 1]``: verl's ``kl_cov_ratio`` / ``clip_cov_ratio`` (default 0.0002).
        old_logprob: ``"clip_cov"`` only (required): ``[..., t]`` the old policy's log-probs.
        window: ``"clip_cov"`` only: ``(lower, upper)``, verl's ``(clip_cov_lb, clip_cov_ub)``; default
            ``(1.0, 5.0)``.
        clip: ``"clip_cov"`` only: PPO's clip ratio, a number or ``(low, high)`` (verl's ``clip_ratio``,
            ``clip_ratio_low`` / ``_high``); default 0.2.
        generator: ``"clip_cov"`` only: the ``torch.Generator`` of the permutation (default: torch's
            global one, as verl), read on the group's first process.
        process_group: the data parallel ``ProcessGroup``; default: found by itself
            (:func:`lightning_kl.ground.parallel.data_parallel_group`).

    Returns:
        A bool tensor of ``logprob``'s shape, False at padding.

    Raises:
        ValueError: a bad setting (the valid ones named); bad inputs (shapes named). Across processes,
            an input refused on one process is raised on every process (naming that rank), none left
            waiting.

    Example:
        >>> lp = torch.tensor([[-0.5, -2.0, -1.0, -3.0]])
        >>> A = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
        >>> covariance_mask(lp, A, loss_mode="kl_cov", fraction=0.5)   # c = 1.125, -0.375, -0.625, 1.375
        tensor([[ True, False, False,  True]])
    """
    loss_mode, fraction, (lower, upper), (low, high) = _check_config(loss_mode, fraction, window, clip)
    check_parallel_args(process_group, None)
    dp = data_parallel_group(process_group)
    try:
        adv, mask = _check_inputs(logprob, advantages, mask, old_logprob, loss_mode)
    except (TypeError, ValueError) as err:
        if dp.size == 1:
            raise
        _gathered(None, dp, problem=str(err))  # the others are about to gather: every process raises there
        raise  # pragma: no cover (_gathered raised)
    tensors = [logprob, advantages] + ([old_logprob] if old_logprob is not None else [])
    dtype = compute_dtype(*tensors)
    lp = logprob.detach().to(dtype).reshape(-1)
    a = adv.detach().to(dtype).reshape(-1)
    valid = (torch.ones_like(logprob, dtype=torch.bool) if mask is None else mask).reshape(-1)
    rows = [lp, a, valid.to(dtype)]
    if loss_mode == "clip_cov":
        assert old_logprob is not None
        rows.append(clipped_by_ppo(lp, old_logprob.detach().to(dtype).reshape(-1), a, low, high).to(dtype))
    every, sizes = _gathered(torch.stack(rows), dp)
    flags = every[2] != 0
    if loss_mode == "kl_cov":
        chosen = kl_cov_select(every[0][flags], every[1][flags], fraction)
    else:
        chosen = clip_cov_select(
            every[0][flags], every[1][flags], every[3][flags] != 0, fraction, lower, upper,
            lambda count: _shared_permutation(count, generator, dp, every.device),
        )  # fmt: skip
    before = 0
    if dp.size > 1:  # this process's share of the concatenated valid tokens starts after the earlier ones'
        rank = dist.get_rank(dp.group)
        before = int(flags[: sum(sizes[:rank])].sum().item()) if rank else 0
    out = torch.zeros_like(valid)
    out[valid] = chosen[before : before + int(valid.sum().item())]
    return out.reshape(logprob.shape)


def _shared_permutation(count: int, generator: Optional[torch.Generator], dp: DataParallelGroup, device: torch.device) -> Tensor:
    """``torch.randperm(count, generator=generator)`` on the group's first process, the same on every one."""
    where = generator.device if generator is not None else torch.device("cpu")
    if dp.size == 1:
        return torch.randperm(count, generator=generator, device=where)
    group = dp.group if dp.group is not None else dist.group.WORLD
    if dist.get_rank(group) == 0:
        perm = torch.randperm(count, generator=generator, device=where).to(device)
    else:
        perm = torch.empty(count, dtype=torch.int64, device=device)
    dist.broadcast(perm, src=dist.get_global_rank(group, 0), group=group)
    return perm


def _gathered(rows: Optional[Tensor], dp: DataParallelGroup, problem: Optional[str] = None) -> tuple[Tensor, list[int]]:
    """Every process's ``rows`` (``[c, n_r]``), concatenated along the last dimension, each padded to the
    longest (the padding is 0: an invalid flag), and the processes' sizes ``n_r``.

    The sizes travel with a flag per process: a process whose inputs were refused (``problem``) makes
    every process raise its error (:func:`~lightning_kl.ground.parallel.agree`).
    """
    if dp.size == 1:
        assert rows is not None
        return rows, [rows.shape[1]]
    if rows is not None:
        device = rows.device
    elif dist.get_backend(dp.group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mine = torch.tensor([0 if rows is None else rows.shape[1], problem is not None], dtype=torch.int64, device=device)
    sizes = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(dp.size)]
    dist.all_gather(sizes, mine, group=dp.group)
    read = [s.tolist() for s in sizes]  # the host read: the lengths to pad to, and the refusals
    if any(flag for _, flag in read):
        agree(problem, dp.group)
    assert rows is not None
    longest = max(n for n, _ in read)
    padded = torch.nn.functional.pad(rows, (0, longest - rows.shape[1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(dp.size)]
    dist.all_gather(parts, padded, group=dp.group)
    every = torch.cat(parts, dim=1)
    # the sizes in the padded layout: each process's block is `longest` long
    return every, [longest] * dp.size
