"""The fast-path all-reduce (`arfusion::all_reduce`) through FlashInfer on GPUs.

`torchrun --nproc-per-node 2 tests/gpu/check_fast_all_reduce.py --out DIR [--shared-gpu]`: models
whose all-reduces are not sites, every all-reduce dispatched to FlashInfer's one-shot kAllReduce,
compiled with the pass in eager mode and under `mode="reduce-overhead"` (CUDA graphs), outputs
against the eager model:
  - a LayerNorm block (o_proj -> all-reduce -> + residual -> LayerNorm: Cohere, StarCoder2, Phi);
  - a DeepSeek-V4-shaped hyper-connection post-mix (the all-reduced value spread over 4 residual
    streams with per-token weights, mixed, then RMSNorm);
  - an RMSNorm site whose eps is a 0-d GPU buffer (it fuses; the op reads eps once).
With --shared-gpu both ranks run on GPU 0 over gloo (tests/gpu/shared_gpu.py); without it, NCCL,
one GPU per rank. Writes DIR/fast_all_reduce.json (one entry per rank).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shared_gpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import arfusion  # noqa: E402
from tests.models import EpsBufferSite, HyperConnections, LayerNormBlock  # noqa: E402

HIDDEN = 1024

# The eps-buffer site made in bf16: its eps a 0-d fp32 buffer (tests/test_numerics_gloo.py runs the
# same class on CPU, where it fuses too).
MODELS = {"layernorm": (LayerNormBlock, None), "hyper_connections": (HyperConnections, 4),
          "eps_buffer": (functools.partial(EpsBufferSite, dtype=torch.bfloat16), None)}


def rel_err(got, want) -> float:
    return max(float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
               for g, w in zip(got, want))


def check(name: str, device: torch.device, rank: int, tokens: int) -> dict:
    cls, streams = MODELS[name]
    torch.manual_seed(0)  # the same weights on every rank: each rank's o_proj is its shard
    model = cls(HIDDEN).to(device)
    torch.manual_seed(1 + rank)
    x = torch.randn(2, tokens, HIDDEN, dtype=torch.bfloat16, device=device)
    other = torch.randn(2, tokens, *((streams,) if streams else ()), HIDDEN, dtype=torch.bfloat16, device=device)
    dist.broadcast(other, src=0)  # the residual stream(s): replicated
    with torch.no_grad():
        want = [t.clone() for t in model(x, other)]
    result = {"model": name, "tokens": tokens}
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        arfusion.reset_stats()
        compiled = torch.compile(model, mode=mode)
        with torch.no_grad():
            for _ in range(4):  # warm-up (workspace, compile), then captured replays
                got = [t.clone() for t in compiled(x, other)]
        torch.cuda.synchronize()
        stats = arfusion.stats()
        result[mode] = {"rel_err": rel_err(got, want), "fused_sites": stats["fused_sites"],
                        "fast_path_all_reduces": stats["fast_path_all_reduces"], "dispatch": stats["dispatch"],
                        "why_not_codes": stats["why_not_codes"]}
        del compiled
    torch._dynamo.reset()  # cudagraph trees shut down before the group goes
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--shared-gpu", action="store_true", help="both ranks on GPU 0 over gloo")
    args = p.parse_args()
    device = shared_gpu.init(args.shared_gpu, hang_s=float(os.environ.get("CHECK_HANG_S", 0)) or None)
    rank = dist.get_rank()
    arfusion.enable(arfusion.PassConfig(enable_allreduce_fusion=True, backend="flashinfer"))
    rows = [check(name, device, rank, t) for name in MODELS for t in args.tokens]
    failures = []
    for r in rows:
        for mode in ("default", "reduce-overhead"):
            m = r[mode]
            kernel = "flashinfer" if r["model"] == "eps_buffer" else "flashinfer all-reduce"
            ok = (m["rel_err"] < 2e-2 and set(m["dispatch"]) == {kernel}
                  and (m["fused_sites"] == 1 if r["model"] == "eps_buffer" else m["fast_path_all_reduces"] == 1))
            if not ok:
                failures.append({"model": r["model"], "tokens": r["tokens"], "mode": mode, **m})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": rank, "rows": rows, "failures": failures,
                                      "device": torch.cuda.get_device_name(device), "torch": torch.__version__})
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "fast_all_reduce.json").write_text(json.dumps(everyone, indent=1))
        print(json.dumps(everyone, indent=1), flush=True)
    from arfusion.backends import get_backend
    from arfusion.decisions import Reason

    backend = get_backend("flashinfer")
    if not isinstance(backend, Reason):
        backend.close()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(e["failures"] for e in everyone) else 0


if __name__ == "__main__":
    sys.exit(main())
