"""The unfused all-reduce the fused op falls back to (`execution.all_reduce_on_current_stream`) on GPUs.

`torchrun --nproc-per-node 2 tests/gpu/check_fallback_all_reduce.py --out DIR [--shared-gpu]`: per
size (bf16, hidden 4096, 1 to 64 MiB per rank), the sum against an all-reduce of a copy, eagerly
and replayed from a CUDA graph with new inputs, and the input left as it was; where the caller
lets it overwrite its input (x_is_scratch), the sum in x itself. With NCCL (one GPU per rank) it
is also timed in CUDA graphs against the in-place all-reduce a model's row-parallel output gets
without the pass (`tuning.time_in_graph`, median us per call; the difference is the copy), and
so is the fallback in place (expected: the in-place time). With --shared-gpu both ranks run on
GPU 0 over gloo (what is computed, not speed). Writes DIR/fallback_all_reduce.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shared_gpu  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from arfusion import execution, tuning  # noqa: E402

HIDDEN = 4096
MIB = [1, 8, 16, 32, 64]


def check(mib: int, device: torch.device, rank: int, group_name: str, nccl: bool) -> dict:
    tokens = mib * 2**20 // (HIDDEN * 2)
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=device, generator=g)
    before = x.clone()

    def by_copy():
        y = x.clone()
        dist.all_reduce(y)
        return y

    row = {"mib": mib, "tokens": tokens}
    got, want = execution.all_reduce_on_current_stream(x, group_name), by_copy()
    row["eager_equal"] = bool(torch.equal(got, want))
    row["input_unchanged"] = bool(torch.equal(x, before))
    scratch = x.clone()  # where the op may overwrite its input (`arfusion::fused_allreduce_rmsnorm_`)
    got = execution.all_reduce_on_current_stream(scratch, group_name, x_is_scratch=True)
    row["in_place_eager_equal"] = bool(torch.equal(got, want)) and got is scratch
    row["ok"] = row["eager_equal"] and row["input_unchanged"] and row["in_place_eager_equal"]
    if not nccl:  # gloo collectives cannot be captured
        return row
    # Captured once, replayed on new inputs: the graph must read x anew and write a fresh sum.
    static_out = []
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        execution.all_reduce_on_current_stream(x, group_name)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    with torch.cuda.graph(graph):
        static_out.append(execution.all_reduce_on_current_stream(x, group_name))
    x.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    row["graph_equal"] = bool(torch.equal(static_out[0], by_copy()))
    x.mul_(2.0)
    row["ok"] = row["ok"] and row["graph_equal"] and bool(torch.equal(x, before))
    inplace = x.clone()
    row["fallback_us"] = tuning.time_in_graph(lambda: execution.all_reduce_on_current_stream(x, group_name),
                                              dist.group.WORLD, 20, 20)
    row["in_place_us"] = tuning.time_in_graph(lambda: dist.all_reduce(inplace), dist.group.WORLD, 20, 20)
    row["fallback_in_place_us"] = tuning.time_in_graph(
        lambda: execution.all_reduce_on_current_stream(inplace, group_name, x_is_scratch=True),
        dist.group.WORLD, 20, 20)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--shared-gpu", action="store_true", help="both ranks on GPU 0 over gloo")
    args = p.parse_args()
    device = shared_gpu.init(args.shared_gpu, hang_s=float(os.environ.get("CHECK_HANG_S", 0)) or None)
    rank = dist.get_rank()
    rows = [check(m, device, rank, dist.group.WORLD.group_name, nccl=not args.shared_gpu) for m in MIB]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": rank, "rows": rows, "device": torch.cuda.get_device_name(device),
                                      "torch": torch.__version__})
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "fallback_all_reduce.json").write_text(json.dumps(everyone, indent=1))
        print(json.dumps(everyone, indent=1), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(r["ok"] for e in everyone for r in e["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
