"""Does the CPU machinery earn its place? Each piece against the plain composition, same run.

Two pieces of the package exist only for CPU speed; each stays only if it beats the plain way (torch's
own intra-op threads) by at least ``--keep`` (1.3x) here:

* ``pool``: the chunk runner's former thread pool (``lightning_kl.ground.chunks``, ``CPU_THREAD_POOL``)
  against a plain loop over the same chunks in the calling thread, whose ops use torch's threads.
  Measured on ``lk.token_logprobs`` and ``lk.full_kl`` (forward+backward of the sum), float32 and
  bfloat16. Skipped (with a line saying so) where the package has no pool: it was removed on these
  figures, so to measure it again run this script from a checkout of the commit before its removal
  (the script puts its own checkout's package first on the path).
* ``fused``: the fused sampled-token kernel (``lightning_kl.kernels.fused``) against the plain
  elementwise composition (``kl_penalty_compute`` with ``fused.ENABLED = False``), forward+backward of
  ``kl_penalty(lp, ref, NAME, mask=m)`` with ``lp`` requiring a gradient, at typical ``[b, t]`` sizes,
  float32 and bfloat16. The fused kernel is called directly, so it is timed even where the package's
  own dispatch would pick the composition. Variants: as it runs (``fused``: chunks of ``fused.CHUNK``
  elements in order, each op with torch's threads), on the pool where there is one, in chunks of
  torch's grain (every op inline on the calling thread) and in one chunk (whole-tensor ops). Skipped
  where the package has no fused kernel any more.

Method: the variants of a case run in the same process, interleaved run by run, after a warm-up of
each; the figure is the median of ``--repeats`` runs (each run the mean of ``--inner`` calls, so that
sub-millisecond cases are timed above the clock's noise). On the fused side the verdict is on the
kernel as the package runs it (``fused``); each row also gives the ratio to its best variant. Ratio = plain / machinery:
above 1 the machinery is faster. The load average is printed before and after; the machine is shared.

    python benchmarks/bench_cpu_machinery.py            # ~1-2 min
    python benchmarks/bench_cpu_machinery.py --quick    # a smoke run (seconds; ratios say little)
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from typing import Callable

# this checkout's package, not an installed one
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import lightning_kl as lk  # noqa: E402
import lightning_kl.ground.chunks as chunks  # noqa: E402
from lightning_kl.estimators import parse_estimator  # noqa: E402
from lightning_kl.functional import kl_penalty_compute  # noqa: E402

SMALL_CHUNK = 1 << 15  # torch's grain: an op on it runs inline on the calling thread
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _optional(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


fused = _optional("lightning_kl.kernels.fused")


def timed(fn: Callable[[], None], inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def compare(variants: dict[str, Callable[[], None]], repeats: int, inner: int) -> dict[str, float]:
    """Median seconds per call of each variant, interleaved run by run after one warm-up each."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            times[k].append(timed(fn, inner))
    return {k: statistics.median(v) for k, v in times.items()}


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


# ---------------------------------------------------------------------------------------------
# the pool


def pool_cases(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    if not hasattr(chunks, "CPU_THREAD_POOL"):
        print("pool: the package has no thread pool (run_chunks is a plain loop): nothing to compare")
        return []
    rows = []
    shapes = [(64, 4096), (256, 32768)] if args.quick else [(512, 32768), (1024, 151936 // 4)]
    for (n, v) in shapes:
        for dname, dtype in DTYPES.items():
            g = torch.Generator().manual_seed(0)
            z = (torch.randn(n, v, generator=g) * 2).to(dtype).requires_grad_()
            zr = (torch.randn(n, v, generator=g) * 2).to(dtype)
            tok = torch.randint(0, v, (n,), generator=g)

            def logprobs() -> None:
                lk.token_logprobs(z, tok).sum().backward()
                z.grad = None

            def full() -> None:
                lk.full_kl(z, zr).sum().backward()
                z.grad = None

            for what, fn in (("token_logprobs", logprobs), ("full_kl", full)):

                def with_pool(on: bool, fn=fn) -> Callable[[], None]:
                    def run() -> None:
                        chunks.CPU_THREAD_POOL = on
                        try:
                            fn()
                        finally:
                            chunks.CPU_THREAD_POOL = True

                    return run

                t = compare({"pool": with_pool(True), "plain": with_pool(False)}, args.repeats, 1)
                label = f"{what} [{n}, {v}] {dname}"
                rows.append((label, t["pool"], t["plain"]))
                print(f"  pool  | {label:40s} | pool {t['pool'] * 1e3:8.2f} ms | plain loop {t['plain'] * 1e3:8.2f} ms "
                      f"| plain / pool {t['plain'] / t['pool']:.2f}x", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# the fused kernel


def fused_cases(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    if fused is None:
        print("fused: the package has no fused kernel (the composition serves every estimator): nothing to compare")
        return []
    pooled = hasattr(chunks, "CPU_THREAD_POOL")
    rows = []
    shapes = [(8, 4096), (64, 4096)] if args.quick else [(8, 4096), (64, 4096), (256, 4096), (2048, 4096)]
    names = ["k3+"] if args.quick else ["k3+", "k3", "k1", "low_var_kl+"]
    for shape in shapes:
        n = shape[0] * shape[1]
        inner = max(1, min(200, (1 << 21) // n))
        for dname, dtype in DTYPES.items():
            g = torch.Generator().manual_seed(1)
            lp = (-torch.rand(shape, generator=g) * 6).to(dtype).requires_grad_()
            ref = (-torch.rand(shape, generator=g) * 6).to(dtype)
            m = torch.rand(shape, generator=g) < 0.9
            up = torch.rand(shape, generator=g)
            for name in names:
                spec = parse_estimator(name)

                def run_fused(pool: bool, chunk=None) -> Callable[[], None]:
                    def run() -> None:
                        if pooled:
                            chunks.CPU_THREAD_POOL = pool
                        try:
                            fused.fused_kl_value(lp, ref, spec, m, torch.float32, chunk=chunk).backward(up)
                        finally:
                            if pooled:
                                chunks.CPU_THREAD_POOL = True
                        lp.grad = None

                    return run

                def run_plain() -> None:
                    old = fused.ENABLED
                    fused.ENABLED = False
                    try:
                        kl_penalty_compute(lp, ref, spec, m).backward(up)
                    finally:
                        fused.ENABLED = old
                    lp.grad = None

                variants = {"composition": run_plain}
                if pooled:
                    variants["fused, pool"] = run_fused(True)
                variants["fused"] = run_fused(False)  # as the package runs it (fused.CHUNK)
                if fused.CHUNK != SMALL_CHUNK:
                    variants["fused, 32K chunks"] = run_fused(False, SMALL_CHUNK)  # every op inline on this thread
                if n > fused.CHUNK:
                    variants["fused, 1 chunk"] = run_fused(False, n)  # whole-tensor ops
                t = compare(variants, args.repeats, inner)
                best = min(v for k, v in t.items() if k != "composition")
                label = f"{name} {list(shape)} {dname}"
                rows.append((label, t["fused"], t["composition"]))  # as the package runs it
                figures = " | ".join(f"{k} {v * 1e3:7.3f} ms" for k, v in t.items())
                extra = ""
                if pooled:
                    nopool = min(v for k, v in t.items() if k not in ("composition", "fused, pool"))
                    extra = f" | fused without pool / with pool {nopool / t['fused, pool']:.2f}x"
                    rows_pool_in_fused.append((label, t["fused, pool"], nopool))
                print(f"  fused | {label:34s} | {figures} | composition / fused {t['composition'] / t['fused']:.2f}x "
                      f"| composition / best fused {t['composition'] / best:.2f}x{extra}", flush=True)
    return rows


rows_pool_in_fused: list[tuple[str, float, float]] = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run at small sizes")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs per variant (median)")
    parser.add_argument("--keep", type=float, default=1.3, help="the speed-up a piece must show to stay")
    parser.add_argument("--only", choices=("pool", "fused"), default=None)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 3 if args.quick else 9
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
          f"median of {args.repeats} interleaved runs; load average before: {load()}", flush=True)
    verdicts = []
    for piece, cases in (("pool", pool_cases), ("fused", fused_cases)):
        if args.only not in (None, piece):
            continue
        rows = cases(args)
        if not rows:
            continue
        ratios = [plain / mach for _, mach, plain in rows]
        wins = [label for (label, mach, plain) in rows if plain / mach >= args.keep]
        verdicts.append(
            f"{piece}: plain / machinery from {min(ratios):.2f}x to {max(ratios):.2f}x (median "
            f"{statistics.median(ratios):.2f}x); {len(wins)} of {len(rows)} cases at >= {args.keep}x"
            + (f": {', '.join(wins)}" if wins else "")
        )
    if rows_pool_in_fused:
        ratios = [plain / mach for _, mach, plain in rows_pool_in_fused]
        wins = [label for (label, mach, plain) in rows_pool_in_fused if plain / mach >= args.keep]
        verdicts.append(
            f"pool inside the fused kernel: without / with from {min(ratios):.2f}x to {max(ratios):.2f}x (median "
            f"{statistics.median(ratios):.2f}x); {len(wins)} of {len(ratios)} cases at >= {args.keep}x"
        )
    print(f"load average after: {load()}")
    for v in verdicts:
        print(v)


if __name__ == "__main__":
    main()
