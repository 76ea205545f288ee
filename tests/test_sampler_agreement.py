"""``lk.Sampling.generate_kwargs()`` against ``transformers``' ``generate``: what is drawn is the Sampling's.

A tiny Qwen2 model whose ``generation_config`` holds every setting that changes what ``generate``
draws (as a checkpoint's ``generation_config.json`` may). ``generate`` returns, per step, the raw
logits (``output_logits``) and the processed scores it sampled from (``output_scores``); the
expected distribution is computed from the raw logits by the library's processed log-probs at every
vocabulary entry (``-inf`` outside the kept set). Without the override of one setting, that
setting's case fails (each case turns on one of them, the last one all at once).
"""

from __future__ import annotations

import pytest
import torch

import lightning_kl as lk

transformers = pytest.importorskip("transformers")

PAD, BOS, EOS = 0, 1, 2
VOCAB = 32
PROMPTS = [[BOS, 5, 6, 7], [PAD, BOS, 9, 5]]  # one left-padded


def _model() -> torch.nn.Module:
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # peaked enough that truncations bite, flat enough that they keep several tokens
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4)
    return model


#: settings of a model's generation_config that change the drawn distribution (one case each)
HOSTILE = {
    "top_k": {"top_k": 3},
    "top_p": {"top_p": 0.3},
    "min_p": {"min_p": 0.5},
    "temperature": {"temperature": 0.3},
    "top_h": {"top_h": 0.3},
    "typical_p": {"typical_p": 0.3},
    "epsilon_cutoff": {"epsilon_cutoff": 0.05},
    "eta_cutoff": {"eta_cutoff": 0.05},
    "repetition_penalty": {"repetition_penalty": 3.0},
    "no_repeat_ngram_size": {"no_repeat_ngram_size": 1},
    "bad_words_ids": {"bad_words_ids": [[v] for v in range(3, 20)]},
    "sequence_bias": {"sequence_bias": {(v,): -10.0 for v in range(3, 20)}},
    "suppress_tokens": {"suppress_tokens": list(range(3, 20))},
    "begin_suppress_tokens": {"begin_suppress_tokens": list(range(3, 20))},
    "min_new_tokens": {"min_new_tokens": 6},  # bans EOS until then
    "min_length": {"min_length": 12},
    "forced_eos_token_id": {"forced_eos_token_id": EOS},
    "exponential_decay_length_penalty": {"exponential_decay_length_penalty": (0, 3.0)},
    "guidance_scale": {"guidance_scale": 3.0},
    "num_beams": {"num_beams": 2},
}
HOSTILE["all"] = {k: v for case in HOSTILE.values() for k, v in case.items() if k not in ("num_beams", "guidance_scale")}

SAMPLERS = {
    "plain": lk.Sampling(),
    "tempered": lk.Sampling(temperature=0.7),
    "top_p": lk.Sampling(temperature=0.9, top_p=0.8),
    "all": lk.Sampling(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05),
}


def _expected_logprobs(logits: torch.Tensor, sampling: lk.Sampling) -> torch.Tensor:
    """The Sampling's log-probs of every vocabulary entry, [b, V] raw logits -> [b, V] (-inf: removed)."""
    b, v = logits.shape
    rows = logits.double()[:, None, :].expand(b, v, v)  # one row per candidate token
    tokens = torch.arange(v).expand(b, v)
    s = sampling
    return lk.token_logprobs(rows, tokens, sampling=s, outside="-inf")


def _drawn_distributions(model, generation_config: dict, sampling: lk.Sampling, steps: int = 8):
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, **generation_config
    )
    ids = torch.tensor(PROMPTS)
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=(ids != PAD).long(), max_new_tokens=steps,
                         output_logits=True, output_scores=True, return_dict_in_generate=True,
                         **sampling.generate_kwargs())
    drawn = torch.log_softmax(torch.stack(out.scores, 1).double(), -1)  # [b, t, V]: what was sampled from
    raw = torch.stack(out.logits, 1)
    expected = torch.stack([_expected_logprobs(raw[:, i], sampling) for i in range(raw.shape[1])], 1)
    return drawn, expected, out.sequences


@pytest.mark.parametrize("sampler", ["plain", "all"])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_generate_draws_from_exactly_the_samplings_distribution(case, sampler):
    sampling = SAMPLERS[sampler]
    drawn, expected, sequences = _drawn_distributions(_model(), HOSTILE[case], sampling)
    assert drawn.shape == expected.shape and drawn.shape[1] >= 1
    kept = expected > -float("inf")
    assert torch.equal(drawn > -float("inf"), kept)  # the same kept set at every step
    torch.testing.assert_close(drawn[kept], expected[kept], rtol=0, atol=1e-5)


def test_the_hostile_settings_do_change_what_plain_keywords_draw():
    # the contrast: the same call with generate's own keywords (not generate_kwargs()) draws from
    # another distribution for every case, so each case above tests its override
    model = _model()
    sampling = SAMPLERS["tempered"]
    plain = dict(do_sample=True, temperature=sampling.temperature)
    for case, config in HOSTILE.items():
        if case == "temperature":
            continue  # an explicit temperature wins in both calls
        model.generation_config = transformers.GenerationConfig(bos_token_id=BOS, eos_token_id=EOS,
                                                                pad_token_id=PAD, **config)
        ids = torch.tensor(PROMPTS)
        torch.manual_seed(0)
        out = model.generate(input_ids=ids, attention_mask=(ids != PAD).long(), max_new_tokens=8,
                             output_logits=True, output_scores=True, return_dict_in_generate=True, **plain)
        n = min(len(out.scores), len(out.logits))
        if config.get("num_beams", 1) > 1:
            continue  # beam sampling: its scores are the beams' running log-probs, not one step's distribution
        drawn = torch.log_softmax(torch.stack(out.scores[:n], 1).double(), -1)
        raw = torch.stack(out.logits[:n], 1)
        expected = torch.stack([_expected_logprobs(raw[:, i], sampling) for i in range(n)], 1)
        same = torch.equal(drawn > -float("inf"), expected > -float("inf")) and torch.allclose(
            drawn.clamp(min=-1e30), expected.clamp(min=-1e30), rtol=0, atol=1e-5)
        assert not same, case


def test_generate_kwargs_sample_and_turn_off_what_the_sampling_does_not_ask_for():
    kw = lk.Sampling(temperature=0.7, top_p=0.9).generate_kwargs()
    assert kw["do_sample"] is True and kw["num_beams"] == 1
    assert (kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"]) == (0.7, 0, 0.9, None)
    kw = lk.Sampling(top_k=5, min_p=0.1).generate_kwargs()
    assert (kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"]) == (1.0, 5, 1.0, 0.1)
    # every key is a GenerationConfig attribute (a misspelt key would reach the model's forward)
    config = transformers.GenerationConfig()
    assert all(hasattr(config, k) for k in kw), [k for k in kw if not hasattr(config, k)]


def test_generate_kwargs_for_a_model_leave_out_what_its_transformers_does_not_know():
    # an older transformers has no top_h (say): generate would refuse the keyword, and applies no such processor
    class OldConfig:
        do_sample = num_beams = temperature = top_k = top_p = min_p = repetition_penalty = None

    class OldModel:
        generation_config = OldConfig()

    s = lk.Sampling(temperature=0.7, top_k=4)
    kw = s.generate_kwargs(OldModel())
    assert kw == {"do_sample": True, "num_beams": 1, "temperature": 0.7, "top_k": 4, "top_p": 1.0, "min_p": None,
                  "repetition_penalty": 1.0}
    assert s.generate_kwargs(OldConfig()) == kw
    # transformers 5 knows every key: the same as without a model
    assert s.generate_kwargs(_model()) == s.generate_kwargs()
