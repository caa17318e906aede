"""Where the 66 s of the `scaled_by_an_attribute_dynamic` awkward-input case go. Not collected by pytest.

    torchrun --nproc-per-node 2 benchmarks/probes/probe_dynamic_scale_compile.py --shared-gpu

Compiles `ScaledByAttribute` (HF Granite's `* self.residual_multiplier`, an fp32 0-d graph input
under dynamic=True) three times in one process, first call timed each time: without the pass,
with it, without it again (dynamo reset in between, FX graph cache off). If the first compile
is slow whichever comes first, the cost is Inductor's, not arfusion's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "gpu"), str(ROOT)]
import shared_gpu  # noqa: E402  (tests/gpu/shared_gpu.py)
from tests.bad_input_cases import ScaledByAttribute  # noqa: E402

import arfusion  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shared-gpu", action="store_true")
    args = p.parse_args()
    device = shared_gpu.init(args.shared_gpu, hang_s=float(os.environ.get("CHECK_HANG_S", 400)))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ScaledByAttribute(1024).to(device)
    torch.manual_seed(100 + rank)
    inputs = [torch.randn(7, 1024, dtype=torch.bfloat16, device=device) for _ in range(2)]
    with_pass = arfusion.inductor_options(arfusion.PassConfig(enable_allreduce_fusion=True, backend="flashinfer"))
    for label, options in (("plain", {}), ("pass", with_pass), ("plain again", {})):
        torch._dynamo.reset()
        arfusion.reset_stats()
        started = time.perf_counter()
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
            torch.compile(model, options=options, dynamic=True)(*inputs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        if rank == 0:
            print(f"{label}: first call {seconds:.1f} s, fused {arfusion.stats()['fused_sites']}, "
                  f"dispatch {arfusion.stats()['dispatch']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
