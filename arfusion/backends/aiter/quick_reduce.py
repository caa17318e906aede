"""aiter's quick all-reduce ("quickreduce": `aiter.init_custom_qr` / `qr_all_reduce`, FP8, INT6 or
INT4 payload): what the installed aiter offers, its settings, and its collective set-up.

Opt-in (`PassConfig(quantized_allreduce=...)`), one per group, set up collectively on the first
eager call that wants it; the fused op then runs the compiled add + RMSNorm (+ quant) after it.
Call `quick_reduce_api` only after `detection.detect` accepted the GPU (that is what makes
importing aiter safe). Tests stand in for the other ranks by replacing `_rank_and_size`,
`_gather_ints` and `_all_agree` in this module.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...runtime import hash63, log_once
# A module name of its own, so tests can stand in for the collective.
from ...runtime import all_ranks_agree as _all_agree
from . import communicator
from .limits import (LIMITS, MIB, QUICK_REDUCE_CAST_ENV, QUICK_REDUCE_MAX_SIZE_ENV, QUICK_REDUCE_MODULE,
                     QUICK_REDUCE_OPS, QUICK_REDUCE_REGIMES)

log = logging.getLogger("arfusion")


@dataclass(frozen=True)
class QuickReduceApi:
    """The installed aiter's quick all-reduce, read once.

    Handle exchange (IPC handles of each rank's buffer, over a non-NCCL group):
    * "helper": ROCm/aiter main has `qr_exchange_handles(ptr, world_size, group)` in the
      communicator module (`qr_get_handle(fa, out_ptr)` / `qr_open_handles(fa, handle_ptrs)`
      take raw host pointers there), and arfusion calls it;
    * "tensors": amd-aiter 0.1.7 has `qr_get_handle(fa) -> Tensor` and
      `qr_open_handles(fa, handles: list[Tensor])` with `dist.all_gather_object` in between.
    """

    ops: Any  # the `aiter` module: init_custom_qr, qr_all_reduce, ...
    module: Any  # aiter.dist.device_communicators.quick_all_reduce
    levels: dict  # arfusion level -> QuickReduceRegime value, read by member name
    exchange: str  # "helper" or "tensors"


def _positional_params(fn: Any) -> list[str] | None:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


@functools.cache
def quick_reduce_api() -> QuickReduceApi | str:
    """The quick all-reduce of the installed aiter, or why there is none. Call only after
    `detect` accepted the GPU (that is what makes importing aiter safe)."""
    try:
        ops = importlib.import_module("aiter")
    except Exception as e:  # a broken install raises anything
        return f"import aiter failed: {type(e).__name__}: {e}"
    missing = [name for name in QUICK_REDUCE_OPS if not callable(getattr(ops, name, None))]
    if missing:
        return f"this aiter has no quick all-reduce ({', '.join(missing)} missing)"
    try:
        module = importlib.import_module(QUICK_REDUCE_MODULE)
    except Exception as e:
        return f"aiter's quick all-reduce module did not import: {type(e).__name__}: {e}"
    regime = getattr(module, "QuickReduceRegime", None)
    levels = {}
    for level, member in QUICK_REDUCE_REGIMES.items():
        value = getattr(getattr(regime, "__members__", {}).get(member), "value", None)
        if isinstance(value, int) and not isinstance(value, bool):
            levels[level] = value
    if callable(getattr(module, "qr_exchange_handles", None)):
        exchange = "helper"
    elif _positional_params(ops.qr_get_handle) in (["fa"], None):
        exchange = "tensors"
    else:
        return (f"unknown quick all-reduce handle exchange: qr_get_handle takes "
                f"{_positional_params(ops.qr_get_handle)} and {QUICK_REDUCE_MODULE} has no qr_exchange_handles")
    return QuickReduceApi(ops=ops, module=module, levels=levels, exchange=exchange)


@dataclass(frozen=True)
class QuickReduceEnv:
    """aiter's own QuickAllReduce settings, from its environment variables (same on every rank)."""

    cast_bf16: bool  # qr_all_reduce's cast_bf2half: bf16 input runs the fp16 kernels
    max_bytes: int  # largest message, inclusive
    qr_max_size: int | None  # what init_custom_qr gets: None is aiter's default (2 GiB)


def quick_reduce_env() -> QuickReduceEnv | str:
    """Read like aiter's QuickAllReduce.init_quick_all_reduce does (int(), same defaults)."""
    try:
        cast = int(os.environ.get(QUICK_REDUCE_CAST_ENV, "1"))
    except ValueError:
        return f"{QUICK_REDUCE_CAST_ENV}={os.environ[QUICK_REDUCE_CAST_ENV]!r} is not an integer"
    try:
        max_mib = int(os.environ.get(QUICK_REDUCE_MAX_SIZE_ENV, "0"))
    except ValueError:
        return f"{QUICK_REDUCE_MAX_SIZE_ENV}={os.environ[QUICK_REDUCE_MAX_SIZE_ENV]!r} is not an integer"
    if max_mib > 0:
        return QuickReduceEnv(cast_bf16=bool(cast), max_bytes=max_mib * MIB, qr_max_size=max_mib * MIB)
    return QuickReduceEnv(cast_bf16=bool(cast), max_bytes=LIMITS.quick_reduce_default_max_bytes, qr_max_size=None)


def quick_reduce_kernel_dtype(dtype: torch.dtype, env: QuickReduceEnv) -> torch.dtype:
    """The dtype aiter's kernel computes in (the key of its threshold table)."""
    return torch.float16 if dtype == torch.float16 or env.cast_bf16 else dtype


@dataclass
class QuickReduceGroup:
    """The quick all-reduce of one process group."""

    ptr: int | None = None  # aiter's DeviceComms, set up and with every peer's buffer open
    destroy: Any = None  # aiter.qr_destroy, kept so close() needs no import
    failed: str | None = None  # the same on every rank of the group; never retried


# Collectives of the set-up, over the group's gloo twin (CPU tensors). Small functions, so the
# tests can stand in for the other ranks.


def _rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _gather_ints(values: list[int], group) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [row.tolist() for row in rows]


def _open_peer_buffers(api: QuickReduceApi, ptr: int, handle: Any, world_size: int, group) -> None:
    """The collective part of the handle exchange (every rank calls it, or none does)."""
    if api.exchange == "helper":
        api.module.qr_exchange_handles(ptr, world_size, group)
        return
    handles = [None] * world_size
    dist.all_gather_object(handles, handle, group=group)
    api.ops.qr_open_handles(ptr, handles)


def set_up_quick_reduce(state: QuickReduceGroup, group_name: str, world_size: int) -> str | None:
    """Collective over the group (its gloo twin); every rank returns a verdict of the same kind
    (None, or a failure that all ranks record), so no rank waits in a kernel or a collective
    its peers never enter:

    1. each rank checks what it can alone (aiter's quick all-reduce, its settings) and all
       ranks compare that and their host: a group spanning nodes has no HIP IPC;
    2. init_custom_qr (allocates 2 x qr_max_size of uncached device memory; on 0.1.7 the IPC
       handle is read here too, so nothing local can fail inside step 3's collective), agreed;
    3. the handle exchange (a collective), then each rank opens its peers' buffers, agreed.

    A communicator that failed after step 2 is left allocated: aiter's qr_destroy closes the
    peers' IPC handles, which were never opened. One that completed step 3 on a rank whose
    peer failed there is freed with qr_destroy, as aiter's own close() does.
    """
    started = time.perf_counter()
    try:
        group = communicator.gloo_twin(communicator.resolve(group_name))
        rank, size = _rank_and_size(group)
    except Exception as e:
        state.failed = f"aiter quick all-reduce set-up failed: {type(e).__name__}: {e}"
        return state.failed
    api, env = quick_reduce_api(), quick_reduce_env()
    local = api if isinstance(api, str) else env if isinstance(env, str) else None
    if local is None and size != world_size:
        local = f"the group's gloo twin has {size} ranks, not {world_size}"
    rows = _gather_ints([0 if local else 1, hash63(socket.gethostname())], group)
    if local or any(row[0] == 0 for row in rows):
        state.failed = local or "aiter's quick all-reduce is unavailable on another rank of the group (see its log)"
        return state.failed
    if len({row[1] for row in rows}) > 1:
        state.failed = "the group spans nodes: aiter's quick all-reduce exchanges HIP IPC handles, one node only"
        return state.failed

    ptr = handle = error = None
    try:
        ptr = api.ops.init_custom_qr(rank, size, env.qr_max_size)
        if api.exchange == "tensors":
            handle = api.ops.qr_get_handle(ptr)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    if not _all_agree(error is None, group):
        state.failed = f"aiter init_custom_qr failed: {error or 'on another rank of the group'}"
        if ptr is not None:
            log_once(f"arfusion: aiter quick all-reduce of group {group_name} left allocated after a failed set-up")
        return state.failed

    try:
        _open_peer_buffers(api, ptr, handle, size, group)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    if not _all_agree(error is None, group):
        state.failed = f"aiter quick all-reduce handle exchange failed: {error or 'on another rank of the group'}"
        if error is None:
            try:
                api.ops.qr_destroy(ptr)
            except Exception:
                pass
        else:
            log_once(f"arfusion: aiter quick all-reduce of group {group_name} left allocated after a failed set-up")
        return state.failed

    state.ptr, state.destroy = ptr, api.ops.qr_destroy
    log.info("arfusion: aiter quick all-reduce for group %s (world %d) ready in %.1fs (messages up to %d MiB, "
             "%s handle exchange)", group_name, size, time.perf_counter() - started, env.max_bytes // MIB,
             api.exchange)
    return None
