"""Fused estimators against the plain composition: forward+backward time and peak extra memory.

For every base estimator and its ``+`` variant, on ``--n`` tokens (default 8M) with a mask (90%
valid), in float32 and bfloat16, ``logprob`` requiring a gradient and ``ref_logprob`` not (the
training case):

* time: ``kl_penalty_compute(logprob, ref, spec, mask)`` then ``backward(upstream)`` with a
  preallocated upstream gradient; the two variants interleaved, run after run, and the median of
  ``--repeats`` runs of each; the ratio is fused / composition, measured in the same process.
* peak extra memory: one child process per variant and dtype allocates the inputs, runs each
  estimator once to warm up, then resets the resident high-water mark (``5`` into
  ``/proc/self/clear_refs``), runs forward+backward and reads ``VmHWM`` from ``/proc/self/status``:
  the peak resident memory above what was resident before the call (inputs, upstream gradient,
  torch itself). The value and the gradient are in it: 32 MiB each at 8M float32 tokens, the floor
  for any implementation that returns a value and a gradient. The children run with a fixed glibc
  mmap threshold (``MALLOC_MMAP_THRESHOLD_=65536``) so that resident memory follows live tensors.
  The same is measured "in a loss": ``aggregate(value, mask).backward()`` (token-mean, what
  ``KLPenaltyLoss`` does), where the value is freed after the forward, as in a training step.

Timings on a shared machine are noisy; the load average is printed with the table.

Run: ``python benchmarks/bench_estimators.py`` (``--quick`` for a smoke run: k3 and k3+ on 256K tokens,
``--compile`` to add a torch.compile'd composition of ``k3+`` with its compile time).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

from lightning_kl.kernels import fused as _fused
from lightning_kl.estimators import BASE_ESTIMATORS, estimator_value, parse_estimator
from lightning_kl.functional import kl_penalty_compute, aggregate

from _measure import reset_peak, run_child, status_kib  # this folder: the child-process measurement

NAMES = [n for b in BASE_ESTIMATORS for n in (b, f"{b}+")]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VARIANTS = ("fused", "composition")


def make_inputs(n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logprob = (-torch.rand(n, generator=g) * 6).to(dtype).requires_grad_()
    ref = (-torch.rand(n, generator=g) * 6).to(dtype)
    mask = torch.rand(n, generator=g) < 0.9
    upstream = torch.rand(n, generator=g)  # the float32 value's incoming gradient
    return logprob, ref, mask, upstream


def step(name: str, variant: str, logprob, ref, mask, upstream, in_loss: bool = False) -> None:
    """One forward+backward of an estimator, fused or composed.

    ``in_loss``: reduce the value with ``aggregate(value, mask)`` (token-mean, as KLPenaltyLoss does)
    and backpropagate from that, so the value is freed before backward, as in a training step.
    """
    _fused.ENABLED = variant == "fused"
    try:
        value = kl_penalty_compute(logprob, ref, parse_estimator(name), mask)
    finally:
        _fused.ENABLED = True
    if in_loss:
        loss = aggregate(value, mask)
        del value
        loss.backward()
    else:
        value.backward(upstream)
    logprob.grad = None


# ---------------------------------------------------------------------------------------------
# time


def time_all(n: int, dtype: torch.dtype, names: list[str], repeats: int) -> dict[str, dict[str, float]]:
    inputs = make_inputs(n, dtype)
    times: dict[str, dict[str, list[float]]] = {name: {v: [] for v in VARIANTS} for name in names}
    for name in names:
        for variant in VARIANTS:
            step(name, variant, *inputs)  # warm-up
    for _ in range(repeats):
        for name in names:
            for variant in VARIANTS:  # interleaved: both variants see the same machine state
                gc.collect()
                t0 = time.perf_counter()
                step(name, variant, *inputs)
                times[name][variant].append(time.perf_counter() - t0)
    return {name: {v: statistics.median(ts) for v, ts in per.items()} for name, per in times.items()}


# ---------------------------------------------------------------------------------------------
# peak resident memory, in a child process per variant


def child(variant: str, dtype_name: str, n: int, names: list[str]) -> None:
    inputs = make_inputs(n, DTYPES[dtype_name])
    peaks = {}
    for name in names:
        for in_loss in (False, True):
            step(name, variant, *inputs, in_loss=in_loss)  # warm-up: one-time allocations are not counted
            gc.collect()
            reset_peak()
            before = status_kib("VmHWM")
            step(name, variant, *inputs, in_loss=in_loss)
            peaks[name + (" loss" if in_loss else "")] = (status_kib("VmHWM") - before) / 1024
    print(json.dumps(peaks))


def memory_all(n: int, dtype_name: str, names: list[str]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {key: {} for name in names for key in (name, name + " loss")}
    for variant in VARIANTS:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, dtype_name, str(n), ",".join(names)]
        for name, mib in run_child(cmd, fixed_mmap_threshold=True).items():
            out[name][variant] = mib
    return out


# ---------------------------------------------------------------------------------------------
# torch.compile, for the record


def compile_k3_plus(n: int, repeats: int) -> str:
    spec = parse_estimator("k3+")

    def composed(logprob, ref, mask):
        d = torch.where(mask, logprob - ref, torch.zeros((), dtype=logprob.dtype))
        return estimator_value(spec, d)

    compiled = torch.compile(composed)
    logprob, ref, mask, upstream = make_inputs(n, torch.float32)
    t0 = time.perf_counter()
    compiled(logprob, ref, mask).backward(upstream)
    compile_s = time.perf_counter() - t0
    logprob.grad = None
    ts = {"compiled": [], "fused": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled(logprob, ref, mask).backward(upstream)
        ts["compiled"].append(time.perf_counter() - t0)
        logprob.grad = None
        t0 = time.perf_counter()
        step("k3+", "fused", logprob, ref, mask, upstream)
        ts["fused"].append(time.perf_counter() - t0)
    c, f = statistics.median(ts["compiled"]), statistics.median(ts["fused"])
    return (
        f"torch.compile of the k3+ composition (float32): first call (compilation) {compile_s:.1f} s, "
        f"then {c * 1e3:.1f} ms per forward+backward; fused {f * 1e3:.1f} ms (fused / compiled = {f / c:.2f}x)"
    )


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=8 * 2**20, help="tokens per batch (default 8M)")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs of each variant (median)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 256K tokens, 3 repeats")
    parser.add_argument("--compile", action="store_true", help="also time a torch.compile'd k3+ composition")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, dtype_name, n, names = args.child
        child(variant, dtype_name, int(n), names.split(","))
        return
    n, repeats = (2**18, 3) if args.quick else (args.n, args.repeats)
    names = ["k3", "k3+"] if args.quick else NAMES

    print(
        f"{n / 2**20:g}M tokens, mask 90% valid, logprob requires grad; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; median of {repeats} interleaved runs; "
        f"load average before: {os.getloadavg()[0]:.1f}\n"
    )
    verdicts = []
    for dtype_name, dtype in DTYPES.items():
        times = time_all(n, dtype, names, repeats)
        mem = memory_all(n, dtype_name, names)
        print(f"**{dtype_name}** (fwd+bwd time in ms, peak extra resident memory in MiB; ratio = fused / composition)")
        print()
        print(
            "| estimator | fused ms | composition ms | time ratio "
            "| fused MiB | composition MiB | memory ratio | in a loss: fused MiB | composition MiB | memory ratio |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name in names:
            t, m, ml = times[name], mem[name], mem[name + " loss"]
            tr = t["fused"] / t["composition"]
            mr = m["fused"] / m["composition"] if m["composition"] > 0 else float("nan")
            mlr = ml["fused"] / ml["composition"] if ml["composition"] > 0 else float("nan")
            print(
                f"| `{name}` | {t['fused'] * 1e3:.1f} | {t['composition'] * 1e3:.1f} | {tr:.2f}x "
                f"| {m['fused']:.1f} | {m['composition']:.1f} | {mr:.2f}x "
                f"| {ml['fused']:.1f} | {ml['composition']:.1f} | {mlr:.2f}x |"
            )
            if tr > 1:
                verdicts.append(f"MISSED: {dtype_name} `{name}` fused is slower than its composition ({tr:.2f}x)")
            if name == "k3+" and dtype_name == "float32":
                for what, r in (
                    ("time", tr),
                    ("peak extra memory (value kept through backward)", mr),
                    ("peak extra memory (in a loss)", mlr),
                ):
                    ok = "met" if r <= 0.3 else "MISSED"
                    verdicts.append(f"{ok}: float32 `k3+` {what} {r:.2f}x of the composition (target <= 0.3x)")
        print()
    if not any(v.startswith("MISSED: ") and "slower" in v for v in verdicts):
        verdicts.append("met: no estimator slower than its composition")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.quick:
        verdicts = ["smoke run (--quick): too small for the targets, which are judged at 8M tokens"]
    for v in verdicts:
        print(v)
    if args.compile:
        print(compile_k3_plus(n, repeats))


if __name__ == "__main__":
    main()
