"""GPU checks of FP8 quant sites on FlashInfer vs arfusion.quant's reference (run under torchrun).

    torchrun --nproc-per-node 2 tests/gpu/check_quant.py      # or 4

Every FP8 form (static, dynamic per-token, per-group 128) x residual or not x norm output or
not (plus the Gemma norm once per form), at token counts on both sides of the dispatch
thresholds, eagerly and replayed from a CUDA graph on fresh data. Dequantized outputs are
compared (see `compare`), scales too (rel L2 < 1e-2), residual and norm as the plain checks do.
A declined call (a cap of 0) then checks the compiled fallback, eagerly and inside a capture.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_flashinfer as cf  # noqa: E402

import arfusion.ops  # noqa: E402,F401  (registers torch.ops.arfusion.*)
from arfusion import quant, reference  # noqa: E402
from arfusion.backends import get_backend  # noqa: E402
from arfusion.core import Form  # noqa: E402

FORMS = ("fp8_static", "fp8_dynamic", "fp8_group")
SITES = [Form(r, "rms", q, e) for q in FORMS for r in (True, False) for e in (False, True)]
SITES += [Form(True, "gemma_rms", q, False) for q in FORMS]
# Declined calls compile one fallback kernel per site: a few sites keep that short.
FALLBACK_SITES = [Form(True, "rms", "fp8_static", False), Form(False, "rms", "fp8_dynamic", True),
                  Form(True, "gemma_rms", "fp8_group", True)]
SCALE = 0.02  # static input scale: |norm| up to ~5 maps to ~250, inside e4m3's 448


def op(x, res, w, site, group_name, max_bytes, scale):
    return torch.ops.arfusion.fused_allreduce_rmsnorm(
        x=x, residual=res, weight=w, eps=cf.EPS, eps_tensor=None, group_name=group_name, norm=site.norm,
        quant=site.quant, quant_scale=scale, emit_norm=site.emit_norm, backend="flashinfer", max_bytes=max_bytes)


def compare(site, got, want, scale, weight, fused):
    """Failure strings (empty when within tolerance) and the errors seen.

    Two views of the quantized output: end to end against the reference on the same inputs
    ("quant", "scale": the bf16 all-reduce's summation order differs between NCCL and the fused
    kernel, and a flipped bf16 rounding of the norm moves an FP8 value one step: ~1-3e-2 rel L2
    at T=1), and against the reference quantization of the op's own norm ("quant_own",
    "scale_own": the quantization alone: near exact where FlashInfer emits the norm it quantized;
    Inductor's compiled fallback quantizes the fp32 value before it rounds the norm to bf16)."""
    got, want = dict(zip(site.outputs(), got)), dict(zip(site.outputs(), want))
    bad, errs = [], {}
    for name in ("residual", "norm"):
        if name in want:
            rel, mx = cf.error(got[name], want[name])
            errs[name] = rel
            if rel > 1e-2 or mx > 5e-2:
                bad.append(f"{name} rel {rel:.2e} max {mx:.2e}")
    if got["quant"].dtype != torch.float8_e4m3fn or got["quant"].shape != want["quant"].shape:
        bad.append(f"quant {got['quant'].dtype} {tuple(got['quant'].shape)}")
    # the op's own norm where it emits one, else recomputed from its residual (that recompute
    # rounds the norm as the reference does, which a kernel need not: then a few values flip)
    own_norm = got["norm"] if site.emit_norm else reference.rms_norm(got["residual"], weight, cf.EPS, site.norm)
    own = {"quant": None, **quant.quantize(own_norm, site.quant, scale)}
    deq = {key: quant.dequantize(d["quant"], d.get("scale", scale), site.quant)
           for key, d in (("got", got), ("want", want), ("own", own))}
    errs["quant"], errs["quant_own"] = cf.error(deq["got"], deq["want"])[0], cf.error(deq["got"], deq["own"])[0]
    if errs["quant"] > 4e-2 or errs["quant_own"] > (5e-3 if site.emit_norm and fused else 4e-2):
        bad.append(f"dequantized rel {errs['quant']:.2e} (own norm {errs['quant_own']:.2e})")
    if "scale" in want:
        if got["scale"].shape != want["scale"].shape or got["scale"].dtype != torch.float32:
            bad.append(f"scale {got['scale'].dtype} {tuple(got['scale'].shape)}")
        errs["scale"], errs["scale_own"] = cf.error(got["scale"], want["scale"])[0], cf.error(got["scale"], own["scale"])[0]
        if errs["scale"] > 1e-2 or errs["scale_own"] > 1e-2:
            bad.append(f"scale rel {errs['scale']:.2e} (own norm {errs['scale_own']:.2e})")
    return bad, errs


def run_once(x, res, w, site, name, max_bytes, q_scale, in_graph, tokens, device):
    """[(op outputs, reference outputs)]: one eager call, or two graph replays on fresh data."""
    if not in_graph:
        return [(op(x, res, w, site, name, max_bytes, q_scale),
                 reference.unfused(x, res, w, cf.EPS, name, site, q_scale))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(x, res, w, site, name, max_bytes, q_scale)  # workspace and compiled kernels appear here
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = op(x, res, w, site, name, max_bytes, q_scale)
    pairs = []
    for seed in (1, 2):
        nx, nres, _ = cf.inputs(tokens, 4096, site, device, seed=7919 * seed + tokens)
        x.copy_(nx)
        if res is not None:
            res.copy_(nres)
        graph.replay()
        torch.cuda.synchronize()
        pairs.append(([t.clone() for t in got], reference.unfused(x, res, w, cf.EPS, name, site, q_scale)))
    del graph
    return pairs


def check_sites(checks, backend, group, tokens_list, in_graph, max_bytes, label, sites=SITES):
    device = torch.device("cuda", torch.cuda.current_device())
    world, name = group.size(), group.group_name
    scale = torch.tensor(SCALE, device=device)
    failures, runs, fused, worst_all = [], 0, 0, {}
    for tokens in tokens_list:
        for site in sites:
            x, res, w = cf.inputs(tokens, 4096, site, device, seed=tokens)
            q_scale = scale if site.quant == "fp8_static" else None
            want_path = cf.expected_path(backend, x, site, name, world, max_bytes)
            before = arfusion.stats()["dispatch"]
            try:
                pairs = run_once(x, res, w, site, name, max_bytes, q_scale, in_graph, tokens, device)
            except Exception as e:  # same shapes on every rank: all raise alike, go on to the next
                failures.append(f"T={tokens} {site.name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            ran = cf.dispatched(before)
            runs += 1
            fused += "flashinfer" in ran
            if want_path not in ran:
                failures.append(f"T={tokens} {site.name}: expected {want_path}, ran {ran}")
            for got_, want_ in pairs:
                bad, worst = compare(site, got_, want_, q_scale, w, want_path == "flashinfer")
                for k, v in worst.items():
                    key = f"{site.quant}/{k}"
                    worst_all[key] = max(worst_all.get(key, 0.0), v)
                if bad:
                    failures.append(f"T={tokens} {site.name} ({want_path}): " + ", ".join(bad))
    checks.record(label, not failures,
                  f"{runs} runs, {fused} on FlashInfer; worst rel {json.dumps({k: float(f'{v:.2e}') for k, v in sorted(worst_all.items())})}; "
                  + ("; ".join(failures[:6]) or "all within tolerance"))


def main():
    rank, world, device = cf.start_distributed(recompile_limit=64)
    checks = cf.Checks(rank)
    backend = get_backend("flashinfer")
    group = dist.group.WORLD
    # up to the fuse cap, both sides of the one-shot switch (H200 table), T=1 and T=world
    tokens = {2: [1, 2, 3, 64, 128, 4096], 4: [1, 4, 5, 128, 256, 257, 1024]}[world]
    over_cap = {2: 4097, 4: 1025}[world]
    check_sites(checks, backend, group, tokens, False, None, "quant eager")
    check_sites(checks, backend, group, tokens, True, None, "quant in CUDA graph")
    # declined at run time (past the cap, or a cap of 0): NCCL + compiled add+RMSNorm+quant,
    # compiled on the eager call, replayed inside a capture
    check_sites(checks, backend, group, [over_cap], False, None, "quant over the cap eager", FALLBACK_SITES)
    check_sites(checks, backend, group, [64, 300, over_cap], True, 0, "quant fallback in CUDA graph", FALLBACK_SITES)
    dist.barrier()
    backend.close()
    cf.finish(checks, device, world, "GPU QUANT CHECKS", "gpu_quant_checks")


if __name__ == "__main__":
    main()
