"""Do FlashInfer's one-shot kernels finish when two ranks share one GPU and queue several calls?

    torchrun --nproc-per-node 2 benchmarks/probes/probe_shared_gpu_queue.py

Context for check_moe_combine.py --shared-gpu, whose CUDA-graph warm-up (three calls queued
without a synchronize) hung while every eager call followed by a synchronize finished. Here the
same question for arfusion's plain fused site (FlashInfer `allreduce_fusion`, which has run in
CUDA graphs on two H200s) and for the MoE op: 1 call + sync, then 2 and 3 calls queued + sync,
each step printed; a watchdog ends the run at the first step that does not finish. If the plain
site hangs the same way, the hang is the shared GPU's (ranks time-sliced), not the MoE call's.

Then CUDA graphs of the MoE op, each replayed three times back to back: one MoE call + one plain
site (a decoder layer's order), two MoE calls, and last one MoE call alone: the order that
arfusion's two finalize workspaces leave open (FinalizeWorkspaces in
arfusion/backends/flashinfer_moe.py), expected to hang here, where a peer is always late.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist

# check_moe_combine and shared_gpu live with the GPU checks
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "gpu"))
from check_moe_combine import EPS, K, graph_of, make_inputs, moe_op  # noqa: E402
from shared_gpu import lift_shared_gpu_guard  # noqa: E402

import arfusion.ops  # noqa: E402,F401  (registers torch.ops.arfusion.*)


def plain_site(rows, scale, index, residual, weight, group_name):
    combined = arfusion.reference.moe_combine(rows, scale, index, K, True)
    return torch.ops.arfusion.fused_allreduce_rmsnorm(
        combined, residual, weight, EPS, None, group_name, "rms", "none", None, True, "flashinfer", -1)


def main():
    from arfusion.backends import flashinfer_dispatch as dispatch

    os.environ[dispatch.MOE_FINALIZE_OPT_IN_ENV] = "1"  # the kernel under test is off by default
    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    lift_shared_gpu_guard()
    rank, group_name = dist.get_rank(), dist.group.WORLD.group_name
    inputs = make_inputs(8, 2048, torch.device("cuda", 0), rank)

    def step(name, run):
        dist.barrier()
        faulthandler.dump_traceback_later(float(os.environ.get("PROBE_HANG_S", 40)), exit=True)
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        faulthandler.cancel_dump_traceback_later()
        print(f"rank {rank}: {name} finished in {(time.perf_counter() - started) * 1e3:.1f} ms", flush=True)

    def queue(fn, calls):
        for _ in range(calls):
            fn(*inputs, group_name)

    for name, fn in (("plain site", plain_site), ("moe op", moe_op)):
        for queued in (1, 1, 2, 3):
            step(f"{name}: {queued} queued call(s)", lambda: queue(fn, queued))

    def layer(*args):  # the MoE site, then the next layer's attention site
        moe_op(*args)
        return plain_site(*args)

    def captured(fn, calls):  # warm-up, capture, then three replays back to back
        graph, _ = graph_of(lambda *a: fn(*a, group_name), inputs, calls)
        for _ in range(3):
            graph.replay()

    for name, fn, calls in (("moe op + plain site", layer, 1), ("moe op", moe_op, 2), ("moe op", moe_op, 1)):
        step(f"graph of {calls} x {name}, 3 replays", lambda: captured(fn, calls))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
