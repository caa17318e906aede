"""A fake world whose all-reduces pay a real backend's host path: bench_hf_decode.py --fake-world N
--nccl-host-path.

torch's fake process group returns every collective at once: in a one-GPU stand-in of TP=N, the
unfused all-reduces of "off" then cost the host next to nothing, while the pass's op runs its
whole host path (one H200, 2026-11-29: the fake group's all-reduce and wait 36 us a site under
torch's profiler, machine U; Inductor's all-reduce on NCCL 48-51 us in the site probe, machine T;
docs/history/2026-11-29-default-mode-stand-in.md). Here rank 0 of N keeps the fake group for
everything but all-reduce, which runs on a group of one rank of a real backend (NCCL on a GPU):
its host path whole (work object, events, the kernel launch) and a kernel that reduces over one
rank. Numbers stay wrong, as with the fake
group alone; what "off" pays the host per all-reduce is what a real rank pays, plus the hop
through Python to get there (3 us a call on the CPU machine, torch 2.13: the functional all-reduce
and its wait cost 7.0 us on the fake group, 10.1 with this hop to a fake group of one). Every
other collective reaches the fake group, registered as this group's backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    FakeProcessGroup,
    _register_process_group,
    _resolve_process_group,
)

BACKEND = "fake_allreduce_on_one"  # the c10d backend name init_world registers


class AllReduceOnOne(dist.ProcessGroup):
    """Rank `rank` of `world`: all_reduce (and its coalesced form) on `one`, a group of one rank;
    every other collective on torch's fake group of `world`."""

    def __init__(self, rank: int, world: int, one: dist.ProcessGroup):
        super().__init__(rank, world)
        self._one, self._fake = one, FakeProcessGroup._create_internal(rank, world)
        for device in ("cpu", "cuda"):  # what reaches a group's backend directly meets the fake one
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, self._fake)
        self._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)  # torch 2.15 asks for it at init
        self.all_reduces = 0

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:  # a Python group's name lives in torch's registry only
        return dist.distributed_c10d._world.pg_names[self]

    def allreduce(self, *args, **kwargs):
        self.all_reduces += 1
        return self._one.allreduce(*args, **kwargs)

    def allreduce_coalesced(self, *args, **kwargs):
        self.all_reduces += 1
        return self._one.allreduce_coalesced(*args, **kwargs)


def init_world(world: int, backend: str) -> AllReduceOnOne:
    """The default group: rank 0 of `world`, all-reduces on a one-rank group of `backend`
    ("nccl" on a GPU, "gloo" for tests on a CPU)."""
    one = (dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo)(dist.HashStore(), 0, 1)
    made: list[AllReduceOnOne] = []

    def create(opts, backend_opts):
        made.append(AllReduceOnOne(opts.group_rank, opts.group_size, one))
        return made[-1]

    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(BACKEND, store=FakeStore(), rank=0, world_size=world)
    group = made[-1]
    try:  # compiled graphs name their group; torch registers a Python group under it only in some versions
        _resolve_process_group(group.group_name)
    except (RuntimeError, ValueError):
        _register_process_group(group.group_name, group)
    return group
