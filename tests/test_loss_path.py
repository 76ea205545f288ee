"""``KLPenaltyLoss.forward`` goes down the layers: the calls it makes inside the package, in order, climb
back to a higher layer (ground <- kernels <- functions <- shells) at most 5 times, and check each input once."""

from __future__ import annotations

import sys
from typing import Any, Callable

import pytest
import torch

import lightning_kl as lk
from lightning_kl.ground import checks

LAYER = {"ground": 0, "kernels": 1, "estimators": 1, "functional": 2, "sequence": 2, "logprobs": 2, "sampling": 2, "accumulation": 2, "mixing": 2, "vocab_inputs": 2, "mismatch": 2}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYER.get(parts[1], 3) if len(parts) > 1 else 4


def _calls(fn: Callable[[], Any]) -> list[tuple[str, str]]:
    """(module, function) of every call into the package while ``fn`` runs."""
    seen: list[tuple[str, str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("lightning_kl") and not frame.f_code.co_name.startswith("<"):
                seen.append((module, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize(
    "estimator, level, old",
    [("k3+", "token", False), ("k3", "token", True), ("k2", "sequence", True), ("k1", "sequence", False)],
)
def test_the_way_of_logprob_through_the_loss_climbs_back_at_most_5_times(estimator: str, level: str, old: bool) -> None:
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(4, 16, generator=g)).requires_grad_()
    ref = -torch.rand(4, 16, generator=g)
    mask = torch.rand(4, 16, generator=g) > 0.2
    loss = lk.KLPenaltyLoss(estimator, agg="seq-mean-token-sum", level=level)
    kwargs = {"old_logprob": lp.detach() - 0.1} if old else {}
    loss(lp, ref, mask, **kwargs)  # the first call's one-time work is not the per-step way
    calls = _calls(lambda: loss(lp, ref, mask, **kwargs))
    climbs = [(a, b) for a, b in zip(calls, calls[1:]) if _layer(b[0]) > _layer(a[0])]
    assert len(climbs) <= 5, climbs
    # each input checked once: one check_mask (the loss's), one shape check per pair
    names = [f for _, f in calls]
    assert names.count("check_mask") == 1 and names.count("check_matching") == (2 if old else 1), names
    assert names.count("check_logprob_values") == 1 and "_kl_metric_update" in names


def test_the_metric_takes_the_loss_checked_values_without_checking_them_again(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = []
    real = checks.check_mask

    def counting(*args: Any, **kwargs: Any) -> Any:
        counted.append(args[2] if len(args) > 2 else kwargs.get("like_name"))
        return real(*args, **kwargs)

    for module in ("lightning_kl.functional", "lightning_kl.metric", "lightning_kl.ground.checks"):
        monkeypatch.setattr(f"{module}.check_mask", counting)
    lp = -torch.rand(2, 5)
    lk.KLPenaltyLoss("k3+", agg="token-mean")(lp, lp - 0.1, torch.ones(2, 5, dtype=torch.bool))
    assert counted == ["logprob"]
