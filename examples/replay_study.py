r"""The importance ratio under a truncating sampler, by enumeration: temperature-only scoring, replay, ``outside="-inf"``.

    python examples/replay_study.py            # the table in docs/sampling.md
    python examples/replay_study.py --step 0.5 --temperature 0.7

A toy policy: ``N`` contexts, logits ``z ~ scale * N(0, 1)`` over ``V`` tokens. The sampler ``mu`` is the
old policy's processed distribution (``lk.Sampling(T, top_p=p)``: the softmax at ``T`` renormalized on the
nucleus ``K_old``). After one update the logits are ``z + step * N(0, 1)`` (``--step``; 0 is on-policy).
For every context and every token the sampler can draw (enumeration, weights ``mu(y)``), the ratio to the
sampler ``rho = pi(y) / mu(y)`` is taken with ``pi`` the new policy's:

* exact: its processed distribution, ``softmax(z_new / T)`` on its own nucleus ``K_new`` (0 outside);
* temperature-only (what verl and TRL score): ``softmax(z_new / T)``, no truncation;
* replay: ``softmax(z_new / T)`` renormalized on the recorded ``K_old`` (``lk.token_logprobs(..., kept=)``);
* ``outside="-inf"``: the processed distribution recomputed, a token outside ``K_new`` scored ``-inf`` and dropped.

Printed per ``top_p``: the mean of ``log rho - log rho_exact`` under ``mu`` over the tokens the new
nucleus keeps (the bias of the log ratio), the share of tokens whose ratio ``rho / rho_exact`` is
outside ``[0.99, 1.01]``, and the sampled mass outside ``K_new`` (the exact ratio there is 0: ``-inf``
drops those tokens, temperature-only scoring and replay give them a finite ratio). Every figure is
exact for the toy (float64, no sampling noise); the log-probs come from ``lk.token_logprobs``.
"""

from __future__ import annotations

import argparse

import torch

import lightning_kl as lk
from lightning_kl.ground.sampler import process_scores

TOP_PS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


def study(top_p: float, temperature: float, step: float, n: int, vocab: int, scale: float, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale
    new = old + step * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    s = lk.Sampling(temperature, top_p=top_p)
    mu = torch.softmax(process_scores(old / temperature, s), -1)  # the sampler, float64
    # every (context, token) pair as one position: [n, V] tokens over [n, V, V] logits (expanded, not copied)
    ys = torch.arange(vocab).expand(n, vocab)
    drawable = mu > 0
    tokens = ys.masked_fill(~drawable, -100)  # the sampler never draws the others: nothing to score
    grid_old, grid_new = old[:, None].expand(n, vocab, vocab), new[:, None].expand(n, vocab, vocab)
    _, kept = lk.token_logprobs(grid_old, tokens, sampling=s, ignore_index=-100, return_kept=True)
    log_mu = mu.log()
    exact = lk.token_logprobs(grid_new, tokens, sampling=s, ignore_index=-100, outside="-inf")
    temp_only = lk.token_logprobs(grid_new, tokens, sampling=lk.Sampling(temperature), ignore_index=-100)
    replay = lk.token_logprobs(grid_new, tokens, sampling=s, ignore_index=-100, kept=kept)
    inside = drawable & (exact > float("-inf"))
    w = mu / n  # the sampler's weights over the pairs (they sum to 1)
    out = {"dropped": float(w[drawable & ~inside].sum())}
    for name, lp in (("temp", temp_only), ("replay", replay)):
        d = (lp - exact)[inside]  # log rho - log rho_exact (the same denominator mu)
        out[f"{name}_bias"] = float((w[inside] * d).sum() / w[inside].sum())
        out[f"{name}_off"] = float((w[inside] * ((d.exp() < 0.99) | (d.exp() > 1.01))).sum() / w[inside].sum())
        assert lp[drawable].isfinite().all()
    out["kept"] = float(drawable.sum(-1).double().mean())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--steps", type=float, nargs="+", default=[0.0, 0.3])
    parser.add_argument("--contexts", type=int, default=400)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--scale", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"toy: {args.contexts} contexts, V={args.vocab}, logits {args.scale} * N(0, 1), T={args.temperature}")
    print("bias = E_mu[log rho - log rho_exact] on the tokens the new nucleus keeps; off = share with rho/rho_exact outside [0.99, 1.01];")
    print("dropped = the sampled mass outside the new nucleus (exact ratio 0: outside='-inf' drops it, the others score it)")
    print()
    print("| step | top_p | mean kept | temp-only bias | temp-only off | replay bias | replay off | dropped |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for step in args.steps:
        for top_p in TOP_PS:
            r = study(top_p, args.temperature, step, args.contexts, args.vocab, args.scale, args.seed)
            print(
                f"| {step:g} | {top_p:g} | {r['kept']:.1f} | {r['temp_bias']:+.4f} | {r['temp_off']:.1%} | "
                f"{r['replay_bias']:+.4f} | {r['replay_off']:.1%} | {r['dropped']:.2%} |"
            )


if __name__ == "__main__":
    main()
