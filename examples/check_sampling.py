r"""The sampler against the scorer in the Hugging Face example: full-vocabulary vs processed log-probs.

    python examples/hf_grpo.py fit --config examples/configs/hf_grpo_lora.yaml
    python examples/hf_grpo.py fit --config examples/configs/hf_grpo_lora.yaml \
        --data.score_processed=false --trainer.logger.init_args.name=hf_grpo_lora_fullvocab
    python examples/hf_grpo.py fit --config examples/configs/hf_grpo_lora.yaml \
        --data.reference=policy_kept --trainer.logger.init_args.name=hf_grpo_lora_policykept
    python examples/check_sampling.py runs/hf_grpo

(``docs/sampling.md`` lists the other runs of its table: ``kl_coef: 0`` and ``top_p: 0.7``.)

``generate`` samples with the YAML's ``data.sampling`` (``temperature`` and ``top_p``, through
``lk.Sampling.generate_kwargs()``). Every rollout logs the importance
ratio of the scorer's log-prob against the sampler's (``generate``'s processed scores), at every
response token: ``sampling/ratio_full_*`` for the full-vocabulary ``log_softmax(z / T)``,
``sampling/ratio_processed_*`` for :func:`lightning_kl.token_logprobs` with ``sampling=`` (``_mean``: the
mean ratio, ``_out``: the share of tokens outside ``lk.hf.RATIO_BAND``, [0.99, 1.01], the band of
``lk.hf``'s own check), and three exact KLs per response
(``sampling/kl_full_seq``: the full softmax against the reference's; ``sampling/kl_processed_seq``:
the processed policy against the reference's softmax; ``sampling/kl_policy_kept_seq``: against the
reference renormalized on the policy's kept set). The last two columns: the loss estimator's value
(``train/kl_est``, token mean) and the exact KL of the run's own objective (``train/kl``, token mean). For each run (newest ``version_*``
under ``RUNS_DIR/<name>/``) this prints the ratio statistics over all rollouts, and the accuracy and
both exact KLs over the last quarter of the rollouts. Standard library only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path: find the siblings
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runs  # noqa: E402

RUNS = (
    "hf_grpo_lora",
    "hf_grpo_lora_fullvocab",
    "hf_grpo_lora_policykept",
    "hf_grpo_lora_kl0",
    "hf_grpo_lora_p07",
    "hf_grpo_lora_p07_fullvocab",
)
RATIOS = ("ratio_full_mean", "ratio_full_out", "ratio_processed_mean", "ratio_processed_out")


def summarize(log_dir: Path) -> dict[str, float]:
    rows = [r for r in _runs.read_rows(log_dir / "metrics.csv") if "sampling/ratio_full_mean" in r]
    if not rows:
        raise SystemExit(f"{log_dir}/metrics.csv has no sampling/ columns: a run of an older example?")
    out = {name: sum(r[f"sampling/{name}"] for r in rows) / len(rows) for name in RATIOS}
    out["steps"] = len(rows)
    out["acc"] = _runs.last_quarter_mean([r["train/acc"] for r in rows])
    out["ref_acc"] = rows[0]["train/ref_acc"]
    for name in ("kl_full_seq", "kl_processed_seq", "kl_policy_kept_seq"):
        out[name] = _runs.last_quarter_mean([r[f"sampling/{name}"] for r in rows])
    # the loss's estimate (train/kl_est: the estimator's value, token mean) against the exact KL it
    # estimates (train/kl: the run's own exact KL, token mean)
    out["kl_est"] = _runs.last_quarter_mean([r["train/kl_est"] for r in rows])
    out["kl_exact"] = _runs.last_quarter_mean([r["train/kl"] for r in rows])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_dir", type=Path)
    parser.add_argument("--runs", nargs="+", default=list(RUNS))
    args = parser.parse_args(argv)
    print("run                         steps  ratio full: mean  out   processed: mean  out    ref acc  acc    KL/resp full  processed  policy_kept   KL/token est  exact")
    found = 0
    for name in args.runs:
        log_dir = _runs.latest_version(args.runs_dir / name)
        if log_dir is None:
            print(f"{name:27s} (no run)")
            continue
        s = summarize(log_dir)
        found += 1
        print(
            f"{name:27s} {s['steps']:5.0f}  {s['ratio_full_mean']:16.4f} {s['ratio_full_out']:5.3f}"
            f"  {s['ratio_processed_mean']:15.4f} {s['ratio_processed_out']:5.3f}"
            f"  {s['ref_acc']:7.3f}  {s['acc']:5.3f}  {s['kl_full_seq']:12.3f}  {s['kl_processed_seq']:9.3f}  {s['kl_policy_kept_seq']:11.3f}"
            f"  {s['kl_est']:12.3f}  {s['kl_exact']:5.3f}"
            f"  {log_dir}"
        )
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
