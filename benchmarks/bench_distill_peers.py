"""Distillation losses beside TRL's and verl's own, on the same CPU inputs: time and peak extra memory.

Forward + ``backward`` of the sum of the per-token loss; the student's inputs require grad, the teacher's do
not. The peers' functions are read from the pinned packages (``_stacks.py``: TRL 1.16.0, verl 0.9.1), not copied.
Cases, for each ``--shapes`` entry ``tokens x vocab`` (float32):

* ``jsd-logits``, the generalized JSD at ``--beta`` on ``[n, V]`` logits of both models:
  - ``trl-gkd``: TRL's ``GKDTrainer.generalized_jsd_loss(s, t, beta=beta, reduction="sum")`` (log-softmax of
    both, the mixture by ``logsumexp`` over a stacked pair, ``F.kl_div`` twice, all ``[n, V]``);
  - ``ours``: ``lk.full_kl(s, t, divergence="jsd", beta=beta)``.
* ``jsd-hidden``, the same from hidden states ``[n, --dim]`` and heads ``[V, --dim]`` (both models; the
  student's hidden states and head require grad):
  - ``trl-chunked``: TRL's ``ChunkedDivergenceFunction``, the kernel ``DistillationTrainer`` calls (its torch
    path on a CPU: tiles of 4,096 tokens x 32,768 ids);
  - ``ours``: ``lk.full_kl(lk.FromHidden(h, w), lk.FromHidden(h_t, w_t), divergence="jsd", beta=beta)``.
* ``topk k=...`` for each of ``--ks``, the forward KL to a teacher's top-k log-probs (``[n, k]`` ids and
  log-probs):
  - ``verl``: verl's ``compute_forward_kl_topk`` (FSDP; ``F.log_softmax`` of the student's ``[n, V]``, a
    gather, its sum over the ids, the top-k overlap diagnostics it also returns), then the registry's
    ``clamp_min(0.0)``;
  - ``verl-chunked``: the same with ``use_chunked_topk=True`` (its opt-in chunked log-softmax);
  - ``ours``: ``lk.full_kl(logits, lk.TopK(ids, logprobs), divergence="forward")`` (the coarsened divergence
    with its tail cell: not the same number as verl's, see ``examples/topk_bias.py``).

Method. Memory (``_measure.py``, as ``bench_topk.py``): each variant in a fresh child process
(``MALLOC_MMAP_THRESHOLD_=65536``), one warm-up step, the resident high-water mark reset, one measured step; the
extra memory is the peak resident memory above the start less the student's gradients, which every variant
returns; medians over ``--runs`` children, the variants alternated. Time: one more child runs every variant of
the case on the same inputs, in alternated rounds (a warm-up round, then ``--pairs`` rounds, the order reversed
every other round); ``time`` is each variant's median step and ``time / peer`` the median over rounds of its
step over the peer's in the same round, so that a change of the machine's load reaches both sides of a ratio.
The ratios are to the case's first variant, the peer's.

    nice -n 10 python benchmarks/bench_distill_peers.py            # the docs table
    python benchmarks/bench_distill_peers.py --quick               # a smoke run (ratios say nothing)

Without a pinned package its variants are skipped, with the install command printed. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import peak_and_time, run_child  # noqa: E402
from _stacks import StackMissing, package_root  # noqa: E402

CASES = {"jsd-logits": ("trl-gkd", "ours"), "jsd-hidden": ("trl-chunked", "ours"), "topk": ("verl", "verl-chunked", "ours")}
NEEDS = {"trl-gkd": "trl", "trl-chunked": "trl", "verl": "verl", "verl-chunked": "verl"}


def _runner(args: argparse.Namespace, variant: str) -> tuple[Callable[[], Any], list[Any]]:
    """``(run, grads)``: the variant's loss on this case's inputs (the same tensors for every variant of a
    process: the generator's seed fixes them), and the tensors whose gradients it returns."""
    import torch

    import lightning_kl as lk
    from _stacks import trl_chunked_divergence, trl_generalized_jsd_loss, verl_forward_kl_topk

    g = torch.Generator().manual_seed(0)
    n, v, case = args.tokens, args.vocab, args.case
    if case == "jsd-hidden":
        d = args.dim
        h = torch.randn(n, d, generator=g).requires_grad_()
        w = (torch.randn(v, d, generator=g) * d**-0.5).requires_grad_()
        h_t, w_t = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) * d**-0.5
        if variant == "trl-chunked":
            kernel = trl_chunked_divergence()
            return (lambda: kernel.apply(h, w, None, h_t, w_t, None, args.beta, 1.0, 1.0, None, 1.0, None)[0]), [h, w]
        return (lambda: lk.full_kl(lk.FromHidden(h, w), lk.FromHidden(h_t, w_t), divergence="jsd", beta=args.beta)), [h, w]
    logits = (2 * torch.randn(n, v, generator=g)).requires_grad_()
    if case == "jsd-logits":
        teacher = 2 * torch.randn(n, v, generator=g)
        if variant == "trl-gkd":
            gjsd = trl_generalized_jsd_loss()
            return (lambda: gjsd(logits, teacher, beta=args.beta, reduction="sum")), [logits]
        return (lambda: lk.full_kl(logits, teacher, divergence="jsd", beta=args.beta)), [logits]
    lq, ids = (2 * torch.randn(n, v, generator=g)).log_softmax(-1).topk(args.k, dim=-1)
    if variant.startswith("verl"):
        verl, chunked = verl_forward_kl_topk(), variant == "verl-chunked"
        return (lambda: verl(logits, ids, lq, use_chunked_topk=chunked)[0]), [logits]
    return (lambda: lk.full_kl(logits, lk.TopK(ids, lq), divergence="forward")), [logits]


def _child(args: argparse.Namespace) -> None:
    import time

    import torch

    if args.child != "paired":  # one variant: its peak extra memory (and its time, alone in its process)
        run, grads = _runner(args, args.child)

        def step() -> None:
            run().sum().backward()

        def clear() -> None:
            for t in grads:
                t.grad = None

        grads_mib = sum(t.numel() for t in grads) * 4 / 2**20
        peak, seconds = peak_and_time(step, clear, args.reps)
        print(json.dumps({"peak_mib": peak - grads_mib, "seconds": seconds, "threads": torch.get_num_threads()}))
        return
    # every variant of the case in this one process, on the same inputs, timed in alternation: a change of the
    # machine's load between two steps reaches both sides of a ratio alike
    names = args.variants.split(",")
    runners = {name: _runner(args, name) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.pairs + 1):
        for name in names if i % 2 == 0 else names[::-1]:
            run, grads = runners[name]
            t0 = time.perf_counter()
            run().sum().backward()
            elapsed = time.perf_counter() - t0
            for t in grads:
                t.grad = None
            if i > 0:  # the first round is the warm-up
                times[name].append(elapsed)
    out = {name: {"seconds": statistics.median(ts), "ratio": statistics.median(t / b for t, b in zip(ts, times[names[0]]))}
           for name, ts in times.items()}  # fmt: skip
    print(json.dumps({"paired": out, "threads": torch.get_num_threads()}))


def _available(variant: str) -> bool:
    if variant not in NEEDS:
        return True
    try:
        package_root(NEEDS[variant])
        return True
    except StackMissing as e:
        print(f"{variant}: skipped ({e})")
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1024x32768,256x8192", help="tokens x vocab, comma separated")
    parser.add_argument("--dim", type=int, default=256, help="hidden width of jsd-hidden")
    parser.add_argument("--ks", default="64,128")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--cases", default="jsd-logits,jsd-hidden,topk")
    parser.add_argument("--runs", type=int, default=2, help="memory: child processes per variant (alternated)")
    parser.add_argument("--pairs", type=int, default=5, help="time: alternated rounds of every variant in one process")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    if args.quick:
        args.shapes, args.dim, args.ks, args.runs, args.pairs = "64x512", 16, "8", 1, 1
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    variants = {case: [v for v in CASES[case] if _available(v)] for case in args.cases.split(",")}
    rows, threads, load = [], 0, []
    for n, v in shapes:
        for case, names in variants.items():
            for k in ks if case == "topk" else [None]:
                common = [sys.executable, os.path.abspath(__file__), "--case", case, "--tokens", str(n), "--vocab", str(v),
                          "--dim", str(args.dim), "--beta", str(args.beta)] + (["--k", str(k)] if k else [])  # fmt: skip
                found: dict[str, list[float]] = {name: [] for name in names}
                for _ in range(args.runs):
                    for name in names:  # alternated: every variant sees the same load over time
                        found[name].append(run_child(common + ["--child", name], fixed_mmap_threshold=True)["peak_mib"])
                load.append(os.getloadavg()[0])
                paired = run_child(common + ["--child", "paired", "--variants", ",".join(names), "--pairs", str(args.pairs)])
                threads = paired["threads"]
                mem = {name: statistics.median(ps) for name, ps in found.items()}
                label = f"{case}" + (f" k={k}" if k else "") + (f" d={args.dim}" if case == "jsd-hidden" else "")
                base = names[0] if names[0] != "ours" else None
                for name in names:
                    t = paired["paired"][name]
                    mem_ratio = f"{mem[name] / mem[base]:.3f}x" if base and mem[base] >= 1 else "-"  # below 1 MiB: noise
                    time_ratio = f"{t['ratio']:.2f}x" if base else "-"
                    rows.append(f"| {n:,} x {v:,} | {label} | {name} | {mem[name]:.1f} | {mem_ratio} | {t['seconds']:.4f} | {time_ratio} |")
    print(f"\ndistillation losses, forward + backward, float32, beta = {args.beta} (JSD); memory: medians of {args.runs} "
          f"alternated processes; time: medians over {args.pairs} alternated rounds in one process; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads {threads}, "
          f"load average {min(load):.1f} to {max(load):.1f}\n")
    print("| tokens x vocab | case | variant | extra memory (MiB) | memory / peer | time (s) | time / peer |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
