"""The engine's edge values and messages (issue 40, A8 and A10).

* A8: the entropy of an unmasked row whose logits are all ``-inf`` is NaN (there is no distribution),
  as torch's ``-(softmax * log_softmax).sum()`` and the truncating sampler's path give; a masked row
  gives 0.
* A10: the backward of a ``+inf`` KL names the reference it was taken against, for each
  ``reference=``, and suggests only what is not already in use.
"""

from __future__ import annotations

import math

import pytest
import torch

import lightning_kl as lk

NINF = float("-inf")


def _torch_entropy(x: torch.Tensor) -> torch.Tensor:
    return -(torch.softmax(x.double(), -1) * torch.log_softmax(x.double(), -1)).sum(-1)


@pytest.mark.parametrize("sampling", [lk.Sampling(), lk.Sampling(temperature=0.7), lk.Sampling(top_k=2), lk.Sampling(top_p=0.9)])
@pytest.mark.parametrize("form", ["logits", "hidden", "with_logprobs"])
def test_the_entropy_of_a_row_without_mass_is_nan(sampling: lk.Sampling, form: str) -> None:
    x = torch.tensor([[NINF] * 4, [0.0, 1.0, 2.0, 3.0]])
    assert math.isnan(float(_torch_entropy(x)[0]))  # what torch gives
    if form == "logits":
        ent = lk.token_entropy(x, sampling=sampling)
    elif form == "hidden":  # the same rows from a head: the bias carries the -inf of row 0
        h = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
        w = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 2.0], [0.0, 3.0]])
        ent = lk.token_entropy(lk.FromHidden(h, w, torch.tensor([0.0, 0.0, 0.0, 0.0])), sampling=sampling)
        ent = torch.stack([lk.token_entropy(lk.FromHidden(h[:1], w, torch.full((4,), NINF)), sampling=sampling)[0], ent[1]])
    else:
        ent = lk.token_logprobs_and_entropy(x, torch.tensor([0, 3]), sampling=sampling, outside="-inf")[1]
    assert math.isnan(float(ent[0])), ent
    want = lk.token_entropy(x[1:], sampling=sampling)[0]
    assert float(ent[1]) == pytest.approx(float(want), rel=1e-6)
    # masked, the same row gives 0
    masked = lk.token_entropy(x, torch.tensor([False, True]), sampling=sampling)
    assert masked[0].item() == 0.0


def test_a_finite_row_keeps_its_entropy() -> None:
    # the NaN is for rows without mass only: a row with one finite logit has entropy 0, not NaN
    x = torch.tensor([[NINF, NINF, 1.0, NINF], [0.0, 0.0, 0.0, 0.0]])
    assert lk.token_entropy(x).tolist() == pytest.approx([0.0, math.log(4)], abs=1e-6)


def _inf_kl_message(reference: str, sampling: lk.Sampling) -> str:
    z = torch.tensor([[0.0, 1.0, 2.0, 3.0]], requires_grad=True)
    ref = torch.tensor([[0.0, 1.0, 2.0, NINF]])  # the reference cannot emit token 3, which the policy keeps
    kl = lk.full_kl(z, ref, sampling=sampling, reference=reference)
    assert kl.item() == float("inf")
    with pytest.raises(ValueError) as err:
        kl.sum().backward()
    return str(err.value)


@pytest.mark.parametrize("sampling", [lk.Sampling(), lk.Sampling(top_k=2)])
def test_an_infinite_kl_against_the_unprocessed_reference_names_it(sampling: lk.Sampling) -> None:
    msg = _inf_kl_message("unprocessed", sampling)
    assert "the reference's softmax" in msg and "own processed" not in msg
    assert "reference logit is -inf" in msg
    assert "'unprocessed'" not in msg  # already in use: not suggested


def test_an_infinite_kl_on_the_policys_kept_set_names_it() -> None:
    msg = _inf_kl_message("policy_kept", lk.Sampling(top_k=2))
    assert "renormalized on the policy's kept set" in msg and "own processed" not in msg
    assert "'policy_kept'" not in msg


def test_an_infinite_kl_against_the_processed_reference_keeps_its_advice() -> None:
    msg = _inf_kl_message("processed", lk.Sampling(top_k=2))
    assert "the reference's own processed distribution" in msg
    assert "reference='policy_kept' or 'unprocessed'" in msg
    # without truncation the processed reference is the softmax: the cause is its -inf logit
    msg = _inf_kl_message("processed", lk.Sampling())
    assert "the reference's softmax" in msg and "own processed" not in msg
