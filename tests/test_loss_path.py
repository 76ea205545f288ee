"""``KLPenaltyLoss.forward`` goes down the layers once: a run-time trace of the package's files that one forward
runs through, and each input checked once.

The trace (:func:`path_of`) lists the files of the package in the order the forward calls into them (the
same file twice in a row counted once). A *return* is entering again a file the path had left; going back
to the loss's own file is not one (the loss composes the steps). The vocabulary engine and the fused kernel
are boxes: what runs below a ``kernels/`` frame is the kernel's inside (its own chunk loop, sampler and
checks), shown as the kernel's file alone.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import pytest
import torch

import lightning_kl as lk
from lightning_kl.ground import checks

PACKAGE = os.path.dirname(lk.__file__) + os.sep


def path_of(fn: Callable[[], Any], boxes: bool = True) -> list[str]:
    """The package files ``fn`` calls into, in order (consecutive repeats once); kernels as boxes."""
    seen: list[str] = []
    depth = [0]
    box = [None]  # the depth at which the path entered a kernel

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            depth[0] += 1
            filename = frame.f_code.co_filename
            if not filename.startswith(PACKAGE) or frame.f_code.co_name.startswith("<"):
                return
            if box[0] is not None:
                return  # inside a kernel
            rel = os.path.relpath(filename, PACKAGE).removesuffix(".py").replace(os.sep, "/")
            if boxes and rel.startswith("kernels/"):
                box[0] = depth[0]
            if not seen or seen[-1] != rel:
                seen.append(rel)
        elif event == "return":
            if box[0] == depth[0]:
                box[0] = None
            depth[0] -= 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def returns(path: list[str], home: str = "loss") -> int:
    """How often the path enters again a file it had left (the loss's own file not counted)."""
    return sum(1 for i, f in enumerate(path) if f != home and f in path[:i])


def _sampled_case() -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(4, 16, generator=g)).requires_grad_()
    ref = -torch.rand(4, 16, generator=g)
    mask = torch.rand(4, 16, generator=g) > 0.2
    return lp, ref, mask


def test_the_path_of_a_k3_plus_forward_at_the_token_level_returns_at_most_once() -> None:
    lp, ref, mask = _sampled_case()
    loss = lk.KLPenaltyLoss("k3+")
    loss(lp, ref, mask)  # the first call's one-time work is not the per-step way
    path = path_of(lambda: loss(lp, ref, mask))
    assert returns(path) <= 1, " > ".join(path)
    assert path[:2] == ["loss", "inputs"], path  # validate first, in one module
    # down the steps in order: validate, compute, reduce, metric, coefficient
    steps = [f for f in path if f in ("inputs", "compute", "reduce", "metric", "coefficient")]
    assert steps == ["inputs", "compute", "reduce", "metric", "coefficient"], path


def test_the_path_of_a_full_forward_with_top_p_at_the_sequence_level_returns_at_most_3_times() -> None:
    g = torch.Generator().manual_seed(1)
    sampling = lk.Sampling(0.7, top_p=0.9)
    logits = torch.randn(2, 6, 32, generator=g, requires_grad=True)
    ref_logits = torch.randn(2, 6, 32, generator=g)
    mask = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        probs = torch.softmax(logits / 0.7, -1)
    tokens = probs.argmax(-1)  # the most likely token: inside every top-p kept set
    sampled = lk.token_logprobs(logits, tokens, sampling=sampling)
    loss = lk.KLPenaltyLoss("full", agg="seq-mean-token-sum", level="sequence", sampling=sampling)
    loss(logits, ref_logits, mask, sampled_logprob=sampled)
    path = path_of(lambda: loss(logits, ref_logits, mask, sampled_logprob=sampled))
    assert returns(path) <= 3, " > ".join(path)
    steps = [f for f in path if f in ("inputs", "compute", "reduce", "metric", "coefficient")]
    assert steps == ["inputs", "compute", "reduce", "metric", "coefficient"], path


def test_the_tracer_counts_a_return_when_a_step_calls_back_up() -> None:
    # the counter itself: a path that goes back into a file it left is counted, the loss's own file is not
    assert returns(["loss", "inputs", "ground/checks", "inputs", "loss", "reduce", "loss"]) == 1
    assert returns(["loss", "inputs", "loss", "compute", "loss"]) == 0


@pytest.mark.parametrize(
    "estimator, level, old",
    [("k3+", "token", False), ("k3", "token", True), ("k2", "sequence", True), ("k1", "sequence", False)],
)
def test_each_input_of_a_forward_is_checked_once(estimator: str, level: str, old: bool) -> None:
    lp, ref, mask = _sampled_case()
    loss = lk.KLPenaltyLoss(estimator, agg="seq-mean-token-sum", level=level)
    kwargs = {"old_logprob": lp.detach() - 0.1} if old else {}
    loss(lp, ref, mask, **kwargs)
    names: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        loss(lp, ref, mask, **kwargs)
    finally:
        sys.setprofile(None)
    # one check_mask (the loss's), one shape check per pair, one log-prob check; the metric takes the sums
    assert names.count("check_mask") == 1 and names.count("check_matching") == (2 if old else 1), names
    assert names.count("check_logprobs") == 1 and "_kl_metric_update" not in names, names


def test_the_loss_input_checks_live_in_at_most_2_modules() -> None:
    lp, ref, mask = _sampled_case()
    loss = lk.KLPenaltyLoss("k3+", level="sequence", agg="token-sum")
    loss(lp, ref, mask, old_logprob=lp.detach())
    where: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_name
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE) and name.startswith(("check_", "_check", "warn_if")):
            where.add(os.path.relpath(frame.f_code.co_filename, PACKAGE))

    sys.setprofile(profile)
    try:
        loss(lp, ref, mask, old_logprob=lp.detach(), num_tokens=40, accumulate_grad_batches=1)
    finally:
        sys.setprofile(None)
    assert where <= {"inputs.py", os.path.join("ground", "checks.py")}, where


def test_the_metric_takes_the_loss_checked_values_without_checking_them_again(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = []
    real = checks.check_mask

    def counting(*args: Any, **kwargs: Any) -> Any:
        counted.append(args[2] if len(args) > 2 else kwargs.get("like_name"))
        return real(*args, **kwargs)

    for module in ("lightning_kl.inputs", "lightning_kl.metric", "lightning_kl.ground.checks"):
        monkeypatch.setattr(f"{module}.check_mask", counting)
    lp = -torch.rand(2, 5)
    lk.KLPenaltyLoss("k3+", agg="token-mean")(lp, lp - 0.1, torch.ones(2, 5, dtype=torch.bool))
    assert counted == ["logprob"]
