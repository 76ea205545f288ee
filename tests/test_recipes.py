"""The recipes users copy, run as they are written, and the mistakes around them made loud.

* the ``MismatchMetric`` recipe of docs/mismatch.md in a real Trainer over 3 epochs: each epoch's own value;
* the Quickstart's mistake (a trainer scorer without the rollout's sampler) warns, with the figures
  it would have made silently;
* ``lk.hf``'s separate sampler keywords are deprecated; ``reference_logprobs(sampling=)`` scores the
  reference's softmax at the sampler's temperature;
* one ratio band for ``lk.hf``'s check and the example's log;
* no example, config or doc names a deprecated name.
"""

from __future__ import annotations

import re
import textwrap
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from _snippets import ROOT, snippet

# --- S1: MismatchMetric over epochs, as docs/mismatch.md writes it ----------------------------------


def _mismatch_module(code: str) -> type:
    """A LightningModule whose ``__init__``, ``training_step`` and ``on_train_epoch_end`` are the recipe's lines."""
    lines = textwrap.dedent(code).splitlines()
    init = [line for line in lines if line.rstrip().endswith("# in __init__")]
    step = [line for line in lines if line.rstrip().endswith("# in training_step")]
    defs = "\n".join(line for line in lines if line not in init + step)
    namespace: dict[str, Any] = {"lk": lk, "torch": torch}
    exec(defs, namespace)
    assert "on_train_epoch_end" in namespace, "the recipe logs the metric in on_train_epoch_end"

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            exec("\n".join(init), {"lk": lk, "self": self})
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.logged: list[float] = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            # epoch 0: the trainer's log-probs are the engine's minus 0.5 (kl = 0.5); later epochs: equal
            shift = 0.5 if self.current_epoch == 0 else 0.0
            rollout = batch["rollout_logprobs"]
            exec("\n".join(step), {"self": self, "logprob": rollout - shift, "batch": batch, "mask": batch["mask"]})
            return self.w * 0.0 + self.w**2

        def on_train_epoch_end(self) -> None:
            namespace["on_train_epoch_end"](self)
            self.logged.append(float(self.trainer.callback_metrics["mismatch/kl"]))  # what the loggers got

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module


def test_mismatch_metric_recipe_logs_each_epoch_alone(quiet_trainer: Any) -> None:
    module = _mismatch_module(snippet("docs/mismatch.md", "lk.MismatchMetric()"))()
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 5, generator=g) * 2
    batches = [{"rollout_logprobs": rollout, "mask": torch.ones(4, 5, dtype=torch.bool)}] * 2
    trainer = quiet_trainer(max_epochs=3)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    # without a reset the metric is cumulative: 0.5, 0.25, 0.1667
    assert module.logged == pytest.approx([0.5, 0.0, 0.0], abs=1e-6)


# --- S2: a trainer scorer that forgot the rollout's sampler -----------------------------------------


@pytest.fixture(scope="module")
def hf_rollout() -> Any:
    pytest.importorskip("peft")
    import test_doc_snippets as snippets_test

    model = snippets_test.lora(snippets_test.tiny_model())
    torch.manual_seed(0)
    with torch.no_grad():  # adapters that change the model: the reference differs from the policy
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    sampling = lk.Sampling(temperature=0.7, top_p=0.9)
    from types import SimpleNamespace

    batch = snippets_test.hf_rollout(SimpleNamespace(policy=model), sampling)
    return model, sampling, batch


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_scorer_without_the_rollouts_sampler_warns_with_what_it_would_get(hf_rollout: Any) -> None:
    model, sampling, batch = hf_rollout
    seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
    p = seq.shape[1] - mask.shape[1]
    # the rollout scored the model with sampling=: the model remembers it; the right call is silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        right = lk.hf.response_logprobs(model, seq, am, p, sampling=sampling)
    assert_close(right[mask], batch["logprobs"][mask], rtol=0, atol=1e-5)
    with pytest.warns(lk.hf.SamplerMismatchWarning, match=r"given no sampler.*sampling=Sampling\(temperature=0.7, "
                      r"top_k=None, top_p=0.9, min_p=None\).*Warned once"):
        wrong = lk.hf.response_logprobs(model, seq, am, p)
    # what it would have given silently: a PPO ratio off 1 on-policy, and another k3
    ratio = torch.exp(wrong - batch["logprobs"])[mask]
    assert not torch.allclose(ratio, torch.ones_like(ratio), atol=1e-3)
    with warnings.catch_warnings():  # once per model
        warnings.simplefilter("error")
        lk.hf.response_logprobs(model, seq, am, p)
        # an explicit plain softmax is a choice, not an omission
        lk.hf.response_logprobs(model, seq, am, p, sampling=lk.Sampling())


def test_a_scorer_without_a_sampler_is_silent_on_a_model_never_scored_with_one() -> None:
    import test_doc_snippets as snippets_test

    model = snippets_test.tiny_model()
    seq = torch.randint(3, 15, (2, 6))
    am = torch.ones_like(seq)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lk.hf.response_logprobs(model, seq, am, 3)
        lk.hf.response_logprobs(model, seq, am, 3, sampling=lk.Sampling(temperature=1.0))  # the plain softmax
        lk.hf.response_logprobs(model, seq, am, 3)


# --- lk.hf's sampler keywords ------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("fn", ["response_logprobs", "reference_logprobs"])
@pytest.mark.parametrize("legacy", [{"temperature": 0.7}, {"top_k": 4}, {"top_p": 0.9}, {"min_p": 0.05},
                                    {"temperature": 0.7, "top_p": 0.9}])
def test_lk_hf_separate_sampler_keywords_are_deprecated(hf_rollout: Any, fn: str, legacy: dict[str, Any]) -> None:
    model, _, batch = hf_rollout
    seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
    p = seq.shape[1] - mask.shape[1]
    shown = ", ".join(f"{k}={v!r}" for k, v in legacy.items())
    with pytest.warns(DeprecationWarning, match=re.escape(f"lk.hf.{fn}(") + r".*" + re.escape(f"is deprecated: pass sampling=lk.Sampling({shown})")):
        old = getattr(lk.hf, fn)(model, seq, am, p, outside="-inf", **legacy)
    new = getattr(lk.hf, fn)(model, seq, am, p, outside="-inf", sampling=lk.Sampling(**legacy))
    assert torch.equal(old, new)


# --- the reference under a truncating sampler --------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_reference_logprobs_of_a_truncating_sampler_are_the_references_softmax_at_its_temperature(hf_rollout: Any) -> None:
    model, sampling, batch = hf_rollout
    seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
    p = seq.shape[1] - mask.shape[1]
    ref = lk.hf.reference_logprobs(model, seq, am, p, sampling=sampling)
    # float64 from the formula: log softmax(z_ref / T)[y] of the model with its adapters off
    with torch.no_grad(), lk.hf.adapters_disabled(model):
        z = model(input_ids=seq, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits[:, p - 1 : -1]
    want = torch.log_softmax(z.double() / sampling.temperature, -1).gather(-1, seq[:, p:, None])[..., 0]
    assert_close(ref.double()[mask], want[mask], rtol=0, atol=1e-5)
    assert torch.isfinite(ref[mask]).all()
    # the reference's own kept set would remove some sampled tokens: -inf there (an infinite KL term)
    own = lk.token_logprobs(z, seq[:, p:].masked_fill(~mask, -100), sampling=sampling, ignore_index=-100, outside="-inf")
    assert (own[mask] == float("-inf")).any(), "the test's rollout must hold a token the reference's top-p removes"
    # kept_from= the policy's logits: the reference renormalized on the policy's kept set
    _, logits = lk.hf.response_logprobs(model, seq, am, p, sampling=sampling, return_logits=True)
    kept = lk.hf.reference_logprobs(model, seq, am, p, sampling=sampling, kept_from=logits)
    want_kept = lk.token_logprobs(z, seq[:, p:].masked_fill(~mask, -100), sampling=sampling, ignore_index=-100, kept_from=logits)
    assert_close(kept[mask], want_kept[mask], rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['temprature'\]"):
        lk.hf.reference_logprobs(model, seq, am, p, temprature=0.7)


# --- one ratio band ------------------------------------------------------------------------------------


def test_the_example_logs_the_share_outside_the_band_of_lk_hf_check() -> None:
    assert lk.hf.RATIO_BAND == (0.99, 1.01)
    source = (ROOT / "examples" / "hf_grpo.py").read_text()
    assert "hf.RATIO_BAND" in source
    assert "(r < 0.9)" not in source and "(r > 1.1)" not in source


# --- D3: no deprecated name in what users read or copy -------------------------------------------------


def _deprecated_names() -> list[str]:
    from lightning_kl import _DEPRECATED

    return sorted(_DEPRECATED)


def test_no_example_config_or_doc_names_a_deprecated_name() -> None:
    names = "|".join(_deprecated_names())
    pattern = re.compile(rf"\b(?:lightning_kl|lk)\.({names})\b|from lightning_kl import [^\n]*\b({names})\b")
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.py")),
             *sorted((ROOT / "examples").rglob("*.yaml")), *sorted((ROOT / "benchmarks").glob("*.py"))]
    hits = []
    for path in files:
        text = path.read_text()
        if path.name == "api.md":  # its "Deprecated names" section documents them, by design
            text = text.split("## Deprecated names")[0]
        for number, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "deprecated names:\n" + "\n".join(hits)
    assert len(files) > 40


# --- the README's two commands run every test a CPU can run -----------------------------------------


def _readme_test_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("Install, then run the tests")[1].split("```bash\n")[1].split("```")[0]
    return [c.strip() for line in block.splitlines() for c in line.split("&&") if c.strip()]


def test_ci_runs_the_readmes_install_and_test_commands() -> None:
    commands = _readme_test_commands()
    assert commands[-1] == "python -m pytest -q"
    stacks = [c for c in commands if "--target .stacks" in c]
    assert stacks and all(v in stacks[0] for v in ("verl==0.9.1", "trl==1.16.0", "openrlhf==0.11.2"))
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
    for command in commands:
        words = [w for w in command.split() if w not in ("--quiet", "--upgrade")]
        if words[:2] == ["pip", "install"]:
            words = ["python", "-m", *words]
        assert any(
            [w for w in line.split() if w not in ("--quiet", "--upgrade")] == words
            or (".[test]" in command and line.startswith("python -m pip install") and ".[test," in line)
            for line in ci
        ), f".ci/run does not run the README's {command!r}"
    assert "unset LIGHTNING_KL_STACKS" in ci  # the README's .stacks, not a folder of its own
    assert ".stacks/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_stack_tests_find_the_readmes_stacks_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import _mismatch_stacks

    monkeypatch.delenv("LIGHTNING_KL_STACKS", raising=False)
    monkeypatch.setattr(_mismatch_stacks, "DEFAULT_STACKS", tmp_path / ".stacks")
    assert _mismatch_stacks.stacks_folder() == ""  # no folder: the environment, then a skip
    (tmp_path / ".stacks").mkdir()
    assert _mismatch_stacks.stacks_folder() == str(tmp_path / ".stacks")
    monkeypatch.setenv("LIGHTNING_KL_STACKS", "/elsewhere")
    assert _mismatch_stacks.stacks_folder() == "/elsewhere"
    assert _mismatch_stacks.DEFAULT_STACKS != ROOT  # and the real default is the repository's .stacks
    monkeypatch.undo()
    assert _mismatch_stacks.DEFAULT_STACKS == ROOT / ".stacks"


def test_a_model_that_sampled_with_generate_kwargs_remembers_its_sampler() -> None:
    import test_doc_snippets as snippets_test

    model = snippets_test.tiny_model()
    seq = torch.randint(3, 15, (2, 6))
    am = torch.ones_like(seq)
    kwargs = lk.Sampling(temperature=0.8, top_k=3).generate_kwargs(model)  # what generate(**kwargs) draws with
    assert kwargs["top_k"] == 3
    with pytest.warns(lk.hf.SamplerMismatchWarning, match=r"sampling=Sampling\(temperature=0.8, top_k=3"):
        lk.hf.response_logprobs(model, seq, am, 3)
    other = snippets_test.tiny_model()  # another model object: nothing remembered
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lk.hf.response_logprobs(other, seq, am, 3)
        lk.Sampling().generate_kwargs(other)  # the plain softmax, remembered: silent
        lk.hf.response_logprobs(other, seq, am, 3)
