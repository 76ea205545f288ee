r"""One vector-math call in the importing thread, at import: oneMKL's first-call race settled before any thread runs.

The oneMKL in torch's CPU wheels serves ``exp``, ``log`` and their kin on float tensors through its
vector-math library, which picks its kernels for the CPU at the process's first such call and keeps
the choice in a static variable: it stores the raw CPU id there first and the mapped kernel index a
few instructions later. A thread that calls a vector-math function in between reads the raw id and
runs another kernel for that call; on Intel AVX-512 hosts that is the low-accuracy ``exp`` (about
3e-9 relative). Two threads make that first call together whenever a process starts with parallel
work: torch's own OpenMP threads on a large input (or a user's own threads); a fresh process
and every spawned worker start over. Traced in this package as a full KL up to 3e-10 off the float64
formula in about 1 fresh process of 4; nothing in the package itself is racy.

:func:`settle_vector_math` makes that first call here, once, in the thread that imports the package,
on a one-element tensor (below torch's grain, so it runs inline with no OpenMP region): every later
call, on any thread, finds the choice made: torch's OpenMP threads, a user's threads, and the chunk
runner's workers (:mod:`lightning_kl.ground.chunks`), which start at the first chunked call, after the
import. A forked child inherits it. On a torch without oneMKL the
call is a plain one-element ``exp`` and costs nothing. ``tests/test_vector_math.py`` reads oneMKL's
variable in a fresh process to check that the import sets it.
"""

from __future__ import annotations

import torch

__all__ = ["settle_vector_math"]


def settle_vector_math() -> None:
    """One vector-math call (``exp`` of a one-element float64 tensor) in the calling thread."""
    torch.ones(1, dtype=torch.float64).exp_()
