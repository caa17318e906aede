"""Soak run of a compiled two-layer TP block with the pass (docs/reliability.md). Not collected by pytest.

    torchrun --nproc-per-node 2 tests/gpu/soak.py --calls 10000 --out DIR      # GPUs (NCCL)
    torchrun --nproc-per-node 2 tests/gpu/soak.py --device cpu --calls 50 --out DIR   # CPU (gloo)
    torchrun --nproc-per-node 2 tests/gpu/soak.py --shared-gpu --calls 2000 --out DIR  # one GPU, 2 ranks

Block: twice (row-parallel matmul -> all_reduce -> residual add -> HF Llama RMSNorm), compiled
with arfusion (backend "flashinfer" on CUDA when importable, else "torch"; never "auto" or
"mnnvl", no NVLink multicast), once under mode="reduce-overhead" and once under dynamic=True.
Token counts are drawn at random (fixed seed, the same on every rank) from 1 to above the fused
cap; every output is checked against the same module run eagerly (unfused) on the side.
Records calls, mismatches beyond tolerance, the max error, arfusion.stats() (fused / declined /
fallback) and CUDA memory at start, after warm-up and at the end; writes DIR/soak.json and
DIR/soak.md; exits non-zero on any mismatch (on any rank).

reduce-overhead records one CUDA graph per distinct token count, so that mode draws from
`--distinct` sizes (default 48, always including 1, the cap's neighbours and the maximum);
dynamic=True draws every size from the whole range.

--shared-gpu (a one-GPU machine; tests/gpu/shared_gpu.py): both ranks on GPU 0 over gloo, FlashInfer
with the "ranks share a GPU" guard lifted: checks what is computed, not speed. gloo cannot run
inside a CUDA graph, so reduce-overhead draws only sizes the fused kernel takes (<= the cap; the
run-time fallback above it is exercised by dynamic=True), and the cap defaults to 2 MiB so that
the eager reference's gloo all-reduces stay cheap.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shared_gpu  # tests/gpu/shared_gpu.py (the script's own directory is on sys.path)

# The GPU checks' tolerance (tests/gpu/check_flashinfer.py): relative L2 error and max abs error
# over max |eager|, for bf16 outputs (the FlashInfer kernel rounds once where HF rounds twice).
REL_L2_TOL, MAX_TOL = 1e-2, 5e-2
BUDGET_CHECK_EVERY = 250  # calls between the ranks' agreement on --budget-s (one tiny all-reduce)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden, dtype, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden).to(dtype))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class TwoLayers(nn.Module):
    """(row-parallel matmul -> all_reduce -> + residual -> RMSNorm) twice; returns (normed, residual)."""

    def __init__(self, hidden, dtype):
        super().__init__()
        self.projs = nn.ModuleList(nn.Linear(hidden, hidden, bias=False, dtype=dtype) for _ in range(2))
        self.norms = nn.ModuleList(LlamaRMSNorm(hidden, dtype) for _ in range(2))

    def forward(self, x, residual):
        for proj, norm in zip(self.projs, self.norms):
            y = proj(x)
            dist.all_reduce(y)
            residual = residual + y
            x = norm(residual)
        return x, residual


def error(got, want) -> tuple[float, float]:
    g, w = got.float(), want.float()
    if g.shape != w.shape or not torch.isfinite(g).all():
        return float("inf"), float("inf")
    if not w.numel():
        return 0.0, 0.0
    return (((g - w).norm() / w.norm().clamp_min(1e-12)).item(),
            ((g - w).abs().max() / w.abs().max().clamp_min(1e-6)).item())


def memory(device) -> dict | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}


def token_schedule(args, cap_tokens: int | None, dynamic: bool) -> list[int]:
    rng = random.Random(args.seed + (1 if dynamic else 0))  # same on every rank
    if dynamic or not args.distinct:
        return [rng.randint(1, args.max_tokens) for _ in range(args.calls)]
    top = min(args.max_tokens, cap_tokens) if args.shared_gpu and cap_tokens else args.max_tokens
    pool = {1, top}
    if cap_tokens:
        pool |= {t for t in (cap_tokens - 1, cap_tokens, cap_tokens + 1) if 1 <= t <= top}
    while len(pool) < min(args.distinct, top):
        pool.add(rng.randint(1, top))
    pool = sorted(pool)
    return [rng.choice(pool) for _ in range(args.calls)]


def run_mode(name, args, model, device, backend, cap_tokens, world) -> dict:
    import arfusion

    dynamic = name == "dynamic"
    torch._dynamo.reset()
    arfusion.reset_stats()
    max_size_mb = {world: args.cap_mb} if args.cap_mb is not None else {}
    options = arfusion.inductor_options(arfusion.PassConfig(
        enable_allreduce_fusion=True, backend=backend, max_size_mb=max_size_mb))
    if dynamic:
        compiled = torch.compile(model, options=options, dynamic=True)
    else:
        # mode="reduce-overhead" is {"triton.cudagraphs": True}; torch.compile takes mode or
        # options, not both. On CPU there are no CUDA graphs: Inductor skips them (logged).
        compiled = torch.compile(model, options={**options, "triton.cudagraphs": True})
    schedule = token_schedule(args, cap_tokens, dynamic)
    rank = dist.get_rank()
    # per-rank activations, drawn on the device (a CPU draw of 6144 x 4096 costs ~100 ms a call)
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    mem = {"start": memory(device)}
    mismatches, max_rel, max_abs, worst, done = 0, 0.0, 0.0, [], 0
    started = time.perf_counter()
    with torch.no_grad():
        for i, tokens in enumerate(schedule):
            x = torch.randn(tokens, args.hidden, generator=gen, device=device, dtype=torch.float32).to(args.dtype)
            residual = torch.randn(tokens, args.hidden, generator=gen, device=device, dtype=torch.float32).to(args.dtype)
            if device.type == "cuda" and not dynamic:
                torch.compiler.cudagraph_mark_step_begin()
            got = [t.clone() for t in compiled(x, residual)]  # cudagraph outputs are overwritten later
            want = model(x, residual)
            rel, mx = (max(v) for v in zip(*(error(g, w) for g, w in zip(got, want))))
            max_rel, max_abs = max(max_rel, rel), max(max_abs, mx)
            if rel > REL_L2_TOL or mx > MAX_TOL:
                mismatches += 1
                if len(worst) < 20:
                    worst.append({"call": i, "tokens": tokens, "rel_l2": rel, "max_rel": mx})
            if i + 1 == args.warmup:
                mem["after_warmup"] = memory(device)
            if i + 1 == len(schedule) // 2:  # graphs compiled and captured by now: later growth would be a leak
                mem["half"] = memory(device)
            done = i + 1
            if rank == 0 and args.progress and done % args.progress == 0:
                print(f"soak {name}: {done}/{len(schedule)} calls, {mismatches} mismatches, "
                      f"max rel {max_rel:.2e}, {time.perf_counter() - started:.0f} s", flush=True)
            if args.budget_s and done % BUDGET_CHECK_EVERY == 0 and out_of_time(started, args.budget_s, device):
                if rank == 0:
                    print(f"soak {name}: budget of {args.budget_s:.0f} s spent after {done} calls", flush=True)
                break
    mem["end"] = memory(device)
    stats = arfusion.stats()
    del compiled
    torch._dynamo.reset()  # drops cudagraph trees (NCCL graphs stall destroy_process_group)
    gc.collect()
    schedule = schedule[:done]
    return {"mode": "reduce-overhead" if not dynamic else "dynamic=True", "calls": done, "planned_calls": args.calls,
            "tokens_min": min(schedule), "tokens_max": max(schedule), "distinct_tokens": len(set(schedule)),
            "above_cap": sum(t > cap_tokens for t in schedule) if cap_tokens else None,
            "mismatches": mismatches, "max_rel_l2": max_rel, "max_rel_abs": max_abs, "worst": worst,
            "stats": {k: stats[k] for k in ("fused_sites", "unfused_sites", "why_not_codes", "dispatch", "by_pattern")},
            "memory": mem, "seconds": round(time.perf_counter() - started, 1)}


def out_of_time(started: float, budget_s: float, device) -> bool:
    """True on every rank once any rank has spent the budget (the ranks must stop at the same call)."""
    flag = torch.tensor([float(time.perf_counter() - started > budget_s)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def reduce_over_ranks(modes, device) -> None:
    """Mismatches summed and errors maxed over ranks, so every rank exits alike."""
    for m in modes:
        t = torch.tensor([m["mismatches"], m["max_rel_l2"], m["max_rel_abs"]], dtype=torch.float64, device=device)
        total = t.clone()
        dist.all_reduce(total[:1])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        m["mismatches_all_ranks"] = int(total[0].item())
        m["max_rel_l2"], m["max_rel_abs"] = float(t[1].item()), float(t[2].item())


def markdown(report) -> str:
    def mib(m, key):
        return "n/a" if not m or not m.get(key) else f"{m[key]['allocated'] / 2**20:.0f} / {m[key]['reserved'] / 2**20:.0f}"

    lines = [f"# Soak: {report['device']}, world {report['world_size']}, backend {report['backend']}, "
             f"hidden {report['hidden']}, {report['dtype']}"
             + (" (both ranks on one GPU, gloo)" if report.get("shared_gpu") else ""), "",
             "| mode | calls | tokens | above cap | mismatches (all ranks) | max rel L2 | max rel abs | "
             "dispatch | fused / unfused sites | MiB alloc / reserved: start, warm, half, end | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in report["modes"]:
        mem = m["memory"]
        lines.append(
            f"| {m['mode']} | {m['calls']} | {m['tokens_min']}..{m['tokens_max']} ({m['distinct_tokens']} sizes) | "
            f"{m['above_cap']} | {m['mismatches_all_ranks']} | {m['max_rel_l2']:.2e} | {m['max_rel_abs']:.2e} | "
            f"{m['stats']['dispatch']} | {m['stats']['fused_sites']} / {m['stats']['unfused_sites']} | "
            f"{mib(mem, 'start')}, {mib(mem, 'after_warmup')}, {mib(mem, 'half')}, {mib(mem, 'end')} | {m['seconds']} |")
    lines += ["", f"Tolerance: rel L2 <= {REL_L2_TOL}, max abs / max |eager| <= {MAX_TOL} (bf16); "
              f"command: `{report['command']}`", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10000, help="calls per mode")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--shared-gpu", action="store_true", help="every rank on GPU 0, gloo (see above)")
    parser.add_argument("--hidden", type=int, help="default 4096 (cuda), 256 (cpu)")
    parser.add_argument("--max-tokens", type=int, help="default 6144 (cuda: above the 32 MiB TP=2 cap), 1024 (cpu)")
    parser.add_argument("--cap-mb", type=float, help="PassConfig.max_size_mb for this world size; default: the "
                        "backend's own table on cuda, 0.25 on cpu (so that some calls are above it)")
    parser.add_argument("--distinct", type=int, default=48, help="distinct token counts under reduce-overhead (0: all)")
    parser.add_argument("--modes", default="reduce-overhead,dynamic")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", type=int, default=1000)
    parser.add_argument("--budget-s", type=float, default=0,
                        help="per mode: stop drawing calls after this many seconds (0: no limit); the ranks agree "
                             "every %d calls, so a stage limit never kills a run that has results" % BUDGET_CHECK_EVERY)
    args = parser.parse_args()

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if use_cuda:
        device = shared_gpu.init(args.shared_gpu, hang_s=float(os.environ.get("SOAK_HANG_S", 570)))
        backend = "flashinfer" if importlib.util.find_spec("flashinfer") else "torch"
        if args.shared_gpu and args.cap_mb is None:
            args.cap_mb = 2.0
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        backend = "torch"
        if args.cap_mb is None:
            args.cap_mb = 0.25
    args.hidden = args.hidden or (4096 if use_cuda else 256)
    args.max_tokens = args.max_tokens or (768 if args.shared_gpu else 6144 if use_cuda else 1024)
    args.dtype = torch.bfloat16
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    torch._inductor.config.fx_graph_cache = False  # a cache hit would skip the pass (why_not_codes empty)

    row_bytes = args.hidden * 2
    if args.cap_mb is not None:
        cap_tokens = int(args.cap_mb * 2**20) // row_bytes
    elif backend == "flashinfer":
        from arfusion.backends import get_backend
        from arfusion.decisions import Reason
        from arfusion.core import Call, Form
        fi = get_backend("flashinfer")
        call = Call(form=Form(residual=True, norm="rms"), tokens=1, hidden=args.hidden, dtype=args.dtype,
                    weight_dtype=args.dtype, world_size=world, device=device, group_name=dist.group.WORLD.group_name)
        cap = None if isinstance(fi, Reason) else fi.default_max_bytes(call)
        cap_tokens = None if cap is None else cap // row_bytes
    else:
        cap_tokens = None

    torch.manual_seed(0)
    model = TwoLayers(args.hidden, args.dtype).to(device)
    with torch.no_grad():  # row-parallel: each rank holds its own shard of the projections
        for proj in model.projs:
            proj.weight.copy_(torch.randn(proj.weight.shape, generator=torch.Generator().manual_seed(rank + 1))
                              .mul_(args.hidden ** -0.5).to(device, args.dtype))
    modes = [run_mode(name, args, model, device, backend, cap_tokens, world)
             for name in args.modes.split(",") if name]
    reduce_over_ranks(modes, device)
    report = {"device": torch.cuda.get_device_name(device) if use_cuda else "cpu", "world_size": world,
              "shared_gpu": args.shared_gpu,
              "backend": backend, "hidden": args.hidden, "dtype": str(args.dtype), "cap_tokens": cap_tokens,
              "tolerance": {"rel_l2": REL_L2_TOL, "max_rel": MAX_TOL}, "seed": args.seed,
              "command": " ".join(["torchrun", f"--nproc-per-node {world}", *sys.argv]), "modes": modes}
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "soak.md").write_text(markdown(report))
        print(markdown(report), flush=True)
    failed = any(m["mismatches_all_ranks"] for m in modes)
    if use_cuda:
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    # Everything is written and the group destroyed. Leave without interpreter finalization: once
    # in a CPU CI run a rank aborted there ("terminate called without an active exception",
    # SIGABRT) after a clean run, as gloo's worker threads can when tensors they hold are freed
    # while the interpreter is torn down (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
