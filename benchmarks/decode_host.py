"""bench_hf_decode.py's host-path phases: decoding as users run it, one whole call at a time.

  loop      a hand-written greedy loop: eager prefill into a static cache, then one compiled
            step per token, mode="reduce-overhead" (cudagraph trees) on GPU
  generate  HF generate() with a static cache and its own compile (reduce-overhead on GPU, or
            --generate-mode default: no CUDA graphs), greedy or sampling (--gen-variants greedy:1
            sample:1 greedy:8 sample:8: mode:batch)

Off and on live side by side in one process and take turns: --pairs interleaved pairs, each pair
one call of each config at each of two lengths (--lengths, default 144 and 16), the config that
goes first alternating from pair to pair. Steady-state ms per token of a config in a pair =
(long - short) / (n_long - n_short); the fixed cost per call (prefill, cache set-up, first token)
= short - n_short x that. A whole call divided by its tokens mixes the two ("naive_ms_per_token",
kept to compare). Each pair's on/off ratio, and their median and spread, are the comparison.

Before the pairs, each config makes one call of each length, longest first (compile, CUDA-graph
recording; HF keeps the largest static cache seen, so one cache then serves every call). A pair
in which any call compiled a graph, recorded a CUDA graph again or ran cudagraph trees' eager
warm-up is excluded from the medians and counted (with what happened); pairs are added until
--pairs valid ones exist or twice as many were tried. Each pair also records each config's
garbage collections in its calls (ms, full ones) and its ms per token without them, and of its long
call what the host did (HostUse: CPU time and share, other threads, context switches, page faults,
CPUs) and a fixed host probe run right after it (host_probe_us).

Per config, alongside: the first calls' seconds, sites fused in the graphs its calls compiled,
and on GPU, once every variant's pairs are measured and saved, the profiler over one call of
each length: GPU kernels, GPU busy time (union of kernel intervals), CUDA-graph and single kernel
launches from the host, per token by the same difference, and GPU busy / wall per token (how
host-bound the path is).
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import statistics
import time

import torch
import torch._dynamo.utils
import torch.distributed as dist

import arfusion
from arfusion.tuning import Progress
from common import by_difference, dispatch_since, per_token_counts, wall_ms
from decode_model import CONFIGS
from decode_phases import kernel_tally
from serving_probes import GcPauses, HostUse, host_probe_us

REDONE = ("record_function", "run_eager")  # cudagraph trees' work that a steady-state call should not do


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


HF_CALL_ATTRS = ("_compiled_call", "_last_compile_config")  # HF's compiled call: one per config here
HF_COMPILE_ATTRS = HF_CALL_ATTRS + ("_previous_max_cache_length",)


def forget_compiles(model) -> None:
    """A fresh start: dynamo's compiled code and cudagraph trees gone, HF's compiled call and
    remembered static-cache length too (generate compiles its own call, per compile config)."""
    torch._dynamo.reset()
    for attr in HF_COMPILE_ATTRS:
        if hasattr(model, attr):
            delattr(model, attr)


class Runner:
    """One config's calls: call(n) makes n new tokens; `active()` wraps every call of this config
    (generate: the pass installed or not, and this config's own compiled call in place)."""

    def __init__(self, b, name: str):
        self.b, self.name = b, name

    @contextlib.contextmanager
    def active(self):
        yield


class LoopRunner(Runner):
    """A greedy loop making n new tokens (eager prefill, n - 1 compiled steps); its own compile."""

    def __init__(self, b, name: str):
        super().__init__(b, name)
        self.fn = b.compile(name, reduce_overhead=True)

    def variant(self, sample: bool, batch: int):
        if sample:
            raise ValueError("the hand-written loop is greedy only")
        b = self.b
        ids = b.prompt(batch, b.args.prompt, seed=5)
        cache = b.cache(b.args.prompt + max(b.args.lengths) + 8)

        def call(n: int):
            cache.reset()  # zeroes the same tensors in place: the graphs' static inputs stay
            with torch.no_grad():
                token = b.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                for _ in range(n - 1):
                    token = self.fn(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            return token

        return call


class GenerateRunner(Runner):
    """model.generate() making exactly n new tokens, static cache, HF's own compile. Each config
    hands generate a compile config of its own: reduce-overhead's option (CUDA graphs) and, for
    "on", the pass (what arfusion.enable() installs globally, here per config, so that the two
    configs' graphs never serve each other). HF keeps one compiled call per model: each config
    keeps its own and puts it back while active."""

    def __init__(self, b, name: str):
        from transformers import CompileConfig

        super().__init__(b, name)
        # What mode="reduce-overhead", HF's default, sets; --generate-mode default: none (every
        # step's kernels and the pass's ops launched from the host).
        options = {"triton.cudagraphs": b.cuda and b.args.generate_mode == "reduce-overhead"}
        if name == "on":
            options.update(arfusion.inductor_options(b.pass_config))
        self.compile_config = CompileConfig(dynamic=False, mode=None, options=options)
        self.compile_config._compile_all_devices = not b.cuda  # HF compiles on CUDA only unless told
        self.saved = {}

    @contextlib.contextmanager
    def active(self):
        model = self.b.model
        for attr in HF_CALL_ATTRS:
            if hasattr(model, attr):
                delattr(model, attr)
        model.__dict__.update(self.saved)
        try:
            yield
        finally:
            self.saved = {a: getattr(model, a) for a in HF_CALL_ATTRS if hasattr(model, a)}

    def variant(self, sample: bool, batch: int):
        from transformers import GenerationConfig

        b = self.b
        ids = b.prompt(batch, b.args.prompt, seed=5)

        def call(n: int):
            gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=sample,
                                   cache_implementation="static", compile_config=self.compile_config)
            if sample:
                gen.top_k, gen.temperature = 50, 1.0
                torch.manual_seed(11)  # the same draws on every rank and for every config
            with torch.no_grad():
                return b.model.generate(ids, generation_config=gen)

        return call


RUNNERS = {"loop": LoopRunner, "generate": GenerateRunner}


def parse_variant(text: str) -> tuple[str, bool, int]:
    """'greedy:8' or its label 'greedy_b8' (no ":", for matrix.py's stage specs) -> ('greedy_b8', False, 8)."""
    mode, _, batch = text.partition(":") if ":" in text else text.partition("_b")
    if mode not in ("greedy", "sample") or not batch.isdigit():
        raise ValueError(f"variant {text!r}: mode:batch or mode_bBATCH, mode greedy or sample")
    return f"{mode}_b{batch}", mode == "sample", int(batch)


def spread(values: list[float]) -> dict:
    """Median, quartiles and extremes of a list (empty dict for none)."""
    if not values:
        return {}
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": round(statistics.median(values), 4), "q1": round(q[0], 4), "q3": round(q[2], 4),
            "min": round(min(values), 4), "max": round(max(values), 4), "n": len(values)}


PROFILE_STACKS_AFTER_S = 120  # a profiled call still running then prints every thread's stack (once)


def profile_call(call, n: int, inspect=None) -> dict:
    """Kernels, GPU busy time and launches of `call(n)` under torch's profiler; `inspect(prof, n)`,
    where given, sees the profile too (benchmarks/probes/probe_generate_ops.py)."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()  # ranks start together: a collective kernel waiting for a late peer is not GPU work
    # A profiled TP=4 generate() call once never returned (4xH100, 2026-11-27): if one hangs again,
    # the log shows where each rank's threads are.
    faulthandler.dump_traceback_later(PROFILE_STACKS_AFTER_S)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call(n)
            torch.cuda.synchronize()
    finally:
        faulthandler.cancel_dump_traceback_later()
    if inspect is not None:
        inspect(prof, n)
    tally = kernel_tally(prof)
    return {"kernels": tally["kernels"], "gpu_busy_ms": tally["gpu_busy_us"] / 1e3,
            "graph_launches": tally["graph_launches"], "kernel_launches": tally["kernel_launches"]}


def measure_variant(b, runners: dict, calls: dict, progress) -> dict:
    """Interleaved pairs of every config's (long, short) calls: see the module's docstring."""
    with GcPauses() as pauses:  # its gc callback lives as long as the measurement
        return _measure(b, runners, calls, progress, pauses)


def _measure(b, runners: dict, calls: dict, progress, pauses: GcPauses) -> dict:
    long_n, short_n = max(b.args.lengths), min(b.args.lengths)
    counters = torch._dynamo.utils.counters
    names = list(runners)
    out = {name: {"first_call_s": {}, "dispatch": collections.Counter()} for name in names}

    def one(name: str, n: int) -> dict:
        before = arfusion.stats()
        graphs = counters["stats"]["unique_graphs"]
        tally = {}
        pauses.reset()
        with runners[name].active(), cudagraph_tree_work(tally):
            use = HostUse()
            ms = wall_ms(lambda: calls[name](n), b.device)
            host = use.since()
            probe = host_probe_us(b.device)
        out[name]["dispatch"].update(dispatch_since(before))  # what the fused op ran in this config's calls
        gc_seen = pauses.summary(0, 0)
        return {"ms": ms, "graphs": counters["stats"]["unique_graphs"] - graphs, "work": tally,
                "fused_sites": arfusion.stats()["fused_sites"] - before["fused_sites"],
                "gc_ms": gc_seen["ms"], "gc_full": gc_seen["full"], "host": host, "probe_us": probe}

    dist.barrier()
    for name in names:  # compile and record, longest first
        fused = 0
        for n in (long_n, short_n):
            first = one(name, n)
            out[name]["first_call_s"][str(n)] = round(first["ms"] / 1e3, 2)
            fused = max(fused, first["fused_sites"])
            out[name].setdefault("first_call_cpus", []).extend(first["host"]["cpus"])
        out[name]["fused_sites"] = fused  # in the graph its first calls compiled (0: graphs of an earlier variant)
        progress.update(f"{name} first calls {sum(out[name]['first_call_s'].values()):.1f} s")
    pairs, valid = [], []
    while len(valid) < b.args.pairs and len(pairs) < 2 * b.args.pairs:
        order = names if len(pairs) % 2 == 0 else names[::-1]
        pair = {"order": order}
        for name in order:
            long_call, short_call = one(name, long_n), one(name, short_n)
            per_token, fixed = by_difference(long_n, long_call["ms"], short_n, short_call["ms"])
            without_gc, _ = by_difference(long_n, long_call["ms"] - long_call["gc_ms"], short_n,
                                          short_call["ms"] - short_call["gc_ms"])
            redone = sum(c["work"].get(k, 0) for c in (long_call, short_call) for k in REDONE)
            pair[name] = {"long_ms": round(long_call["ms"], 3), "short_ms": round(short_call["ms"], 3),
                          "ms_per_token": round(per_token, 4), "fixed_ms": round(fixed, 3),
                          "gc_ms": round(long_call["gc_ms"] + short_call["gc_ms"], 3),
                          "gc_full": long_call["gc_full"] + short_call["gc_full"],
                          "ms_per_token_without_gc": round(without_gc, 4),
                          "host": long_call["host"], "probe_us": long_call["probe_us"],
                          "graphs_compiled": long_call["graphs"] + short_call["graphs"], "cudagraphs_redone": redone,
                          "replays": sum(c["work"].get("execute_node", 0) for c in (long_call, short_call))}
        pair["valid"] = not any(pair[n]["graphs_compiled"] or pair[n]["cudagraphs_redone"] for n in names)
        if len(names) == 2:
            pair["on_speedup"] = round(pair["off"]["ms_per_token"] / pair["on"]["ms_per_token"], 4)
        pairs.append(pair)
        if pair["valid"]:
            valid.append(pair)
        progress.update(f"pair {len(pairs)}: " + ", ".join(f"{n} {pair[n]['ms_per_token']:.3f}" for n in names)
                        + ("" if pair["valid"] else " (excluded)"))
    excluded = collections.Counter()
    for p in pairs:
        for n in names:
            if p[n]["graphs_compiled"]:
                excluded[f"{n}: graphs compiled"] += 1
            if p[n]["cudagraphs_redone"]:
                excluded[f"{n}: CUDA graphs recorded again or eager warm-up"] += 1
    for name in names:
        row = out[name]
        row["dispatch"] = dict(row["dispatch"])
        per_token = [p[name]["ms_per_token"] for p in valid]
        row["ms_per_token"] = round(statistics.median(per_token), 4) if per_token else None
        row["ms_per_token_spread"] = spread(per_token)
        row["fixed_ms"] = round(statistics.median(p[name]["fixed_ms"] for p in valid), 3) if valid else None
        for key in ("empty", "view"):
            probes = [p[name]["probe_us"][key] for p in valid]
            row[f"probe_{key}_us"] = round(statistics.median(probes), 3) if probes else None
        shares = [p[name]["host"]["main_cpu_share"] for p in valid if p[name]["host"]["main_cpu_share"] is not None]
        row["main_cpu_share"] = round(statistics.median(shares), 3) if shares else None
        row["naive_ms_per_token"] = (round(statistics.median(p[name]["long_ms"] for p in valid) / long_n, 4)
                                     if valid else None)
    result = {**out, "pairs": pairs, "valid_pairs": len(valid), "excluded_pairs": len(pairs) - len(valid),
              "excluded_why": dict(excluded)}
    if len(names) == 2:
        result["on_speedup"] = spread([p["on_speedup"] for p in valid])
        for first in names:  # an order effect shows as a different ratio by which config went first
            result[f"on_speedup_{first}_first"] = spread([p["on_speedup"] for p in valid if p["order"][0] == first])
    return result


def profile_variant(b, runners: dict, calls: dict, row: dict, progress) -> None:
    """The profiler over one call of each length per config, into `row[config]`; each config first
    makes one unprofiled call of each length (an earlier variant's shapes may have left a CUDA graph
    to record again). Run after every variant's pairs are saved: on 4xH100 (2026-11-27) the first
    profiled call of a TP=4 generate() never returned, and took the stage's results with it."""
    long_n, short_n = max(b.args.lengths), min(b.args.lengths)
    for name, r in ((n, row[n]) for n in runners if row.get(n, {}).get("ms_per_token")):
        with runners[name].active():
            for n in (long_n, short_n):
                calls[name](n)
            prof = {n: profile_call(lambda n=n: calls[name](n), n) for n in (long_n, short_n)}
        r["profile"] = per_token_counts(long_n, prof[long_n], short_n, prof[short_n])
        busy = r["profile"]["gpu_busy_ms"]["per_token"]
        r["gpu_busy_ms_per_token"] = round(busy, 4)
        r["gpu_busy_fraction"] = round(busy / r["ms_per_token"], 3)
        progress.update(f"{name} profiled")


def run_host_phase(b, kind: str) -> dict:
    """loop or generate: each variant's interleaved pairs over the configs (--configs)."""
    names = [c for c in CONFIGS if c in b.args.configs]
    variants = [parse_variant(v) for v in b.args.gen_variants]
    if kind == "loop":
        variants = [v for v in variants if not v[1]] or [("greedy_b1", False, 1)]
    # first calls + up to 2 x pairs + profile, per variant
    progress = Progress(len(variants) * (len(names) * (2 if b.cuda else 1) + 2 * b.args.pairs),
                        f"{kind} ({', '.join(v[0] for v in variants)})", enabled=b.rank == 0)
    result = {"lengths": sorted(b.args.lengths, reverse=True), "pairs": b.args.pairs, "prompt": b.args.prompt,
              "configs": names, "mode": ("reduce-overhead (cudagraph trees)" if b.cuda and (
                  kind == "loop" or b.args.generate_mode == "reduce-overhead") else "default"),
              "method": "interleaved pairs, difference of two lengths", "variants": {}}
    forget_compiles(b.model)
    b.compiled.clear()  # the decode phase's compiles went with dynamo's reset
    try:
        runners = {name: RUNNERS[kind](b, name) for name in names}
        longest = 0.0  # the longest variant so far: one that could not end within the budget does not start
        measured = {}  # label -> its calls, profiled after every variant's pairs
        for label, sample, batch in variants:
            if b.out_of_time(longest):
                result["variants"][label] = {"skipped": "time budget (--budget-s) spent"}
                b.say(f"{kind} {label}: skipped, time budget spent")
                continue
            started, before = time.time(), arfusion.stats()
            try:
                calls = {name: runners[name].variant(sample, batch) for name in names}
                row = measure_variant(b, runners, calls, progress)
            except Exception as e:  # e.g. a cudagraph-trees assertion: the other variants still run
                if b.args.strict:
                    raise
                row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            row.update(batch=batch, sample=sample, dispatch=dispatch_since(before), seconds=round(time.time() - started))
            longest = max(longest, time.time() - started)
            result["variants"][label] = row
            b.result["phases"][kind] = result  # saved after every variant: a run cut short keeps them
            b.save()
            b.say(variant_line(kind, label, row))
            if "error" not in row:
                measured[label] = calls
        # Profiles last, each within the budget: the measured pairs are saved whatever happens here.
        for label, calls in measured.items() if b.cuda else ():
            row = result["variants"][label]
            late = b.out_of_time(row.get("seconds", 0) / 2)  # asked on every rank: rank 0 decides
            if "error" in row or late:
                continue
            profile_variant(b, runners, calls, row, progress)
            b.save()
            b.say(variant_line(kind, label, row))
    finally:
        arfusion.disable()
        progress.close()
    step = next((r for r in b.result["phases"].get("decode", {}).get("rows", []) if r["batch"] == 1), None)
    greedy = result["variants"].get("greedy_b1", {})
    if step and b.cuda:  # the captured decode step's GPU time against the steady-state wall time
        for name in names:
            if greedy.get(name, {}).get("ms_per_token"):
                greedy[name]["captured_step_fraction"] = round(step[f"{name}_ms"] / greedy[name]["ms_per_token"], 3)
    return result


def variant_line(kind: str, label: str, row: dict) -> str:
    if "error" in row or "skipped" in row:
        return f"{kind} {label}: {'FAILED ' + row['error'] if 'error' in row else row['skipped']}"
    parts = []
    for name in CONFIGS:
        r = row.get(name)
        if r and r.get("ms_per_token") is not None:
            s = r["ms_per_token_spread"]
            busy = f", GPU busy {r['gpu_busy_ms_per_token']:.3f}" if r.get("gpu_busy_ms_per_token") is not None else ""
            parts.append(f"{name} {r['ms_per_token']:.3f} ms/token ({s['min']:.3f}-{s['max']:.3f}), "
                         f"fixed {r['fixed_ms']:.1f} ms{busy}, {r['fused_sites']} sites, "
                         f"probe {r.get('probe_empty_us')}/{r.get('probe_view_us')} us")
    speed = row.get("on_speedup") or {}
    ratio = (f"; on/off speed {speed['median']:.3f}x ({speed['min']:.3f}-{speed['max']:.3f})" if speed else "")
    return (f"{kind} {label}: " + "; ".join(parts) + ratio +
            f"; {row['valid_pairs']} valid pairs, {row['excluded_pairs']} excluded {row['excluded_why'] or ''}")


def phase_loop(b):
    return run_host_phase(b, "loop")


def phase_generate(b):
    return run_host_phase(b, "generate")


def host_summary(result: dict) -> list[str]:
    """One line per runner and variant, for the end-of-run table."""
    return [variant_line(kind, label, row) for kind in ("generate", "loop")
            for label, row in result["phases"].get(kind, {}).get("variants", {}).items()]
