r"""The exact KL of a truncated policy against a reference, over the vocabulary, in bounded memory.

Notation: ``n`` tokens, ``V`` the vocabulary; :math:`\tilde p` the policy's processed distribution
(:mod:`lightning_kl.kernels.processing`: ``softmax(z / T)`` renormalized on its kept set :math:`K`),
:math:`z^{\mathrm{ref}}` the reference's logits. Three references (``reference=``):

* ``"unprocessed"``: :math:`q = \operatorname{softmax}(z^{\mathrm{ref}} / T)`, the whole vocabulary;
* ``"processed"``: :math:`q` = the reference's own processed distribution, the same rule (temperature,
  top-k, top-p, min-p) on its own logits, kept set :math:`K^{\mathrm{ref}}`;
* ``"policy_kept"``: :math:`q = \operatorname{softmax}(z^{\mathrm{ref}} / T)` renormalized on the
  policy's kept set :math:`K`.

.. math::
    \mathrm{KL} = \sum_{i \in K} \tilde p_i (\log \tilde p_i - \log q_i), \qquad
    \frac{\partial\,\mathrm{KL}}{\partial z_i} = \frac{[i \in K]\,\tilde p_i (\log \tilde p_i - \log q_i - \mathrm{KL})}{T}, \qquad
    \frac{\partial\,\mathrm{KL}}{\partial z^{\mathrm{ref}}_i} = \frac{q_i - \tilde p_i}{T}

(the kept sets are selections: they do not move under a small change of the logits). With
``"processed"`` the KL is ``+inf`` where the policy keeps a token that the reference removed
(:math:`\tilde p_i > 0 = q_i`): the value says so, and a backward through such a token raises
(the gradient of an infinite KL does not exist). The other two references are positive wherever
:math:`\tilde p` is, so their KL is finite.

Chunks of valid rows, as :mod:`lightning_kl.kernels.full`: the forward keeps the per-token KL, the
backward recomputes both distributions per chunk and writes that chunk of the gradients once;
masked tokens have value 0 and gradient exactly 0. On the CPU they are never read (an index list of
the valid rows); elsewhere (no host read per call, ``lightning_kl.ground.checks.host_reads``) every
row is computed and the masked ones are zeroed, NaN padding included.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_kl.ground.checks import check_values, compute_dtype, host_reads
from lightning_kl.ground.chunks import run_chunks
from lightning_kl.kernels.processing import CPU_CHUNK_ELEMENTS, CUDA_CHUNK_ELEMENTS, Processing, process_scores
from lightning_kl.kernels.rows import Rows

__all__ = ["REFERENCES", "processed_full_kl_kernel"]

#: The references a truncated policy's KL can be taken against (see the module's docstring).
REFERENCES = ("unprocessed", "processed", "policy_kept")


def processed_full_kl_kernel(
    logits: Tensor, ref_logits: Tensor, mask_flat: Optional[Tensor], proc: Processing, reference: str, chunk_size: Optional[int]
) -> Tensor:
    """Per-token ``KL(p~ || q)`` ``[...]`` of checked inputs (``mask_flat`` ``[n]`` bool or None)."""
    return _ProcessedFullKL.apply(logits, ref_logits, mask_flat, proc, reference, chunk_size)


def _log_dists(
    src: Rows, ref: Rows, idx: slice | Tensor, dtype: torch.dtype, proc: Processing, reference: str
) -> tuple[Tensor, Tensor]:
    """A chunk's ``log p~`` and ``log q`` (``-inf`` off each support), ``[c, V]`` each."""
    z = src.read(idx)[0].to(dtype) / proc.temperature
    kept = process_scores(z, proc)
    zr = ref.read(idx)[0].to(dtype) / proc.temperature
    if reference == "processed":
        zr = process_scores(zr, proc)
    elif reference == "policy_kept":
        zr = zr.masked_fill_(kept == float("-inf"), float("-inf"))
    return torch.log_softmax(kept, dim=-1), torch.log_softmax(zr, dim=-1)


def _rows(mask_flat: Optional[Tensor], n: int, chunk_size: int, device: torch.device) -> list[tuple[slice, Tensor]]:
    """Chunks of the rows to compute: the valid ones on the CPU, every row elsewhere (no host read)."""
    host = mask_flat is not None and host_reads(device)
    rows = mask_flat.nonzero().squeeze(-1) if host else torch.arange(n, device=device)
    return [(slice(s, min(s + chunk_size, rows.numel())), rows[s : s + chunk_size]) for s in range(0, rows.numel(), chunk_size)]


class _ProcessedFullKL(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        ref_logits: Tensor,
        mask_flat: Optional[Tensor],
        proc: Processing,
        reference: str,
        chunk_size: Optional[int],
    ) -> Tensor:
        src, ref = Rows(logits), Rows(ref_logits)
        dtype, device = compute_dtype(logits, ref_logits), logits.device
        n, vocab = src.x.shape[:-1].numel(), logits.shape[-1]
        if chunk_size is None:
            chunk_size = max(1, (CUDA_CHUNK_ELEMENTS if device.type != "cpu" else CPU_CHUNK_ELEMENTS) // max(vocab, 1))
        kl = torch.zeros(n, dtype=dtype, device=device)

        def work(item: tuple[slice, Tensor], state: Any) -> None:
            _, idx = item
            logp, logq = _log_dists(src, ref, idx, dtype, proc, reference)
            p = logp.exp()
            # 0 log 0 = 0 off the policy's support; p > 0 = q gives +inf
            kl[idx] = torch.sub(logp, logq, out=logq).mul_(p).masked_fill_(p == 0, 0).sum(-1)

        run_chunks(work, _rows(mask_flat, n, chunk_size, device), device)
        if mask_flat is not None:
            kl.masked_fill_(~mask_flat, 0)  # off the CPU masked rows were computed (NaN padding, say)
        ctx.save_for_backward(logits, ref_logits, mask_flat, kl)
        ctx.proc, ctx.reference, ctx.chunk_size = proc, reference, chunk_size
        return kl.view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        logits, ref_logits, mask_flat, kl = ctx.saved_tensors
        proc: Processing = ctx.proc
        need_z, need_ref = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
        g_out = grad_out.reshape(-1).to(kl.dtype)
        if mask_flat is not None:
            g_out = g_out.masked_fill(~mask_flat, 0)
        infinite = (kl == float("inf")) & (g_out != 0)
        why = (
            "(the policy keeps a token that the reference's processing removes): its gradient does not exist. "
            "Use reference='policy_kept' or 'unprocessed' to regularize, or mask those tokens"
        )
        check_values(
            infinite,
            lambda: ValueError(f"the KL against the reference's own processed distribution is +inf at {int(infinite.sum())} token(s) {why}."),
            f"the KL against the reference's own processed distribution is +inf {why}",
        )
        # off the CPU masked rows are computed too (NaN padding, say): their gradients are zeroed
        skip = None if mask_flat is None or host_reads(logits.device) else ~mask_flat
        src, ref = Rows(logits), Rows(ref_logits)
        n, vocab, device, dtype = kl.numel(), logits.shape[-1], logits.device, kl.dtype
        scale = g_out / proc.temperature
        # masked rows are never written: their gradient is exactly 0
        grad_z = torch.zeros((n, vocab), dtype=logits.dtype, device=device) if need_z else None
        grad_ref = torch.zeros((n, vocab), dtype=ref_logits.dtype, device=device) if need_ref else None

        def work(item: tuple[slice, Tensor], state: Any) -> None:
            _, idx = item
            logp, logq = _log_dists(src, ref, idx, dtype, proc, ctx.reference)
            s = scale[idx].unsqueeze(1)
            p = logp.exp()
            off = None if skip is None else skip[idx].unsqueeze(1)  # NaN padding: 0 * NaN
            if grad_ref is not None:
                gr = logq.exp().sub_(p).mul_(s)
                grad_ref[idx] = (gr if off is None else gr.masked_fill_(off, 0)).to(ref_logits.dtype)
            if grad_z is not None:
                d = logp.sub_(logq).sub_(kl[idx].unsqueeze(1)).mul_(p).masked_fill_(p == 0, 0)
                d.masked_fill_((kl[idx] == float("inf")).unsqueeze(1), 0)  # infinite rows here have s = 0
                d.mul_(s)
                grad_z[idx] = (d if off is None else d.masked_fill_(off, 0)).to(logits.dtype)

        run_chunks(work, _rows(mask_flat, n, ctx.chunk_size, device), device)
        return (
            None if grad_z is None else grad_z.view(logits.shape),
            None if grad_ref is None else grad_ref.view(ref_logits.shape),
            None,
            None,
            None,
            None,
        )
