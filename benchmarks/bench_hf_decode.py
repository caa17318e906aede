"""End to end: a tensor-parallel HF model's decode and prefill, with and without arfusion.

    torchrun --nproc-per-node 2 benchmarks/bench_hf_decode.py --out results/    # 2 GPUs
    torchrun --nproc-per-node 2 benchmarks/bench_hf_decode.py --tiny            # CPU/gloo, seconds
    torchrun --nproc-per-node 1 benchmarks/bench_hf_decode.py --phases generate loop --configs off  # TP=1
    python benchmarks/bench_hf_decode.py --fake-world 2 --layers 8 --phases generate loop   # TP=2's host path, one GPU
    python benchmarks/bench_hf_decode.py --plot results/decode_llama_w2.json results/decode_llama_w4.json
    torchrun --nproc-per-node 1 benchmarks/bench_hf_decode.py --rank-of 2 --phases decode   # TP=2's floor

An HF model built from a config (Llama-3-8B shape by default; --model-type qwen3, gemma,
qwen3_moe (Qwen3-30B-A3B) or deepseek_v2 (DeepSeek-V2-Lite) for those architectures), random
bf16 weights, loaded with `tp_plan="auto"`, static KV cache, compiled twice: "off" (plain
torch.compile) and "on" (the same with arfusion's pass). Both share the weights; each has its
own caches. In one run, phase by phase (each phase writes the JSON again, so a run cut short
keeps what it measured):

  startup   compile + first decode token at batch 1, cold (fresh FX graph cache) and warm (the
            same cache after torch._dynamo.reset()), arfusion's config first; the pass's own time
            from arfusion.stats()
  decode    the headline: the whole compiled decode step captured in one CUDA graph and replayed,
            median ms per step over --replays replays (CUDA events), batch 1, 8, 32; tokens/s; with
            --floor also "floor", the step with every all-reduce dropped (its lower bound), and the
            share of the all-reduces' time (off - floor) that the pass removes
  accuracy  teacher forcing: the same prompt and the same --steps tokens fed to eager, off and on
            (and to the same weights run in fp32, the reference all three are measured against);
            per step the logits' relative L2 error against eager and between on and off, and
            top-1 agreement (random weights make near ties common: both numbers, not one)
  prefill   one compiled (dynamic length) prefill captured per length (512, 2048), batch 1,
            last-token logits as serving engines compute them; ms and tokens/s. With
            --quantized fp8 a third config, "quantized": the pass with quantized_allreduce="fp8"
            (the backend's crossover decides per site), its speedups and how many of the op's
            calls in one prefill ran the quantized all-reduce (on CPU the torch backend emulates
            it at every size)
  kernels   PyTorch profiler over uncaptured compiled decode steps: kernels and GPU time per step,
            by kind (NCCL, fused all-reduce, Triton, GEMM, attention, other)
  loop      what users run, 1: a greedy loop (eager prefill, then the step compiled with
            mode="reduce-overhead", cudagraph trees) making n new tokens per call
  generate  what users run, 2: HF generate() with a static cache and its own compile, greedy and
            sampling at batch 1 and 8 (--gen-variants), in CUDA graphs or, with --generate-mode
            default, without (each step's launches, the pass's ops included, on the host)
            loop and generate time off and on in interleaved pairs (--pairs, the config going first
            alternating), each config's calls at two lengths (--lengths 144 16): steady-state ms
            per token by difference, the fixed per-call cost (prefill, cache set-up) apart, each
            pair's on/off ratio with the median and spread; pairs in which a call compiled or
            re-recorded a CUDA graph are excluded and counted; on GPU per token: GPU busy time,
            kernels, CUDA-graph and kernel launches (decode_host.py)

On CPU (gloo) CUDA graphs, the profiler's kernels and reduce-overhead do not exist: decode and
prefill are timed as plain compiled calls, and loop and generate use the default compile mode.

--rank-of N: one process, no TP, a model holding one rank's share of the TP=N model (heads,
intermediates, vocabulary divided by N): the TP=N step without any communication, the floor no
all-reduce fusion can go below.

--fake-world N: one process (plain `python`, no torchrun) standing for rank 0 of TP=N through
torch's fake process group: rank 0's shards load with the TP plan, compile and run, and every
collective returns at once without computing. Numbers are wrong and times lack communication;
the host path is real (graphs compiled, CUDA-graph replays and kernel launches per token,
compile time), so it measures that without peers. The pass fuses as on a real rank; the fused
op runs the torch backend (FlashInfer and aiter need peers), so "on" GPU times are not arfusion's.
With --flashinfer-host-path it runs FlashInfer's host path instead, up to the kernel call, which
is skipped (a stand-in workspace): "on" then pays every host cost of a fused site but the
kernel's launch, the comparison for steps the host launches (--generate-mode default). With
--nccl-host-path every all-reduce (off's above all) runs on a real group of one rank, NCCL's host
path and kernel, where the fake group's costs next to nothing (benchmarks/nccl_host_path.py).

Modules: decode_model.py (presets, model, Bench), decode_phases.py (startup .. kernels),
decode_host.py (loop, generate), decode_report.py (table, plot), common.py (shared helpers).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, also under torchrun

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from arfusion.backends import get_backend  # noqa: E402
from arfusion.decisions import Reason  # noqa: E402
from arfusion.config import QUANTIZED_LEVELS  # noqa: E402
from common import (HOST_PATHS_NEED_FAKE_WORLD, add_host_path_args, flashinfer_host_path_only, no_multicast,  # noqa: E402
                    numa_placement)
from decode_host import parse_variant, phase_generate, phase_loop  # noqa: E402
from decode_model import CONFIGS, PRESETS, Bench, one_rank_shape  # noqa: E402,F401  (one_rank_shape: tests)
from decode_phases import phase_accuracy, phase_decode, phase_kernels, phase_prefill, phase_startup  # noqa: E402
from decode_report import format_table, plot  # noqa: E402

PHASES = {"startup": phase_startup, "decode": phase_decode, "accuracy": phase_accuracy, "prefill": phase_prefill,
          "kernels": phase_kernels, "loop": phase_loop, "generate": phase_generate}
NEED_BOTH = ("startup", "decode", "accuracy", "prefill", "kernels")  # compare off and on within the phase


def run(b: Bench) -> None:
    b.load()
    run_phases(b)
    b.say(format_table(b.result))
    # A run once stopped here for minutes at TP=4 (after its results were saved): if that
    # recurs, print where every thread is and exit instead of hanging.
    faulthandler.dump_traceback_later(90, exit=True)
    dist.barrier()
    # That hang was inside destroy_process_group (TP=4, and TP=2 after the loop phase, with
    # FlashInfer already closed), while cudagraph trees still held graphs with NCCL kernels
    # in them: free those graphs, then FlashInfer's workspaces, then the group.
    torch._dynamo.reset()  # also shuts the cudagraph trees down
    b.compiled.clear()
    gc.collect()
    b.sync()
    backend = get_backend("flashinfer")
    if not isinstance(backend, Reason):
        backend.close()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def run_phases(b: Bench) -> None:
    """Each phase in turn, its result saved after it (a failing one keeps what it saved)."""
    for phase in b.args.phases:
        if b.out_of_time():
            b.result["phases"][phase] = {"skipped": "time budget (--budget-s) spent"}
            b.say(f"{phase}: skipped, time budget spent")
            continue
        t0 = time.time()
        try:
            result = PHASES[phase](b)
        except Exception as e:  # the same shapes on every rank: an error is every rank's
            if b.args.strict:
                raise
            # What the phase saved before it failed (decode: its timed rows and configs) stays.
            result = {**b.result["phases"].get(phase, {}), "error": f"{type(e).__name__}: {str(e)[:500]}"}
            b.say(f"{phase}: FAILED {result['error']}")
        result["phase_seconds"] = round(time.time() - t0, 1)
        b.result["phases"][phase] = result
        b.save()


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", default="llama", choices=sorted(PRESETS))
    p.add_argument("--tiny", action="store_true", help="a tiny config (hidden 256, 2 layers): CPU/CI")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even where CUDA exists")
    p.add_argument("--layers", type=int, default=0, help="override the number of layers")
    p.add_argument("--unique-layers", type=int, default=0, metavar="N",
                   help="write and load N layers' weights only and reuse them in turn up to --layers (each layer "
                        "its own KV cache): a deep model's step without its whole checkpoint")
    p.add_argument("--rank-of", type=int, default=1, metavar="N",
                   help="one process, no TP: the model holds one rank's share of TP=N (heads, intermediates, "
                        "vocabulary divided by N), so its step is the TP=N step without communication")
    p.add_argument("--fake-world", type=int, default=0, metavar="N",
                   help="one process as rank 0 of TP=N through torch's fake process group (no torchrun): the "
                        "host path of TP=N without peers; collectives do not compute")
    p.add_argument("--backend", default="auto", choices=["auto", "flashinfer", "aiter", "torch"])
    add_host_path_args(p)
    p.add_argument("--pin-numa", action="store_true",
                   help="move the process to the CPUs of its GPU's NUMA node before anything loads (a host "
                        "with one node: nothing to do); the placement is in the JSON's meta either way")
    p.add_argument("--init", default="hf", choices=["hf", "scaled"],
                   help="random weights: HF's init (std 0.02), or with the residual branches' output "
                        "projections scaled by 1/sqrt(2 * layers) (GPT-2's init, closer to trained models)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--floor", action="store_true",
                   help="decode: also the step with every all-reduce dropped (no communication, wrong numbers), "
                        "the floor under off and on in the same run")
    p.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--quantized", choices=QUANTIZED_LEVELS,
                   help="prefill also with the pass and this quantized all-reduce (fp8 on FlashInfer)")
    p.add_argument("--prompt", type=int, default=32, help="context tokens before the decode steps")
    p.add_argument("--steps", type=int, default=32, help="teacher-forced steps of the accuracy phase")
    p.add_argument("--lengths", type=int, nargs=2, default=None, metavar=("LONG", "SHORT"),
                   help="new tokens per call of loop and generate, timed by difference (default 144 16; "
                        "--tiny 12 4)")
    p.add_argument("--pairs", type=int, default=8,
                   help="loop/generate: interleaved off/on pairs per variant that must be valid (no compile or "
                        "CUDA-graph recording in them); at most twice as many are tried")
    p.add_argument("--generate-mode", default="reduce-overhead", choices=["reduce-overhead", "default"],
                   help="generate()'s compile: CUDA graphs (HF's default) or none (every step launched from the host)")
    p.add_argument("--gen-variants", nargs="+", default=["greedy:1"], metavar="MODE:BATCH",
                   help="generate (and loop, greedy only): sampling mode and batch, e.g. greedy:1 sample:1 greedy:8 "
                        "sample:8")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                   help="configs of loop and generate (off alone at TP=1: nothing to fuse)")
    p.add_argument("--replays", type=int, default=100, help="CUDA-graph replays per decode measurement")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES))
    p.add_argument("--budget-s", type=float, default=0,
                   help="skip what would pass this many seconds: a phase starting after it; a decode batch that "
                        "compiles its graph, or a generate()/loop variant, that would end after it (rank 0 decides "
                        "for every rank)")
    p.add_argument("--strict", action="store_true", help="raise on a failing phase (tests)")
    p.add_argument("--ckpt-dir", default=None, help="where random checkpoints are written (default: temp dir)")
    p.add_argument("--cache-root", default=None, help="where the fresh Inductor cache dirs go (default: temp dir)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--tag", default="", help="suffix of the JSON file name (runs of some phases each)")
    p.add_argument("--plot", nargs="+", help="decode_*.json files to plot instead of measuring")
    p.add_argument("--png", default="bench_hf_decode.png")
    args = p.parse_args(argv)
    args.argv = argv
    workers = int(os.environ.get("WORLD_SIZE", 1))
    if args.rank_of > 1 and workers != 1:
        p.error("--rank-of runs one rank's share alone: start it with --nproc-per-node 1")
    if args.fake_world:
        if workers != 1 or "TORCHELASTIC_RUN_ID" in os.environ:
            p.error("--fake-world runs one process: start it with python, not torchrun")
        if args.rank_of > 1:
            p.error("--fake-world and --rank-of exclude each other")
        if args.flashinfer_host_path:  # FlashInfer's host path on a stand-in workspace, no kernel
            args.backend = "flashinfer"
        elif args.backend != "torch":  # FlashInfer and aiter build workspaces with their peers
            args.backend = "torch"
    elif args.flashinfer_host_path or args.nccl_host_path:
        p.error(HOST_PATHS_NEED_FAKE_WORLD)
    if args.configs != list(CONFIGS) and set(args.phases) & set(NEED_BOTH):
        p.error(f"--configs applies to loop and generate; {sorted(set(args.phases) & set(NEED_BOTH))} "
                "compare off and on")
    if args.unique_layers and not 0 < args.unique_layers < args.layers:
        p.error("--unique-layers N: fewer layers than --layers, which it repeats up to")
    if args.unique_layers and "accuracy" in args.phases:  # it compares with the checkpoint's own model
        p.error("--unique-layers: not with the accuracy phase")
    try:
        [parse_variant(v) for v in args.gen_variants]
    except ValueError as e:
        p.error(str(e))
    if args.lengths is None:
        args.lengths = [12, 4] if args.tiny else [144, 16]
    if min(args.lengths) < 2 or args.lengths[0] == args.lengths[1]:
        p.error("--lengths: two different lengths, each at least 2")
    if args.tiny:
        args.prefill = [n for n in args.prefill if n <= 64] or [16, 64]
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.plot:
        plot(args.plot, args.png)
        return
    args.numa = numa_placement(int(os.environ.get("LOCAL_RANK", 0)), pin=args.pin_numa)
    if args.flashinfer_host_path:
        flashinfer_host_path_only()
    if args.quantized:  # never NVLink multicast (NCCL NVLS, torch symmetric memory): as .device/setup.sh
        no_multicast()
    run(Bench(args))


if __name__ == "__main__":
    main()
