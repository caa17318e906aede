"""A fresh process whose first fused call happens inside torch.compile(mode="reduce-overhead").

    torchrun --nproc-per-node 2 tests/gpu/check_first_call_in_cudagraphs.py     # or 4

Nothing runs the fused op eagerly first, so FlashInfer's workspace (and the zero residual of a
site without one) is created during cudagraph trees' warm-up, when the current stream allocates
from the graph's private pool. Checks that this works (no "tensor(s) in the cudagraph pool not
tracked as outputs"), that every call matches eager, and that the process exits on its own.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters

import arfusion
from tests.models import RowParallelThenNorm

HIDDEN, TOKENS, CALLS = 4096, 8, 6


class TwoSites(nn.Module):
    def __init__(self):
        super().__init__()
        self.with_residual = RowParallelThenNorm(HIDDEN, residual="first")
        self.without = RowParallelThenNorm(HIDDEN, residual="none", sum_unused=True)

    def forward(self, x, residual):
        normed, h = self.with_residual(x, residual)
        return self.without(normed, h), h


def main() -> int:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    torch._inductor.config.fx_graph_cache = False
    torch.manual_seed(0)
    model = TwoSites().cuda()
    arfusion.enable(arfusion.PassConfig(enable_allreduce_fusion=True, backend="flashinfer"))
    compiled = torch.compile(model, mode="reduce-overhead")
    worst, failure = 0.0, None
    try:
        with torch.no_grad():
            for i in range(CALLS):
                torch.manual_seed(100 * i + rank)
                x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
                res = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
                got = [t.clone() for t in compiled(x, res)]
                want = model(x, res)
                for g, w in zip(got, want):
                    worst = max(worst, ((g.float() - w.float()).norm() / w.float().norm()).item())
    except Exception as e:  # the same on every rank
        failure = f"{type(e).__name__}: {str(e)[:400]}"
    s = arfusion.stats()
    ok = (failure is None and worst < 2e-2 and s["fused_sites"] == 2 and s["dispatch"].get("flashinfer", 0) > 0
          and "fallback" not in s["dispatch"] and counters["inductor"]["cudagraph_skips"] == 0)
    if rank == 0:
        print(f"FIRST CALL IN CUDAGRAPHS world={dist.get_world_size()}: {'PASS' if ok else 'FAIL'} "
              f"worst rel {worst:.2e}, stats {s}, cudagraph skips {counters['inductor']['cudagraph_skips']}, "
              f"error {failure}", flush=True)
    dist.barrier()
    dist.destroy_process_group()  # the FlashInfer workspace is freed at exit, as in a user's script
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
