"""Vocabulary-parallel log-probs and full KL against gathering the logits and against ``loss_parallel``.

Two CPU processes (gloo) hold the logits ``[tokens, V]`` split over the vocabulary (a DTensor
``Shard(-1)``, ``V / 2`` columns each, float32). In the same run, each rank measures a forward and
backward of:

* ``vocab-parallel``: ``lk.token_logprobs(dt, tokens)`` and ``lk.full_kl(dt, dt_ref)`` on the shards
  (this package: a few numbers per token cross the group);
* ``gather``: ``dt.full_tensor()`` (both models' for the KL), then the same single-process kernels
  on the whole vocabulary;
* ``loss_parallel`` (log-probs only: torch has no KL there): ``-F.cross_entropy(dt, tokens,
  reduction="none")`` inside ``torch.distributed.tensor.parallel.loss_parallel()``.

Bytes communicated are counted by design, in the collectives themselves: a ``TorchDispatchMode``
sees every c10d and functional collective the step issues and adds up the bytes of the tensors it
sends (for an all-gather, the gathered output, which is what crosses the group). Peak memory is the
resident high-water mark of the rank's process above its resident size before the step (inputs not
counted; ``benchmarks/_measure.py``), time the median of ``--reps`` steps. Variants are measured one
after the other in the same processes; rank 0 prints the table and the ratios to ``gather``.

    python benchmarks/bench_vocab_parallel.py            # 1024 tokens x 65536 vocabulary, float32
    python benchmarks/bench_vocab_parallel.py --quick    # a smoke run (seconds)

Linux only (reads /proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from _measure import peak_and_time  # this folder: resident-memory high-water mark and time

TARGET_MEMORY_RATIO = 0.5
TARGET_TIME_RATIO = 1.0


class CountBytes(TorchDispatchMode):
    """Adds up the bytes that each collective op sends (c10d and functional collectives)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into plain ops and collectives, then see those
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns, name = func.namespace, func.__name__
        if ns in ("c10d", "_c10d_functional") and any(k in name for k in ("all", "reduce", "broadcast", "scatter")):
            if "gather" in name:  # what crosses is the gathered result
                sent = out[0] if isinstance(out, (tuple, list)) else out
                tensors = sent if isinstance(sent, (tuple, list)) else [sent]
            else:
                tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor)][:1]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            self.calls += 1
        return out


def _flat(x: Any) -> list:
    if isinstance(x, (tuple, list)):
        return [y for item in x for y in _flat(item)]
    return [x]


def _child(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(args.threads)
    import lightning_kl as lk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2,))
    n, vocab = args.tokens, args.vocab
    g = torch.Generator().manual_seed(0)
    z = torch.randn(n, vocab, generator=g)
    zr = z + 0.3 * torch.randn(n, vocab, generator=g)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    half = vocab // 2
    local = z[:, rank * half : (rank + 1) * half].clone().requires_grad_()
    local_ref = zr[:, rank * half : (rank + 1) * half].clone()
    del z, zr

    def dtensor(x: torch.Tensor) -> Any:
        return DTensor.from_local(x, mesh, [Shard(-1)], run_check=False)

    def ours_lp() -> None:
        lk.token_logprobs(dtensor(local), tokens).sum().backward()

    def gather_lp() -> None:
        lk.token_logprobs(dtensor(local).full_tensor(), tokens).sum().backward()

    def torch_lp() -> None:
        with loss_parallel():
            (-F.cross_entropy(dtensor(local), tokens, reduction="none")).sum().backward()

    def ours_kl() -> None:
        lk.full_kl(dtensor(local), dtensor(local_ref)).sum().backward()

    def gather_kl() -> None:
        lk.full_kl(dtensor(local).full_tensor(), dtensor(local_ref).full_tensor()).sum().backward()

    variants: dict[str, Callable[[], None]] = {
        "logprobs vocab-parallel": ours_lp,
        "logprobs gather": gather_lp,
        "logprobs loss_parallel": torch_lp,
        "full KL vocab-parallel": ours_kl,
        "full KL gather": gather_kl,
    }
    # check first: every variant gives the gather's values
    with torch.no_grad():
        want = lk.token_logprobs(dtensor(local).full_tensor(), tokens)
        got = lk.token_logprobs(dtensor(local), tokens)
        with loss_parallel():
            tp = (-F.cross_entropy(dtensor(local), tokens, reduction="none")).full_tensor()
        kl_want = lk.full_kl(dtensor(local).full_tensor(), dtensor(local_ref).full_tensor())
        kl_got = lk.full_kl(dtensor(local), dtensor(local_ref))
    agree = {
        "logprobs": float((got - want).abs().max()),
        "loss_parallel": float((tp - want).abs().max()),
        "full KL": float((kl_got - kl_want).abs().max()),
    }

    def clear() -> None:
        local.grad = None

    results = {}
    for name, step in variants.items():
        counter = CountBytes()
        with counter:
            step()
        clear()
        dist.barrier()
        peak, seconds = peak_and_time(step, clear, args.reps)
        dist.barrier()
        results[name] = {"bytes": counter.bytes, "collectives": counter.calls, "peak_mib": peak, "seconds": seconds}
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"results": results, "agree": agree}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--quick", action="store_true", help="256 x 4096, 2 reps: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.vocab, args.reps = 256, 4096, 2
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # resident memory follows the live tensors
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        torch.multiprocessing.spawn(_child, args=(args, os.path.join(tmp, "store"), out), nprocs=2, join=True)
        with open(out) as f:
            report = json.load(f)
    res, agree = report["results"], report["agree"]
    n, vocab = args.tokens, args.vocab
    print(f"{n} tokens x {vocab} vocabulary (float32), split over 2 processes (gloo, CPU); rank 0's figures")
    print(f"max |difference| to the gather: {', '.join(f'{k} {v:.1e}' for k, v in agree.items())}")
    print(f"{'variant':26s} {'sent MiB':>9s} {'colls':>6s} {'peak MiB':>9s} {'ms':>8s}  ratios to the gather (sent, peak, time)")
    for name, r in res.items():
        base = res["full KL gather" if name.startswith("full") else "logprobs gather"]
        ratios = f"{r['bytes'] / base['bytes']:.2e}  {r['peak_mib'] / base['peak_mib']:.2f}  {r['seconds'] / base['seconds']:.2f}"
        print(f"{name:26s} {r['bytes'] / 2**20:9.3f} {r['collectives']:6d} {r['peak_mib']:9.1f} {r['seconds'] * 1e3:8.1f}  {ratios}")
    for kind in ("logprobs", "full KL"):
        ours, gather = res[f"{kind} vocab-parallel"], res[f"{kind} gather"]
        mem, time_ = ours["peak_mib"] / gather["peak_mib"], ours["seconds"] / gather["seconds"]
        per_token = ours["bytes"] / n
        print(
            f"{kind}: {per_token:.0f} bytes sent per token (O(tokens); the gather: {gather['bytes'] / n:.0f}); "
            f"memory {mem:.2f}x the gather's ({'met' if mem <= TARGET_MEMORY_RATIO else 'missed'} <= {TARGET_MEMORY_RATIO}), "
            f"time {time_:.2f}x ({'met' if time_ <= TARGET_TIME_RATIO else 'missed'} <= {TARGET_TIME_RATIO})"
        )


if __name__ == "__main__":
    sys.exit(main())
