"""The awkward inputs of tests/bad_input_cases.py on GPUs, through the FlashInfer backend. Not collected by pytest.

    torchrun --nproc-per-node 2 tests/gpu/check_bad_inputs.py --out DIR               # two GPUs, NCCL
    torchrun --nproc-per-node 2 tests/gpu/check_bad_inputs.py --shared-gpu --out DIR  # one GPU (shared_gpu.py)

The cases of tests/bad_input_cases.py (the CPU suite runs them with the `torch` backend), each a
small model compiled with the pass against the same model run eagerly: non-contiguous and offset
views, zero tokens, NaN/Inf, negative zeros (FlashInfer's one-shot kernels use -0.0 as their
"not written yet" mark), Granite's multiplier between the all-reduce and the add (the op's
input scale, static and dynamic), hidden 36 (FlashInfer must decline it), an fp32 norm weight with bf16
activations (must stay unfused). Writes DIR/bad_inputs_rank<r>.json and DIR/bad_inputs.md; exits
non-zero if a case is wrong or dispatched other than expected (on any rank).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shared_gpu  # tests/gpu/shared_gpu.py (the script's own directory is on sys.path)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bad_input_cases import run_bad_inputs  # noqa: E402

FUSED_BY_FLASHINFER = ("strided_slice", "transposed_back", "offset_view", "nan_inf", "negative_zero",
                       "scaled_input", "scaled_input_dynamic", "scaled_by_a_buffer", "scaled_by_an_attribute_dynamic")
LEFT_UNFUSED = ("zero_tokens", "zero_tokens_dynamic", "fp32_weight")


def problems_of(results: dict) -> list[str]:
    found = []
    for name, r in results.items():
        if not r["ok"]:
            found.append(f"{name}: {r.get('error') or r['problems']}")
        stats = r["stats"]
        if name in FUSED_BY_FLASHINFER and (stats["fused_sites"] != 1 or stats["dispatch"] != {"flashinfer": 1}):
            found.append(f"{name}: expected one site run by FlashInfer, got {stats}")
        if name in LEFT_UNFUSED and stats["fused_sites"]:
            found.append(f"{name}: expected unfused, got {stats}")
        if name == "hidden_36" and stats["dispatch"].get("flashinfer"):
            found.append(f"hidden_36: FlashInfer ran a hidden size it does not support: {stats}")
    return found


def markdown(results: dict, meta: dict) -> str:
    lines = [f"# Awkward inputs on {meta['device']}, world {meta['world']} ({meta['mode']})", "",
             "| case | result (rank 0) | max rel err | fused / unfused | dispatch | why not | s |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        s = r["stats"]
        verdict = "correct" if r["ok"] else f"WRONG: {r.get('error') or r['problems']}"
        why = "; ".join(f"{code} ×{n}" for code, n in s["why_not_codes"].items())
        lines.append(f"| {name} | {verdict} | {r.get('err', float('nan')):.2e} | {s['fused_sites']} / "
                     f"{s['unfused_sites']} | {s['dispatch']} | {why} | {r['seconds']} |")
    lines += ["", f"command: `{meta['command']}`", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--shared-gpu", action="store_true", help="every rank on GPU 0, gloo (a one-GPU machine)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=5)
    args = p.parse_args()
    device = shared_gpu.init(args.shared_gpu, hang_s=float(os.environ.get("CHECK_HANG_S", 400)))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.config.recompile_limit = 64

    def progress(name):
        print(f"{time.strftime('%H:%M:%S')} rank {rank}: {name}", flush=True)

    results = run_bad_inputs(rank, device, "flashinfer", hidden=args.hidden, tokens=args.tokens, progress=progress)
    mine = problems_of(results)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    meta = {"device": torch.cuda.get_device_name(device), "world": world,
            "mode": "both ranks on one GPU, gloo" if args.shared_gpu else "one GPU per rank, NCCL",
            "command": " ".join(["torchrun", f"--nproc-per-node {world}", *sys.argv])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bad_inputs_rank{rank}.json").write_text(
        json.dumps({"meta": meta, "problems": mine, "results": results}, indent=1, default=str))
    if rank == 0:
        (out / "bad_inputs.md").write_text(markdown(results, meta))
        print(markdown(results, meta), flush=True)
        for r, found in enumerate(everyone):
            for line in found:
                print(f"PROBLEM rank {r}: {line}", flush=True)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(everyone) else 0


if __name__ == "__main__":
    sys.exit(main())
