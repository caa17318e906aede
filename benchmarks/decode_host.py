"""bench_hf_decode.py's host-path phases: decoding as users run it, one whole call at a time.

  loop      a hand-written greedy loop: eager prefill into a static cache, then one compiled
            step per token, mode="reduce-overhead" (cudagraph trees) on GPU
  generate  HF generate() with a static cache and its own compile (reduce-overhead on GPU)

Each call makes n new tokens from the same prompt. Timed by difference of two lengths
(--lengths, default 144 and 16): the longest call first (compile, CUDA-graph recording; one
static cache then serves every call: HF keeps the largest static cache seen, and a larger
max_new_tokens than before builds a new cache, recompiles and records new graphs), then --reps
pairs of (long, short) calls. Steady-state ms per token = (long - short) / (n_long - n_short), the
median over pairs; the fixed cost per call (prefill, cache set-up, first token) = short - n_short x
that. A whole call divided by its tokens mixes the two ("naive_ms_per_token", kept to compare).

Alongside, per config: the first call's seconds (compile + recording), graphs compiled, what
cudagraph trees did per token (replays, recordings, eager runs), and on GPU the profiler over one
call of each length: GPU kernels, GPU busy time (union of kernel intervals), CUDA-graph launches
and single kernel launches from the host, per token by the same difference, and per call.
"""

from __future__ import annotations

import contextlib
import statistics

import torch
import torch._dynamo.utils
import torch.distributed as dist

import arfusion
from arfusion.tuning import Progress
from common import dispatch_since, per_token_counts, steady_state, wall_ms
from decode_phases import kernel_tally


@contextlib.contextmanager
def cudagraph_tree_work(tally: dict):
    """Counts what cudagraph trees do per call (eager warm-ups, recordings, replays): a loop
    that keeps warming up or re-recording is host-bound for a reason other than Python."""
    if not torch.cuda.is_available():
        yield tally
        return
    from torch._inductor import cudagraph_trees as trees

    manager = trees.CUDAGraphTreeManager
    saved = {name: getattr(manager, name) for name in ("run_eager", "record_function", "execute_node")}

    def counting(name):
        def wrapper(*a, **k):
            tally[name] = tally.get(name, 0) + 1
            return saved[name](*a, **k)
        return wrapper

    for name in saved:
        setattr(manager, name, counting(name))
    try:
        yield tally
    finally:
        for name, fn in saved.items():
            setattr(manager, name, fn)


def forget_compiles(model) -> None:
    """A fresh start: dynamo's compiled code and cudagraph trees gone, HF's compiled call and
    remembered static-cache length too (generate compiles its own call, per compile config)."""
    torch._dynamo.reset()
    for attr in ("_compiled_call", "_previous_max_cache_length"):
        if hasattr(model, attr):
            delattr(model, attr)


def loop_call(b, name: str):
    """call(n): a greedy loop making n new tokens (eager prefill, n - 1 compiled steps)."""
    fn = b.compile(name, reduce_overhead=True)
    ids = b.prompt(1, b.args.prompt, seed=5)
    cache = b.cache(b.args.prompt + max(b.args.lengths) + 8)

    def call(n: int):
        cache.reset()  # zeroes the same tensors in place: the graphs' static inputs stay
        with torch.no_grad():
            token = b.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(n - 1):
                token = fn(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return token

    return call


def generate_call(b, name: str):
    """call(n): model.generate() making exactly n new tokens, greedy, static cache."""
    from transformers import GenerationConfig

    ids = b.prompt(1, b.args.prompt, seed=5)

    def call(n: int):
        gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static")
        if not b.cuda:  # HF compiles generate's decode only on CUDA unless told otherwise
            from transformers import CompileConfig

            gen.compile_config = CompileConfig(dynamic=False)
            gen.compile_config._compile_all_devices = True
        with torch.no_grad():
            return b.model.generate(ids, generation_config=gen)

    return call


def median_counts(tallies: list[dict]) -> dict:
    """Each count's median over calls: what a call typically does."""
    keys = {k for t in tallies for k in t}
    return {k: statistics.median(t.get(k, 0) for t in tallies) for k in keys}


def profile_call(call, n: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call(n)
        torch.cuda.synchronize()
    tally = kernel_tally(prof)
    return {"kernels": tally["kernels"], "gpu_busy_ms": tally["gpu_busy_us"] / 1e3,
            "graph_launches": tally["graph_launches"], "kernel_launches": tally["kernel_launches"]}


def measure(b, call, fresh_per_length: bool, reset, progress) -> dict:
    """One config of one runner: first call, timed pairs, counts per token, profile (GPU)."""
    long_n, short_n = max(b.args.lengths), min(b.args.lengths)
    counters = torch._dynamo.utils.counters
    graphs0 = counters["stats"]["unique_graphs"]
    samples, work = {long_n: [], short_n: []}, {long_n: [], short_n: []}
    out, compiled_in_first = {}, []

    def timed(n):
        tally = {}
        with cudagraph_tree_work(tally):
            samples[n].append(wall_ms(lambda: call(n), b.device))
        work[n].append(tally)
        progress.update(f"{n} tokens {samples[n][-1]:.0f} ms")

    def first(n):
        fused, graphs = arfusion.stats()["fused_sites"], counters["stats"]["unique_graphs"]
        ms = wall_ms(lambda: call(n), b.device)  # compiles, records graphs
        out.setdefault("first_call_s", {})[str(n)] = round(ms / 1e3, 2)
        out.setdefault("fused_sites_per_compile", []).append(arfusion.stats()["fused_sites"] - fused)
        compiled_in_first.append(counters["stats"]["unique_graphs"] - graphs)
        progress.update(f"first call {ms / 1e3:.1f} s")

    dist.barrier()
    if fresh_per_length:  # a fresh compile per length, longest first: nothing recorded is reused
        for n in (long_n, short_n):
            reset()
            first(n)
            for _ in range(b.args.reps):
                timed(n)
    else:
        first(long_n)
        for _ in range(b.args.reps):
            for n in (long_n, short_n):
                timed(n)
    out.update(steady_state(samples))
    typical = {n: median_counts(work[n]) for n in work}  # a stray re-recording is counted below
    out["cudagraph_work"] = per_token_counts(long_n, typical[long_n], short_n, typical[short_n])
    out["cudagraph_work_timed_calls"] = {str(n): work[n] for n in (long_n, short_n)}
    out["rerecords_in_timed_calls"] = sum(t.get("record_function", 0) + t.get("run_eager", 0)
                                          for n in work for t in work[n])
    out["graphs_compiled"] = counters["stats"]["unique_graphs"] - graphs0
    out["graphs_compiled_in_timed_calls"] = out["graphs_compiled"] - sum(compiled_in_first)
    out["compile_s"] = round(out["first_call_s"][str(long_n)] - out["call_ms"][str(long_n)] / 1e3, 2)
    if b.cuda:
        prof = {n: profile_call(call, n) for n in (long_n, short_n)}
        progress.update("profiled")
        out["profile"] = per_token_counts(long_n, prof[long_n], short_n, prof[short_n])
        busy = out["profile"]["gpu_busy_ms"]["per_token"]
        out["gpu_busy_ms_per_token"] = round(busy, 4)
        out["gpu_busy_fraction"] = round(busy / out["ms_per_token"], 3) if out["ms_per_token"] > 0 else None
    return out


def run_host_phase(b, kind: str) -> dict:
    """loop or generate, for each config (--configs, in --loop-order for the loop)."""
    configs = [c for c in (b.args.loop_order if kind == "loop" else ("off", "on")) if c in b.args.configs]
    steps_per_config = (2 if b.args.fresh_per_length else 1) + 2 * b.args.reps + (1 if b.cuda else 0)
    progress = Progress(len(configs) * steps_per_config, f"{kind} ({', '.join(configs)})", enabled=b.rank == 0)
    result = {"lengths": sorted(b.args.lengths, reverse=True), "reps": b.args.reps, "prompt": b.args.prompt,
              "batch": 1, "mode": "reduce-overhead (cudagraph trees)" if b.cuda else "default (CPU)"}
    try:
        for name in configs:
            forget_compiles(b.model)
            if kind == "generate" and name == "on":
                arfusion.enable(b.pass_config)  # generate compiles its own call: the pass is read then
            before = arfusion.stats()
            make = loop_call if kind == "loop" else generate_call
            call = make(b, name)

            def reset():
                forget_compiles(b.model)

            fresh = b.args.fresh_per_length
            try:
                row = measure(b, call, fresh, reset, progress)
            except Exception as e:  # e.g. cudagraph trees' input-length assertion on a changed call
                if fresh:
                    raise
                error = f"{type(e).__name__}: {str(e)[:300]}"
                b.say(f"{kind} {name}: {error}; again with a fresh compile per length")
                row = measure(b, make(b, name), True, reset, progress)
                row["shared_compile_error"] = error
                fresh = True
            row["fresh_compile_per_length"] = fresh
            row["fused_sites"] = max(row.pop("fused_sites_per_compile"))  # in the graph the call compiled
            row["dispatch"] = dispatch_since(before)
            arfusion.disable()
            result[name] = row
            b.say(f"{kind} {name}: {row['ms_per_token']} ms/token steady, {row['fixed_ms']} ms fixed per call "
                  f"(naive {row['naive_ms_per_token']}), first call {row['first_call_s']} s, "
                  f"GPU busy {row.get('gpu_busy_ms_per_token')} ms/token, {row['fused_sites']} sites fused")
    finally:
        arfusion.disable()
        progress.close()
    step = next((r for r in b.result["phases"].get("decode", {}).get("rows", []) if r["batch"] == 1), None)
    if step and b.cuda:  # the captured decode step's GPU time against the steady-state wall time
        for name in configs:
            result[name]["captured_step_fraction"] = round(step[f"{name}_ms"] / result[name]["ms_per_token"], 3)
    return result


def phase_loop(b):
    return run_host_phase(b, "loop")


def phase_generate(b):
    return run_host_phase(b, "generate")


def host_summary(result: dict) -> list[str]:
    """One line per runner and config, for the end-of-run table."""
    lines = []
    for kind in ("generate", "loop"):
        phase = result["phases"].get(kind, {})
        for name in ("off", "on"):
            r = phase.get(name)
            if not isinstance(r, dict) or "fixed_ms" not in r:  # not measured, or an older JSON
                continue
            busy = f", GPU busy {r['gpu_busy_ms_per_token']:.3f} ms" if r.get("gpu_busy_ms_per_token") is not None else ""
            launches = ""
            if "profile" in r:
                p = r["profile"]
                launches = (f", {p['graph_launches']['per_token']:g} graph launches + "
                            f"{p['kernel_launches']['per_token']:g} kernel launches per token")
            lines.append(f"{kind + ' ' + name:<13} {r['ms_per_token']:8.3f} ms/token steady, {r['fixed_ms']:8.2f} ms "
                         f"fixed per call (whole call / tokens: {r['naive_ms_per_token']:.3f}){busy}{launches}")
    return lines
