"""Process groups as rows name them: "world", or "ranks0-2-4" (the members' global ranks), cached."""

from __future__ import annotations

from typing import Any

_CACHE: dict[int, tuple[Any, str, tuple[int, ...]]] = {}


def _label(ranks: tuple[int, ...], world: int) -> str:
    if ranks == tuple(range(world)):
        return "world"
    return "ranks" + "-".join(map(str, ranks))


def describe(group: Any) -> tuple[str, tuple[int, ...]]:
    """(label, global ranks) of a c10d group argument (None: the default group) or a functional
    collective's group (a ProcessGroup, a list of ranks, a DeviceMesh, (mesh, dim), or a group name)."""
    import torch.distributed as dist

    if isinstance(group, (list, tuple)) and group and all(isinstance(r, int) for r in group):
        ranks = tuple(group)
        return _label(ranks, dist.get_world_size()), ranks
    pg = _process_group(group)
    hit = _CACHE.get(id(pg))
    if hit is not None and hit[0] is pg:
        return hit[1], hit[2]
    ranks = tuple(dist.get_process_group_ranks(pg))
    label = _label(ranks, dist.get_world_size())
    _CACHE[id(pg)] = (pg, label, ranks)  # keeps the group alive: groups are few and long-lived
    return label, ranks


def _process_group(group: Any) -> Any:
    import torch.distributed as dist

    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, str):
        from torch.distributed import distributed_c10d as c10d

        return c10d._resolve_process_group(group)
    if isinstance(group, tuple) and len(group) == 2:
        mesh, dim = group
        return mesh.get_group(dim)
    get_group = getattr(group, "get_group", None)  # a 1-D DeviceMesh
    if get_group is not None:
        return get_group()
    raise TypeError(f"unknown process group argument {type(group).__name__}")
