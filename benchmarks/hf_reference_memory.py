r"""Parameter memory of the reference: a frozen copy of the model, or the same model with its LoRA adapters off.

    python benchmarks/hf_reference_memory.py

Builds the models on the ``meta`` device (no weights are allocated or downloaded) and counts bytes:
the example's model (float32) and a model shaped like Qwen2.5-0.5B (bf16, from its published
config values). LoRA adapters on every linear layer of the decoder (r as given). With the adapters off,
the reference needs no parameter memory beyond the policy's: the forward pass with adapters off costs
the same activations as any no-grad forward pass.
"""

from __future__ import annotations

import warnings

import torch

warnings.filterwarnings("ignore")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = {
    # examples/configs/hf_grpo_lora.yaml
    "hf_grpo example (float32)": dict(
        dtype=torch.float32, r=8, vocab_size=15, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    # Qwen/Qwen2.5-0.5B config.json values
    "Qwen2.5-0.5B shape (bf16)": dict(
        dtype=torch.bfloat16, r=16, vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    ),
}


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def main() -> None:
    import peft
    import transformers

    print(f"{'model':<28} {'base weights':>14} {'LoRA adapters':>14} {'ref: a copy':>14} {'ref: adapters off':>18}")
    for name, shape in SHAPES.items():
        shape = dict(shape)
        dtype, r = shape.pop("dtype"), shape.pop("r")
        with torch.device("meta"):
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape)).to(dtype)
            base = nbytes(model.parameters())
            policy = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS))
            adapters = nbytes(p for p in policy.parameters() if p.requires_grad)
        mib = lambda n: f"{n / 2**20:,.2f} MiB"  # noqa: E731
        print(f"{name:<28} {mib(base):>14} {mib(adapters):>14} {'+' + mib(base):>14} {'+0':>18}")


if __name__ == "__main__":
    main()
