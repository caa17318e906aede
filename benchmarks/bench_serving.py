"""Serving with transformers' continuous batching (`generate_batch`), with and without the pass.

    torchrun --nproc-per-node 2 benchmarks/bench_serving.py --out results/               # 2 GPUs (NCCL)
    torchrun --nproc-per-node 2 benchmarks/bench_serving.py --model-type qwen3_moe --layers 24
    python benchmarks/bench_serving.py --fake-world 2 --layers 8 --out results/          # TP=2's host path, one GPU
    torchrun --nproc-per-node 2 benchmarks/bench_serving.py --shared-gpu --tiny          # both ranks on one GPU
    torchrun --nproc-per-node 2 benchmarks/bench_serving.py --cpu --tiny                 # CPU dry run (gloo)

A model built from a config (Llama-3-8B shape by default, or Qwen3-30B-A3B: --model-type
qwen3_moe; benchmarks/decode_model.py's presets), random bf16 weights, loaded with
`tp_plan="auto"` and `arfusion.hf.prepare_for_compile`. For each batch mix (--mixes: 1 request;
16 and 64 concurrent requests; each request --prompt prompt tokens and --new output tokens,
greedy; new random prompts for every call, the same in every config) and each config, "off" (the
varlen and decode paths compiled by Inductor alone) and "on" (the same with the pass), side by
side in one run. Per config one manager serves every call, as
a server keeps one (`persistent_manager`): a first call of the largest mix compiles, captures
transformers' CUDA graphs and sizes the cache, then each mix runs --repeats timed calls that
reuse them. transformers' own CUDA graphs are on (--no-cuda-graphs turns them off).

Per call, from transformers' per-token timestamps (`record_timestamps`): time to first token (from
the request's admission), inter-token latency (median and p90 over every gap of every request), and
output tokens per second (all new tokens over the first admission to the last token); and how the
scheduler cut it into steps (each varlen step's query tokens, and the number of decode fast-path
steps), when each varlen step was launched, each step's time on the GPU and the GPU's idle time
between steps (`steps`), each distinct first-token time (`first_tokens_ms`) and Python's garbage
collections (`gc`): where a call's time went, on the host or on the GPU (serving_probes.py).
The table holds the medians over the timed calls and the ratio on / off. A timed call in which
transformers captured a CUDA graph (it records one per new padded size, also after the first
call) or Dynamo compiled, on any rank, is excluded and kept apart (`excluded_calls`); calls are made until
--repeats steady ones or twice as many were made. With TP, ranks other than 0 look for new requests
every 0.1 s when idle (transformers' generation loop), and rank 0's first step waits for them: a
call's TTFT and tokens/s then vary by up to 100 ms in either config, more than the pass changes.
--idle-wait-ms (default 1) shortens that wait on every rank; 100 is transformers' own. Ranks other
than 0 also see a call's end up to 1 s late (they poll for it), so timed calls start after a
barrier, as in a server whose generation loop never stops. Greedy tokens of "on" against "off":
identical up to the first step where the model's two best logits are within bf16 rounding
(arfusion.testing.greedy_departures).

--interleave: a model per config in one process, each keeping its manager; the timed calls alternate
(off on, on off, ...), so a slow stretch of the host (shared machines run up to 2x slower for seconds)
hits both configs; each row then also holds on / off per round (`pairs`). Every timed call records the
host's CPU use and a fixed host probe after it (`host`).

--profile-host: one more call under cProfile (the generation thread's host time). --profile-kernels:
one more call of the largest mix under torch.profiler (where the GPU time goes: attention, matmuls,
copies, all-reduces), after the timed rows are saved.

--fake-world N: one process standing for rank 0 of TP=N through torch's fake process group
(collectives compute nothing): the host path, graphs and kernels of a TP=N rank, without peers;
the pass runs its torch backend (FlashInfer needs peers), or with --flashinfer-host-path FlashInfer's
host path up to its kernel call, which is skipped (the host cost of a fused site without its peers:
the comparison for steps the host launches, --no-cuda-graphs). --shared-gpu: torchrun 2, both ranks on
GPU 0 over gloo with FlashInfer (tests/gpu/shared_gpu.py; the ranks take turns: correctness and
dispatch, not speed; the LM head is replicated and "off" runs without CUDA graphs, since gloo
collectives cannot be captured). --above-cap: "on" caps the fused kernel and the fast all-reduce at
one byte, so every call runs the op's run-time fallback (all-reduce, then the compiled norm), the
path of every prefill step above the kernel's cap; with --fake-world it keeps the real backend, so
one GPU times that path's host and device work against "off" (the all-reduces, nothing in both).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "tests" / "gpu")]
from common import (HOST_PATHS_NEED_FAKE_WORLD, add_host_path_args, flashinfer_host_path_only,  # noqa: E402
                    log_arfusion_info, no_multicast, save_json)
from decode_model import init_world, model_config, random_checkpoint  # noqa: E402
from serving_calls import (DICT_STATS, STATS_KEPT, add_stats, call_window, interleaved_calls,  # noqa: E402
                           pair_ratios, prompts_for, serving_metrics, steady_calls)
from serving_probes import (GcPauses, HostUse, host_probe_us, host_profile, kernel_profile,  # noqa: E402
                            record_steps, step_summary)

import arfusion  # noqa: E402
from arfusion.hf import prepare_for_compile, tp_kwargs  # noqa: E402
from arfusion.testing import fake_gloo_groups, generate_batch, greedy_departures  # noqa: E402

CONFIGS = ("off", "on")
PROFILED = 999  # the profiled calls' prompts (`prompts_for`'s call): new ones, as every timed call's


def shorten_idle_wait(seconds: float) -> None:
    """transformers' generation loop, when idle, waits up to 0.1 s for new requests; a request
    wakes rank 0 at once, but nothing wakes the other TP ranks, and rank 0's next step waits for
    them. From now on every continuous-batching manager made waits at most `seconds` instead."""
    import threading

    from transformers.generation.continuous_batching import continuous_api

    class ShortWait(threading.Event):
        def wait(self, timeout=None):
            return super().wait(timeout if timeout is None else min(timeout, seconds))

    made = continuous_api.ContinuousBatchingManager.__init__

    def init(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self._wake_up_loop = ShortWait()

    continuous_api.ContinuousBatchingManager.__init__ = init


def cache_sizes(model) -> dict:
    """num_blocks and max_batch_tokens of the cache of `model`'s kept continuous-batching manager
    (what transformers chose from free memory), or {} where this transformers keeps them elsewhere."""
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    sizes = {k: getattr(cache, k, None) for k in ("num_blocks", "max_batch_tokens")}
    return {k: int(v) for k, v in sizes.items() if isinstance(v, int)}


def load(args, device):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    # Its warning at each call that keeps the manager dropped; every other one shown (a failed warm-up
    # capture is a warning, and the first error after it says nothing of its cause).
    logging.getLogger("ContinuousBatchingLogger").addFilter(
        lambda record: not str(record.msg).startswith("Since you passed `persistent_manager=True`"))
    config = model_config(args, dist.get_world_size())
    path = random_checkpoint(config, device, args.ckpt_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=args.attn,
                                                 **tp_kwargs("auto", config=path)).eval()
    prepared = prepare_for_compile(model)
    if args.shared_gpu and args.cuda_graphs:  # a gloo all-gather cannot be captured: the LM head whole
        from safetensors.torch import load_file

        weights = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            weights.update(load_file(str(f)))
        full = weights["lm_head.weight"]
        model.lm_head = torch.nn.Linear(full.shape[1], full.shape[0], bias=False, dtype=full.dtype, device=device)
        with torch.no_grad():
            model.lm_head.weight.copy_(full)
    return config, model, prepared


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", default="llama", choices=["llama", "llama70b", "qwen3", "qwen3_moe"])
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the preset's)")
    p.add_argument("--tiny", action="store_true", help="hidden 256, 2 layers, vocab 512 (correctness runs)")
    p.add_argument("--mixes", default="1,16,64", help="concurrent requests per call, comma-separated")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed calls per mix and config")
    p.add_argument("--configs", default="off,on")
    p.add_argument("--interleave", action="store_true",
                   help="a model per config, each with its manager kept; the timed calls alternate A B, B A, ... "
                        "(one process, twice the weights; each cache takes half of --max-memory-percent, the second "
                        "gets the first's sizes)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--max-memory-percent", type=float, default=0.5, help="of free GPU memory for the KV cache")
    p.add_argument("--kv-padding", type=int, default=0, metavar="TOKENS",
                   help="transformers' kv_padding_interval_size (0: its default, 16384): a varlen step reads the "
                        "cache padded to a multiple of this many tokens")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "flash_attention_3"],
                   help="attention; flash_attention_3 takes transformers' decode fast path (paged kernel) and needs "
                        "benchmarks/device/fa3_setup.sh sourced first")
    p.add_argument("--backend", default="auto")
    p.add_argument("--fake-world", type=int, default=0, metavar="N")
    add_host_path_args(p)
    p.add_argument("--shared-gpu", action="store_true")
    p.add_argument("--above-cap", action="store_true",
                   help="every call of the pass's ops above its cap: the run-time fallback (see above)")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--profile-host", action="store_true",
                   help="one more call per config under cProfile (host_profile_CONFIG_rankR.txt)")
    p.add_argument("--profile-requests", type=int, default=0, metavar="N",
                   help="requests of the --profile-host call (0: the smallest mix)")
    p.add_argument("--profile-kernels", action="store_true",
                   help="one more call of the largest mix per config under torch.profiler: where the device time "
                        "goes (kernels_CONFIG_rankR.txt; the top 10 in the JSON)")
    p.add_argument("--trace", action="store_true",
                   help="with --profile-kernels: the host's ops too, and the call's timeline "
                        "(trace_CONFIG_rankR.json.gz)")
    p.add_argument("--idle-wait-ms", type=float, default=1.0,
                   help="longest wait of an idle generation loop for new requests (100: transformers' own)")
    p.add_argument("--log-info", action="store_true",
                   help="print arfusion's INFO lines (what it fused, what ran unfused and why) to stderr")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--out", default="results")
    args = p.parse_args()
    args.rank_of, args.argv = 0, sys.argv[1:]
    if args.interleave and len(args.configs.split(",")) != 2:
        p.error("--interleave alternates two configs: --configs off,on or on,off")
    if (args.flashinfer_host_path or args.nccl_host_path) and not args.fake_world:
        p.error(HOST_PATHS_NEED_FAKE_WORLD)
    no_multicast()
    if args.log_info:
        log_arfusion_info()
    if args.flashinfer_host_path:
        flashinfer_host_path_only()
    scoped = contextlib.ExitStack()
    cuda = torch.cuda.is_available() and not args.cpu
    one_rank = None  # with --nccl-host-path: the one-rank group the all-reduces run on
    if args.shared_gpu:
        import shared_gpu

        device = shared_gpu.init(True, hang_s=float(os.environ.get("CHECK_HANG_S", 0)) or None)
    else:
        if cuda:
            torch.cuda.set_device(0 if args.fake_world else int(os.environ.get("LOCAL_RANK", 0)))
        one_rank = init_world(args, cuda)
        if args.fake_world:  # continuous batching's scheduling group (gloo) joins the fake world too
            scoped.enter_context(fake_gloo_groups())
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    args.cuda_graphs = args.cuda_graphs and cuda
    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.config.recompile_limit = 64  # varlen shapes, off and on share the forward's code
    torch._dynamo.config.accumulated_recompile_limit = 1024
    say = print if rank == 0 else (lambda *a, **k: None)
    backend = args.backend if cuda and (args.above_cap or not args.fake_world) else "torch"
    if args.flashinfer_host_path and cuda:
        backend = "flashinfer"
    config, model, prepared = load(args, device)
    import transformers

    shorten_idle_wait(args.idle_wait_ms / 1e3)
    steps = []
    record_steps(steps)
    pauses = scoped.enter_context(GcPauses())  # its gc callback goes when main ends

    cb = {"max_memory_percent": args.max_memory_percent} if cuda else {}
    if cuda:
        cb.update(num_blocks=None, max_batch_tokens=None)
    if cuda and args.interleave:  # two caches of the same size: each takes half of the share
        cb["max_memory_percent"] = args.max_memory_percent / 2
    if args.kv_padding:
        cb["kv_padding_interval_size"] = args.kv_padding
    result = {"meta": {"command": f"{'python' if args.fake_world else f'torchrun --nproc-per-node {world}'} "
                                  f"benchmarks/bench_serving.py {' '.join(args.argv)}",
                       "date": time.strftime("%Y-%m-%d %H:%M"), "model_type": config.model_type,
                       "layers": config.num_hidden_layers, "hidden": config.hidden_size, "world": world,
                       "fake_world": args.fake_world, "interleave": args.interleave, "shared_gpu": args.shared_gpu,
                       "cuda_graphs": args.cuda_graphs,
                       "prompt": args.prompt, "new": args.new, "backend": backend, "prepared": prepared,
                       "flashinfer_host_path": args.flashinfer_host_path, "nccl_host_path": args.nccl_host_path,
                       "kv_padding": args.kv_padding or None, "attn": args.attn, "above_cap": args.above_cap,
                       "idle_wait_ms": args.idle_wait_ms,
                       "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                       "transformers": transformers.__version__}, "configs": {}, "mixes": {}}
    out = Path(args.out, f"serving_{config.model_type}_w{world}{'_fake' if args.fake_world else ''}"
                         f"{'_shared' if args.shared_gpu else ''}.json")
    one_byte = {world: 1 / 2**20} if args.above_cap else {}
    passes = {"off": None, "on": arfusion.PassConfig(enable_allreduce_fusion=True, backend=backend,
                                                     max_size_mb=one_byte, plain_max_size_mb=one_byte)}
    mixes = [int(m) for m in args.mixes.split(",")]

    def prompts(requests: int, call: int = 0) -> list[list[int]]:
        return prompts_for(requests, args.prompt, config.vocab_size, call)

    names = args.configs.split(",")
    models = {name: model for name in names}
    if args.interleave:  # a model each: each keeps its own manager (graphs, cache), so calls can alternate
        models[names[1]] = load(args, device)[1]
    made = {}  # (config, requests): the counter of its timed calls' prompts (`prompts_for`'s call)
    runs, totals = {}, {name: {} for name in names}

    def generate(name, requests, index, **kw):
        run = generate_batch(models[name], prompts(requests, index), args.new, config=passes[name],
                             cuda_graphs=graphs[name], record_timestamps=True, persistent=True, **cb, **kw)
        totals[name] = add_stats(totals[name], run.report.stats)
        return run

    def first_call(name):
        # One manager per config, kept across calls as a server keeps it: the first call (the largest
        # mix) compiles, captures and sizes it; the timed calls reuse its graphs and cache.
        first = generate(name, max(mixes), 0)
        say(f"{name}: first call (compile, CUDA-graph capture, {max(mixes)} requests) {first.seconds:.1f}s")
        return first.seconds

    def timed_call(name, requests):
        # A rank other than 0 returns from a call up to 1 s after rank 0 (it polls for the end) and
        # starts its loop only in the next; rank 0's new requests would wait for it: start together.
        dist.barrier()
        steps.clear()
        pauses.reset()
        index = made[(name, requests)] = made.get((name, requests), 0) + 1
        use = HostUse()  # the generation thread's CPU shows as the busiest other thread
        run = generate(name, requests, index)
        host = dict(use.since(), probe_us=host_probe_us(device))  # a slow host, whatever ran
        runs.setdefault((name, requests), run)  # each config's first: the same prompts
        admitted, last = call_window(run.outputs)
        return dict(serving_metrics(run.outputs), seconds=run.seconds, steps=step_summary(steps, admitted),
                    gc=pauses.summary(admitted, last), host=host, at_s=round(time.perf_counter() - began, 3))

    def any_rank(flag: bool) -> bool:  # every rank excludes the same calls (serving_calls.measured)
        seen = torch.tensor([int(flag)], device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        return bool(seen.item())

    def record(name, requests, calls, excluded):
        row = result["mixes"].setdefault(str(requests), {})
        kept = calls or excluded  # none steady: the medians of all, said so
        row[name] = {k: statistics.median(c[k] for c in kept) for k in ("ttft_ms", "itl_ms", "itl_p90_ms",
                                                                        "tokens_per_s", "new_tokens", "seconds")}
        row[name].update(calls=calls, excluded_calls=excluded, cuda_graphs=graphs[name], steady=bool(calls))
        say(f"{requests} requests, {name}: " + ", ".join(f"{k} {row[name][k]:.3g}" for k in
                                                         ("ttft_ms", "itl_ms", "itl_p90_ms", "tokens_per_s"))
            + f" ({len(calls)} steady calls, {len(excluded)} excluded: graphs captured or compiled)")
        if rank == 0:  # each row as it comes: a run cut short keeps what it measured
            save_json(str(out), result)

    def finish(name, first_s):
        threads = sorted(t.name for t in threading.enumerate())  # after the timed calls, the manager kept
        if args.profile_host:
            with host_profile(Path(args.out, f"host_profile_{name}_rank{rank}.txt")):
                generate(name, args.profile_requests or min(mixes), PROFILED)
        profiled = {}
        if args.profile_kernels:
            if rank == 0:  # the timed rows first: a profiled call that never returns keeps them
                save_json(str(out), result)
            trace = Path(args.out, f"trace_{name}_rank{rank}.json.gz") if args.trace else None
            with kernel_profile(Path(args.out, f"kernels_{name}_rank{rank}.txt"), device, profiled, trace):
                generate(name, max(mixes), PROFILED)
        models[name].destroy_cached_continuous_batching_manager()
        # Its CUDA-graph pool goes now, not in a garbage collection during the next capture (torch 2.11 aborts).
        gc.collect()
        stats = totals[name]
        result["configs"][name] = {"first_call_s": first_s, "python_threads": threads, **profiled,
                                   **{k: stats.get(k, {} if k in DICT_STATS else 0) for k in STATS_KEPT}}
        if eager := stats.get("eager_in_cuda_graphs"):  # each replays eagerly: this config's timings aren't the pass's
            say(f"{name}: ran eagerly inside CUDA-graph captures: {eager} (--log-info says why)")
        if rank == 0:
            save_json(str(out), result)

    # Over gloo (--shared-gpu) Inductor alone leaves gloo all-reduces, which cannot be captured.
    graphs = {name: args.cuda_graphs and not (args.shared_gpu and name == "off") for name in names}
    began = time.perf_counter()
    if not args.interleave:
        for name in names:
            first_s = first_call(name)
            for requests in mixes:
                record(name, requests, *steady_calls(lambda: timed_call(name, requests), args.repeats, any_rank))
            finish(name, first_s)
    else:
        first_s = {}
        for name in names:
            first_s[name] = first_call(name)
            if cuda and not cb.get("num_blocks"):  # the second manager gets the first's cache, not what is left
                result["meta"]["cache"] = cache_sizes(models[name])
                # transformers checks the given sizes against its share of the memory left now, which the
                # first model and cache have shrunk: the whole share of what is left holds the same cache
                cb.update(result["meta"]["cache"], max_memory_percent=args.max_memory_percent)
        for requests in mixes:
            kept = interleaved_calls({name: (lambda name=name: timed_call(name, requests)) for name in names},
                                     args.repeats, any_rank)
            for name in names:
                record(name, requests, *kept[name])
        for name in names:
            finish(name, first_s[name])
    for requests in mixes:
        row = result["mixes"][str(requests)]
        if ("off", requests) in runs and ("on", requests) in runs:
            departures = greedy_departures(model, prompts(requests, 1), runs[("off", requests)], runs[("on", requests)])
            row["tokens"] = {"ok": all(d["ok"] for d in departures),
                             "departures": [d for d in departures if d["departs_at"] is not None]}
            row["on_over_off"] = {k: row["on"][k] / row["off"][k] for k in ("ttft_ms", "itl_ms", "tokens_per_s")}
            if args.interleave:
                row["pairs"] = {k: pair_ratios(row["on"]["calls"], row["off"]["calls"], k)
                                for k in ("ttft_ms", "itl_ms", "tokens_per_s")}
            say(f"{requests} requests, on / off: " + ", ".join(f"{k} {v:.3f}" for k, v in row["on_over_off"].items())
                + f"; tokens ok: {row['tokens']['ok']}")
            if row.get("pairs") and all(row["pairs"].values()):  # the spread the medians' ratio hides
                say(f"{requests} requests, on / off per round (median, min-max of {len(row['pairs']['itl_ms'])}): "
                    + ", ".join(f"{k} {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
                                for k, v in row["pairs"].items()))
    if one_rank is not None:
        result["meta"]["all_reduces_on_one_rank"] = one_rank.all_reduces
    if rank == 0:
        save_json(str(out), result)
    if rank == 0:
        print(json.dumps({m: r.get("on_over_off") for m, r in result["mixes"].items()}), flush=True)
    dist.barrier()
    scoped.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
