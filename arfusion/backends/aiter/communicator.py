"""aiter's CustomAllreduce on the matched TP group, and the gloo twin it exchanges handles over.

Tests stand in for the process-group lookups by replacing `resolve` and `gloo_twin` in this
module: the other modules call them through it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...runtime import group_is_live
from .limits import LIMITS

_gloo_groups: dict[tuple[int, ...], Any] = {}


def resolve(group_name: str):
    """The live ProcessGroup of that name (raises RuntimeError for none)."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def resolve_or_none(group_name: str):
    """What the name resolves to now, None for no group (looked up through `resolve` at each
    call, so tests can stand in for it)."""
    try:
        return resolve(group_name)
    except RuntimeError:
        return None


def gloo_twin(group):
    """A gloo group of the same ranks: aiter exchanges IPC handles over a non-NCCL group.

    Created once per rank set, by the member ranks only (use_local_synchronization): other
    TP groups' ranks are at their own first call, with their own ranks, at the same time.
    Again after destroy_process_group, which destroys the twin with everything else.
    """
    if dist.get_backend(group) == dist.Backend.GLOO:
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _gloo_groups or not group_is_live(_gloo_groups[ranks]):
        _gloo_groups[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _gloo_groups[ranks]


def create_communicator(custom_ar: Any, group_name: str, device: torch.device) -> Any:
    """aiter's CustomAllreduce for this group, or a string saying why there is none."""
    try:
        group = gloo_twin(resolve(group_name))
        comm = custom_ar.CustomAllreduce(group, device, max_size=LIMITS.registered_buffer_bytes)
    except Exception as e:
        return f"aiter custom all-reduce set-up failed: {type(e).__name__}: {e}"
    if comm.disabled:
        return "aiter disabled its custom all-reduce for this group (multi-node or unsupported size)"
    return comm
