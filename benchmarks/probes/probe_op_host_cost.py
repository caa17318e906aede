"""Host time of one call of arfusion's fused op, by layer, on this machine's CPU. Not collected by pytest.

    python benchmarks/probes/probe_op_host_cost.py

One process, torch's fake process group (world of 2), a decode-sized call (1 token, hidden 4096,
bf16). The backend's `run` is replaced by one that returns ready outputs, so what is timed is the
dispatch alone: the ATen dispatcher's call of the op, `execution.run_fused` (the call's route and
the backend's checks), and, for comparison, one ATen op. Outside CUDA-graph replays a compiled
graph pays this on every call: in default-mode compiles, and in steps that are not replayed.
Medians of 7 runs of 5,000 calls each.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import arfusion.ops  # noqa: E402,F401  (registers torch.ops.arfusion.*)
from arfusion import execution  # noqa: E402
from arfusion.policy import Caps  # noqa: E402


def per_call_us(fn, calls: int = 5000, runs: int = 7) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - began) / calls * 1e6)
    return statistics.median(times)


def main() -> int:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    group = dist.group.WORLD.group_name
    x, residual = torch.randn(2, 1, 4096, dtype=torch.bfloat16).unbind(0)
    weight = torch.ones(4096, dtype=torch.bfloat16)
    backend, _ = execution.resolve("torch", x.device)
    ready = [x.clone(), x.clone()]
    backend.run = lambda call, *args: ready  # the dispatch alone
    args = (x, residual, weight, 1e-5, None, group, "rms", "none", None, True, "torch")
    form = execution.form_of(residual, "rms", "none", True)
    rows = {
        "one ATen op (add)": lambda: torch.ops.aten.add.Tensor(x, residual),
        "execution.run_fused": lambda: execution.run_fused(x, residual, weight, 1e-5, group, form, None, "torch",
                                                           Caps()),
        "arfusion::fused_allreduce_rmsnorm": lambda: torch.ops.arfusion.fused_allreduce_rmsnorm.default(*args),
        "arfusion::fused_allreduce_rmsnorm_ (may overwrite x)":
            lambda: torch.ops.arfusion.fused_allreduce_rmsnorm_.default(*args),
    }
    print(f"torch {torch.__version__}; us per call (median of 7 runs of 5,000 calls)")
    for name, fn in rows.items():
        print(f"  {name}: {per_call_us(fn):.1f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
