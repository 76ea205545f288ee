"""The figures and fixes of ``docs/migration.md`` added by the issue "The second hour".

* ``old_logprob=`` is not neutral on-policy: the gradient of ``k1``, ``k3`` and ``low_var_kl`` changes,
  that of ``k2`` and the ``+`` names does not (the figures the page quotes);
* the TRL rows write ``coef=beta``, and the verl block adds a ``KLRewardCallback`` only for
  ``use_kl_in_reward: True``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import lightning_kl as lk

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "migration.md"


def _gradients(estimator: str) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    # 8 x 16 tokens sampled from random logits over 64 tokens (on-policy), a random reference, float64
    torch.manual_seed(0)
    z = torch.randn(8, 16, 64, dtype=torch.float64, requires_grad=True)
    z_ref = torch.randn(8, 16, 64, dtype=torch.float64)
    tokens = torch.distributions.Categorical(logits=z.detach()).sample()
    mask = torch.ones(8, 16, dtype=torch.bool)
    out = []
    for old in (False, True):
        lp = torch.log_softmax(z, -1).gather(-1, tokens[..., None])[..., 0]
        ref = torch.log_softmax(z_ref, -1).gather(-1, tokens[..., None])[..., 0]
        kwargs = {"old_logprob": lp.detach()} if old else {}
        loss = lk.KLPenaltyLoss(estimator, coef=1.0, agg="token-mean")(lp, ref, mask, **kwargs)
        out.append((float(loss.detach()), torch.autograd.grad(loss, z)[0]))
    (v0, g0), (v1, g1) = out
    return g0, g1, v0, v1


@pytest.mark.parametrize(("estimator", "relative", "cosine"), [("k3", 1.14, 0.77), ("low_var_kl", 1.14, 0.77),
                                                              ("k1", 1.72, None), ("k2", 0.0, 1.0),
                                                              ("k3+", 0.0, 1.0), ("low_var_kl+", 0.0, 1.0)])
def test_old_logprob_changes_k3s_gradient_on_policy(estimator: str, relative: float, cosine: float) -> None:
    g0, g1, v0, v1 = _gradients(estimator)
    assert v0 == pytest.approx(v1, rel=1e-12)  # the weight is 1 on-policy: the same value
    rel = float((g1 - g0).norm() / g0.norm())
    assert rel == pytest.approx(relative, abs=0.005)
    if cosine is not None:
        assert float((g0 * g1).sum() / (g0.norm() * g1.norm())) == pytest.approx(cosine, abs=0.005)
    text = GUIDE.read_text()
    if relative:
        assert f"{relative:.2f}" in text


def test_the_trl_rows_write_coef_beta() -> None:
    text = GUIDE.read_text()
    trl = text.split("## TRL")[1].split("\n## ")[0]
    rows = [line for line in trl.splitlines() if "KLPenaltyLoss(" in line]
    assert rows and all("coef=beta" in row for row in rows), rows
    assert "coef=0.001" not in trl


def test_the_verl_callback_is_for_use_kl_in_reward_true_only() -> None:
    text = GUIDE.read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    assert "use_kl_in_reward=True" in block and "KLRewardCallback" in block
    before = text.split("```yaml")[0].rsplit("```", 1)[-1]  # the text between the python block and this one
    assert "use_kl_in_reward: True" in before and "use_kl_in_reward: False" in before
    row = next(line for line in text.splitlines() if line.startswith("| `algorithm.use_kl_in_reward`"))
    assert "`False`: no callback" in row


def test_the_trl_loss_type_default_names_the_versions() -> None:
    trl = GUIDE.read_text().split("## TRL")[1].split("\n## ")[0]
    row = next(line for line in trl.splitlines() if line.startswith("| `loss_type` left at its default"))
    for version in ("v0.17", "v0.14", "v1.9", '"dapo"', '"bnpo"'):
        assert version in row
