r"""``high_entropy_mask``: the tokens of highest entropy ("Beyond the 80/20 rule"), over the data parallel group.

Wang et al. (2025) find that the policy gradient of RLVR works almost entirely through the ~20 % of
tokens of highest entropy (the "forking" tokens), and train on those alone. TRL ships it as
``GRPOConfig(top_entropy_quantile=rho)``: the threshold is the ``1 - rho`` quantile (``torch.quantile``,
linear interpolation) of the valid tokens' entropies, gathered from every process, and a token is
kept when its entropy is at least the threshold.

:func:`high_entropy_mask` is that rule, exact over the data parallel group: the mask on each process
is the one a single process would compute on the concatenated batch of every process, whatever the
number of valid tokens each holds (none included). The quantile is computed on the device from a
sort and a count (:func:`masked_quantile`), the same operations as ``torch.quantile``'s, so a
single process needs no host read; across processes the one host read is of the other processes'
tensor sizes (the lengths to pad to), before the gather.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_kl.ground.checks import check_floating, check_mask
from lightning_kl.ground.parallel import DataParallelGroup, agree, check_parallel_args, data_parallel_group

__all__ = ["check_top", "high_entropy_mask", "masked_quantile"]


def check_top(top: object) -> float:
    """Validate the fraction of tokens kept: a number in ``(0, 1]``."""
    if isinstance(top, bool) or not isinstance(top, (int, float)) or not 0 < top <= 1:
        hint = ""
        if isinstance(top, (int, float)) and top == 0:
            hint = (
                " (TRL's `top_entropy_quantile=0.0` keeps the tokens at the largest entropy: any `top` below "
                "1 / (n - 1) for n valid tokens does the same, e.g. top=1e-9)"
            )
        raise ValueError(f"`top` must be a fraction of the valid tokens in (0, 1], got {top!r}{hint}.")
    return float(top)


def masked_quantile(values: Tensor, valid: Tensor, q: float) -> Tensor:
    r"""The ``q`` quantile of ``values[valid]``, as ``torch.quantile`` (linear), without selecting them.

    The invalid positions are set to ``+inf`` and sorted last; the count of valid values stays on
    the device, so nothing is read by the host. The arithmetic is ``torch.quantile``'s in the values'
    dtype (rank ``q (n - 1)``, its floor and ceiling, ``lerp`` between them), so the result is the
    same number (``torch.quantile`` itself refuses more than :math:`2^{24}` values; here the rank
    is then rounded in float32, at most one position). A NaN among the valid values gives NaN; no
    valid value gives NaN.

    Args:
        values: ``[n]`` floating values.
        valid: ``[n]`` bool.
        q: the quantile, in ``[0, 1]``.

    Example:
        >>> masked_quantile(torch.tensor([4.0, 1.0, 9.0, 2.0]), torch.tensor([True, True, False, True]), 0.5)
        tensor(2.)
    """
    inf = torch.full((), math.inf, dtype=values.dtype, device=values.device)
    ordered = torch.where(valid, values, inf).sort().values
    n = valid.sum()
    ranks = torch.full((), q, dtype=values.dtype, device=values.device) * (n - 1)
    ranks = ranks.clamp(min=0)  # n = 0: any index, the result is replaced below
    below = ranks.to(torch.int64)
    weight = ranks - below
    above = ranks.ceil().to(torch.int64)
    out = ordered[below].lerp(ordered[above], weight)
    bad = (n == 0) | (valid & values.isnan()).any()
    return torch.where(bad, torch.full((), math.nan, dtype=values.dtype, device=values.device), out)


def high_entropy_mask(
    entropy: Tensor, mask: Optional[Tensor] = None, *, top: float = 0.2, process_group: Any = None
) -> Tensor:
    r"""The valid tokens whose entropy is among the ``top`` fraction of highest, over the data parallel group.

    .. math::
        \tau = \operatorname{quantile}_{1 - \mathrm{top}}\big(\{H_t : m_t\}_{\text{all processes}}\big),
        \qquad \mathrm{keep}_t = m_t \wedge (H_t \ge \tau)

    with ``torch.quantile``'s linear interpolation: TRL's ``get_high_entropy_mask`` (``GRPOConfig
    (top_entropy_quantile=top)``), exactly, and a process's mask is the one a single process
    computes on the concatenated batch of every process of the group. Padding never counts (nor does
    what it holds: NaN, inf). Ties at the threshold are all kept, so slightly more than ``top`` of the
    tokens may be. ``top=1`` keeps every valid token (the threshold is their least entropy). The
    threshold and the comparison are in the entropy's dtype, at least float32 (TRL computes the
    threshold in float32 and compares in the entropy's dtype: the same for float32 entropies); across
    processes in the widest of theirs (float64 entropies on one process: float64 on every one).

    No valid token anywhere: nothing is kept. A NaN entropy at a valid position of any process: the
    threshold is NaN and nothing is kept, on every process (``torch.quantile`` gives NaN there too).

    The group is ``process_group`` when given, else the data parallel group found by itself
    (:func:`lightning_kl.ground.parallel.data_parallel_group`: under Lightning's DDP the world, under
    ``ModelParallelStrategy`` the ``"data_parallel"`` mesh dimension). Every process of the group
    must call it (two collectives: the sizes, then the padded entropies). The host reads the
    processes' sizes (``entropy.numel()``, the lengths to pad to, with a flag per process for refused
    inputs), which on a GPU waits for the work queued so far; a single process reads nothing.

    Args:
        entropy: ``[...]`` per-token entropies (e.g. :func:`~lightning_kl.token_entropy`'s), any shape;
            used detached.
        mask: optional ``[...]`` the same shape, True on valid tokens (bool, or 0/1 numbers).
        top: the fraction of the valid tokens kept, in ``(0, 1]``; 0.2 is the paper's 20 %. TRL's
            ``top_entropy_quantile``.
        process_group: the data parallel ``ProcessGroup``; default: found by itself.

    Returns:
        A bool tensor of ``entropy``'s shape.

    Raises:
        ValueError: for ``top`` outside ``(0, 1]`` (the value named), or a mask of another shape
            (both shapes named). Across processes, an input refused on one process is raised on
            every process of the group (a ``ValueError`` naming that rank), none left waiting.

    Example:
        >>> H = torch.tensor([[0.1, 2.0, 0.5, 9.0], [1.0, 0.3, 0.0, 0.0]])
        >>> m = torch.tensor([[True, True, True, False], [True, True, False, False]])
        >>> high_entropy_mask(H, m, top=0.4)  # valid: 0.1 0.3 0.5 1.0 2.0; the 0.6 quantile: 0.5 + 0.4 (1.0 - 0.5) = 0.7
        tensor([[False,  True, False, False],
                [ True, False, False, False]])
    """
    top = check_top(top)
    check_parallel_args(process_group, None)
    dp = data_parallel_group(process_group)
    try:
        check_floating("entropy", entropy)
        mask = check_mask(mask, entropy, "entropy")
    except (TypeError, ValueError) as err:
        if dp.size == 1:
            raise
        # the other processes are about to gather: they learn of it there, and every process raises
        _gathered(None, None, dp, problem=str(err))
        raise  # pragma: no cover (_gathered raised)
    dtype = torch.promote_types(entropy.dtype, torch.float32)
    local = entropy.detach().to(dtype)
    valid = torch.ones_like(local, dtype=torch.bool) if mask is None else mask
    values, flags = _gathered(local.reshape(-1), valid.reshape(-1), dp)
    if values.numel() == 0:  # no token on any process (sizes are known to the host)
        return torch.zeros_like(valid)
    threshold = masked_quantile(values, flags, 1.0 - top)
    return valid & (local.to(values.dtype) >= threshold)  # in the group's dtype (float64 if any process's is)


def _gathered(
    values: Optional[Tensor], valid: Optional[Tensor], dp: DataParallelGroup, problem: Optional[str] = None
) -> tuple[Tensor, Tensor]:
    """Every process's ``values`` and ``valid`` flags, concatenated (padded positions invalid).

    The sizes travel with a flag per process: a process whose inputs were refused (``problem``) makes
    every process raise its error (:func:`~lightning_kl.ground.parallel.agree`), at no extra collective
    when none was; and with each process's dtype: the values are gathered in the widest (float64 when
    any process's entropies are float64, as ``torch.cat`` of them would promote), the same on every process.
    """
    if values is None or valid is None:
        if dp.size == 1:  # never: a single process raises its own error before this
            raise RuntimeError("high_entropy_mask: no values to gather")
    elif dp.size == 1:
        return values, valid
    if values is not None:
        device = values.device
    elif dist.get_backend(dp.group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    width = 0 if values is None else values.element_size()
    mine = torch.tensor([0 if values is None else values.numel(), problem is not None, width], dtype=torch.int64, device=device)
    sizes = [torch.zeros(3, dtype=torch.int64, device=device) for _ in range(dp.size)]
    dist.all_gather(sizes, mine, group=dp.group)
    read = [s.tolist() for s in sizes]  # the host read: the lengths to pad to, the refusals, the dtypes
    if any(flag for _, flag, _ in read):
        agree(problem, dp.group)
    if values is None or valid is None:  # never: agree raised for this process's problem
        raise RuntimeError("high_entropy_mask: no values to gather")
    if max(w for _, _, w in read) > values.element_size():
        values = values.to(torch.float64)  # another process's entropies are float64: gather in float64
    longest = max(n for n, _, _ in read)
    pad = longest - values.numel()
    # values and flags in one buffer of the values' dtype (a flag is 0 or 1, exact in any float)
    both = torch.stack([values, valid.to(values.dtype)])
    both = torch.nn.functional.pad(both, (0, pad))
    parts = [torch.empty_like(both) for _ in range(dp.size)]
    dist.all_gather(parts, both.contiguous(), group=dp.group)
    every = torch.cat(parts, dim=1)
    return every[0], every[1] != 0
