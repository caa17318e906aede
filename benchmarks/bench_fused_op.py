"""All-reduce + residual add + RMSNorm: unfused vs arfusion vs FlashInfer, inside CUDA graphs.

    torchrun --nproc-per-node 4 benchmarks/bench_fused_op.py --out results/   # one world size
    python benchmarks/bench_fused_op.py --plot results/bench_w2.json results/bench_w4.json --png bench.png

Per token count (hidden 4096 and 8192, bf16), median microseconds per call, each call one of
100 captured in a CUDA graph (20 above 8 MiB), median over 30 replays (rank 0's clock, ranks
aligned by a barrier before each replay):
  a   NCCL all_reduce (on a copy of the input) + torch.compile'd add+RMSNorm: the probe's
      "unfused_compile" and what Inductor runs for an input it may not overwrite
  a0  NCCL all_reduce in place + the same compiled norm (a model's row-parallel output: no copy)
  b   arfusion as a user gets it: the function compiled with the pass (static shapes), so each
      size is fused or left to Inductor by the dispatch table
  c   arfusion's op with FlashInfer forced at every size (up to 64 MiB per rank)
  u   where b is left unfused: the same function compiled without the pass (Inductor's own
      graph, which b then is too); a / u shows what the harness's (a) costs against it
  a1  where b is left unfused: (a) with the all_reduce issued async (NCCL's own stream, joined
      back by wait(), as a functional collective and so Inductor's graph issue it)
  d   where b is left unfused: arfusion's op declining the call (its own unfused path)
  ur, a0r, br  where b is left unfused, as in a model (the all-reduce input made inside the
      step, here x * 2, so it may be reduced in place): Inductor's graph, eager x * 2 + NCCL in
      place + the compiled norm, and the graph compiled with the pass
With --variants (first hidden only), FlashInfer forced one-shot / two-shot at every size, and for
T <= 512 with PDL off, fp32 accumulation off, and both off (how the probe calls FlashInfer).

With --quant fp8_static fp8_dynamic fp8_group (writes bench_quant_w<world>.json), the same
columns with the norm followed by FP8 quantization spelled as real code spells it (the spellings
the pass matches; only the quantized output and the residual are used):
  a   NCCL all_reduce (on a copy) + torch.compile'd add+RMSNorm+quant
  a0  the same with the all_reduce in place
  b   the function compiled with the pass (static shapes)
  c   arfusion's op with FlashInfer forced (per-group: FlashInfer's norm + one compiled quant kernel)

With --quantized fp8 (writes bench_quantized_w<world>.json), the quantized all-reduce at prefill
message sizes (--mib, per rank, hidden 4096: tokens = MiB * 2^20 / (4096 * 2)), bf16:
  a0   NCCL all_reduce in place + torch.compile'd add+RMSNorm
  c    arfusion's op with FlashInfer's exact fused kernel forced (it may decline: see c_dispatch)
  b    the function compiled with the pass and quantized_allreduce="fp8" (static shapes): the
       dispatch table and the quantized crossover decide, as for a user
  q    arfusion's op with the quantized all-reduce forced (quantized_min_bytes=0)
  fi_q FlashInfer's quantized_all_reduce called directly + the same compiled norm
Each with what ran (stats()["dispatch"]) and the norm output's relative error against a0's. The
exact path ("ex") is what arfusion takes without quantization: c where the table fuses, else a0.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192)
EPS = 1e-6
# No NVLink multicast anywhere (NCCL NVLS, torch symmetric memory, NVSHMEM): as .device/setup.sh.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def with_pass() -> dict:
    """Inductor options of the "(b)" columns: the pass as a user enables it."""
    import arfusion

    return arfusion.inductor_options(arfusion.PassConfig(enable_allreduce_fusion=True, backend="auto"))


def hf_rms_norm(h, weight):
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


def add_norm(y, residual, weight):
    h = residual + y
    return hf_rms_norm(h, weight), h


FP8 = torch.float8_e4m3fn


def quantize(form, normed, scale):
    """FP8 quantization of the norm output, spelled as the traced real code spells it."""
    if form == "fp8_static":  # FP8 checkpoints' static activation quant, a 0-d fp32 scale
        return [(normed / scale).clamp(-448, 448).to(FP8)]
    fmax = torch.finfo(FP8).max
    if form == "fp8_dynamic":  # torchao 0.18 Float8DynamicActivationFloat8WeightConfig, PerRow
        amax = normed.abs().amax(dim=normed.dim() - 1, keepdim=True)
        row_scale = (amax / fmax).to(torch.float32)
        return [(normed.to(torch.float32) / row_scale).clamp(-fmax, fmax).to(FP8), row_scale]
    x = normed.float()  # per-group 128, DeepSeek-style act quant
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // 128, 128)
    group_scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / fmax
    return [(groups / group_scale).clamp(-fmax, fmax).to(FP8).reshape(x.shape), group_scale.squeeze(-1)]


def add_norm_quant(form):
    def fn(y, residual, weight, scale):
        h = residual + y
        return [h, *quantize(form, hf_rms_norm(h, weight), scale)]

    return fn


def make_quant_model_fn(group_name, form):
    from arfusion.reference import all_reduce_sum

    def layer_boundary(x, residual, weight, scale):  # residual, quant[, scale]
        h = residual + all_reduce_sum(x, group_name)
        return [h, *quantize(form, hf_rms_norm(h, weight), scale)]

    return layer_boundary


def make_model_fn(group_name, produce_input=False):
    from arfusion.reference import all_reduce_sum

    def layer_boundary(x, residual, weight):  # how a decoder layer ends, as the graph sees it
        if produce_input:  # as a row-parallel matmul's output: an intermediate, reducible in place
            x = x * 2
        h = residual + all_reduce_sum(x, group_name)
        return hf_rms_norm(h, weight), h

    return layer_boundary


@contextmanager
def knobs(backend, **values):
    saved = {k: getattr(backend, k) for k in values}
    for k, v in values.items():
        setattr(backend, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(backend, k, v)


def rel_err(got, want):
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def dispatch_since(before: dict) -> dict:
    """arfusion.stats()["dispatch"] counts added since `before` (an earlier arfusion.stats())."""
    import arfusion

    old = before["dispatch"]
    return {k: v - old.get(k, 0) for k, v in arfusion.stats()["dispatch"].items() if v != old.get(k, 0)}


def init_distributed():
    """One process per GPU under torchrun; (rank, world, device, print-on-rank-0)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    torch._dynamo.config.recompile_limit = 1024  # one compile per token count and variant
    torch._dynamo.config.accumulated_recompile_limit = 8192
    torch._inductor.config.fx_graph_cache = False  # a cache hit would skip the pass
    say = print if rank == 0 else (lambda *a, **k: None)
    return rank, world, device, say


def run(args):
    import arfusion
    from arfusion import reference, tuning
    from arfusion.backends import flashinfer_dispatch as dispatch
    from arfusion.backends import get_backend
    from arfusion.backends.base import Call, Site

    rank, world, device, say = init_distributed()
    group, gname = dist.group.WORLD, dist.group.WORLD.group_name
    backend = get_backend("flashinfer")
    site = Site(residual=True, norm="rms")
    say(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, world {world}, "
        f"calls/graph {args.calls or 'auto'}, replays {args.replays}", flush=True)

    norm_a = torch.compile(add_norm, dynamic=False)
    model_b = torch.compile(make_model_fn(gname), dynamic=False, options=with_pass())
    model_u = torch.compile(make_model_fn(gname), dynamic=False)
    model_ur = torch.compile(make_model_fn(gname, produce_input=True), dynamic=False)
    model_br = torch.compile(make_model_fn(gname, produce_input=True), dynamic=False, options=with_pass())

    def timed(fn):
        # Ranks start a replay a few microseconds apart and the first call absorbs that skew:
        # many calls per graph make it small next to a small call's own time.
        calls = args.calls or (100 if nbytes <= 8 * 2**20 else 20)
        return tuning.time_in_graph(fn, group, calls, args.replays)

    rows, started = [], time.time()
    for hidden in args.hidden:
        g = torch.Generator(device=device)
        g.manual_seed(17)
        weight = (1 + 0.1 * torch.randn(hidden, device=device, generator=g)).to(torch.bfloat16)
        tokens = [t for t in args.tokens if hidden < 8192 or t in args.tokens_8192]
        for t in tokens:
            nbytes = t * hidden * 2
            g.manual_seed(1000 + rank)
            x = torch.randn(t, hidden, device=device, dtype=torch.bfloat16, generator=g)
            g.manual_seed(2000)
            res = torch.randn(t, hidden, device=device, dtype=torch.bfloat16, generator=g)
            x_inplace = x.clone()
            row = {"world": world, "hidden": hidden, "tokens": t, "bytes_per_rank": nbytes}

            def unfused_copy():
                y = x.clone()
                dist.all_reduce(y, group=group)
                return norm_a(y, res, weight)

            def unfused_inplace():
                dist.all_reduce(x_inplace, group=group)
                return norm_a(x_inplace, res, weight)

            row["a_us"] = timed(unfused_copy)
            row["a0_us"] = timed(unfused_inplace)

            call = Call(site=site, tokens=t, hidden=hidden, dtype=torch.bfloat16, weight_dtype=torch.bfloat16,
                        world_size=world, device=device, group_name=gname)
            reason = backend.why_not(call) if not isinstance(backend, str) else backend
            row["b_path"] = ("fused one-shot" if backend.use_oneshot(call) else "fused two-shot") if reason is None else "unfused"
            before = arfusion.stats()
            row["b_us"] = timed(lambda: model_b(x, res, weight))
            row["b_dispatch"] = dispatch_since(before)
            want = reference.unfused(x, res, weight, EPS, gname, site)
            row["b_err"] = rel_err(model_b(x, res, weight)[0], want[1])
            if row["b_path"] == "unfused":
                row["u_us"] = timed(lambda: model_u(x, res, weight))

                def unfused_async():
                    y = x.clone()
                    dist.all_reduce(y, group=group, async_op=True).wait()
                    return norm_a(y, res, weight)

                def unfused_inplace_produced():
                    y = x * 2
                    dist.all_reduce(y, group=group)
                    return norm_a(y, res, weight)

                row["a1_us"] = timed(unfused_async)
                row["d_us"] = timed(lambda: tuning.fused_step(x, res, weight, EPS, gname, 0))
                row["ur_us"] = timed(lambda: model_ur(x, res, weight))
                row["a0r_us"] = timed(unfused_inplace_produced)
                row["br_us"] = timed(lambda: model_br(x, res, weight))
                row["br_err"] = rel_err(model_br(x, res, weight)[0], model_ur(x, res, weight)[0])

            if nbytes <= dispatch.HARD_MAX_FUSED_BYTES and not isinstance(backend, str):
                forced = lambda: tuning.fused_step(x, res, weight, EPS, gname, dispatch.HARD_MAX_FUSED_BYTES)
                row["c_us"] = timed(forced)
                row["c_err"] = rel_err(forced()[1], want[1])
                if args.variants and hidden == args.hidden[0]:
                    with knobs(backend, force_oneshot=True):
                        row["fi_1shot_us"] = timed(forced)
                    if t > world:
                        with knobs(backend, force_oneshot=False):
                            row["fi_2shot_us"] = timed(forced)
                    if t <= 512:
                        for name, kw in (("nopdl", dict(launch_with_pdl=False)),
                                         ("nofp32acc", dict(fp32_acc=False)),
                                         ("probe_like", dict(launch_with_pdl=False, fp32_acc=False))):
                            for shot, oneshot in (("1shot", True), ("2shot", False)):
                                if oneshot or t > world:
                                    with knobs(backend, force_oneshot=oneshot, **kw):
                                        row[f"fi_{shot}_{name}_us"] = timed(forced)
            rows.append(row)
            say(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    dist.barrier()
    if not isinstance(backend, str):
        backend.close()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"bench_w{world}.json")
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "world": world,
                "calls_per_graph": args.calls or "100 up to 8 MiB, else 20", "replays": args.replays,
                "seconds": round(time.time() - started)}
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(format_table(rows))
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


def save_rows(rank, out_dir, path, meta, started, rows):
    """Rank 0 rewrites the JSON after every row: a stage cut short still leaves its rows."""
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"meta": {**meta, "seconds": round(time.time() - started)}, "rows": rows}, f, indent=1)


def finish(rank, backend, table, path):
    """Free FlashInfer's buffers on every rank, print the table, end the process group."""
    dist.barrier()
    backend.close()
    if rank == 0:
        print(table)
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


def run_quant(args):
    import arfusion
    from arfusion import quant, reference, tuning
    from arfusion.backends import flashinfer_dispatch as dispatch
    from arfusion.backends import get_backend
    from arfusion.backends.base import Call, Site

    rank, world, device, say = init_distributed()
    group, gname = dist.group.WORLD, dist.group.WORLD.group_name
    backend = get_backend("flashinfer")
    hidden = args.hidden[0]
    say(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, world {world}, hidden {hidden}, "
        f"quant {args.quant}, calls/graph {args.calls or 'auto'}, replays {args.replays}", flush=True)
    path = os.path.join(args.out, f"bench_quant_w{world}.json")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "world": world, "hidden": hidden,
            "calls_per_graph": args.calls or "100 up to 8 MiB, else 20", "replays": args.replays}
    rows, started = [], time.time()
    g = torch.Generator(device=device)
    g.manual_seed(17)
    weight = (1 + 0.1 * torch.randn(hidden, device=device, generator=g)).to(torch.bfloat16)
    scale = torch.tensor(0.02, device=device)  # 0-d fp32, as a static checkpoint's input scale
    for form in args.quant:
        site = Site(residual=True, norm="rms", quant=form, emit_norm=False)
        q_scale = scale if form == "fp8_static" else None
        norm_a = torch.compile(add_norm_quant(form), dynamic=False)
        model_b = torch.compile(make_quant_model_fn(gname, form), dynamic=False, options=with_pass())
        for t in args.tokens:
            nbytes = t * hidden * 2
            calls = args.calls or (100 if nbytes <= 8 * 2**20 else 20)
            g.manual_seed(1000 + rank)
            x = torch.randn(t, hidden, device=device, dtype=torch.bfloat16, generator=g)
            g.manual_seed(2000)
            res = torch.randn(t, hidden, device=device, dtype=torch.bfloat16, generator=g)
            x_inplace = x.clone()
            row = {"world": world, "hidden": hidden, "tokens": t, "quant": form, "bytes_per_rank": nbytes}

            def unfused_copy():
                y = x.clone()
                dist.all_reduce(y, group=group)
                return norm_a(y, res, weight, scale)

            def unfused_inplace():
                dist.all_reduce(x_inplace, group=group)
                return norm_a(x_inplace, res, weight, scale)

            def quant_err(outs):
                """rel L2 of the dequantized output vs the eager reference (and of the scale)."""
                want = dict(zip(site.outputs(), reference.unfused(x, res, weight, EPS, gname, site, q_scale)))
                got = dict(zip(site.outputs(), outs))
                deq = [quant.dequantize(d["quant"], d.get("scale", q_scale), form) for d in (got, want)]
                err = {"quant": rel_err(deq[0], deq[1])}
                if "scale" in want:
                    err["scale"] = rel_err(got["scale"], want["scale"])
                return err

            row["a_us"] = tuning.time_in_graph(unfused_copy, group, calls, args.replays)
            row["a0_us"] = tuning.time_in_graph(unfused_inplace, group, calls, args.replays)
            call = Call(site=site, tokens=t, hidden=hidden, dtype=torch.bfloat16, weight_dtype=torch.bfloat16,
                        world_size=world, device=device, group_name=gname)
            reason = backend.why_not(call)
            row["b_path"] = ("fused one-shot" if backend.use_oneshot(call) else "fused two-shot") if reason is None else "unfused"
            before = arfusion.stats()
            try:  # an error here is the same on every rank (same shapes): record it, go on
                row["b_us"] = tuning.time_in_graph(lambda: model_b(x, res, weight, scale), group, calls, args.replays)
                row["b_err"] = quant_err(model_b(x, res, weight, scale))
            except Exception as e:
                row["b_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            after = arfusion.stats()
            row["b_dispatch"] = dispatch_since(before)
            row["b_patterns"] = sorted(k for k, v in after["by_pattern"].items() if v != before["by_pattern"].get(k, 0))
            if nbytes <= dispatch.HARD_MAX_FUSED_BYTES:
                forced = lambda: torch.ops.arfusion.fused_allreduce_rmsnorm(
                    x, res, weight, EPS, None, gname, "rms", form, q_scale, False, "flashinfer",
                    dispatch.HARD_MAX_FUSED_BYTES)
                try:
                    row["c_us"] = tuning.time_in_graph(forced, group, calls, args.replays)
                    row["c_err"] = quant_err(forced())
                except Exception as e:
                    row["c_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            say(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            save_rows(rank, args.out, path, meta, started, rows)
    finish(rank, backend, format_table(rows), path)


def run_quantized(args):
    import importlib

    import arfusion
    from arfusion import tuning
    from arfusion.backends import flashinfer_dispatch as dispatch
    from arfusion.backends import get_backend
    from arfusion.backends.base import Call, Site

    os.environ.update(NO_MULTICAST)  # before any communicator or symmetric buffer exists
    rank, world, device, say = init_distributed()
    group, gname = dist.group.WORLD, dist.group.WORLD.group_name
    backend = get_backend("flashinfer")  # FlashInfer's "trtllm" backend only: never "auto" / "mnnvl"
    if isinstance(backend, str):
        raise SystemExit(f"FlashInfer unavailable: {backend}")
    fi_quantized = importlib.import_module("flashinfer.comm.quantized_allreduce").quantized_all_reduce
    level, hidden = args.quantized, 4096
    say(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, world {world}, hidden {hidden}, "
        f"quantized {level}, MiB {args.mib}, calls/graph {args.calls or 'auto'}, replays {args.replays}", flush=True)
    path = os.path.join(args.out, f"bench_quantized_w{world}.json")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "world": world, "hidden": hidden,
            "level": level, "calls_per_graph": args.calls or "100 up to 8 MiB, else 20", "replays": args.replays}
    norm_a = torch.compile(add_norm, dynamic=False)
    model_b = torch.compile(make_model_fn(gname), dynamic=False, options=arfusion.inductor_options(
        arfusion.PassConfig(enable_allreduce_fusion=True, backend="auto", quantized_allreduce=level)))
    g = torch.Generator(device=device)
    g.manual_seed(17)
    weight = (1 + 0.1 * torch.randn(hidden, device=device, generator=g)).to(torch.bfloat16)
    rows, started = [], time.time()
    for mib in args.mib:
        t = int(mib * 2**20) // (hidden * 2)
        nbytes = t * hidden * 2
        calls = args.calls or (100 if nbytes <= 8 * 2**20 else 20)
        g.manual_seed(1000 + rank)
        x = torch.randn(t, hidden, device=device, dtype=torch.bfloat16, generator=g)
        g.manual_seed(2000)
        res = torch.randn(t, hidden, device=device, dtype=torch.bfloat16, generator=g)
        x_inplace, reduced = x.clone(), x.clone()
        dist.all_reduce(reduced, group=group)
        want = norm_a(reduced, res, weight)[0]  # a0's norm output on fresh data
        row = {"world": world, "hidden": hidden, "mib": mib, "tokens": t, "bytes_per_rank": nbytes}

        def measure(key, fn, norm_at):
            """row[key_us], the rel error of the norm output (fn()[norm_at]) vs a0's and what ran;
            an error is the same on every rank (same shapes): recorded, the run goes on."""
            before = arfusion.stats()
            try:
                row[f"{key}_us"] = tuning.time_in_graph(fn, group, calls, args.replays)
                if norm_at is not None:
                    row[f"{key}_err"] = rel_err(fn()[norm_at], want)
            except Exception as e:
                row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if ran := dispatch_since(before):
                row[f"{key}_dispatch"] = ran

        def unfused_inplace():
            dist.all_reduce(x_inplace, group=group)
            return norm_a(x_inplace, res, weight)

        measure("a0", unfused_inplace, None)  # x_inplace grows with every call: no error
        measure("c", lambda: tuning.fused_step(x, res, weight, EPS, gname, dispatch.HARD_MAX_FUSED_BYTES), 1)
        measure("b", lambda: model_b(x, res, weight), 0)
        # q before fi_q: arfusion's collective warm-up makes FlashInfer's symmetric buffer at its
        # largest size once, so the direct calls never grow it between captures.
        measure("q", lambda: tuning.fused_step(x, res, weight, EPS, gname, -1, quantized=level), 1)
        measure("fi_q", lambda: norm_a(fi_quantized(x, group), res, weight), 0)
        call = Call(site=Site(residual=True, norm="rms"), tokens=t, hidden=hidden, dtype=torch.bfloat16,
                    weight_dtype=torch.bfloat16, world_size=world, device=device, group_name=gname)
        fuses = backend.why_not(call) is None
        row["exact_path"] = ("fused one-shot" if backend.use_oneshot(call) else "fused two-shot") if fuses else "unfused"
        row["exact_us"] = row.get("c_us" if fuses else "a0_us")
        for name, num, den in (("q_vs_a0", "a0_us", "q_us"), ("q_vs_exact", "exact_us", "q_us"),
                               ("b_vs_exact", "exact_us", "b_us"), ("fi_q_vs_q", "fi_q_us", "q_us")):
            if row.get(num) and row.get(den):
                row[name] = row[num] / row[den]
        rows.append(row)
        say(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        save_rows(rank, args.out, path, meta, started, rows)
    finish(rank, backend, format_quantized_table(rows), path)


def format_quantized_table(rows):
    """Speedups are time ratios (>1: the second one named is faster): a0/q, ex/q, ex/b, fi_q/q."""
    lines = [f"{'MiB':>4} {'T':>5} {'a0 us':>8} {'c us':>8} {'b us':>8} {'q us':>8} {'fi_q us':>8} "
             f"{'a0/q':>6} {'ex/q':>6} {'ex/b':>6} {'fi_q/q':>6} {'q err':>8}  exact path; b ran; c ran"]
    for r in rows:
        def us(key):
            return f"{r[key]:8.1f}" if key in r else f"{'-':>8}"

        def ratio(key):
            return f"{r[key]:5.2f}x" if key in r else f"{'-':>6}"

        def ran(key):
            return ", ".join(f"{k} {v}" for k, v in r.get(f"{key}_dispatch", {}).items()) or r.get(f"{key}_error", "-")

        err = f"{r['q_err']:8.1e}" if "q_err" in r else f"{'-':>8}"
        lines.append(f"{r['mib']:>4g} {r['tokens']:>5} {us('a0_us')} {us('c_us')} {us('b_us')} {us('q_us')} "
                     f"{us('fi_q_us')} {ratio('q_vs_a0')} {ratio('q_vs_exact')} {ratio('b_vs_exact')} "
                     f"{ratio('fi_q_vs_q')} {err}  {r['exact_path']}; {ran('b')}; {ran('c')}")
    return "\n".join(lines)


def format_table(rows):
    head = (f"{'quant':>11} {'world':>5} {'hidden':>6} {'T':>5} {'MiB':>6} {'a us':>7} {'a0 us':>7} {'b us':>7} "
            f"{'c us':>7} {'u us':>7} {'a1 us':>7} {'d us':>7} {'ur us':>7} {'a0r us':>7} {'br us':>7} {'a/b':>6} {'a0/b':>6} {'a/c':>6} {'u/b':>6} {'1shot':>7} {'2shot':>7}  b path")
    lines = [head]
    for r in rows:
        def us(key):
            return f"{r[key]:7.1f}" if key in r else f"{'-':>7}"

        def ratio(num, den):
            return f"{r[num] / r[den]:5.2f}x" if num in r and den in r else f"{'-':>6}"

        lines.append(f"{r.get('quant', 'none'):>11} {r['world']:>5} {r['hidden']:>6} {r['tokens']:>5} {r['bytes_per_rank'] / 2**20:6.2f} "
                     f"{us('a_us')} {us('a0_us')} {us('b_us')} {us('c_us')} {us('u_us')} {us('a1_us')} {us('d_us')} "
                     f"{us('ur_us')} {us('a0r_us')} {us('br_us')} {ratio('a_us', 'b_us')} "
                     f"{ratio('a0_us', 'b_us')} {ratio('a_us', 'c_us')} {ratio('u_us', 'b_us')} {us('fi_1shot_us')} "
                     f"{us('fi_2shot_us')}  "
                     f"{r['b_path']}")
    return "\n".join(lines)


def plot(paths, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [json.load(open(p)) for p in paths]
    fig, axes = plt.subplots(len(data), 2, figsize=(13, 4.2 * len(data)), squeeze=False)
    for (ax_us, ax_x), d in zip(axes, data):
        world = d["meta"]["world"]
        for hidden, style in ((4096, "-"), (8192, "--")):
            rows = [r for r in d["rows"] if r["hidden"] == hidden]
            if not rows:
                continue
            for key, label, color in (("a_us", "(a) NCCL + compiled norm", "tab:gray"),
                                      ("a0_us", "(a0) same, in place", "tab:brown"),
                                      ("b_us", "(b) arfusion as dispatched", "tab:blue"),
                                      ("c_us", "(c) FlashInfer forced", "tab:orange")):
                pts = [(r["tokens"], r[key]) for r in rows if key in r]
                ax_us.plot(*zip(*pts), style, marker=".", color=color, label=f"{label}, H={hidden}")
            for key, label, color in (("b_us", "(b) arfusion", "tab:blue"), ("c_us", "(c) FlashInfer forced", "tab:orange")):
                pts = [(r["tokens"], r["a_us"] / r[key]) for r in rows if key in r]
                ax_x.plot(*zip(*pts), style, marker=".", color=color, label=f"{label}, H={hidden}")
        ax_us.set(xscale="log", yscale="log", xlabel="tokens", ylabel="us per call (CUDA graph)",
                  title=f"{d['meta']['device']}, TP={world}, bf16")
        ax_x.axhline(1.0, color="black", lw=0.8)
        ax_x.axhline(0.97, color="red", lw=0.8, ls=":")
        ax_x.set(xscale="log", xlabel="tokens", ylabel="speedup vs (a)", title=f"TP={world}: (a) / variant")
        ax_us.legend(fontsize=6)
        ax_x.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--tokens-8192", type=int, nargs="+", default=[1, 8, 32, 128, 256, 512, 1024, 2048, 4096, 8192],
                   help="token counts measured at hidden >= 8192")
    p.add_argument("--variants", action="store_true",
                   help="also FlashInfer one-/two-shot, PDL, fp32-acc variants (first --hidden only)")
    p.add_argument("--calls", type=int, default=0, help="calls per graph (default: 100 up to 8 MiB, else 20)")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--quant", nargs="+", choices=("fp8_static", "fp8_dynamic", "fp8_group"),
                   help="quant rows instead (first --hidden only): NCCL + compiled add+RMSNorm+quant vs fused")
    p.add_argument("--quantized", choices=("fp8",),
                   help="quantized all-reduce rows instead (bench_quantized_w<world>.json): exact paths vs it")
    p.add_argument("--mib", type=float, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                   help="per-rank message sizes of --quantized, MiB (hidden 4096, bf16)")
    p.add_argument("--plot", nargs="+", help="bench_w*.json files to plot instead of measuring")
    p.add_argument("--png", default="bench_fused_op.png")
    args = p.parse_args()
    if args.plot:
        plot(args.plot, args.png)
    elif args.quantized:
        run_quantized(args)
    elif args.quant:
        run_quant(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
