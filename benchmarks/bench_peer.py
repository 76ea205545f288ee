"""Token log-probs and entropy from hidden states, side by side with TRL's chunked kernel.

One case, forward + ``backward`` of ``logprobs.sum() + entropy.sum()`` from hidden states ``[n, d]``
and an LM head ``[V, d]`` (default 512 x 896 and 151,936 x 896 float32, Qwen2.5-0.5B's head), both
requiring grad. Variants:

* ``ours-one-pass``: ``lk.token_logprobs_and_entropy(lk.FromHidden(h, w), tokens)``;
* ``ours-two-calls``: ``lk.token_logprobs(...)`` and ``lk.token_entropy(...)``;
* ``trl-chunked``: TRL's ``ChunkedLogProbFunction`` (``trl/kernels/chunked_logprob.py``, loaded alone
  from its file; on CPU its torch path), with TRL's vocabulary tile of 32,768 and ``outputs=("entropy",)``;
* ``trl-selective``: the formula of TRL's ``selective_log_softmax`` (``trl/trainer/utils.py``, float32
  branch: a gather minus a per-row ``logsumexp`` loop) on the whole logits ``h @ w.T``, with the
  entropy of the same logits;
* ``naive``: ``log_softmax(h @ w.T)``, a gather and ``-(p * logp).sum(-1)``.

Both TRL variants and ours compute the entropy of ``softmax(z / T)``; with a truncating sampler ours
is the entropy of the sampler's processed distribution (TRL's kernel has no sampler).

Method (``_measure.py``, as ``bench_logprobs.py``): each measurement is a fresh child process that
builds the inputs, runs a warm-up, resets the resident high-water mark and times ``--reps`` passes;
the extra memory is the peak resident memory above the start minus the gradients of ``h`` and
``w`` that every variant returns. Variants alternate run by run; the table shows medians over
``--runs`` children and each variant's ratios to TRL's kernel.

    python benchmarks/bench_peer.py              # the docs table
    python benchmarks/bench_peer.py --quick      # a smoke run at small sizes (ratios say nothing)

TRL's file is found under ``$LIGHTNING_KL_STACKS/trl/kernels/`` (default ``.venv/stacks``), or in an
importable ``trl``; without it the TRL variants are skipped. Linux only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _measure import peak_and_time, run_child  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("ours-one-pass", "ours-two-calls", "trl-chunked", "trl-selective", "naive")
TRL_TILE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16


def trl_kernel_path() -> Optional[str]:
    """TRL's ``kernels/chunked_logprob.py``: under ``$LIGHTNING_KL_STACKS/trl``, else in an importable ``trl``."""
    stacks = os.environ.get("LIGHTNING_KL_STACKS", os.path.join(ROOT, ".venv", "stacks"))
    path = os.path.join(stacks, "trl", "kernels", "chunked_logprob.py")
    if os.path.exists(path):
        return path
    spec = importlib.util.find_spec("trl")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "kernels", "chunked_logprob.py")
        return path if os.path.exists(path) else None
    return None


def _load_trl(path: str) -> Any:
    """That one file as a module (TRL's package imports dependencies this environment lacks).

    Its backward imports ``maybe_gather_lm_head_ctx`` from ``..trainer.utils``: a ZeRO-3 gather that
    TRL itself makes a null context without DeepSpeed. A stand-in parent package gives it that null
    context."""
    import contextlib
    import types

    pkg = "_trl_alone"
    for name in (pkg, f"{pkg}.kernels", f"{pkg}.trainer"):
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__path__ = []  # type: ignore[attr-defined]
    utils = types.ModuleType(f"{pkg}.trainer.utils")
    utils.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()  # type: ignore[attr-defined]
    sys.modules[utils.__name__] = utils
    spec = importlib.util.spec_from_file_location(f"{pkg}.kernels.chunked_logprob", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _selective_log_softmax(logits: Any, index: Any) -> Any:
    """TRL 1.16's ``selective_log_softmax``, float32 branch, temperature 1 (copied formula)."""
    import torch

    selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
    lse = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])  # TRL's loop over rows
    return selected - lse


def _child(args: argparse.Namespace) -> None:
    import torch

    import lightning_kl as lk

    torch.manual_seed(0)
    n, d, vocab = args.tokens, args.dim, args.vocab
    h = torch.randn(n, d).requires_grad_()
    w = (torch.randn(vocab, d) * d**-0.5).requires_grad_()
    tokens = torch.randint(0, vocab, (n,))
    variant = args.child
    trl = _load_trl(args.trl) if variant == "trl-chunked" else None

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        if variant == "ours-one-pass":
            return lk.token_logprobs_and_entropy(lk.FromHidden(h, w), tokens)
        if variant == "ours-two-calls":
            return lk.token_logprobs(lk.FromHidden(h, w), tokens), lk.token_entropy(lk.FromHidden(h, w))
        if variant == "trl-chunked":
            out = trl.ChunkedLogProbFunction.apply(h, w, None, tokens, 1.0, TRL_TILE, None, 1.0, ("entropy",))
            return out[0], out[1]
        logits = h @ w.T
        if variant == "trl-selective":
            lp = _selective_log_softmax(logits, tokens)
            logp = torch.log_softmax(logits, dim=-1)
            return lp, -(logp.exp() * logp).sum(-1)
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, tokens[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    grads_mib = (h.numel() + w.numel()) * 4 / 2**20

    def step() -> None:
        lp, ent = run()
        (lp.sum() + ent.sum()).backward()

    def clear() -> None:
        h.grad = w.grad = None

    peak_mib, time_s = peak_and_time(step, clear, args.reps)
    print(json.dumps({"extra_mib": peak_mib - grads_mib, "time_s": time_s}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dim", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--runs", type=int, default=2, help="child processes per variant (alternated)")
    parser.add_argument("--reps", type=int, default=2, help="timed passes per child")
    parser.add_argument("--quick", action="store_true", help="smoke run: 64 tokens, V = 8192, d = 64")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trl", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    if args.quick:
        args.tokens, args.vocab, args.dim, args.runs, args.reps = 64, 8192, 64, 1, 1
    trl = trl_kernel_path()
    variants = [v for v in VARIANTS if trl is not None or not v.startswith("trl")]
    if trl is None:
        print("TRL's kernels/chunked_logprob.py not found (set LIGHTNING_KL_STACKS): the TRL variants are skipped")
    found: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(args.runs):
        for v in variants:  # alternated: every variant sees the same load over time
            cmd = [sys.executable, os.path.abspath(__file__), "--child", v, "--tokens", str(args.tokens), "--dim", str(args.dim)]
            cmd += ["--vocab", str(args.vocab), "--reps", str(args.reps)] + (["--trl", trl] if trl else [])
            found[v].append(run_child(cmd, fixed_mmap_threshold=True))
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("extra_mib", "time_s")} for v, rs in found.items()}
    base = med.get("trl-chunked")
    print(f"\nlog-probs + entropy, forward + backward, hidden [{args.tokens}, {args.dim}] x head [{args.vocab:,}, {args.dim}] float32")
    print(f"medians of {args.runs} alternated children x {args.reps} passes\n")
    print("| variant | extra memory (MiB) | time (s) | memory / TRL's kernel | time / TRL's kernel |")
    print("|---|---|---|---|---|")
    for v in variants:
        m = med[v]
        ratio = (f"{m['extra_mib'] / base['extra_mib']:.2f}x | {m['time_s'] / base['time_s']:.2f}x") if base else "- | -"
        print(f"| {v} | {m['extra_mib']:.0f} | {m['time_s']:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
