"""Statements of the README and ``docs/`` that were wrong, each run where it can be:

* verl's ``+`` names: the pinned verl 0.9.1's own ``kl_penalty`` (read from ``.stacks``) runs them and
  gives ours; the releases that crashed are named;
* TRL 1.16's ``use_bias_correction_kl`` default, as ``docs/migration.md`` states it;
* the gradient change of ``old_logprob=`` on-policy: the range over 5 seeds that the page prints;
* LightningCLI needs jsonargparse, the ``cli`` extra, which the README's ``[hf]`` install now names;
* where the last line of a bad YAML value is the library's message, and where it is jsonargparse's
  (a real LightningCLI parse);
* the README's timing names its machines; ``examples/entropy_study.py`` builds without Lightning's
  ``save_hyperparameters`` warning.
"""

from __future__ import annotations

import ast
import math
import re
import subprocess
import sys
import textwrap
import tomllib
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import pytest
import torch

import lightning_kl as lk
from _mismatch_stacks import package_root

ROOT = Path(__file__).resolve().parents[1]
MIGRATION = (ROOT / "docs" / "migration.md").read_text()
README = (ROOT / "README.md").read_text()

# ---------------------------------------------------------------------------------------------
# verl's `+` names

#: verl's names (with a `+`) and ours (docs/migration.md's mapping)
VERL_PLUS = {"kl+": "k1+", "k1+": "k1+", "abs+": "abs+", "mse+": "k2+", "k2+": "k2+", "low_var_kl+": "low_var_kl+", "k3+": "low_var_kl+"}


def _verl_kl_functions() -> dict[str, Any]:
    """verl 0.9.1's ``kl_penalty`` and ``kl_penalty_forward``, their source taken from the pinned release."""
    path = package_root("verl") / "trainer" / "ppo" / "core_algos.py"
    tree = ast.parse(path.read_text())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("kl_penalty", "kl_penalty_forward")]
    assert len(wanted) == 2
    ns: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), ns)
    return ns


@pytest.mark.parametrize("verl_name", sorted(VERL_PLUS))
def test_verl_091_plus_names_run_and_are_ours(verl_name: str) -> None:
    verl = _verl_kl_functions()
    d = torch.linspace(-25, 25, 201, dtype=torch.float64)
    ref = torch.full_like(d, -30.0)  # log-probs <= 0 on the whole grid
    out = []
    for fn in (lambda a, b: verl["kl_penalty"](a, b, verl_name), lambda a, b: lk.kl_penalty(a, b, VERL_PLUS[verl_name])):
        lp = (ref + d).clone().requires_grad_(True)
        value = fn(lp, ref)
        (grad,) = torch.autograd.grad(value.sum(), lp)
        out.append((value.detach(), grad))
    (v_verl, g_verl), (v_ours, g_ours) = out
    torch.testing.assert_close(v_ours, v_verl, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_ours, g_verl, rtol=1e-12, atol=1e-12)


def test_the_releases_before_the_fix_crashed_as_the_page_says() -> None:
    # before verl PR 6058 the `+` reached kl_penalty_forward unstripped: that function raises for it
    verl = _verl_kl_functions()
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    with pytest.raises(NotImplementedError):
        verl["kl_penalty_forward"](lp, ref, "k3+")
    row = next(line for line in MIGRATION.splitlines() if line.startswith("| `kl_loss_type` or `kl_penalty` with `+`"))
    for words in ("verl 0.9.1", "pull request 6058", "v0.8.0", "v0.9.0", "v0.6.0, v0.6.1 and v0.7.0", "NotImplementedError"):
        assert words in row, words
    assert "At the commit we read, every `+` name raised" not in MIGRATION


# ---------------------------------------------------------------------------------------------
# TRL's use_bias_correction_kl


def test_trl_116_use_bias_correction_kl_default_is_what_the_page_says() -> None:
    config = (package_root("trl") / "trainer" / "grpo_config.py").read_text()
    assert re.search(r"    use_bias_correction_kl: bool = field\(\n        default=True,", config)
    trl = MIGRATION.split("## TRL")[1].split("\n## ")[0]
    row = next(line for line in trl.splitlines() if line.startswith("| `use_bias_correction_kl`"))
    assert "`True` in TRL 1.16" in row
    assert "TRL 1.16 (the pinned release) turns `use_bias_correction_kl`\n  on by default" in MIGRATION


# ---------------------------------------------------------------------------------------------
# a single seed's figure


def _change(estimator: str, seed: int) -> tuple[float, float]:
    """tests/test_migration_fixes.py's batch with another seed: the gradient's relative change and cosine."""
    torch.manual_seed(seed)
    z = torch.randn(8, 16, 64, dtype=torch.float64, requires_grad=True)
    z_ref = torch.randn(8, 16, 64, dtype=torch.float64)
    tokens = torch.distributions.Categorical(logits=z.detach()).sample()
    mask = torch.ones(8, 16, dtype=torch.bool)
    grads = []
    for old in (False, True):
        lp = torch.log_softmax(z, -1).gather(-1, tokens[..., None])[..., 0]
        ref = torch.log_softmax(z_ref, -1).gather(-1, tokens[..., None])[..., 0]
        kwargs = {"old_logprob": lp.detach()} if old else {}
        loss = lk.KLPenaltyLoss(estimator, coef=1.0, agg="token-mean")(lp, ref, mask, **kwargs)
        grads.append(torch.autograd.grad(loss, z)[0])
    g0, g1 = grads
    return float((g1 - g0).norm() / g0.norm()), float((g0 * g1).sum() / (g0.norm() * g1.norm()))


def test_the_old_logprob_figures_are_a_range_over_five_seeds() -> None:
    k3 = [_change("k3", seed) for seed in range(5)]
    k1 = [_change("k1", seed) for seed in range(5)]
    rel, cos = [r for r, _ in k3], [c for _, c in k3]
    text = " ".join(MIGRATION.split())
    assert f"changes by **{min(rel):.2f} to {max(rel):.2f}** relative (cosine {min(cos):.2f} to {max(cos):.2f})" in text
    assert f"({k3[0][0]:.2f} and {k3[0][1]:.2f} with seed 0)" in text
    assert f"by {min(r for r, _ in k1):.2f} to {max(r for r, _ in k1):.2f} for `k1`" in text


# ---------------------------------------------------------------------------------------------
# the cli extra


def test_lightning_cli_needs_jsonargparse_which_the_cli_extra_brings() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("jsonargparse") for dep in extras["cli"])
    assert not any(dep.startswith("jsonargparse") for dep in extras["hf"])  # hence `.[hf,cli]`
    assert all(any(dep.startswith("jsonargparse") for dep in extras[name]) for name in ("examples", "test"))
    assert 'pip install -e ".[hf,cli]"' in README and "the `cli` extra" in README
    # the statement itself: without jsonargparse, LightningCLI does not import
    code = "import sys; sys.modules['jsonargparse'] = None\nfrom lightning.pytorch.cli import LightningCLI"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "jsonargparse" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# the last line of a bad YAML value


def _last_line(args: list[str]) -> tuple[str, str]:
    """The last line of the error a LightningCLI parse raises for ``args``, and the whole report."""
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    class Module(pl.LightningModule):
        def __init__(
            self,
            estimator: lk.EstimatorName = "k3",
            kl_coef: Union[float, lk.KLController] = 0.1,
            bonus: Optional[lk.EntropyBonus] = None,
        ) -> None:
            super().__init__()
            self.kl = lk.KLPenaltyLoss(estimator, coef=kl_coef)
            self.bonus = bonus

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException) as info:
            LightningCLI(Module, run=False, args=args, save_config_callback=None, trainer_defaults={"logger": False})
    report = "".join(traceback.format_exception(info.value)).strip()
    return report.splitlines()[-1], report


def test_the_last_line_is_the_library_s_for_an_argument_of_the_module() -> None:
    last, _ = _last_line(["--model.estimator=k4"])
    assert last.startswith("ValueError: Unknown KL estimator 'k4'"), last
    lightning = (ROOT / "docs" / "lightning.md").read_text()
    assert "For an argument of the module itself (`model.estimator: k4`), the last line a YAML" in lightning


@pytest.mark.parametrize(
    "arg,library_message",
    [
        ('--model.kl_coef={"class_path":"lightning_kl.AdaptiveKLController","init_args":{"target_kl":-1.0}}', "`target_kl` must be > 0"),
        ('--model.bonus={"class_path":"lightning_kl.EntropyBonus","init_args":{"agg":"nope"}}', "Unknown aggregation mode 'nope'"),
    ],
)
def test_inside_a_class_path_block_the_last_line_is_jsonargparse_s(arg: str, library_message: str) -> None:
    last, report = _last_line([arg])
    assert last.startswith("Given value: Namespace(class_path='lightning_kl."), last
    errors = report.split("Errors:")[1].split("Given value type:")[0]
    assert library_message in errors, report[-3000:]
    lightning = " ".join((ROOT / "docs" / "lightning.md").read_text().split())
    assert "the last line is jsonargparse's `Given value: Namespace(...)`" in lightning
    entropy = " ".join((ROOT / "docs" / "entropy.md").read_text().split())
    assert "the last line is jsonargparse's `Given value: Namespace(...)`" in entropy
    assert "so the last line a YAML user sees is the library's message" not in lightning


# ---------------------------------------------------------------------------------------------
# timings, friction


def test_the_readme_s_timing_names_its_machines() -> None:
    setup = " ".join(README.split("## Set-up")[1].split("```")[0].split())
    assert "30-40 s" not in README
    for words in ("CPU time", "2-core AMD EPYC", "2-core Intel Xeon", "load average"):
        assert words in setup, words


def test_the_entropy_study_module_is_built_without_the_save_hyperparameters_warning() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import entropy_study
    finally:
        sys.path.remove(str(ROOT / "examples"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = entropy_study.EntropyToy(entropy_bonus=lk.EntropyBonus(coef=0.1), top_entropy=0.2)
    assert "entropy_bonus" not in module.hparams and module.hparams["top_entropy"] == 0.2
    assert isinstance(module.entropy_bonus, lk.EntropyBonus)
