"""Every public computation of the package at one thread count: ``python _threads_worker.py THREADS OUT``.

Computes a fixed set of values and gradients (the vocabulary engine's paths, from logits and from a head,
whole and truncated; the sampled estimators on tensors past torch's parallel grain size; the loss in every
`agg` mode; the metric, the high-entropy mask, the bonus's controller step, the rollout correction) at
``torch.set_num_threads(THREADS)`` and saves them to ``OUT`` (``torch.save``), for
``tests/test_thread_counts.py`` to compare across thread counts.
"""

from __future__ import annotations

import sys

import torch

if __name__ == "__main__":  # (pytest's doctest collection imports this file too)
    torch.set_num_threads(int(sys.argv[1]))

import lightning_kl as lk  # noqa: E402

F64 = torch.float64


def main(out_path: str) -> None:
    g = torch.Generator().manual_seed(0)
    out: dict[str, list[torch.Tensor]] = {}

    def put(name: str, value: torch.Tensor, *leaves: torch.Tensor) -> None:
        grads = torch.autograd.grad(value.masked_fill(value.isinf(), 0).sum(), leaves) if leaves else ()
        out[name] = [value.detach(), *grads]

    z = (torch.randn(40, 3000, generator=g) * 3).requires_grad_()
    ref = torch.randn(40, 3000, generator=g) * 3
    tokens = torch.randint(0, 3000, (40,), generator=g)
    top_k = lk.Sampling(temperature=0.7, top_k=50)
    put("full_kl", lk.full_kl(z, ref), z)
    put("full_kl_top_k", lk.full_kl(z, ref, sampling=top_k), z)
    put("token_logprobs", lk.token_logprobs(z, tokens), z)
    put("token_logprobs_top_k", lk.token_logprobs(z, z.detach().argmax(-1), sampling=top_k), z)
    put("token_entropy", lk.token_entropy(z), z)
    put("token_entropy_top_k", lk.token_entropy(z, sampling=top_k), z)
    hid = torch.randn(6, 20, 32, generator=g).requires_grad_()
    w = (torch.randn(500, 32, generator=g) * 0.3).requires_grad_()
    b = torch.randn(500, generator=g).requires_grad_()
    ids = torch.randint(0, 500, (6, 20), generator=g)
    put("from_hidden", lk.token_logprobs(lk.FromHidden(hid, w, b), ids), hid, w, b)
    put("from_hidden_top_k", lk.token_logprobs(lk.FromHidden(hid, w, b), ids, sampling=lk.Sampling(top_k=400), outside="-inf"), hid, w, b)
    put("from_hidden_entropy", lk.token_entropy(lk.FromHidden(hid, w, b, softcap=30.0)), hid, w, b)

    lp = (-torch.rand(300, 400, generator=g, dtype=F64)).requires_grad_()  # 120,000 values: past the grain size
    ref_lp = -torch.rand(300, 400, generator=g, dtype=F64)
    mask = torch.rand(300, 400, generator=g) > 0.1
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"):
        put(f"loss_{agg}", lk.KLPenaltyLoss("k3+", coef=0.1, agg=agg)(lp, ref_lp, mask), lp)
    put("loss_sequence", lk.KLPenaltyLoss("k3", coef=0.1, level="sequence", agg="seq-mean-token-sum")(lp, ref_lp, mask), lp)
    lp32 = lp.detach().float().requires_grad_()
    for name in ("k1", "k2", "k3", "k3+", "k1+"):
        put(f"kl_penalty_{name}", lk.kl_penalty(lp32, ref_lp.float(), name), lp32)
    metric = lk.KLMetric()
    metric(lk.kl_penalty(lp.detach(), ref_lp, "k3"), mask)
    put("kl_metric", metric.compute())
    ent = torch.rand(300, 400, generator=g, dtype=F64)
    put("high_entropy_mask", lk.high_entropy_mask(ent, mask, top=0.2))
    bonus = lk.EntropyBonus(coef=lk.TargetEntropyController(0.5, 0.01))
    bonus(entropy=ent, mask=mask)
    coef, h = bonus.update_coef()
    put("bonus_step", torch.stack([coef, h, bonus.controller.value_tensor()]))
    correction = lk.RolloutCorrection(weights="token", upper=2.0, batch_normalize=True, rejection="token_k2", rejection_threshold=3.0)
    result = correction(lp.detach(), ref_lp, mask)
    put("correction_weights", result.weights)
    put("correction_mask", result.mask)
    out["correction_metrics"] = [torch.stack([result.metrics[k].to(F64) for k in sorted(result.metrics)])]
    torch.save(out, out_path)


if __name__ == "__main__":
    main(sys.argv[2])
