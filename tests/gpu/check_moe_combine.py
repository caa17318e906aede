"""GPU check of the MoE combine fused into the site (FlashInfer's MoE finalize), under torchrun.

    torchrun --nproc-per-node 2 tests/gpu/check_moe_combine.py --out /tmp/moe_combine

For top-k K in 8, 2, 6, hidden 2048, 4096, 7168 and T = 1 ... 512 tokens (the MoE site's whole grid; --k,
--hidden, --tokens pick a part; bf16, HF grouped-experts layout: rows in expert-sorted order, index =
inverse permutation, one weight per permuted row), K = 8 first, so a run cut short by --budget-s
has the cases the targets are judged on:

1. correctness: `arfusion::moe_combine_allreduce_rmsnorm` (dispatch table as shipped, and with
   the MoE finalize kernel forced at every T) against the unfused reference (combine in fp32-
   accurate torch + NCCL all-reduce + add + RMSNorm in the model's dtype): max relative error of
   the residual sum and the norm output, eagerly and replayed from a CUDA graph on fresh data;
2. speed, CUDA-graph replays, median over samples (each sample = REPLAYS graph launches):
   - unfused: one torch.compile'd function: combine + all-reduce (NCCL) + add + RMSNorm;
   - site_only: compiled combine, then arfusion's plain fused op (FlashInfer allreduce_fusion);
   - moe_op: the MoE op as dispatched by the table (kernel up to the table's T, else site_only's path);
   - moe_kernel: the MoE op with the finalize kernel forced at every T up to --force-max-tokens
     (128: it is one-shot only, and already slower than site_only's path from T = 64 at hidden 2048).
3. a shared expert's term added before the all-reduce (`shared`, FlashInfer's `shared_expert_output`),
   with bf16 and with fp32 routing weights (DeepSeek's router: the graph's combine runs in fp32).
Writes <out>/moe_combine_rank<r>.json (rank 0 also prints a table). Never uses FlashInfer's
"auto"/"mnnvl" backends (the backend asks for "trtllm" only).

--no-finalize: only (2) for unfused and site_only, which is what the pass emits by default (the
finalize kernel stays opt-in: in the model's decode step it was slower than site_only, 2xH200).

--shared-gpu: every rank on GPU 0 (a one-GPU machine), a gloo group, correctness only (1 and 3;
no timings: the ranks' kernels take turns on the GPU). The backend's "two ranks share one GPU"
guard is lifted for this check only: FlashInfer's IPC workspace maps the other process's buffers
on the same device, and its one-shot kernel waits for the other rank's data, which arrives when
the GPU switches to that process, so the NRanks=2 kernel computes what it computes on two GPUs.
The ranks drift far apart this way, which is how the finalize kernel's hang was found (two
queued calls never finished while it shared the plain kernel's workspace; docs/flashinfer.md):
the cases run eagerly with a synchronize after each call, and the one CUDA graph comes last,
behind a watchdog.
The kernel under test is opted in here (ARFUSION_FLASHINFER_MOE_FINALIZE=1); arfusion leaves it
off by default.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import arfusion.ops  # noqa: F401  (registers the ops)
from arfusion import reference
from arfusion.backends import flashinfer_dispatch as dispatch
from arfusion.backends import get_backend
from arfusion.decisions import Reason
from arfusion.core import Form

import shared_gpu  # tests/gpu/shared_gpu.py (the script's own directory is on sys.path)

K = 8  # the default top-k (Qwen3-MoE, DeepSeek-V3); the grid also takes DeepSeek-V2-Lite's 6 and Mixtral's 2
TOP_KS = (8, 2, 6)
TOKENS = (1, 8, 32, 64, 128, 256, 512)
HIDDENS = (2048, 4096, 7168)
FORCE_MAX_TOKENS = 128
EPS = 1e-6
DTYPE = torch.bfloat16
TOL = 2e-2
SAMPLES, REPLAYS = 25, 20
# Calls per captured graph, for every variant alike: an even number of MoE finalize calls, so a
# graph replayed back to back never starts on the workspace it ended on (FinalizeWorkspaces in
# arfusion/backends/flashinfer_moe.py: the one order its two workspaces do not make safe).
CALLS_PER_GRAPH = 2
SITE = Form(residual=True, norm="rms")


def make_inputs(tokens, hidden, device, rank, seed=0, k=K):
    """Same routing and weights on every rank (TP replicates the router), rows differ per rank."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    perm = torch.randperm(tokens * k, generator=g)
    index = torch.empty_like(perm)
    index[perm] = torch.arange(perm.numel())
    scale = torch.rand(tokens * k, 1, generator=g).to(DTYPE)
    residual = torch.randn(tokens, hidden, generator=g).to(DTYPE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DTYPE)
    g_rank = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank + 1)
    rows = torch.randn(tokens * k, hidden, generator=g_rank).to(DTYPE)
    return [t.to(device) for t in (rows, scale, index, residual, weight)]


def moe_op(rows, scale, index, residual, weight, group_name, k=K):
    return torch.ops.arfusion.moe_combine_allreduce_rmsnorm(
        rows=rows, scale=scale, index=index, top_k=k, scale_first=True, residual=residual, weight=weight, eps=EPS,
        eps_tensor=None, group_name=group_name, norm="rms", quant="none", quant_scale=None, emit_norm=True,
        backend="flashinfer")


def make_site_only(group_name, k=K):
    combine = torch.compile(reference.moe_combine)

    def site_only(rows, scale, index, residual, weight):
        combined = combine(rows, scale, index, k, True)
        return torch.ops.arfusion.fused_allreduce_rmsnorm(
            x=combined, residual=residual, weight=weight, eps=EPS, eps_tensor=None, group_name=group_name,
            norm="rms", quant="none", quant_scale=None, emit_norm=True, backend="flashinfer")

    return site_only


def make_unfused(group_name, k=K):
    @torch.compile
    def unfused(rows, scale, index, residual, weight):
        combined = reference.moe_combine(rows, scale, index, k, True)
        reduced = funcol.wait_tensor(funcol.all_reduce(combined, "sum", group_name))
        h = residual + reduced
        hf = h.float()
        normed = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)
        return h, normed

    return unfused


def all_reduced(t, group_name):
    """fp32 sum over the group, not timed: on the device for NCCL (it has no CPU backend), via the CPU for gloo."""
    group = dist.distributed_c10d._resolve_process_group(group_name)
    if t.device.type == "cuda" and "nccl" in str(dist.get_backend(group)):
        out = t.float().clone()
        dist.all_reduce(out, group=group)
        return out
    host = t.float().cpu()
    dist.all_reduce(host, group=group)
    return host.to(t.device)


def exact(rows, scale, index, residual, weight, group_name, shared=None, routed_scale=1.0, input_scale=1.0):
    """Reference outputs: the combine [* routed_scale] [+ shared] in fp32, all-reduced in fp32
    [* input_scale], then the model's roundings."""
    k = index.numel() // residual.shape[0]
    combined = ((rows.float() * scale.float())[index]).view(-1, k, rows.shape[-1]).sum(1) * routed_scale
    if shared is not None:
        combined = combined + shared.float()
    h = (residual.float() + all_reduced(combined, group_name) * input_scale).to(DTYPE)
    return h, reference.rms_norm(h, weight, EPS, "rms")


# (routed_scale, input_scale): none; Laguna's routed factor (before the shared term, after the merge);
# MiniMax-M3's factor after the all-reduce; both (the kernel's routed_scaling_factor takes the product).
SCALES = ((1.0, 1.0), (2.5, 1.0), (1.0, 0.75), (2.5, 0.5))


def check_shared_expert(device, rank, group_name, kernel_calls, failures):
    """A shared expert's partial output added before the all-reduce (the op's `shared`, FlashInfer's
    `shared_expert_output`), with the routing weights in bf16 and in fp32 (DeepSeek), and numbers
    scaling the combine (`SCALES`: FlashInfer's `routed_scaling_factor`): eager, against the fp32
    reference, per (hidden, T)."""
    checks = []
    for hidden in HIDDENS:
        for tokens, (routed_scale, input_scale) in ((t, s) for t in (1, 8) for s in SCALES):
            for weights_dtype in (DTYPE, torch.float32):
                rows, scale, index, residual, weight = make_inputs(tokens, hidden, device, rank, seed=2)
                scale = torch.rand(scale.shape, generator=torch.Generator().manual_seed(3)).to(device, weights_dtype)
                shared = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank + 7)).to(
                    device, DTYPE)
                kernel_calls[0] = 0
                got = torch.ops.arfusion.moe_combine_allreduce_rmsnorm(
                    rows=rows, scale=scale, index=index, top_k=K, scale_first=True, residual=residual,
                    weight=weight, eps=EPS, eps_tensor=None, group_name=group_name, norm="rms", quant="none",
                    quant_scale=None, emit_norm=True, backend="flashinfer", shared=shared,
                    routed_scale=routed_scale, input_scale=input_scale)
                h, normed = exact(rows, scale, index, residual, weight, group_name, shared, routed_scale, input_scale)
                errs = {"residual": rel(got[0], h), "norm": rel(got[1], normed)}
                checks.append({"hidden": hidden, "tokens": tokens, "weights": str(weights_dtype),
                               "routed_scale": routed_scale, "input_scale": input_scale,
                               "ran_kernel": kernel_calls[0] > 0, "rel_err": errs})
                if max(errs.values()) > TOL or got[0].dtype != DTYPE or not kernel_calls[0]:
                    failures.append(f"shared expert H={hidden} T={tokens} {weights_dtype} scales "
                                    f"{routed_scale}, {input_scale}: {errs}, {got[0].dtype}, kernel {kernel_calls[0]}")
    return checks


def graph_probe(backend, device, rank, group_name, kernel_calls):
    """--shared-gpu: a CUDA graph of the finalize kernel (warm-up of three queued calls, two calls
    captured, PDL as shipped), replayed three times back to back; last, so a hang costs nothing
    recorded before it. Before the finalize kernel had workspaces of its own, the warm-up hung."""
    inputs = make_inputs(8, 2048, device, rank, seed=5)
    kernel_calls[0] = 0
    progress(rank, "graph probe: capture")
    graph, outs = graph_of(lambda *a: moe_op(*a, group_name), inputs)
    for static, new in zip(inputs, make_inputs(8, 2048, device, rank, seed=6)):
        static.copy_(new)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    want = exact(*inputs, group_name)
    errs = {"residual": rel(outs[0], want[0]), "norm": rel(outs[1], want[1]), "ran_kernel": kernel_calls[0] > 0}
    progress(rank, f"graph probe: replayed, {errs}")
    return errs


def over_budget(budget_s, started, device):
    """The same verdict on every rank (the slowest rank's clock), so no rank starts a case its peer skips."""
    late = budget_s is not None and time.monotonic() - started > budget_s
    flag = torch.tensor([int(late)], dtype=torch.int32,
                        device="cpu" if dist.get_backend() == "gloo" else device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def progress(rank, what):
    print(f"{time.strftime('%H:%M:%S')} rank {rank}: {what}", flush=True)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def graph_of(fn, args, calls=CALLS_PER_GRAPH):
    """A CUDA graph of `calls` calls of fn(*static args) (warmed up on a side stream first), and the
    last call's outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            outs = fn(*args)
    return graph, outs


def time_graph(graph, group):
    samples = []
    for _ in range(SAMPLES):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / (REPLAYS * CALLS_PER_GRAPH))  # us per call
    return statistics.median(samples)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shared-gpu", action="store_true", help="every rank on GPU 0, gloo, correctness only")
    p.add_argument("--no-finalize", action="store_true",
                   help="only unfused vs site_only (the path the pass takes by default)")
    p.add_argument("--k", type=int, nargs="+", default=list(TOP_KS), help="top-k values, in this order")
    p.add_argument("--hidden", type=int, nargs="+", default=list(HIDDENS))
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--force-max-tokens", type=int, default=FORCE_MAX_TOKENS,
                   help="moe_kernel (the finalize kernel forced) only up to this T")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new case after this many seconds (the results so far are written)")
    args = p.parse_args()
    started = time.monotonic()
    # One compiled combine and one unfused function per K, each recompiled once for dynamic shapes:
    # more variants of one code object than Dynamo's default limit, past which it would run eagerly.
    torch._dynamo.config.recompile_limit = 64
    if not args.no_finalize:
        os.environ[dispatch.MOE_FINALIZE_OPT_IN_ENV] = "1"  # the kernel under test is off by default (its hazard)
    if args.shared_gpu:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
        logging.getLogger("arfusion").setLevel(logging.INFO)
    # Shared GPU: a hang (ranks waiting on each other's kernel) shows where it sits, then the run ends.
    device = shared_gpu.init(args.shared_gpu, hang_s=float(os.environ.get("CHECK_HANG_S", 200)))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    group_name = group.group_name
    backend = get_backend("flashinfer")
    assert not isinstance(backend, Reason), backend
    kernel_calls = [0]
    real_run = backend.run_moe_combine

    def counting_run(*a, **kw):
        kernel_calls[0] += 1
        return real_run(*a, **kw)

    backend.run_moe_combine = counting_run
    sm = torch.cuda.get_device_capability(device)[0]
    table_cap = dispatch.MOE_FINALIZE_MAX_TOKENS.get((sm, world))
    results = {"device": torch.cuda.get_device_name(device), "world": world, "top_k": args.k, "table_cap": table_cap,
               "shared_gpu": args.shared_gpu, "samples": SAMPLES, "replays_per_sample": REPLAYS,
               "force_max_tokens": args.force_max_tokens, "cases": []}
    timed = not args.shared_gpu
    failures = []
    grid = [(k, hidden, tokens) for k in args.k for hidden in args.hidden for tokens in args.tokens]
    compiled = {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for k, hidden, tokens in grid:
        if over_budget(args.budget_s, started, device):
            results["stopped_by_budget"] = f"before K={k} H={hidden} T={tokens}"
            progress(rank, f"budget spent: {results['stopped_by_budget']}")
            break
        if k not in compiled:
            compiled[k] = {"site_only": make_site_only(group_name, k), "unfused": make_unfused(group_name, k)}
        label = f"K={k} H={hidden} T={tokens}"
        case = {"top_k": k, "hidden": hidden, "tokens": tokens}
        inputs = make_inputs(tokens, hidden, device, rank, k=k)
        want = exact(*inputs, group_name)
        forced_cases = (False, True) if tokens <= args.force_max_tokens else (False,)
        for forced in () if args.no_finalize else forced_cases:
            name = "moe_kernel" if forced else "moe_op"
            saved = dict(dispatch.MOE_FINALIZE_MAX_TOKENS)
            if forced:
                dispatch.MOE_FINALIZE_MAX_TOKENS[(sm, world)] = 1 << 20
            try:
                kernel_calls[0] = 0
                progress(rank, f"{label} {name}: eager")
                got = moe_op(*inputs, group_name, k)  # eager: creates the workspace outside any capture
                torch.cuda.synchronize()
                progress(rank, f"{label} {name}: eager done, kernel {kernel_calls[0] > 0}")
                case[f"{name}_ran_kernel"] = kernel_calls[0] > 0
                errs = {"residual": rel(got[0], want[0]), "norm": rel(got[1], want[1])}
                case[f"{name}_rel_err"] = errs
                if not timed:  # shared GPU: eager only here, one graph at the end (graph_probe)
                    if max(errs.values()) > TOL:
                        failures.append(f"{name} {label}: {errs}")
                    continue
                graph, outs = graph_of(lambda *a: moe_op(*a, group_name, k), inputs)
                for static, new in zip(inputs, make_inputs(tokens, hidden, device, rank, seed=1, k=k)):
                    static.copy_(new)
                graph.replay()
                torch.cuda.synchronize()
                want_fresh = exact(*inputs, group_name)
                errs.update(graph_residual=rel(outs[0], want_fresh[0]), graph_norm=rel(outs[1], want_fresh[1]))
                if max(errs.values()) > TOL:
                    failures.append(f"{name} {label}: {errs}")
                case[f"{name}_us"] = time_graph(graph, group)
                del graph
            finally:
                dispatch.MOE_FINALIZE_MAX_TOKENS.clear()
                dispatch.MOE_FINALIZE_MAX_TOKENS.update(saved)
            inputs = make_inputs(tokens, hidden, device, rank, k=k)
        results["cases"].append(case)
        if not timed:
            if rank == 0:
                print(f"{label}: moe_op kernel {case['moe_op_ran_kernel']} err {case['moe_op_rel_err']}; "
                      f"moe_kernel err {case.get('moe_kernel_rel_err', 'not forced')}", flush=True)
            continue
        for name, fn in compiled[k].items():
            got = fn(*inputs)
            torch.cuda.synchronize()
            case[f"{name}_rel_err"] = {"residual": rel(got[0], want[0]), "norm": rel(got[1], want[1])}
            graph, _ = graph_of(fn, inputs)
            case[f"{name}_us"] = time_graph(graph, group)
            del graph
        for name in ("site_only", "moe_op", "moe_kernel"):
            if f"{name}_us" in case:
                case[f"speedup_{name}_vs_unfused"] = case["unfused_us"] / case[f"{name}_us"]
        if rank == 0:
            line = (f"{label}: unfused {case['unfused_us']:7.1f} us, site_only {case['site_only_us']:7.1f} "
                    f"({case['speedup_site_only_vs_unfused']:.2f}x)")
            if "moe_op_us" in case:
                line += (f", moe_op {case['moe_op_us']:7.1f} ({case['speedup_moe_op_vs_unfused']:.2f}x, kernel "
                         f"{case['moe_op_ran_kernel']})")
            if "moe_kernel_us" in case:
                line += f", moe_kernel {case['moe_kernel_us']:7.1f} ({case['speedup_moe_kernel_vs_unfused']:.2f}x)"
            print(line, flush=True)
        (out / f"moe_combine_rank{rank}.json").write_text(json.dumps(results, indent=1))  # a cut-off run keeps these
    if not args.no_finalize:
        results["shared_expert"] = check_shared_expert(device, rank, group_name, kernel_calls, failures)
    results["failures"] = failures
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (out / f"moe_combine_rank{rank}.json").write_text(json.dumps(results, indent=1))
    if rank == 0:
        print("FAILURES:" if failures else "all within tolerance", *failures, sep="\n")
    if not timed:
        results["graph_probe"] = graph_probe(backend, device, rank, group_name, kernel_calls)
        (out / f"moe_combine_rank{rank}.json").write_text(json.dumps(results, indent=1))
    backend.close()
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
