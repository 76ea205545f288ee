"""Every scorer of ``lk.hf`` checks the sampler its model recorded (issue 40, S1 and S2), and a
keyword of the user's own wins in ``Sampling.generate_kwargs`` (issue 40, friction).

* S1: ``lk.hf.reference_logprobs`` given no ``sampling=`` warns when the (LoRA) model drew with a
  sampler (``generate_kwargs(model)``), as ``response_logprobs`` does; the reference it would have
  given silently is another distribution's (its k3 against the rollout is another number).
* S2: both scorers given an explicit sampler other than the one the model drew with warn, naming both.
* ``generate_kwargs(model, min_new_tokens=...)``: the user's keyword wins (``generate`` runs with it), a
  keyword that changes what is drawn warns, and the processing itself is refused by name.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk

pytest.importorskip("transformers")
pytest.importorskip("peft")

import test_doc_snippets as snippets  # noqa: E402  (the tiny Qwen2, LoRA and the docs' rollout)

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

SAMPLER = lk.Sampling(temperature=0.7, top_p=0.9)


def _policy() -> Any:
    model = snippets.lora(snippets.tiny_model())
    torch.manual_seed(0)
    with torch.no_grad():  # adapters that change the model: the reference differs from the policy
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def rollout() -> tuple[Any, dict[str, Any]]:
    model = _policy()
    batch = snippets.hf_rollout(SimpleNamespace(policy=model), SAMPLER)  # generate(**SAMPLER.generate_kwargs(policy))
    return model, batch


def _inputs(batch: dict[str, Any]) -> tuple[Any, Any, Any, int]:
    seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
    return seq, am, mask, seq.shape[1] - mask.shape[1]


def _k3(lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    d = (lp.double() - ref.double())[mask]
    return float((torch.exp(-d) + d - 1).mean())


def _silent(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


def test_the_reference_scorer_without_the_sampler_warns_on_a_model_that_drew_with_one(rollout: Any) -> None:
    model, batch = rollout
    seq, am, mask, p = _inputs(batch)
    right = _silent(lk.hf.reference_logprobs, model, seq, am, p, sampling=SAMPLER)
    assert_close(right[mask], batch["ref_logprobs"][mask], rtol=0, atol=1e-6)
    with pytest.warns(lk.hf.SamplerMismatchWarning,
                      match=r"reference_logprobs was given no sampler.*sampled with sampling=Sampling\(temperature=0.7, "
                            r"top_k=None, top_p=0.9, min_p=None\).*Warned once"):
        wrong = lk.hf.reference_logprobs(model, seq, am, p)
    # what it gives silently otherwise: the reference at T = 1, another k3 against the rollout's log-probs
    k3_right, k3_wrong = _k3(batch["logprobs"], right, mask), _k3(batch["logprobs"], wrong, mask)
    assert abs(k3_wrong - k3_right) > 0.1 * k3_right, (k3_right, k3_wrong)
    _silent(lk.hf.reference_logprobs, model, seq, am, p)  # once per model


def test_a_model_that_never_drew_with_a_sampler_is_not_warned_about() -> None:
    model = _policy()
    seq = torch.randint(3, 15, (2, 6))
    am = torch.ones_like(seq)
    _silent(lk.hf.reference_logprobs, model, seq, am, 3)
    lk.Sampling().generate_kwargs(model)  # the plain softmax, recorded: nothing to forget
    _silent(lk.hf.reference_logprobs, model, seq, am, 3)
    _silent(lk.hf.response_logprobs, model, seq, am, 3)


@pytest.mark.parametrize("scorer", ["response_logprobs", "reference_logprobs"])
@pytest.mark.parametrize("other", [lk.Sampling(temperature=1.0, top_p=0.9), lk.Sampling(temperature=0.7),
                                   lk.Sampling()])
def test_a_scorer_given_another_sampler_than_the_model_drew_with_warns(scorer: str, other: lk.Sampling) -> None:
    model = _policy()
    batch = snippets.hf_rollout(SimpleNamespace(policy=model), SAMPLER)
    seq, am, mask, p = _inputs(batch)
    fn = getattr(lk.hf, scorer)
    with pytest.warns(lk.hf.SamplerMismatchWarning,
                      match=rf"{scorer} was given sampling={other!r}.*sampled with sampling={SAMPLER!r}".replace("(", r"\(")
                      .replace(")", r"\)")):
        lp = fn(model, seq, am, p, sampling=other, outside="-inf")
    if scorer == "response_logprobs":  # the figure: the ratio to the sampler is not 1 on-policy
        ratio = torch.exp(lp - batch["logprobs"])[mask]
        assert (ratio - 1).abs().max() > 1e-2
    _silent(fn, model, seq, am, p, sampling=SAMPLER)  # the right one is silent


def test_the_check_follows_the_last_draw() -> None:
    # a new draw with another sampler (a temperature schedule) is recorded: scoring with it is silent
    model = _policy()
    seq = torch.randint(3, 15, (2, 6))
    am = torch.ones_like(seq)
    SAMPLER.generate_kwargs(model)
    later = lk.Sampling(temperature=0.5, top_p=0.9)
    later.generate_kwargs(model)
    _silent(lk.hf.response_logprobs, model, seq, am, 3, sampling=later, outside="-inf")
    _silent(lk.hf.reference_logprobs, model, seq, am, 3, sampling=later)
    # a scorer's own sampler does not replace a draw: the next other sampler still warns
    with pytest.warns(lk.hf.SamplerMismatchWarning, match="sampled with sampling=Sampling\\(temperature=0.5"):
        lk.hf.response_logprobs(model, seq, am, 3, sampling=SAMPLER, outside="-inf")


# --- generate_kwargs(model, **overrides) -------------------------------------------------------


def test_a_keyword_of_your_own_wins_in_generate_kwargs() -> None:
    model = snippets.tiny_model()
    enc = torch.tensor([[1, 5, 6, 7]])
    # without the overrides, one's own min_new_tokens beside **generate_kwargs() is a TypeError
    with pytest.raises(TypeError, match="multiple values"):
        model.generate(input_ids=enc, **SAMPLER.generate_kwargs(model), min_new_tokens=3)  # type: ignore[misc]
    with pytest.warns(lk.hf.SamplerMismatchWarning, match=r"min_new_tokens=3 \(neutral: min_new_tokens=None\)"):
        kwargs = SAMPLER.generate_kwargs(model, min_new_tokens=3, max_new_tokens=3, pad_token_id=0)
    assert kwargs["min_new_tokens"] == 3 and kwargs["max_new_tokens"] == 3 and kwargs["top_p"] == 0.9
    out = model.generate(input_ids=enc, attention_mask=torch.ones_like(enc), **kwargs)
    assert out.shape == (1, 7)  # EOS banned for 3 tokens, and at most 3 new ones
    # the ids and lengths, or a neutral value given again, change nothing drawn: silent
    same = _silent(SAMPLER.generate_kwargs, model, max_new_tokens=8, eos_token_id=2, repetition_penalty=1.0)
    assert same == {**SAMPLER.generate_kwargs(model), "max_new_tokens": 8, "eos_token_id": 2}


@pytest.mark.parametrize("key", ["temperature", "top_k", "top_p", "min_p", "do_sample", "num_beams"])
def test_the_processing_is_not_an_override(key: str) -> None:
    model = snippets.tiny_model()
    with pytest.raises(ValueError, match=rf"\['{key}'\] are this sampler's own processing.*lk.Sampling"):
        SAMPLER.generate_kwargs(model, **{key: 1})
    assert lk.ground.sampler.remembered_sampler(model) is None  # refused before anything is recorded
