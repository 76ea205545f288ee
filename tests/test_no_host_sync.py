"""Log-probs, the full KL and the processed sampling functions read nothing from the device on the host per call, off the CPU.

On CPU a host read cannot stall, so the package reads values there where it helps (named errors,
skipping padding: ``lightning_kl.ground.checks.HOST_READ_DEVICES``). These tests switch that off, as
on a GPU, and run forward and backward with every way of reading a tensor's value into Python
(``item``, ``tolist``, ``__float__``, ``__int__``, ``__bool__``, ``__index__``) and every op whose
output size depends on the values (``nonzero``, ``argwhere``, ``masked_select``, indexing by a bool
tensor: a sync on a GPU) refused: the results must equal the host form's, NaN padding included, and a
bad token id must still fail.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch import Tensor
from torch.testing import assert_close

import lightning_kl as lk
from _vocab import kl_from_hidden, logprobs_from_hidden, processed, processed_from_hidden, processed_kl

# the reference side is differentiated on purpose here: its gradient is checked too
pytestmark = pytest.mark.filterwarnings("ignore:`ref_[a-z]*` requires grad")
from lightning_kl.ground import checks

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
SIZED_BY_VALUES = ("nonzero", "argwhere", "masked_select")
B, T, V, D = 3, 6, 37, 5


@contextlib.contextmanager
def device_form(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(name: str) -> Any:
        def read(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"Tensor.{name} called: a host read")

        return read

    with monkeypatch.context() as m, _RefuseBoolIndexing():
        m.setattr(checks, "HOST_READ_DEVICES", frozenset())
        for name in READS + SIZED_BY_VALUES:
            m.setattr(Tensor, name, refuse(name))
        for name in SIZED_BY_VALUES:
            m.setattr(torch, name, refuse(name))
        yield


class _RefuseBoolIndexing(TorchFunctionMode):
    """Indexing by a bool tensor sizes its result by values (a host sync): refused.

    A torch function mode, not a patched ``Tensor.__getitem__``: setting and deleting ``__getitem__``
    on the class leaves CPython's sequence slot behind, and ``torch.tensor([[0-d tensors]])`` then
    fails in every later test of the process.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is Tensor.__getitem__:
            key = args[1]
            keys = key if isinstance(key, tuple) else (key,)
            if any(isinstance(k, Tensor) and k.dtype == torch.bool for k in keys):
                raise AssertionError("indexing by a bool tensor: a host sync")
        return func(*args, **(kwargs or {}))


def _inputs() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(3)
    mask = torch.arange(T).expand(B, T) < torch.tensor([[6], [2], [0]])
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    z = torch.where(mask.unsqueeze(-1), z, float("nan"))  # NaN padding
    z[0, 1, 4] = float("-inf")  # p = 0 there: the safe path
    tokens = torch.randint(0, V, (B, T), generator=g).masked_fill(~mask, -100)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    # tied scores (a grid of halves), which top-p's sort splits at its boundary: the backward's re-run
    zt = torch.where(mask.unsqueeze(-1), (z.nan_to_num(0, 0, 0) * 2).round() / 2, float("nan"))
    w_tied = torch.randn(V, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    w_tied[1::2] = w_tied[0:-1:2]  # logits from hidden states tied in pairs
    return {
        "z": z,
        "zr": torch.randn(B, T, V, generator=g, dtype=torch.float64),
        "mask": mask,
        "tokens": tokens,
        "hidden": torch.where(mask.unsqueeze(-1), hidden, float("nan")),
        "ref_hidden": torch.randn(B, T, D, generator=g, dtype=torch.float64),
        "w": torch.randn(V, D, generator=g, dtype=torch.float64),
        "w_ref": torch.randn(V, D, generator=g, dtype=torch.float64),
        "weights": torch.randn(B, T, generator=g, dtype=torch.float64),
        "zt": zt,
        "zt_top": zt.nan_to_num(0).argmax(-1).masked_fill(~mask, -100),  # in every kept set
        "zt_ref": zt.nan_to_num(0) / 2,  # flatter, the same order: keeps a superset, "processed" stays finite
        "w_tied": w_tied,
        "h_top": (hidden.nan_to_num(0) @ w_tied.T).argmax(-1).masked_fill(~mask, -100),
    }


# the sampler's processing of the processed cases: top-p splits the ties of "zt" (checked below)
PROC = {"temperature": 0.9, "top_k": 20, "top_p": 0.6}


# each case: (leaves that get gradients, function of them) -> per-token values
CASES: dict[str, tuple[tuple[str, ...], Callable[..., Tensor]]] = {
    "token_logprobs": (("z",), lambda x, z: lk.token_logprobs(z, x["tokens"], ignore_index=-100, chunk_size=4)),
    "token_logprobs_T": (("z",), lambda x, z: lk.token_logprobs(z[:, :-1], x["tokens"][:, :-1], sampling=lk.Sampling(0.7), ignore_index=-100)),
    "token_logprobs_from_hidden": (
        ("hidden", "w"),
        lambda x, h, w: logprobs_from_hidden(h, w, x["tokens"], ignore_index=-100, chunk_size=4),
    ),
    "full_kl": (("z", "zr"), lambda x, z, zr: lk.full_kl(z, zr, x["mask"], sampling=lk.Sampling(1.3), chunk_size=4)),
    "full_kl_sliced": (("z", "zr"), lambda x, z, zr: lk.full_kl(z[:, 1:], zr[:, 1:], x["mask"][:, 1:])),
    "full_kl_from_hidden": (
        ("hidden", "w", "ref_hidden"),
        lambda x, h, w, hr: kl_from_hidden(h, w, hr, x["w_ref"], x["mask"], chunk_size=4),
    ),
    "token_entropy": (("z",), lambda x, z: lk.token_entropy(z, x["mask"], sampling=lk.Sampling(0.8), chunk_size=4)),
    "token_entropy_processed": (("zt",), lambda x, z: lk.token_entropy(z, x["mask"], sampling=lk.Sampling(**PROC), chunk_size=4)),
    "kl_penalty_full": (("z", "zr"), lambda x, z, zr: lk.kl_penalty(z, zr, "full", mask=x["mask"])),
    "processed_logprobs": (
        ("zt",),
        lambda x, z: processed(z, x["zt_top"], **PROC, ignore_index=-100, chunk_size=4).logprobs,
    ),
    "processed_logprobs_outside_-inf_min_p": (
        ("zt",),
        lambda x, z: processed(z, x["tokens"], top_p=0.6, min_p=0.2, ignore_index=-100, outside="-inf").logprobs,
    ),
    "processed_logprobs_kept_from": (
        ("zr",),
        lambda x, zr: processed(zr, x["tokens"], **PROC, ignore_index=-100, outside="-inf", kept_from=x["zt"]).logprobs,
    ),
    "processed_logprobs_top_k_only": (
        ("zt",),
        lambda x, z: processed(z, x["zt_top"], top_k=7, ignore_index=-100, chunk_size=4).logprobs,
    ),
    "processed_logprobs_from_hidden": (
        ("hidden", "w_tied"),
        lambda x, h, w: processed_from_hidden(h, w, x["h_top"], **PROC, ignore_index=-100, chunk_size=4).logprobs,
    ),
    "token_logprobs_top_p": (
        ("zt",),
        lambda x, z: lk.token_logprobs(z, x["zt_top"], sampling=lk.Sampling(0.9, top_p=0.6), ignore_index=-100, chunk_size=4),
    ),
    **{
        f"processed_full_kl_{reference}": (
            ("zt", "zt_ref"),
            lambda x, z, zr, reference=reference: processed_kl(z, zr, x["mask"], **PROC, reference=reference, chunk_size=4),
        )
        for reference in ("unprocessed", "processed", "policy_kept")
    },
}


def _run(name: str) -> tuple[Tensor, list[Tensor]]:
    x = _inputs()
    names, fn = CASES[name]
    leaves = [x[n].clone().requires_grad_() for n in names]
    out = fn(x, *leaves)
    (out * x["weights"][tuple(slice(0, s) for s in out.shape)]).nansum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("name", sorted(CASES))
def test_device_form_reads_nothing_and_equals_the_host_form(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    want, want_grads = _run(name)
    with device_form(monkeypatch):
        got, grads = _run(name)
    assert_close(got, want, rtol=0, atol=1e-12, equal_nan=True)
    for g, w in zip(grads, want_grads):
        assert bool(g.isfinite().all())  # NaN padding stays out of every gradient
        assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("from_hidden", [False, True])
def test_device_form_still_refuses_an_out_of_range_id(monkeypatch: pytest.MonkeyPatch, from_hidden: bool) -> None:
    x = _inputs()
    tokens = x["tokens"].clamp(min=0)
    tokens[1, 0] = V
    with device_form(monkeypatch), pytest.raises(RuntimeError, match=rf"token ids must be in \[0, {V}\)"):
        if from_hidden:
            logprobs_from_hidden(x["hidden"], x["w"], tokens)
        else:
            lk.token_logprobs(x["z"], tokens)


@pytest.mark.parametrize("key", ["zt", "hidden"])
def test_the_processed_cases_have_ties_split_by_top_p(key: str) -> None:
    """Without rows whose kept set splits tied scores, the backward's re-run would go untested."""
    from lightning_kl.ground.sampler import check_processing, process_scores

    x = _inputs()
    z = x["zt"] if key == "zt" else x["hidden"] @ x["w_tied"].T
    z = z[x["mask"]] / PROC["temperature"]
    kept = process_scores(z, check_processing(**PROC))
    smallest_kept = torch.where(kept == float("-inf"), float("inf"), z).amin(-1, keepdim=True)
    split = ((z == smallest_kept) & (kept == float("-inf"))).any(-1)
    assert 0 < int(split.sum()) < z.shape[0]  # tied rows split, and rows masked by their threshold


def test_device_form_still_refuses_a_token_outside_the_kept_set(monkeypatch: pytest.MonkeyPatch) -> None:
    z = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    with device_form(monkeypatch), pytest.raises(RuntimeError, match="sampled tokens must lie in the kept set"):
        processed(z, torch.tensor([2]), top_k=2)
    with device_form(monkeypatch):  # a token inside it passes
        lp = processed(z, torch.tensor([1]), top_k=2).logprobs
    assert_close(lp, -torch.tensor([1.0]).exp().log1p())  # log(e / (e^2 + e))


def test_device_form_still_refuses_the_gradient_of_an_infinite_kl(monkeypatch: pytest.MonkeyPatch) -> None:
    z = torch.tensor([[2.0, 1.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[0.0, 1.0, 2.0]])
    with device_form(monkeypatch):
        kl = processed_kl(z, ref, top_k=2, reference="processed")  # token 0 kept, removed by the reference
        with pytest.raises(RuntimeError, match=r"processed distribution is \+inf"):
            kl.sum().backward()
    assert torch.isinf(kl.detach()).all()  # the value says so
