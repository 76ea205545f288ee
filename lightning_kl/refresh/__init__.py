"""Refreshing the reference model: the callback (:mod:`.callback`, ``ReferenceRefresh``) and the maths it applies
to the weights (:mod:`.mixing`: mixing two modules, folding LoRA adapters)."""

from lightning_kl.refresh.callback import ReferenceRefresh

__all__ = ["ReferenceRefresh"]
