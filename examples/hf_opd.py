r"""On-policy distillation (OPD) of a Hugging Face student from a larger teacher, both made here.

    python examples/hf_opd.py fit --config examples/configs/hf_opd.yaml                                # a local teacher
    python examples/hf_opd.py fit --config examples/configs/hf_opd.yaml --model.teacher_form=topk \
        --trainer.logger.init_args.name=hf_opd_topk                                                      # a served top-k

Everything is made on a CPU with no download, on the task of ``examples/hf_grpo.py`` (its tokenizer,
``a+b=``, the exact-answer check, its model builder):

1. **Teacher.** A ``Qwen2ForCausalLM`` (or Llama) larger than the student (``teacher_*`` sizes), trained
   in code on a corpus whose answers are all right (``teacher_p_correct``). Cached under ``cache_dir``.
2. **Student.** A smaller model of the same family, pretrained on the careless corpus of ``hf_grpo.py``
   (only ``p_correct`` of its answers right, the others copy an operand). Cached too. All its weights train.
3. **OPD.** The student samples (``model.generate`` with the data's ``lk.Sampling``) inside the data
   pipeline (:class:`lightning_kl.OnPolicyRollouts`); the teacher scores the student's tokens; the loss is
   :class:`lightning_kl.KLPenaltyLoss` ``("full", divergence=...)`` per token, no reward. The teacher comes
   in one of two forms (``teacher_form``):

   * ``"hidden"``: a local teacher, from its last hidden states and LM head,
     ``self.kl(lk.FromHidden(h, student.lm_head.weight), lk.FromHidden(h_T, teacher.lm_head.weight), mask)``:
     the exact divergence over the vocabulary, the logits never made whole;
   * ``"topk"``: the teacher's ``topk`` most likely ids and their log-probs at every response position, as a
     server returns them (vLLM's ``prompt_logprobs=k``; here at the rollout's temperature, padded with ``-inf``
     after the response), ``self.kl(lk.FromHidden(h, W), lk.TopK(ids, logprobs), mask)``: the divergence
     coarsened onto the ``k`` ids and a tail (``docs/distillation.md``), a lower bound of the full one.

   Logged per step: ``opd/kl_exact``, the student's exact ``KL(student || teacher)`` per token over the
   vocabulary on its own rollout (whatever the loss's form and direction), ``opd/kl_exact_seq`` its sum per
   response, ``train/acc`` the accuracy of the student's samples (the teacher's, ``train/teacher_acc``, is
   measured once at the start), ``opd/loss`` the loss's divergence (the loss's metric), and with ``"topk"``
   each row's tail mass for both models (``opd/student_tail``, ``opd/teacher_tail``).

Notation: ``b`` rollouts in a batch, ``p`` the padded prompt length, ``t`` the response length.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import Tensor
from torch.utils.data import DataLoader

import lightning_kl as lk
from lightning_kl import hf

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests): find the siblings
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runs  # noqa: E402  (examples/_runs.py: pretraining and its cache, rollout loader, metrics CSV)
import hf_grpo as task  # noqa: E402  (the tokenizer, the task, the reward and the model builder)

TEACHER_FORMS = ("hidden", "topk")


def response_hidden(model: Any, sequences: Tensor, attention_mask: Tensor, p: int) -> Tensor:
    """The last hidden states (after the final norm) at the positions that predict the response: ``[b, t, d]``.

    One forward pass, positions numbered from each row's first real token as ``generate`` did; the LM head runs
    on one position only (``logits_to_keep=1``): the engine applies it chunk by chunk (``lk.FromHidden``).
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids,
                output_hidden_states=True, logits_to_keep=1, use_cache=False)
    return out.hidden_states[-1][:, p - 1 : -1]


def served_topk(logits: Tensor, mask: Tensor, k: int, temperature: float = 1.0) -> lk.TopK:
    """A teacher's top-k as an inference server returns it: per response position its ``k`` most likely ids and
    their float32 log-probs at ``temperature``; positions after the response padded (id 0, log-prob ``-inf``)."""
    lp, ids = torch.log_softmax(logits.float() / temperature, dim=-1).topk(k, dim=-1)
    pad = ~mask.unsqueeze(-1)
    return lk.TopK(ids.masked_fill(pad, 0), lp.masked_fill(pad, float("-inf")))


# ---------------------------------------------------------------------------------------------
# the data pipeline: the student's rollouts, scored by the teacher


class OPDDataModule(pl.LightningDataModule):
    """The environment: the addition problems, both corpora, the reward (measured, not trained on), the rollouts.

    Args:
        max_operand: operands are in ``[0, max_operand)``.
        p_correct: the share of right answers in the student's pretraining corpus.
        teacher_p_correct: the same for the teacher's.
        max_new_tokens: the response length limit.
        prompts_per_rollout: rollouts per batch (one answer each; OPD needs no groups).
        rollouts: rollout batches per epoch (one ``training_step`` each).
        sampling: the student's sampler (:class:`lightning_kl.Sampling`): ``generate`` draws with
            ``sampling.generate_kwargs()``, and the loss is the divergence of that distribution.
        teacher_samples: samples drawn from the teacher at the start to measure its accuracy.
        eval_prompts: problems of the fixed evaluation set: their right answers, on which the student's exact KL
            to the teacher is measured before and after distillation (:meth:`HFOPD.eval_kl`).
    """

    def __init__(
        self,
        max_operand: int = 14,
        p_correct: float = 0.4,
        teacher_p_correct: float = 1.0,
        max_new_tokens: int = 3,
        prompts_per_rollout: int = 64,
        rollouts: int = 300,
        sampling: lk.Sampling = lk.Sampling(),
        teacher_samples: int = 512,
        eval_prompts: int = 256,
    ) -> None:
        super().__init__()
        if not 1 <= max_operand <= 1000:
            raise ValueError(f"`max_operand` must be in [1, 1000], got {max_operand!r}.")
        for name, value in (("p_correct", p_correct), ("teacher_p_correct", teacher_p_correct)):
            if not 0 <= value <= 1:
                raise ValueError(f"`{name}` must be in [0, 1], got {value!r}.")
        if max_new_tokens < len(str(2 * max_operand - 2)) + 1:
            raise ValueError(f"`max_new_tokens` {max_new_tokens} cannot hold the answer {2 * max_operand - 2} and EOS.")
        if isinstance(sampling, dict):  # a YAML's mapping, given to the class directly (not through the CLI)
            sampling = lk.Sampling(**sampling)
        if not isinstance(sampling, lk.Sampling):
            raise TypeError(f"`sampling` must be a lightning_kl.Sampling (or a mapping of its fields), got {type(sampling).__name__}.")
        for name, value in (("prompts_per_rollout", prompts_per_rollout), ("rollouts", rollouts),
                            ("teacher_samples", teacher_samples), ("eval_prompts", eval_prompts)):
            if not value >= 1:
                raise ValueError(f"`{name}` must be >= 1, got {value!r}.")
        self.save_hyperparameters()
        self.sampling = sampling
        self.tokenizer = task.build_tokenizer()

    @property
    def max_length(self) -> int:
        """The longest prompt + response, in tokens (for the models' position tables)."""
        return 1 + 2 * len(str(self.hparams.max_operand - 1)) + 2 + self.hparams.max_new_tokens

    def _generator(self, rank: int) -> torch.Generator:
        return torch.Generator().manual_seed(int(torch.randint(2**62, ())) + rank)

    @torch.no_grad()
    def sample(self, model: Any, problems: list[tuple[int, int]], device: torch.device) -> dict[str, Tensor]:
        """One answer per problem from ``model`` (``generate`` with the sampler): sequences, masks, scores."""
        enc = self.tokenizer([task.prompt_text(a, b) for a, b in problems], return_tensors="pt", padding=True)
        prompt_ids, prompt_am = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        seq = model.generate(input_ids=prompt_ids, attention_mask=prompt_am, max_new_tokens=self.hparams.max_new_tokens,
                             pad_token_id=task.PAD_ID, eos_token_id=task.EOS_ID, **self.sampling.generate_kwargs(model))
        p = prompt_ids.shape[1]
        mask = hf.response_mask(seq[:, p:], task.EOS_ID)
        attention_mask, _ = hf.sequence_inputs(prompt_am, mask)
        return {"sequences": seq, "attention_mask": attention_mask, "mask": mask,
                "scores": task.score(self.tokenizer, seq[:, p:], mask, problems)}

    def answers(self, problems: list[tuple[int, int]], device: torch.device) -> dict[str, Tensor]:
        """The right answers written out (prompt, ``a + b``, EOS): the fixed sequences of :meth:`HFOPD.eval_kl`."""
        prompts = self.tokenizer([task.prompt_text(a, b) for a, b in problems], return_tensors="pt", padding=True)
        answers = [[int(c) + 3 for c in str(a + b)] + [task.EOS_ID] for a, b in problems]  # "0".."9" are ids 3..12
        t = max(len(x) for x in answers)
        responses = torch.tensor([x + [task.PAD_ID] * (t - len(x)) for x in answers])
        mask = hf.response_mask(responses, task.EOS_ID)
        attention_mask, _ = hf.sequence_inputs(prompts["attention_mask"], mask)
        seq = torch.cat([prompts["input_ids"], responses], dim=1)
        return {"sequences": seq.to(device), "attention_mask": attention_mask.to(device), "mask": mask.to(device)}

    @torch.no_grad()
    def rollout(self, module: "HFOPD") -> dict[str, Tensor]:
        """One batch of the student's rollouts, with the teacher's side in the module's form.

        ``sequences [b, p + t]``, ``attention_mask``, ``mask [b, t]``, ``scores [b]``, ``teacher_hidden [b, t, d_T]``
        (both forms: the exact KL is logged either way) and, for ``"topk"``, ``topk_ids``, ``topk_logprobs [b, t, k]``.
        """
        problems = task.sample_problems(self.hparams.prompts_per_rollout, self.hparams.max_operand,
                                        self._generator(module.global_rank))
        student = module.student
        was_training = student.training
        student.eval()
        batch = self.sample(student, problems, module.device)
        student.train(was_training)
        seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
        p = seq.shape[1] - mask.shape[1]
        batch["teacher_hidden"] = response_hidden(module.teacher, seq, am, p)
        if module.hparams.teacher_form == "topk":  # what a server would send back for these positions
            served = served_topk(module.teacher.lm_head(batch["teacher_hidden"]), mask, module.hparams.topk,
                                 self.sampling.temperature)
            batch["topk_ids"], batch["topk_logprobs"] = served.ids, served.logprobs
        return batch

    def train_dataloader(self) -> DataLoader:
        module = self.trainer.lightning_module if self.trainer is not None else None
        if not isinstance(module, HFOPD):
            raise RuntimeError("OPDDataModule samples from the student of the HFOPD module of its Trainer.")
        return _runs.rollout_loader(functools.partial(self.rollout, module), self.hparams.rollouts)


# ---------------------------------------------------------------------------------------------
# the LightningModule


class HFOPD(pl.LightningModule):
    """On-policy distillation of a ``transformers`` student from a larger teacher.

    Args:
        arch: ``"qwen2"`` or ``"llama"`` (both models).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: the student's shape.
        teacher_hidden_size, teacher_num_layers, teacher_num_heads, teacher_num_kv_heads,
            teacher_intermediate_size: the teacher's (larger) shape.
        pretrain_steps, teacher_pretrain_steps, pretrain_batch_size, pretrain_lr, pretrain_seed: stage 1, both models
            trained in code (each a function of its configuration, cached under ``cache_dir``).
        lr: the distillation learning rate (AdamW, all the student's weights).
        teacher_form: ``"hidden"`` (a local teacher, ``lk.FromHidden`` on both sides) or ``"topk"`` (its top-k
            log-probs as a server returns them, ``lk.TopK``).
        topk: ``k`` of the served top-k.
        divergence, beta, kl_coef, kl_agg: :class:`lightning_kl.KLPenaltyLoss` ``("full", ...)``, validated here
            (and again at setup with the data's sampler, which a forward direction refuses if it truncates).
    """

    def __init__(
        self,
        arch: str = "qwen2",
        hidden_size: int = 32,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        intermediate_size: int = 64,
        teacher_hidden_size: int = 64,
        teacher_num_layers: int = 3,
        teacher_num_heads: int = 4,
        teacher_num_kv_heads: int = 2,
        teacher_intermediate_size: int = 128,
        pretrain_steps: int = 400,
        teacher_pretrain_steps: int = 800,
        pretrain_batch_size: int = 128,
        pretrain_lr: float = 3e-3,
        pretrain_seed: int = 0,
        cache_dir: str = "runs/hf_opd/models",
        lr: float = 5e-3,
        teacher_form: str = "hidden",
        topk: int = 4,
        divergence: lk.Divergence = "reverse",
        beta: Optional[float] = None,
        kl_coef: float = 1.0,
        kl_agg: lk.AggMode = "token-mean",
    ) -> None:
        super().__init__()
        if arch not in ("qwen2", "llama"):
            raise ValueError(f"`arch` must be 'qwen2' or 'llama', got {arch!r}.")
        if teacher_form not in TEACHER_FORMS:
            raise ValueError(f"`teacher_form` must be one of {TEACHER_FORMS}, got {teacher_form!r}.")
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"`topk` must be an integer >= 1, got {topk!r}.")
        for name in ("pretrain_steps", "teacher_pretrain_steps"):
            if not (isinstance(locals()[name], int) and locals()[name] >= 0):
                raise ValueError(f"`{name}` must be an integer >= 0, got {locals()[name]!r}.")
        self.save_hyperparameters()
        self.kl = self._loss(lk.Sampling())  # the divergence, beta, coef and agg validated here, before any model
        self.student: Any = None
        self.teacher: Any = None
        self.teacher_acc = float("nan")
        self.eval_kl_start = self.eval_kl_end = float("nan")  # eval_kl on the fixed answers, before and after
        self.pretrain_seconds = 0.0
        self._train_start = 0.0

    def _loss(self, sampling: lk.Sampling) -> lk.KLPenaltyLoss:
        h = self.hparams
        return lk.KLPenaltyLoss("full", coef=h.kl_coef, agg=h.kl_agg, sampling=sampling, divergence=h.divergence, beta=h.beta)

    # -- stage 1: the teacher and the student ----------------------------------------------------

    def _shape(self, who: str) -> list[Any]:
        h, pre = self.hparams, "teacher_" if who == "teacher" else ""
        return [h.arch] + [h[pre + k] for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")]

    def trained_model(self, dm: OPDDataModule, who: str) -> Any:
        """The teacher or the student, trained on its corpus (or loaded from the cache)."""
        h = self.hparams
        shape = self._shape(who)
        steps = h.teacher_pretrain_steps if who == "teacher" else h.pretrain_steps
        p_correct = dm.hparams.teacher_p_correct if who == "teacher" else dm.hparams.p_correct
        build = lambda: task.build_model(*shape, dm.max_length)  # noqa: E731

        def batch_loss(model: Any, generator: torch.Generator) -> Tensor:
            lines = task.corpus_lines(h.pretrain_batch_size, dm.hparams.max_operand, p_correct, generator)
            enc = dm.tokenizer(lines, return_tensors="pt", padding=True).to(self.device)
            return model(**enc, labels=enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)).loss

        config = {"model": shape, "max_positions": dm.max_length, "pretrain": [steps, h.pretrain_batch_size, h.pretrain_lr,
                  h.pretrain_seed], "corpus": {"max_operand": dm.hparams.max_operand, "p_correct": p_correct}, "format": 1}
        pretrain = lambda: _runs.pretrain(lambda: build().to(self.device), batch_loss, steps=steps,  # noqa: E731
                                          lr=h.pretrain_lr, seed=h.pretrain_seed, tag=f"hf_opd {who}")
        state, _, _, seconds = _runs.load_or_pretrain(h.cache_dir, config, pretrain, f"hf_opd {who}")
        self.pretrain_seconds += seconds
        model = build()
        model.load_state_dict(state)
        return model

    def setup(self, stage: str) -> None:
        if stage != "fit" or self.student is not None:
            return
        dm = self.trainer.datamodule
        if not isinstance(dm, OPDDataModule):
            raise RuntimeError("HFOPD is trained with an OPDDataModule (it holds the task and the rollouts).")
        self.kl = self._loss(dm.sampling)  # the divergence of what the student samples (refused here if +inf)
        self.teacher = self.trained_model(dm, "teacher").requires_grad_(False).eval()
        self.student = self.trained_model(dm, "student")

    def on_fit_start(self) -> None:
        self.teacher.to(self.device)
        dm = self.trainer.datamodule
        problems = task.sample_problems(dm.hparams.teacher_samples, dm.hparams.max_operand, torch.Generator().manual_seed(1))
        self.teacher_acc = float(dm.sample(self.teacher, problems, self.device)["scores"].mean())

    def on_train_start(self) -> None:
        self.eval_kl_start = self.eval_kl(self._eval_batch(), self.kl.sampling)
        self._train_start = time.perf_counter()

    def on_train_end(self) -> None:
        self.eval_kl_end = self.eval_kl(self._eval_batch(), self.kl.sampling)

    def _eval_batch(self) -> dict[str, Tensor]:
        # the right answers to a fixed set of problems: the same sequences before and after distillation
        dm = self.trainer.datamodule
        problems = task.sample_problems(dm.hparams.eval_prompts, dm.hparams.max_operand, torch.Generator().manual_seed(2))
        return dm.answers(problems, self.device)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.student.parameters(), lr=self.hparams.lr, weight_decay=0.0)

    # -- stage 2: distillation -------------------------------------------------------------------

    @torch.no_grad()
    def eval_kl(self, batch: dict[str, Tensor], sampling: Optional[lk.Sampling] = None) -> float:
        """The student's exact token-mean ``KL(student || teacher)`` over the vocabulary on ``batch``'s responses."""
        seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
        p = seq.shape[1] - mask.shape[1]
        x = hf.from_hidden(self.student, response_hidden(self.student, seq, am, p))
        t = hf.from_hidden(self.teacher, response_hidden(self.teacher, seq, am, p))
        return float(lk.aggregate(lk.full_kl(x, t, mask, sampling=sampling), mask))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
        p = seq.shape[1] - mask.shape[1]
        student = lk.FromHidden(response_hidden(self.student, seq, am, p), self.student.lm_head.weight)
        local = lk.FromHidden(batch["teacher_hidden"], self.teacher.lm_head.weight)
        if self.hparams.teacher_form == "hidden":
            loss = self.kl(student, local, mask)
        else:
            served = lk.TopK(batch["topk_ids"], batch["topk_logprobs"])
            loss = self.kl(student, served, mask)
        n = mask.shape[0]
        detached = lk.FromHidden(student.hidden.detach(), student.weight.detach())
        with torch.no_grad():  # the exact KL of what the student samples, whatever the loss's form and direction
            exact = lk.full_kl(detached, local, mask, sampling=self.kl.sampling)
            if self.hparams.teacher_form == "topk":
                tails = lk.full_kl(detached, served, mask, sampling=self.kl.sampling, return_tails=True)
                self.log("opd/student_tail", tails.student_tail[mask].mean(), batch_size=n)
                self.log("opd/teacher_tail", tails.teacher_tail[mask].mean(), batch_size=n)
        self.log("opd/kl_exact", lk.aggregate(exact, mask), prog_bar=True, batch_size=n)
        self.log("opd/kl_exact_seq", exact.sum(-1).mean(), batch_size=n)
        self.log("opd/loss", self.kl.metric, batch_size=n)
        self.log("train/acc", batch["scores"].mean(), prog_bar=True, batch_size=n)
        self.log("train/teacher_acc", self.teacher_acc, batch_size=n)
        self.log("train/response_len", mask.sum(-1).float().mean(), batch_size=n)
        self.log("train/elapsed_s", time.perf_counter() - self._train_start, batch_size=n)
        return loss


# ---------------------------------------------------------------------------------------------
# the end of a run: a summary from the CSV the run wrote


def first_quarter_mean(values: list[float]) -> float:
    k = max(len(values) // 4, 1)
    return sum(values[:k]) / k


class HFOPDCLI(LightningCLI):
    """LightningCLI that prints a summary at the end: the exact KL and the accuracy, first quarter against last."""

    def before_fit(self) -> None:
        self._start = time.perf_counter()

    def after_fit(self) -> None:
        seconds = time.perf_counter() - self._start
        trainer, module = self.trainer, self.model
        if trainer.fast_dev_run or not isinstance(module, HFOPD) or not trainer.is_global_zero:
            return
        run = _runs.finished_run(trainer, "hf_opd", seconds)
        if run is None:
            return
        csv_logger, series = run
        kl, acc = _runs.values(series["opd/kl_exact"]), _runs.values(series["train/acc"])
        h = module.hparams
        form = "lk.FromHidden (a local teacher)" if h.teacher_form == "hidden" else f"lk.TopK, k={h.topk} (a served teacher)"
        lines = [
            f"[hf_opd] teacher {form}, divergence {h.divergence!r}; {len(kl)} steps in "
            f"{series['train/elapsed_s'][-1][1]:.1f} s of OPD, {seconds:.1f} s in all (models trained or loaded in "
            f"{module.pretrain_seconds:.1f} s)",
            f"  exact KL(student || teacher) per token: first quarter {first_quarter_mean(kl):.4f} -> last quarter "
            f"{_runs.last_quarter_mean(kl):.4f} nats",
            f"  exact KL per token on the right answers to {trainer.datamodule.hparams.eval_prompts} fixed problems: "
            f"{module.eval_kl_start:.4f} before -> {module.eval_kl_end:.4f} after",
            f"  accuracy: student first quarter {first_quarter_mean(acc):.3f} -> last quarter "
            f"{_runs.last_quarter_mean(acc):.3f}; teacher {module.teacher_acc:.3f}",
        ]
        if "opd/teacher_tail" in series:
            lines.append(f"  tails (last quarter): student {_runs.last_quarter_mean(_runs.values(series['opd/student_tail'])):.4f}, "
                         f"teacher {_runs.last_quarter_mean(_runs.values(series['opd/teacher_tail'])):.4f}")
        lines.append(f"  metrics : {Path(csv_logger.log_dir) / 'metrics.csv'}")
        print("\n".join(lines))


def main(args: Optional[list[str]] = None, run: bool = True) -> HFOPDCLI:
    # the rollout dataset has a length on purpose (no prefetch, see lk.OnPolicyRollouts), read in this process
    warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")  # the frozen teacher, on purpose
    return HFOPDCLI(HFOPD, OPDDataModule, args=args, run=run, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # tiny matrices on a busy machine: one thread (see examples/hf_grpo.py)
    main()
