r"""Replay on the Hugging Face example: PPO epochs over a top-p rollout, scored three ways.

    nice -n 10 python examples/hf_replay_study.py                  # the tables and docs/hf_replay.png
    python examples/hf_replay_study.py --rollouts 4 --seeds 0 --top-ps 0.9 1.0 --table-rollouts 2   # a smoke run

The model, tokenizer, task (``a+b=``), reward, pretrained reference (cached under ``--cache-dir``, shared
with ``examples/hf_grpo.py``) and LoRA adapters are those of ``examples/hf_grpo.py``. The RL loop is
written out here (no Trainer) so that each rollout can be reused: a rollout of ``prompts x group``
responses is drawn with ``generate`` under ``lk.Sampling(T, top_p=p)``, then ``--epochs`` PPO epochs of
``--minibatches`` optimizer steps each are taken on it (GRPO advantages, clipped ratio, AdamW on the
adapters, gradient norm clipped at 1; no KL term: the study isolates the ratio). After the first
step the policy is not the sampler any more and its kept sets move. The three ways to score the
rollout's tokens in the PPO ratio ``exp(logp - old_logp)``, each used for both log-probs:

* ``replay``: the old log-probs are the processed distribution's and record the kept sets
  (``lk.hf.response_logprobs(..., return_kept=True)``); later steps renormalize the current policy on
  the recorded sets (``kept=``);
* ``temp_only``: ``softmax(z / T)`` on both sides, no truncation (what verl and TRL score);
* ``drop``: the current policy's processed distribution (``lk.token_logprobs(..., outside="-inf")``),
  a token outside its new kept set scored ``-inf`` and dropped from the loss.

**The exact ratio** is defined per token given its prefix: at a response position (the prefix of a
sampled response, teacher-forced), the old policy's processed distribution ``mu = p~_old`` drew the
token; the exact ratio of a token ``y`` is ``p~_new(y) / p~_old(y)``, each processed distribution on
its own kept set (``K_new``, ``K_old``): 0 when ``y`` left ``K_new``. At every off-policy step the
script enumerates every ``y`` the sampler can draw at every valid response position of the
mini-batch (the vocabulary has 15 entries, nothing is sampled) and compares each scorer's log ratio
with the exact one in float64, weighted by ``mu(y)``, each position alike:

* ``bias``: ``E_mu[log rho - log rho_exact]`` over the tokens ``K_new`` keeps (where the exact ratio is
  defined); ``|err|``: the same of the absolute difference; ``off``: the share of them with
  ``rho / rho_exact`` outside [0.99, 1.01];
* ``dropped``: the sampler's mass outside ``K_new`` (exact ratio 0: ``drop`` gives those tokens no
  log-prob and no gradient, ``replay`` and ``temp_only`` a finite ratio);
* ``temp_only`` against the sampler: ``log softmax(z_new / T)(y) - log mu(y)`` (a rollout correction's
  ratio to an engine that reports its processed log-probs: TRL's open issue 6789): ``log S_new``,
  off on-policy too.

Printed: (a) those figures at ``--top-p`` (mean over the off-policy steps, the rollouts and the
seeds); (b) the task reward (the rollouts' accuracy) over the rollouts, per method, 3 seeds, with the
share of the loss's tokens that ``drop`` took out and of the ratios outside the clip band; (c) the
bias of ``temp_only`` against ``top_p`` (``--top-ps``, ``--table-rollouts`` rollouts of the replay run
at each, seed 0), on-policy (the first step of every rollout) and off-policy. ``--out`` writes the
figure.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

import lightning_kl as lk
from lightning_kl import hf
from lightning_kl.ground.sampler import process_scores

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests): find the siblings
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runs  # noqa: E402
import hf_grpo  # noqa: E402

METHODS = ("replay", "temp_only", "drop")
BAND = (0.99, 1.01)

# ---------------------------------------------------------------------------------------------
# the exact ratio, by enumeration


def ratio_errors(old: Tensor, new: Tensor, sampling: lk.Sampling) -> dict[str, float]:
    r"""Each scorer's log ratio against the exact one, every token ``y`` the sampler can draw enumerated.

    ``old``, ``new``: ``[n, V]`` logits of the sampler (the policy that drew the rollout) and of the
    current policy at ``n`` response positions (one prefix each). In float64: the sampler
    ``mu = p~_old``, the exact log ratio ``log p~_new(y) - log p~_old(y)`` (processed distributions,
    each on its own kept set, from :func:`process_scores` and ``log_softmax``: ``-inf`` for ``y``
    outside ``K_new``); the scorers' log ratios from :func:`lightning_kl.token_logprobs` (every
    ``(position, y)`` pair one token of a ``[n, V]`` batch over the ``[n, V, V]`` logits, expanded).

    Returns ``{scorer}_bias``, ``{scorer}_abs``, ``{scorer}_off`` for the scorers ``replay``,
    ``temp_only``, ``drop`` and ``temp_vs_sampler`` (module docstring), ``dropped`` (``mu``'s mass
    outside ``K_new``), ``kept`` (``|K_old|``, mean over positions), ``log_kept`` (``E log S_old``) and
    ``replay_finite``, ``temp_only_finite`` (1.0 when every drawable token's ratio is finite).
    """
    if old.dim() != 2 or old.shape != new.shape:
        raise ValueError(f"`old` and `new` must be [n, V] logits of one shape, got {tuple(old.shape)} and {tuple(new.shape)}.")
    old, new = old.detach().double(), new.detach().double()
    n, vocab = old.shape
    T = sampling.temperature
    plain = lk.Sampling(T)
    # the formula: processed distributions, float64
    log_mu = torch.log_softmax(process_scores(old / T, sampling), -1)
    log_new = torch.log_softmax(process_scores(new / T, sampling), -1)
    mu = log_mu.exp()
    exact = log_new - log_mu  # -inf off K_new; nan off K_old (not drawable: masked below)
    # the library's scorers
    drawable = mu > 0
    tokens = torch.arange(vocab).expand(n, vocab).masked_fill(~drawable, -100)
    g_old, g_new = old[:, None].expand(n, vocab, vocab), new[:, None].expand(n, vocab, vocab)
    lp_old, kept = lk.token_logprobs(g_old, tokens, sampling=sampling, ignore_index=-100, return_kept=True)
    t_old = lk.token_logprobs(g_old, tokens, sampling=plain, ignore_index=-100)
    t_new = lk.token_logprobs(g_new, tokens, sampling=plain, ignore_index=-100)
    lr = {
        "replay": lk.token_logprobs(g_new, tokens, sampling=sampling, ignore_index=-100, kept=kept) - lp_old,
        "temp_only": t_new - t_old,
        "drop": lk.token_logprobs(g_new, tokens, sampling=sampling, ignore_index=-100, outside="-inf") - lp_old,
        "temp_vs_sampler": t_new - lp_old,
    }
    inside = drawable & (exact > float("-inf"))
    w = mu / n  # the sampler's weights over the (position, token) pairs: they sum to 1
    w_in = w[inside].sum()
    out = {"dropped": float(w[drawable & ~inside].sum()), "kept": float(drawable.sum(-1).double().mean()),
           "log_kept": float(torch.logsumexp(process_scores(old / T, sampling), -1).sub(torch.logsumexp(old / T, -1)).mean())}
    for name, v in lr.items():
        d = (v - exact)[inside]
        out[f"{name}_bias"] = float((w[inside] * d).sum() / w_in)
        out[f"{name}_abs"] = float((w[inside] * d.abs()).sum() / w_in)
        r = d.exp()
        out[f"{name}_off"] = float((w[inside] * ((r < BAND[0]) | (r > BAND[1]))).sum() / w_in)
    for name in ("replay", "temp_only"):
        out[f"{name}_finite"] = float(bool(lr[name][drawable].isfinite().all()))
    return out


# ---------------------------------------------------------------------------------------------
# the example's policy, rollouts and PPO steps


def build(args: argparse.Namespace, top_p: float) -> tuple[Any, hf_grpo.ArithmeticDataModule]:
    """The example's data module (at ``top_p``) and its module (for the cached reference)."""
    sampling = lk.Sampling(args.temperature, top_p=top_p)
    dm = hf_grpo.ArithmeticDataModule(prompts_per_rollout=args.prompts, group_size=args.group_size,
                                      sampling=sampling, check_sampler=True)
    module = hf_grpo.HFGRPO(pretrain_steps=args.pretrain_steps, cache_dir=args.cache_dir, lr=args.lr)
    return module, dm


def fresh_policy(module: Any, dm: hf_grpo.ArithmeticDataModule) -> Any:
    """The reference (cached) with fresh LoRA adapters: the example's ``HFGRPO.setup``."""
    import peft

    h = module.hparams
    base = module.reference_model(dm)
    lora = peft.LoraConfig(r=h.lora_r, lora_alpha=h.lora_alpha, target_modules=list(h.lora_targets),
                           lora_dropout=0.0, bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(h.pretrain_seed + 1)
        return peft.get_peft_model(base, lora)


@torch.no_grad()
def rollout(policy: Any, dm: hf_grpo.ArithmeticDataModule, generator: torch.Generator) -> dict[str, Any]:
    """One rollout from ``policy``: sequences, masks, reward, group, the sampler's response logits, the
    processed log-probs checked against ``generate``'s scores, and the kept sets."""
    h = dm.hparams
    problems = hf_grpo.sample_problems(h.prompts_per_rollout, h.max_operand, generator)
    problems = [ab for ab in problems for _ in range(h.group_size)]
    policy.eval()
    batch = dm.sample(policy, problems, torch.device("cpu"))
    seq, am, mask = batch["sequences"], batch["attention_mask"], batch["mask"]
    p = seq.shape[1] - mask.shape[1]
    lp, logits, kept = hf.response_logprobs(policy, seq, am, p, sampling=dm.sampling, return_logits=True,
                                            return_kept=True, sampler_scores=batch.pop("generate_scores"))
    policy.train()
    tokens = seq[:, p:].masked_fill(~mask, -100)
    batch.update(p=p, tokens=tokens, logits=logits.detach(), kept=kept, processed=lp,
                 temp_only=lk.token_logprobs(logits, tokens, sampling=lk.Sampling(dm.sampling.temperature), ignore_index=-100),
                 group=torch.arange(h.prompts_per_rollout).repeat_interleave(h.group_size))
    return batch


def scored(method: str, policy: Any, batch: dict[str, Any], rows: Tensor, sampling: lk.Sampling) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logp, old_logp, mask, logits)`` of the rows ``rows`` of a rollout, as ``method`` scores them.

    One forward pass: the current policy replayed on the recorded sets, its logits; ``temp_only`` and
    ``drop`` are taken from those logits (the same numbers a call of their own would give)."""
    seq, am, mask, tokens = batch["sequences"][rows], batch["attention_mask"][rows], batch["mask"][rows], batch["tokens"][rows]
    kept = None if batch["kept"] is None else batch["kept"][rows]  # None: a sampler that keeps everything
    lp, logits = hf.response_logprobs(policy, seq, am, batch["p"], sampling=sampling, kept=kept, return_logits=True)
    if method == "replay":
        return lp, batch["processed"][rows], mask, logits
    if method == "temp_only":
        lp = lk.token_logprobs(logits, tokens, sampling=lk.Sampling(sampling.temperature), ignore_index=-100)
        return lp, batch["temp_only"][rows], mask, logits
    lp = lk.token_logprobs(logits, tokens, sampling=sampling, ignore_index=-100, outside="-inf")
    keep = mask & (lp > float("-inf"))  # a token outside the current kept set: dropped
    old = batch["processed"][rows]
    return torch.where(keep, lp, old), old, keep, logits  # the dropped tokens: no -inf into exp (no nan)


def train(method: str, seed: int, top_p: float, rollouts: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """One run: ``rollouts`` rollouts, ``epochs x minibatches`` PPO steps on each. Per rollout: the reward,
    the on-policy and off-policy :func:`ratio_errors` (means over that rollout's steps) and the share
    of tokens dropped from the loss."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}.")
    module, dm = build(args, top_p)
    policy = fresh_policy(module, dm)
    sampling = dm.sampling
    torch.manual_seed(seed)  # generate's draws
    generator = torch.Generator().manual_seed(seed)  # prompts and mini-batches
    params = [q for q in policy.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    log: dict[str, list[float]] = {}
    for _ in range(rollouts):
        batch = rollout(policy, dm, generator)
        b = batch["mask"].shape[0]
        adv = _runs.group_advantages(batch["scores"], batch["group"])[:, None]
        on, off, dropped, clip_share = [], [], [], []
        for epoch in range(args.epochs):
            for rows in torch.randperm(b, generator=generator).chunk(args.minibatches):
                lp, old, keep, logits = scored(method, policy, batch, rows, sampling)
                mask = batch["mask"][rows]
                errors = ratio_errors(batch["logits"][rows][mask], logits.detach()[mask], sampling)
                step_off = bool(on) or epoch > 0  # the first step of a rollout is on-policy
                (off if step_off else on).append(errors)
                dropped.append(float((mask & ~keep).sum() / mask.sum().clamp(min=1)))
                ratio = torch.exp(lp - old)
                clipped = ratio.clamp(1 - args.clip_eps, 1 + args.clip_eps)
                if step_off:  # the share of the loss's tokens whose ratio is outside the clip band
                    clip_share.append(float(((ratio != clipped) & keep).sum() / keep.sum().clamp(min=1)))
                loss = lk.aggregate(-torch.minimum(ratio * adv[rows], clipped * adv[rows]), keep, "token-mean")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
        log.setdefault("reward", []).append(float(batch["scores"].mean()))
        log.setdefault("loss_dropped", []).append(sum(dropped) / len(dropped))
        log.setdefault("clipped", []).append(mean(clip_share))
        for tag, errs in (("on", on), ("off", off)):
            for key in errs[0] if errs else ():
                log.setdefault(f"{tag}/{key}", []).append(sum(e[key] for e in errs) / len(errs))
    return log


# ---------------------------------------------------------------------------------------------
# the report


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def running_mean(values: list[float], k: int = 10) -> list[float]:
    return [mean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def table_a(runs: dict[tuple[str, int], dict[str, list[float]]]) -> str:
    """The off-policy steps' ratio errors, per training run's method, over its rollouts and seeds."""
    lines = ["| run | scorer | bias of log ratio | mean abs error | off [0.99, 1.01] | dropped mass |",
             "|---|---|---:|---:|---:|---:|"]
    for method in METHODS:
        logs = [v for (m, _), v in runs.items() if m == method]
        if not logs or "off/replay_bias" not in logs[0]:
            continue
        for scorer in (*METHODS, "temp_vs_sampler"):
            f = {k: mean([mean(lg[f"off/{scorer}_{k}"]) for lg in logs]) for k in ("bias", "abs", "off")}
            dropped = mean([mean(lg["off/dropped"]) for lg in logs])
            lines.append(f"| {method} | {scorer} | {f['bias']:+.5f} | {f['abs']:.5f} | {f['off']:.2%} | {dropped:.3%} |")
    return "\n".join(lines)


def table_b(runs: dict[tuple[str, int], dict[str, list[float]]], seeds: list[int]) -> str:
    """Reward: the first and last quarter of the rollouts, per seed and mean; the loss's dropped tokens."""
    lines = ["| method | " + " | ".join(f"seed {s}: first -> last quarter" for s in seeds)
             + " | mean, last quarter | tokens dropped from the loss | ratio outside the clip band, off-policy steps |",
             "|---|" + "---:|" * (len(seeds) + 3)]
    for method in METHODS:
        cells, lasts, drops, clips = [], [], [], []
        for s in seeds:
            r = runs[(method, s)]["reward"]
            k = max(len(r) // 4, 1)
            cells.append(f"{mean(r[:k]):.3f} -> {mean(r[-k:]):.3f}")
            lasts.append(mean(r[-k:]))
            drops.append(mean(runs[(method, s)]["loss_dropped"]))
            clips.append(mean(runs[(method, s)]["clipped"]))
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {mean(lasts):.3f} | {mean(drops):.3%} | {mean(clips):.2%} |")
    return "\n".join(lines)


def table_c(rows: dict[float, dict[str, list[float]]]) -> str:
    """The temperature-only scorer's bias against top_p: against the sampler on-policy, and in the PPO
    ratio off-policy, with replay's."""
    lines = ["| top_p | mean kept | temp_only vs sampler, on-policy: bias | off [0.99, 1.01] | "
             "temp_only PPO ratio, off-policy: bias | mean abs error | replay, off-policy: bias | mean abs error | "
             "dropped mass, off-policy |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for top_p, lg in rows.items():
        g = {k: mean(v) for k, v in lg.items()}
        lines.append(
            f"| {top_p:g} | {g['on/kept']:.2f} | {g['on/temp_vs_sampler_bias']:+.5f} | {g['on/temp_vs_sampler_off']:.1%} | "
            f"{g['off/temp_only_bias']:+.5f} | {g['off/temp_only_abs']:.5f} | "
            f"{g['off/replay_bias']:+.5f} | {g['off/replay_abs']:.5f} | {g['off/dropped']:.3%} |"
        )
    return "\n".join(lines)


def plot(runs: dict[tuple[str, int], dict[str, list[float]]], seeds: list[int], rows: dict[float, dict[str, list[float]]],
         out: Path, title: str) -> None:
    plt = _runs.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = dict(zip(METHODS, ("C0", "C1", "C2")))
    ax = axes[0]
    for method in METHODS:
        for i, s in enumerate(seeds):
            ax.plot(running_mean(runs[(method, s)]["reward"]), color=colors[method], alpha=0.8, lw=1,
                    label=method if i == 0 else None)
    ax.set(title="task reward (rollout accuracy, mean of 10), one line a seed", xlabel="rollout", ylim=(0, 1))
    ax.legend()
    ax = axes[1]  # over every run (each method, each seed): the scorers' errors are measured at every step
    logs = [lg for lg in runs.values() if "off/replay_abs" in lg]
    for key, label, color in (("off/temp_vs_sampler_abs", "temp_only vs sampler: mean |error|", "C3"),
                              ("off/temp_only_abs", "temp_only PPO ratio: mean |error|", colors["temp_only"]),
                              ("off/replay_abs", "replay: mean |error|", colors["replay"]),
                              ("off/dropped", "sampled mass outside K_new (drop: ratio 0)", colors["drop"])):
        curve = [mean([lg[key][i] for lg in logs]) for i in range(len(logs[0][key]))]
        ax.semilogy(running_mean(curve), label=label, color=color, ls="--" if key == "off/dropped" else "-")
    ax.set(title="log ratio against the exact one, off-policy steps", xlabel="rollout")
    ax.legend(fontsize=7)
    ax = axes[2]
    ps = list(rows)
    for key, label, color, style in (("on/temp_vs_sampler_bias", "temp_only vs sampler, on-policy", "C3", "o-"),
                                     ("off/temp_vs_sampler_bias", "temp_only vs sampler, off-policy", "C3", "x--"),
                                     ("off/temp_only_bias", "temp_only PPO ratio, off-policy", colors["temp_only"], "o-"),
                                     ("off/replay_bias", "replay, off-policy", colors["replay"], "o-")):
        ax.plot(ps, [mean(rows[p].get(key, [math.nan])) for p in ps], style, color=color, label=label)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set(title="bias E_mu[log rho - log rho_exact] against top_p", xlabel="top_p")
    ax.legend(fontsize=7)
    _runs.save_figure(fig, title, out)


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top-p", type=float, default=0.9, help="the training runs' sampler (b)")
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--rollouts", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip-eps", type=float, default=0.2)
    parser.add_argument("--top-ps", type=float, nargs="*", default=[0.5, 0.8, 0.9, 0.95, 1.0], help="table (c)")
    parser.add_argument("--table-rollouts", type=int, default=10)
    parser.add_argument("--pretrain-steps", type=int, default=800)
    parser.add_argument("--cache-dir", default="runs/hf_grpo/reference")
    parser.add_argument("--out", default="docs/hf_replay.png", help="the figure; '' for none")
    args = parser.parse_args(argv)
    for name in ("rollouts", "epochs", "minibatches", "prompts", "group_size", "table_rollouts"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.epochs * args.minibatches < 2:
        raise SystemExit("--epochs x --minibatches must be >= 2: the study is about the off-policy steps")
    for p in [args.top_p, *args.top_ps]:
        if not 0 < p <= 1:
            raise SystemExit(f"top_p must be in (0, 1], got {p}")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse(argv)
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
    start = time.perf_counter()
    runs = {}
    for method in args.methods:
        for seed in args.seeds:
            t0 = time.perf_counter()
            runs[(method, seed)] = train(method, seed, args.top_p, args.rollouts, args)
            print(f"[hf_replay_study] {method} seed {seed}: {args.rollouts} rollouts in {time.perf_counter() - t0:.1f} s, "
                  f"reward last quarter {_runs.last_quarter_mean(runs[(method, seed)]['reward']):.3f}", flush=True)
    rows = {}
    for top_p in args.top_ps:
        rows[top_p] = train("replay", args.seeds[0], top_p, args.table_rollouts, args)
    print(f"\nT = {args.temperature}, top_p = {args.top_p}, {args.epochs} epochs x {args.minibatches} mini-batches per rollout "
          f"of {args.prompts} x {args.group_size}, lr {args.lr}, {args.rollouts} rollouts, seeds {args.seeds}; "
          f"{time.perf_counter() - start:.0f} s in all, {torch.get_num_threads()} thread(s)")
    print("\n(a) the PPO log ratio against the exact one, off-policy steps (enumeration over the tokens at every response position)\n")
    print(table_a(runs))
    print("\n(b) task reward (rollout accuracy)\n")
    if set(args.methods) == set(METHODS):
        print(table_b(runs, args.seeds))
    print(f"\n(c) the bias of temperature-only scoring against top_p (replay runs, seed {args.seeds[0]}, "
          f"{args.table_rollouts} rollouts each)\n")
    print(table_c(rows))
    if args.out and set(args.methods) == set(METHODS):
        plot(runs, args.seeds, rows, Path(args.out),
             f"HF example, top_p {args.top_p}, T {args.temperature}, {args.epochs} PPO epochs x {args.minibatches} "
             f"mini-batch(es) per rollout; {len(args.seeds)} seeds")
        print(f"\nfigure: {args.out}")
    return {"runs": runs, "rows": rows}


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    main()
