r"""Hugging Face ``transformers`` glue: response log-probs, EOS masks, and the reference for free.

What every user of a ``transformers`` causal LM needs between ``model.generate`` and the KL term:

* :func:`response_logits`: the logits that *predict* the response tokens (shifted by one);
* :func:`response_mask`: True on the response up to and including its first EOS;
* :func:`sequence_inputs`: the attention mask and position ids of prompt + response for one
  forward pass that sees what ``generate`` saw (left-padded prompts);
* :func:`response_logprobs`: ``log pi(y_t | x, y_<t)`` of the sampled response, float32, differentiable;
* :func:`adapters_disabled` and :func:`reference_logprobs`: the same log-probs with the LoRA
  adapters switched off and without gradient. With ``peft`` adapters on a frozen base model, the
  base model *is* the reference, so the reference costs no second copy of the weights;
* :func:`sampler_agreement`: the scorer's log-probs against what ``generate`` drew from (its
  processed scores), the check behind ``response_logprobs(..., sampler_scores=out.scores)``;
* :func:`from_hidden` and :func:`logit_transform`: the model's LM head as an
  :class:`lightning_kl.FromHidden`, with the logit scale and the soft cap its config sets (Gemma 2/3's
  ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``).

One :class:`lightning_kl.Sampling` configures both sides: ``model.generate(**sampling.generate_kwargs())``
draws from exactly the distribution that ``response_logprobs(..., sampling=sampling)`` scores. The
model records the sampler it drew with (``sampling.generate_kwargs(model)``), or else the one it was
last scored with: :func:`response_logprobs` and :func:`reference_logprobs` of the same model given no
sampler at all (a scorer that forgot ``sampling=``), or another sampler than the one it drew with (two
copies of a sampler that drifted apart), give a :class:`SamplerMismatchWarning`, once per model,
because the PPO ratio and the KL estimates would then be those of another distribution than the
rollout's.

Notation: ``b`` sequences, ``p`` prompt length (left-padded, the same for every row), ``t`` response
length (``max_new_tokens`` or less), ``V`` vocabulary size. ``sequences = generate(...)`` is
``[b, p + t]``: the prompt block ``sequences[:, :p]`` then the response block ``sequences[:, p:]``.

Nothing here imports ``transformers`` or ``peft``: the functions take the model object you already
have, so the core package does not depend on them (``pip install "lightning-kl[hf]"`` installs both).

Example (a user's ``training_step``; ``batch`` from a rollout with ``model.generate``)::

    sampling = self.sampling   # the lk.Sampling the rollouts were drawn with (generate_kwargs())
    logprobs = lk.hf.response_logprobs(model, batch["sequences"], batch["attention_mask"], p, sampling=sampling)
    ref_logprobs = lk.hf.reference_logprobs(model, batch["sequences"], batch["attention_mask"], p, sampling=sampling)
    loss = policy_loss + self.kl(logprobs, ref_logprobs, batch["mask"])
"""

from __future__ import annotations

import math
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_kl.ground.checks import check_temperature
from lightning_kl.ground.sampler import SamplerMismatchWarning, Sampling, check_processing, remember_sampler, remembered_sampler
from lightning_kl.inputs import check_logit_transform
from lightning_kl.logprobs import FromHidden, token_logprobs

__all__ = [
    "RATIO_BAND",
    "SamplerAgreement",
    "SamplerMismatchWarning",
    "adapters_disabled",
    "from_hidden",
    "logit_transform",
    "reference_logprobs",
    "response_logits",
    "response_logprobs",
    "response_mask",
    "sampler_agreement",
    "sequence_inputs",
]

#: the band of the importance ratio (scorer over sampler) that float noise stays in: what
#: :func:`sampler_agreement` counts outside, and what ``examples/hf_grpo.py`` logs
RATIO_BAND = (0.99, 1.01)
_LEGACY = ("temperature", "top_k", "top_p", "min_p")


def _check_prompt_length(prompt_length: int, seq_len: int, what: str) -> None:
    if isinstance(prompt_length, bool) or not isinstance(prompt_length, int):
        raise TypeError(f"`prompt_length` must be an int, got {type(prompt_length).__name__}.")
    if not 1 <= prompt_length < seq_len:
        raise ValueError(
            f"`prompt_length` must be in [1, {seq_len - 1}] for {what} of length {seq_len} "
            f"(at least one prompt token and one response token), got {prompt_length}."
        )


def _batched_twice(name: str, x: Tensor, dims: int) -> str:
    # a rollout batch that is already batched, given to a DataLoader with its default batch_size=1,
    # comes back with one more leading dimension of size 1
    if x.dim() == dims + 1 and x.shape[0] == 1:
        return (
            f" `{name}` has an extra leading dimension of size 1: a DataLoader with its default batch_size=1 "
            "batches a batch again; give it `batch_size=None` for a dataset whose items are whole batches."
        )
    return ""


def response_logits(logits: Tensor, prompt_length: int) -> Tensor:
    r"""The logits that predict the response tokens: ``logits[:, p - 1 : -1]``.

    A causal LM's output at position ``i`` is the distribution of token ``i + 1``, so the response
    ``sequences[:, p:]`` is predicted by positions ``p - 1 .. p + t - 2``. The result is a view
    (no copy); :func:`lightning_kl.token_logprobs` reads it in place.

    Shapes: ``logits [b, p + t, V]`` (the model's output on ``sequences``) -> ``[b, t, V]``.

    Args:
        logits: the logits of the whole sequences.
        prompt_length: ``p``, the length of the (left-padded) prompt block.

    Raises:
        ValueError: if ``logits`` is not 3-D, or ``prompt_length`` leaves no prompt or no response.

    Example:
        >>> import torch
        >>> logits = torch.arange(5.0).view(1, 5, 1)   # the output at position i holds the value i
        >>> response_logits(logits, prompt_length=3).flatten().tolist()   # predicts tokens 3 and 4
        [2.0, 3.0]
    """
    if logits.dim() != 3:
        raise ValueError(f"`logits` must be [b, p + t, V], got shape {tuple(logits.shape)}.{_batched_twice('logits', logits, 3)}")
    _check_prompt_length(prompt_length, logits.shape[1], "logits")
    return logits[:, prompt_length - 1 : -1]


def _eos_hits(responses: Tensor, eos_token_id: Union[int, Sequence[int], Tensor]) -> Tensor:
    if isinstance(eos_token_id, Tensor) and eos_token_id.dim() <= 1 and not eos_token_id.is_floating_point():
        eos_token_id = eos_token_id.tolist()  # a tensor(2) or tensor([2, 7]) from a tokenizer or config
    ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if not isinstance(ids, (list, tuple)) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"`eos_token_id` must be an int or a non-empty list of ints (or an integer tensor of them), got {eos_token_id!r}.")
    return torch.isin(responses, torch.tensor(ids, device=responses.device))


def response_mask(responses: Tensor, eos_token_id: Union[int, Sequence[int], Tensor]) -> Tensor:
    r"""True on each response's tokens up to and including its first EOS; False after it.

    ``generate`` pads a finished row with ``pad_token_id``, often the EOS id itself: only the
    *first* EOS counts. A row without EOS ran to the length limit and is valid throughout (it ends
    truncated; its reward is the caller's business).

    Shapes: ``responses [b, t]`` (``sequences[:, p:]``) -> bool ``[b, t]``.

    Args:
        responses: the generated tokens after the prompt block.
        eos_token_id: one id or several (``model.generation_config.eos_token_id`` may be a list), as
            ints or as an integer tensor (0-d or 1-d).

    Raises:
        ValueError: if ``responses`` is not 2-D or ``eos_token_id`` is not an int or a list of ints.

    Example:
        >>> import torch
        >>> EOS, PAD = 2, 0
        >>> responses = torch.tensor([[5, 2, 0, 0],     # EOS at 1, then padding
        ...                           [5, 6, 7, 8],     # no EOS: truncated, all valid
        ...                           [2, 2, 2, 2]])    # EOS first; pad_token_id == eos_token_id
        >>> response_mask(responses, EOS).int().tolist()
        [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    """
    if responses.dim() != 2:
        raise ValueError(f"`responses` must be [b, t], got shape {tuple(responses.shape)}.{_batched_twice('responses', responses, 2)}")
    hit = _eos_hits(responses, eos_token_id)
    # EOS seen strictly before position i: the cumulative count minus the hit at i itself
    before = hit.cumsum(-1) - hit.long()
    return before == 0


def sequence_inputs(prompt_attention_mask: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    r"""The attention mask and position ids of ``prompt + response`` for one forward pass.

    Left padding shifts every row's tokens right; ``generate`` numbers positions from each row's
    first real token (``attention_mask.cumsum(-1) - 1``), and a forward pass over the whole
    sequences must do the same, or models with absolute positions (GPT-2, OPT) score tokens at the
    wrong positions. Response tokens after the first EOS are masked out.

    Shapes: ``prompt_attention_mask [b, p]`` (the tokenizer's, 1 on real tokens), ``mask [b, t]``
    (:func:`response_mask`) -> ``attention_mask [b, p + t]`` (long), ``position_ids [b, p + t]``
    (long; 0 on left padding).

    Raises:
        ValueError: if the two masks are not 2-D with the same number of rows.

    Example:
        >>> import torch
        >>> prompt_am = torch.tensor([[0, 1, 1], [1, 1, 1]])        # row 0 is left-padded
        >>> mask = torch.tensor([[True, False], [True, True]])     # row 0 ended at its first token
        >>> am, pos = sequence_inputs(prompt_am, mask)
        >>> am.tolist(), pos.tolist()
        ([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]], [[0, 0, 1, 2, 2], [0, 1, 2, 3, 4]])
    """
    if prompt_attention_mask.dim() != 2 or mask.dim() != 2 or prompt_attention_mask.shape[0] != mask.shape[0]:
        raise ValueError(
            f"`prompt_attention_mask` [b, p] and `mask` [b, t] must be 2-D with the same b, got shapes "
            f"{tuple(prompt_attention_mask.shape)} and {tuple(mask.shape)}.{_batched_twice('mask', mask, 2)}"
        )
    attention_mask = torch.cat([prompt_attention_mask.long(), mask.long()], dim=-1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return attention_mask, position_ids


def response_logprobs(
    model: Any,
    sequences: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    temperature: Optional[float] = None,
    return_logits: bool = False,
    *,
    sampling: Optional[Sampling] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    kept_from: Optional[Tensor] = None,
    outside: str = "raise",
    sampler_scores: Union[Sequence[Tensor], Tensor, None] = None,
    kept: Any = None,
    return_kept: bool = False,
) -> Any:
    r"""Log-probs of the response tokens under ``model``: one forward pass, float32, differentiable.

    .. math::
        \log \pi(y_t \mid x, y_{<t}) = \log \mathrm{softmax}(z_{p + t - 1} / T)[y_t]

    The position ids come from ``attention_mask`` as :func:`sequence_inputs` makes them, so the
    log-probs are those ``generate`` sampled from (left padding included). Only the last ``t + 1``
    positions go through the LM head when the model takes ``logits_to_keep`` (recent
    ``transformers``). Log-probs come from :func:`lightning_kl.token_logprobs`: float32 for
    bf16/fp16 models, float64 for float64 ones. Positions after EOS hold the log-probs of padding
    tokens: mask them with :func:`response_mask`. The model's mode is left as it is: in train mode,
    dropout (``lora_dropout`` too) makes the log-probs random, so score rollouts in eval mode, as
    ``generate`` samples them.

    Shapes: ``sequences [b, p + t]``, ``attention_mask [b, p + t]`` -> ``[b, t]`` (and the response
    logits ``[b, t, V]``, a view of the model's output, with ``return_logits=True``).

    Args:
        model: a causal LM (``transformers`` ``PreTrainedModel`` or ``peft`` ``PeftModel``) whose
            forward takes ``input_ids``, ``attention_mask``, ``position_ids`` and returns ``.logits``.
        sequences: prompt block then response block, as ``generate`` returns them.
        attention_mask: from :func:`sequence_inputs` (1 on the prompt's real tokens and the valid response).
        prompt_length: ``p``.
        temperature: deprecated: ``sampling=lk.Sampling(temperature=T)`` (a ``DeprecationWarning``).
        return_logits: also return the response logits (for the ``full`` estimator or the exact KL).
        sampling: the sampler (:class:`lightning_kl.Sampling`), the one whose ``generate_kwargs()``
            drew the tokens: the log-probs of its tempered, truncated, renormalized distribution
            (:func:`lightning_kl.token_logprobs` with ``sampling=``); None: the plain softmax. With a
            truncating sampler, response positions outside ``attention_mask`` (after EOS: not
            sampled) get 0. The model records it (unless it drew with a sampler:
            ``sampling.generate_kwargs(model)`` records that one). A call on a model that drew with
            another sampler, or with no sampler on a model whose record is not the plain softmax, warns
            (:class:`SamplerMismatchWarning`, once per model): give every scorer of a rollout the
            rollout's ``sampling=``.
        top_k, top_p, min_p: deprecated: ``sampling=lk.Sampling(top_k=..., top_p=..., min_p=...)``
            (a ``DeprecationWarning``).
        kept_from: optional ``[b, t, V]`` response logits of the policy: the kept set is the
            policy's (a reference renormalized on the policy's kept set).
        outside: a sampled token outside the kept set: ``"raise"``, ``"-inf"`` or, for rollouts
            reused off-policy (PPO epochs > 1, mini-batches, stale rollouts), ``"extend"``
            (:func:`lightning_kl.token_logprobs` with ``sampling=``; ``docs/sampling.md``).
        sampler_scores: opt-in check of the scorer against the sampler: ``generate``'s processed
            scores of these sequences (``out.scores`` of ``generate(..., output_scores=True,
            return_dict_in_generate=True)``, ``t`` tensors ``[b, V]``, or one ``[b, t, V]``). The
            log-probs are compared with them on the valid response tokens (:func:`sampler_agreement`,
            one host read) and a :class:`SamplerMismatchWarning` with the figures is given, once per
            model, when they disagree beyond float noise: the mean ratio off 1 by more than ``1e-3``,
            or more than 1% of the tokens outside ``[0.99, 1.01]``.
        kept: replay: the response positions' kept sets recorded at rollout time (``[b, t]``: from
            ``return_kept=True`` on the rollout, or ``KeptSets.from_scores(out.scores)`` of ``generate``'s
            processed scores): the log-probs of the current model renormalized on them
            (:func:`lightning_kl.token_logprobs` with ``kept=``), finite off-policy. Positions after EOS
            are not scored (0) and may hold any set.
        return_kept: also return the kept sets of the response positions (``[b, t]``, empty after EOS;
            None without truncation), last in the returned tuple.

    Raises:
        ValueError: if ``sequences`` and ``attention_mask`` differ in shape, ``prompt_length`` is
            out of range, ``temperature`` is not a finite number > 0 or a processing value is out of
            range, ``sampling`` is given with the separate keywords, or ``sampler_scores`` does not
            match the responses' shape (before the forward pass); a sampled token outside the kept set
            (``outside="raise"``).
    """
    if sequences.dim() != 2 or attention_mask.shape != sequences.shape:
        hint = _batched_twice("sequences", sequences, 2) or (" They must be 2-D." if attention_mask.shape == sequences.shape else "")
        raise ValueError(
            f"`sequences` and `attention_mask` must both be [b, p + t], got shapes {tuple(sequences.shape)} "
            f"and {tuple(attention_mask.shape)}.{hint}"
        )
    _check_prompt_length(prompt_length, sequences.shape[1], "sequences")
    sampling = _resolve_sampling(sampling, {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p},
                                 "response_logprobs")
    _check_sampler(model, sampling, "response_logprobs")
    return _score(model, sequences, attention_mask, prompt_length, sampling, return_logits, kept_from, outside,
                  sampler_scores, remember=True, kept=kept, return_kept=return_kept)


def _resolve_sampling(sampling: Optional[Sampling], separate: dict[str, Any], call: str) -> Optional[Sampling]:
    """``sampling=``, or (deprecated, with a warning naming it) the sampler of the separate keywords; None: none given."""
    legacy = {k: v for k, v in separate.items() if v is not None}
    if sampling is not None:
        if not isinstance(sampling, Sampling):
            raise TypeError(f"`sampling` must be a lightning_kl.Sampling, got {type(sampling).__name__}.")
        given = {k: v for k, v in legacy.items() if not (k == "temperature" and v == 1.0)}
        if given:
            raise ValueError(
                f"give the sampler as `sampling=` or as the separate keywords, not both: got sampling={sampling} "
                f"and {given}."
            )
        return sampling
    if not legacy:
        return None
    check_temperature(legacy.get("temperature", 1.0))  # a bad value fails as before, naming the value
    check_processing(1.0, legacy.get("top_k"), legacy.get("top_p"), legacy.get("min_p"))
    warnings.warn(
        f"lk.hf.{call}({', '.join(f'{k}=' for k in legacy)}...) is deprecated: pass "
        f"sampling=lk.Sampling({', '.join(f'{k}={v!r}' for k, v in legacy.items())}).",
        DeprecationWarning,
        stacklevel=3,
    )
    return Sampling(**legacy)


_warned_unsampled: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _check_sampler(model: Any, sampling: Optional[Sampling], call: str) -> None:
    """Warn (once per model) when ``model`` is scored with no sampler, or with another one than it drew with.

    The record is the sampler the model drew with (``Sampling.generate_kwargs(model)``), or, for a model
    that never drew with one, the one :func:`response_logprobs` last scored it with: that one is only
    compared with no sampler at all (a model scored with several samplers in turn, e.g. a schedule of
    temperatures, is not warned about)."""
    record = remembered_sampler(model)
    if record is None:
        return
    recorded, drawn = record
    if sampling is None and recorded == Sampling():
        return
    if sampling is not None and (sampling == recorded or not drawn):
        return
    try:
        if model in _warned_unsampled:
            return
        _warned_unsampled.add(model)
    except TypeError:  # a model object that takes no weak reference: nothing is remembered
        return
    how = "sampled with" if drawn else "scored before with"
    if sampling is None:
        what = f"lk.hf.{call} was given no sampler, so it scores the plain softmax"
        fix = "(sampling=lk.Sampling() to mean the plain softmax)"
    else:
        what = f"lk.hf.{call} was given sampling={sampling}"
        fix = ("(one lk.Sampling object for generate and every scorer; from YAML, link the copies: "
               "docs/sampling.md, 'One sampler in a YAML file')")
    warnings.warn(
        f"{what}, but this model was {how} sampling={recorded} (the rollout's sampler, presumably): the PPO ratio "
        f"and the KL estimates would compare two distributions (the ratio is not 1 on-policy) and nothing else "
        f"would say so. Give every scorer of a rollout the rollout's sampling= {fix}. Warned once for this model.",
        SamplerMismatchWarning,
        stacklevel=3,
    )


def _score(model: Any, sequences: Tensor, attention_mask: Tensor, prompt_length: int, sampling: Optional[Sampling],
           return_logits: bool, kept_from: Optional[Tensor], outside: str, sampler_scores: Any, remember: bool,
           kept: Any = None, return_kept: bool = False) -> Any:
    if remember and sampling is not None:
        remember_sampler(model, sampling)
    if sampling is None:
        sampling = Sampling()
    temperature, top_k, top_p, min_p = sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
    temperature = check_temperature(temperature)  # before the forward pass, not after it
    processed = check_processing(temperature, top_k, top_p, min_p).truncates or kept_from is not None or kept is not None
    t = sequences.shape[1] - prompt_length
    if sampler_scores is not None:
        sampler_scores = _checked_scores(sampler_scores, sequences.shape[0], t)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=t + 1, use_cache=False)
    logits = out.logits
    # logits_to_keep=t+1 keeps the last t+1 positions; a model that ignores it returns all of them
    logits = response_logits(logits, logits.shape[1] - t)
    # chunked and exact, with no float32 copy of the logits (bf16 models): lk.token_logprobs
    if processed:
        # positions after EOS were not sampled: the sampler's kept set says nothing about them
        tokens = sequences[:, prompt_length:].masked_fill(attention_mask[:, prompt_length:] == 0, -100)
        logprobs = token_logprobs(logits, tokens, sampling=sampling, ignore_index=-100, outside=outside, kept_from=kept_from,
                                  kept=kept, return_kept=return_kept)
    else:
        logprobs = token_logprobs(logits, sequences[:, prompt_length:], sampling=sampling, return_kept=return_kept)
    logprobs, recorded = logprobs if return_kept else (logprobs, None)
    if sampler_scores is not None:
        _check_against_sampler(model, logprobs, sampler_scores, sequences[:, prompt_length:],
                               attention_mask[:, prompt_length:] != 0)
    if not (return_logits or return_kept):
        return logprobs
    return (logprobs,) + ((logits,) if return_logits else ()) + ((recorded,) if return_kept else ())


class SamplerAgreement(NamedTuple):
    """The importance ratio of the scorer over the sampler on the valid response tokens."""

    mean_ratio: float
    """The mean of ``exp(logprob - sampler_logprob)`` (1 when the scorer is the sampler)."""
    share_outside: float
    """The share of the tokens whose ratio is outside ``[0.99, 1.01]``."""
    tokens: int
    """How many tokens were compared."""

    @property
    def agrees(self) -> bool:
        """Within float noise: the mean ratio within ``1e-3`` of 1 and at most 1% of the tokens outside the band."""
        return self.tokens == 0 or (abs(self.mean_ratio - 1) <= 1e-3 and self.share_outside <= 0.01)


def _checked_scores(scores: Union[Sequence[Tensor], Tensor], b: int, t: int) -> Union[Sequence[Tensor], Tensor]:
    expected = f"`sampler_scores` must be generate's scores of these sequences: {t} tensors [b={b}, V] (out.scores) or one [b={b}, t={t}, V]"
    if isinstance(scores, Tensor):
        if scores.dim() != 3 or scores.shape[:2] != (b, t):
            raise ValueError(f"{expected}, got a tensor of shape {tuple(scores.shape)}.")
        return scores
    shapes = [tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__ for x in scores]
    if len(shapes) != t or any(shape != shapes[0] or not isinstance(shape, tuple) or len(shape) != 2 or shape[0] != b
                               for shape in shapes):
        shown = shapes[:3] + (["..."] if len(shapes) > 3 else [])
        raise ValueError(f"{expected}, got {len(shapes)} of shapes {shown}.")
    return scores


@torch.no_grad()
def sampler_agreement(
    logprobs: Tensor, sampler_scores: Union[Sequence[Tensor], Tensor], responses: Tensor, mask: Tensor
) -> SamplerAgreement:
    r"""How far the scorer's log-probs are from the distribution ``generate`` drew the responses from.

    The ratio ``exp(logprobs - log_softmax(scores)[y])`` at every valid response token, with
    ``scores`` ``generate``'s processed scores (``output_scores=True``): 1 up to float noise when the
    scorer scores the sampler's distribution. A processor the scorer does not know about (a
    ``generation_config``'s ``top_k=50``, another temperature, a repetition penalty) moves it. One step
    at a time (no ``[b, t, V]`` copy); one host read.

    Shapes: ``logprobs [b, t]``, ``sampler_scores`` ``t`` tensors ``[b, V]`` (``out.scores``) or one
    ``[b, t, V]``, ``responses [b, t]`` (``sequences[:, p:]``), ``mask [b, t]`` (bool,
    :func:`response_mask`).

    Example:
        >>> import torch
        >>> scores = [torch.tensor([[0.0, 0.0, -float("inf")]])] * 2   # generate kept tokens 0 and 1
        >>> tokens, mask = torch.tensor([[0, 1]]), torch.tensor([[True, True]])
        >>> sampler_agreement(torch.full((1, 2), -0.6931472), scores, tokens, mask).agrees   # log 1/2
        True
        >>> a = sampler_agreement(torch.full((1, 2), -1.0986123), scores, tokens, mask)     # log 1/3
        >>> round(a.mean_ratio, 4), a.share_outside, a.agrees
        (0.6667, 1.0, False)
    """
    b, t = responses.shape
    scores = _checked_scores(sampler_scores, b, t)
    if logprobs.shape != responses.shape or mask.shape != responses.shape:
        raise ValueError(
            f"`logprobs`, `responses` and `mask` must all be [b, t], got shapes {tuple(logprobs.shape)}, "
            f"{tuple(responses.shape)} and {tuple(mask.shape)}."
        )
    steps = [scores[:, i] if isinstance(scores, Tensor) else scores[i] for i in range(t)]
    drawn = torch.stack([
        torch.log_softmax(step.double(), -1).gather(-1, responses[:, i : i + 1].clamp(0, step.shape[-1] - 1).to(step.device))[:, 0]
        for i, step in enumerate(steps)
    ], 1).to(logprobs.device) if t else logprobs.new_zeros(b, 0)
    mask = mask.to(logprobs.device).bool()
    ratio = torch.exp(logprobs.detach().double() - drawn.double())[mask]
    n = int(ratio.numel())
    if n == 0:
        return SamplerAgreement(1.0, 0.0, 0)
    lo, hi = RATIO_BAND
    figures = torch.stack([ratio.mean(), ((ratio < lo) | (ratio > hi)).double().mean()]).tolist()
    return SamplerAgreement(float(figures[0]), float(figures[1]), n)


_warned_models: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _check_against_sampler(model: Any, logprobs: Tensor, scores: Any, responses: Tensor, mask: Tensor) -> None:
    try:
        if model in _warned_models:
            return
    except TypeError:  # a model object that takes no weak reference: warned at each disagreement
        pass
    agreement = sampler_agreement(logprobs, scores, responses, mask)
    if agreement.agrees:
        return
    try:
        _warned_models.add(model)
    except TypeError:
        pass
    ratio = "nan" if math.isnan(agreement.mean_ratio) else f"{agreement.mean_ratio:.4f}"
    warnings.warn(
        f"lk.hf.response_logprobs: the scored log-probs are not those of the distribution generate drew from "
        f"(sampler_scores=): mean ratio {ratio}, {agreement.share_outside:.1%} of {agreement.tokens} response "
        f"tokens outside [{RATIO_BAND[0]}, {RATIO_BAND[1]}]. Sample with model.generate(**sampling.generate_kwargs()) and score with "
        f"the same sampling= (a model's generation_config can add top_k=50, a repetition penalty, another "
        f"temperature). Warned once for this model.",
        SamplerMismatchWarning,
        stacklevel=4,
    )


@contextmanager
def adapters_disabled(model: Any) -> Iterator[Any]:
    r"""A context in which ``model`` runs without its adapters: the base model, i.e. the reference.

    Works for a ``peft`` ``PeftModel`` (its ``disable_adapter()`` context) and for a
    ``transformers`` model with adapters loaded through its peft integration
    (``disable_adapters()`` / ``enable_adapters()``). The adapters are back on when the context
    exits, also on an exception.

    Raises:
        TypeError: if ``model`` has no adapters to switch off (a plain model is not its own reference:
            keep a frozen copy and call :func:`response_logprobs` on it under ``torch.no_grad()``).
    """
    if callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config"):
        with model.disable_adapter():
            yield model
        return
    if getattr(model, "_hf_peft_config_loaded", False):
        model.disable_adapters()
        try:
            yield model
        finally:
            model.enable_adapters()
        return
    raise TypeError(
        f"{type(model).__name__} has no adapters to disable: pass a peft PeftModel (peft.get_peft_model) "
        "or a transformers model with adapters loaded (model.add_adapter / load_adapter)."
    )


@torch.no_grad()
def reference_logprobs(
    model: Any,
    sequences: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    temperature: Optional[float] = None,
    return_logits: bool = False,
    *,
    sampling: Optional[Sampling] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    kept_from: Optional[Tensor] = None,
    outside: str = "raise",
    kept: Any = None,
    **unexpected: Any,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    r"""The reference's log-probs of the response: ``model`` with its adapters off, without gradient.

    With LoRA adapters trained on a frozen base model, the reference is the base model, and this is
    its log-probs at no extra parameter memory (TRL does the same). The activations of this forward
    pass are not kept (``torch.no_grad``). Arguments, shapes and errors as :func:`response_logprobs`;
    :func:`adapters_disabled` raises ``TypeError`` for a model without adapters.

    Give it the rollout's ``sampling=``, as to :func:`response_logprobs`: given none, or another sampler
    than the one the model drew with (``sampling.generate_kwargs(model)``), it warns as
    :func:`response_logprobs` does (:class:`SamplerMismatchWarning`, once per model; it records
    nothing itself). The reference did not sample,
    so only the sampler's temperature applies to it: the log-probs of the reference's softmax at that
    temperature (what verl and TRL score, and ``reference="unprocessed"`` of
    :func:`lightning_kl.full_kl`). A truncating sampler's kept set is the *policy's*: the reference's
    own top-k or top-p set would give a sampled token that the reference's processing removes a
    log-prob of :math:`-\infty`, an infinite KL term. With ``kept_from=`` (the policy's response
    logits) the reference is renormalized on the policy's kept set instead (``reference="policy_kept"``);
    with ``kept=`` (the rollout's record, as :func:`response_logprobs` takes it) on the recorded sets.

    ``sampler_scores`` is refused: the reference is not the sampler (check the policy's log-probs).

    Example (``logprobs, logits = lk.hf.response_logprobs(policy, seq, am, p, sampling=s, return_logits=True)``)::

        ref = lk.hf.reference_logprobs(policy, seq, am, p, sampling=s)                     # softmax(z_ref / T)
        ref = lk.hf.reference_logprobs(policy, seq, am, p, sampling=s, kept_from=logits)   # on the policy's kept set
    """
    if "sampler_scores" in unexpected:
        raise TypeError(
            "`sampler_scores` checks the sampling policy's log-probs: give it to lk.hf.response_logprobs, "
            "not to reference_logprobs (the reference did not draw the tokens)."
        )
    if unexpected:
        raise TypeError(f"reference_logprobs() got unexpected keyword argument(s) {sorted(unexpected)}.")
    sampling = _resolve_sampling(sampling, {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p},
                                 "reference_logprobs")
    _check_sampler(model, sampling, "reference_logprobs")
    if sampling is not None and kept_from is None and kept is None and sampling.truncates:
        sampling = Sampling(temperature=sampling.temperature)  # the reference's softmax at the sampler's temperature
    with adapters_disabled(model):
        return _score(model, sequences, attention_mask, prompt_length, sampling, return_logits, kept_from, outside,
                      None, remember=False, kept=kept)


# ---------------------------------------------------------------------------------------------
# the LM head as lk.FromHidden, with what the model does to its logits

#: ``model_type`` prefixes whose forward multiplies the logits by ``config.logit_scale`` (Cohere, Command R)
_MULTIPLY_BY_LOGIT_SCALE = ("cohere",)
#: ``model_type`` prefixes whose forward divides the logits by ``config.logits_scaling`` (Granite)
_DIVIDE_BY_LOGITS_SCALING = ("granite",)


def logit_transform(model: Any) -> dict[str, Optional[float]]:
    r"""The logit scale and the soft cap that ``model``'s forward applies to its LM head's output.

    ``{"logit_scale": s, "softcap": c}``, read from the (text) config of a ``transformers`` model (or
    a config), to pass on: ``lk.FromHidden(hidden, weight, **lk.hf.logit_transform(model))`` gives
    the model's own logits :math:`c \tanh(s\,(h W^T + b) / c)`. Read as the models apply them
    (``transformers`` 5): ``final_logit_softcapping`` of any model is :math:`c` (Gemma 2, Gemma 3 and
    every model that copies their forward); ``logit_scale`` of a Cohere model multiplies the logits;
    ``logits_scaling`` of a Granite model divides them (:math:`s = 1 / \texttt{logits\_scaling}`).

    Raises:
        ValueError: for a config that sets ``logit_scale`` or ``logits_scaling`` (other than 1) on a
            model type this function does not know: models apply them differently (HyperCLOVA X
            multiplies by ``logits_scaling``, MiniCPM3 divides its hidden states, MPT's forward ignores
            ``logit_scale``), and a guess would give other logits than the model's, silently. Read the
            model's forward and pass ``lk.FromHidden(..., logit_scale=, softcap=)`` yourself.
        TypeError, ValueError: for values that :class:`lightning_kl.FromHidden` refuses.

    Example:
        >>> from types import SimpleNamespace
        >>> logit_transform(SimpleNamespace(model_type="gemma2", final_logit_softcapping=30.0))
        {'logit_scale': 1.0, 'softcap': 30.0}
    """
    config = getattr(model, "config", model)
    if callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config(decoder=True)  # a vision-language model's text side
    kind = str(getattr(config, "model_type", "") or "")
    softcap = getattr(config, "final_logit_softcapping", None)
    scale: Any = 1.0
    for attr, known, how in (
        ("logit_scale", _MULTIPLY_BY_LOGIT_SCALE, lambda v: v),
        ("logits_scaling", _DIVIDE_BY_LOGITS_SCALING, lambda v: 1.0 / v),
    ):
        value = getattr(config, attr, None)
        if value is None:
            continue
        if kind.startswith(known):
            scale = how(value)
        elif value != 1:
            raise ValueError(
                f"the config of model type {kind!r} sets {attr}={value!r}, which lk.hf does not know how this model "
                f"applies (it reads {attr} for model types {list(known)}): pass "
                "lk.FromHidden(hidden, weight, bias, logit_scale=..., softcap=...) as the model's forward makes its logits."
            )
    logit_scale, cap = check_logit_transform(scale, softcap)
    return {"logit_scale": logit_scale, "softcap": cap}


def from_hidden(model: Any, hidden: Tensor) -> FromHidden:
    r"""``model``'s LM head applied to ``hidden`` as an :class:`lightning_kl.FromHidden`: the output
    embeddings' weight and bias, and :func:`logit_transform`'s scale and cap.

    ``hidden`` ``[..., d]``: the last hidden states, after the final norm (``output_hidden_states=True``
    gives them as ``out.hidden_states[-1]``), shifted as the logits would be. Then
    ``lk.token_logprobs(lk.hf.from_hidden(model, hidden), tokens)`` are the log-probs of the model's
    own logits, with no ``[..., V]`` tensor made. Under FSDP2 (a sharded head) or tensor parallelism (a
    column-parallel head), build ``lk.FromHidden(hidden, weight, **lk.hf.logit_transform(model))`` with
    the unsharded weight or an :class:`lightning_kl.VocabShard` instead.

    Raises:
        TypeError: if ``model`` has no output embeddings (``get_output_embeddings()``) with a ``weight``.
        ValueError: as :func:`logit_transform`.
    """
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None or not isinstance(getattr(head, "weight", None), Tensor):
        raise TypeError(
            f"{type(model).__name__} has no LM head to read (`get_output_embeddings()` with a `weight`): pass "
            "lk.FromHidden(hidden, weight, bias, **lk.hf.logit_transform(model)) with the head's tensors."
        )
    return FromHidden(hidden, head.weight, getattr(head, "bias", None), **logit_transform(model))
