"""bench_hf_decode.py's device-side phases, each a function of the `Bench` (decode_model.py):

  startup   compile + first decode token, cold and warm
  decode    the compiled decode step captured in one CUDA graph, per batch
  accuracy  teacher-forced logits of eager, off and on against the same weights in fp32
  prefill   one compiled prefill per length (and the quantized all-reduce with --quantized)
  kernels   the profiler over uncaptured decode steps: kernels and GPU time per step, by kind

(bench_hf_decode.py's docstring says what each measures; decode_host.py has loop and generate.)
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import time

import torch
import torch.distributed as dist

import arfusion
from common import NoAllReduce, dispatch_since, rel_err_rows, top1_same
from decode_model import CONFIGS

REWRITE_COUNTS = ("fused_sites", "unfused_sites", "summed_all_reduces_merged", "gated_all_reduces_merged",
                  "sums_moved_before_all_reduce", "scaled_all_reduces_fused",
                  "moe_combines_fused")
KERNEL_KINDS = (  # first match wins; lower-case substrings of kernel names
    ("fused_allreduce", ("allreduce_fusion", "allreducefusion", "fused_allreduce")),
    ("nccl", ("nccl",)),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "cublas", "splitk")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("triton", ("triton",)),
)


def kernel_kind(name: str) -> str:
    name = name.lower()
    return next((k for k, keys in KERNEL_KINDS if any(s in name for s in keys)), "other")


def kernel_tally(prof) -> dict:
    """What a profiler saw: GPU kernels by kind ({kind: [count, us]}), GPU busy microseconds (the
    union of kernel intervals, so overlapping kernels count once), and host-side launches:
    CUDA-graph launches and single kernel launches (runtime or driver API)."""
    kinds: dict[str, list] = {}
    spans, launches = [], {"graph_launches": 0, "kernel_launches": 0}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(evt.name)
            kinds.setdefault(kind, [0, 0.0])
            kinds[kind][0] += 1
            kinds[kind][1] += evt.time_range.elapsed_us()
            spans.append((evt.time_range.start, evt.time_range.end))
        elif evt.name in ("cudaGraphLaunch", "cuGraphLaunch"):
            launches["graph_launches"] += 1
        elif evt.name.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")):
            launches["kernel_launches"] += 1
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return {"kinds": kinds, "gpu_busy_us": busy, "kernels": sum(n for n, _ in kinds.values()), **launches}


def first_token(b, name: str) -> dict:
    cache, token = b.prefilled(1)
    before = arfusion.stats()
    dist.barrier()
    t0 = time.perf_counter()
    fn = b.compile(name)
    with torch.no_grad():
        fn(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1).tolist()
    seconds = time.perf_counter() - t0
    after = arfusion.stats()
    b.compiled[name] = fn
    return {"seconds": round(seconds, 2), "fused_sites": after["fused_sites"] - before["fused_sites"],
            "pass_seconds": round(after["pass_seconds"] - before["pass_seconds"], 3)}


def warm_up_compiler(b):
    """Process-wide first-compile costs (imports, dynamo's and AOT's first trace of this
    model, compile workers) go here, not into whichever config is compiled cold first."""
    with b.cache_dir("warmup"):
        norm = torch.compile(lambda x, w: w * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype))
        x = torch.randn(4, 64, device=b.device, dtype=torch.bfloat16)
        norm(x, torch.ones(64, device=b.device, dtype=torch.bfloat16))
        cache, token = b.prefilled(1)
        with torch.no_grad():
            torch.compile(b.model, backend="aot_eager")(input_ids=token, past_key_values=cache, use_cache=True)
    torch._dynamo.reset()


def phase_startup(b):
    torch._inductor.config.fx_graph_cache = True
    warm_up_compiler(b)
    out = {}
    for temperature in ("cold", "warm"):
        if temperature == "warm":
            torch._dynamo.reset()  # forget compiled code; the on-disk caches stay
        for name in ("on", "off"):  # a bias of going first falls on arfusion, not for it
            with b.cache_dir(name) as path:
                if temperature == "cold":
                    shutil.rmtree(path, ignore_errors=True)
                out[f"{temperature}_{name}"] = first_token(b, name)
            b.say(f"startup {temperature} {name}: {out[f'{temperature}_{name}']}")
    out["cold_added_s"] = round(out["cold_on"]["seconds"] - out["cold_off"]["seconds"], 2)
    out["order"] = ("cold on, cold off, dynamo reset, warm on, warm off; batch 1 decode step; a cache dir "
                    "per config, in-memory kernel caches cleared before each")
    return out


def phase_decode(b):
    rows = []
    names = CONFIGS + (("floor",) if b.args.floor else ())
    dropped = NoAllReduce.dropped
    compiled, longest, skipped = set(), 0.0, []  # graphs: "static" (batch 1), "dynamic" (every batch > 1)
    for batch in b.args.batches:
        graph = "static" if batch == 1 else "dynamic"
        # A batch that compiles its graph takes about as long as the longest batch so far; one that
        # replays a compiled graph is short and always runs.
        if graph not in compiled and b.out_of_time(longest):
            skipped.append(batch)
            b.say(f"decode batch {batch}: skipped, its compiles would end past the time budget (--budget-s)")
            continue
        compiled.add(graph)
        started = time.time()
        row = {"batch": batch}
        for name in names:
            fn = b.compiled_model(name)
            cache, token = b.prefilled(batch)
            if batch > 1:  # one dynamic-batch graph serves every batch > 1 (1 specializes)
                torch._dynamo.maybe_mark_dynamic(token, 0)
                for layer in cache.layers:
                    for t in (layer.keys, layer.values):
                        torch._dynamo.maybe_mark_dynamic(t, 0)
            before = arfusion.stats()
            step = lambda cache=cache: fn(input_ids=token, past_key_values=cache, use_cache=True).logits
            row[f"{name}_ms"] = b.time_step(step, b.rewinder(cache, b.args.prompt))
            row[f"{name}_dispatch"] = dispatch_since(before)
            del cache
            b.say(f"decode batch {batch}: {name} {row[f'{name}_ms']:.3f} ms")
            # A run killed before the batch's last config keeps the configs it timed.
            b.result["phases"]["decode"] = {"rows": rows, "partial": True, "incomplete_row": row}
            b.save()
        row["speedup"] = round(row["off_ms"] / row["on_ms"], 3)
        row["gain_pct"] = round(100 * (1 - row["on_ms"] / row["off_ms"]), 1)
        row["on_tokens_per_s"] = round(batch * 1e3 / row["on_ms"], 1)
        row["off_tokens_per_s"] = round(batch * 1e3 / row["off_ms"], 1)
        floor = ""
        if "floor_ms" in row:  # what the all-reduces add over the step without them, and the pass's share of it
            row["comm_ms"] = round(row["off_ms"] - row["floor_ms"], 4)
            row["comm_removed_pct"] = (round(100 * (row["off_ms"] - row["on_ms"]) / row["comm_ms"], 1)
                                       if row["comm_ms"] > 0 else None)
            floor = f", floor {row['floor_ms']:.3f} ms" + (
                f" (the pass removes {row['comm_removed_pct']}% of the all-reduces' time)" if row["comm_ms"] > 0 else "")
        b.say(f"decode batch {batch}: off {row['off_ms']:.3f} ms, on {row['on_ms']:.3f} ms, "
              f"{row['gain_pct']:+.1f}%{floor} ({row['on_dispatch']})")
        rows.append(row)
        longest = max(longest, time.time() - started)
        b.result["phases"]["decode"] = {"rows": rows, "partial": True}  # a run cut short keeps its rows
        b.save()
    # What the pass did to the graphs timed here (MoE: all-reduces merged or moved).
    stats = arfusion.stats()
    done = {k: v for k, v in stats.items() if k in REWRITE_COUNTS and v}
    b.say(f"pass: {done}, forms {stats['by_pattern']}")
    out = {"rows": rows, "captured": b.cuda, "replays": b.args.replays, "context": b.args.prompt,
           "pass": done, "by_pattern": stats["by_pattern"]}
    if skipped:
        out["skipped_batches"] = {"batches": skipped,
                                  "why": "time budget (--budget-s): their compiles would have ended past it"}
    if b.args.floor:
        out["floor"] = {"all_reduces_dropped": NoAllReduce.dropped - dropped,
                        "what": "every all-reduce compiled as its input (no communication, wrong numbers): "
                                "the step's lower bound; all-gathers kept"}
    return out


def phase_accuracy(b):
    steps = b.args.steps
    forced = b.prompt(1, steps, seed=7)  # the tokens fed at every step, same for all
    logits = {}
    # The same bf16 weights run in fp32, eagerly: how far each bf16 run is from the exact
    # result, so "on" can be compared with "off" against the truth and not only each other.
    from transformers import AutoModelForCausalLM

    exact = AutoModelForCausalLM.from_pretrained(b.checkpoint, dtype=torch.float32, **b.tp(b.checkpoint)).eval()
    for name in ("fp32", "eager", *CONFIGS):
        fn = {"fp32": exact, "eager": b.model}[name] if name in ("fp32", "eager") else b.compiled_model(name)
        cache, _ = b.prefilled(1, model=fn if name == "fp32" else None)
        per_step = []
        with torch.no_grad():
            for i in range(steps):
                token = forced[:, i:i + 1].clone()  # a fresh tensor, like a real decode loop's
                out = fn(input_ids=token, past_key_values=cache, use_cache=True).logits
                per_step.append(out[0, -1].float().clone())
        logits[name] = torch.stack(per_step)
    del exact, cache
    gc.collect()
    if b.cuda:
        torch.cuda.empty_cache()

    def rel(got, want):
        return rel_err_rows(got, want).tolist()

    def agree(got, want):
        return top1_same(got, want).tolist()

    out = {"steps": steps,
           "on_vs_off_rel_l2": rel(logits["on"], logits["off"]),
           "on_vs_eager_rel_l2": rel(logits["on"], logits["eager"]),
           "off_vs_eager_rel_l2": rel(logits["off"], logits["eager"]),
           "on_vs_off_top1": agree(logits["on"], logits["off"]),
           "on_vs_eager_top1": agree(logits["on"], logits["eager"]),
           "off_vs_eager_top1": agree(logits["off"], logits["eager"])}
    for name in ("eager", *CONFIGS):
        out[f"{name}_vs_fp32_rel_l2"] = rel(logits[name], logits["fp32"])
        out[f"{name}_vs_fp32_top1"] = agree(logits[name], logits["fp32"])
    summary = {k.replace("_rel_l2", "_max_rel_l2"): max(v) for k, v in out.items() if k.endswith("rel_l2")}
    summary.update({k: statistics.mean(v) for k, v in out.items() if k.endswith("top1")})
    out["summary"] = summary
    b.say(f"accuracy over {steps} teacher-forced steps: {json.dumps({k: round(v, 4) for k, v in summary.items()})}")
    return out


def phase_prefill(b):
    rows = []
    names = CONFIGS + (("quantized",) if b.args.quantized else ())
    fns = {name: b.compile(name) for name in names}  # its own graph: lengths dynamic
    for length in b.args.prefill:
        ids = b.prompt(1, length, seed=3)
        torch._dynamo.mark_dynamic(ids, 1)
        row = {"tokens": length}
        for name, fn in fns.items():
            step = lambda: fn(input_ids=ids, use_cache=False, logits_to_keep=1).logits
            row[f"{name}_ms"] = b.time_step(step, lambda: None, warmup=2)
            row[f"{name}_tokens_per_s"] = round(length * 1e3 / row[f"{name}_ms"], 1)
            before = arfusion.stats()  # what the op ran in one more (uncaptured) prefill
            with torch.no_grad():
                step()
            row[f"{name}_dispatch"] = dispatch_since(before)
        row["on_vs_off"] = round(row["on_ms"] / row["off_ms"], 4)
        row["on_speedup"] = round(row["off_ms"] / row["on_ms"], 3)
        line = f"prefill {length}: off {row['off_ms']:.2f} ms, on {row['on_ms']:.2f} ms ({row['on_speedup']:.3f}x)"
        if "quantized" in fns:
            row["quantized_speedup"] = round(row["off_ms"] / row["quantized_ms"], 3)
            row["quantized_vs_on"] = round(row["on_ms"] / row["quantized_ms"], 3)
            row["quantized_calls"] = sum(v for k, v in row["quantized_dispatch"].items() if " quantized " in k)
            row["op_calls"] = sum(row["quantized_dispatch"].values())
            line += (f", {b.args.quantized} {row['quantized_ms']:.2f} ms ({row['quantized_speedup']:.3f}x, "
                     f"{row['quantized_vs_on']:.3f}x vs on; {row['quantized_calls']}/{row['op_calls']} calls quantized)")
        b.say(line)
        rows.append(row)
        b.result["phases"]["prefill"] = {"rows": rows, "partial": True}  # a run cut short keeps its rows
        b.save()
    return {"rows": rows, "batch": 1, "quantized": b.args.quantized}


def phase_kernels(b):
    if not b.cuda:
        return {"skipped": "no CUDA: the profiler sees no GPU kernels"}
    from torch.profiler import ProfilerActivity, profile

    steps, out = 5, {}
    for name in CONFIGS:
        fn = b.compiled_model(name)
        cache, token = b.prefilled(1)  # room for warm-up and profiled steps: no rewinds
        with torch.no_grad():
            for _ in range(3):
                fn(input_ids=token, past_key_values=cache, use_cache=True)
            b.sync()
            dist.barrier()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    fn(input_ids=token, past_key_values=cache, use_cache=True)
                b.sync()
        kinds = kernel_tally(prof)["kinds"]
        out[name] = {k: {"kernels": round(n / steps, 1), "gpu_us": round(us / steps, 1)} for k, (n, us) in kinds.items()}
        out[name]["total"] = {"kernels": round(sum(n for n, _ in kinds.values()) / steps, 1),
                              "gpu_us": round(sum(us for _, us in kinds.values()) / steps, 1)}
        b.say(f"kernels per decode step, {name}: {out[name]['total']}")
    saved = out["off"]["total"]["kernels"] - out["on"]["total"]["kernels"]
    out["kernels_saved_per_step"] = round(saved, 1)
    out["kernels_saved_per_layer"] = round(saved / b.config.num_hidden_layers, 2)
    out["note"] = "5 uncaptured compiled steps at batch 1, per step"
    return out
