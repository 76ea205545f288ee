"""Peak extra memory and time of the top-k divergence (a served teacher's top-k, ``lk.TopK``) against the plain composition.

Forward + ``backward`` of the sum of the per-token divergence, ``--tokens`` x ``--vocab`` float32 student
logits with grad and a teacher's top ``--k`` ids and log-probs:

* naive: ``torch.log_softmax(logits, -1).gather(-1, ids)``, the tails ``log(1 - exp(logsumexp))`` and the
  divergence of the ``k + 1`` cells (``lightning_kl.kernels.divergence``), all by autograd;
* lean: ``lk.full_kl(logits, lk.TopK(ids, logprobs), divergence=...)`` (the engine's chunked k-id gather).

Each measurement runs in a fresh child process (``_measure.py``: ``MALLOC_MMAP_THRESHOLD_=65536``, one
warm-up, ``VmHWM`` reset); the peak extra memory excludes the logits' gradient, which both return. The
table shows medians over ``--runs`` children and the ratios lean / naive.

    python benchmarks/bench_topk.py            # 1024 x 32768, k = 64
    python benchmarks/bench_topk.py --quick    # a smoke run (ratios say nothing)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import peak_and_time, run_child  # noqa: E402


def _child(args: argparse.Namespace) -> None:
    import json

    import torch

    import lightning_kl as lk
    from lightning_kl.kernels.divergence import divergence

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, generator=g).requires_grad_()
    lq, ids = torch.randn(args.tokens, args.vocab, generator=g).log_softmax(-1).topk(args.k, dim=-1)

    def log1mexp(a: torch.Tensor) -> torch.Tensor:
        return torch.where(a > -0.693, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))

    def naive() -> torch.Tensor:
        lp = torch.log_softmax(logits, -1).gather(-1, ids)
        cells_p = torch.cat([lp, log1mexp(torch.logsumexp(lp, -1, keepdim=True).clamp(max=-1e-7))], -1)
        cells_q = torch.cat([lq, log1mexp(torch.logsumexp(lq, -1, keepdim=True).clamp(max=-1e-7))], -1)
        return divergence(cells_p, cells_q, args.divergence)

    def lean() -> torch.Tensor:
        return lk.full_kl(logits, lk.TopK(ids, lq), divergence=args.divergence)

    run = naive if args.child == "naive" else lean

    def step() -> None:
        run().sum().backward()

    def clear() -> None:
        logits.grad = None

    grad_mib = args.tokens * args.vocab * 4 / 2**20
    peak, seconds = peak_and_time(step, clear, args.reps)
    print(json.dumps({"peak_mib": peak - grad_mib, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--divergence", default="reverse")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.vocab, args.k, args.reps, args.runs = 64, 512, 8, 1, 1
    if args.child:
        _child(args)
        return
    results: dict[str, list[dict[str, float]]] = {"naive": [], "lean": []}
    for _ in range(args.runs):  # interleaved, run by run
        for variant in results:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--tokens", str(args.tokens), "--vocab",
                   str(args.vocab), "--k", str(args.k), "--divergence", args.divergence, "--reps", str(args.reps)]
            results[variant].append(run_child(cmd, fixed_mmap_threshold=True))
    med = {v: {key: statistics.median(r[key] for r in rs) for key in ("peak_mib", "seconds")} for v, rs in results.items()}
    print(f"top-k divergence ({args.divergence}), {args.tokens} x {args.vocab} float32 logits, k = {args.k}, fwd+bwd")
    print(f"{'':8} {'peak extra MiB':>15} {'seconds':>10}")
    for v in ("naive", "lean"):
        print(f"{v:8} {med[v]['peak_mib']:15.1f} {med[v]['seconds']:10.4f}")
    print(f"{'lean/naive':8} {med['lean']['peak_mib'] / max(med['naive']['peak_mib'], 1e-9):15.2f} "
          f"{med['lean']['seconds'] / med['naive']['seconds']:10.2f}")


if __name__ == "__main__":
    main()
