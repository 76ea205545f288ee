"""Peak extra memory and time of the exact KL ('full') against the plain composition.

Both variants compute the per-token KL(pi || pi_ref) over the vocabulary for ``tokens x vocab``
logits and back-propagate ``kl.sum()`` into the policy logits (the reference is frozen unless
``--ref-grad``):

* ``composition``: ``logp = log_softmax(z)``, ``logq = log_softmax(z_ref)``,
  ``(logp.exp() * (logp - logq)).sum(-1)``, differentiated by autograd;
* ``full``: ``lk.kl_penalty(z, z_ref, "full")`` (chunked forward, recomputing backward).

Each measurement runs in a fresh child process: it builds the inputs, does one warm-up
forward+backward, drops the gradient, resets the kernel's resident-memory high-water mark
(``echo 5 > /proc/self/clear_refs``), and then times ``--reps`` forward+backward passes; the peak
extra memory is ``VmHWM`` minus the resident memory just before the first timed pass (so the inputs
are not counted; the gradient, which both variants must produce, is). Variants are interleaved
run by run; the table shows medians over ``--runs`` children and the ratio to the composition.

    python benchmarks/bench_full_kl.py            # 2048 tokens x 32768 vocabulary, float32
    python benchmarks/bench_full_kl.py --quick    # a smoke run (seconds): at 256 x 4096 a chunk is
                                                  # half the tensor, so its ratios say nothing
    python benchmarks/bench_full_kl.py --chunks 1,4,16,64   # also sweep full's chunk size (tokens)

Linux only (reads /proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from _measure import peak_and_time, run_child  # this folder: the child-process measurement

TARGET_MEMORY_RATIO = 0.3
TARGET_TIME_RATIO = 1.1


def _child(args: argparse.Namespace) -> None:
    import torch

    import lightning_kl as lk

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    z = (torch.randn(args.tokens, args.vocab) * 2).to(dtype).requires_grad_()
    z_ref = (torch.randn(args.tokens, args.vocab) * 2).to(dtype).requires_grad_(args.ref_grad)
    temperature = args.temperature

    def composition() -> torch.Tensor:
        logp = torch.log_softmax(z.float() / temperature, dim=-1)
        logq = torch.log_softmax(z_ref.float() / temperature, dim=-1)
        return (logp.exp() * (logp - logq)).sum(-1)

    def full() -> torch.Tensor:
        if args.chunk is None:
            # one sequence of n positions [1, n, V] (flat [n, V] rows without a mask are refused)
            return lk.kl_penalty(z[None], z_ref[None], "full", sampling=lk.Sampling(temperature=temperature))[0]
        return lk.full_kl(z, z_ref, sampling=lk.Sampling(temperature), chunk_size=args.chunk)

    fn = composition if args.child == "composition" else full

    def step() -> None:
        fn().sum().backward()

    def clear() -> None:
        z.grad = None
        z_ref.grad = None

    extra_mib, time_s = peak_and_time(step, clear, args.reps)
    print(json.dumps({"extra_mib": extra_mib, "time_s": time_s}))


def _run_child(args: argparse.Namespace, variant: str, chunk: int | None) -> dict[str, float]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        variant,
        "--tokens",
        str(args.tokens),
        "--vocab",
        str(args.vocab),
        "--dtype",
        args.dtype,
        "--temperature",
        str(args.temperature),
        "--reps",
        str(args.reps),
    ]
    if chunk is not None:
        cmd += ["--chunk", str(chunk)]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    if args.ref_grad:
        cmd.append("--ref-grad")
    # every large block mapped on malloc and unmapped on free: without it, at small sizes (blocks under
    # glibc's adaptive mmap threshold) a freed gradient stays resident between steps, and the peak above
    # it reads below the gradient's own size ("beyond grads" negative)
    return run_child(cmd, fixed_mmap_threshold=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--ref-grad", action="store_true", help="the reference logits require grad too")
    parser.add_argument("--runs", type=int, default=5, help="child processes per variant (interleaved)")
    parser.add_argument("--reps", type=int, default=3, help="timed forward+backward passes per child")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in each child (default: torch's)")
    parser.add_argument("--chunks", default="", help="comma-separated chunk sizes (tokens) to sweep for full")
    parser.add_argument("--quick", action="store_true", help="smoke run: 256 x 4096, 1 run, 1 rep")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args)
        return
    if args.quick:
        args.tokens, args.vocab, args.runs, args.reps = 256, 4096, 1, 1

    variants: list[tuple[str, str, int | None]] = [("composition", "composition", None), ("full", "full", None)]
    for c in filter(None, args.chunks.split(",")):
        variants.append((f"full chunk={int(c)}", "full", int(c)))
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in variants}
    load_before = os.getloadavg()[0]
    for run in range(args.runs):
        order = variants if run % 2 == 0 else variants[::-1]  # interleaved, alternating order
        for label, variant, chunk in order:
            results[label].append(_run_child(args, variant, chunk))

    load_after = os.getloadavg()[0]
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    n_grads = 2 if args.ref_grad else 1
    grad_mib = args.tokens * args.vocab * torch.finfo(getattr(torch, args.dtype)).bits / 8 / 2**20
    print(
        f"exact KL over the vocabulary: {args.tokens} tokens x {args.vocab} vocab, {args.dtype}, "
        f"T={args.temperature}, ref grad={args.ref_grad}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads on {os.cpu_count()} CPUs; median of {args.runs} runs x {args.reps} reps; "
        f"load average {load_before:.1f} before, {load_after:.1f} after"
    )
    print(f"(one [tokens, vocab] tensor of this dtype = {grad_mib:.0f} MiB; each gradient is one of them)")
    med = {label: {k: statistics.median(r[k] for r in rs) for k in ("extra_mib", "time_s")} for label, rs in results.items()}
    base = med["composition"]
    print(
        f"{'variant':<18} {'peak extra MiB':>15} {'beyond grads':>13} {'mem ratio':>10} "
        f"{'fwd+bwd ms':>11} {'time ratio':>11}"
    )
    for label, m in med.items():
        print(
            f"{label:<18} {m['extra_mib']:>15.1f} {m['extra_mib'] - n_grads * grad_mib:>13.1f} "
            f"{m['extra_mib'] / base['extra_mib']:>10.3f} {m['time_s'] * 1e3:>11.1f} {m['time_s'] / base['time_s']:>11.3f}"
        )
    if args.quick:
        print("(--quick: a smoke run; at this size the ratios are not the benchmark's)")
    mem_ratio = med["full"]["extra_mib"] / base["extra_mib"]
    time_ratio = med["full"]["time_s"] / base["time_s"]
    print(
        f"full vs composition: memory {mem_ratio:.3f}x (target <= {TARGET_MEMORY_RATIO}x: "
        f"{'met' if mem_ratio <= TARGET_MEMORY_RATIO else 'MISSED'}), time {time_ratio:.3f}x "
        f"(target <= {TARGET_TIME_RATIO}x: {'met' if time_ratio <= TARGET_TIME_RATIO else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
