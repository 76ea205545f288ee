r"""The KL of whole responses (``level="sequence"``): the exact gradient, on-policy and off-policy.

Notation: ``b`` batch, ``t`` response length; a response :math:`y` runs along the last dimension and
its valid tokens are where ``mask`` is True (padding anywhere: left, right, holes). For a valid token
:math:`t`, :math:`\pi_t = \pi(y_t \mid y_{<t})`, :math:`d_t = \log\pi_t - \log\pi_{\mathrm{ref},t}`,
and sums over :math:`s` run over valid tokens only.

**What "exact" means at each level.** RLHF regularizes the KL between whole responses,

.. math::
    \mathrm{KL}(\pi \,\|\, \pi_{\mathrm{ref}}) = E_{y\sim\pi}\Big[\sum_t d_t\Big], \qquad
    \nabla\mathrm{KL} = E_{y\sim\pi}\Big[\sum_t \nabla\log\pi_t \sum_{s \ge t} d_s\Big]

(the score function of :math:`\pi(y) = \prod_t \pi_t`; the term :math:`E[\sum_t \nabla d_t] =
E[\sum_t \nabla\log\pi_t]` is 0, and :math:`E[\nabla\log\pi_t \, d_s] = 0` for :math:`s < t`).
A per-token estimator whose expected gradient is exact at the token level (``k2``, every ``+``
name) gives :math:`E[\sum_t d_t \nabla\log\pi_t]`: the gradient of each token's KL *given its
prefix*, with the prefix distribution held fixed. It misses the *KL-to-go* term
:math:`\nabla\log\pi_t \sum_{s > t} d_s`: how token :math:`t` changes the distribution of every token
after it. In ``examples/estimator_study.py`` the missing term is of the order of the whole gradient
(a relative error of 0.48 for ``k3+``).

**On-policy** (``old_logprob`` not given), ``level="sequence"`` returns, per valid token,

.. math::
    \mathrm{out}_t = k_t + (\log\pi_t - \operatorname{sg}\log\pi_t)\,\operatorname{sg}(F_t), \qquad
    F_t = \sum_{s > t} d_s

(:math:`\operatorname{sg}` = detach): the value is :math:`k_t`, the token level's (the added term
is an exact 0), and the gradient gains :math:`F_t\nabla\log\pi_t`, the ``k1`` reward-to-go of the
tokens after :math:`t`. Given :math:`y_{\le t}`, :math:`E[\sum_{s>t} d_s]` is the KL-to-go, so
:math:`E[F_t\nabla\log\pi_t] = E[\nabla\log\pi_t \sum_{s>t} d_s]`: the expected gradient of
:math:`\sum_t \mathrm{out}_t` is :math:`\nabla\mathrm{KL}` exactly, for every name whose token-level
gradient is exact (its local term :math:`E[g_t \mid y_{<t}] = \nabla\mathrm{KL}_t(y_{<t})`, and
:math:`\mathrm{KL} = E[\sum_t \mathrm{KL}_t(y_{<t})]`): ``k2`` and every ``+`` name; also ``k1`` and
``k3`` with ``old_logprob=logprob.detach()``, as at the token level.

**Off-policy** (``old_logprob`` from the sampler :math:`\mu`), with the per-decision weights

.. math::
    \rho_{1:t} = \prod_{u \le t} \frac{\pi_u}{\mu_u} = \exp\Big(\sum_{u \le t} (\log\pi_u - \log\mu_u)\Big)

(a cumulative sum of the masked log-ratios), token :math:`t` returns

.. math::
    \mathrm{out}_t = W_t\,k_t + (\log\pi_t - \operatorname{sg}\log\pi_t)\,\operatorname{sg}(\tilde F_t),
    \qquad \tilde F_t = \sum_{s > t} \rho_{1:s}\, d_s

where :math:`W_t` has the value :math:`\rho_{1:t}` and the gradient of the token-level weight
:math:`w_t = \pi_t / \mu_t` only (:math:`\nabla W_t = W_t \nabla\log\pi_t` for ``k1``, ``k3``,
``abs``, ``low_var_kl``; detached for ``k2`` and every ``+`` name: the rule of
:func:`lightning_kl.functional.importance_weight`). For any function :math:`h` of a prefix,
:math:`E_\mu[\rho_{1:t} h(y_{\le t})] = E_\pi[h(y_{\le t})]`, hence:

* value: :math:`E_\mu[\sum_t \rho_{1:t} k_t] = \sum_t E_\pi[k_t] = \mathrm{KL}` for the unbiased
  values (``k1``, ``k3``, ``k1+``, ``k3+``);
* local term: :math:`E_\mu[\rho_{1:t}\, g_t] = E_\pi[g_t]`, the token level's exact local gradient
  (:math:`g_t = d_t\nabla\log\pi_t` for ``k2`` and the ``+`` names; :math:`(k_t + k_t')\nabla\log\pi_t`
  for a differentiable weight, :math:`= d_t\nabla\log\pi_t` for ``k3``, :math:`(d_t + 1)\nabla\log\pi_t`
  for ``k1``, whose extra term has expectation 0 given the prefix);
* KL-to-go: :math:`E_\mu[\nabla\log\pi_t \sum_{s>t} \rho_{1:s} d_s] = \sum_{s>t} E_\pi[\nabla\log\pi_t\, d_s]`.

So off-policy, the expected gradient is :math:`\nabla\mathrm{KL}` exactly for ``k1``, ``k3``, ``k2``
and every ``+`` name, and the expected value is the KL for ``k1``, ``k3``, ``k1+``, ``k3+``; in
all, every token :math:`s` enters with the weight of its prefix and itself, :math:`\rho_{1:s}`, in the
value and in each gradient term :math:`d_s\nabla\log\pi_t` (:math:`t \le s`) that it pays for.

**A less noisy KL-to-go** (``kl_to_go="k3"``): the sum of the later tokens' ``k3`` values,
:math:`k_3(d_s) = d_s + (e^{-d_s} - 1)`, in place of :math:`d_s`. The added term has expectation 0
given the prefix, on-policy (:math:`E_\pi[e^{-d_s} - 1 \mid y_{<s}] = \sum \pi_{\mathrm{ref}} - 1 = 0`)
and off-policy (:math:`E_\mu[\rho_{1:s}(e^{-d_s} - 1) \mid y_{<s}] = \rho_{1:s-1}(\sum \pi_{\mathrm{ref}}
- 1) = 0`), so the expected gradient stays exact: it is a control variate, which lowers the
gradient's noise most where the per-token KL is small (``examples/estimator_study.py``). Exact as long
as the reference puts no mass where the policy puts none and :math:`|d_s| \le 20` (``k3``'s clamp).
With ``max_weight``, the added term averages to 0 only on the prefixes whose weight is not cut (one
more term of the dropped-mass bias below).

**Truncation** (``max_weight`` :math:`= c \ge 1`): the cumulative weight is cut,
:math:`\bar\rho_{1:s} = \min(\rho_{1:s}, c)` (in log space, so nothing overflows), in the value and in
both gradient terms, and a differentiable :math:`W_t` keeps its gradient (as at the token level).
Every term above is an expectation over prefixes :math:`y_{\le s}` of length :math:`s`; truncation
replaces the policy's prefix probability :math:`\pi(y_{\le s})` there by
:math:`m_s(y_{\le s}) = \min(\pi(y_{\le s}),\ c\,\mu(y_{\le s}))`:

.. math::
    E_\mu[\text{value}] = \sum_s \sum_{y_{\le s}} m_s\, k_s, \qquad
    E_\mu[\text{gradient}] = \sum_s \sum_{y_{\le s}} m_s\, \Big(g_s + d_s \sum_{t < s} \nabla\log\pi_t\Big).

The bias is the dropped prefix mass :math:`\sum_{y_{\le s}} (\pi(y_{\le s}) - c\,\mu(y_{\le s}))_+`
of each length, times the size of the terms it carries, and vanishes with it. The price: a
cumulative weight is a product of per-token ratios, so without truncation its variance grows
exponentially with the response length (and the weights of long responses are mostly near 0 with
rare huge ones). With :math:`c \ge \max_s \rho_{1:s}` on the batch nothing changes, and
on-policy (:math:`\rho = 1`) truncation never bites.

**Aggregation.** :math:`\mathrm{out}_t` is weighted like token :math:`t` by
:func:`~lightning_kl.aggregate`. A mode is exact when it is a positive constant times the sum of
each response's :math:`\sum_t \mathrm{out}_t`: ``token-sum`` (the sum of the responses' KL),
``seq-mean-token-sum`` (their mean; the count of non-empty responses is fixed unless some responses
are empty), ``seq-mean-token-sum-norm`` (a constant divisor, Dr. GRPO), and ``token-mean`` when
the number of valid tokens per batch does not depend on the samples (fixed-length responses, or a
fixed ``num_tokens``); with variable lengths ``token-mean`` divides by a random count (for a batch of
one response it is the length-normalized objective below; a ratio estimate whose bias shrinks as
the batch grows).
``seq-mean-token-mean`` optimizes another objective, the length-normalized
:math:`J = E[\frac{1}{n(y)}\sum_t d_t]` (:math:`n(y)` the response's valid-token count). Its exact
gradient, :math:`\nabla J = E[\sum_t \nabla\log\pi_t\,(1 + \sum_s d_s) / n(y)]` with the sum over
*every* token :math:`s` of the response, past ones included (:math:`1/n(y)` depends on the whole
response), is not a KL-to-go and is not offered: :func:`check_sequence_agg` rejects the mode.

**``full``** (the exact per-position KL from both models' logits, on-policy) gives the local term
exactly: :math:`\mathrm{KL}_t(y_{<t})` and its gradient with the prefix fixed, no sampling noise. The
KL-to-go needs the score :math:`\nabla\log\pi_t` of the *sampled* token, which the logits alone do
not give: pass its log-prob as ``sampled_logprob`` (differentiable, at the sampling temperature).
The future term then uses the exact KLs of the later positions,

.. math::
    \mathrm{out}_t = \mathrm{KL}_t + (\log\pi_t - \operatorname{sg}\log\pi_t)\,
    \operatorname{sg}\Big(\sum_{s > t} \mathrm{KL}_s\Big),

exact because :math:`\mathrm{KL}_s(y_{<s}) = E[d_s \mid y_{<s}]` and :math:`\nabla\log\pi_t` is a
function of :math:`y_{\le t}`, :math:`t < s` (tower property). Replacing each :math:`d_s` by its
conditional expectation removes the sampling noise of the later tokens' own draws, so the gradient is
less noisy than a sampled estimator's (``examples/estimator_study.py``). Off-policy ``full`` stays
rejected, as at the token level.

**Not here.** The gradient w.r.t. ``ref_logprob`` stays the token level's (the reference is frozen
in RL fine-tuning).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_kl.estimators import base_value
from lightning_kl.inputs import check_sampled_logprob  # noqa: F401  (with every per-call check; named here for 0.2's callers)

__all__ = [
    "LEVELS",
    "Level",
    "SEQUENCE_AGG_MODES",
    "check_level",
    "check_sampled_logprob",
    "check_sequence_agg",
    "exclusive_cumsum",
    "full_with_kl_to_go",
    "future_sum",
    "KL_TO_GO",
    "check_kl_to_go",
    "weighted_kl_to_go",
    "prefix_log_weights",
    "with_kl_to_go",
]

#: The levels of :func:`lightning_kl.kl_penalty` and :class:`lightning_kl.KLPenaltyLoss`.
LEVELS: tuple[str, ...] = ("token", "sequence")

#: The type of a ``level`` argument: one of :data:`LEVELS`, listed by LightningCLI's ``--help``; any other
#: string is refused when the object is built, by a message that lists the valid levels.
Level = Union[Literal[LEVELS], str]  # type: ignore[valid-type]

#: The aggregation modes that keep ``level="sequence"`` exact (see the module's docstring).
SEQUENCE_AGG_MODES: tuple[str, ...] = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")


#: The estimators of the KL-to-go term at the sequence level (``kl_to_go=``): ``"k1"``, the sum of the
#: later log-ratios :math:`d_s`; ``"k3"``, the sum of their ``k3`` values, the same expectation with
#: less noise (see the module's docstring).
KL_TO_GO: tuple[str, ...] = ("k1", "k3")


def check_kl_to_go(kl_to_go: object, level: str, full: bool) -> str:
    """Validate ``kl_to_go``; it only means something for a sampled estimator at the sequence level.

    Raises:
        ValueError: for an unknown value (listing the valid ones), or ``"k3"`` at the token level or with
            ``full`` (whose KL-to-go is the exact KL of the later positions).
    """
    if not isinstance(kl_to_go, str) or kl_to_go not in KL_TO_GO:
        valid = ", ".join(repr(v) for v in KL_TO_GO)
        raise ValueError(f"Unknown `kl_to_go` {kl_to_go!r}. Valid values: {valid} (the estimator of the KL-to-go term).")
    if kl_to_go != "k1" and (level != "sequence" or full):
        where = "level='token' has no KL-to-go term" if level != "sequence" else (
            "'full' uses the exact KL of the later positions"
        )
        raise ValueError(f"`kl_to_go={kl_to_go!r}` does not apply here: {where}.")
    return kl_to_go


def check_level(level: object) -> str:
    """Validate a level; raise ``ValueError`` naming the bad value and the valid ones.

    Example:
        >>> check_level("sequence")
        'sequence'
    """
    if not isinstance(level, str) or level not in LEVELS:
        valid = ", ".join(repr(v) for v in LEVELS)
        raise ValueError(
            f"Unknown KL level {level!r}. Valid levels: {valid} ('token': each token's KL given its prefix; "
            "'sequence': the KL of whole responses, with the KL-to-go gradient term)."
        )
    return level


def check_sequence_agg(mode: str) -> str:
    """Reject ``seq-mean-token-mean`` at the sequence level (a length-normalized objective, not the KL)."""
    if mode not in SEQUENCE_AGG_MODES:
        valid = ", ".join(repr(m) for m in SEQUENCE_AGG_MODES)
        raise ValueError(
            f"Aggregation mode {mode!r} does not fit level='sequence': the mean over each response's own "
            "tokens optimizes E[(1/n(y)) sum_t d_t], a length-normalized KL, whose exact gradient gives every "
            "token the coefficient (1 + sum_s d_s) / n(y) over the whole response, past tokens included: not "
            f"the KL of responses. Modes that keep level='sequence' exact: {valid} ('token-mean' when the "
            "number of valid tokens per batch is fixed); see lightning_kl.sequence."
        )
    return mode


def prefix_log_weights(log_w: Tensor, mask: Optional[Tensor]) -> Tensor:
    r"""Per-decision log-weights: the value :math:`\log\rho_{1:t} = \sum_{u \le t} \log w_u`, the
    gradient of :math:`\log w_t` alone.

    Feeding this to :func:`lightning_kl.functional.importance_weight` gives the weight :math:`W_t`
    of the module's docstring: its value is the product of the ratios of the prefix and the token
    (truncated there, if asked), and a differentiable weight keeps the token-level gradient
    :math:`W_t\nabla\log w_t` (the prefix's share of the gradient is the KL-to-go term, added once
    by :func:`with_kl_to_go`).

    Args:
        log_w: ``[..., t]`` the log-ratios :math:`\log\pi_t - \log\mu_t`.
        mask: optional ``[..., t]`` bool mask; masked positions add nothing (whatever they hold).

    Example:
        >>> prefix_log_weights(torch.tensor([0.5, 9.0, -1.0]), torch.tensor([True, False, True]))
        tensor([ 0.5000,  0.5000, -0.5000])
    """
    if mask is not None:
        log_w = torch.where(mask, log_w, torch.zeros((), dtype=log_w.dtype, device=log_w.device))
    cum = log_w.detach().cumsum(-1)
    return cum + (log_w - log_w.detach())


def weighted_kl_to_go(
    logprob: Tensor,
    ref_logprob: Tensor,
    mask: Optional[Tensor],
    weight: Optional[Tensor] = None,
    estimator: str = "k1",
) -> Tensor:
    r"""The detached KL-to-go :math:`\tilde F_t = \sum_{s > t,\ \mathrm{valid}} \rho_{1:s} k_s` (``weight``
    :math:`= \rho`, or 1), a reversed exclusive cumulative sum along the last dimension, with
    :math:`k_s = d_s` (``"k1"``) or the ``k3`` value of :math:`d_s` (``"k3"``, see :data:`KL_TO_GO`).

    Args:
        logprob, ref_logprob: ``[..., t]`` the sampled tokens' log-probs under the policy and the
            reference.
        mask: optional ``[..., t]`` bool mask; masked positions add nothing (NaN or inf there is never read).
        weight: optional ``[..., t]`` per-decision weights :math:`\bar\rho_{1:s}` (their value is used).
        estimator: one of :data:`KL_TO_GO`.

    Returns:
        ``[..., t]`` in the promoted dtype (at least float32), without gradient.

    Example:
        >>> lp = torch.tensor([-1.0, -2.0, float("nan"), -1.0])
        >>> ref = torch.tensor([-1.5, -1.0, 0.0, -2.0])
        >>> weighted_kl_to_go(lp, ref, torch.tensor([True, True, False, True]))  # d = 0.5, -1, -, 1
        tensor([0., 1., 1., 0.])
    """
    dtype = torch.promote_types(torch.promote_types(logprob.dtype, ref_logprob.dtype), torch.float32)
    with torch.no_grad():
        d = logprob.to(dtype) - ref_logprob.to(dtype)
        if mask is not None:
            d = torch.where(mask, d, torch.zeros((), dtype=dtype, device=d.device))
        k = base_value("k3", d) if estimator == "k3" else d
        if weight is not None:
            k = weight.detach().to(dtype) * k
        return future_sum(k, mask)


def future_sum(values: Tensor, mask: Optional[Tensor]) -> Tensor:
    r"""The detached :math:`\sum_{s > t,\ \mathrm{valid}} v_s` along the last dimension.

    A reversed cumulative sum shifted by one: each tail is summed from the later values alone, so a
    tail far smaller than :math:`v_t` keeps its digits (``(sum from t on) - v_t`` would cancel them).

    Example:
        >>> future_sum(torch.tensor([1.0, 2.0, float("inf"), 4.0]), torch.tensor([True, True, False, True]))
        tensor([6., 4., 4., 0.])
    """
    with torch.no_grad():
        if mask is not None:
            values = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
        return exclusive_cumsum(values.flip(-1)).flip(-1)


def exclusive_cumsum(values: Tensor) -> Tensor:
    r""":math:`\sum_{u < t} v_u` along the last dimension: a cumulative sum shifted by one (0 first), never
    ``cumsum - v``, which loses the digits of a prefix far smaller than :math:`v_t`.

    Example:
        >>> exclusive_cumsum(torch.tensor([1e-8, 1.0, 2.0]))
        tensor([0.0000e+00, 1.0000e-08, 1.0000e+00])
    """
    if values.shape[-1] == 0:
        return values.clone()
    return F.pad(values[..., :-1].cumsum(-1), (1, 0))


def full_with_kl_to_go(kl: Tensor, sampled_logprob: Tensor, mask: Optional[Tensor]) -> Tensor:
    r"""``full`` at the sequence level: :math:`\mathrm{KL}_t + (\log\pi_t - \operatorname{sg}\log\pi_t)
    \sum_{s > t} \operatorname{sg}\mathrm{KL}_s`.

    Args:
        kl: ``[..., t]`` the exact per-position KL (differentiable w.r.t. the logits).
        sampled_logprob: ``[..., t]`` the policy's log-probs of the sampled tokens (differentiable).
        mask: optional ``[..., t]`` bool mask.

    Example:
        >>> lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
        >>> out = full_with_kl_to_go(torch.tensor([0.25, 0.5, 0.125]), lp, None)
        >>> out
        tensor([0.2500, 0.5000, 0.1250], grad_fn=<AddBackward0>)
        >>> out.sum().backward(); lp.grad  # the exact KL of the later positions
        tensor([0.6250, 0.1250, 0.0000])
    """
    return with_kl_to_go(kl, sampled_logprob, future_sum(kl.detach(), mask), mask)


def with_kl_to_go(value: Tensor, logprob: Tensor, future: Tensor, mask: Optional[Tensor]) -> Tensor:
    r"""``value + (logprob - logprob.detach()) * future``: an exact 0 added to the value, the score
    term :math:`\tilde F_t\nabla\log\pi_t` added to the gradient, none at masked positions.

    Args:
        value: ``[..., t]`` the weighted per-token estimate (in the compute dtype).
        logprob: ``[..., t]`` the policy's log-probs of the sampled tokens (differentiable).
        future: ``[..., t]`` :func:`weighted_kl_to_go` (detached).
        mask: optional ``[..., t]`` bool mask.

    Example:
        >>> lp = torch.tensor([-1.0, -2.0], requires_grad=True)
        >>> out = with_kl_to_go(torch.tensor([0.1, 0.2]), lp, torch.tensor([3.0, 0.0]), None)
        >>> out
        tensor([0.1000, 0.2000], grad_fn=<AddBackward0>)
        >>> out.sum().backward(); lp.grad
        tensor([3., 0.])
    """
    lp = logprob.to(value.dtype)
    if mask is not None:
        # select before subtracting: inf - inf at a padded position would be NaN
        lp = torch.where(mask, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
    return value + (lp - lp.detach()) * future.detach()
