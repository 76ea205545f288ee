"""Every ```python block of the README and of docs/*.md runs here, with tiny models built in code.

Each block has a runner, keyed by its file and its position in the file: a new block without one
fails ``test_every_snippet_has_a_runner``. A fragment (a few lines of a ``training_step``) runs in a
namespace that holds the names it reads (``logprob``, ``mask``, ``batch``, ``self`` ...); a class
is built and its ``training_step`` run; the figure a block's text claims is checked where it claims
one. Deprecation warnings are errors: a snippet never shows a deprecated call.
"""

from __future__ import annotations

import importlib.util
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
from torch.testing import assert_close

import lightning_kl as lk
from _recipes_stacks import run_plain_loop, run_trl_recipe, run_verl_recipe
from _snippets import ROOT, all_snippets, snippet

B, T, V, D = 4, 6, 11, 8


class FakeSelf(SimpleNamespace):
    """``self`` of a fragment: a LightningModule's attributes, and ``log`` / ``log_dict`` that record."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.logged: dict[str, Any] = {}

    def log(self, name: str, value: Any, **kw: Any) -> None:
        self.logged[name] = value

    def log_dict(self, values: dict[str, Any], **kw: Any) -> None:
        self.logged.update(values)


def _run(code: str, ns: dict[str, Any]) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", lk.hf.SamplerMismatchWarning)
        exec(compile(textwrap.dedent(code), "<doc snippet>", "exec"), ns)
    return ns


def _tensors(seed: int = 0) -> dict[str, Any]:
    """Consistent tensors: logits = hidden @ lm_head.T, tokens their argmax (kept by any sampler)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 3, 1, 5])
    mask = torch.arange(T) < lengths[:, None]
    lm_head = torch.nn.Linear(D, V, bias=False)
    ref_lm_head = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(V, D, generator=g))
        ref_lm_head.weight.copy_(lm_head.weight + 0.1 * torch.randn(V, D, generator=g))
    hidden = torch.randn(B, T, D, generator=g, requires_grad=True)
    ref_hidden = (hidden + 0.1 * torch.randn(B, T, D, generator=g)).detach()
    logits = (hidden @ lm_head.weight.T).detach().requires_grad_()
    ref_logits = (ref_hidden @ ref_lm_head.weight.T).detach()
    tokens = logits.argmax(-1)
    logprob = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0].detach().requires_grad_()
    ref_logprob = torch.log_softmax(ref_logits, -1).gather(-1, tokens[..., None])[..., 0]
    rollout = (logprob + 0.05 * torch.randn(B, T, generator=g)).detach()
    batch = {
        "logprobs": rollout, "rollout_logprobs": rollout, "ref_logprobs": ref_logprob,
        "advantages": torch.randn(B, generator=g), "mask": mask, **lk.step_totals([mask]),
    }
    return {
        "torch": torch, "lk": lk, "B": B, "T": 0.9, "eps": 0.2, "mask": mask, "tokens": tokens,
        "logits": logits, "ref_logits": ref_logits, "hidden": hidden, "ref_hidden": ref_hidden,
        "lm_head": lm_head, "ref_lm_head": ref_lm_head, "ref_weight": ref_lm_head.weight,
        "logprob": logprob, "ref_logprob": ref_logprob, "old_logprob": rollout.clone(), "batch": batch,
        "lp": logprob, "ref_lp": ref_logprob,
    }


def _fragment_self(**kw: Any) -> FakeSelf:
    attrs = {"kl": lk.KLPenaltyLoss("k3+", coef=0.05), "correction": lk.RolloutCorrection("token", upper=2.0)}
    return FakeSelf(**{**attrs, **kw})


def run_fragment(code: str, **extra: Any) -> dict[str, Any]:
    ns = _tensors()
    ns["self"] = _fragment_self()
    ns.update(extra)
    return _run(code, ns)


# --- Hugging Face: a tiny Qwen2 and the example's character tokenizer, built here (no hub) ------


def run_sampling_replay(code: str, mp: Any) -> None:
    """docs/sampling.md's replay: the ratio is exactly 1 on-policy, and the loss has a gradient."""
    ns = run_fragment(code)
    assert torch.equal(ns["ratio"], torch.ones_like(ns["ratio"]))
    on_policy = lk.full_kl(ns["logits"], ns["ref_logits"], ns["mask"], sampling=ns["sampling"])
    assert torch.equal(ns["exact_kl"], on_policy)  # the record is the policy's own: today's value
    ns["kl_loss"].backward()
    assert ns["logits"].grad.isfinite().all()


def _hf_example() -> Any:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    path = ROOT / "examples" / "hf_grpo.py"
    spec = importlib.util.spec_from_file_location("hf_grpo_for_snippets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_model(seed: int = 0) -> Any:
    ex = _hf_example()
    torch.manual_seed(seed)
    model = ex.build_model("qwen2", 16, 1, 2, 1, 32, 32).eval()
    with torch.no_grad():  # peakier logits than the default init, so that top-p bites
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(6)
    return model


def hf_rollout_fn() -> Callable[..., dict[str, Any]]:
    """``rollout`` of docs/huggingface.md, as the page writes it."""
    return _run(snippet("docs/huggingface.md", "def rollout("), {})["rollout"]


def hf_rollout(module: Any, sampling: lk.Sampling, seed: int = 0) -> dict[str, Any]:
    ex = _hf_example()
    torch.manual_seed(seed)
    module.policy.eval()
    batch = hf_rollout_fn()(module.policy, ex.build_tokenizer(), ["<bos>3+4=", "<bos>12+1=", "<bos>7+7="], 2, 4,
                            sampling=sampling)
    batch["scores"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    batch["advantages"] = batch["scores"] - 0.5
    return batch


class Spy:
    """Records the first ``lk.aggregate`` call's values (the policy loss's ``-ratio * adv``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, Any]] = []
        self.real = lk.aggregate

    def __call__(self, values: torch.Tensor, mask: Any = None, *args: Any, **kw: Any) -> torch.Tensor:
        self.calls.append((values.detach(), mask))
        return self.real(values, mask, *args, **kw)


def _k3(logprob: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    d = (logprob.double() - ref.double())[mask]
    return float((torch.exp(-d) + d - 1).mean())


def _check_grpo_on_policy(module: Any, batch: dict[str, Any], monkeypatch: Any, clipped: bool) -> None:
    """On the rollout's own policy: the PPO ratio is 1 on every response token, and the KL term's
    metric is k3 of the rollout's log-probs against the reference's (the sampler's, not the softmax's)."""
    spy = Spy()
    monkeypatch.setattr(lk, "aggregate", spy)
    module.policy.eval()  # LoRA dropout off: the rollout was scored in eval mode too
    loss = _run("loss = module.training_step(batch, 0)", {"module": module, "batch": batch})["loss"]
    monkeypatch.undo()
    assert torch.isfinite(loss)
    loss.backward()
    values, mask = spy.calls[0]
    adv = batch["advantages"] if "advantages" in batch else None
    if adv is None:  # docs/huggingface.md: group-normalized advantages from scores
        adv = _run(snippet("docs/huggingface.md", "def group_advantages("), {"torch": torch})["group_advantages"](
            batch["scores"], batch["group"])
    ratio = -values / adv[:, None]
    keep = mask & (adv[:, None].abs() > 1e-3)
    assert keep.any()
    assert_close(ratio[keep], torch.ones_like(ratio[keep]), rtol=0, atol=1e-5)  # 1 on-policy, as the README says
    kl = float(module.kl.metric.compute())
    assert kl == pytest.approx(_k3(batch["logprobs"], batch["ref_logprobs"], batch["mask"]), rel=1e-5)


SAMPLER = lk.Sampling(temperature=0.7, top_p=0.9)


def run_readme_grpo(code: str, monkeypatch: Any) -> None:
    ns = _run(code, {})
    module = ns["GRPO"](tiny_model())
    assert module.sampling == SAMPLER  # the Quickstart's default sampler truncates: the case that needs it
    batch = hf_rollout(module, module.sampling)
    _check_grpo_on_policy(module, batch, monkeypatch, clipped=False)


def run_readme_full(code: str, monkeypatch: Any) -> None:
    ns = _run(snippet("README.md", "class GRPO("), {})
    module = ns["GRPO"](tiny_model(), sampling=lk.Sampling(temperature=0.7))
    batch = hf_rollout(module, module.sampling)
    seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
    out = _run(code, {"torch": torch, "lk": lk, "self": module, "seq": seq, "am": am, "mask": mask,
                      "p": seq.shape[1] - mask.shape[1]})
    assert torch.isfinite(out["kl_loss"])
    # the sampled tokens' log-probs at the sampler's temperature are the rollout's own
    assert_close(out["sampled"][mask], batch["logprobs"][mask], rtol=0, atol=1e-5)
    out["kl_loss"].backward()


def run_hf_page(code: str, monkeypatch: Any) -> None:
    ns = _run(code, {})
    module = ns["GRPO"](tiny_model(), sampling=SAMPLER)
    batch = ns["rollout"](module.policy, _hf_example().build_tokenizer(), ["<bos>3+4=", "<bos>12+1="], 3, 4,
                          sampling=module.sampling)
    batch["scores"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    _check_grpo_on_policy(module, batch, monkeypatch, clipped=True)
    assert isinstance(module.configure_optimizers(), torch.optim.AdamW)


def run_lightning_bandit(code: str, monkeypatch: Any) -> None:
    # an excerpt of examples/minimal.py (trained by tests/test_example.py): every code line is there
    source = {line.split("#")[0].strip() for line in (ROOT / "examples" / "minimal.py").read_text().splitlines()}
    for line in code.splitlines():
        text = line.split("#")[0].strip()
        if text and text != "..." and not text.startswith("def "):  # the signatures carry annotations there
            assert text in source, f"not in examples/minimal.py: {text!r}"
    compile(code.replace(", ...)", ")"), "<doc snippet>", "exec")


def run_mismatch_sources(code: str, monkeypatch: Any) -> None:
    cfg = SimpleNamespace(algorithm=SimpleNamespace(rollout_correction={"rollout_is": "token"}))
    grpo_config = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True)
    args = SimpleNamespace(algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="token")))
    run_fragment(code, cfg=cfg, grpo_config=grpo_config, args=args)


def run_mismatch_bypass(code: str, monkeypatch: Any) -> None:
    # every way a correction can leave the weights: a tensor, or None (bypass_pg_geo_rs)
    for correction in (lk.RolloutCorrection("token", upper=2.0, bypass=True),
                       lk.RolloutCorrection(None, rejection="seq_mean_k1", rejection_threshold="0.5_2.0", bypass=True)):
        ns = run_fragment(code)
        ns["self"].correction = correction
        out = _run(code, ns)
        assert torch.isfinite(out["policy_loss"])


def run_mismatch_decoupled(code: str, monkeypatch: Any) -> None:
    for correction in (lk.RolloutCorrection("token", upper=2.0),
                       lk.RolloutCorrection(None, rejection="seq_mean_k1", rejection_threshold="0.5_2.0")):
        ns = _tensors()
        ns["self"] = _fragment_self(correction=correction)
        out = _run(code, ns)
        assert torch.isfinite(out["policy_loss"] + out["kl_loss"])


def run_mismatch_metric(code: str, monkeypatch: Any) -> None:
    out = run_fragment(code)
    out["on_train_epoch_end"](out["self"])
    assert out["self"].logged["mismatch/kl"] == pytest.approx(float(lk.mismatch_metrics(
        out["logprob"], out["batch"]["rollout_logprobs"], out["mask"])["kl"]))
    assert out["self"].mismatch.update_count == 0  # reset: the next epoch starts empty


def run_lightning_controller(code: str, monkeypatch: Any) -> None:
    ns = _tensors()
    lp = ns["lp"]
    ns.update(n_steps=2, micro_batches=[0, 1], policy_loss=lambda micro: 0 * lp.sum(),
              optimizer=torch.optim.SGD([lp], lr=0.1))
    _run(code, ns)


def run_refresh_trainer(code: str, monkeypatch: Any, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    run_fragment(code)


def run_sampling_generate(code: str, monkeypatch: Any) -> None:
    model = tiny_model()
    tok = _hf_example().build_tokenizer()
    inputs = dict(tok(["<bos>3+4=", "<bos>12+1="], return_tensors="pt", padding=True))
    out = run_fragment(code, model=model, inputs=inputs)
    assert out["logprobs"].shape == out["mask"].shape


def lora(model: Any) -> Any:
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))


def run_sampling_calls(code: str, monkeypatch: Any) -> None:
    model = lora(tiny_model())
    module = SimpleNamespace(policy=model)
    batch = hf_rollout(module, lk.Sampling(temperature=0.9, top_p=0.9))
    run_fragment(code, model=model, sequences=batch["sequences"], attention_mask=batch["attention_mask"],
                 p=batch["sequences"].shape[1] - batch["mask"].shape[1])


def run_scale_fsdp_head(code: str, monkeypatch: Any) -> None:
    head = torch.nn.Linear(D, V, bias=False)
    head.unshard = lambda: None  # FSDP2's fully_shard adds it; a plain module holds the whole weight already
    ns = _tensors()
    with torch.no_grad():
        head.weight.copy_(ns["lm_head"].weight)
    ns["self"] = _fragment_self(policy=SimpleNamespace(lm_head=head), kl=lk.KLPenaltyLoss("full", coef=0.05))
    assert torch.isfinite(_run(code, ns)["kl_loss"])


def run_vocabulary_class(code: str, monkeypatch: Any) -> None:
    ns = _run(code, {})
    policy, ref = tiny_model(0), tiny_model(1)
    module = ns["RLHF"](policy, ref)
    module.log = lambda *a, **k: None  # no Trainer here
    ids = torch.randint(3, 15, (2, 7))
    labels = ids.clone()
    labels[:, :3] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
             "old_logprobs": torch.zeros(2, 6), "advantages": torch.randn(2, 6)}
    module.on_train_start()
    assert torch.isfinite(module.training_step(batch, 0))


def run_vocabulary_hidden(code: str, monkeypatch: Any) -> None:
    policy, ref = tiny_model(0), tiny_model(1)
    ids = torch.randint(3, 15, (2, 7))
    targets = ids[:, 1:].clone()
    targets[:, :2] = -100
    ns = {"torch": torch, "lk": lk, "ids": ids, "attn": torch.ones_like(ids), "targets": targets,
          "mask": targets != -100, "self": FakeSelf(policy=policy, ref=ref, kl=lk.KLPenaltyLoss("full", coef=0.05))}
    out = _run(code, ns)
    # the hidden states x the head give the logits' log-probs
    logits = policy(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1]
    want = lk.token_logprobs(logits, targets, ignore_index=-100)
    assert_close(out["logprob"], want, rtol=0, atol=1e-5)
    assert torch.isfinite(out["kl_loss"])


def run_vocabulary_calls(code: str, monkeypatch: Any) -> None:
    # `model`: a Gemma-style model whose config soft-caps at 30, holding the fragment's lm_head
    ns = _tensors()
    model = SimpleNamespace(config=SimpleNamespace(model_type="gemma2", final_logit_softcapping=30.0),
                            get_output_embeddings=lambda: ns["lm_head"])
    out = run_fragment(code, **{k: v for k, v in ns.items() if k != "self"}, model=model)
    capped = lk.token_logprobs(lk.FromHidden(ns["hidden"], ns["lm_head"].weight, softcap=30.0), ns["tokens"])
    assert_close(out["logprob"], capped, rtol=0, atol=0)  # lk.hf.from_hidden read the cap from the config
    # the one-pass call's entropy is the separate call's, of the same capped head
    assert_close(out["entropy"], lk.token_entropy(lk.FromHidden(ns["hidden"], ns["lm_head"].weight, softcap=30.0)), rtol=0, atol=0)


def run_hf_from_hidden(code: str, monkeypatch: Any) -> None:
    policy = tiny_model(0)
    seq = torch.randint(3, 15, (2, 7))
    am, p, sampling = torch.ones_like(seq), 3, lk.Sampling(0.9)
    out = _run(code, {"torch": torch, "lk": lk, "policy": policy, "seq": seq, "am": am, "p": p, "sampling": sampling,
                      "weight": policy.lm_head.weight})
    # the hidden states x the head give the model's own log-probs of the response
    assert_close(out["logprobs"], lk.hf.response_logprobs(policy, seq, am, p, sampling=sampling), rtol=0, atol=1e-5)
    assert isinstance(out["x"], lk.FromHidden) and out["x"].softcap is None  # a Qwen2 head: no cap, no scale


def run_scale_tensor_parallel(code: str, monkeypatch: Any) -> None:
    # the whole block needs a tensor parallel group (tests/test_vocab_parallel.py runs the same calls on
    # two gloo processes); here: it compiles, and its calls exist
    compile(code, "<doc snippet>", "exec")
    assert callable(lk.token_logprobs) and callable(lk.VocabShard)


def run_defs(code: str, monkeypatch: Any) -> None:
    # blocks of method definitions: they are defined (the names they read exist when they run)
    ns = _tensors()
    ns.update(fully_shard=lambda *a, **k: None, self=_fragment_self())
    _run(code, ns)


def run_entropy_module(code: str, monkeypatch: Any) -> None:
    ns = _tensors()
    lm_head = ns["lm_head"]
    ns.update(prompt_len=2, logprobs=ns["logprob"], policy_loss=lambda logprobs, batch, mask: lk.aggregate(-logprobs, mask))
    ns = _run(code, ns)
    module = ns["Policy"]()
    module.policy = lambda tokens: torch.randn(tokens.shape[0], tokens.shape[1] + 1, V, requires_grad=True)
    module.log = lambda *a, **k: None  # no Trainer here
    loss = module.training_step({"tokens": torch.zeros(B, T + 1, dtype=torch.long)[:, : T + 1], "mask": ns["mask"]}, 0)
    assert torch.isfinite(loss)
    del lm_head


def run_entropy_one_pass(code: str, monkeypatch: Any) -> None:
    out = run_fragment(code, sampling=lk.Sampling(temperature=0.9), policy_loss=lambda logprob, *rest: lk.aggregate(-logprob),
                       self=_fragment_self(entropy=lk.EntropyBonus(coef=0.01)))
    assert torch.isfinite(out["loss"])
    assert_close(out["entropy"], lk.token_entropy(lk.FromHidden(out["hidden"], out["lm_head"].weight),
                                                  sampling=lk.Sampling(temperature=0.9)), rtol=0, atol=1e-5)


def run_distillation_topk(code: str, monkeypatch: Any) -> None:
    ns = _tensors()
    lq, ids = ns["ref_logits"].log_softmax(-1).topk(4, dim=-1)  # the reference as a served teacher's top-4
    lq[0, 0, 3] = float("-inf")  # a shorter list
    out = run_fragment(code, topk_ids=ids, topk_logprobs=lq)
    lp = (out["logits"].detach() / 0.9).log_softmax(-1)  # the student at T = 0.9, the teacher served at T = 1
    full = (lp.exp() * (lp - ns["ref_logits"].log_softmax(-1))).sum(-1) * out["mask"]
    assert torch.isfinite(out["kl_loss"]) and (out["out"].value <= full + 1e-6).all()  # a lower bound of the full KL
    assert_close(out["kl_loss"].detach(), out["out"].value[out["mask"]].mean(), rtol=1e-6, atol=0)  # the loss: coef 1, token-mean
    out["kl_loss"].backward()
    assert set(out["self"].logged) == {"opd/kl", "opd/student_tail", "opd/teacher_tail"}


def run_distillation_reward(code: str, monkeypatch: Any) -> None:
    ns = _tensors()
    batch = {**ns["batch"], "teacher_logprobs": ns["ref_logprob"], "scores": torch.zeros(B)}
    out = run_fragment(code, batch=batch)
    want = -(batch["logprobs"] - batch["teacher_logprobs"]).masked_fill(~ns["mask"], 0)
    assert_close(out["rewards"], want, rtol=0, atol=1e-6)
    rewards, _, _ = out["opd"].shape_rewards(batch)  # the callback writes the same per-token reward
    assert_close(rewards, want, rtol=0, atol=1e-6)


RUNNERS: dict[tuple[str, int], Callable[..., None]] = {
    ("docs/distillation.md", 0): run_distillation_topk,
    ("docs/distillation.md", 1): run_distillation_reward,
    ("docs/entropy.md", 0): run_entropy_module,
    ("docs/entropy.md", 1): run_entropy_one_pass,
    ("README.md", 0): run_readme_grpo,
    ("README.md", 1): run_readme_full,
    ("docs/estimators.md", 0): lambda code, mp: run_fragment(code),
    ("docs/estimators.md", 1): lambda code, mp: run_fragment(code),
    ("docs/estimators.md", 2): lambda code, mp: run_fragment(code),
    ("docs/huggingface.md", 0): run_hf_page,
    ("docs/huggingface.md", 1): run_hf_from_hidden,
    ("docs/lightning.md", 0): run_lightning_bandit,
    ("docs/lightning.md", 1): run_lightning_controller,
    ("docs/migration.md", 0): lambda code, mp: run_fragment(code),
    ("docs/mismatch.md", 0): lambda code, mp: run_fragment(code),
    ("docs/mismatch.md", 1): run_mismatch_metric,
    ("docs/mismatch.md", 2): lambda code, mp: run_fragment(code),
    ("docs/mismatch.md", 3): run_mismatch_sources,
    ("docs/mismatch.md", 4): run_mismatch_decoupled,
    ("docs/mismatch.md", 5): run_mismatch_bypass,
    ("docs/mismatch.md", 6): lambda code, mp: run_fragment(code),  # tests/test_trust_region.py: = prime-rl's loss
    ("docs/mismatch.md", 7): lambda code, mp: run_fragment(code),  # tests/test_verl_dro.py: = verl's dro
    ("docs/mismatch.md", 8): lambda code, mp: run_fragment(code),  # tests/test_cov_select.py: = verl's losses
    ("docs/recipes_stacks.md", 0): run_plain_loop,
    ("docs/recipes_stacks.md", 1): run_trl_recipe,  # TRL's names stood in for (tests/_recipes_stacks.py)
    ("docs/recipes_stacks.md", 2): run_verl_recipe,  # verl's likewise
    ("docs/refresh.md", 0): None,  # needs tmp_path: run_refresh_trainer
    ("docs/refresh.md", 1): lambda code, mp: run_fragment(code),
    ("docs/sampling.md", 0): run_sampling_generate,
    ("docs/sampling.md", 1): run_sampling_calls,
    ("docs/sampling.md", 2): lambda code, mp: run_fragment(code),
    ("docs/sampling.md", 3): lambda code, mp: run_fragment(code),
    ("docs/sampling.md", 4): lambda code, mp: run_fragment(code),
    ("docs/sampling.md", 5): lambda code, mp: run_fragment(code),
    ("docs/sampling.md", 6): run_defs,  # parsed by a real LightningCLI in tests/test_sampler_truth_docs.py
    ("docs/sampling.md", 7): run_sampling_replay,
    ("docs/scale.md", 0): lambda code, mp: run_fragment(code),
    ("docs/scale.md", 1): lambda code, mp: run_fragment(code, micro_batches=[{"mask": _tensors()["mask"]}]),
    ("docs/scale.md", 2): run_defs,
    ("docs/scale.md", 3): run_scale_fsdp_head,
    ("docs/scale.md", 4): run_scale_tensor_parallel,
    ("docs/vocabulary.md", 0): lambda code, mp: run_fragment(code),
    ("docs/vocabulary.md", 1): run_vocabulary_calls,
    ("docs/vocabulary.md", 2): run_vocabulary_class,
    ("docs/vocabulary.md", 3): run_vocabulary_hidden,
}


def test_every_snippet_has_a_runner() -> None:
    assert sorted(all_snippets()) == sorted(RUNNERS), "a ```python block was added, moved or removed: give it a runner"


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft on transformers 5
@pytest.mark.parametrize("key", sorted(RUNNERS), ids=lambda k: f"{k[0]}[{k[1]}]")
def test_snippet_runs(key: tuple[str, int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    code = all_snippets()[key]
    torch.manual_seed(0)
    if key == ("docs/refresh.md", 0):
        run_refresh_trainer(code, monkeypatch, tmp_path)
    else:
        RUNNERS[key](code, monkeypatch)
