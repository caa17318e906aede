"""The faults of docs/reliability.md on GPUs with the real FlashInfer backend. Not collected by pytest.

    torchrun --nproc-per-node 2 tests/gpu/check_faults.py --case CASE --cache DIR --out DIR [--shared-gpu]

One case per launch (a fresh pair of processes each, as a restarted job would be):
  cold         compile a 2-layer TP decoder (5 sites) with the pass, Inductor's FX graph cache on
               in DIR (one directory per rank): a cache miss, the sites fused, FlashInfer runs;
  warm         the same in fresh processes: a cache hit, the pass never runs, and the op must still
               create FlashInfer's workspace at its first call (vLLM #37461: a workspace never
               created after a compile-cache load) and run the kernel;
  fail_build   FlashInfer's kernels fail to build on rank 1 only: both ranks run unfused, correct;
  low_memory   rank 1's GPU reports no free memory for the workspace: both unfused, correct, no hang
               (the ranks agree on it before anyone allocates);
  fail_create  FlashInfer's workspace creation raises at its start on rank 1 only. It HUNG on an
               H100 (both ranks on it): rank 0 waited in the creation's handle exchange for rank 1.
               Expected now: rank 0 gives up after WORKSPACE_EXCHANGE_TIMEOUT_S (60 s) and both
               run unfused, correct; not yet run on GPUs, so not in device_run.sh's default list
               (FAULT_CASES=fail_create). The realistic cause, a rank without memory for it, is
               caught before (low_memory).
The tests/test_faults.py and tests/test_flashinfer_backend.py CPU tests cover the same paths with
a stand-in; this runs the real library. Writes DIR/CASE/rank<r>.json; exits non-zero if a rank's
result is wrong or not dispatched as expected.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import shared_gpu  # tests/gpu/shared_gpu.py (the script's own directory is on sys.path)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.fault_cases import Recorder, compare, counters, fresh_counts, stats  # noqa: E402
from tests.models import TinyDecoder  # noqa: E402

import arfusion  # noqa: E402

SITES = 5  # TinyDecoder(layers=2): the embedding's site and two per layer
EXPECTED_DISPATCH = {"cold": "flashinfer", "warm": "flashinfer", "fail_build": "fallback", "low_memory": "fallback",
                     "fail_create": "fallback"}


def inject(case: str, rank: int) -> None:
    """Make FlashInfer fail on rank 1 the way a broken install or a failed allocation would."""
    if rank != 1 or case not in ("fail_build", "low_memory", "fail_create"):
        return

    def fail(*args, **kwargs):
        raise RuntimeError(f"injected by check_faults.py ({case})")

    if case == "low_memory":
        from arfusion.backends import flashinfer as fi
        fi._free_device_bytes = lambda device: 0
    elif case == "fail_build":
        importlib.import_module("flashinfer.comm.trtllm_ar").get_trtllm_comm_module = fail
    else:
        importlib.import_module("flashinfer.comm").create_allreduce_fusion_workspace = fail


def problems_of(case: str, result: dict) -> list[str]:
    found = [] if result.get("ok") else [f"wrong or failed: {result.get('error') or result.get('problems')}"]
    s, c = result.get("stats", {}), result.get("counters", {})
    if s.get("fused_sites") != SITES:
        found.append(f"expected {SITES} fused sites, stats say {s.get('fused_sites')}")
    if set(s.get("dispatch", {})) != {EXPECTED_DISPATCH[case]}:
        found.append(f"expected every call dispatched to {EXPECTED_DISPATCH[case]}, got {s.get('dispatch')}")
    if case == "cold" and not c.get("fxgraph_cache_miss"):
        found.append(f"the cold round did not miss the cache: {c}")
    if case == "warm" and (not c.get("fxgraph_cache_hit") or s.get("graphs")):
        found.append(f"the warm round did not come from the cache: {c}, graphs {s.get('graphs')}")
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", required=True, choices=sorted(EXPECTED_DISPATCH))
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--shared-gpu", action="store_true", help="every rank on GPU 0, gloo (a one-GPU machine)")
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()
    device = shared_gpu.init(args.shared_gpu, hang_s=float(os.environ.get("CHECK_HANG_S", 300)))
    rank = dist.get_rank()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.cache, f"rank{rank}")
    inject(args.case, rank)
    torch.manual_seed(0)  # the same weights on every rank
    model = TinyDecoder(args.hidden, layers=2).to(device)
    torch.manual_seed(100 + rank)  # different activations per rank: the all-reduce matters
    x = torch.randn(1, 8, args.hidden, dtype=torch.bfloat16, device=device)
    options = arfusion.inductor_options(arfusion.PassConfig(enable_allreduce_fusion=True, backend="flashinfer"))

    def case():
        fresh_counts()
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=args.case in ("cold", "warm")):
            expected = model(x)
            actual = torch.compile(model, options=options)(x)
        torch.cuda.synchronize()
        return {**compare(actual, expected), "stats": stats(), "counters": counters()}

    rec = Recorder(str(Path(args.out, args.case)), rank)
    Path(args.out, args.case).mkdir(parents=True, exist_ok=True)
    result = rec.run(args.case, case)
    mine = problems_of(args.case, result)
    rec.record("problems", mine)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        for r, found in enumerate(everyone):
            verdict = "; ".join(found) if found else "as expected"
            print(f"{args.case} rank {r}: {verdict}", flush=True)
        print(f"{args.case} rank 0: err {result.get('err')}, stats {result.get('stats')}, "
              f"counters {result.get('counters')}, {result.get('seconds')} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(everyone) else 0


if __name__ == "__main__":
    sys.exit(main())
