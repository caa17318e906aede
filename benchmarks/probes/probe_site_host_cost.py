"""Host time of a site outside CUDA graphs, without and with the pass, on GPUs. Not collected by pytest.

    torchrun --nproc-per-node 2 benchmarks/probes/probe_site_host_cost.py [--shared-gpu] [--out DIR]

A compile without CUDA graphs (`torch.compile(model)`, the README's first line) launches every
kernel from the host on every step; a decode step there is host-bound, so the host time each
site costs is the step's time. This probe measures it, per rank, for a decode-sized site
(1 token, hidden 4096, bf16):

- components, called eagerly: Inductor's unfused all-reduce (`_c10d_functional.all_reduce_` +
  `wait_tensor`), FlashInfer's `allreduce_fusion`, `execution.run_fused`, and the two fused ops;
- chains of K sites (matmul -> all-reduce -> residual add -> RMSNorm, as a decoder's), compiled
  in default mode without and with the pass, K = 1 and 16: the host time per site is the slope.

Host time: calls queued without a synchronize, divided by their number (medians of 15 runs,
garbage collection paused); wall time: the same calls to the end of the last kernel. Both ranks
run the same calls. --profile N: also where a component's host time goes (cProfile of N calls,
rank 0, the 25 heaviest functions by own time) into DIR/profile_*.txt.

--shared-gpu: both ranks on GPU 0 (tests/gpu/shared_gpu.py): FlashInfer's world-2 kernels run
there and their host path is the real one, but the ranks take turns on the GPU, so wall times
mean nothing, and NCCL refuses two ranks on one GPU: the unfused all-reduce runs on a one-rank
NCCL group per rank (the same host path, no peer). On two GPUs: NCCL, one group for both.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shared_gpu  # noqa: E402  (tests/gpu/shared_gpu.py)
from common import sync  # noqa: E402  (benchmarks/common.py)

import arfusion  # noqa: E402
import arfusion.ops  # noqa: E402,F401  (registers torch.ops.arfusion.*)
from arfusion import execution  # noqa: E402
from arfusion.policy import Caps  # noqa: E402

HIDDEN, EPS, RUNS = int(os.environ.get("PROBE_HIDDEN", 4096)), 1e-5, 15


def rms(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    v = h.float()
    return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


def chain(x, residual, w_norm, w_mm, group_name: str, sites: int):
    for _ in range(sites):
        residual = funcol.all_reduce(x @ w_mm, "sum", group_name) + residual
        x = rms(residual, w_norm)
    return x, residual


def timed(fn, calls: int, world) -> dict:
    """Median host and wall us per call over RUNS runs of `calls` queued calls (ranks in step)."""
    for _ in range(3):
        fn()
    sync()
    host, wall = [], []
    gc.disable()
    for _ in range(RUNS):
        dist.barrier(group=world)
        sync()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        queued = time.perf_counter()
        sync()
        ended = time.perf_counter()
        host.append((queued - began) / calls * 1e6)
        wall.append((ended - began) / calls * 1e6)
    gc.enable()
    return {"host_us": statistics.median(host), "host_range": [min(host), max(host)],
            "wall_us": statistics.median(wall), "calls": calls}


def flashinfer_layers(ws, backend, x, residual, weight) -> tuple[dict, dict]:
    """FlashInfer's unified `allreduce_fusion`, and the kernel call arfusion makes instead
    (flashinfer_kernel.py), for a residual site with its outputs preallocated: (theirs, ours)."""
    from flashinfer import comm as fic

    from arfusion.backends import flashinfer_kernel

    pattern = fic.AllReduceFusionPattern.kARResidualRMSNorm
    knobs = dict(launch_with_pdl=backend.launch_with_pdl, trigger_completion_at_end=True, use_oneshot=True,
                 fp32_acc=backend.fp32_acc)
    outs = dict(residual_in=residual, residual_out=torch.empty_like(x), norm_out=torch.empty_like(x),
                rms_gamma=weight, rms_eps=EPS, weight_bias=0.0)
    return ({"FlashInfer allreduce_fusion (outputs preallocated)":
             lambda: fic.allreduce_fusion(input=x, workspace=ws, pattern=pattern, **knobs, **outs)},
            {"FlashInfer trtllm_allreduce_fusion, as arfusion calls it (outputs preallocated)":
             lambda: flashinfer_kernel.launch(fic, ws, x, pattern, dict(outs), **knobs)})


def skip_kernel() -> None:
    """From here on arfusion's FlashInfer calls stop short of the kernel: what is left of the
    fused path is host time alone (its outputs are left unwritten)."""
    from arfusion.backends import flashinfer_kernel

    flashinfer_kernel.kernel_call = lambda fic: (lambda **arguments: None)


def profiled(fn, calls: int) -> str:
    """cProfile of `calls` calls of fn (a synchronize every 50: the launch queue stays short)."""
    profile = cProfile.Profile()
    profile.enable()
    for i in range(calls):
        fn()
        if i % 50 == 49:
            sync()
    profile.disable()
    sync()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def options_on(backend_name: str) -> dict:
    return arfusion.inductor_options(arfusion.PassConfig(enable_allreduce_fusion=True, backend=backend_name))


def measure(components: dict, world, say) -> dict:
    rows = {}
    for name, fn in components.items():
        rows[name] = row = timed(fn, 100, world)
        say(f"{name}: host {row['host_us']:.1f} us/call (range {row['host_range'][0]:.1f}-"
            f"{row['host_range'][1]:.1f}), wall {row['wall_us']:.1f}")
    return rows


def chains(configs: dict, inputs: tuple, world, say) -> dict:
    """Each config's chain of 1 and of 16 sites, compiled in default mode, timed."""
    rows = {}
    for config, (options, group) in configs.items():
        for sites in (1, 16):
            arfusion.reset_stats()
            torch._dynamo.reset()
            fn = torch.compile(functools.partial(chain, group_name=group, sites=sites), options=options)
            rows[f"{config} K={sites}"] = row = timed(functools.partial(fn, *inputs), 8, world)
            row["stats"] = {k: v for k, v in arfusion.stats().items() if k in ("fused_sites", "dispatch")}
            say(f"chain {config} K={sites}: host {row['host_us']:.1f} us/call, wall {row['wall_us']:.1f}; "
                f"{row['stats']}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shared-gpu", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="N")
    args = p.parse_args()
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    cuda = torch.cuda.is_available()
    if cuda:
        device, backend_name = shared_gpu.init(args.shared_gpu, hang_s=400), "flashinfer"
    else:  # a dry run of the script on CPU: gloo, the torch backend
        dist.init_process_group("gloo")
        device, backend_name, args.shared_gpu = torch.device("cpu"), "torch", False
    rank, world = dist.get_rank(), dist.group.WORLD
    fused_group = world.group_name
    if args.shared_gpu:  # NCCL needs one GPU per rank: each rank alone in a group of its own
        singles = [dist.new_group([r], backend="nccl") for r in range(dist.get_world_size())]
        nccl_group = singles[rank].group_name
    else:
        nccl_group = fused_group
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(0)
    bf16 = dict(dtype=torch.bfloat16, device=device)
    x, residual = torch.randn(1, HIDDEN, **bf16), torch.randn(1, HIDDEN, **bf16)
    w_norm, w_mm = torch.rand(HIDDEN, **bf16) + 0.5, torch.randn(HIDDEN, HIDDEN, **bf16) / 64
    caps = Caps()
    form = execution.form_of(residual, "rms", "none", True)
    results: dict = {"meta": {"shared_gpu": args.shared_gpu, "device": torch.cuda.get_device_name() if cuda else "cpu",
                              "backend": backend_name,
                              "torch": torch.__version__, "world": dist.get_world_size(),
                              "tokens": 1, "hidden": HIDDEN, "runs": RUNS}}

    with torch.no_grad():  # as HF generate()
        # the backend's workspace, made once (collective) before anything is timed
        execution.run_fused(x, residual, w_norm, EPS, fused_group, form, None, backend_name, caps)
        sync()
        backend, _ = execution.resolve(backend_name, device)
        call = execution.Call.of_tensors(form, x, w_norm, dist.get_world_size(), fused_group)

        def unfused_all_reduce():
            t = torch.ops._c10d_functional.all_reduce_(x.clone(), "sum", nccl_group)
            torch.ops._c10d_functional.wait_tensor(t)

        scratch = x.clone()
        baseline = {
            "aten clone (one launch)": lambda: x.clone(),
            "Inductor's all-reduce (all_reduce_ + wait_tensor, with a clone)": unfused_all_reduce,
        }
        ours = {  # arfusion's layers of a fused site, measured again with the kernel skipped
            "the backend's run (FlashInfer: the kernel call + output allocation)":
                lambda: backend.run(call, x, residual, w_norm, EPS, None),
            "execution.run_fused": lambda: execution.run_fused(x, residual, w_norm, EPS, fused_group, form, None,
                                                               backend_name, caps),
            "arfusion::fused_allreduce_rmsnorm": lambda: torch.ops.arfusion.fused_allreduce_rmsnorm.default(
                x, residual, w_norm, EPS, None, fused_group, "rms", "none", None, True, backend_name),
            "arfusion::fused_allreduce_rmsnorm_": lambda: torch.ops.arfusion.fused_allreduce_rmsnorm_.default(
                scratch, residual, w_norm, EPS, None, fused_group, "rms", "none", None, True, backend_name),
        }
        theirs = {}
        if backend_name == "flashinfer":  # FlashInfer's own layers, outputs preallocated
            theirs, direct = flashinfer_layers(backend.workspace(fused_group), backend, x, residual, w_norm)
            ours.update(direct)
        components = {**baseline, **ours, **theirs}
        results["components"] = measure(components, world, say)
        if args.profile:
            for i, (name, fn) in enumerate(components.items()):
                text = profiled(fn, args.profile)
                if rank == 0 and args.out:
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    Path(args.out, f"profile_{i}.txt").write_text(f"{name}: {args.profile} calls\n{text}")

        configs = {"off": ({}, nccl_group), "on": (options_on(backend_name), fused_group)}
        results["chains"] = chains(configs, (x, residual, w_norm, w_mm), world, say)
        if backend_name == "flashinfer":  # the same without the kernel: host time alone, no GPU turns
            skip_kernel()
            say("-- the kernel skipped")
            results["components, kernel skipped"] = measure(ours, world, say)
            results["chains"].update(chains({"on, kernel skipped": configs["on"]}, (x, residual, w_norm, w_mm),
                                            world, say))
        per_site = {}
        for config in {name.split(" K=")[0] for name in results["chains"]}:
            one, many = results["chains"][f"{config} K=1"], results["chains"][f"{config} K=16"]
            per_site[config] = (many["host_us"] - one["host_us"]) / 15
        results["host_us_per_site"] = per_site
        say("host us per site (slope K=1..16): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_site.items())))

    if rank == 0 and args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "site_host_cost.json").write_text(json.dumps(results, indent=1))
    dist.barrier(group=world)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
