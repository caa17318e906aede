"""World 2 on a one-GPU machine: every rank on GPU 0, a gloo group (NCCL refuses two ranks on one
GPU). Used by the GPU scripts' `--shared-gpu` mode when no two-GPU machine is lent.

What it shows: what FlashInfer's world-2 kernels compute and whether arfusion's set-up, dispatch
and fallbacks work on a real GPU. FlashInfer's IPC workspace maps the other process's buffers on
the same device and its kernels wait for the other rank's writes, which arrive when the GPU
switches to that process, so the NRanks=2 kernels compute what they compute on two GPUs. What it
does not show: speed (the ranks take turns), NCCL, or a gloo collective inside a CUDA graph (gloo
cannot be captured, so a run-time fallback to the plain all-reduce must not happen under capture).
"""

from __future__ import annotations

import faulthandler
import os

import torch
import torch.distributed as dist


def lift_shared_gpu_guard() -> None:
    """Give each rank its own device id in the facts the FlashInfer backend gathers, so its "two
    ranks share one GPU" verdict (right for real jobs: such a group is a misconfiguration) does
    not decline the group. Test scripts only."""
    from arfusion.backends import flashinfer as fi

    real = fi._rank_facts

    def per_rank(index):
        host, uuid, *rest = real(index)
        return [host, uuid + 1 + dist.get_rank(), *rest]

    fi._rank_facts = per_rank


_host_gather_library = None


def route_all_gather_through_host(dispatch_key: str = "CUDA") -> None:
    """gloo's all_gather_into_tensor on CUDA tensors segfaults (torch 2.11, seen in DTensor's
    Shard -> Replicate of a TP lm_head's output): run the functional all-gather on host copies.
    Test scripts only; gloo's all-reduce of CUDA tensors works and is left alone."""
    global _host_gather_library
    if _host_gather_library is not None:
        return
    from torch.distributed.distributed_c10d import _resolve_process_group

    def gather(inp, group_size, group_name):
        host = inp.detach().to("cpu").contiguous()
        out = host.new_empty((host.shape[0] * group_size, *host.shape[1:]))
        dist.all_gather_into_tensor(out, host, group=_resolve_process_group(group_name))
        return out.to(inp.device)

    _host_gather_library = torch.library.Library("_c10d_functional", "IMPL")
    _host_gather_library.impl("all_gather_into_tensor", gather, dispatch_key)


def init(shared: bool, hang_s: float | None = None) -> torch.device:
    """Initialise the default group and return this rank's device.

    shared: gloo, GPU 0 for every rank, the guard lifted, and (hang_s) a watchdog that dumps every
    thread's stack and exits if the run takes longer (ranks waiting on each other's kernel
    otherwise hang until the device call's limit). Else: NCCL, GPU LOCAL_RANK.
    """
    if shared:
        os.environ["LOCAL_RANK"] = "0"  # transformers binds each rank to cuda:LOCAL_RANK
        torch.cuda.set_device(0)
        if hang_s:
            faulthandler.dump_traceback_later(hang_s, exit=True)
        dist.init_process_group("gloo")
        lift_shared_gpu_guard()
        route_all_gather_through_host()
        return torch.device("cuda", 0)
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    return device
