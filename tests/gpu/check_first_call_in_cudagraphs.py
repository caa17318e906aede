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
from torch import nn
from torch._dynamo.utils import counters

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # check_flashinfer; tests.models
import check_flashinfer as cf  # noqa: E402

import arfusion  # noqa: E402
from tests.models import RowParallelThenNorm  # noqa: E402

HIDDEN, TOKENS, CALLS = 4096, 8, 6


class TwoSites(nn.Module):
    def __init__(self):
        super().__init__()
        self.with_residual = RowParallelThenNorm(HIDDEN, residual="first")
        self.without = RowParallelThenNorm(HIDDEN, residual="none", sum_unused=True)

    def forward(self, x, residual):
        normed, h = self.with_residual(x, residual)
        return self.without(normed, h), h


def main() -> None:
    rank, world, device = cf.start_distributed(recompile_limit=8)
    checks = cf.Checks(rank)
    torch.manual_seed(0)
    model = TwoSites().to(device)
    arfusion.enable(arfusion.PassConfig(enable_allreduce_fusion=True, backend="flashinfer"))
    compiled = torch.compile(model, mode="reduce-overhead")
    worst, failure = 0.0, None
    try:
        with torch.no_grad():
            for i in range(CALLS):
                torch.manual_seed(100 * i + rank)
                x = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
                res = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
                got = [t.clone() for t in compiled(x, res)]
                want = model(x, res)
                for g, w in zip(got, want):
                    worst = max(worst, ((g.float() - w.float()).norm() / w.float().norm()).item())
    except Exception as e:  # the same on every rank
        failure = f"{type(e).__name__}: {str(e)[:400]}"
    s, skips = arfusion.stats(), counters["inductor"]["cudagraph_skips"]
    ok = (failure is None and worst < 2e-2 and s["fused_sites"] == 2 and s["dispatch"].get("flashinfer", 0) > 0
          and "fallback" not in s["dispatch"] and skips == 0)
    checks.record("first fused call inside reduce-overhead", ok,
                  f"worst rel {worst:.2e}, stats {s}, cudagraph skips {skips}, error {failure}")
    # The FlashInfer workspace is left to the exit hook, as in a user's script.
    cf.finish(checks, device, world, "FIRST CALL IN CUDAGRAPHS", "gpu_first_call")


if __name__ == "__main__":
    main()
