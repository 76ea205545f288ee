r"""The Hugging Face GRPO example with a real rollout/trainer mismatch, measured and corrected.

    python examples/hf_mismatch.py fit --config examples/configs/hf_grpo_lora.yaml --data.sampling.top_p=1.0 \
        --data.engine=stale --model.correction=token_tis --trainer.logger.init_args.name=stale_token_tis
    python examples/hf_mismatch.py plot runs/hf_grpo docs/hf_mismatch.png stale_none stale_token_tis ...

``examples/hf_grpo.py`` samples with the policy it trains. Here the rollouts come from an *engine*
that is not the trainer (``--data.engine``):

* ``bfloat16``: a copy of the policy in bfloat16 samples the responses (``generate``), the trainer
  scores them in float32, as an inference engine in another dtype would;
* ``stale``: a copy of the policy refreshed every ``--data.engine_lag`` rollouts samples them, as an
  asynchronous engine one or more updates behind would;
* ``policy``: no mismatch (``hf_grpo.py`` itself).

The engine's log-probs (``sampler_logprobs``, from ``generate``'s processed scores) are the rollout
log-probs :math:`\mu`; the trainer's at rollout time (``logprobs``) are :math:`\pi_{old}`. Every step logs
:func:`lightning_kl.mismatch_metrics` of the two (``mismatch/*``), and ``--model.correction`` puts a
:class:`lightning_kl.RolloutCorrection` into the loss with the recipe of ``docs/mismatch.md``:
``none`` (the engine's samples used as if the trainer had drawn them), ``token_tis``
(``RolloutCorrection("token", upper=2.0)``) or ``seq_tis`` (``"sequence"``, ``upper=2.0``). The KL
term's sampler is the engine in every case (``old_logprob=sampler_logprobs``).
"""

from __future__ import annotations

import copy
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

import lightning_kl as lk
from lightning_kl import hf

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runs  # noqa: E402
import hf_grpo  # noqa: E402

ENGINES = ("policy", "bfloat16", "stale")
CORRECTIONS: dict[str, Optional[dict[str, Any]]] = {
    "none": None,
    "token_tis": dict(weights="token", upper=2.0),
    "seq_tis": dict(weights="sequence", upper=2.0),
}


class EngineDataModule(hf_grpo.ArithmeticDataModule):
    """``ArithmeticDataModule`` whose responses come from an engine that is not the trained policy.

    Args:
        engine: one of ``"policy"``, ``"bfloat16"``, ``"stale"`` (module docstring).
        engine_lag: ``"stale"``: rollouts between two refreshes of the engine's copy.
        kwargs: ``ArithmeticDataModule``'s.
    """

    def __init__(self, *args: Any, engine: str = "bfloat16", engine_lag: int = 4, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if engine not in ENGINES:
            raise ValueError(f"unknown `engine` {engine!r}; valid engines: {', '.join(ENGINES)}.")
        if not (isinstance(engine_lag, int) and engine_lag >= 1):
            raise ValueError(f"`engine_lag` must be an integer >= 1, got {engine_lag!r}.")
        self.engine, self.engine_lag = engine, engine_lag
        self._copy: Any = None
        self._rollouts = 0

    def _engine(self, model: Any) -> Any:
        if self.engine == "bfloat16":
            return copy.deepcopy(model).to(torch.bfloat16)
        if self._copy is None or self._rollouts % self.engine_lag == 0:
            self._copy = copy.deepcopy(model)
        return self._copy

    @torch.no_grad()
    def sample(self, model: Any, problems: list[tuple[int, int]], device: torch.device, synced: bool = False) -> dict[str, Tensor]:
        return super().sample(model if self.engine == "policy" else self._engine(model), problems, device, synced)

    @torch.no_grad()
    def rollout(self, module: Any, n_prompts: Optional[int] = None) -> dict[str, Tensor]:
        batch = super().rollout(module, n_prompts)
        self._rollouts += 1
        return batch

    @torch.no_grad()
    def reference_accuracy(self, module: Any, n: Optional[int] = None) -> float:
        engine, self.engine = self.engine, "policy"  # the reference's own accuracy, sampled exactly
        try:
            return super().reference_accuracy(module, n)
        finally:
            self.engine = engine


class MismatchGRPO(hf_grpo.HFGRPO):
    """``HFGRPO`` with the rollout correction of ``docs/mismatch.md`` in its loss.

    Args:
        correction: ``"none"``, ``"token_tis"`` or ``"seq_tis"`` (module docstring).
        kwargs: ``HFGRPO``'s.
    """

    def __init__(self, *args: Any, correction: str = "none", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if correction not in CORRECTIONS:
            raise ValueError(f"unknown `correction` {correction!r}; valid: {', '.join(CORRECTIONS)}.")
        cfg = CORRECTIONS[correction]
        self.correction = lk.RolloutCorrection(**cfg) if cfg is not None else None

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
        p = seq.shape[1] - mask.shape[1]
        returns = batch["scores"]
        adv = _runs.group_advantages(returns, batch["group"])[:, None]
        dm = self.trainer.datamodule
        logprobs = hf.response_logprobs(self.policy, seq, am, p, **dm.scoring)
        old, rollout = batch["logprobs"], batch["sampler_logprobs"]  # pi_old (trainer), mu (engine)
        ratio = torch.exp(logprobs - old)
        clipped = ratio.clamp(1 - self.hparams.clip_eps, 1 + self.hparams.clip_eps)
        surrogate = -torch.minimum(ratio * adv, clipped * adv)
        keep = mask
        if self.correction is not None:
            fix = self.correction(old, rollout, mask)
            surrogate, keep = fix.weights * surrogate, fix.mask
            self.log("mismatch/weight_mean", fix.metrics["rollout_is_mean"], batch_size=mask.shape[0])
        pg_loss = lk.aggregate(surrogate, keep, "token-mean")
        kl_loss = self.kl(logprobs, batch["ref_logprobs"], keep, old_logprob=rollout)
        n = mask.shape[0]
        metrics = lk.mismatch_metrics(old, rollout, mask)
        for key in ("kl", "k3_kl", "chi2_seq", "logp_abs_diff_max", "token_mult_prob_error"):
            self.log(f"mismatch/{key}", metrics[key], batch_size=n)
        self.log("train/acc", batch["scores"].mean(), prog_bar=True, batch_size=n)
        self.log("train/reward", returns.mean(), batch_size=n)
        self.log("train/kl_seq", batch["true_kl"].sum(-1).mean(), batch_size=n)
        self.log("train/ref_acc", self.ref_acc, batch_size=n)
        self.log("train/elapsed_s", time.perf_counter() - self._train_start, batch_size=n)
        return pg_loss + kl_loss


def _series(csv_path: Path, key: str) -> list[float]:
    import csv

    with open(csv_path) as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


def _running_mean(values: list[float], k: int = 15) -> list[float]:
    return [sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def plot(save_dir: Path, runs: list[str], out: Path) -> str:
    """The mismatch (k3_kl per token) and the accuracy of every run over its rollouts; a markdown table."""
    plt = _runs.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    lines = ["| run | k3_kl per token (mean) | max abs log-prob difference (mean) | accuracy, last quarter |",
             "|---|---|---|---|"]  # fmt: skip
    for name in runs:
        version = _runs.latest_version(save_dir / name)
        assert version is not None, f"no run {name} under {save_dir}"
        csv_path = version / "metrics.csv"
        k3, acc = _series(csv_path, "mismatch/k3_kl"), _series(csv_path, "train/acc")
        gap = _series(csv_path, "mismatch/logp_abs_diff_max")
        axes[0].semilogy(_running_mean(k3), label=name)
        axes[1].plot(_running_mean(acc), label=name)
        lines.append(f"| {name} | {sum(k3) / len(k3):.2e} | {sum(gap) / len(gap):.3f} | {_runs.last_quarter_mean(acc):.3f} |")
    axes[0].set(title="mismatch: k3_kl per token (mean of 15 rollouts)", xlabel="rollout", ylim=(1e-6, 1e-1))
    axes[1].set(title="accuracy of sampled answers (mean of 15)", xlabel="rollout", ylim=(0, 1))
    axes[1].legend(fontsize=7)
    _runs.save_figure(fig, "GRPO with a bfloat16 or stale engine, with and without correction", out)
    return "\n".join(lines)


def main(args: Optional[list[str]] = None, run: bool = True) -> Any:
    warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
    return hf_grpo.HFGRPOCLI(MismatchGRPO, EngineDataModule, args=args, run=run, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "plot":  # python examples/hf_mismatch.py plot SAVE_DIR OUT.png RUN...
        print(plot(Path(sys.argv[2]), sys.argv[4:], Path(sys.argv[3])))
        sys.exit(0)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    main()
