"""Does arfusion's fp8 emulation quantize as FlashInfer's quantized all-reduce does? (one GPU)

    torchrun --nproc-per-node 1 tests/gpu/check_quantized_codec.py --out DIR

`arfusion.codec.emulate(x, group, "fp8")` stands in for FlashInfer's
`quantized_all_reduce` wherever the kernel cannot run (CPU, tests, the accuracy harness). On a
group of one rank the kernel's two-shot reduces to its first phase (quantize each 256-element
group to e4m3 with scale amax / 448, dequantize, sum in fp32, write bf16). The emulation is not
bit-exact (first run, H100: 0.005% of elements one fp8 step apart on normal data, 1.6% on
heavy-tailed data; Triton's fp32 division and conversion round a few values the other way), so
the check is on what the accuracy harness relies on: the error against the exact sum, max and
mean, within 5% of the kernel's. The second phase (re-quantizing a reduced stripe for the other
ranks) needs two GPUs and is not checked here. Writes DIR/quantized_codec.json; exits 1 when the
errors disagree.
Never uses multicast (symmetric memory with TORCH_SYMM_MEM_DISABLE_MULTICAST=1, one rank).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from arfusion import codec

HIDDEN = 4096


def messages(tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(tokens)
    normal = torch.randn(tokens, HIDDEN, generator=g, device=device)
    outliers = normal.clone()
    outliers.view(-1)[:: 997] *= 300  # a few large values per scale group's neighbourhood
    return {
        "normal": normal,
        "tiny": normal * 1e-6,
        "heavy_tail": normal ** 3,
        "outliers": outliers,
        "zeros_and_rows": torch.where(torch.rand(tokens, 1, generator=g, device=device) < 0.3, 0.0, normal),
    }


def close(a: float, b: float, rel: float = 0.05) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    from flashinfer.comm.quantized_allreduce import quantized_all_reduce

    group = dist.group.WORLD
    rows, failures = [], []
    for tokens in (256, 1024, 2048, 8192):  # 2, 8, 16, 64 MiB of bf16
        for name, values in messages(tokens, device).items():
            x = values.to(torch.bfloat16).contiguous()
            kernel = quantized_all_reduce(x, group)
            emulated = codec.emulate(x, group.group_name, "fp8")
            torch.cuda.synchronize()
            differ = (kernel.view(torch.int16) != emulated.view(torch.int16)).sum().item()
            scale = x.float().abs().max().clamp_min(1e-30)
            err_k, err_e = (kernel.float() - x.float()).abs(), (emulated.float() - x.float()).abs()
            row = {"tokens": tokens, "mib": x.numel() * 2 / 2**20, "data": name,
                   "fraction_differing": differ / x.numel(),
                   "max_abs_diff": (kernel.float() - emulated.float()).abs().max().item(),
                   "kernel_max_rel_err": (err_k.max() / scale).item(), "emulation_max_rel_err": (err_e.max() / scale).item(),
                   "kernel_mean_abs_err": err_k.mean().item(), "emulation_mean_abs_err": err_e.mean().item()}
            rows.append(row)
            if not (close(row["kernel_max_rel_err"], row["emulation_max_rel_err"])
                    and close(row["kernel_mean_abs_err"], row["emulation_mean_abs_err"])):
                failures.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quantized_codec.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(device), "world": dist.get_world_size(), "torch": torch.__version__,
         "rows": rows, "failures": len(failures)}, indent=1))
    print("errors agree in every case" if not failures else f"{len(failures)} cases disagree", flush=True)
    dist.destroy_process_group()
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
