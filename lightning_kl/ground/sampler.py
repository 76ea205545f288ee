r"""The sampler, in one module: ``Sampling``, its processing (temperature, top-k, top-p, min-p) as one validated
object, and the kept set it draws from (:func:`process_scores`).

The same object configures the sampler (``model.generate(**sampling.generate_kwargs())``), the scorer
(``lk.token_logprobs(..., sampling=sampling)``, ``lk.hf``) and the loss
(``lk.KLPenaltyLoss("full", sampling=sampling)``), so that what was drawn is what is scored.

Notation: ``n`` tokens (flattened leading dims), ``V`` the vocabulary, :math:`z` one token's logits,
:math:`T` the temperature. A sampler that processes the logits draws from

.. math::
    \tilde p_i = \frac{[i \in K]\, e^{z_i / T}}{\sum_{j \in K} e^{z_j / T}}, \qquad
    \log \tilde p_y = \frac{z_y}{T} - \operatorname{lse}_{j \in K}\Big(\frac{z_j}{T}\Big)

where the kept set :math:`K` is chosen by :func:`process_scores`, which applies the processors in
the order and with the tie rules of ``transformers``' ``generate`` (temperature, then top-k, then
top-p, then min-p; each one sees the scores the previous one left, with ``-inf`` on what it removed):

* top-k keeps every token whose score is ``>=`` the k-th largest (ties at the boundary are all kept);
* top-p sorts the scores ascending (``torch.sort``), and removes the tokens whose cumulative
  probability, summed from the least likely, is ``<= 1 - top_p``; the most likely token is always kept;
* min-p removes the tokens with probability ``< min_p`` times the largest probability.

The kept set is a selection: it does not move under a small change of the logits, so the gradient
flows through the kept tokens' logits and the normalizer only,

.. math::
    \frac{\partial \log \tilde p_y}{\partial z_i} = \frac{[i = y] - [i \in K]\, \tilde p_i}{T}.

The kept set's log-probs, the KL and the entropy of this distribution are computed chunk by chunk in
:mod:`lightning_kl.kernels.engine`.
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_kl.ground.checks import check_temperature

__all__ = ["Sampling", "SamplerMismatchWarning", "check_processing", "process_scores"]


@dataclass(frozen=True)
class Sampling:
    r"""A sampler's processing of the logits, in ``generate``'s order: temperature, top-k, top-p, min-p.

    A sampler that processes the logits ``z`` draws token ``y`` with probability
    :math:`\tilde p_y = [y \in K]\, e^{z_y / T} / \sum_{j \in K} e^{z_j / T}`, where the kept set ``K`` is
    chosen as ``transformers``' warpers choose it (ties and rounding included).

    Neutral values turn a processor off, as in ``generate``: ``top_k`` None or 0, ``top_p`` None or 1,
    ``min_p`` None or 0; the object then holds None for it (so equal samplers compare equal).

    Args:
        temperature: ``T > 0`` (finite).
        top_k: an integer ``>= 0``, or None.
        top_p: a number in ``[0, 1]``, or None. ``top_p=0`` keeps only the most likely token.
        min_p: a number in ``[0, 1]``, or None.

    Raises:
        ValueError: at construction, naming the bad value and the valid range.

    Example:
        >>> s = Sampling(temperature=0.7, top_p=0.9, top_k=0)
        >>> s
        Sampling(temperature=0.7, top_k=None, top_p=0.9, min_p=None)
        >>> s.truncates
        True
        >>> Sampling().generate_kwargs()["top_k"]  # off explicitly: generation_config's top_k=50 cannot slip in
        0
    """

    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None

    def __post_init__(self) -> None:
        temperature = check_temperature(self.temperature)
        top_k, top_p, min_p = self.top_k, self.top_p, self.min_p
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise ValueError(f"`top_k` must be an integer >= 0 (0 or None: no top-k), got {top_k!r}.")
        for name, value in (("top_p", top_p), ("min_p", min_p)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= 1
            ):
                raise ValueError(f"`{name}` must be a number in [0, 1] or None, got {value!r}.")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_k", int(top_k) if top_k else None)
        object.__setattr__(self, "top_p", None if top_p is None or top_p == 1 else float(top_p))
        object.__setattr__(self, "min_p", None if min_p is None or min_p == 0 else float(min_p))

    @property
    def truncates(self) -> bool:
        """Whether a token can be removed (the kept set may be smaller than the vocabulary)."""
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    def as_dict(self) -> dict[str, Any]:
        """The four settings by name (for messages and logs)."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}

    def generate_kwargs(self, model: Any = None, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``model.generate`` that sample from exactly this distribution.

        ``do_sample=True``, this object's four settings, and every other setting of ``generate`` that
        changes what is drawn set to its neutral value explicitly. ``generate`` fills what its caller
        leaves out from the model's ``generation_config`` (``generation_config.json``), then from its
        global defaults (``top_k=50``); an explicit keyword wins over both, ``None`` included. So a
        checkpoint's ``top_k``, ``typical_p``, repetition penalty, banned or suppressed tokens, minimum
        length (which bans EOS), forced tokens, sequence bias, classifier-free guidance, watermark or
        DoLa layers cannot change the distribution behind the scorer's back. Speculative decoding stays
        possible (it is exact), but not its lossy ensemble weight.

        Not covered: a ``logits_processor=`` or ``prefix_allowed_tokens_fn=`` of the caller's own.
        Length keywords (``max_new_tokens``) and the ids (``pad_token_id``, ``eos_token_id``) are the
        caller's: they end a response, they do not change the distribution of its tokens; pass them
        to ``generate`` or here.

        A keyword of your own wins: ``generate_kwargs(model, min_new_tokens=4)`` gives ``min_new_tokens=4``
        (passing it to ``generate`` beside ``**generate_kwargs()`` would be a ``TypeError: got multiple
        values``). One of the settings set here to its neutral value, given another value, makes
        ``generate`` draw from another distribution than this object's (``min_new_tokens`` bans EOS,
        ``repetition_penalty`` reweighs), which no scorer models: that gives a
        :class:`SamplerMismatchWarning` naming it. The processing itself (``temperature``, ``top_k``,
        ``top_p``, ``min_p``, ``do_sample``, ``num_beams``) is this object's: giving it here is a
        ``ValueError`` (build the ``Sampling`` with it).

        Args:
            model: optional, the model that will ``generate`` (or its ``GenerationConfig``): the
                settings its ``transformers`` version does not know are left out (an older version
                has no such processor, and would refuse the unknown keyword). Without it, every
                setting of ``transformers`` 5 is given. The model records this sampler: the scorers
                of :mod:`lightning_kl.hf` warn when they later score this model with no sampler or
                with another one (:class:`SamplerMismatchWarning`).
            overrides: keywords of your own for ``generate``, given as they are (they win).

        Raises:
            ValueError: for an override of the processing (named), before anything is recorded.
        """
        own = sorted(set(overrides) & set(_PROCESSING))
        if own:
            raise ValueError(
                f"{own} are this sampler's own processing, not overrides: build the lk.Sampling with them "
                f"(lk.Sampling(temperature=, top_k=, top_p=, min_p=)), so that the scorers given it score what "
                f"generate draws; got {', '.join(f'{k}={overrides[k]!r}' for k in own)} for {self}."
            )
        if model is not None:
            remember_sampler(model, self, drawn=True)
        kwargs = {
            "do_sample": True,
            "num_beams": 1,
            # this object's processing, in generate's order
            "temperature": self.temperature,
            "top_k": 0 if self.top_k is None else self.top_k,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "min_p": self.min_p,
            # the other warpers (applied with do_sample)
            "top_h": None,
            "typical_p": 1.0,
            "epsilon_cutoff": 0.0,
            "eta_cutoff": 0.0,
            # the logits processors (applied in every mode)
            "repetition_penalty": 1.0,
            "encoder_repetition_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "encoder_no_repeat_ngram_size": 0,
            "bad_words_ids": None,
            "sequence_bias": None,
            "suppress_tokens": None,
            "begin_suppress_tokens": None,
            "min_length": 0,
            "min_new_tokens": None,
            "forced_bos_token_id": None,
            "forced_eos_token_id": None,
            "exponential_decay_length_penalty": None,
            "remove_invalid_values": False,
            "guidance_scale": None,
            "watermarking_config": None,
            # other decoding modes
            "constraints": None,
            "force_words_ids": None,
            "dola_layers": None,
            "assistant_ensemble_weight": None,
        }
        changed = sorted(k for k, v in overrides.items() if k in kwargs and not _same(v, kwargs[k]))
        if changed:
            warnings.warn(
                f"Sampling.generate_kwargs: {', '.join(f'{k}={overrides[k]!r}' for k in changed)} (neutral: "
                f"{', '.join(f'{k}={kwargs[k]!r}' for k in changed)}) makes generate draw from another distribution "
                f"than {self}, which the scorers given this sampling= do not model: the PPO ratio and the KL "
                f"estimates are then those of another distribution than the rollout's.",
                SamplerMismatchWarning,
                stacklevel=2,
            )
        config = getattr(model, "generation_config", model)
        if config is not None:
            kwargs = {k: v for k, v in kwargs.items() if hasattr(config, k)}
        return {**kwargs, **overrides}


#: the keywords of ``generate`` that are a :class:`Sampling`'s own processing (not overridable)
_PROCESSING = ("do_sample", "num_beams", "temperature", "top_k", "top_p", "min_p")


def _same(a: Any, b: Any) -> bool:
    """``a`` is the neutral value ``b`` (None, a bool or a number; anything else is another value)."""
    if a is None or b is None or isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b


class SamplerMismatchWarning(UserWarning):
    """The scorer's log-probs are not those of the distribution ``generate`` drew from."""


def check_processing(temperature: Any = 1.0, top_k: Any = None, top_p: Any = None, min_p: Any = None) -> Sampling:
    """Validate the sampler's processing, with ``generate``'s names and neutral values (see :class:`Sampling`).

    Raises:
        ValueError: naming the bad value and the valid range.
    """
    return Sampling(temperature, top_k, top_p, min_p)


def process_scores(scores: Tensor, proc: Sampling) -> Tensor:
    """``generate``'s top-k, top-p and min-p on tempered scores ``[..., V]``: removed entries -> ``-inf``.

    The same ops as ``transformers``' ``TopKLogitsWarper``, ``TopPLogitsWarper`` and
    ``MinPLogitsWarper`` (``min_tokens_to_keep=1``, sampling without beams), in that order, so that
    on the same scores the same tokens are kept, ties and rounding included. Returns a new tensor.
    """
    ninf = float("-inf")
    if proc.top_k is not None:
        k = min(proc.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], ninf)
    if proc.top_p is not None:
        sorted_scores, order = torch.sort(scores, descending=False)
        remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - proc.top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(-1, order, remove), ninf)
    if proc.min_p is not None:
        probs = torch.softmax(scores, dim=-1)
        remove = probs < proc.min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        scores = scores.masked_fill(remove, ninf)
    return scores


# the sampler each model last drew with (generate_kwargs(model), drawn=True) or, when it never drew with
# one, was scored with (lk.hf.response_logprobs, drawn=False)
_samplers: "weakref.WeakKeyDictionary[Any, tuple[Sampling, bool]]" = weakref.WeakKeyDictionary()


def remember_sampler(model: Any, sampling: Sampling, drawn: bool = False) -> None:
    """Record ``sampling`` as the sampler of ``model``: ``drawn`` (``generate_kwargs(model)``) always; a
    scorer's (``drawn=False``) only where no draw is recorded. Nothing for an object that takes no weak
    reference."""
    try:
        if drawn or not _samplers.get(model, (None, False))[1]:
            _samplers[model] = (sampling, drawn)
    except TypeError:
        pass


def remembered_sampler(model: Any) -> Optional[tuple[Sampling, bool]]:
    """The sampler recorded for ``model`` by :func:`remember_sampler` and whether it drew, or None."""
    try:
        return _samplers.get(model)
    except TypeError:
        return None
