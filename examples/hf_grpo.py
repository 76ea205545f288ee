r"""GRPO on a Hugging Face ``transformers`` policy with LoRA; the reference is the same model, adapters off.

    python examples/hf_grpo.py fit --config examples/configs/hf_grpo_lora.yaml
    python examples/hf_grpo.py fit --config examples/configs/hf_grpo_fsdp2.yaml  # FSDP2, 2 CPU processes

Everything is made here, on a CPU, with no download:

1. **Tokenizer.** A character-level ``PreTrainedTokenizerFast`` built with ``tokenizers``:
   ``<pad> <bos> <eos> 0-9 + =``, left padding.
2. **Task.** ``a+b=`` with ``a, b`` in ``[0, max_operand)``; the answer is checked exactly (reward 1
   if the response before its first EOS is the decimal sum, else 0). The prompts have 3 to 5
   characters, so a rollout batch is left-padded.
3. **Reference.** A ``Qwen2ForCausalLM`` (or ``LlamaForCausalLM``) built from a config with random
   weights, pretrained on a corpus that this file generates where only a share ``p_correct`` of the
   answers are right: the others copy one of the two operands (a "careless" answer). The reference
   learns both habits; RL has to drop the careless one. Cached under ``cache_dir`` keyed by its
   configuration, so later runs load it in no time.
4. **Policy.** LoRA adapters from ``peft`` on the reference's weights. The reference log-probs come from
   the same model with the adapters disabled (:func:`lightning_kl.hf.reference_logprobs`): no second
   copy of the weights.
5. **RL.** Rollouts are sampled with ``model.generate`` (groups of ``group_size`` answers per prompt)
   *inside the data pipeline* (:class:`lightning_kl.OnPolicyRollouts`, with a length, so no prefetch: every rollout
   comes from the policy that the previous step left), so a :class:`lightning_kl.KLRewardCallback`
   can shape the rewards. ``training_step`` is GRPO: group-normalized advantages, token-level ratio
   (clipped), plus the KL term from :class:`lightning_kl.KLPenaltyLoss` (estimator, coefficient and
   level from the YAML). Every log-prob comes from :func:`lightning_kl.hf.response_logprobs`, which
   reads the logits with :func:`lightning_kl.token_logprobs`. One :class:`lightning_kl.Sampling` (the
   YAML's ``data.sampling``) configures both sides: ``generate`` samples with its ``generate_kwargs()``
   (every processor it does not ask for switched off, whatever the model's ``generation_config``
   holds), and the rollouts are scored with the log-probs of that processed distribution
   (``score_processed``; ``docs/sampling.md``), checked against ``generate``'s own processed scores
   (``check_sampler``).
6. **Entropy (optional, off by default).** ``entropy_coef`` adds :class:`lightning_kl.EntropyBonus` to
   the loss (a number, or a :class:`lightning_kl.TargetEntropyController` by ``class_path``), and
   ``top_entropy < 1`` takes the policy gradient only on that share of the rollout's tokens of highest
   entropy (:func:`lightning_kl.high_entropy_mask`, "Beyond the 80/20 rule"); both from the entropy of
   the distribution the rollouts were drawn from. ``train/entropy`` is logged either way.

Notation: ``b`` sequences in a rollout (``prompts_per_rollout * group_size``), ``p`` the padded prompt
length, ``t`` the response length (at most ``max_new_tokens``), ``V`` the vocabulary size.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import Tensor
from torch.utils.data import DataLoader

import lightning_kl as lk
from lightning_kl.estimators import SAMPLED_ESTIMATORS
from lightning_kl import hf

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests): find the siblings
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runs  # noqa: E402  (examples/_runs.py: pretraining and its cache, rollout loader, metrics CSV, plots)

# ---------------------------------------------------------------------------------------------
# tokenizer and task

SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = "0123456789+="
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = len(SPECIALS) + len(CHARS)


def build_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast``: one token per character, left padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # "1", "2" -> "12"
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", padding_side="left"
    )


def sample_problems(n: int, max_operand: int, generator: torch.Generator) -> list[tuple[int, int]]:
    """``n`` pairs ``(a, b)``, uniform in ``[0, max_operand)^2``."""
    ab = torch.randint(max_operand, (n, 2), generator=generator)
    return [(int(a), int(b)) for a, b in ab]


def prompt_text(a: int, b: int) -> str:
    return f"<bos>{a}+{b}="


def corpus_lines(n: int, max_operand: int, p_correct: float, generator: torch.Generator) -> list[str]:
    """Pretraining lines ``<bos>a+b=s<eos>``: ``s = a + b`` with probability ``p_correct``, else ``a`` or ``b``."""
    problems = sample_problems(n, max_operand, generator)
    correct = (torch.rand(n, generator=generator) < p_correct).tolist()
    first = (torch.rand(n, generator=generator) < 0.5).tolist()
    return [
        f"{prompt_text(a, b)}{a + b if ok else (a if f else b)}<eos>"
        for (a, b), ok, f in zip(problems, correct, first)
    ]


def score(tokenizer: Any, responses: Tensor, mask: Tensor, problems: list[tuple[int, int]]) -> Tensor:
    """1.0 where the response before its first EOS is exactly ``str(a + b)``, else 0.0: ``[b, t]`` -> ``[b]``.

    A response without EOS (cut at ``max_new_tokens``) scores 0.
    """
    out = []
    for row, valid, (a, b) in zip(responses.tolist(), mask.tolist(), problems):
        tokens = [tok for tok, v in zip(row, valid) if v]
        ended = bool(tokens) and tokens[-1] == EOS_ID
        out.append(float(ended and tokenizer.decode(tokens[:-1]) == str(a + b)))
    return torch.tensor(out, device=responses.device)


group_advantages = _runs.group_advantages


def build_model(arch: str, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                intermediate_size: int, max_positions: int) -> Any:
    """A small ``transformers`` causal LM with random weights, built from its config (no download)."""
    import transformers

    kwargs = dict(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))


def parameter_bytes(model: torch.nn.Module, trainable: Optional[bool] = None) -> int:
    """Bytes of ``model``'s parameters (all, or only the trainable / frozen ones)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if trainable is None or p.requires_grad == trainable)


# ---------------------------------------------------------------------------------------------
# the data pipeline: rollouts from the current policy


class ArithmeticDataModule(pl.LightningDataModule):
    """The environment: the addition problems, the corpus, the reward, and the rollout stream.

    Args:
        max_operand: operands are in ``[0, max_operand)``.
        p_correct: the share of right answers in the reference's pretraining corpus.
        max_new_tokens: the response length limit (the longest answer and its EOS must fit).
        prompts_per_rollout, group_size: a rollout is ``group_size`` samples of each of
            ``prompts_per_rollout`` prompts.
        rollouts: rollout batches per epoch (one ``training_step`` each).
        sampling: the sampler (:class:`lightning_kl.Sampling`: temperature, top-k, top-p, min-p):
            ``generate`` draws with ``sampling.generate_kwargs()``, the log-probs are taken with it.
        reference_samples: samples drawn from the reference at the start to measure its accuracy.
        score_processed: score the rollouts with the log-probs of the processed distribution they
            were sampled from (``lk.hf.response_logprobs(..., sampling=)``), or, False, with the
            full-vocabulary softmax at the sampling temperature (the contrast).
        check_sampler: compare the policy's log-probs with ``generate``'s processed scores at every
            rollout (``lk.hf.response_logprobs(..., sampler_scores=)``): a warning, once, if they
            disagree beyond float noise (the full-vocabulary contrast run warns, as it should).
        reference: the reference of the processed policy's KL (``"unprocessed"`` or ``"policy_kept"``):
            ``"unprocessed"`` (its softmax at the temperature) or ``"policy_kept"`` (renormalized on the
            policy's kept set: blind to which tokens the policy keeps, see ``docs/sampling.md``).
    """

    def __init__(
        self,
        max_operand: int = 14,
        p_correct: float = 0.4,
        max_new_tokens: int = 3,
        prompts_per_rollout: int = 16,
        group_size: int = 8,
        rollouts: int = 300,
        sampling: lk.Sampling = lk.Sampling(),
        reference_samples: int = 1024,
        score_processed: bool = True,
        reference: str = "unprocessed",
        check_sampler: bool = True,
    ) -> None:
        super().__init__()
        if not 1 <= max_operand <= 1000:
            raise ValueError(f"`max_operand` must be in [1, 1000], got {max_operand!r}.")
        if not 0 <= p_correct <= 1:
            raise ValueError(f"`p_correct` must be in [0, 1], got {p_correct!r}.")
        if max_new_tokens < len(str(2 * max_operand - 2)) + 1:
            raise ValueError(f"`max_new_tokens` {max_new_tokens} cannot hold the answer {2 * max_operand - 2} and EOS.")
        if isinstance(sampling, dict):  # a YAML's mapping, given to the class directly (not through the CLI)
            sampling = lk.Sampling(**sampling)
        if not isinstance(sampling, lk.Sampling):
            raise TypeError(f"`sampling` must be a lightning_kl.Sampling (or a mapping of its fields), got {type(sampling).__name__}.")
        for name, value in [("prompts_per_rollout", prompts_per_rollout), ("group_size", group_size),
                            ("rollouts", rollouts), ("reference_samples", reference_samples)]:
            if not value >= 1:
                raise ValueError(f"`{name}` must be >= 1, got {value!r}.")
        if reference not in ("unprocessed", "policy_kept"):
            raise ValueError(f"`reference` must be 'unprocessed' or 'policy_kept', got {reference!r}.")
        self.save_hyperparameters()
        self._sampling = sampling  # the object (LightningCLI saves the hyperparameters as its config: a mapping)
        self.tokenizer = build_tokenizer()

    @property
    def sampling(self) -> lk.Sampling:
        """The sampler: ``generate`` draws with it, the rollouts are scored with it."""
        return self._sampling

    @property
    def scoring(self) -> dict[str, Any]:
        """How :func:`lightning_kl.hf.response_logprobs` scores the rollouts: the sampler, or (the
        full-vocabulary contrast) the softmax at its temperature."""
        if self.hparams.score_processed:
            return {"sampling": self.sampling}
        return {"sampling": lk.Sampling(temperature=self.sampling.temperature)}

    def corpus_config(self) -> dict[str, Any]:
        return {"max_operand": self.hparams.max_operand, "p_correct": self.hparams.p_correct}

    @property
    def max_length(self) -> int:
        """The longest prompt + response, in tokens (for the model's position table)."""
        return 1 + 2 * len(str(self.hparams.max_operand - 1)) + 2 + self.hparams.max_new_tokens

    def _generator(self, rank: int) -> torch.Generator:
        # fresh prompts from the global RNG (seeded by seed_everything), distinct on every DDP rank
        return torch.Generator().manual_seed(int(torch.randint(2**62, ())) + rank)

    @torch.no_grad()
    def sample(self, model: Any, problems: list[tuple[int, int]], device: torch.device,
               synced: bool = False, generate_kwargs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Sample one answer per problem from ``model`` with ``generate``; masks and inputs for scoring.

        ``synced``: the model is sharded (FSDP2), so every rank runs as many forward passes as the
        slowest one (``generate(synced_gpus=True)``): each pass gathers the weights collectively.
        ``generate_kwargs``: the sampler's keywords, ``self.sampling.generate_kwargs()`` by default
        (another value only for ``examples/check_generate.py``'s contrast). ``"generate_scores"``, the
        processed scores ``generate`` drew from, is for the check, not for the batch.
        """
        h = self.hparams
        enc = self.tokenizer([prompt_text(a, b) for a, b in problems], return_tensors="pt", padding=True)
        prompt_ids, prompt_am = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        if generate_kwargs is None:
            generate_kwargs = self.sampling.generate_kwargs(model)
        out = model.generate(
            input_ids=prompt_ids, attention_mask=prompt_am, max_new_tokens=h.max_new_tokens,
            pad_token_id=PAD_ID, eos_token_id=EOS_ID, output_scores=True, return_dict_in_generate=True,
            synced_gpus=synced, **generate_kwargs,
        )
        sequences = out.sequences
        p = prompt_ids.shape[1]
        mask = hf.response_mask(sequences[:, p:], EOS_ID)
        attention_mask, _ = hf.sequence_inputs(prompt_am, mask)
        scores = score(self.tokenizer, sequences[:, p:], mask, problems)
        # the log-probs the sampler drew with: generate's processed scores, [b, t]
        sampler_lp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, sequences[:, p:, None])[..., 0]
        return {"sequences": sequences, "attention_mask": attention_mask, "mask": mask, "scores": scores,
                "sampler_logprobs": sampler_lp, "generate_scores": out.scores}

    @torch.no_grad()
    def rollout(self, module: "HFGRPO", n_prompts: Optional[int] = None) -> dict[str, Tensor]:
        """One rollout batch from ``module.policy``'s current weights (``b = n_prompts * group_size``).

        A dict: ``sequences [b, p + t]`` (prompt block, response block), ``attention_mask [b, p + t]``,
        ``mask [b, t]`` (bool, the response up to and including its first EOS), ``logprobs [b, t]``
        (the sampling policy's), ``ref_logprobs [b, t]`` (adapters off), ``scores [b]`` (1.0 if right),
        ``group [b]`` (prompt index), ``true_kl [b, t]`` (exact per-token KL), ``entropy [b, t]`` (the
        sampling distribution's, 0 on padding).
        """
        h = self.hparams
        n_prompts = h.prompts_per_rollout if n_prompts is None else n_prompts
        problems = sample_problems(n_prompts, h.max_operand, self._generator(module.global_rank))
        problems = [ab for ab in problems for _ in range(h.group_size)]
        policy = module.policy
        was_training = policy.training
        policy.eval()
        batch = self.sample(policy, problems, module.device, module.sharded)
        generate_scores = batch.pop("generate_scores")
        seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
        p = seq.shape[1] - mask.shape[1]
        check = {"sampler_scores": generate_scores} if h.check_sampler else {}
        logprobs, logits = hf.response_logprobs(policy, seq, am, p, return_logits=True, **self.scoring, **check)
        # the reference's softmax, or the reference on the policy's kept set
        T = self.sampling.temperature
        ref_kw = (dict(self.scoring, kept_from=logits) if h.score_processed and h.reference == "policy_kept"
                  else {"sampling": lk.Sampling(temperature=T)})
        ref_logprobs, ref_logits = hf.reference_logprobs(policy, seq, am, p, return_logits=True, **ref_kw)
        if module.kl.spec.base == "full":  # the loss's `full` estimator: the reference's distributions
            batch["ref_logits"] = ref_logits.detach()
        policy.train(was_training)
        # the exact KL of the next-token distributions (0 on padding): summed over a response, an
        # unbiased estimate of the responses' KL (chain rule), no estimator noise; of the full
        # softmax, and of the processed policy against the reference's softmax and on its kept set
        kl_full = lk.kl_penalty(logits, ref_logits, "full", mask=mask, sampling=lk.Sampling(temperature=T))
        kl_processed, kl_policy_kept = (
            lk.full_kl(logits, ref_logits, mask, sampling=self.sampling, reference=r)
            for r in ("unprocessed", "policy_kept")
        )
        # importance ratios of the scorer against the sampler, full softmax and processed
        tokens = seq[:, p:].masked_fill(~mask, -100)
        full_lp = lk.token_logprobs(logits, tokens, sampling=lk.Sampling(T), ignore_index=-100)
        proc_lp = lk.token_logprobs(logits, tokens, sampling=self.sampling, ignore_index=-100)
        batch.update(
            logprobs=logprobs,
            ref_logprobs=ref_logprobs,
            group=torch.arange(n_prompts, device=seq.device).repeat_interleave(h.group_size),
            true_kl=(kl_processed if h.reference == "unprocessed" else kl_policy_kept) if h.score_processed else kl_full,
            kl_full=kl_full,
            kl_processed=kl_processed,
            kl_policy_kept=kl_policy_kept,
            ratio_full=torch.exp(full_lp - batch["sampler_logprobs"]),
            ratio_processed=torch.exp(proc_lp - batch["sampler_logprobs"]),
            entropy=lk.token_entropy(logits, mask, **self.scoring),
        )
        return batch

    @torch.no_grad()
    def reference_accuracy(self, module: "HFGRPO", n: Optional[int] = None) -> float:
        """The accuracy of ``n`` (default ``reference_samples``) samples from the reference (adapters off)."""
        h = self.hparams
        n = h.reference_samples if n is None else n
        problems = sample_problems(n, h.max_operand, self._generator(module.global_rank))
        policy = module.policy
        was_training = policy.training
        policy.eval()
        with hf.adapters_disabled(policy) as reference:
            acc = float(self.sample(reference, problems, module.device, module.sharded)["scores"].mean())
        policy.train(was_training)
        return acc

    def train_dataloader(self) -> DataLoader:
        module = self.trainer.lightning_module if self.trainer is not None else None
        if not isinstance(module, HFGRPO):
            raise RuntimeError("ArithmeticDataModule samples from the policy of the HFGRPO module of its Trainer.")
        return _runs.rollout_loader(functools.partial(self.rollout, module), self.hparams.rollouts)


# ---------------------------------------------------------------------------------------------
# the LightningModule


class HFGRPO(pl.LightningModule):
    """GRPO with a KL term on a ``transformers`` causal LM with ``peft`` LoRA adapters.

    Args:
        arch: ``"qwen2"`` or ``"llama"``.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: the model's shape.
        pretrain_steps, pretrain_batch_size, pretrain_lr, pretrain_seed: stage 1, the reference.
        cache_dir: where the pretrained reference is cached, one file per configuration.
        lora_r, lora_alpha, lora_targets: the LoRA adapters (``peft.LoraConfig``).
        lr: the RL learning rate (AdamW, adapters only).
        kl_estimator, kl_coef, kl_agg, kl_level, kl_to_go: :class:`lightning_kl.KLPenaltyLoss`
            (``kl_coef: 0`` keeps the KL out of the loss but still measures it; a controller,
            ``class_path: lightning_kl.TargetKLController``, moves it once per optimizer step). At
            ``level="sequence"`` the loss's expected gradient is that of the KL of whole responses;
            ``seq-mean-token-sum`` makes the term ``coef`` times the mean KL per response, exact for
            responses of any length. ``full`` is the exact KL of the policy's and the reference's
            softmaxes at the sampling temperature, from both models' logits; it needs a sampler
            without truncation (no top-k, top-p, min-p), whose distribution that softmax is.
        kl_old_logprob: pass the sampler's log-probs to the KL loss as ``old_logprob`` (importance
            weights; on-policy they make ``k3``'s gradient ``k3+``'s and ``k1``'s exact); ``False``
            gives the plain estimator, as frameworks without the weights use it.
        clip_eps: the ratio clip (GRPO/PPO); bites only if a rollout is used for more than one step.
        entropy_coef: ``None`` (the default): no entropy term. Else the coefficient of an
            :class:`lightning_kl.EntropyBonus` added to the loss, ``-coef`` times the token-mean entropy
            of the distribution the rollouts were drawn from (``data.sampling``): a number, or a
            controller by ``class_path`` (:class:`lightning_kl.TargetEntropyController`, moved once per
            optimizer step; logged as ``entropy/coef`` and ``entropy/value``). TRL's ``entropy_coef``.
        top_entropy: the share of the rollout's valid tokens, those of highest entropy, that the
            policy gradient is taken on (:func:`lightning_kl.high_entropy_mask`; TRL's
            ``top_entropy_quantile``); 1 (the default) takes every token. The KL and the entropy
            bonus still see every token.
    """

    def __init__(
        self,
        arch: str = "qwen2",
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        intermediate_size: int = 128,
        pretrain_steps: int = 800,
        pretrain_batch_size: int = 128,
        pretrain_lr: float = 3e-3,
        pretrain_seed: int = 0,
        cache_dir: str = "runs/hf_grpo/reference",
        lora_r: int = 8,
        lora_alpha: int = 16,
        lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        lr: float = 3e-3,
        kl_estimator: lk.EstimatorName = "k3+",
        kl_coef: Union[float, lk.KLController] = 0.3,
        kl_agg: lk.AggMode = "seq-mean-token-sum",
        kl_level: lk.Level = "sequence",
        kl_to_go: str = "k1",
        kl_old_logprob: bool = True,
        clip_eps: float = 0.2,
        entropy_coef: Union[float, lk.KLController, None] = None,
        top_entropy: float = 1.0,
    ) -> None:
        super().__init__()
        if arch not in ("qwen2", "llama"):
            raise ValueError(f"`arch` must be 'qwen2' or 'llama', got {arch!r}.")
        if not (isinstance(pretrain_steps, int) and pretrain_steps >= 0):
            raise ValueError(f"`pretrain_steps` must be an integer >= 0, got {pretrain_steps!r}.")
        if isinstance(top_entropy, bool) or not isinstance(top_entropy, (int, float)) or not 0 < top_entropy <= 1:
            raise ValueError(f"`top_entropy` must be a number in (0, 1] (1: every token), got {top_entropy!r}.")
        self.save_hyperparameters()
        # the estimator name, coefficient, mode and level are validated here, before any step
        self.kl = lk.KLPenaltyLoss(kl_estimator, coef=kl_coef, agg=kl_agg, level=kl_level, kl_to_go=kl_to_go)
        # the entropy term, validated here too; None keeps it out (no module, the loss unchanged)
        self.entropy = None if entropy_coef is None else lk.EntropyBonus(coef=entropy_coef)
        self.policy: Any = None  # a peft PeftModel, made in setup() on the pretrained weights
        self.ref_acc = float("nan")
        self.pretrain_seconds = 0.0
        self.reference_path: Optional[Path] = None
        self.reference_cached = False
        self.memory: dict[str, int] = {}
        self.sharded = False  # by FSDP2, in configure_model
        self._train_start = 0.0

    # -- stage 1: the reference ----------------------------------------------------------------

    def _build(self, max_positions: int) -> Any:
        h = self.hparams
        return build_model(h.arch, h.hidden_size, h.num_layers, h.num_heads, h.num_kv_heads,
                           h.intermediate_size, max_positions)

    def reference_config(self, dm: ArithmeticDataModule) -> dict[str, Any]:
        """What the pretrained reference is a function of (its cache key)."""
        h = self.hparams
        return {
            "model": [h.arch, h.hidden_size, h.num_layers, h.num_heads, h.num_kv_heads, h.intermediate_size],
            "max_positions": dm.max_length,
            "pretrain": [h.pretrain_steps, h.pretrain_batch_size, h.pretrain_lr, h.pretrain_seed],
            "corpus": dm.corpus_config(),
            "format": 1,
        }

    def pretrain(self, dm: ArithmeticDataModule) -> dict[str, Tensor]:
        """Train a fresh model on the corpus; a function of the configuration alone (own RNG)."""
        h = self.hparams

        def batch_loss(model: Any, generator: torch.Generator) -> Tensor:
            lines = corpus_lines(h.pretrain_batch_size, dm.hparams.max_operand, dm.hparams.p_correct, generator)
            enc = dm.tokenizer(lines, return_tensors="pt", padding=True).to(self.device)
            labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)  # HF's ignore index
            return model(**enc, labels=labels).loss

        return _runs.pretrain(lambda: self._build(dm.max_length).to(self.device), batch_loss,
                              steps=h.pretrain_steps, lr=h.pretrain_lr, seed=h.pretrain_seed, tag="hf_grpo")

    def reference_model(self, dm: ArithmeticDataModule) -> Any:
        """The pretrained reference (from the cache, or pretrained now and cached), a ``transformers`` model."""
        state, self.reference_path, self.reference_cached, self.pretrain_seconds = _runs.load_or_pretrain(
            self.hparams.cache_dir, self.reference_config(dm), lambda: self.pretrain(dm), "hf_grpo"
        )
        base = self._build(dm.max_length)
        base.load_state_dict(state)
        return base

    def setup(self, stage: str) -> None:
        if stage != "fit" or self.policy is not None:
            return
        import peft

        dm = self.trainer.datamodule
        if not isinstance(dm, ArithmeticDataModule):
            raise RuntimeError("HFGRPO is trained with an ArithmeticDataModule (it holds the task and the reward).")
        h = self.hparams
        if self.kl.spec.base == "full" and dm.sampling.truncates:
            raise ValueError(
                f"`kl_estimator` 'full' is the KL of the softmaxes at the sampling temperature, but the sampler "
                f"truncates them ({dm.sampling}): sample with top_k 0, top_p 1 and min_p 0, or use one of "
                f"{sorted(SAMPLED_ESTIMATORS)}."
            )
        base = self.reference_model(dm)
        base_bytes = parameter_bytes(base)
        # LoRA on the frozen pretrained weights: the policy; with the adapters disabled, the reference
        lora = peft.LoraConfig(r=h.lora_r, lora_alpha=h.lora_alpha, target_modules=list(h.lora_targets),
                               lora_dropout=0.0, bias="none")
        with torch.random.fork_rng(devices=[]):  # the adapters' init does not shift the run's RNG
            torch.manual_seed(h.pretrain_seed + 1)
            self.policy = peft.get_peft_model(base, lora)
        self.memory = {
            "base": base_bytes,
            "adapters": parameter_bytes(self.policy, trainable=True),
            "reference_as_a_copy": base_bytes,
            "reference_adapters_off": 0,
        }

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy``: FSDP2 over the data parallel dimension (each decoder layer,
        then the whole model); the reference is the same sharded model with its adapters off."""
        mesh = self.device_mesh
        if mesh is None or self.sharded:
            return
        if mesh["tensor_parallel"].size() > 1:
            raise ValueError("this example shards with FSDP2 only: give ModelParallelStrategy(tensor_parallel_size=1).")
        from torch.distributed.fsdp import fully_shard

        model = self.policy.base_model.model  # the transformers model: generate() calls it, not the PeftModel
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
        self.sharded = True

    def on_fit_start(self) -> None:
        acc = torch.tensor(self.trainer.datamodule.reference_accuracy(self), device=self.device)
        self.ref_acc = float(self.trainer.strategy.reduce(acc, reduce_op="mean"))

    def on_train_start(self) -> None:
        self._train_start = time.perf_counter()

    # -- stage 2: RL ---------------------------------------------------------------------------

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.policy.parameters() if p.requires_grad]  # the adapters
        return torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=0.0)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
        p = seq.shape[1] - mask.shape[1]
        rewards = batch.get("rewards")  # [b, t], from KLRewardCallback if one is in the Trainer
        returns = torch.where(mask, rewards, 0.0).sum(-1) if rewards is not None else batch["scores"]
        adv = group_advantages(returns, batch["group"])[:, None]

        dm = self.trainer.datamodule
        full = self.kl.spec.base == "full"
        top = self.hparams.top_entropy
        need_entropy = self.entropy is not None or top < 1
        out = hf.response_logprobs(self.policy, seq, am, p, return_logits=full or need_entropy, **dm.scoring)
        logprobs, logits = out if full or need_entropy else (out, None)
        # the per-token entropy of the distribution the rollouts were drawn from (differentiable)
        entropy = lk.token_entropy(logits, mask, **dm.scoring) if need_entropy else None
        # the policy gradient on every valid token, or on the share `top` of highest entropy
        pg_mask = mask if top == 1 else lk.high_entropy_mask(entropy.detach(), mask, top=top)
        ratio = torch.exp(logprobs - batch["logprobs"])  # token-level; 1 on the first step over a rollout
        clipped = ratio.clamp(1 - self.hparams.clip_eps, 1 + self.hparams.clip_eps)
        pg_loss = lk.aggregate(-torch.minimum(ratio * adv, clipped * adv), pg_mask, "token-mean")
        if full:  # both models' softmaxes at the sampling temperature; the sampled log-probs carry the
            # KL-to-go term at the sequence level
            T = dm.sampling.temperature
            sampled = logprobs if self.kl.level == "sequence" else None
            kl_loss = self.kl(logits / T, batch["ref_logits"] / T, mask, sampled_logprob=sampled)
        else:
            old = batch["logprobs"] if self.hparams.kl_old_logprob else None
            kl_loss = self.kl(logprobs, batch["ref_logprobs"], mask, old_logprob=old)
        loss = pg_loss + kl_loss
        if self.entropy is not None:  # -coef x the token-mean entropy (its controller steps in the callback)
            loss = loss + self.entropy(entropy=entropy, mask=mask)

        n = mask.shape[0]
        self.log("train/acc", batch["scores"].mean(), prog_bar=True, batch_size=n)
        self.log("train/reward", returns.mean(), prog_bar=True, batch_size=n)
        self.log("train/kl", lk.aggregate(batch["true_kl"], mask, "token-mean"), prog_bar=True, batch_size=n)
        self.log("train/kl_seq", batch["true_kl"].sum(-1).mean(), batch_size=n)
        self.log("train/entropy", lk.aggregate(batch["entropy"], mask, "token-mean"), batch_size=n)
        if top < 1:
            self.log("train/pg_tokens", pg_mask.sum() / mask.sum().clamp(min=1), batch_size=n)
        if "ratio_full" in batch:  # the sampler against the scorer: full softmax vs processed
            lo, hi = hf.RATIO_BAND  # the band of lk.hf's own check (sampler_scores=)
            for name in ("full", "processed"):
                r = batch[f"ratio_{name}"][mask]
                self.log(f"sampling/ratio_{name}_mean", r.mean(), batch_size=n)
                self.log(f"sampling/ratio_{name}_out", ((r < lo) | (r > hi)).float().mean(), batch_size=n)
            for name in ("full", "processed", "policy_kept"):
                self.log(f"sampling/kl_{name}_seq", batch[f"kl_{name}"].sum(-1).mean(), batch_size=n)
        self.log("train/kl_est", self.kl.metric, batch_size=n)
        self.log("train/ref_acc", self.ref_acc, batch_size=n)
        self.log("train/loss", loss.detach(), batch_size=n)
        self.log("train/response_len", mask.sum(-1).float().mean(), batch_size=n)
        self.log("train/elapsed_s", time.perf_counter() - self._train_start, batch_size=n)
        return loss


# ---------------------------------------------------------------------------------------------
# the end of a run: plot and summary (from the CSV the run wrote)


def plot_run(series: dict[str, list[tuple[int, float]]], out: str | Path, title: str) -> None:
    """Accuracy and exact KL against the wall-clock time of RL, in two panels, as a PNG."""
    plt = _runs.pyplot()
    secs = [v for _, v in series["train/elapsed_s"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    ax = axes[0]
    ax.plot(secs, [v for _, v in series["train/acc"]], label="policy (rollout mean)")
    ax.axhline(series["train/ref_acc"][0][1], color="gray", ls="--", label="reference (adapters off)")
    ax.set_title("accuracy of sampled answers")
    ax.set_ylim(0, 1)
    ax.legend()
    ax = axes[1]
    ax.plot(secs, [v for _, v in series["train/kl_seq"]], label="exact KL per response")
    ax.set_title("KL(policy || reference), nats")
    ax.legend()
    for ax in axes:
        ax.set_xlabel("seconds of RL")
    _runs.save_figure(fig, title, out)


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


class HFGRPOCLI(LightningCLI):
    """LightningCLI that reports at the end: a plot, a summary, the parameter memory of the reference."""

    def before_fit(self) -> None:
        self._start = time.perf_counter()

    def after_fit(self) -> None:
        seconds = time.perf_counter() - self._start
        trainer, module = self.trainer, self.model
        if trainer.fast_dev_run or not isinstance(module, HFGRPO) or not trainer.is_global_zero:
            return
        run = _runs.finished_run(trainer, "hf_grpo", seconds)
        if run is None:
            return
        csv_logger, series = run
        log_dir = Path(csv_logger.log_dir)
        png = log_dir / "hf_grpo.png"
        h = module.hparams
        coef = h.kl_coef if isinstance(h.kl_coef, (int, float)) else type(module.kl.controller).__name__
        plot_run(series, png, f"{csv_logger.name}: {h.kl_estimator}, coef {coef}, level {h.kl_level}")
        acc = [v for _, v in series["train/acc"]]
        kl = [v for _, v in series["train/kl_seq"]]
        m = module.memory
        how = "loaded from cache" if module.reference_cached else "pretrained"
        print("\n".join([
            f"[hf_grpo] {len(acc)} rollouts in {series['train/elapsed_s'][-1][1]:.1f} s of RL, "
            f"{seconds:.1f} s in all (reference {how} in {module.pretrain_seconds:.1f} s)",
            f"  accuracy: reference {module.ref_acc:.3f} -> final {_runs.last_quarter_mean(acc):.3f} (last quarter of rollouts)",
            f"  KL      : exact, per response: mean {sum(kl) / len(kl):.3f}, max {max(kl):.3f}, "
            f"last quarter {_runs.last_quarter_mean(kl):.3f} nats",
            f"  memory  : base weights {_mib(m['base'])}, LoRA adapters {_mib(m['adapters'])}; reference as a "
            f"copy +{_mib(m['reference_as_a_copy'])}, adapters off +0",
            f"  files   : metrics {log_dir / 'metrics.csv'}",
            f"            plot    {png}",
            f"            config  {log_dir / 'config.yaml'}",
            f"            reference {module.reference_path}",
            f"  check   : python examples/check_hf_grpo.py {Path(csv_logger.save_dir)}",
        ]))


def main(args: Optional[list[str]] = None, run: bool = True) -> HFGRPOCLI:
    # the rollout dataset has a length on purpose (no prefetch, see lk.OnPolicyRollouts) and is read in
    # this process (num_workers=0), so Lightning's warning about lengths and workers does not apply
    warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")
    # peft calls a transformers method that transformers 5 deprecates; nothing for a user to do
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
    return HFGRPOCLI(HFGRPO, ArithmeticDataModule, args=args, run=run, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        # tiny matrices: a second intra-op thread buys little, and OpenMP threads that spin-wait on
        # a busy 2-core machine can make a run many times slower
        torch.set_num_threads(1)
    main()
