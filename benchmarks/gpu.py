"""One command for the first GPU: the CUDA sync-debug check and every figure, each against its anchor.

    python benchmarks/gpu.py --out gpu_results     # on a CUDA machine, budgeted for under 5 minutes: gpu.md, gpu.json
    python benchmarks/gpu.py --smoke --out /tmp/x  # on CPU, tiny shapes, seconds (a test runs it)

It installs nothing. What it does, printing progress as it goes:

1. **Environment**: device, compute capability, memory, torch / CUDA / cuDNN / lightning versions,
   this checkout's commit, and which anchors are importable (``trl``, ``liger_kernel``, ``triton``;
   read from the installed package metadata, imported only by their cases).
2. **Sync-debug**: every public function, the loss, the metric, the controllers and
   ``KLRewardCallback`` (its per-step hook, in a real ``Trainer``) run forward and backward under
   ``torch.cuda.set_sync_debug_mode("error")``: a call that makes the host wait for the device
   raises there. The list (``_gpu_sync.py``) marks the calls expected to synchronize today, with the reason;
   the run reports each call as ``no sync``, ``sync (expected)``, ``SYNC (unexpected)`` or ``no sync
   (marked as expected: update the mark)`` and never stops at one. ``coverage()`` checks that every
   name in ``lightning_kl.__all__`` and ``lightning_kl.hf.__all__`` is called by the list or listed
   in ``HOST_ONLY`` with a reason, so the list cannot fall behind the API. On CPU (``--smoke``),
   where sync-debug does nothing, every call still runs with the Python-level host reads
   (``.item()``, ``bool()``, ``float()``, ``.nonzero()``, ...) made to raise: an approximation that
   sees every expected sync but the copies to the device, so the marks are checked on CPU too.
3. **Figures**: forward + backward time (median of CUDA-event timings) and peak memory
   (``torch.cuda.max_memory_allocated`` above what the inputs hold, input gradients included, reset
   per case) of:

   * ``estimators``: every sampled estimator, bf16 and fp32, 8M tokens, in a loss
     (``aggregate(kl_penalty(...), mask).backward()``), against the plain composition of the same
     formula (``lightning_kl.kernels.fused.ENABLED = False``);
   * ``logprobs-logits``: ``lk.token_logprobs`` of bf16 logits at V = 151,936 and 2k-16k tokens,
     against ``log_softmax(logits.float()).gather`` and TRL's ``selective_log_softmax`` (if ``trl``
     imports);
   * ``logprobs-hidden``: ``lk.token_logprobs(lk.FromHidden(...))`` (d = 1536, Qwen2.5-1.5B's head), against
     the logits made by the head then ``log_softmax`` + ``gather``, and Liger's
     ``LigerFusedLinearCrossEntropyLoss(reduction="none")`` (if ``liger_kernel`` imports, on CUDA);
   * ``full-logits``, ``full-hidden``: the exact KL (``lk.full_kl`` of logits and of ``lk.FromHidden``)
     against the plain composition (both ``log_softmax``, ``exp``, multiply, sum) and, from hidden
     states, Liger's ``LigerFusedLinearJSD(jsd_beta=1)`` (its reverse KL: a scalar mean);
   * ``sequence``: ``kl_penalty(..., level="sequence")`` against ``level="token"`` (what it costs);
   * ``chunks``: ``lk.token_logprobs``, ``lk.full_kl`` and ``lk.full_kl(lk.FromHidden(...))`` at 16k tokens
     with 2^25 (the CUDA default), 2^23 and 2^27 elements per chunk, to check the defaults on the device.

   Each row also gives the largest difference of its forward value from the library's (the inputs
   are the same, seeded), so a wrong number on CUDA shows up next to its timing.

**Budget.** CUDA kernels cannot be interrupted from Python, so a case is never stopped midway;
instead (a) a case is skipped, and reported, when two iterations (a warm-up and one timed), predicted
from the previous size of the same series (linear in the tokens), would overrun ``--case-budget`` or
what is left of ``--budget``; (b)
its first (warm-up) iteration is timed alone, and the case stops there, reported, if that iteration
alone overran the case budget; (c) the timed repetitions stop when the next one would overrun;
(d) a watchdog thread, which cannot interrupt a kernel either, ends the whole process
(``os._exit(3)``) if one case runs past ``3 x --case-budget + 60`` seconds, after writing the files
with that case marked ``hung``. The JSON is rewritten after every case, so whatever ends the run,
the figures measured so far are on disk. Out-of-memory is caught per case (``oom``, reported).

Outputs in ``--out``: ``gpu.md`` (the tables, ready to paste into ``docs/performance.md``) and
``gpu.json`` (everything, with the environment). Ratios are "lightning-kl / this row" (for
``chunks``: the CUDA default / this row): 0.40x time means the library takes 0.40 of that anchor's time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

import lightning_kl as lk  # noqa: E402
from lightning_kl.estimators import SAMPLED_ESTIMATORS
from lightning_kl.kernels import fused  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: the sync-debug list
from _gpu_sync import HOST_ONLY, SYNC_CALLS, SyncCall, check_sync, coverage, package_reads, sampled_inputs, seeded  # noqa: E402,F401

VOCAB = 151_936  # Qwen2.5's vocabulary
DIM = 1536  # Qwen2.5-1.5B's hidden size (its head is [151936, 1536])
MIB = 2**20

#: One forward + backward; ``step(True)`` also returns the forward value (detached).
Step = Callable[[bool], Optional[Tensor]]

# ---------------------------------------------------------------------------------------------
# shapes: the GPU run and the CPU smoke run (tiny, seconds)


@dataclass(frozen=True)
class Shapes:
    vocab: int
    dim: int
    tokens: tuple[int, ...]  # the from-logits and from-hidden sizes, increasing
    seq_len: int  # logits are [tokens / seq_len, seq_len, V], as a batch of sequences (TRL loops over the batch)
    est_shape: tuple[int, int]  # [b, t] of the estimators and the sequence level
    chunk_tokens: int
    chunk_exponents: tuple[int, ...]  # elements per chunk: 2^k


GPU_SHAPES = Shapes(VOCAB, DIM, (2048, 4096, 8192, 16384), 1024, (256, 32768), 16384, (23, 25, 27))
SMOKE_SHAPES = Shapes(512, 32, (16, 32), 8, (4, 512), 32, (10, 12))


# ---------------------------------------------------------------------------------------------
# the device: synchronization, peak memory and timing in one place


class Device:
    """Timing and memory for one device: CUDA events and allocator statistics, or the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        """Give the last case's memory back (an error's traceback holds its frames: a collection frees them)."""
        if self.cuda:
            gc.collect()
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> Optional[int]:
        return torch.cuda.memory_allocated(self.device) if self.cuda else None

    def peak(self) -> Optional[int]:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def timed(self, fn: Callable[[], Any]) -> tuple[float, float]:
        """``(device ms, host wall seconds)`` of ``fn()``, the device idle before and after.

        ``fn``'s result is dropped at once: it would otherwise live through the next call and
        count in its peak memory.
        """
        self.sync()
        t0 = time.perf_counter()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end), time.perf_counter() - t0
        fn()
        wall = time.perf_counter() - t0
        return wall * 1e3, wall


@dataclass
class Measured:
    status: str  # ok | skipped
    reason: str = ""
    ms: Optional[float] = None  # median device time of the timed repetitions
    ms_all: list[float] = field(default_factory=list)
    first_s: Optional[float] = None  # the warm-up iteration, host wall
    peak_mib: Optional[float] = None  # above what was allocated before the step (inputs)
    value: Optional[Tensor] = None  # the warm-up's forward value, float64 on the host


def measure(step: Step, clear: Callable[[], None], dev: Device, budget_s: float, max_reps: int) -> Measured:
    """Time ``step`` (forward + backward) within ``budget_s`` seconds; keep the warm-up's forward value.

    The warm-up iteration pays one-time costs (cuBLAS handles, Triton autotuning) and is timed
    alone: past the budget the case stops there. Then at least one timed repetition, and more
    until ``max_reps`` or until the next one (as long as the last) would overrun the budget.
    ``clear()`` after every step drops the input gradients, so each step starts from the same
    allocation. The peak is measured over the timed repetitions, from the allocation before them.
    """
    kept: list[Optional[Tensor]] = []
    _, first = dev.timed(lambda: kept.append(step(True)))
    value = kept[0].to("cpu", torch.float64) if kept and kept[0] is not None else None
    kept.clear()
    clear()
    if first > budget_s:
        return Measured("skipped", f"the first iteration took {first:.1f} s > the case budget {budget_s:.0f} s", first_s=first, value=value)
    dev.sync()
    base = dev.allocated()
    dev.reset_peak()
    spent, times = first, []
    while len(times) < max_reps:
        ms, wall = dev.timed(lambda: step(False))
        clear()
        times.append(ms)
        spent += wall
        if spent + wall > budget_s:
            break
    peak = dev.peak()
    peak_mib = None if peak is None or base is None else (peak - base) / MIB
    return Measured("ok", "", statistics.median(times), times, first, peak_mib, value)


# ---------------------------------------------------------------------------------------------
# the anchors (imported only when their cases run; never vendored)


def installed(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def trl_selective_log_softmax() -> Callable[[Tensor, Tensor], Tensor]:
    from trl.trainer.utils import selective_log_softmax  # type: ignore[import-not-found]

    return selective_log_softmax


def liger_linear_logprobs() -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """Liger's fused linear cross-entropy per token, negated: the log-probs from hidden states."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # type: ignore[import-not-found]

    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")

    def run(h: Tensor, w: Tensor, y: Tensor) -> Tensor:
        out = loss(w, h, y)
        return -(out[0] if isinstance(out, tuple) else out)

    return run


def liger_linear_reverse_kl() -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """Liger's fused linear generalized JSD at beta = 1 (KL(student || teacher)): a scalar mean."""
    from liger_kernel.transformers import LigerFusedLinearJSD  # type: ignore[import-not-found]

    jsd = LigerFusedLinearJSD(jsd_beta=1.0)

    def run(h: Tensor, w: Tensor, rh: Tensor, rw: Tensor) -> Tensor:
        try:
            return jsd(h, w, rh, rw, None)
        except TypeError:  # releases before shift_labels took four inputs
            return jsd(h, w, rh, rw)

    return run


# ---------------------------------------------------------------------------------------------
# the cases


@dataclass
class Case:
    group: str
    what: str  # the row's subject (an estimator name, "token_logprobs", ...)
    size: str  # tokens, or [b, t]
    tokens: int  # for the prediction from the previous size
    dtype: str
    variant: str
    build: Callable[[], tuple[Step, Callable[[], None]]]
    reference: bool = False  # the library's row of its (group, what, size, dtype): the others' ratios are against it
    needs_cuda: bool = False
    compare: str = "value"  # how the value compares with the reference's: "value" or "mean" (a scalar anchor)

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.group, self.what, self.size, self.dtype)

    @property
    def series(self) -> tuple[str, str, str, str]:
        return (self.group, self.what, self.dtype, self.variant)

    @property
    def name(self) -> str:
        return f"{self.group} {self.what} {self.size} {self.dtype} {self.variant}"


def _clear(*leaves: Tensor) -> Callable[[], None]:
    def clear() -> None:
        for x in leaves:
            x.grad = None

    return clear


def _step(forward: Callable[[], Tensor], reduce: Callable[[Tensor], Tensor] = torch.sum) -> Step:
    """One forward + backward of ``reduce(forward())``; ``step(True)`` also returns the forward value.

    The value is dropped before backward (unless kept), as a training step drops it when
    ``training_step`` returns the loss: only what autograd saved stays alive.
    """

    def step(keep: bool) -> Optional[Tensor]:
        value = forward()
        loss = reduce(value)
        kept = value.detach() if keep else None
        del value
        loss.backward()
        return kept

    return step


def build_cases(shapes: Shapes, device: torch.device, dtypes: tuple[str, ...]) -> list[Case]:
    cases: list[Case] = []
    cases += _estimator_cases(shapes, device, dtypes)
    cases += _logits_cases(shapes, device)
    cases += _hidden_cases(shapes, device)
    cases += _full_cases(shapes, device)
    cases += _sequence_cases(shapes, device, dtypes)
    cases += _chunk_cases(shapes, device)
    return cases


def _estimator_cases(shapes: Shapes, device: torch.device, dtypes: tuple[str, ...]) -> list[Case]:
    b, t = shapes.est_shape
    out = []
    for dtype in dtypes:
        for name in SAMPLED_ESTIMATORS:
            if name in ("kl", "mse", "kl+", "mse+"):
                continue  # aliases: the same kernels as k1 and k2
            for variant in ("lightning-kl", "composition"):

                def build(name: str = name, variant: str = variant, dtype: str = dtype) -> tuple[Step, Callable[[], None]]:
                    logprob, ref, mask = sampled_inputs((b, t), getattr(torch, dtype), device)

                    def forward() -> Tensor:
                        fused.ENABLED = variant == "lightning-kl"
                        try:
                            return lk.kl_penalty(logprob, ref, name, mask=mask)
                        finally:
                            fused.ENABLED = True

                    return _step(forward, lambda value: lk.aggregate(value, mask)), _clear(logprob)

                out.append(Case("estimators", name, f"{b}x{t}", b * t, dtype, variant, build, reference=variant == "lightning-kl"))
    return out


def _logits(n: int, vocab: int, device: torch.device, seed: int, grad: bool = True) -> Tensor:
    z = (torch.randn(n, vocab, generator=seeded(device, seed), device=device, dtype=torch.bfloat16) * 2)
    return z.requires_grad_(grad)


def _logits_cases(shapes: Shapes, device: torch.device) -> list[Case]:
    out = []
    for n in shapes.tokens:
        for variant in ("lightning-kl", "log_softmax + gather", "trl selective_log_softmax"):

            def build(n: int = n, variant: str = variant) -> tuple[Step, Callable[[], None]]:
                lead = (n // shapes.seq_len, shapes.seq_len)
                z = _logits(n, shapes.vocab, device, 1).detach().view(*lead, shapes.vocab).requires_grad_()
                y = torch.randint(0, shapes.vocab, lead, generator=seeded(device, 2), device=device)
                fn: Callable[[], Tensor]
                if variant == "lightning-kl":
                    fn = lambda: lk.token_logprobs(z, y)  # noqa: E731
                elif variant == "log_softmax + gather":
                    fn = lambda: torch.log_softmax(z.float(), dim=-1).gather(-1, y[..., None]).squeeze(-1)  # noqa: E731
                else:
                    sls = trl_selective_log_softmax()
                    fn = lambda: sls(z, y)  # noqa: E731

                return _step(fn), _clear(z)

            out.append(Case("logprobs-logits", "token_logprobs", str(n), n, "bfloat16", variant, build, reference=variant == "lightning-kl"))
    return out


def _head(n: int, shapes: Shapes, device: torch.device, seed: int, grad: bool) -> tuple[Tensor, Tensor]:
    g = seeded(device, seed)
    h = torch.randn(n, shapes.dim, generator=g, device=device, dtype=torch.bfloat16).requires_grad_(grad)
    w = (torch.randn(shapes.vocab, shapes.dim, generator=g, device=device) * shapes.dim**-0.5).to(torch.bfloat16)
    return h, w.requires_grad_(grad)


def _hidden_cases(shapes: Shapes, device: torch.device) -> list[Case]:
    out = []
    for n in shapes.tokens:
        for variant in ("lightning-kl", "linear + log_softmax + gather", "liger fused linear CE"):

            def build(n: int = n, variant: str = variant) -> tuple[Step, Callable[[], None]]:
                h, w = _head(n, shapes, device, 3, True)
                y = torch.randint(0, shapes.vocab, (n,), generator=seeded(device, 4), device=device)
                fn: Callable[[], Tensor]
                if variant == "lightning-kl":
                    fn = lambda: lk.token_logprobs(lk.FromHidden(h, w), y)  # noqa: E731
                elif variant.startswith("linear"):
                    fn = lambda: torch.log_softmax(F.linear(h, w).float(), dim=-1).gather(-1, y[:, None]).squeeze(-1)  # noqa: E731
                else:
                    liger = liger_linear_logprobs()
                    fn = lambda: liger(h, w, y)  # noqa: E731

                return _step(fn), _clear(h, w)

            case = Case("logprobs-hidden", "token_logprobs(FromHidden)", str(n), n, "bfloat16", variant, build, reference=variant == "lightning-kl")
            case.needs_cuda = variant.startswith("liger")
            out.append(case)
    return out


def _naive_full_kl(z: Tensor, ref: Tensor) -> Tensor:
    logp, logq = torch.log_softmax(z.float(), dim=-1), torch.log_softmax(ref.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def _full_cases(shapes: Shapes, device: torch.device) -> list[Case]:
    out = []
    for n in shapes.tokens:
        for variant in ("lightning-kl", "log_softmax composition"):

            def build(n: int = n, variant: str = variant) -> tuple[Step, Callable[[], None]]:
                z, ref = _logits(n, shapes.vocab, device, 5), _logits(n, shapes.vocab, device, 6, grad=False)
                fn = (lambda: lk.full_kl(z, ref)) if variant == "lightning-kl" else (lambda: _naive_full_kl(z, ref))

                return _step(fn), _clear(z)

            out.append(Case("full-logits", "full_kl", str(n), n, "bfloat16", variant, build, reference=variant == "lightning-kl"))
        for variant in ("lightning-kl", "linear + log_softmax composition", "liger fused linear JSD beta=1"):

            def build_h(n: int = n, variant: str = variant) -> tuple[Step, Callable[[], None]]:
                h, w = _head(n, shapes, device, 7, True)
                rh, rw = _head(n, shapes, device, 8, False)
                fn: Callable[[], Tensor]
                if variant == "lightning-kl":
                    fn = lambda: lk.full_kl(lk.FromHidden(h, w), lk.FromHidden(rh, rw))  # noqa: E731
                elif variant.startswith("linear"):
                    fn = lambda: _naive_full_kl(F.linear(h, w), F.linear(rh, rw))  # noqa: E731
                else:
                    liger = liger_linear_reverse_kl()
                    fn = lambda: liger(h, w, rh, rw)  # noqa: E731

                return _step(fn), _clear(h, w)

            case = Case("full-hidden", "full_kl(FromHidden)", str(n), n, "bfloat16", variant, build_h, reference=variant == "lightning-kl")
            if variant.startswith("liger"):
                case.needs_cuda, case.compare = True, "mean"
            out.append(case)
    return out


def _sequence_cases(shapes: Shapes, device: torch.device, dtypes: tuple[str, ...]) -> list[Case]:
    b, t = shapes.est_shape
    out = []
    for dtype in dtypes:
        for level in ("sequence", "token"):

            def build(level: str = level, dtype: str = dtype) -> tuple[Step, Callable[[], None]]:
                logprob, ref, mask = sampled_inputs((b, t), getattr(torch, dtype), device)

                forward = lambda: lk.kl_penalty(logprob, ref, "k3+", mask=mask, level=level)  # noqa: E731
                return _step(forward, lambda value: lk.aggregate(value, mask, mode="seq-mean-token-sum")), _clear(logprob)

            out.append(Case("sequence", "k3+", f"{b}x{t}", b * t, dtype, f"level={level}", build, reference=level == "sequence"))
    return out


def _chunk_cases(shapes: Shapes, device: torch.device) -> list[Case]:
    n, vocab = shapes.chunk_tokens, shapes.vocab
    out = []
    # the middle size first: the reference row (2^25, the CUDA default, in the GPU run)
    exponents = list(shapes.chunk_exponents)
    exponents.insert(0, exponents.pop(len(exponents) // 2))
    for what in ("token_logprobs", "full_kl", "full_kl(FromHidden)"):
        for k in exponents:
            rows = max(1, 2**k // vocab)

            def build(what: str = what, rows: int = rows) -> tuple[Step, Callable[[], None]]:
                leaves: tuple[Tensor, ...]
                fn: Callable[[], Tensor]
                if what == "token_logprobs":
                    z = _logits(n, vocab, device, 9)
                    y = torch.randint(0, vocab, (n,), generator=seeded(device, 10), device=device)
                    fn, leaves = (lambda: lk.token_logprobs(z, y, chunk_size=rows)), (z,)
                elif what == "full_kl":
                    z, ref = _logits(n, vocab, device, 9), _logits(n, vocab, device, 11, grad=False)
                    fn, leaves = (lambda: lk.full_kl(z, ref, chunk_size=rows)), (z,)
                else:
                    (h, w), (rh, rw) = _head(n, shapes, device, 12, True), _head(n, shapes, device, 13, False)
                    fn, leaves = (lambda: lk.full_kl(lk.FromHidden(h, w), lk.FromHidden(rh, rw), chunk_size=rows)), (h, w)

                return _step(fn), _clear(*leaves)

            label = f"2^{k} elements ({rows} rows)" + (" (CUDA default)" if k == 25 else "")
            out.append(Case("chunks", what, str(n), n, "bfloat16", label, build, reference=k == exponents[0]))
    return out


# ---------------------------------------------------------------------------------------------
# running the cases within the budget


@dataclass
class Budget:
    total_s: float
    case_s: float
    start: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.total_s - (time.perf_counter() - self.start)


class Watchdog:
    """Ends the process if one case runs far past its budget (a kernel cannot be interrupted)."""

    def __init__(self, limit_s: float, on_hang: Callable[[str], None], poll_s: float = 1.0, end: Callable[[int], Any] = os._exit) -> None:
        self.limit_s, self.on_hang, self.poll_s, self.end = limit_s, on_hang, poll_s, end
        self.case: Optional[str] = None
        self.since = 0.0
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, name="gpu-bench-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def watching(self, name: str) -> Iterator[None]:
        with self.lock:
            self.case, self.since = name, time.perf_counter()
        try:
            yield
        finally:
            with self.lock:
                self.case = None

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            with self.lock:
                case, since = self.case, self.since
            if case is not None and time.perf_counter() - since > self.limit_s:
                self.on_hang(case)
                self.end(3)  # os._exit: the main thread may be blocked in a kernel or a synchronize
                return


def run_cases(cases: list[Case], dev: Device, budget: Budget, max_reps: int, report: "Report", watchdog: Watchdog) -> None:
    last: dict[tuple[str, str, str, str], tuple[int, float]] = {}  # series -> (tokens, seconds per iteration)
    references: dict[tuple[str, str, str, str], Tensor] = {}
    for i, case in enumerate(cases, 1):
        row: dict[str, Any] = {
            "group": case.group, "what": case.what, "size": case.size, "dtype": case.dtype,
            "variant": case.variant, "reference": case.reference,
        }
        reason = _skip_reason(case, dev, budget, last)
        if reason:
            row.update(status="skipped", reason=reason)
        else:
            with watchdog.watching(case.name):
                row.update(_run_case(case, dev, budget, max_reps, last, references))
        report.add_case(row)
        note = f"{row.get('ms', 0) or 0:.3f} ms" if row["status"] == "ok" else f"{row['status']}: {row.get('reason', '')}"
        if row["status"] == "ok" and row.get("peak_mib") is not None:
            note += f", peak {row['peak_mib']:.0f} MiB"
        print(f"[{i}/{len(cases)} {time.perf_counter() - budget.start:5.0f}s] {case.name}: {note}", flush=True)


def _skip_reason(case: Case, dev: Device, budget: Budget, last: dict[tuple[str, str, str, str], tuple[int, float]]) -> str:
    if case.needs_cuda and not dev.cuda:
        return "needs CUDA (Triton)"
    if case.variant.startswith("trl") and installed("trl") is None:
        return "trl is not installed"
    if case.variant.startswith("liger") and installed("liger-kernel") is None:
        return "liger-kernel is not installed"
    if budget.left() <= 0:
        return "the total budget is spent"
    if case.series in last:
        tokens, seconds = last[case.series]
        predicted = seconds * case.tokens / tokens
        if 2 * predicted > budget.case_s:  # a warm-up and one timed iteration at least
            return f"predicted {predicted:.1f} s per iteration (from {tokens} tokens): two would overrun the case budget {budget.case_s:.0f} s"
        if 2 * predicted > budget.left():
            return f"predicted {predicted:.1f} s per iteration > the {budget.left():.0f} s left"
    return ""


def _run_case(
    case: Case,
    dev: Device,
    budget: Budget,
    max_reps: int,
    last: dict[tuple[str, str, str, str], tuple[int, float]],
    references: dict[tuple[str, str, str, str], Tensor],
) -> dict[str, Any]:
    step = clear = None
    try:
        dev.free()
        step, clear = case.build()
        m = measure(step, clear, dev, min(budget.case_s, max(budget.left(), 1.0)), max_reps)
    except torch.cuda.OutOfMemoryError as e:
        return {"status": "oom", "reason": str(e).splitlines()[0][:200]}
    except Exception as e:  # an anchor's API change, a missing Triton: reported, the run goes on
        return {"status": "error", "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", "traceback": traceback.format_exc(limit=4)}
    finally:
        del step, clear
        dev.free()
    if m.first_s is not None:
        # the timed median when there is one: the warm-up also paid one-time costs (Triton's
        # autotuning, cuBLAS) that the next size does not pay again
        last[case.series] = (case.tokens, m.ms / 1e3 if m.ms is not None else m.first_s)
    out: dict[str, Any] = {"status": m.status, "reason": m.reason, "ms": m.ms, "ms_all": m.ms_all, "first_s": m.first_s, "peak_mib": m.peak_mib}
    if m.value is not None:
        if case.reference:
            references[case.key] = m.value
        elif case.key in references:
            ref = references[case.key]
            if case.compare == "mean":
                out["max_abs_diff"] = float((m.value.reshape(-1).mean() - ref.mean()).abs())
            elif m.value.shape == ref.shape:
                out["max_abs_diff"] = float((m.value - ref).abs().nan_to_num(math.inf).max()) if ref.numel() else 0.0
    return out


# ---------------------------------------------------------------------------------------------
# the sync-debug list (its calls: _gpu_sync.py)


def run_sync_debug(device: torch.device, report: "Report", watchdog: "Watchdog") -> None:
    for i, call in enumerate(SYNC_CALLS, 1):
        row: dict[str, Any] = {"name": call.name, "expected": call.syncs}
        with watchdog.watching(f"sync-debug {call.name}"):
            check_sync(call, device, row)
        report.add_sync(row)
        print(f"[sync {i}/{len(SYNC_CALLS)}] {call.name}: {row['status']}" + (f" {row['reason']}" if row["status"] == "ERROR" else ""), flush=True)


# ---------------------------------------------------------------------------------------------
# the report: JSON after every case, markdown at the end


class Report:
    def __init__(self, out: Path, environment: dict[str, Any], args: dict[str, Any]) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {"environment": environment, "args": args, "coverage": coverage(), "sync_debug": [], "cases": []}
        self.lock = threading.Lock()

    def add_sync(self, row: dict[str, Any]) -> None:
        with self.lock:
            self.data["sync_debug"].append(row)
        self.write_json()

    def add_case(self, row: dict[str, Any]) -> None:
        with self.lock:
            self.data["cases"].append(row)
        self.write_json()

    def write_json(self) -> Path:
        with self.lock:
            path = self.out / "gpu.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=str))
            tmp.replace(path)
        return path

    def write_markdown(self) -> Path:
        path = self.out / "gpu.md"
        path.write_text(markdown(self.data))
        return path

    def hung(self, case: str) -> None:
        with self.lock:
            self.data["hung"] = f"{case}: past the watchdog's limit; the process was ended (a CUDA kernel cannot be interrupted)"
        print(f"WATCHDOG: {self.data['hung']}", flush=True)
        self.write_json()
        self.write_markdown()


def _fmt(x: Optional[float], digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    lines = [
        "# lightning-kl on a GPU",
        "",
        f"`python benchmarks/gpu.py{' --smoke' if env.get('smoke') else ''}` at commit `{env.get('commit')}`: "
        f"{env.get('device_name')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"anchors: {', '.join(f'{k} {v}' for k, v in env.get('anchors', {}).items() if v) or 'none installed'}.",
        "",
        ("Forward + backward, median of the CUDA-event timings; peak = `max_memory_allocated` above the inputs "
         "(input gradients included)." if env.get("device", "").startswith("cuda") else
         "Forward + backward, median host wall time (not on CUDA: no peak memory, and the times say nothing).")
        + " Ratios: the reference row (the library's; the CUDA default for `chunks`) / this row (0.40x: the "
        "reference takes 0.40 of its time). max abs diff: the largest difference of this row's forward value "
        "from the reference row's, same inputs.",
        "",
    ]
    refs = {(c["group"], c["what"], c["size"], c["dtype"]): c for c in data["cases"] if c.get("reference") and c["status"] == "ok"}
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in data["cases"]:
        groups.setdefault(c["group"], []).append(c)
    for group, rows in groups.items():
        lines += [f"## {group}", "", "| what | size | dtype | variant | ms | peak MiB | time ratio | memory ratio | max abs diff | status |",
                  "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
        for c in rows:
            ref = refs.get((c["group"], c["what"], c["size"], c["dtype"]))
            t_ratio = m_ratio = ""
            if ref is not None and not c.get("reference") and c["status"] == "ok":
                if c.get("ms"):
                    t_ratio = f"{ref['ms'] / c['ms']:.2f}x"
                if c.get("peak_mib") and ref.get("peak_mib") is not None:
                    m_ratio = f"{ref['peak_mib'] / c['peak_mib']:.2f}x"
            status = c["status"] if c["status"] == "ok" else f"{c['status']}: {c.get('reason', '')}"
            if c.get("reference"):
                status += " (reference)"
            diff = c.get("max_abs_diff")
            lines.append(
                f"| `{c['what']}` | {c['size']} | {c['dtype']} | {c['variant']} | {_fmt(c.get('ms'), 3)} | {_fmt(c.get('peak_mib'), 0)} "
                f"| {t_ratio} | {m_ratio} | {'' if diff is None else f'{diff:.2e}'} | {status} |"
            )
        lines.append("")
    lines += ["## sync-debug (`torch.cuda.set_sync_debug_mode(\"error\")`)", "", "| call | result | expected to sync today because |", "|---|---|---|"]
    for s in data["sync_debug"]:
        result = s["status"] + (f": {s['reason']}" if s["status"] == "ERROR" else "")
        lines.append(f"| {s['name']} | {result} | {s.get('expected') or ''} |")
    cov = data["coverage"]
    lines += ["", f"Public names not covered: {', '.join(cov['missing']) or 'none'}; listed but not public: {', '.join(cov['stale']) or 'none'}."]
    if data.get("hung"):
        lines += ["", f"**Hung:** {data['hung']}"]
    lines += ["", f"Total: {data['elapsed_s']:.0f} s." if "elapsed_s" in data else "The run did not finish.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# environment and main


def environment(device: torch.device, smoke: bool) -> dict[str, Any]:
    import lightning

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    env: dict[str, Any] = {
        "smoke": smoke,
        "device": str(device),
        "device_name": "CPU",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": lightning.__version__,
        "lightning_kl": lk.__version__,
        "commit": commit,
        "cpu_threads": torch.get_num_threads(),
        "anchors": {name: installed(name) for name in ("trl", "liger-kernel", "triton")},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version(),
            driver_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
    return env


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (or --device), seconds: the test suite's run")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    p.add_argument("--out", default="gpu_results", help="folder for gpu.md and gpu.json (default: ./gpu_results)")
    p.add_argument("--budget", type=float, default=210.0, help="seconds for all the figures (default 210; sync-debug and set-up come on top)")
    p.add_argument("--case-budget", type=float, default=20.0, help="seconds for one case (default 20)")
    p.add_argument("--max-reps", type=int, default=10, help="timed repetitions per case at most (default 10)")
    p.add_argument("--groups", default=None, help="comma-separated groups to measure (default: all): "
                   "estimators, logprobs-logits, logprobs-hidden, full-logits, full-hidden, sequence, chunks")
    p.add_argument("--no-sync-debug", action="store_true", help="skip the sync-debug list")
    p.add_argument("--no-figures", action="store_true", help="only the environment and the sync-debug list")
    p.add_argument("--from-json", default=None, metavar="GPU_JSON",
                   help="write --out/gpu.md from the gpu.json of an earlier run (one that was cut short) and stop")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu.md").write_text(markdown(json.loads(Path(args.from_json).read_text())))
        print(f"wrote {out / 'gpu.md'} from {args.from_json}")
        return 0
    name = args.device or ("cpu" if args.smoke else "cuda")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("No CUDA device is available: run on a GPU machine, or `--smoke` for the CPU smoke run.", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shapes = SMOKE_SHAPES if args.smoke else GPU_SHAPES
    if args.smoke:
        args.max_reps = min(args.max_reps, 2)
    env = environment(device, args.smoke)
    report = Report(Path(args.out), env, vars(args))
    print("environment: " + json.dumps(env), flush=True)
    cov = report.data["coverage"]
    if cov["missing"] or cov["stale"]:
        print(f"sync-debug list: public names not covered {cov['missing']}, listed but not public {cov['stale']}", flush=True)

    # what is alive now lives to the end: a full collection (between cases, to free the tensors an
    # error's traceback holds) then skips it (0.3 s a collection with lightning imported)
    gc.freeze()
    start = time.perf_counter()
    watchdog = Watchdog(3 * args.case_budget + 60, report.hung)
    if not args.no_sync_debug:
        run_sync_debug(device, report, watchdog)
    if not args.no_figures:
        dev = Device(device)
        budget = Budget(args.budget, args.case_budget)
        cases = build_cases(shapes, device, ("bfloat16", "float32"))
        if args.groups:
            wanted = set(args.groups.split(","))
            unknown = wanted - {c.group for c in cases}
            if unknown:
                print(f"unknown groups {sorted(unknown)}; valid: {sorted({c.group for c in cases})}", file=sys.stderr)
                return 2
            cases = [c for c in cases if c.group in wanted]
        run_cases(cases, dev, budget, args.max_reps, report, watchdog)
    report.data["elapsed_s"] = time.perf_counter() - start
    report.write_json()
    md = report.write_markdown()
    print(f"wrote {md} and {report.out / 'gpu.json'} in {report.data['elapsed_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
