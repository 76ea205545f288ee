r"""The Trainer that runs a module: found from the ``LightningModule`` whose hook calls it.

An ``nn.Module`` inside a ``LightningModule`` has no link to its parent, so a loss cannot read
``self.trainer`` as the ``LightningModule`` does. But it is called from the ``LightningModule``'s
``training_step`` (or a method it calls): :class:`TrainerLookup` finds that module among the callers'
``self`` (a few frames up the stack, read once per caller and cached) and returns its Trainer. Nothing is
found outside a Trainer, where the caller then passes what it needs explicitly.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Optional

import lightning.pytorch as pl

__all__ = ["TrainerLookup"]

# forward <- Module._call_impl <- Module._wrapped_call_impl <- training_step: 3 frames for a direct
# attribute of the LightningModule, 3 more for each plain nn.Module in between
_DEPTH = 16


class TrainerLookup:
    """Remembers the ``LightningModule`` that called its owner; ``trainer()`` is that module's Trainer.

    The stack is read (at most ``16`` frames up) until a caller's ``self`` is a ``LightningModule``
    attached to a Trainer; that module is then kept (by a weak reference) and asked directly on later
    calls.
    """

    def __init__(self) -> None:
        self._module: Optional[weakref.ReferenceType[pl.LightningModule]] = None

    def trainer(self) -> Optional[Any]:
        """The Trainer running the caller's ``LightningModule``, or None outside one."""
        module = self._module() if self._module is not None else None
        if module is None:
            module = _calling_lightning_module(sys._getframe(2))
            if module is None:
                return None
            self._module = weakref.ref(module)
        return _trainer_of(module)

    def __getstate__(self) -> dict[str, Any]:
        return {"_module": None}  # a weak reference does not pickle (nor deep-copy into another run)

    def __deepcopy__(self, memo: dict[int, Any]) -> "TrainerLookup":
        return TrainerLookup()


def _calling_lightning_module(frame: Any) -> Optional[pl.LightningModule]:
    for _ in range(_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, pl.LightningModule) and _trainer_of(owner) is not None:
            return owner
        frame = frame.f_back
    return None


def _trainer_of(module: pl.LightningModule) -> Optional[Any]:
    try:
        return module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None
