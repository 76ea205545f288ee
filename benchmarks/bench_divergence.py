"""Time and peak extra memory of every divergence of ``lk.full_kl`` against the reverse KL and the plain composition.

For ``tokens x vocab`` logits of the policy and of the other model (a teacher; frozen unless
``--other-grad``), forward and backward of ``value.sum()`` into the policy's logits, for each divergence:

* ``lk.full_kl(z, z_other, sampling=lk.Sampling(T), divergence=..., beta=0.5)``: the one chunked engine;
* the plain composition: ``log_softmax`` of both models' logits (float32), then the divergence's formula
  (the two KLs, their mix, the JSD with ``log m = logaddexp(log p + log(1 - beta), log q + log(beta))`` as
  TRL writes it), differentiated by autograd.

Each measurement is a fresh child process (``_measure.py``: one warm-up pass, then ``--reps`` timed passes;
the peak extra memory is ``VmHWM`` above the resident memory before the first timed pass, so the inputs
are not counted and the gradient, which every variant returns, is). Variants are interleaved run by
run; the table shows medians over ``--runs`` children and two ratios per divergence: its time to the
reverse KL's (issue 41's goal: within 1.2x) and its memory to its own plain composition's (goal: at
most 0.3x). ``--head`` measures ``lk.FromHidden`` instead (``tokens x hidden`` states, a
``vocab x hidden`` head per model): the composition then makes both ``[n, V]`` logits by matmul.

    python benchmarks/bench_divergence.py                # 2048 tokens x 32768 vocabulary, float32
    python benchmarks/bench_divergence.py --quick        # a smoke run (seconds; its ratios say nothing)
    python benchmarks/bench_divergence.py --head --tokens 1024 --vocab 65536

Linux only (reads /proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

from _measure import peak_and_time, run_child  # this folder: the child-process measurement

DIVERGENCES = ("reverse", "forward", "jsd", "mixed")
BETA = 0.5
TARGET_TIME_RATIO = 1.2  # of the reverse KL's time
TARGET_MEMORY_RATIO = 0.3  # of the plain composition's peak extra memory


def _composition(lp, lq, name: str):  # type: ignore[no-untyped-def]
    import torch

    if name == "reverse":
        return (lp.exp() * (lp - lq)).sum(-1)
    if name == "forward":
        return (lq.exp() * (lq - lp)).sum(-1)
    if name == "mixed":
        return (1 - BETA) * (lq.exp() * (lq - lp)).sum(-1) + BETA * (lp.exp() * (lp - lq)).sum(-1)
    lm = torch.logaddexp(lp + math.log1p(-BETA), lq + math.log(BETA))
    return BETA * (lq.exp() * (lq - lm)).sum(-1) + (1 - BETA) * (lp.exp() * (lp - lm)).sum(-1)


def _child(args: argparse.Namespace) -> None:
    import warnings

    import torch

    import lightning_kl as lk

    warnings.simplefilter("ignore")  # --other-grad: on purpose
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t = args.temperature
    name = args.divergence
    beta = BETA if name in ("jsd", "mixed") else None
    if args.head:
        h = torch.randn(args.tokens, args.hidden).requires_grad_()
        w = (torch.randn(args.vocab, args.hidden) / args.hidden**0.5 * 2).requires_grad_()
        h_o = torch.randn(args.tokens, args.hidden).requires_grad_(args.other_grad)
        w_o = (torch.randn(args.vocab, args.hidden) / args.hidden**0.5 * 2).requires_grad_(args.other_grad)
        leaves = [h, w, h_o, w_o]
        x, x_o = lk.FromHidden(h, w), lk.FromHidden(h_o, w_o)
        logits = lambda: (h @ w.T, h_o @ w_o.T)  # noqa: E731
    else:
        z = (torch.randn(args.tokens, args.vocab) * 2).requires_grad_()
        z_o = (torch.randn(args.tokens, args.vocab) * 2).requires_grad_(args.other_grad)
        leaves = [z, z_o]
        x, x_o = z, z_o
        logits = lambda: (z, z_o)  # noqa: E731

    def engine() -> torch.Tensor:
        return lk.full_kl(x, x_o, sampling=lk.Sampling(t), divergence=name, beta=beta)

    def composition() -> torch.Tensor:
        a, b = logits()
        return _composition(torch.log_softmax(a.float() / t, -1), torch.log_softmax(b.float() / t, -1), name)

    fn = composition if args.child == "composition" else engine

    def step() -> None:
        fn().sum().backward()

    def clear() -> None:
        for leaf in leaves:
            leaf.grad = None

    extra_mib, time_s = peak_and_time(step, clear, args.reps)
    print(json.dumps({"extra_mib": extra_mib, "time_s": time_s}))


def _run_child(args: argparse.Namespace, variant: str, name: str) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--divergence", name, "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--temperature", str(args.temperature), "--reps", str(args.reps)]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    if args.other_grad:
        cmd.append("--other-grad")
    if args.head:
        cmd.append("--head")
    return run_child(cmd, fixed_mmap_threshold=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--head", action="store_true", help="lk.FromHidden of a head per model instead of logits")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--other-grad", action="store_true", help="the other model's inputs require grad too")
    parser.add_argument("--runs", type=int, default=3, help="child processes per variant (interleaved)")
    parser.add_argument("--reps", type=int, default=3, help="timed forward+backward passes per child")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--divergences", default=",".join(DIVERGENCES))
    parser.add_argument("--no-composition", action="store_true", help="the engine only (time ratios to reverse)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 256 x 4096, 1 run, 1 rep")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--divergence", default="reverse", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args)
        return
    if args.quick:
        args.tokens, args.vocab, args.runs, args.reps = 256, 4096, 1, 1
    names = [n for n in args.divergences.split(",") if n]
    assert "reverse" in names, "the ratios are to the reverse KL's time"
    variants = [(kind, n) for n in names for kind in (("engine",) if args.no_composition else ("engine", "composition"))]
    results: dict[tuple[str, str], list[dict[str, float]]] = {v: [] for v in variants}
    load_before = os.getloadavg()[0]
    for run in range(args.runs):
        for v in variants if run % 2 == 0 else variants[::-1]:
            results[v].append(_run_child(args, *v))
    load_after = os.getloadavg()[0]
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("extra_mib", "time_s")} for v, rs in results.items()}
    source = f"FromHidden (d = {args.hidden})" if args.head else "logits"
    print(f"{args.tokens} tokens x {args.vocab} vocabulary, {source}, float32, T = {args.temperature}, other side "
          f"{'with' if args.other_grad else 'without'} grad; medians of {args.runs} children x {args.reps} passes; "
          f"load {load_before:.1f} -> {load_after:.1f}")
    print("| divergence | engine MiB, s | composition MiB, s | time / reverse's (<= 1.2x) | memory / composition's (<= 0.3x) |")
    print("|---|---|---|---|---|")
    base = med[("engine", "reverse")]["time_s"]
    for n in names:
        e = med[("engine", n)]
        c = med.get(("composition", n))
        comp = f"{c['extra_mib']:.0f}, {c['time_s']:.3f}" if c else "-"
        mem = f"{e['extra_mib'] / c['extra_mib']:.2f}x" if c and c["extra_mib"] > 0 else "-"
        print(f"| {n} | {e['extra_mib']:.0f}, {e['time_s']:.3f} | {comp} | {e['time_s'] / base:.2f}x | {mem} |")


if __name__ == "__main__":
    main()
