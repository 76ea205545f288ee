r"""The top-k bias: the divergence to a teacher's top-k log-probs against the exact full one, beside verl's and TRL's.

Run ``python examples/topk_bias.py`` (about 1.5 CPU-minutes): it prints one markdown table per
direction, the ``docs/distillation.md`` tables. ``--quick`` is the test's configuration.

**Rows.** Two related random models over a vocabulary of ``V`` ids (4,096 by default), ``--rows`` positions,
per seed: a teacher ``z_T = a (h W^T) / sqrt(d) + b``, with a Zipf prior ``b`` (``-1.1 log rank``, the ranks
shuffled), hidden states ``h`` and a head ``W`` standard normal (``d = 64``) and a sharpness ``a`` drawn per
position (log-normal around 6: peaked rows and flat ones; the teacher's entropy 1.8 nats on average at
V = 4,096), and a student that shares ``b`` and sees ``h`` and ``W`` through noise (0.3 of their scale), at 0.8
of the teacher's sharpness (a student flatter than its teacher, as at the start of distillation).

**Per row**, in float64, for ``k`` = 1, 8, 64, 256 and ``V`` (the teacher's ``k`` most likely ids and their
log-probs, as a server returns them), for the forward KL ``KL(q || p)``, the reverse KL ``KL(p || q)`` and the
JSD at ``beta = 0.5`` (TRL's convention):

* ``D``: the exact full divergence, ``lk.full_kl(z, z_T, divergence=...)``;
* ``D_I``: ours on the payload, ``lk.full_kl(z, lk.TopK(ids, logprobs), divergence=...)``: the divergence of the
  two distributions coarsened onto the ``k`` ids and one tail cell, ``0 <= D_I <= D`` (the data-processing
  inequality), ``D_I = D`` at ``k = V``;
* verl 0.9.1's ``forward_kl_topk`` (forward only): ``compute_forward_kl_topk`` of
  ``verl/trainer/distillation/fsdp/losses.py``, the teacher-weighted sum over the ids of the student's
  full-vocabulary log-probs (no tail), then its registry's ``clamp_min(0.0)``; with the YAML's defaults
  (``log_prob_min_clamp: null``, ``loss_max_clamp: null``). Its unclamped sum is ``D_I - T`` with the tail
  term ``T = Q_t log(Q_t / P_t)``: below ``D_I`` where the teacher leaves more mass outside its ids than
  the student does, above where the student leaves more, and then also possibly above ``D``;
* TRL 1.16.0's ``ServerDistillationTrainer`` loss: ``_add_tail_bucket`` and ``_jsd_divergence`` on the
  teacher's top-k for the forward KL (``beta = 0``, any ``loss_top_k``); for ``beta > 0`` TRL accepts only
  ``loss_top_k = 1``, and its method ``_compute_sparse_top_1_divergence_loss`` takes the support {the
  teacher's top-1, the sampled token} (the sampled token alone for ``beta = 1``) plus the tail: shown on
  the ``k = 1`` row, with a token sampled from the student per position.

The peers' functions are read from the pinned packages (``benchmarks/_stacks.py``); without them their
columns are left out. Each number is the mean over rows and seeds; the script asserts ``0 <= D_I <= D`` on
every row, ``D_I = D`` at ``k = V``, verl's sum ``= D_I - T`` and TRL's forward ``= D_I`` (rows with both
tails above TRL's clamp), and prints the largest deviations.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

import lightning_kl as lk

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _stacks import StackMissing, trl_server, verl_forward_kl_topk  # noqa: E402

DIVERGENCES = (("forward", None), ("reverse", None), ("jsd", 0.5))
TRL_BETA = {"forward": 0.0, "reverse": 1.0, "jsd": 0.5}  # TRL's ends: 0 forward, 1 reverse


def rows(seed: int, n: int, vocab: int, d: int = 64) -> tuple[Tensor, Tensor]:
    """``(student logits, teacher logits)``, ``[n, vocab]`` float64 each (the module's docstring)."""
    g = torch.Generator().manual_seed(seed)
    rank = torch.randperm(vocab, generator=g).double() + 1
    prior = -1.1 * rank.log()
    h, w = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(vocab, d, generator=g, dtype=torch.float64)
    sharp = (math.log(6.0) + 0.5 * torch.randn(n, 1, generator=g, dtype=torch.float64)).exp()
    teacher = sharp * (h @ w.T) / d**0.5 + prior
    h_s = h + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)
    w_s = w + 0.3 * torch.randn(vocab, d, generator=g, dtype=torch.float64)
    student = 0.8 * sharp * (h_s @ w_s.T) / (1.09 * d**0.5) + prior  # 1.09 = 1 + 0.3^2: the noisy inputs' larger scale
    return student, teacher


def one_seed(seed: int, n: int, vocab: int, ks: list[int], peers: dict[str, Any]) -> dict[tuple[str, int], dict[str, Tensor]]:
    """Per (direction, k), per row: ``D``, ``D_I``, the tails and the peers' values."""
    z, zt = rows(seed, n, vocab)
    lp_all, lq_all = z.log_softmax(-1), zt.log_softmax(-1)
    g = torch.Generator().manual_seed(10_000 + seed)
    sampled = torch.multinomial(lp_all.exp(), 1, generator=g).squeeze(-1)  # the student's token per position
    out: dict[tuple[str, int], dict[str, Tensor]] = {}
    for name, beta in DIVERGENCES:
        full = lk.full_kl(z, zt, divergence=name, beta=beta)
        for k in ks:
            lq, ids = lq_all.topk(k, dim=-1)
            res = lk.full_kl(z, lk.TopK(ids, lq), divergence=name, beta=beta, return_tails=True)
            r = {"D": full, "D_I": res.value, "P_t": res.student_tail, "Q_t": res.teacher_tail, "Q_I": lq.exp().sum(-1)}
            if name == "forward" and "verl" in peers:
                clamped, raw, _ = peers["verl"](z, ids, lq)
                r.update(verl=clamped.double(), verl_raw=raw.double())
            if "trl" in peers:
                add_tail, jsd, top1 = peers["trl"]
                if name == "forward":
                    valid = torch.ones_like(ids, dtype=torch.bool)
                    sp, mask = add_tail(lp_all.gather(-1, ids), valid)
                    sq, _ = add_tail(lq, valid)
                    r["trl"] = jsd(sp, sq, 0.0, mask).sum(-1)
                elif k == 1:
                    lq_sampled = lq_all.gather(-1, sampled[:, None])[:, 0]
                    r["trl"] = top1(TRL_BETA[name], True, lp_all, ids[:, 0], lq[:, 0], sampled, lq_sampled)
            out[(name, k)] = r
    return out


def peers() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, load in (("verl", verl_forward_kl_topk), ("trl", trl_server)):
        try:
            found[name] = load()
        except StackMissing as e:
            print(f"{name}: left out ({e})")
    return found


def run(seeds: list[int], n: int, vocab: int, ks: list[int]) -> dict[tuple[str, int], dict[str, Tensor]]:
    """Every seed's rows, concatenated per (direction, k)."""
    found = peers()
    per_seed = [one_seed(s, n, vocab, ks, found) for s in seeds]
    return {key: {f: torch.cat([p[key][f] for p in per_seed]) for f in per_seed[0][key]} for key in per_seed[0]}


def checks(results: dict[tuple[str, int], dict[str, Tensor]], vocab: int) -> dict[str, float]:
    """The largest deviations of the properties (each asserted within float64's rounding, or verl's float32)."""
    dev = {"D_I below 0": 0.0, "D_I above D": 0.0, "k = V: |D_I - D|": 0.0, "verl: |sum - (D_I - T)|": 0.0,
           "TRL forward: |value - D_I|": 0.0}  # fmt: skip
    for (name, k), r in results.items():
        d, di = r["D"], r["D_I"]
        dev["D_I below 0"] = max(dev["D_I below 0"], float((-di).max()))
        dev["D_I above D"] = max(dev["D_I above D"], float((di - d).max()))
        if k == vocab:
            dev["k = V: |D_I - D|"] = max(dev["k = V: |D_I - D|"], float((di - d).abs().max()))
        if "verl_raw" in r:
            qt, pt = r["Q_t"], r["P_t"]
            tail = torch.where(qt > 0, qt * (qt.log() - pt.log()), torch.zeros_like(qt))
            keep = (qt > 1e-6) | (k == vocab)  # the tails' floors: resolved tails, or none at k = V
            dev["verl: |sum - (D_I - T)|"] = max(dev["verl: |sum - (D_I - T)|"], float((r["verl_raw"] - (di - tail))[keep].abs().max()))
            assert torch.equal(r["verl"], r["verl_raw"].clamp_min(0.0))
        if name == "forward" and "trl" in r:
            keep = (r["Q_t"] > 1e-6) & (r["P_t"] > 1e-6)  # TRL clamps the top-k log-sum at -1e-7
            if keep.any():
                dev["TRL forward: |value - D_I|"] = max(dev["TRL forward: |value - D_I|"], float((r["trl"] - di)[keep].abs().max()))
    assert dev["D_I below 0"] <= 1e-12 and dev["D_I above D"] <= 1e-10, dev
    assert dev["k = V: |D_I - D|"] <= 1e-10, dev
    assert dev["verl: |sum - (D_I - T)|"] <= 1e-4, dev  # verl sums in float32
    assert dev["TRL forward: |value - D_I|"] <= 1e-9, dev
    return dev


def _mean(t: Optional[Tensor]) -> str:
    if t is None:
        return "-"
    v = float(t.mean())
    return f"{0.0 if abs(v) < 5e-5 else v:.4f}"  # no "-0.0000" from rounding


def table(results: dict[tuple[str, int], dict[str, Tensor]], name: str, vocab: int) -> str:
    head = ["k", "teacher mass on the ids", "full D", "ours D_I", "bias D - D_I", "bias / D"]
    if name == "forward":
        head += ["verl (clamped)", "verl clamp active", "verl > D_I", "verl > D", "TRL tail bucket"]
    else:
        head += ["TRL top-1 support (sampled token)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (n, k), r in results.items():
        if n != name:
            continue
        d, di = r["D"], r["D_I"]
        cells = ["V" if k == vocab else str(k), _mean(r["Q_I"]), _mean(d), _mean(di), _mean(d - di),
                 f"{max(float((d - di).mean() / d.mean()), 0.0):.1%}"]  # fmt: skip (D_I <= D: asserted)
        if name == "forward":
            if "verl" in r:
                share = [(r["verl_raw"] < 0), (r["verl"] > di + 1e-4), (r["verl"] > d + 1e-4)]  # 1e-4: verl's float32
                cells += [_mean(r["verl"])] + [f"{float(x.double().mean()):.0%}" for x in share]
            else:
                cells += ["-"] * 4
            cells += [_mean(r.get("trl"))]
        else:
            cells += [_mean(r.get("trl")) if k == 1 else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=512, help="positions per seed")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--quick", action="store_true", help="V = 256, 32 rows, one seed: the test's configuration")
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.rows, args.seeds = 256, 32, "0"
    seeds = [int(s) for s in args.seeds.split(",")]
    ks = sorted({k for k in (1, 8, 64, 256) if k < args.vocab} | {args.vocab})
    results = run(seeds, args.rows, args.vocab, ks)
    dev = checks(results, args.vocab)
    z, zt = rows(seeds[0], args.rows, args.vocab)
    h_t = -(zt.softmax(-1) * zt.log_softmax(-1)).sum(-1)
    h_s = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    print(f"V = {args.vocab}, {args.rows} positions x seeds {seeds}; entropy (seed {seeds[0]}): teacher {float(h_t.mean()):.2f} "
          f"nats (10%-90%: {float(h_t.quantile(0.1)):.2f}-{float(h_t.quantile(0.9)):.2f}), student {float(h_s.mean()):.2f}")
    for name, beta in DIVERGENCES:
        label = {"forward": "forward KL(q || p)", "reverse": "reverse KL(p || q)", "jsd": f"JSD, beta = {beta}"}[name]
        print(f"\n{label}\n")
        print(table(results, name, args.vocab))
    print("\nchecks (largest deviation): " + ", ".join(f"{k} {v:.1e}" for k, v in dev.items()))


if __name__ == "__main__":
    main()
