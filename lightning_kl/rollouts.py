r"""The on-policy rollout stream: a dataset that samples each batch from the current policy when asked."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from torch.utils.data import IterableDataset


class OnPolicyRollouts(IterableDataset):
    r"""Yields ``n_rollouts`` batches, each made by calling ``sample()`` at the moment it is fetched.

    Serve it with ``DataLoader(OnPolicyRollouts(sample, n), batch_size=None, num_workers=0)``: it
    yields whole batches, and the sampler must run in the process that holds the policy's current
    weights. Sampling inside the data pipeline lets a :class:`lightning_kl.KLRewardCallback` shape the
    rewards before ``training_step`` sees the batch.

    The dataset has a length on purpose: Lightning fetches one batch ahead from an iterable without
    one (to know when the epoch ends), so rollout ``k + 1`` would be sampled before update ``k``,
    one step off-policy. With a length there is no prefetch, and every rollout comes from the policy
    that the previous ``training_step`` left behind. Lightning warns about an ``IterableDataset`` with
    ``__len__`` (meant for worker processes, which this does not use); filter it with
    ``warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")``.

    Args:
        sample: called with no arguments once per batch; returns the batch (any collated object,
            usually a dict of tensors). It is not called before the batch is fetched.
        n_rollouts: batches per epoch (one ``training_step`` each), ``>= 1``.

    Raises:
        TypeError: ``sample`` is not callable.
        ValueError: ``n_rollouts`` is not an integer ``>= 1``.

    Example:
        >>> calls = []
        >>> rollouts = OnPolicyRollouts(lambda: calls.append(len(calls)) or len(calls), n_rollouts=3)
        >>> len(rollouts), calls
        (3, [])
        >>> it = iter(rollouts)
        >>> next(it), calls
        (1, [0])
        >>> list(it)
        [2, 3]
    """

    def __init__(self, sample: Callable[[], Any], n_rollouts: int) -> None:
        if not callable(sample):
            raise TypeError(f"`sample` must be callable (called once per batch), got {type(sample).__name__}.")
        if isinstance(n_rollouts, bool) or not isinstance(n_rollouts, int) or n_rollouts < 1:
            raise ValueError(f"`n_rollouts` must be an integer >= 1, got {n_rollouts!r}.")
        self.sample = sample
        self.n_rollouts = n_rollouts

    def __len__(self) -> int:
        # a length makes Lightning fetch each batch when it is needed instead of one ahead
        return self.n_rollouts

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.n_rollouts):
            yield self.sample()
