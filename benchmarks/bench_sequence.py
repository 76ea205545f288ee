"""What ``level="sequence"`` costs over ``level="token"``: forward + backward time, side by side.

    python benchmarks/bench_sequence.py            # 4M float32 tokens (64 x 65536), k3+ and k3, 7 repeats
    python benchmarks/bench_sequence.py --quick    # a smoke run

Each repeat times one forward and backward of ``aggregate(kl_penalty(...), mask, "seq-mean-token-sum")``
at each level, alternating the levels so that both see the same load; it prints the medians and their
ratio, on-policy and off-policy (``old_logprob``). Timings on shared machines are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import lightning_kl as lk


def once(logprob, ref, mask, name: str, level: str, old) -> float:
    lp = logprob.detach().requires_grad_()
    start = time.perf_counter()
    out = lk.kl_penalty(lp, ref, name, mask=mask, level=level, old_logprob=old)
    lk.aggregate(out, mask, "seq-mean-token-sum").backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.length, args.repeats = 8, 8192, 3
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.length)
    logprob = torch.randn(shape, generator=g) - 1
    ref = logprob + 0.1 * torch.randn(shape, generator=g)
    old = logprob + 0.01 * torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.1
    print(f"{args.batch} x {args.length} float32 tokens, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'estimator':<10} {'weights':<12} {'token (ms)':>11} {'sequence (ms)':>14} {'ratio':>6}")
    for name in ("k3+", "k3"):
        for weights, o in (("on-policy", None), ("old_logprob", old)):
            times = {"token": [], "sequence": []}
            once(logprob, ref, mask, name, "token", o)  # warm-up
            once(logprob, ref, mask, name, "sequence", o)
            for _ in range(args.repeats):
                for level in times:
                    times[level].append(once(logprob, ref, mask, name, level, o))
            tok, seq = (statistics.median(times[k]) * 1e3 for k in ("token", "sequence"))
            print(f"{name:<10} {weights:<12} {tok:>11.1f} {seq:>14.1f} {seq / tok:>5.2f}x")


if __name__ == "__main__":
    main()
