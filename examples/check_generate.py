r"""What ``generate`` draws against what the Hugging Face example scores, under two ``generation_config``\ s.

    python examples/check_generate.py --config examples/configs/hf_grpo_lora.yaml
    python examples/check_generate.py --config examples/configs/hf_grpo_lora.yaml --rollouts 4 \
        --data.sampling.top_p=0.7                     # any of the example's CLI overrides

The example's models (``examples/hf_grpo.py``: the pretrained reference, loaded from its cache or
pretrained, and the same architecture at its random initialization, a flatter distribution) sample
rollouts of the YAML's prompts with ``generate``, in four ways: two ``generation_config``\ s ×
two samplers.

- ``generation_config``: the model's default (as ``transformers`` builds it from the model's config;
  ``generate`` then fills ``top_k=50`` from its global defaults), or one like a chat checkpoint's
  ``generation_config.json`` (``do_sample=True, temperature=0.7, top_k=5, top_p=0.8,
  repetition_penalty=1.05``).
- sampler: ``generate(**sampling.generate_kwargs())`` with the YAML's ``data.sampling`` (what the
  example does), or ``generate(do_sample=True, temperature=T, top_p=p)`` with the same values as
  ``generate``'s own keywords (what is left unsaid comes from the ``generation_config``).

Every rollout is scored as the example scores it (``lk.hf.response_logprobs(..., sampling=)``, a token
outside the scorer's kept set scored ``-inf``), and compared with ``generate``'s processed scores
(:func:`lightning_kl.hf.sampler_agreement`): the mean importance ratio (scorer over sampler) over
every valid response token and the share of tokens outside [0.99, 1.01]. Prints one row per model,
``generation_config`` and sampler; exits 1 unless every ``generate_kwargs()`` row is 1.0000 with no
token outside the band.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests): find the siblings
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_grpo  # noqa: E402

from lightning_kl import hf  # noqa: E402

#: a chat checkpoint's generation_config.json, in the spirit of the ones on the Hub
CHECKPOINT_LIKE = {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.8, "repetition_penalty": 1.05}


def measure(config: str, rollouts: int = 8, overrides: Optional[list[str]] = None) -> tuple[Any, list[dict[str, Any]]]:
    """The YAML's sampler, and one row per model x ``generation_config`` x sampler: the ratio's figures
    over ``rollouts`` batches."""
    import transformers

    cli = hf_grpo.main(["--config", config, "--trainer.logger=false", *(overrides or [])], run=False)
    module, dm = cli.model, cli.datamodule
    s = dm.sampling
    models = {"pretrained": module.reference_model(dm)}
    h = module.hparams
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        models["random init"] = hf_grpo.build_model(h.arch, h.hidden_size, h.num_layers, h.num_heads, h.num_kv_heads,
                                                    h.intermediate_size, dm.max_length)
    samplers = {
        "generate(**sampling.generate_kwargs())": s.generate_kwargs(),
        "generate(do_sample=True, temperature, top_p)": {
            "do_sample": True, "temperature": s.temperature, "top_p": 1.0 if s.top_p is None else s.top_p,
        },
    }
    rows = []
    for model_name, model in models.items():
        model.eval()
        default = model.generation_config
        configs = {
            "the model's default": default,
            "checkpoint-like": transformers.GenerationConfig(**{**default.to_dict(), **CHECKPOINT_LIKE}),
        }
        for config_name, generation_config in configs.items():
            model.generation_config = generation_config
            for sampler_name, kwargs in samplers.items():
                generator = torch.Generator().manual_seed(0)
                torch.manual_seed(0)
                total = ratio_sum = outside_sum = 0.0
                for _ in range(rollouts):
                    problems = hf_grpo.sample_problems(dm.hparams.prompts_per_rollout, dm.hparams.max_operand, generator)
                    problems = [ab for ab in problems for _ in range(dm.hparams.group_size)]
                    with torch.no_grad():
                        batch = dm.sample(model, problems, torch.device("cpu"), generate_kwargs=kwargs)
                        seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
                        p = seq.shape[1] - mask.shape[1]
                        lp = hf.response_logprobs(model, seq, am, p, outside="-inf", **dm.scoring)
                    a = hf.sampler_agreement(lp, batch["generate_scores"], seq[:, p:], mask)
                    total += a.tokens
                    ratio_sum += a.mean_ratio * a.tokens
                    outside_sum += a.share_outside * a.tokens
                rows.append({"model": model_name, "generation_config": config_name, "sampler": sampler_name,
                             "mean_ratio": ratio_sum / total, "share_outside": outside_sum / total, "tokens": int(total)})
            model.generation_config = default
    return s, rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the example's YAML (examples/configs/hf_grpo_lora.yaml)")
    parser.add_argument("--rollouts", type=int, default=8, help="rollout batches per row")
    args, overrides = parser.parse_known_args(argv)
    sys.argv = sys.argv[:1]  # the overrides go to the example's LightningCLI through its args
    # the rollout dataset's length warning and peft's deprecation: as in hf_grpo.main
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
    sampling, rows = measure(args.config, args.rollouts, overrides)
    print(f"{args.config}: {sampling}, {args.rollouts} rollouts per row; checkpoint-like: {CHECKPOINT_LIKE}")
    print(f"{'model':<12} {'generation_config':<20} {'sampler':<46} {'mean ratio':>10} {'outside [0.99, 1.01]':>21} {'tokens':>7}")
    ok = True
    for r in rows:
        print(f"{r['model']:<12} {r['generation_config']:<20} {r['sampler']:<46} {r['mean_ratio']:>10.4f} "
              f"{r['share_outside']:>20.1%} {r['tokens']:>7}")
        if r["sampler"].startswith("generate(**"):
            ok &= f"{r['mean_ratio']:.4f}" == "1.0000" and r["share_outside"] == 0.0
    print(("PASS" if ok else "FAIL") + "  every generate(**sampling.generate_kwargs()) row: ratio 1.0000, 0% outside [0.99, 1.01]")
    return 0 if ok else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
