"""Lightning's entry point for lightning-kl (``lightning.pytorch.callbacks_factory``), kept out of the package.

Lightning loads this module and calls :func:`callbacks_factory` for every ``Trainer`` of the environment, also
in programs that never use lightning-kl. So it imports nothing of the package by itself: it adds a
``KLLossCallback`` only when the program has loaded ``lightning_kl.loss`` (``import lightning_kl`` does), and
else returns ``[]`` (Lightning then logs nothing). It never raises: a failure becomes one warning, and the
Trainer is built without the callback.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

__all__ = ["callbacks_factory"]

_warned = [False]


def callbacks_factory() -> list[Any]:
    """``[KLLossCallback()]`` when ``lightning_kl.loss`` has been imported, else ``[]``; never raises."""
    try:
        if "lightning_kl.loss" not in sys.modules:
            return []  # the program uses no KLPenaltyLoss: nothing to attach
        from lightning_kl.callbacks.kl_loss import KLLossCallback

        return [KLLossCallback()]
    except Exception as err:  # the entry point of one package must not break every Trainer
        if not _warned[0]:
            _warned[0] = True
            warnings.warn(
                f"lightning-kl's entry point could not add KLLossCallback ({type(err).__name__}: {err}); the Trainer "
                "is built without it. Add `lightning_kl.KLLossCallback()` to `Trainer(callbacks=...)` by hand.",
                RuntimeWarning,
                stacklevel=2,
            )
        return []
