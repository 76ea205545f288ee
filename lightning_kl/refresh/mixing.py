r"""The maths of moving the reference: mix a model's tensors into another's, fold LoRA adapters.

Both are in place, parameter by parameter, under ``torch.no_grad``, with no collective: under data
parallelism every process holds the same policy after an optimizer step and computes the same
reference; a parameter sharded as a ``DTensor`` (FSDP2) is updated through its local shard
(``to_local()``), so no process gathers the whole model.

With ``alpha`` in ``(0, 1]`` (``1`` is a hard reset):

.. math::
    \theta_{\mathrm{ref}} \leftarrow \alpha\, \theta + (1 - \alpha)\, \theta_{\mathrm{ref}}

* :func:`mix_modules_`: a separate reference model, tensor by tensor; ``alpha = 1`` copies
  (bitwise), otherwise the mix is computed in the promoted dtype (float32 at least) and written
  back in the reference's dtype.
* :func:`fold_adapters_`: a LoRA policy whose reference is the same model with its adapters off.
  For each LoRA layer (base weight :math:`W`, adapter :math:`\Delta = s\, B A`, ``s`` the LoRA
  scaling) the policy is :math:`W + \Delta` and the reference :math:`W`. Folding a share
  :math:`\alpha` of the adapter into the base weight and keeping the rest in the adapter,

  .. math::
      W \leftarrow W + \alpha\, s\, B A, \qquad B \leftarrow (1 - \alpha)\, B,

  leaves the policy unchanged (:math:`W + \Delta`, up to the rounding of the sum) and makes the
  reference :math:`W + \alpha \Delta = \alpha\,(W + \Delta) + (1 - \alpha)\, W`: exactly the mix
  above, at the memory of one model and one adapter. ``alpha = 1`` merges the adapter and
  restarts it at ``B = 0`` (``A`` keeps its value, so ``B``'s gradient is not zero).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_kl.ground.parallel import agree

__all__ = ["check_alpha", "check_foldable", "check_mixable", "fold_adapters_", "lora_layers", "mix_", "mix_modules_"]


def check_alpha(alpha: Any) -> float:
    """``alpha`` as a float in ``(0, 1]``; else ``ValueError`` naming the value."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or not 0 < alpha <= 1:
        raise ValueError(
            f"`alpha` must be a number in (0, 1] (1.0: hard reset, reference := policy; below 1: "
            f"reference := alpha * policy + (1 - alpha) * reference), got {alpha!r}."
        )
    return float(alpha)


def _local(t: Tensor) -> Tensor:
    # a DTensor (FSDP2) is updated through this process's shard: no gather
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and hasattr(t, "placements") else t


def mix_(reference: Tensor, policy: Tensor, alpha: float) -> Tensor:
    r"""``reference := alpha * policy + (1 - alpha) * reference`` in place; returns ``reference``.

    ``alpha = 1`` copies ``policy`` (bitwise when the dtypes match). Otherwise the mix is computed in
    the promoted dtype of both, float32 at least, and written back in ``reference``'s dtype.
    ``DTensor`` arguments are mixed shard by shard (their local tensors).

    Example:
        >>> ref, pol = torch.tensor([0.0, 4.0]), torch.tensor([1.0, 0.0])
        >>> mix_(ref, pol, 0.25)
        tensor([0.2500, 3.0000])
    """
    r, p = _local(reference), _local(policy)
    if r.shape != p.shape:
        raise ValueError(f"cannot mix a policy tensor of shape {tuple(p.shape)} into a reference of shape {tuple(r.shape)}.")
    with torch.no_grad():
        if alpha == 1.0 or not r.is_floating_point():
            r.copy_(p)
        else:
            dtype = torch.promote_types(torch.promote_types(r.dtype, p.dtype), torch.float32)
            r.copy_(r.to(dtype) * (1.0 - alpha) + p.to(dtype) * alpha)
    return reference


def _reshard(*modules: nn.Module) -> None:
    # FSDP2 leaves a module that ran forward without backward (the reference, the root) unsharded:
    # its registered parameters are then full tensors. Back to the shards, where the refresh is local
    for module in modules:
        for m in module.modules():
            if callable(getattr(m, "reshard", None)) and callable(getattr(m, "unshard", None)):
                m.reshard()


def _pairs(reference: nn.Module, policy: nn.Module, buffers: bool) -> Iterator[tuple[str, Tensor, Tensor]]:
    ref = dict(reference.named_parameters())
    pol = dict(policy.named_parameters())
    if buffers:
        ref.update(reference.named_buffers())
        pol.update(policy.named_buffers())
    if ref.keys() != pol.keys():
        only_ref, only_pol = sorted(ref.keys() - pol.keys()), sorted(pol.keys() - ref.keys())
        raise ValueError(
            "the reference and the policy must have the same parameters and buffers to be mixed: "
            f"only in the reference: {only_ref[:5]}, only in the policy: {only_pol[:5]}."
        )
    for name, r in ref.items():
        yield name, r, pol[name]


def _is_sharded(t: Tensor) -> bool:
    return hasattr(t, "placements") and hasattr(t, "device_mesh")


def _mesh_ranks(t: Tensor) -> Any:
    # the global ranks of the mesh, laid out as the mesh is: which process holds which shard
    return t.device_mesh.mesh.tolist()


def _difference(name: str, r: Tensor, p: Tensor) -> Optional[str]:
    """Why ``p`` cannot be mixed into ``r`` shard by shard on this process (None: it can)."""
    if (_is_sharded(r), getattr(r, "placements", None)) != (_is_sharded(p), getattr(p, "placements", None)):
        return (
            f"`{name}` is sharded differently in the reference ({getattr(r, 'placements', 'a plain tensor')}) "
            f"and in the policy ({getattr(p, 'placements', 'a plain tensor')}): shard both models alike."
        )
    if _is_sharded(r) and _mesh_ranks(r) != _mesh_ranks(p):
        return (
            f"`{name}` is sharded over the processes {_mesh_ranks(r)} in the reference and {_mesh_ranks(p)} in "
            "the policy (the device meshes' ranks): each process would mix another process's shard into its own. "
            "Shard both models over one device mesh."
        )
    if r.shape != p.shape or _local(r).shape != _local(p).shape:
        where = "" if r.shape == p.shape else f" (whole: {tuple(r.shape)} and {tuple(p.shape)})"
        return (
            f"`{name}` has shape {tuple(_local(r).shape)} in the reference and {tuple(_local(p).shape)} in the "
            f"policy{where}."
        )
    return None


def check_mixable(reference: nn.Module, policy: nn.Module, buffers: bool = True) -> int:
    """Check that :func:`mix_modules_` can run (same names, shapes, sharding); return the tensor count.

    Sharded tensors (``DTensor``, FSDP2) must have the same placements on the same processes: the
    same device mesh ranks, not only the same local shapes, or each process would mix another
    process's shard into its own. A difference in the shards may show on some processes only (an
    uneven dimension); with sharded tensors the check is therefore agreed over every process (one
    ``all_reduce`` of a flag, :func:`lightning_kl.ground.parallel.agree`) and every process raises
    the same error. Every process must call it then, as it does at a refresh.

    Raises:
        ValueError: naming the first parameter or buffer that differs, or if ``reference is policy``.
    """
    if reference is policy:
        raise ValueError("the reference and the policy are one module: nothing to refresh (use reference=None for adapters).")
    _reshard(reference, policy)
    problem: Optional[str] = None
    try:
        pairs = list(_pairs(reference, policy, buffers))
    except ValueError as err:
        pairs, problem = [], str(err)
    sharded = any(_is_sharded(t) for m in (reference, policy) for t in m.parameters())
    for name, r, p in pairs:
        problem = problem or _difference(name, r, p)
    if sharded:
        agree(problem)
    elif problem is not None:
        raise ValueError(problem)
    return len(pairs)


def mix_modules_(reference: nn.Module, policy: nn.Module, alpha: float, buffers: bool = True) -> int:
    r"""Mix every parameter (and floating buffer) of ``policy`` into ``reference``, in place.

    Tensors are matched by name (``named_parameters`` / ``named_buffers``); a non-floating buffer
    (a counter) is copied on a hard reset and left as it is otherwise. Returns the number of
    tensors updated.

    Raises:
        ValueError: if ``alpha`` is outside ``(0, 1]`` or the two modules differ (see :func:`check_mixable`).

    Example:
        >>> ref, pol = nn.Linear(2, 1), nn.Linear(2, 1)
        >>> mix_modules_(ref, pol, 1.0), torch.equal(ref.weight, pol.weight)
        (2, True)
    """
    alpha = check_alpha(alpha)
    check_mixable(reference, policy, buffers)
    n = 0
    for _, r, p in _pairs(reference, policy, buffers):
        if r.is_floating_point() or alpha == 1.0:
            mix_(r, p, alpha)
            n += 1
    return n


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """The ``peft`` LoRA layers of ``model`` (modules with ``lora_A``, ``lora_B``, ``scaling``, ``base_layer``)."""
    return [
        m
        for m in model.modules()
        if all(hasattr(m, a) for a in ("lora_A", "lora_B", "scaling", "base_layer")) and len(m.lora_A) > 0
    ]


def _adapters(layer: nn.Module) -> list[str]:
    # the adapters that make up the policy: the active ones this layer holds
    active = getattr(layer, "active_adapters", None)
    if active is None:
        active = list(layer.lora_A.keys())
    return [a for a in ([active] if isinstance(active, str) else active) if a in layer.lora_A]


def check_foldable(model: nn.Module) -> list[nn.Module]:
    """The LoRA layers of ``model``, checked for :func:`fold_adapters_`; raise where a fold is not exact.

    Raises:
        ValueError: if ``model`` has no LoRA layer, or a layer is something a fold cannot reproduce
            exactly: DoRA or another LoRA variant, a LoRA bias, an embedding or convolution
            adapter, a quantized or non-floating base weight, an adapter merged already, or an
            adapter sharded as a ``DTensor``. The message names the layer and what to do.
    """
    layers = lora_layers(model)
    if not layers:
        raise ValueError(
            f"reference=None means 'the policy with its adapters off', but {type(model).__name__} has no peft "
            "LoRA layer (lora_A / lora_B): give the LightningModule attribute of a separate reference model."
        )
    names = {id(m): n for n, m in model.named_modules()}
    for layer in layers:
        where = names.get(id(layer), type(layer).__name__)
        base = layer.base_layer
        weight = getattr(base, "weight", None)
        problems = []
        if getattr(layer, "merged_adapters", None):
            problems.append(f"adapters {layer.merged_adapters} are merged already (unmerge them first)")
        if len(getattr(layer, "lora_embedding_A", ())) or len(getattr(layer, "lora_magnitude_vector", ())):
            problems.append("an embedding adapter or DoRA")
        for a in _adapters(layer):
            if a in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(a, False):
                problems.append(f"adapter {a!r} is a LoRA variant (DoRA, aLoRA, ...), not B @ A")
            if getattr(layer, "lora_bias", {}).get(a, False):
                problems.append(f"adapter {a!r} has a LoRA bias")
            for f in (layer.lora_A[a], layer.lora_B[a]):
                if not isinstance(f, nn.Linear) or hasattr(f.weight, "placements"):
                    problems.append(f"adapter {a!r} is not a pair of plain nn.Linear (a conv adapter, or sharded)")
                    break
        if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.dim() != 2:
            problems.append(f"its base layer {type(base).__name__} has no 2-D floating weight (quantized, or a conv)")
        elif hasattr(weight, "placements"):
            problems.append("its base weight is a DTensor (FSDP2): folding adapters into shards is not supported")
        if problems:
            raise ValueError(
                f"cannot fold the LoRA adapters of `{where}` into its base weight exactly: {'; '.join(problems)}. "
                "Refresh such a model with a separate reference model (reference='<attribute>') instead."
            )
    return layers


def fold_adapters_(model: nn.Module, alpha: float) -> int:
    r"""Fold a share ``alpha`` of each active LoRA adapter into its base weight, in place.

    For each LoRA layer and active adapter: ``W += alpha * s * (B @ A)`` (transposed for
    ``fan_in_fan_out`` layers, computed in float32 at least and written back in ``W``'s dtype),
    then ``B *= 1 - alpha`` (``B = 0`` when ``alpha = 1``). The policy (``W + s B A``) is unchanged
    up to rounding; the reference (the model with its adapters off, ``W``) becomes
    ``alpha * policy + (1 - alpha) * reference``. Returns the number of adapters folded.

    Raises:
        ValueError: if ``alpha`` is outside ``(0, 1]`` or a layer cannot be folded exactly (see
            :func:`check_foldable`).
    """
    alpha = check_alpha(alpha)
    n = 0
    with torch.no_grad():
        for layer in check_foldable(model):
            w = layer.base_layer.weight
            for a in _adapters(layer):
                b, a_ = layer.lora_B[a].weight, layer.lora_A[a].weight
                dtype = torch.promote_types(torch.promote_types(w.dtype, b.dtype), torch.float32)
                delta = (b.to(dtype) @ a_.to(dtype)) * layer.scaling[a]
                if getattr(layer, "fan_in_fan_out", False):
                    delta = delta.T
                w.copy_(w.to(dtype) + alpha * delta)
                if alpha == 1.0:
                    b.zero_()
                else:
                    b.mul_(1.0 - alpha)
                n += 1
    return n
