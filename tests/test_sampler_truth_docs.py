"""The docs' sampler statements, run (issue 40: C2, "`full` with a truncating sampler", S2's YAML).

* The README's `full` block runs with the README's own truncating sampler on a rollout with padding
  after EOS (the line it replaced raised there, naming ``ignore_index``), and its KL is the one
  statement the README, docs/huggingface.md, docs/vocabulary.md and the loss's docstring make: the
  exact KL from the processed policy to the reference's softmax at the same temperature (float64 maths
  from the formula).
* docs/sampling.md's "One sampler in a YAML file": its CLI block and YAML, parsed by a real
  ``LightningCLI``: the bonus and a `full` loss get the module's sampler, a sampled estimator gets
  none, a command-line override reaches all of them, a value written at a linked part is replaced.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import lightning_kl as lk
from _snippets import ROOT, snippet, snippets
from lightning_kl.ground.sampler import process_scores

STATEMENT = ("the exact KL from the distribution the sampler draws from (the policy's softmax at its temperature, "
             "truncated to the kept set and renormalized) to the reference's softmax at the same temperature")


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("page", ["README.md", "docs/huggingface.md", "docs/vocabulary.md"])
def test_full_with_a_truncating_sampler_is_one_statement_everywhere(page: str) -> None:
    text = _flat((ROOT / page).read_text())
    assert STATEMENT in text
    assert "refused when the sampler truncates" not in text and "a sampler that does not truncate" not in text
    doc = _flat(lk.KLPenaltyLoss.__doc__ or "")
    assert "truncated and renormalized, to the reference's ``softmax(ref_logits / T)``" in doc


def _full_kl64(logits: torch.Tensor, ref_logits: torch.Tensor, sampling: lk.Sampling) -> torch.Tensor:
    """sum_{i in K} p~_i (log p~_i - log q_i), q = softmax(ref / T), in float64 from the formula."""
    e = logits.double() / sampling.temperature
    keep = process_scores(logits.float() / sampling.temperature, sampling) != float("-inf")
    logp = torch.log_softmax(e.masked_fill(~keep, float("-inf")), -1)
    logq = torch.log_softmax(ref_logits.double() / sampling.temperature, -1)
    p = logp.exp()
    return torch.where(keep, p * (logp - logq), 0.0).sum(-1)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_readmes_full_block_runs_with_its_truncating_sampler_on_padded_responses() -> None:
    pytest.importorskip("peft")
    import test_doc_snippets as snippets_test

    ns = snippets_test._run(snippet("README.md", "class GRPO("), {})
    module = ns["GRPO"](snippets_test.tiny_model())  # the README's default sampler: T = 0.7, top-p 0.9
    assert module.sampling.truncates
    batch = snippets_test.hf_rollout(module, module.sampling)
    seq, mask = batch["sequences"].clone(), batch["mask"].clone()
    p = seq.shape[1] - mask.shape[1]
    # three responses end early: padding after their last valid token, with a pad id that lies outside the
    # kept set at some padded position (as an EOS or pad id often does: the case the README's old line raised on)
    for row, end in ((0, 1), (2, 2), (4, 3)):
        mask[row, end:] = False
    am = lk.hf.sequence_inputs(batch["attention_mask"][:, :p], mask)[0]
    code = snippet("README.md", 'lk.KLPenaltyLoss("full"')
    old_line_raised = False
    for pad in range(15):
        seq[:, p:] = seq[:, p:].masked_fill(~mask, pad)
        with warnings.catch_warnings():
            warnings.simplefilter("error", lk.hf.SamplerMismatchWarning)
            out = snippets_test._run(code, {"torch": torch, "lk": lk, "self": module, "seq": seq, "am": am, "mask": mask, "p": p})
        try:  # the line it replaced
            lk.token_logprobs(out["logits"], seq[:, p:], sampling=module.sampling)
        except ValueError as err:  # raised on the padding, and says what to do
            assert re.search(r"padding after EOS.*ignore_index", str(err)), str(err)
            old_line_raised = True
            break
    assert old_line_raised
    sampled = out["sampled"]
    torch.testing.assert_close(sampled[mask], batch["logprobs"][mask], rtol=0, atol=1e-5)  # the rollout's own
    assert (sampled[~mask] == 0).all()
    # the KL it regularizes: the processed policy against the reference's softmax at T, per token
    want = _full_kl64(out["logits"].detach(), out["ref_logits"], module.sampling)
    got = lk.full_kl(out["logits"].detach(), out["ref_logits"], mask, sampling=module.sampling)
    torch.testing.assert_close(got.double()[mask], want[mask], rtol=1e-5, atol=1e-6)
    assert float(out["kl_full"].metric.compute()) == pytest.approx(float(want[mask].mean()), rel=1e-5)
    untruncated = _full_kl64(out["logits"].detach(), out["ref_logits"], lk.Sampling(temperature=0.7))
    assert not torch.allclose(want[mask], untruncated[mask], rtol=1e-3)  # another number than the softmaxes'
    assert torch.isfinite(out["kl_loss"])
    out["kl_loss"].backward()


# --- docs/sampling.md, "One sampler in a YAML file" -----------------------------------------------------


def _yaml_block() -> str:
    text = (ROOT / "docs" / "sampling.md").read_text()
    section = text[text.index("## One sampler in a YAML file"):]
    return re.search(r"^```yaml\n(.*?)^```", section, re.S | re.M).group(1)


def _parse(tmp_path: Path, yaml_text: str, *args: str) -> Any:
    """The docs' block as a module of its own (jsonargparse reads its signatures), and a CLI parse of the YAML."""
    pytest.importorskip("jsonargparse")
    name = "sampling_yaml_recipe"
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(snippet("docs/sampling.md", "class CLI(LightningCLI)")))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        config = tmp_path / "config.yaml"
        config.write_text(yaml_text)
        with mock.patch.object(sys, "argv", ["cli"]):
            cli = module.CLI(module.GRPO, run=False, save_config_callback=None, seed_everything_default=False,
                             trainer_defaults={"logger": False, "enable_checkpointing": False, "enable_progress_bar": False},
                             args=["--config", str(config), *args])
    finally:
        del sys.modules[name]
    return cli.model


def test_the_yaml_recipe_gives_every_part_the_one_sampler(tmp_path: Path) -> None:
    one = lk.Sampling(temperature=0.7, top_p=0.9)
    model = _parse(tmp_path, _yaml_block())
    assert model.sampling == one and model.kl.sampling == one and model.bonus.sampling == one
    assert model.kl.spec.name == "full"
    # one override on the command line reaches every part
    model = _parse(tmp_path, _yaml_block(), "--model.sampling.top_p=0.8")
    assert model.sampling == model.kl.sampling == model.bonus.sampling == lk.Sampling(temperature=0.7, top_p=0.8)


def test_the_yaml_recipe_gives_a_sampled_estimator_no_sampler_and_replaces_a_copy(tmp_path: Path) -> None:
    sampled = _yaml_block().replace("estimator: full", "estimator: k3+")
    model = _parse(tmp_path, sampled)
    assert model.kl.spec.name == "k3+" and model.kl.sampling == lk.Sampling()
    assert model.bonus.sampling == lk.Sampling(temperature=0.7, top_p=0.9)
    # a sampler written at a linked part: the one place wins
    copy = _yaml_block().replace("{estimator: full, coef: 0.05}", "{estimator: full, coef: 0.05, sampling: {temperature: 1.0}}")
    assert copy != _yaml_block()
    model = _parse(tmp_path, copy)
    assert model.kl.sampling == lk.Sampling(temperature=0.7, top_p=0.9)
    # without a bonus the link has nothing to fill
    no_bonus = _yaml_block().split("  bonus:")[0]
    assert _parse(tmp_path, no_bonus).bonus is None


def test_the_yaml_recipe_fails_at_the_parse_on_a_bad_sampler(tmp_path: Path) -> None:
    # the link computes the parts' values at the parse: the sampler's own message, before any Trainer runs
    with pytest.raises(ValueError, match=r"`top_p` must be a number in \[0, 1\] or None, got 1.5"):
        _parse(tmp_path, _yaml_block().replace("top_p: 0.9", "top_p: 1.5"))


def test_the_sampling_page_has_the_blocks_this_file_runs() -> None:
    blocks = snippets(ROOT / "docs" / "sampling.md")
    assert sum("class CLI(LightningCLI)" in b for b in blocks) == 1
    assert sum('outside="extend"' in b for b in blocks) == 1
