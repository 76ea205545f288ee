"""Peak extra memory and time of token log-probs (and the full KL from hidden states) against the naive path.

Three cases, each forward + ``backward`` of the sum:

* ``logits``: ``--tokens`` x ``--vocab`` logits (default 2048 x 151,936 bf16, Qwen2.5's vocabulary).
  naive: ``torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None])``;
  lean: ``lk.token_logprobs(logits, tokens)``.
* ``hidden``: ``--hidden-tokens`` hidden states ``[n, d]`` and an LM head ``[V, d]`` (default 1024 x 896
  and 151,936 x 896 float32, Qwen2.5-0.5B's head), both requiring grad.
  naive: ``torch.log_softmax(hidden @ weight.T, -1).gather(...)``;
  lean: ``lk.token_logprobs(lk.FromHidden(hidden, weight), tokens)``.
* ``full-hidden``: the exact per-token KL over the vocabulary from the policy's hidden states and
  head (with grad) and the reference's (without), same shapes as ``hidden``.
  naive: both logits by matmul, both ``log_softmax``, ``(p * (logp - logq)).sum(-1)``;
  lean: ``lk.full_kl(lk.FromHidden(hidden, weight), lk.FromHidden(ref_hidden, ref_weight))``.

Method (as ``bench_full_kl.py``): each measurement runs in a fresh child process (with
``MALLOC_MMAP_THRESHOLD_=65536`` so that resident memory follows live tensors) that builds the
inputs, runs one warm-up forward+backward, drops the gradients, resets the kernel's resident
high-water mark (``5`` into ``/proc/self/clear_refs``) and then times ``--reps`` passes. The peak
extra memory is ``VmHWM`` minus the resident memory just before the first timed pass, *minus the
input gradients* that every implementation returns (the logits' gradient; those of ``hidden`` and
``weight``), which are allocated during the pass. Variants are interleaved run by run; the table
shows medians over ``--runs`` children, and the ratio lean / naive of both.

    python benchmarks/bench_logprobs.py                  # all three cases, the README table at the end
    python benchmarks/bench_logprobs.py --cases logits   # one case
    python benchmarks/bench_logprobs.py --quick          # a smoke run at small sizes (ratios say nothing)

Linux only (reads /proc/self/status). Needs about 5 GiB of free memory at the default sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

# this checkout's package, not an installed one
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _measure import peak_and_time, run_child  # noqa: E402  (this folder: the child-process measurement)

# (memory ratio, time ratio) targets per case, lean / naive (issue 12); None: no target
TARGETS = {"logits": (0.1, 1.0), "hidden": (0.1, 1.5), "full-hidden": (0.1, None)}
CASES = tuple(TARGETS)


def _child(args: argparse.Namespace) -> None:
    import torch

    import lightning_kl as lk

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    case, variant = args.case, args.child
    if case == "logits":
        z = (torch.randn(args.tokens, args.vocab) * 2).to(dtype).requires_grad_()
        tokens = torch.randint(0, args.vocab, (args.tokens,))
        leaves = [z]

        def run() -> torch.Tensor:
            if variant == "naive":
                return torch.log_softmax(z.float(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
            return lk.token_logprobs(z, tokens)

    else:
        n, d, vocab = args.hidden_tokens, args.dim, args.vocab
        h = torch.randn(n, d).to(dtype).requires_grad_()
        w = (torch.randn(vocab, d) * d**-0.5).to(dtype).requires_grad_()
        tokens = torch.randint(0, vocab, (n,))
        leaves = [h, w]
        if case == "hidden":

            def run() -> torch.Tensor:
                if variant == "naive":
                    return torch.log_softmax(h @ w.T, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
                return lk.token_logprobs(lk.FromHidden(h, w), tokens)

        else:
            h_ref = torch.randn(n, d).to(dtype)
            w_ref = (torch.randn(vocab, d) * d**-0.5).to(dtype)

            def run() -> torch.Tensor:
                if variant == "naive":
                    logp = torch.log_softmax((h @ w.T).float(), dim=-1)
                    with torch.no_grad():
                        logq = torch.log_softmax((h_ref @ w_ref.T).float(), dim=-1)
                    return (logp.exp() * (logp - logq)).sum(-1)
                return lk.full_kl(lk.FromHidden(h, w), lk.FromHidden(h_ref, w_ref))

    grads_mib = sum(x.numel() * x.element_size() for x in leaves) / 2**20

    def step() -> None:
        run().sum().backward()

    def clear() -> None:
        for x in leaves:
            x.grad = None

    peak_mib, time_s = peak_and_time(step, clear, args.reps)
    print(json.dumps({"extra_mib": peak_mib - grads_mib, "time_s": time_s, "grads_mib": grads_mib}))


def _run_child(args: argparse.Namespace, case: str, variant: str) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--case", case]
    cmd += ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--hidden-tokens", str(args.hidden_tokens)]
    cmd += ["--dim", str(args.dim), "--dtype", _dtype(args, case), "--reps", str(args.reps)]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    return run_child(cmd, fixed_mmap_threshold=True)


def _dtype(args: argparse.Namespace, case: str) -> str:
    return args.logits_dtype if case == "logits" else args.hidden_dtype


def _shape(args: argparse.Namespace, case: str) -> str:
    if case == "logits":
        return f"{args.tokens} x {args.vocab:,} logits, {args.logits_dtype}"
    return f"{args.hidden_tokens} tokens, d = {args.dim}, V = {args.vocab:,}, {args.hidden_dtype}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--tokens", type=int, default=2048, help="rows of the logits case")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden-tokens", type=int, default=1024, help="rows of the hidden cases")
    parser.add_argument("--dim", type=int, default=896)
    parser.add_argument("--logits-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--hidden-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--runs", type=int, default=1, help="child processes per variant (interleaved)")
    parser.add_argument("--reps", type=int, default=2, help="timed forward+backward passes per child")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in each child (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 256 tokens, V = 8192, d = 64")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args)
        return
    if args.quick:
        args.tokens, args.hidden_tokens, args.vocab, args.dim, args.runs, args.reps = 256, 256, 8192, 64, 1, 1
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; valid: {', '.join(CASES)}")

    import torch

    load_before = os.getloadavg()[0]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for case in cases:
        for run in range(args.runs):
            for variant in ("naive", "lean") if run % 2 == 0 else ("lean", "naive"):
                results.setdefault((case, variant), []).append(_run_child(args, case, variant))
    load_after = os.getloadavg()[0]
    threads = args.threads or torch.get_num_threads()
    print(
        f"token log-probs, lean vs naive; torch {torch.__version__}, {threads} threads on {os.cpu_count()} CPUs; "
        f"median of {args.runs} runs x {args.reps} reps; load average {load_before:.1f} before, {load_after:.1f} after"
    )
    print("peak extra memory of forward+backward, not counting the input gradients (every variant returns them)")
    med = {k: {f: statistics.median(r[f] for r in rs) for f in ("extra_mib", "time_s", "grads_mib")} for k, rs in results.items()}
    rows = []
    for case in cases:
        naive, lean = med[(case, "naive")], med[(case, "lean")]
        mem, tim = lean["extra_mib"] / naive["extra_mib"], lean["time_s"] / naive["time_s"]
        target_mem, target_time = TARGETS[case]
        verdict = f"memory {mem:.3f}x (target <= {target_mem}x: {'met' if mem <= target_mem else 'MISSED'})"
        verdict += f", time {tim:.2f}x" + (
            f" (target <= {target_time}x: {'met' if tim <= target_time else 'MISSED'})" if target_time else " (no target)"
        )
        print(f"{case:<12} {_shape(args, case)}; input gradients {naive['grads_mib']:.0f} MiB")
        for name, m in (("naive", naive), ("lean", lean)):
            print(f"  {name:<6} peak extra {m['extra_mib']:>9.1f} MiB   fwd+bwd {m['time_s'] * 1e3:>9.1f} ms")
        print(f"  lean / naive: {verdict}")
        rows.append((case, _shape(args, case), naive, lean, mem, tim))
    if args.quick:
        print("(--quick: a smoke run; at this size the ratios are not the benchmark's)")
    print()
    print("| case | shape | naive: peak extra MiB, fwd+bwd s | lean: peak extra MiB, fwd+bwd s | memory | time |")
    print("|---|---|---|---|---|---|")
    for case, shape, naive, lean, mem, tim in rows:
        print(
            f"| `{case}` | {shape} | {naive['extra_mib']:,.0f}, {naive['time_s']:.2f} | "
            f"{lean['extra_mib']:,.0f}, {lean['time_s']:.2f} | {mem:.3f}x | {tim:.2f}x |"
        )


if __name__ == "__main__":
    main()
