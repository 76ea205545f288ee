"""Peak extra memory and time of processed log-probs (temperature + top-k + top-p) against the composition.

``--tokens`` x ``--vocab`` logits (default 1024 x 151,936 bf16, Qwen2.5's vocabulary), forward +
``backward`` of the sum of the sampled tokens' log-probs under ``temperature=0.9, top_k=1024,
top_p=0.8`` (the processing of the issue's measurement). Three variants:

* ``naive``: what one writes with ``generate``'s warpers: ``scores = logits.float() / T``, the
  top-k / top-p masking on the whole ``[n, V]`` scores (the same ops as ``transformers``), then
  ``log_softmax(scores).gather(...)`` and autograd;
* ``lean``: ``lk.token_logprobs(logits, tokens, sampling=lk.Sampling(T, top_k=, top_p=))``, chunked;
* ``plain``: ``lk.token_logprobs(logits, tokens, temperature=T)``, the unprocessed log-probs (what the
  processing costs on top of them).

Method as ``bench_logprobs.py`` (``_measure.py``): each measurement in a fresh child process with
``MALLOC_MMAP_THRESHOLD_=65536``, one warm-up pass, then ``--reps`` timed passes; the peak extra memory
is ``VmHWM`` minus the resident memory before the first timed pass, minus the logits' gradient.
Variants interleaved run by run; medians over ``--runs`` children; ratios lean / naive and
lean / plain.

    python benchmarks/bench_sampling.py
    python benchmarks/bench_sampling.py --quick      # a smoke run at small sizes (ratios say nothing)
    python benchmarks/bench_sampling.py --ties       # the share of rows whose top-p boundary splits tied scores

The backward masks each row by its kept set's threshold instead of sorting it again, except in rows
where top-p's sort splits tied scores at its boundary (the kept set is then not a threshold set):
those run the processing again. ``--ties`` prints how many rows that is, in bf16 and float32.

Linux only. Needs about 4 GiB of free memory at the default sizes (the naive variant's sort).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _measure import peak_and_time, run_child  # noqa: E402

VARIANTS = ("naive", "lean", "plain")
PROCESSING = dict(temperature=0.9, top_k=1024, top_p=0.8)


def _child(args: argparse.Namespace) -> None:
    import torch

    import lightning_kl as lk
    from lightning_kl.ground.sampler import check_processing, process_scores

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    z = (torch.randn(args.tokens, args.vocab) * 3).to(getattr(torch, args.dtype)).requires_grad_()
    proc = check_processing(**PROCESSING)
    with torch.no_grad():  # tokens from the processed distribution, so that none is outside the kept set
        kept = process_scores(z.float() / proc.temperature, proc)
        tokens = torch.multinomial(torch.softmax(kept, -1), 1).squeeze(-1)

    def run() -> torch.Tensor:
        if args.child == "naive":
            scores = process_scores(z.float() / proc.temperature, proc)
            return torch.log_softmax(scores, -1).gather(-1, tokens[:, None]).squeeze(-1)
        if args.child == "lean":
            return lk.token_logprobs(z, tokens, sampling=proc)
        return lk.token_logprobs(z, tokens, sampling=lk.Sampling(proc.temperature))

    grads_mib = z.numel() * z.element_size() / 2**20

    def step() -> None:
        run().sum().backward()

    def clear() -> None:
        z.grad = None

    peak_mib, time_s = peak_and_time(step, clear, args.reps)
    print(json.dumps({"extra_mib": peak_mib - grads_mib, "time_s": time_s}))


def _ties(args: argparse.Namespace) -> None:
    import torch

    from lightning_kl.ground.sampler import check_processing, process_scores

    torch.manual_seed(0)
    logits = torch.randn(256, args.vocab) * 3
    for kw in (PROCESSING, dict(temperature=0.9, top_p=0.8), dict(temperature=0.9, top_k=50)):
        proc = check_processing(**kw)
        for dtype in (torch.bfloat16, torch.float32):
            z = logits.to(dtype).float() / proc.temperature
            keep = process_scores(z, proc) > float("-inf")
            smallest = torch.where(keep, z, float("inf")).amin(-1, keepdim=True)
            split = ((z == smallest) & ~keep).any(-1).float().mean().item()
            print(f"{str(kw):55s} {str(dtype):15s} rows whose kept set splits tied scores: {split:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--runs", type=int, default=1, help="child processes per variant (interleaved)")
    parser.add_argument("--reps", type=int, default=2, help="timed forward+backward passes per child")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in each child (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 128 tokens, V = 8192")
    parser.add_argument("--ties", action="store_true", help="only the share of rows with ties at the top-p boundary")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args)
        return
    if args.ties:
        _ties(args)
        return
    if args.quick:
        args.tokens, args.vocab, args.runs, args.reps = 128, 8192, 1, 1
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(args.runs):
        for variant in VARIANTS:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--tokens", str(args.tokens)]
            cmd += ["--vocab", str(args.vocab), "--dtype", args.dtype, "--reps", str(args.reps)]
            if args.threads is not None:
                cmd += ["--threads", str(args.threads)]
            results[variant].append(run_child(cmd, fixed_mmap_threshold=True))
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("extra_mib", "time_s")} for v, rs in results.items()}
    print(f"{args.tokens} x {args.vocab:,} {args.dtype} logits, {PROCESSING}, fwd+bwd, medians of {args.runs} x {args.reps}")
    for v in VARIANTS:
        print(f"  {v:6s} peak extra {med[v]['extra_mib']:8.0f} MiB   time {med[v]['time_s'] * 1000:8.0f} ms")
    for other in ("naive", "plain"):
        print(
            f"  lean / {other}: memory {med['lean']['extra_mib'] / max(med[other]['extra_mib'], 1e-9):.3f}x, "
            f"time {med['lean']['time_s'] / med[other]['time_s']:.3f}x"
        )


if __name__ == "__main__":
    main()
