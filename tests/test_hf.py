"""lightning_kl.hf against hand-built expectations and tiny transformers/peft models.

Every expected log-prob here is computed another way than the function under test: from
``generate``'s own per-step logits (what the tokens were sampled from), or by running the model
on each prefix alone, with no padding. A wrong shift, a wrong position id under left padding, an
EOS mask that stops at the last EOS, or adapters left on fails one of them.
"""

from __future__ import annotations

import ast
import copy
import json
import math
import sys
import importlib.util
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from lightning_kl import hf
from _ddp import run_ddp_worker

# peft's get_peft_model calls a transformers method that transformers 5 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

transformers = pytest.importorskip("transformers")  # the `test` extra installs it: CI never skips
peft = pytest.importorskip("peft")

PAD, BOS, EOS = 0, 1, 2
VOCAB = 12


def _tiny(arch: str = "qwen2", seed: int = 0) -> torch.nn.Module:
    """A 1-layer causal LM with random weights (eval mode, no dropout)."""
    common = dict(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    if arch == "qwen2":
        config = transformers.Qwen2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                          **common)
        cls = transformers.Qwen2ForCausalLM
    else:  # absolute learned positions: a wrong position id changes every log-prob
        config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, **common)
        cls = transformers.GPT2LMHeadModel
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # bigger logits than the default init, so that differences show
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8)
    return model


def _lora(model: torch.nn.Module, arch: str = "qwen2") -> torch.nn.Module:
    targets = ["q_proj", "v_proj"] if arch == "qwen2" else ["c_attn"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                             fan_in_fan_out=arch == "gpt2")
    policy = peft.get_peft_model(model, config)
    torch.manual_seed(1)
    with torch.no_grad():  # lora_B starts at 0 (adapters are a no-op): make them change the model
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)
    return policy.eval()


# prompts of lengths 2, 4 and 3, left-padded to 4
PROMPTS = [[BOS, 5], [BOS, 3, 4, 6], [BOS, 7, 8]]


def _left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    p = max(len(x) for x in PROMPTS)
    ids = torch.tensor([[PAD] * (p - len(x)) + x for x in PROMPTS])
    return ids, (ids != PAD).long()


def _generate(model, seed: int = 0, max_new_tokens: int = 5):
    ids, am = _left_padded()
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=am, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                         max_new_tokens=max_new_tokens, pad_token_id=PAD, eos_token_id=EOS,
                         output_logits=True, return_dict_in_generate=True)
    return ids, am, out


def _prefix_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    """log pi(y_t | x, y_<t) by running ``model`` on each unpadded prefix alone, in float64."""
    out = []
    for t, token in enumerate(response):
        prefix = torch.tensor([prompt + response[:t]])
        with torch.no_grad():
            logits = model(input_ids=prefix).logits[0, -1].double()
        out.append(float(torch.log_softmax(logits, -1)[token]))
    return out


# --- response_logits ---------------------------------------------------------------------------


def test_response_logits_are_the_positions_that_predict_the_response():
    # position i of the output holds the value 10 * row + i in every vocabulary slot
    b, n, v = 2, 6, 3
    logits = (torch.arange(n) + 10 * torch.arange(b)[:, None]).float()[..., None].expand(b, n, v)
    out = hf.response_logits(logits, prompt_length=4)
    # response tokens 4 and 5 are predicted by positions 3 and 4; the last position predicts nothing
    assert out[..., 0].tolist() == [[3.0, 4.0], [13.0, 14.0]]
    assert out.data_ptr() == logits.data_ptr() + 3 * logits.stride(1) * logits.element_size()  # a view


@pytest.mark.parametrize("p", [0, 6, -1])
def test_response_logits_rejects_a_prompt_length_that_leaves_nothing(p):
    with pytest.raises(ValueError, match=rf"`prompt_length` must be in \[1, 5\].*got {p}"):
        hf.response_logits(torch.zeros(1, 6, 3), p)


def test_response_logits_rejects_2d_logits():
    with pytest.raises(ValueError, match=r"\[b, p \+ t, V\], got shape \(6, 3\)"):
        hf.response_logits(torch.zeros(6, 3), 2)


# --- response_mask ----------------------------------------------------------------------------


def test_response_mask_up_to_and_including_the_first_eos():
    responses = torch.tensor([
        [5, 6, EOS, PAD, PAD],   # EOS at 2, padded after
        [5, 6, 7, 8, 9],         # no EOS: truncated, valid throughout
        [EOS, 5, EOS, 6, EOS],   # EOS first: only that token; a later EOS does not reopen the mask
        [5, EOS, EOS, EOS, EOS],  # pad_token_id == eos_token_id, as many HF models ship
        [5, 6, 7, 8, EOS],       # EOS at the last slot
    ])
    expected = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    mask = hf.response_mask(responses, EOS)
    assert mask.dtype == torch.bool and mask.int().tolist() == expected


def test_response_mask_takes_several_eos_ids():
    # generation_config.eos_token_id is a list for many chat models (e.g. <|im_end|>, <|endoftext|>)
    responses = torch.tensor([[5, 9, 2, 0], [9, 5, 5, 0], [5, 5, 5, 5]])
    assert hf.response_mask(responses, [2, 9]).int().tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_response_mask_of_an_empty_batch():
    assert hf.response_mask(torch.zeros(0, 4, dtype=torch.long), EOS).shape == (0, 4)


@pytest.mark.parametrize("eos", [[], "2", 2.0, [2, None], True])
def test_response_mask_rejects_a_bad_eos_id(eos):
    with pytest.raises(ValueError, match="`eos_token_id` must be an int or a non-empty list of ints"):
        hf.response_mask(torch.zeros(1, 3, dtype=torch.long), eos)


def test_response_mask_rejects_full_sequences_in_3d():
    with pytest.raises(ValueError, match=r"\[b, t\], got shape \(1, 2, 3\)"):
        hf.response_mask(torch.zeros(1, 2, 3, dtype=torch.long), EOS)


# --- sequence_inputs --------------------------------------------------------------------------


def test_sequence_inputs_number_positions_from_each_rows_first_real_token():
    prompt_am = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    am, pos = hf.sequence_inputs(prompt_am, mask)
    assert am.tolist() == [[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0]]
    # a real token's position = the number of real tokens before it (what generate feeds the model)
    assert pos.tolist() == [[0, 0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 5, 6], [0, 0, 1, 2, 3, 3, 3]]


def test_sequence_inputs_reject_masks_of_different_batch_sizes():
    with pytest.raises(ValueError, match=r"same b, got shapes \(2, 4\) and \(3, 2\)"):
        hf.sequence_inputs(torch.ones(2, 4), torch.ones(3, 2, dtype=torch.bool))


# --- response_logprobs: what generate sampled from --------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_response_logprobs_equal_generates_own_distributions(arch):
    model = _tiny(arch)
    ids, prompt_am, out = _generate(model)
    p = ids.shape[1]
    responses = out.sequences[:, p:]
    mask = hf.response_mask(responses, EOS)
    assert mask.sum(-1).unique().numel() > 1, "the rows should end at different lengths (seed choice)"
    am, _ = hf.sequence_inputs(prompt_am, mask)
    logprobs = hf.response_logprobs(model, out.sequences, am, p)
    # generate's raw logits at each step, before any processor: the sampling distribution at T = 1
    step_logits = torch.stack(out.logits, dim=1).double()
    expected = torch.log_softmax(step_logits, -1).gather(-1, responses[..., None]).squeeze(-1)
    assert logprobs.dtype == torch.float32
    assert_close(logprobs[mask].double(), expected[mask], rtol=0, atol=2e-5)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_response_logprobs_equal_each_prefix_run_alone(arch):
    model = _tiny(arch, seed=3)
    ids, prompt_am, out = _generate(model, seed=3)
    p = ids.shape[1]
    mask = hf.response_mask(out.sequences[:, p:], EOS)
    am, _ = hf.sequence_inputs(prompt_am, mask)
    logprobs = hf.response_logprobs(model, out.sequences, am, p)
    for row, prompt in enumerate(PROMPTS):
        response = out.sequences[row, p:][mask[row]].tolist()
        expected = torch.tensor(_prefix_logprobs(model, prompt, response), dtype=torch.float64)
        assert_close(logprobs[row, : len(response)].double(), expected, rtol=0, atol=2e-5)


def test_gpt2_needs_the_position_ids_that_left_padding_implies():
    # the test above can fail: scoring left-padded rows at positions 0.. (no position ids) is wrong
    model = _tiny("gpt2", seed=3)
    ids, prompt_am, out = _generate(model, seed=3)
    p = ids.shape[1]
    mask = hf.response_mask(out.sequences[:, p:], EOS)
    am, _ = hf.sequence_inputs(prompt_am, mask)
    naive = torch.log_softmax(model(input_ids=out.sequences, attention_mask=am).logits.float(), -1)
    naive = naive[:, p - 1 : -1].gather(-1, out.sequences[:, p:, None]).squeeze(-1)
    right = hf.response_logprobs(model, out.sequences, am, p)
    padded_rows = prompt_am.sum(-1) < p
    assert (naive - right)[padded_rows][mask[padded_rows]].abs().max() > 1e-2
    assert_close(naive[~padded_rows], right[~padded_rows], rtol=0, atol=1e-5)


def test_response_logprobs_at_a_temperature():
    model = _tiny()
    ids, prompt_am, out = _generate(model)
    p = ids.shape[1]
    mask = hf.response_mask(out.sequences[:, p:], EOS)
    am, _ = hf.sequence_inputs(prompt_am, mask)
    lp, logits = hf.response_logprobs(model, out.sequences, am, p, sampling=lk.Sampling(0.5), return_logits=True)
    assert logits.shape == (3, out.sequences.shape[1] - p, VOCAB)
    expected = torch.log_softmax(logits.double() / 0.5, -1).gather(-1, out.sequences[:, p:, None]).squeeze(-1)
    assert_close(lp.double(), expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="`temperature` must be a finite number > 0, got 0"):
        hf.response_logprobs(model, out.sequences, am, p, temperature=0)  # deprecated keyword: checked first


def test_response_logprobs_of_a_bf16_model_are_float32_and_differentiable():
    model = _tiny().to(torch.bfloat16)
    ids, prompt_am, out = _generate(model)
    p = ids.shape[1]
    mask = hf.response_mask(out.sequences[:, p:], EOS)
    am, _ = hf.sequence_inputs(prompt_am, mask)
    lp = hf.response_logprobs(model, out.sequences, am, p)
    assert lp.dtype == torch.float32 and lp.requires_grad
    lk.aggregate(lp, mask).backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.dtype == torch.bfloat16


def test_response_logprobs_reject_mismatched_shapes():
    with pytest.raises(ValueError, match=r"both be \[b, p \+ t\], got shapes \(2, 5\) and \(2, 4\)"):
        hf.response_logprobs(_tiny(), torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 4), 2)


# --- one Sampling for the sampler and the scorer; the opt-in check against generate's scores -----


def _sample(model, generate_kwargs: dict, seed: int = 0, max_new_tokens: int = 5):
    ids, am = _left_padded()
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=max_new_tokens, pad_token_id=PAD,
                         eos_token_id=EOS, output_scores=True, output_logits=True, return_dict_in_generate=True,
                         **generate_kwargs)
    p = ids.shape[1]
    mask = hf.response_mask(out.sequences[:, p:], EOS)
    return out, hf.sequence_inputs(am, mask)[0], p, mask


def test_response_logprobs_take_one_sampling_for_the_old_keywords():
    model = _tiny()
    s = lk.Sampling(temperature=0.7, top_k=4, top_p=0.9)
    out, am, p, mask = _sample(model, s.generate_kwargs())
    by_object = hf.response_logprobs(model, out.sequences, am, p, sampling=s)
    with pytest.warns(DeprecationWarning, match=r"lk.hf.response_logprobs\(temperature=, top_k=, top_p=...\) is "
                      r"deprecated: pass sampling=lk.Sampling\(temperature=0.7, top_k=4, top_p=0.9\)"):
        by_keywords = hf.response_logprobs(model, out.sequences, am, p, 0.7, top_k=4, top_p=0.9)
    assert torch.equal(by_object, by_keywords)
    # the sampler's own distribution: generate's processed scores, at every valid token
    drawn = torch.log_softmax(torch.stack(out.scores, 1).double(), -1).gather(-1, out.sequences[:, p:, None])[..., 0]
    assert_close(by_object[mask].double(), drawn[mask], rtol=0, atol=2e-5)
    ref = hf.reference_logprobs(_lora(_tiny()), out.sequences, am, p, sampling=lk.Sampling(temperature=0.7))
    assert ref.shape == by_object.shape


@pytest.mark.parametrize("extra", [{"temperature": 0.7}, {"top_p": 0.9}, {"top_k": 3}, {"min_p": 0.1}])
def test_response_logprobs_refuse_a_sampling_and_the_separate_keywords(extra):
    model = _tiny()
    seq = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"`sampling=` or as the separate keywords, not both.*" + list(extra)[0]):
        hf.response_logprobs(model, seq, torch.ones_like(seq), 2, sampling=lk.Sampling(), **extra)
    with pytest.raises(TypeError, match="`sampling` must be a lightning_kl.Sampling, got dict"):
        hf.response_logprobs(model, seq, torch.ones_like(seq), 2, sampling={"temperature": 0.7})


def test_the_sampler_check_is_silent_when_generate_drew_from_the_scored_sampling():
    import warnings

    model = _tiny()
    model.generation_config.top_k = 2  # a checkpoint's default: generate_kwargs() switches it off
    for s in (lk.Sampling(), lk.Sampling(temperature=0.6, top_p=0.8), lk.Sampling(top_k=3, min_p=0.05)):
        out, am, p, mask = _sample(model, s.generate_kwargs())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hf.response_logprobs(model, out.sequences, am, p, sampling=s, sampler_scores=out.scores)
        agreement = hf.sampler_agreement(hf.response_logprobs(model, out.sequences, am, p, sampling=s),
                                         out.scores, out.sequences[:, p:], mask)
        assert agreement.tokens == int(mask.sum()) and agreement.share_outside == 0.0
        assert abs(agreement.mean_ratio - 1) < 1e-5 and agreement.agrees


@pytest.mark.parametrize("case", ["generation_config top_k", "temperature scored at 1", "scorer truncates more"])
def test_the_sampler_check_warns_once_with_the_ratios_figures_on_a_mismatched_scorer(case):
    import re
    import warnings

    model = _tiny()
    scorer = lk.Sampling()
    if case == "generation_config top_k":  # generate's own keywords: the model's top_k=2 slips in
        model.generation_config.top_k = 2
        kwargs = dict(do_sample=True, temperature=1.0)
    elif case == "temperature scored at 1":
        kwargs = lk.Sampling(temperature=0.5).generate_kwargs()
    else:  # the scorer's kept set is smaller than the sampler's: the rest get -inf, ratio 0
        kwargs, scorer = lk.Sampling().generate_kwargs(), lk.Sampling(top_k=1)
    out, am, p, mask = _sample(model, kwargs)
    lp = hf.response_logprobs(model, out.sequences, am, p, sampling=scorer, outside="-inf")
    expected = hf.sampler_agreement(lp, out.scores, out.sequences[:, p:], mask)
    # from the formula: the ratio at each valid token, in float64
    drawn = torch.log_softmax(torch.stack(out.scores, 1).double(), -1).gather(-1, out.sequences[:, p:, None])[..., 0]
    ratio = torch.exp(lp.double() - drawn)[mask]
    assert expected.tokens == ratio.numel()
    assert_close(torch.tensor(expected.mean_ratio, dtype=torch.float64), ratio.mean(), rtol=1e-12, atol=0)
    assert expected.share_outside == float(((ratio < 0.99) | (ratio > 1.01)).double().mean())
    assert not expected.agrees
    figures = (f"mean ratio {expected.mean_ratio:.4f}, {expected.share_outside:.1%} of {expected.tokens} "
               "response tokens outside [0.99, 1.01]")
    with pytest.warns(hf.SamplerMismatchWarning, match=re.escape(figures)) as record:
        hf.response_logprobs(model, out.sequences, am, p, sampling=scorer, outside="-inf", sampler_scores=out.scores)
    assert len(record) == 1 and record[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():  # once per model
        warnings.simplefilter("error")
        hf.response_logprobs(model, out.sequences, am, p, sampling=scorer, outside="-inf", sampler_scores=out.scores)


def test_the_sampler_check_refuses_scores_of_other_sequences_before_the_forward_pass():
    model = _tiny()
    out, am, p, mask = _sample(model, lk.Sampling().generate_kwargs())
    t = out.sequences.shape[1] - p
    with pytest.raises(ValueError, match=rf"`sampler_scores` must be generate's scores.*{t} tensors \[b=3, V\].*got {t - 1}"):
        hf.response_logprobs(model, out.sequences, am, p, sampler_scores=out.scores[1:])
    with pytest.raises(ValueError, match=r"`sampler_scores` must be.*got a tensor of shape \(3, 12\)"):
        hf.response_logprobs(model, out.sequences, am, p, sampler_scores=out.scores[0])
    with pytest.raises(TypeError, match="give it to lk.hf.response_logprobs, not to reference_logprobs"):
        hf.reference_logprobs(_lora(model), out.sequences, am, p, sampler_scores=out.scores)
    # one [b, t, V] tensor is taken as well
    lp = hf.response_logprobs(model, out.sequences, am, p)
    stacked = hf.sampler_agreement(lp, torch.stack(out.scores, 1), out.sequences[:, p:], mask)
    assert stacked == hf.sampler_agreement(lp, out.scores, out.sequences[:, p:], mask)


# --- the reference for free: adapters off -----------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_reference_logprobs_equal_a_copy_of_the_base_model(arch):
    base_copy = copy.deepcopy(_tiny(arch))
    policy = _lora(_tiny(arch), arch)
    ids, prompt_am, out = _generate(policy)
    p = ids.shape[1]
    mask = hf.response_mask(out.sequences[:, p:], EOS)
    am, _ = hf.sequence_inputs(prompt_am, mask)

    on = hf.response_logprobs(policy, out.sequences, am, p)
    ref = hf.reference_logprobs(policy, out.sequences, am, p)
    with torch.no_grad():
        expected = hf.response_logprobs(base_copy, out.sequences, am, p)
    assert_close(ref, expected, rtol=0, atol=1e-6)
    assert (on - ref)[mask].abs().max() > 0.1  # the adapters matter, so equality above means "off"
    assert not ref.requires_grad and on.requires_grad
    # and they are back on afterwards
    assert_close(hf.response_logprobs(policy, out.sequences, am, p), on, rtol=0, atol=0)


def test_adapters_come_back_on_after_an_exception():
    policy = _lora(_tiny())
    x = torch.tensor([[BOS, 3, 4]])
    on = policy(input_ids=x).logits
    with pytest.raises(RuntimeError, match="boom"):
        with hf.adapters_disabled(policy):
            raise RuntimeError("boom")
    assert_close(policy(input_ids=x).logits, on, rtol=0, atol=0)


def test_adapters_of_the_transformers_peft_integration_are_switched_through_its_methods():
    # model.add_adapter(...) puts LoRA layers into a plain transformers model, switched by
    # disable_adapters() / enable_adapters() (a real one needs peft >= 0.22 with transformers 5)
    class Integrated:
        _hf_peft_config_loaded = True

        def __init__(self):
            self.calls = []

        def disable_adapters(self):
            self.calls.append("disable")

        def enable_adapters(self):
            self.calls.append("enable")

    model = Integrated()
    with hf.adapters_disabled(model) as inside:
        assert inside is model and model.calls == ["disable"]
    assert model.calls == ["disable", "enable"]
    with pytest.raises(RuntimeError, match="boom"):
        with hf.adapters_disabled(model):
            raise RuntimeError("boom")
    assert model.calls == ["disable", "enable", "disable", "enable"]


def test_a_model_without_adapters_is_refused():
    with pytest.raises(TypeError, match="Qwen2ForCausalLM has no adapters to disable"):
        hf.reference_logprobs(_tiny(), torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4), 2)


def test_the_package_does_not_import_transformers_or_peft_for_hf():
    # `import lightning_kl` must work without the `hf` extra: lightning_kl/hf.py imports neither
    tree = ast.parse(Path(hf.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"transformers", "peft", "tokenizers"}


# --- the example: examples/hf_grpo.py through Lightning -----------------------------------------

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "hf_grpo_lora.yaml"
_worker_spec = importlib.util.spec_from_file_location("_hf_ddp_worker", Path(__file__).with_name("_hf_ddp_worker.py"))
ddp_worker = importlib.util.module_from_spec(_worker_spec)
_worker_spec.loader.exec_module(ddp_worker)
ex = ddp_worker.load_example()
TINY_ARGS = [f"--model.{k}={v}" for k, v in ddp_worker.TINY_MODEL.items()] + [
    f"--data.{k}={v}" for k, v in ddp_worker.TINY_DATA.items()
]
QUIET_CLI = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.logger=false"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    # one tiny reference for the module: the cache is keyed by config, so later tests load it
    return str(tmp_path_factory.mktemp("reference"))


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["hf_grpo.py"])  # LightningCLI reads args=, not pytest's argv
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only spin-waits on shared cores
    yield
    torch.set_num_threads(threads)


@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_example_config_runs_on_policy_and_trains_only_the_adapters(tmp_path, cache_dir, one_thread, arch):
    seen = {}

    class OnPolicy(pl.Callback):
        # recompute the batch's log-probs with the policy as training_step will see it: equal only
        # if the rollout was sampled after the previous optimizer step (no prefetch)
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
            dm = trainer.datamodule  # the YAML's sampler: temperature and top-p, scored processed
            with torch.no_grad():
                now = hf.response_logprobs(module.policy, seq, am, seq.shape[1] - mask.shape[1], **dm.scoring)
            seen.setdefault("gap", []).append(float((now - batch["logprobs"])[mask].abs().max()))
            seen.setdefault("batches", []).append({k: v for k, v in batch.items()})

    cli = ex.main(["--config", str(CONFIG), *TINY_ARGS, *QUIET_CLI, f"--model.cache_dir={cache_dir}",
                   f"--trainer.default_root_dir={tmp_path}", "--trainer.fast_dev_run=3", "--data.rollouts=3",
                   f"--model.arch={arch}"], run=False)
    cli.trainer.callbacks.append(OnPolicy())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    module = cli.model
    expected_class = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    assert type(module.policy.get_base_model()).__name__ == expected_class
    assert cli.trainer.global_step == 3 and len(seen["gap"]) == 3
    assert max(seen["gap"]) < 1e-5, seen["gap"]

    first = seen["batches"][0]
    seq, mask = first["sequences"], first["mask"]
    p = seq.shape[1] - mask.shape[1]
    assert_close(mask, hf.response_mask(seq[:, p:], ex.EOS_ID), rtol=0, atol=0)
    # adapters start as a no-op (lora_B = 0): the first rollout's policy is the reference, exactly:
    # the softmaxes' KL and the KL on the policy's kept set are 0; the processed log-probs exceed the
    # reference's softmax ones by -log S >= 0 (the YAML samples with top-p)
    assert first["kl_full"].abs().max() < 1e-6 and first["kl_policy_kept"].abs().max() < 1e-6
    assert (first["logprobs"][mask] >= first["ref_logprobs"][mask] - 1e-6).all()
    assert (first["logprobs"][mask] > first["ref_logprobs"][mask]).any()
    assert len({int(g) for g in first["group"]}) == ddp_worker.TINY_DATA["prompts_per_rollout"]
    # the reference is still the pretrained model: only the adapters trained
    state = torch.load(module.reference_path, map_location="cpu", weights_only=True)
    for name, param in module.policy.named_parameters():
        if "lora_" in name:
            assert param.requires_grad
        else:
            key = name.replace("base_model.model.", "").replace("base_layer.", "")
            assert not param.requires_grad and torch.equal(param.detach(), state[key]), name
    assert any(p.abs().sum() > 0 for n, p in module.policy.named_parameters() if "lora_B" in n)
    assert 0.0 <= module.ref_acc <= 1.0
    assert module.memory["reference_adapters_off"] == 0
    assert module.memory["reference_as_a_copy"] == module.memory["base"] > module.memory["adapters"] > 0


def test_the_examples_sampler_draws_what_it_scores_whatever_the_generation_config(cache_dir, one_thread, capsys):
    # examples/check_generate.py on the example's YAML (tiny model): generate(**sampling.generate_kwargs())
    # is scored at ratio 1 under the model's default generation_config and a checkpoint-like one;
    # generate's own keywords let the checkpoint's top_k and repetition penalty in
    spec = importlib.util.spec_from_file_location("check_generate", ROOT / "examples" / "check_generate.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    args = ["--config", str(CONFIG), "--rollouts", "1", *TINY_ARGS, f"--model.cache_dir={cache_dir}"]
    sampling, rows = check.measure(str(CONFIG), 1, args[4:])
    assert sampling == lk.Sampling(temperature=0.9, top_p=0.9)  # the YAML's
    assert len(rows) == 8 and all(r["tokens"] > 0 for r in rows)
    for r in rows:
        if r["sampler"] == "generate(**sampling.generate_kwargs())" or r["generation_config"] == "the model's default":
            assert abs(r["mean_ratio"] - 1) < 1e-5 and r["share_outside"] == 0.0, r
        else:
            assert not hf.SamplerAgreement(r["mean_ratio"], r["share_outside"], r["tokens"]).agrees, r
    assert check.main(args) == 0
    assert "PASS  every generate(**sampling.generate_kwargs()) row: ratio 1.0000, 0% outside" in capsys.readouterr().out
    # the example's own rollout path (ArithmeticDataModule.sample, no keywords given) under that config
    cli = ex.main(["--config", str(CONFIG), *QUIET_CLI, *TINY_ARGS, f"--model.cache_dir={cache_dir}"], run=False)
    dm, model = cli.datamodule, cli.model.reference_model(cli.datamodule).eval()
    model.generation_config = transformers.GenerationConfig(**{**model.generation_config.to_dict(), **check.CHECKPOINT_LIKE})
    torch.manual_seed(0)
    batch = dm.sample(model, [(1, 0), (0, 1)] * 8, torch.device("cpu"))
    seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
    p = seq.shape[1] - mask.shape[1]
    lp = hf.response_logprobs(model, seq, am, p, **dm.scoring)
    agreement = hf.sampler_agreement(lp, batch["generate_scores"], seq[:, p:], mask)
    assert agreement.share_outside == 0.0 and abs(agreement.mean_ratio - 1) < 1e-5, agreement


def test_example_rejects_a_bad_estimator_before_any_step(tmp_path, one_thread):
    # the message lists the valid names; the model is built before the reference is pretrained
    with pytest.raises(ValueError, match=r"k3\+"):
        ex.main(["--config", str(CONFIG), *QUIET_CLI, "--model.kl_estimator=k4",
                 f"--model.cache_dir={tmp_path}"], run=False)
    assert not list(Path(tmp_path).iterdir())  # no reference was pretrained


@pytest.mark.parametrize("top_p", [0.9, 0.99])
def test_example_refuses_full_with_a_truncating_sampler_before_pretraining(tmp_path, one_thread, top_p):
    # `full` is the KL of the softmaxes: not the distribution a top-p sampler draws from
    cli = ex.main(["--config", str(CONFIG), *TINY_ARGS, *QUIET_CLI, "--model.kl_estimator=full",
                   f"--data.sampling.top_p={top_p}", f"--model.cache_dir={tmp_path / 'ref'}",
                   f"--trainer.default_root_dir={tmp_path}", "--trainer.fast_dev_run=1"], run=False)
    with pytest.raises(ValueError, match=r"sampler truncates them .*top_p 1"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert not (tmp_path / "ref").exists() or not list((tmp_path / "ref").iterdir())


def _kl_terms(tmp_path, cache_dir, args):
    """Fit 2 steps of the tiny example; the KL loss's inputs and output at each step, and the policy's
    and the reference's logits over the response (float64), recomputed just before the step."""
    seen: list[dict] = []

    class Capture(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
            p = seq.shape[1] - mask.shape[1]
            with torch.no_grad():
                _, logits = hf.response_logprobs(module.policy, seq, am, p, return_logits=True, sampling=lk.Sampling())
                _, ref = hf.reference_logprobs(module.policy, seq, am, p, return_logits=True, sampling=lk.Sampling())
            seen.append({"logits": logits.double(), "ref": ref.double(), "mask": mask})

    cli = ex.main(["--config", str(CONFIG), *TINY_ARGS, *QUIET_CLI, f"--model.cache_dir={cache_dir}",
                   f"--trainer.default_root_dir={tmp_path}", "--trainer.fast_dev_run=2", "--data.rollouts=2",
                   *args], run=False)
    cli.trainer.callbacks.append(Capture())
    hook = cli.model.kl.register_forward_hook(
        lambda m, a, kw, out: seen[-1].update(args=a, kwargs=kw, out=out.detach().double()), with_kwargs=True)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    hook.remove()
    return seen, cli.model


@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_example_full_in_the_loss_is_the_softmaxes_kl_at_the_sampling_temperature(tmp_path, cache_dir, one_thread, level):
    # coef x the mean over responses of the summed exact KL of softmax(logits / T) against the
    # reference's, from the formula in float64 (T = 0.5: a loss without the temperature is off)
    T, coef = 0.5, 0.7
    seen, _ = _kl_terms(tmp_path, cache_dir, ["--model.kl_estimator=full", f"--model.kl_level={level}",
                                           f"--model.kl_coef={coef}", f"--data.sampling.temperature={T}",
                                           "--data.sampling.top_p=1.0"])
    assert len(seen) == 2
    for i, s in enumerate(seen):
        logp, logq = torch.log_softmax(s["logits"] / T, -1), torch.log_softmax(s["ref"] / T, -1)
        per_token = (logp.exp() * (logp - logq)).sum(-1) * s["mask"]
        expected = coef * per_token.sum(-1).mean()
        assert_close(s["out"], expected, rtol=1e-4, atol=1e-7)
        assert ("sampled_logprob" in s["kwargs"] and s["kwargs"]["sampled_logprob"] is not None) == (level == "sequence")
        if i == 1:  # the first step moved the adapters: the second step's KL is not 0
            assert float(expected) > 1e-5


@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")
@pytest.mark.parametrize("weights", [True, False])
def test_example_kl_old_logprob_switches_the_importance_weights(tmp_path, cache_dir, one_thread, weights):
    seen, _ = _kl_terms(tmp_path, cache_dir, ["--model.kl_estimator=k3", f"--model.kl_old_logprob={weights}"])
    assert len(seen) == 2
    for s in seen:
        assert (s["kwargs"]["old_logprob"] is not None) is weights


@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")
def test_example_takes_a_target_kl_controller_by_class_path(tmp_path, cache_dir, one_thread):
    # the rule, once per step, from each step's KL (its loss over the coefficient it used): step 1 with
    # the initial coefficient, step 2 with the one step 1's KL gave
    ctl = {"class_path": "lightning_kl.TargetKLController",
           "init_args": {"target_kl": 0.01, "init_kl_coef": 0.2, "step_size": 0.1}}
    seen, module = _kl_terms(tmp_path, cache_dir, [f"--model.kl_coef={json.dumps(ctl)}", "--model.kl_estimator=k3+"])
    assert type(module.kl.controller) is lk.TargetKLController and len(seen) == 2
    beta = 0.2
    for s in seen:
        kl = float(s["out"]) / beta
        beta *= math.exp(0.1 * max(-1.0, min(1.0, kl / 0.01 - 1)))
    assert beta != pytest.approx(0.2)  # the coefficient moved
    assert module.kl.coef == pytest.approx(beta, rel=1e-6)
