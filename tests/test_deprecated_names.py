"""Each name the vocabulary surface replaced still works for one minor version: it warns, naming the new
call, gives exactly what the new call gives, and is out of ``__all__`` but reachable as ``lk.name``."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl.deprecated import SampledLogprobs

F64 = torch.float64
DEPRECATED = (
    "token_logprobs_from_hidden",
    "full_kl_from_hidden",
    "processed_logprobs",
    "processed_logprobs_from_hidden",
    "processed_full_kl",
)


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 9, generator=g, dtype=F64)
    return {
        "z": z,
        "zr": torch.randn(2, 3, 9, generator=g, dtype=F64),
        "h": torch.randn(2, 3, 4, generator=g, dtype=F64),
        "w": torch.randn(9, 4, generator=g, dtype=F64),
        "b": torch.randn(9, generator=g, dtype=F64),
        "tokens": z.argmax(-1),
        "mask": torch.tensor([[True, False, True], [True, True, True]]),
    }


@pytest.mark.parametrize("name", DEPRECATED)
def test_out_of_all_but_reachable(name: str) -> None:
    assert name not in lk.__all__
    assert callable(getattr(lk, name))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        getattr(lk, "nope")


def test_token_logprobs_from_hidden() -> None:
    d = _data()
    tokens = torch.nn.functional.linear(d["h"], d["w"], d["b"]).argmax(-1)  # in every top-4
    with pytest.warns(DeprecationWarning, match=r"lk.token_logprobs_from_hidden is deprecated: use lk.token_logprobs\(lk.FromHidden"):
        old = lk.token_logprobs_from_hidden(d["h"], d["w"], tokens, d["b"], 0.8, top_k=4)
    new = lk.token_logprobs(lk.FromHidden(d["h"], d["w"], d["b"]), tokens, sampling=lk.Sampling(0.8, top_k=4))
    assert torch.equal(old, new)


def test_full_kl_from_hidden() -> None:
    d = _data()
    with pytest.warns(DeprecationWarning, match=r"lk.full_kl_from_hidden is deprecated: use lk.full_kl\(lk.FromHidden"):
        old = lk.full_kl_from_hidden(d["h"], d["w"], d["h"].flip(0), d["w"], d["mask"], bias=d["b"], temperature=1.5)
    new = lk.full_kl(lk.FromHidden(d["h"], d["w"], d["b"]), lk.FromHidden(d["h"].flip(0), d["w"]), d["mask"], sampling=lk.Sampling(1.5))
    assert torch.equal(old, new)


def test_processed_logprobs() -> None:
    d = _data()
    with pytest.warns(DeprecationWarning, match=r"lk.processed_logprobs is deprecated: use lk.token_logprobs\(.*return_log_kept=True"):
        old = lk.processed_logprobs(d["z"], d["tokens"], 0.9, None, 0.7)
    lp, log_kept = lk.token_logprobs(d["z"], d["tokens"], sampling=lk.Sampling(0.9, top_p=0.7), return_log_kept=True)
    assert isinstance(old, SampledLogprobs) and torch.equal(old.logprobs, lp) and torch.equal(old.log_kept, log_kept)


def test_processed_logprobs_from_hidden() -> None:
    d = _data()
    with pytest.warns(DeprecationWarning, match=r"lk.processed_logprobs_from_hidden is deprecated: use lk.token_logprobs\(lk.FromHidden"):
        old = lk.processed_logprobs_from_hidden(d["h"], d["w"], d["tokens"], d["b"], min_p=0.1, outside="-inf")
    lp, log_kept = lk.token_logprobs(
        lk.FromHidden(d["h"], d["w"], d["b"]), d["tokens"], sampling=lk.Sampling(min_p=0.1), outside="-inf", return_log_kept=True
    )
    assert torch.equal(old.logprobs, lp) and torch.equal(old.log_kept, log_kept)


def test_processed_full_kl() -> None:
    d = _data()
    with pytest.warns(DeprecationWarning, match=r"lk.processed_full_kl is deprecated: use lk.full_kl\(.*sampling=lk.Sampling"):
        old = lk.processed_full_kl(d["z"], d["zr"], d["mask"], top_k=3, reference="policy_kept")
    new = lk.full_kl(d["z"], d["zr"], d["mask"], sampling=lk.Sampling(top_k=3), reference="policy_kept")
    assert torch.equal(old, new)


def test_sampler_keywords_of_token_logprobs_and_full_kl() -> None:
    d = _data()
    with pytest.warns(DeprecationWarning, match=r"token_logprobs\(temperature=, top_k=...\) is deprecated: pass sampling=lk.Sampling\(temperature=0.7, top_k=5\)"):
        old = lk.token_logprobs(d["z"], d["tokens"], temperature=0.7, top_k=5)
    assert torch.equal(old, lk.token_logprobs(d["z"], d["tokens"], sampling=lk.Sampling(0.7, top_k=5)))
    with pytest.warns(DeprecationWarning, match=r"positionally is deprecated"):
        old = lk.token_logprobs(d["z"], d["tokens"], 0.7, 0)
    assert torch.equal(old, lk.token_logprobs(d["z"], d["tokens"], sampling=lk.Sampling(0.7), ignore_index=0))
    with pytest.warns(DeprecationWarning, match=r"full_kl\(temperature=...\) is deprecated: pass sampling=lk.Sampling\(temperature=2.0\)"):
        old = lk.full_kl(d["z"], d["zr"], temperature=2.0)
    assert_close(old, lk.full_kl(d["z"], d["zr"], sampling=lk.Sampling(2.0)), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['temprature'\]"):
        lk.full_kl(d["z"], d["zr"], temprature=2.0)
