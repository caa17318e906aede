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
  q    arfusion's op with the quantized all-reduce forced (codec_min_bytes=0)
  fi_q FlashInfer's quantized_all_reduce called directly + the same compiled norm
With --codec-knobs [KNOB=V1,V2 ...] also fi_q under every combination of FlashInfer's launch knobs
(flashinfer_dispatch.CODEC_KNOBS: block size, blocks, warps, P2P phase 3; none changes the numbers),
each row's fastest (knobs_best_us, knobs_best) and the exact path against it (ex_vs_knobs_best).
Each with what ran (stats()["dispatch"]) and the norm output's relative error against a0's. The
exact path ("ex") is what arfusion takes without quantization: c where the table fuses, else a0.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, also under torchrun

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import dispatch_since, no_multicast, rel_err, rounded, save_json  # noqa: E402
from arfusion.decisions import Reason  # noqa: E402
from fused_op_cases import (EPS, TOKENS, add_norm, add_norm_quant, calls_per_graph, finish,  # noqa: E402
                            init_distributed, inputs, knob_grid, launch_variant, make_model_fn,
                            make_quant_model_fn, norm_weight, save_rows, with_pass)
from fused_op_report import format_codec_table, format_table, plot  # noqa: E402


def fused_path(backend, call) -> str:
    """What the dispatch table makes of a call: one-shot, two-shot, or left unfused."""
    if isinstance(backend, Reason) or backend.why_not(call) is not None:
        return "unfused"
    return "fused one-shot" if backend.use_oneshot(call) else "fused two-shot"


def run(args):
    import arfusion
    from arfusion import reference, tuning
    from arfusion.backends import flashinfer_dispatch as dispatch
    from arfusion.backends import get_backend
    from arfusion.decisions import Reason
    from arfusion.core import Call, Form

    rank, world, device, say = init_distributed()
    group, gname = dist.group.WORLD, dist.group.WORLD.group_name
    backend = get_backend("flashinfer")
    site = Form(residual=True, norm="rms")
    say(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, world {world}, "
        f"calls/graph {args.calls or 'auto'}, replays {args.replays}")

    norm_a = torch.compile(add_norm, dynamic=False)
    model_b = torch.compile(make_model_fn(gname), dynamic=False, options=with_pass())
    model_u = torch.compile(make_model_fn(gname), dynamic=False)
    model_ur = torch.compile(make_model_fn(gname, produce_input=True), dynamic=False)
    model_br = torch.compile(make_model_fn(gname, produce_input=True), dynamic=False, options=with_pass())

    rows, started = [], time.time()
    g = torch.Generator(device=device)
    for hidden in args.hidden:
        weight = norm_weight(g, hidden, device)
        tokens = [t for t in args.tokens if hidden < 8192 or t in args.tokens_8192]
        for t in tokens:
            nbytes = t * hidden * 2
            x, res = inputs(g, rank, t, hidden, device)
            x_inplace = x.clone()
            row = {"world": world, "hidden": hidden, "tokens": t, "bytes_per_rank": nbytes}

            def timed(fn):
                return tuning.time_in_graph(fn, group, calls_per_graph(args, nbytes), args.replays)

            def unfused_copy():
                y = x.clone()
                dist.all_reduce(y, group=group)
                return norm_a(y, res, weight)

            def unfused_inplace():
                dist.all_reduce(x_inplace, group=group)
                return norm_a(x_inplace, res, weight)

            row["a_us"] = timed(unfused_copy)
            row["a0_us"] = timed(unfused_inplace)

            row["b_path"] = fused_path(backend, Call.of_tensors(site, x, weight, world, gname))
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

            if nbytes <= dispatch.HARD_MAX_FUSED_BYTES and not isinstance(backend, Reason):
                forced = lambda: tuning.fused_step(x, res, weight, EPS, gname, dispatch.HARD_MAX_FUSED_BYTES)
                row["c_us"] = timed(forced)
                row["c_err"] = rel_err(forced()[1], want[1])
                if args.variants and hidden == args.hidden[0]:
                    def kernel(oneshot, **knobs):
                        """FlashInfer's kernel alone, one-shot or two-shot as the Call says, with
                        these launch knobs: overrides passed explicitly, the cached backend untouched."""
                        call = Call.of_tensors(site, x, weight, world, gname, oneshot=oneshot)
                        fi = launch_variant(backend, **knobs)
                        reason = fi.prepare(call, dispatch.HARD_MAX_FUSED_BYTES)  # eager, before any capture
                        if reason:
                            raise RuntimeError(f"FlashInfer declined {call}: {reason}")
                        return lambda: tuning.kernel_step(fi, call, x, res, weight, EPS)

                    row["fi_1shot_us"] = timed(kernel(True))
                    if t > world:  # two-shot splits the tokens over the ranks
                        row["fi_2shot_us"] = timed(kernel(False))
                    if t <= 512:
                        for name, kw in (("nopdl", dict(launch_with_pdl=False)),
                                         ("nofp32acc", dict(fp32_acc=False)),
                                         ("probe_like", dict(launch_with_pdl=False, fp32_acc=False))):
                            for shot, oneshot in (("1shot", True), ("2shot", False)):
                                if oneshot or t > world:
                                    row[f"fi_{shot}_{name}_us"] = timed(kernel(oneshot, **kw))
            rows.append(row)
            say(json.dumps(rounded(row)))
    dist.barrier()
    if not isinstance(backend, Reason):
        backend.close()
    if rank == 0:
        path = os.path.join(args.out, f"bench_w{world}.json")
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "world": world,
                "calls_per_graph": args.calls or "100 up to 8 MiB, else 20", "replays": args.replays,
                "seconds": round(time.time() - started)}
        save_json(path, {"meta": meta, "rows": rows})
        print(format_table(rows))
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


def run_output_quant(args):
    import arfusion
    from arfusion import quant, reference, tuning
    from arfusion.backends import flashinfer_dispatch as dispatch
    from arfusion.backends import get_backend
    from arfusion.decisions import Reason
    from arfusion.core import Call, Form

    rank, world, device, say = init_distributed()
    group, gname = dist.group.WORLD, dist.group.WORLD.group_name
    backend = get_backend("flashinfer")
    hidden = args.hidden[0]
    say(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, world {world}, hidden {hidden}, "
        f"quant {args.quant}, calls/graph {args.calls or 'auto'}, replays {args.replays}")
    path = os.path.join(args.out, f"bench_quant_w{world}.json")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "world": world, "hidden": hidden,
            "calls_per_graph": args.calls or "100 up to 8 MiB, else 20", "replays": args.replays}
    rows, started = [], time.time()
    g = torch.Generator(device=device)
    weight = norm_weight(g, hidden, device)
    scale = torch.tensor(0.02, device=device)  # 0-d fp32, as a static checkpoint's input scale
    for form in args.quant:
        site = Form(residual=True, norm="rms", quant=form, emit_norm=False)
        q_scale = scale if form == "fp8_static" else None
        norm_a = torch.compile(add_norm_quant(form), dynamic=False)
        model_b = torch.compile(make_quant_model_fn(gname, form), dynamic=False, options=with_pass())
        for t in args.tokens:
            nbytes = t * hidden * 2
            calls = calls_per_graph(args, nbytes)
            x, res = inputs(g, rank, t, hidden, device)
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
            row["b_path"] = fused_path(backend, Call.of_tensors(site, x, weight, world, gname))
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
                    x=x, residual=res, weight=weight, eps=EPS, eps_tensor=None, group_name=gname, norm="rms",
                    quant=form, quant_scale=q_scale, emit_norm=False, backend="flashinfer",
                    max_bytes=dispatch.HARD_MAX_FUSED_BYTES)
                try:
                    row["c_us"] = tuning.time_in_graph(forced, group, calls, args.replays)
                    row["c_err"] = quant_err(forced())
                except Exception as e:
                    row["c_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            say(json.dumps(rounded(row)))
            save_rows(rank, path, meta, started, rows)
    finish(rank, backend, format_table(rows), path)


def run_codec(args):
    import arfusion
    from arfusion import tuning
    from arfusion.backends import flashinfer_dispatch as dispatch
    from arfusion.backends import get_backend
    from arfusion.decisions import Reason
    from arfusion.core import Call, Form

    no_multicast()  # before any communicator or symmetric buffer exists
    rank, world, device, say = init_distributed()
    group, gname = dist.group.WORLD, dist.group.WORLD.group_name
    backend = get_backend("flashinfer")  # FlashInfer's "trtllm" backend only: never "auto" / "mnnvl"
    if isinstance(backend, Reason):
        raise SystemExit(f"FlashInfer unavailable: {backend}")
    fi_quantized = importlib.import_module("flashinfer.comm.quantized_allreduce").quantized_all_reduce
    level, hidden = args.quantized, 4096
    say(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, world {world}, hidden {hidden}, "
        f"quantized {level}, MiB {args.mib}, calls/graph {args.calls or 'auto'}, replays {args.replays}")
    path = os.path.join(args.out, f"bench_quantized_w{world}.json")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "world": world, "hidden": hidden,
            "level": level, "calls_per_graph": args.calls or "100 up to 8 MiB, else 20", "replays": args.replays}
    norm_a = torch.compile(add_norm, dynamic=False)
    model_b = torch.compile(make_model_fn(gname), dynamic=False, options=arfusion.inductor_options(
        arfusion.PassConfig(enable_allreduce_fusion=True, backend="auto", quantized_allreduce=level)))
    g = torch.Generator(device=device)
    weight = norm_weight(g, hidden, device)
    grid = knob_grid(args.codec_knobs) if args.codec_knobs is not None else []
    meta["codec_knobs"] = grid
    rows, started = [], time.time()
    for mib in args.mib:
        t = int(mib * 2**20) // (hidden * 2)
        nbytes = t * hidden * 2
        calls = calls_per_graph(args, nbytes)
        x, res = inputs(g, rank, t, hidden, device)
        x_inplace, reduced = x.clone(), x.clone()
        dist.all_reduce(reduced, group=group)
        want = norm_a(reduced, res, weight)[0]  # a0's norm output on fresh data
        row = {"world": world, "hidden": hidden, "mib": mib, "tokens": t, "bytes_per_rank": nbytes}

        def measure(key, fn, norm_at, into=row):
            """into[key_us], the rel error of the norm output (fn()[norm_at]) vs a0's and what ran;
            an error is the same on every rank (same shapes): recorded, the run goes on."""
            before = arfusion.stats()
            try:
                into[f"{key}_us"] = tuning.time_in_graph(fn, group, calls, args.replays)
                if norm_at is not None:
                    into[f"{key}_err"] = rel_err(fn()[norm_at], want)
            except Exception as e:
                into[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if ran := dispatch_since(before):
                into[f"{key}_dispatch"] = ran

        def unfused_inplace():
            dist.all_reduce(x_inplace, group=group)
            return norm_a(x_inplace, res, weight)

        measure("a0", unfused_inplace, None)  # x_inplace grows with every call: no error
        measure("c", lambda: tuning.fused_step(x, res, weight, EPS, gname, dispatch.HARD_MAX_FUSED_BYTES), 1)
        measure("b", lambda: model_b(x, res, weight), 0)
        # q before fi_q: arfusion's collective warm-up makes FlashInfer's symmetric buffer at its
        # largest size once, so the direct calls never grow it between captures.
        measure("q", lambda: tuning.fused_step(x, res, weight, EPS, gname, None, codec=level), 1)
        measure("fi_q", lambda: norm_a(fi_quantized(x, group), res, weight), 0)
        for knobs in grid:  # the same call under other launch knobs
            row.setdefault("knobs", []).append(entry := {"knobs": knobs})
            measure("fi_q", lambda knobs=knobs: norm_a(fi_quantized(x, group, **knobs), res, weight), 0, into=entry)
        if timed := [k for k in row.get("knobs", ()) if "fi_q_us" in k]:
            best = min(timed, key=lambda k: k["fi_q_us"])
            row["knobs_best_us"], row["knobs_best"] = best["fi_q_us"], best["knobs"]
        row["exact_path"] = fused_path(backend, Call.of_tensors(Form(residual=True, norm="rms"), x, weight, world,
                                                                gname))
        row["exact_us"] = row.get("a0_us" if row["exact_path"] == "unfused" else "c_us")
        for name, num, den in (("q_vs_a0", "a0_us", "q_us"), ("q_vs_exact", "exact_us", "q_us"),
                               ("b_vs_exact", "exact_us", "b_us"), ("fi_q_vs_q", "fi_q_us", "q_us"),
                               ("ex_vs_knobs_best", "exact_us", "knobs_best_us")):
            if row.get(num) and row.get(den):
                row[name] = row[num] / row[den]
        rows.append(row)
        say(json.dumps(rounded({k: v for k, v in row.items() if k != "knobs"}, 4)))
        save_rows(rank, path, meta, started, rows)
    finish(rank, backend, format_codec_table(rows), path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    p.add_argument("--codec-knobs", nargs="*", metavar="KNOB=V1,V2",
                   help="with --quantized: also time FlashInfer's call under every combination of its launch knobs "
                        "(alone: the whole grid of flashinfer_dispatch.CODEC_KNOBS; KNOB=V1,V2 narrows one knob)")
    p.add_argument("--plot", nargs="+", help="bench_w*.json files to plot instead of measuring")
    p.add_argument("--png", default="bench_fused_op.png")
    return p.parse_args(argv)


def main():
    args = parse_args()
    if args.plot:
        plot(args.plot, args.png)
    elif args.quantized:
        run_codec(args)
    elif args.quant:
        run_output_quant(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
