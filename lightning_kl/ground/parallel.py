r"""The data parallel group: which processes hold different data, and how many average the gradient.

Every part that reduces across processes asks :func:`data_parallel_group` (the loss's counts under
``global_batch=True`` and its multiplier, the metric's sync, the callback's statistics), so that a
layout is read in one place. Under data parallel x tensor parallel, the ranks of one tensor
parallel group hold the *same* batch: reducing over all processes would count it once per tensor
parallel rank. The group is, in this order:

1. the one given: a ``ProcessGroup``, or a ``DeviceMesh`` (1-D: its group; N-D: its dimension named
   ``"data_parallel"``, the name Lightning's ``ModelParallelStrategy`` gives it);
2. the Lightning strategy's, when the caller has one (the callback): ``ModelParallelStrategy``'s
   ``device_mesh["data_parallel"]``; for DDP and the other strategies that replicate the data
   loader over every process, the world; one device: none;
3. otherwise, when ``torch.distributed`` is initialized: the ``"data_parallel"`` dimension of the
   device mesh that this process made (its process groups are described ``mesh_data_parallel``),
   else the world. Process groups of other sizes and no data parallel one (a layout this cannot
   read) raise an error that asks for the group.

A group given next to a layout found by 2. or 3. must agree with it (same ranks), else an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DataParallelGroup", "check_parallel_args", "data_parallel_group"]

#: The name of the data parallel dimension in Lightning's ``ModelParallelStrategy`` device mesh.
DATA_PARALLEL_DIM = "data_parallel"


@dataclass(frozen=True)
class DataParallelGroup:
    """The processes over which batches are summed and gradients averaged.

    Attributes:
        group: the process group (``None``: the default group, the world).
        size: how many processes average the gradient (1: nothing to reduce).
        source: where it was found, for messages.
    """

    group: Any
    size: int
    source: str

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over the group, in place (nothing to do for a size of 1); return it."""
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor


_SINGLE = DataParallelGroup(None, 1, "a single process")


def _is_mesh(x: object) -> bool:
    return type(x).__name__ == "DeviceMesh" and hasattr(x, "mesh_dim_names")


def check_parallel_args(process_group: object, device_mesh: object) -> None:
    """Validate the explicit data parallel arguments at construction: at most one, of the right type.

    Raises:
        TypeError: for a ``process_group`` that is not a ``ProcessGroup`` or a ``device_mesh`` that is
            not a ``DeviceMesh`` (the type named).
        ValueError: for both given, or a mesh with no dimension to take (its dimension names listed).
    """
    if process_group is not None and device_mesh is not None:
        raise ValueError("give the data parallel group as `process_group` or as `device_mesh`, not both.")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"`process_group` must be a torch.distributed ProcessGroup (the data parallel group), got "
            f"{type(process_group).__name__}."
        )
    if device_mesh is not None:
        if not _is_mesh(device_mesh):
            raise TypeError(f"`device_mesh` must be a torch DeviceMesh, got {type(device_mesh).__name__}.")
        _mesh_dim(device_mesh)


def _mesh_dim(mesh: Any) -> Any:
    """The 1-D data parallel mesh of ``mesh``: itself if 1-D, else its ``"data_parallel"`` dimension."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is not None and DATA_PARALLEL_DIM in names:
        return mesh[DATA_PARALLEL_DIM]
    raise ValueError(
        f"a {mesh.ndim}-D device mesh with dimensions {names} does not say which one holds the data parallel "
        f"replicas: give its data parallel sub-mesh (e.g. `mesh['dp']`), or name that dimension "
        f"{DATA_PARALLEL_DIM!r} (as Lightning's ModelParallelStrategy does)."
    )


def _from_mesh(mesh: Any, source: str) -> DataParallelGroup:
    dp = _mesh_dim(mesh)
    size = dp.size()
    return DataParallelGroup(dp.get_group() if size > 1 else None, size, source)


def _from_group(group: Any, source: str) -> DataParallelGroup:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{source} was given, but torch.distributed is not initialized.")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{source} does not hold this process (global rank {dist.get_rank()}).")
    size = dist.get_world_size(group)
    return DataParallelGroup(group if size > 1 else None, size, source)


def _from_strategy(strategy: Any) -> DataParallelGroup:
    world = int(getattr(strategy, "world_size", 1) or 1)
    if world <= 1:
        return _SINGLE
    name = type(strategy).__name__
    try:
        mesh = getattr(strategy, "device_mesh", None)
    except RuntimeError:  # ModelParallelStrategy before its processes start
        mesh = None
    if mesh is not None and _is_mesh(mesh):
        return _from_mesh(mesh, f"{name}'s device mesh dimension {DATA_PARALLEL_DIM!r}")
    replicas = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    if replicas.get("num_replicas", world) != world:
        raise ValueError(
            f"{name} splits the data over {replicas['num_replicas']} replicas among {world} processes, and "
            "gives no device mesh that says which processes they are: pass the data parallel `process_group` "
            "(or `device_mesh`)."
        )
    return DataParallelGroup(None, world, f"{name}: every process is a data parallel replica")


def _mesh_groups() -> tuple[list[Any], list[Any]]:
    """This process's data parallel mesh groups and its other groups smaller than the world.

    torch keeps no public list of process groups; this reads the c10d registry where it can and
    returns nothing where it cannot (then the world is taken, as before meshes existed).
    """
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if not isinstance(registry, dict):
        return [], []
    world = dist.get_world_size()
    dp, other = [], []
    for pg in list(registry):
        if pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        size = pg.size()
        if getattr(pg, "group_desc", None) == f"mesh_{DATA_PARALLEL_DIM}":
            dp.append(pg)
        elif 1 < size < world:
            other.append(pg)
    return dp, other


def _discovered() -> Optional[DataParallelGroup]:
    """The data parallel group of the device mesh this process made, if any (see the module docstring)."""
    dp, other = _mesh_groups()
    if dp:
        ranks = {tuple(dist.get_process_group_ranks(pg)) for pg in dp}
        if len(ranks) > 1:
            raise ValueError(
                f"this process belongs to several data parallel mesh groups (ranks {sorted(ranks)}): pass the "
                "data parallel `process_group` (or `device_mesh`)."
            )
        group = dp[-1]
        return DataParallelGroup(group if group.size() > 1 else None, group.size(), "the device mesh's data parallel group")
    if other:
        sizes = sorted({pg.size() for pg in other})
        raise ValueError(
            f"torch.distributed has {dist.get_world_size()} processes and process groups of size {sizes}, but no "
            f"device mesh dimension named {DATA_PARALLEL_DIM!r}: which processes hold different data is "
            "ambiguous. Pass the data parallel `process_group` (or a `device_mesh`); when every process holds "
            "its own data (DDP, hybrid-sharded FSDP), that is `torch.distributed.group.WORLD`."
        )
    return None


def _same(a: DataParallelGroup, b: DataParallelGroup) -> bool:
    if a.size != b.size:
        return False
    if a.size == 1:
        return True
    return dist.get_process_group_ranks(a.group or dist.group.WORLD) == dist.get_process_group_ranks(b.group or dist.group.WORLD)


def data_parallel_group(
    process_group: Any = None, device_mesh: Any = None, strategy: Any = None
) -> DataParallelGroup:
    """The data parallel group for this process: given, from ``strategy``, or found (module docstring).

    Args:
        process_group: the data parallel ``ProcessGroup``, or None.
        device_mesh: a ``DeviceMesh``: 1-D, or with a ``"data_parallel"`` dimension; or None.
        strategy: the Lightning strategy of the running Trainer, or None outside a Trainer.

    Returns:
        A :class:`DataParallelGroup`; size 1 outside ``torch.distributed``.

    Raises:
        ValueError: for a layout this cannot read (it asks for the group), or a group given that
            disagrees with the strategy's or the device mesh's (both named).

    Example:
        >>> data_parallel_group()  # no torch.distributed: nothing to reduce
        DataParallelGroup(group=None, size=1, source='a single process')
    """
    check_parallel_args(process_group, device_mesh)
    given: Optional[DataParallelGroup] = None
    if process_group is not None:
        given = _from_group(process_group, "the `process_group` given")
    elif device_mesh is not None:
        given = _from_mesh(device_mesh, "the `device_mesh` given")
    distributed = dist.is_available() and dist.is_initialized()
    if strategy is not None:
        found = _from_strategy(strategy)
    elif distributed:
        found = _discovered() if given is None or given.size > 1 else None
        if found is None and given is None:
            found = DataParallelGroup(None, dist.get_world_size(), "the world: no device mesh")
    else:
        found = _SINGLE if given is None else None
    if given is None:
        assert found is not None
        return found
    if found is not None and not _same(given, found):
        raise ValueError(
            f"{given.source} ({given.size} processes) does not match {found.source} ({found.size} processes): "
            "the data parallel group is the one over which the gradients are averaged."
        )
    return given
