r"""The data parallel group: which processes hold different data, and how many average the gradient.

Every part that reduces across processes asks :func:`data_parallel_group` (the loss's counts under
``global_batch=True`` and its multiplier, the metric's sync, the callback's statistics), so that a
layout is read in one place. Under data parallel x tensor parallel, the ranks of one tensor
parallel group hold the *same* batch: reducing over all processes would count it once per tensor
parallel rank. The group is the first of:

1. the one given: a ``ProcessGroup``, or a ``DeviceMesh`` (1-D: its group; N-D: its dimension named
   ``"data_parallel"``, the name Lightning's ``ModelParallelStrategy`` gives it). A group given always
   wins: nothing is discovered next to it, nor compared with it;
2. the Lightning strategy's, when the caller has one (the callback): ``ModelParallelStrategy``'s
   ``device_mesh["data_parallel"]``; for DDP and the other strategies that replicate the data
   loader over every process, the world; one device: none;
3. otherwise, when ``torch.distributed`` is initialized, found from the device meshes this process
   made (their process groups are described ``mesh_<dimension>``; every process makes a mesh, so
   every process reads the same): a ``"data_parallel"`` dimension; else, when no mesh dimension
   is model parallel (hybrid-sharded FSDP's ``("replicate", "shard")``) or there is no mesh at all,
   the world. Plain process groups of the user's (``new_group``) are not read: they say nothing
   about the data. A mesh dimension of more than one process named as model parallel (``tp``,
   ``cp``, ``pp``, ``ep``, ..., or unnamed) with no ``"data_parallel"`` one raises an error that asks for the group, on every
   process alike.

A refusal in code that runs on several processes is agreed before it is raised (:func:`agree`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_kl.ground.checks import host_reads, warn_user

__all__ = [
    "DataParallelGroup",
    "agree",
    "check_parallel_args",
    "collective_device",
    "data_parallel_group",
    "held_warnings",
    "release_warnings",
    "sum_or_refuse",
]

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


def distributed() -> bool:
    """Whether a process group is initialized (other processes may be waiting in a collective)."""
    return dist.is_available() and dist.is_initialized()


def _is_mesh(x: object) -> bool:
    return type(x).__name__ == "DeviceMesh" and hasattr(x, "mesh_dim_names")


def check_parallel_args(process_group: object, device_mesh: object) -> None:
    """Validate the explicit data parallel arguments at construction: at most one, of the right type.

    Raises:
        TypeError: for a ``process_group`` that is not a ``ProcessGroup`` or a ``device_mesh`` that is
            not a ``DeviceMesh`` (the type named).
        ValueError: for both given, a group that does not hold this process, or a mesh with no
            dimension to take (its dimension names listed).
    """
    if process_group is not None and device_mesh is not None:
        raise ValueError("give the data parallel group as `process_group` or as `device_mesh`, not both.")
    non_member = dist.GroupMember.NON_GROUP_MEMBER
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup) and process_group == non_member:
        raise ValueError(
            "the `process_group` given does not hold this process (torch.distributed.new_group returns "
            "GroupMember.NON_GROUP_MEMBER to the processes outside the group): give every process the data "
            "parallel group that holds it."
        )
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
    if not distributed():
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


def _mesh_groups() -> list[tuple[str, Any]]:
    """The device mesh dimensions this process belongs to: ``(dimension name, process group)``.

    Only groups made by a ``DeviceMesh`` are read (their description is ``mesh_<dimension>``): a mesh is
    made by every process, so every process reads the same names. Plain groups of the user's
    (``new_group``) say nothing about the data, and only their members hold them, so they are left
    out. torch keeps no public list of process groups; this reads the c10d registry where it can and
    returns nothing where it cannot (then the world is taken, as before meshes existed).
    """
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if not isinstance(registry, dict):
        return []
    found = []
    for pg in list(registry):
        if pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        desc = getattr(pg, "group_desc", None)
        if isinstance(desc, str) and desc.startswith("mesh_") and desc != "mesh_default":
            found.append((desc[len("mesh_"):], pg))
    return found


#: Words of a mesh dimension's name that say its processes hold the *same* data (model parallel).
MODEL_PARALLEL_WORDS = frozenset(
    {"tp", "tensor", "cp", "context", "pp", "pipeline", "ep", "expert", "sp", "sequence", "mp", "model"}
)


def _holds_same_data(name: str) -> bool:
    """Whether a mesh dimension named ``name`` may hold the same data on its processes (or says nothing)."""
    if re.fullmatch(r"dim_\d+", name):  # an unnamed mesh: nothing says which dimension is which
        return True
    return bool(MODEL_PARALLEL_WORDS & set(name.lower().split("_")))


def _discovered() -> Optional[DataParallelGroup]:
    """The data parallel group of the device mesh this process made, if any (see the module docstring).

    Reads only what every process holds alike (the meshes' dimensions), so every process takes the
    same decision, or raises the same error, without communicating.
    """
    dims = _mesh_groups()
    dp = [pg for name, pg in dims if name == DATA_PARALLEL_DIM]
    if dp:
        ranks = {tuple(dist.get_process_group_ranks(pg)) for pg in dp}
        if len(ranks) > 1:
            raise ValueError(
                f"this process belongs to several data parallel mesh groups (ranks {sorted(ranks)}): pass the "
                "data parallel `process_group` (or `device_mesh`)."
            )
        group = dp[-1]
        return DataParallelGroup(group if group.size() > 1 else None, group.size(), "the device mesh's data parallel group")
    # a dimension of one process shares its data with no other (Lightning's tensor_parallel of size 1)
    unread = sorted({name for name, pg in dims if _holds_same_data(name) and pg.size() > 1})
    if unread:
        raise ValueError(
            f"a device mesh has dimensions {unread} (model parallel, or unnamed) and none named "
            f"{DATA_PARALLEL_DIM!r}: which processes hold different data is ambiguous. Pass the data parallel "
            "`process_group` (or `device_mesh`); when every process holds its own data, that is "
            "`torch.distributed.group.WORLD`."
        )
    return None  # no mesh, or only data parallel dimensions (hybrid-sharded FSDP): every process is a replica


def agree(problem: Optional[str], group: Any = None, error: type = ValueError) -> None:
    """Raise ``error`` on every process of ``group`` when any of them found a ``problem``; else return.

    Each process passes its own finding (a message, or None). One ``all_reduce`` of a flag tells every
    process whether any found one; only then are the messages gathered, so that every process raises
    the same error (the first rank's message, with its rank) instead of some raising while the others
    wait in their next collective. Outside ``torch.distributed`` (or a group of one), ``problem`` is
    raised as it is. Every process of ``group`` must call it.
    """
    if not distributed() or dist.get_world_size(group) == 1:
        if problem is not None:
            raise error(problem)
        return
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, problem, group=group)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    first = next(i for i, message in enumerate(found) if message is not None)
    raise error(f"{found[first]} (found on rank {ranks[first]}; every rank raises this error)")


def collective_device(x: Any, dp: DataParallelGroup) -> torch.device:
    """Where this process's tensors for ``dp``'s collectives live, even when ``x`` is not a tensor."""
    if isinstance(x, Tensor):
        return x.device
    if dist.get_backend(dp.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_or_refuse(
    dp: DataParallelGroup, terms: Optional[Tensor], problem: Optional[str], device: torch.device, size: int, who: str
) -> Tensor:
    """Sum ``terms`` (``size`` numbers, or None where this process refused its inputs) over ``dp`` with a
    count of the processes that refused theirs (``problem``, a message, or None), in one all-reduce.

    A process that refused its inputs still meets the others in the all-reduce they are on their way
    to. Then every process raises: where values are read on the host
    (:func:`~lightning_kl.ground.checks.host_reads`) the same ``ValueError`` on each (:func:`agree`
    gathers the message); elsewhere no value is read on the host per call: the refusing process raises
    its own error (the caller re-raises it) and the others stop on a device assertion naming ``who``.
    When no process refused anything, nothing more is read than the flag (on the host where values are
    read on the host, else nowhere). Returns the summed terms.
    """
    if dp.size == 1 and terms is not None:
        return terms
    packed = torch.zeros(size + 1, dtype=torch.float64, device=device)
    if terms is not None:
        packed[:size] = terms
    packed[size] = float(problem is not None)
    dp.all_reduce_sum(packed)
    if host_reads(packed.device):
        if bool(packed[size] > 0):
            agree(problem, dp.group)  # every process raises the same error
    elif problem is None:  # (the refusing process raises its own error on return)
        torch._assert_async(packed[size] == 0, f"{who}: another data parallel process refused its inputs")
    return packed[:size]


@contextmanager
def held_warnings(hold: bool) -> Iterator[Optional[list[Any]]]:
    """Hold the warnings raised inside (record them, neither shown nor raised) when ``hold``; yield their list.

    For the code before a collective: a warning that a filter turns into an error (``-W error``) on one
    process only would raise there and leave the others waiting in the collective. Held, it travels as a
    flag in the collective (``bool(list)``), and :func:`release_warnings` issues it after, alike on every
    process. ``hold=False`` holds nothing and yields None.
    """
    if not hold:
        yield None
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # recorded, whatever the filters say (they apply at release)
        yield caught


def release_warnings(held: Optional[list[Any]], anyone: Tensor, dp: DataParallelGroup) -> None:
    """Issue the warnings :func:`held_warnings` held, after the collective that carried ``anyone``.

    ``anyone``: the sum over ``dp`` of each process's ``bool(held)``. Where values are read on the host
    (:func:`~lightning_kl.ground.checks.host_reads`), when any process held one, the warnings of every
    process are gathered (one more collective, only then) and every process issues all of them, in rank
    order, once each: a filter that makes them errors then raises on every process alike. Elsewhere
    nothing is read per call: each process issues its own. Every process of ``dp`` must call it.
    """
    if held is None:
        return
    mine = [(str(w.message), w.category) for w in held]
    if dp.size > 1 and host_reads(anyone.device):
        if not bool(anyone > 0):
            return
        everyone: list[Any] = [None] * dp.size
        dist.all_gather_object(everyone, mine, group=dp.group)
        mine = list(dict.fromkeys(item for found in everyone for item in found))
    for message, category in mine:
        warn_user(message, category)


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
        ValueError: for a layout that discovery cannot read (it asks for the group; never when a group
            is given), the same on every process.

    Example:
        >>> data_parallel_group()  # no torch.distributed: nothing to reduce
        DataParallelGroup(group=None, size=1, source='a single process')
    """
    check_parallel_args(process_group, device_mesh)
    if process_group is not None:  # an explicit group wins: nothing is discovered, nothing compared
        return _from_group(process_group, "the `process_group` given")
    if device_mesh is not None:
        return _from_mesh(device_mesh, "the `device_mesh` given")
    if strategy is not None:
        return _from_strategy(strategy)
    if not distributed():
        return _SINGLE
    found = _discovered()
    return found if found is not None else DataParallelGroup(None, dist.get_world_size(), "the world: every process is a replica")
