"""Distillation: the other side of a divergence given as a served teacher's top-k log-probs (:mod:`.topk`)."""

from lightning_kl.distill.topk import TopK, topk_divergence

__all__ = ["TopK", "topk_divergence"]
