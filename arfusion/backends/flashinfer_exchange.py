"""FlashInfer's workspace set-up across the ranks of a group: every rank's verdict on whether the
group can use FlashInfer (same host, one GPU each, same GPU model and dispatch tables, P2P),
FlashInfer's handle exchange with an arrival check before each of its collectives, so that a
rank that failed early leaves its peers an error instead of a wait, and symmetric memory without
NVLink multicast while FlashInfer allocates."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from . import flashinfer_dispatch as dispatch

# Facts each rank contributes to the verdict, in this order.
FACTS = ("host", "device_uuid", "sm", "table")

_exchanges: dict[str, int] = {}  # workspace creations per group name: the same count on every rank

# torch's CUDA symmetric memory binds an NVLink multicast object to each buffer at its rendezvous
# wherever the GPU supports one (NVSwitch H100/H200), unless this variable is set: at every
# rendezvous each rank reads it (device_has_multicast_support, torch/csrc/distributed/c10d/symm_mem/)
# and the group makes one only if every rank may. FlashInfer rendezvous there for
# the quantized all-reduce's buffer (flashinfer/comm/quantized_allreduce.py, _get_buf; 0.7.2.post1
# and 0.7.4) and, under confidential computing, for the fusion workspace. Its kernels read and write
# the peers' buffers through their unicast pointers only: multicast buys nothing there.
NO_SYMM_MEM_MULTICAST = "TORCH_SYMM_MEM_DISABLE_MULTICAST"


@contextlib.contextmanager
def unicast_symmetric_memory():
    """NO_SYMM_MEM_MULTICAST set to "1" while FlashInfer allocates, then as it was (also on error):
    arfusion never makes an NVLink multicast object, and leaves the process's setting alone."""
    before = os.environ.get(NO_SYMM_MEM_MULTICAST)
    os.environ[NO_SYMM_MEM_MULTICAST] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NO_SYMM_MEM_MULTICAST, None)
        else:
            os.environ[NO_SYMM_MEM_MULTICAST] = before


@functools.cache
def _guarded_backend_class():
    """FlashInfer's TorchDistBackend with an arrival check before each collective (see
    dispatch.WORKSPACE_EXCHANGE_TIMEOUT_S); None where FlashInfer has no such class."""
    try:
        base = importlib.import_module("flashinfer.comm.mnnvl").TorchDistBackend
    except (ImportError, AttributeError):
        return None

    class ArrivalCheckedBackend(base):
        def __init__(self, group, prefix: str):
            super().__init__(group=group)
            self._rank, self._size = group.rank(), group.size()
            self._prefix, self._steps = prefix, 0
            self._store = dist.distributed_c10d._get_default_store()

        def _arrive(self) -> None:
            """Every rank of the group has reached this collective, or raise after the timeout
            (a peer failed before it: better an error here than a wait in the collective)."""
            self._steps += 1
            key = f"{self._prefix}/{self._steps}"
            self._store.set(f"{key}/{self._rank}", b"1")
            try:
                self._store.wait([f"{key}/{r}" for r in range(self._size)],
                                 timedelta(seconds=dispatch.WORKSPACE_EXCHANGE_TIMEOUT_S))
            except Exception as e:
                raise RuntimeError(f"a peer did not reach FlashInfer's handle exchange within "
                                   f"{dispatch.WORKSPACE_EXCHANGE_TIMEOUT_S:.0f} s (it failed before): {e}") from e

        def allgather(self, data):
            self._arrive()
            return super().allgather(data)

        def bcast(self, data, root):
            self._arrive()
            return super().bcast(data, root)

        def barrier(self):
            self._arrive()
            return super().barrier()

    return ArrivalCheckedBackend


def exchange_backend(group, group_name: str):
    cls = _guarded_backend_class()
    if cls is None:
        return None
    _exchanges[group_name] = _exchanges.get(group_name, 0) + 1
    return cls(group, f"arfusion/flashinfer-exchange/{group_name}/{_exchanges[group_name]}")


def group_verdict(local_problem: str | None, facts: list[int], group, comm_device,
                  local_gpus: dict[int, int]) -> str | None:
    """None if this rank sees no reason against using FlashInfer with this group.

    Gathers every rank's facts (a failed rank sends zeros), so the checks below see the same
    data on every rank; only the P2P query is local, and `all_ranks_agree` settles that.
    """
    mine = torch.tensor([0 if local_problem else 1, *(facts or [0] * len(FACTS))],
                        dtype=torch.int64, device=comm_device)
    rows = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(rows, mine, group=group)
    table = [row.tolist() for row in rows]
    if local_problem:
        return local_problem
    if any(row[0] == 0 for row in table):
        return "FlashInfer kernels or memory unavailable on another rank of the group"
    host, uuid, sm, tables = (set(col) for col in list(zip(*table))[1:])
    if len(host) > 1:
        return "the group spans nodes (FlashInfer's trtllm all-reduce is single-node only)"
    if len(uuid) < len(table):
        return "two ranks of the group share one GPU"
    if len(sm) > 1:
        return "the group mixes GPU models"
    if len(tables) > 1:
        return "ranks read different dispatch tables (tuned cache differs)"
    return _p2p_problem([row[2] for row in table], local_gpus)


def _p2p_problem(peer_uuid_hashes: list[int], local_by_uuid: dict[int, int]) -> str | None:
    """local_by_uuid: this process's GPUs, hash63 of the uuid -> device index."""
    me = torch.cuda.current_device() if local_by_uuid else -1
    for peer in peer_uuid_hashes:
        index = local_by_uuid.get(peer)
        if index is None:
            # The peer GPU is hidden from this process (per-rank CUDA_VISIBLE_DEVICES): workspace
            # creation maps its memory and fails cleanly if there is no path.
            continue
        if index != me and not torch.cuda.can_device_access_peer(me, index):
            return f"no P2P access between GPU {me} and GPU {index}"
    return None
