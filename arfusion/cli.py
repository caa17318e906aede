"""The `arfusion` command.

    torchrun --nproc-per-node 4 --no-python arfusion tune --hidden 4096 [--dtype bf16] [--quantized fp8 [--knobs]]
    arfusion table            # what dispatch would do, per table entry and tuned entry
    arfusion check llama      # what the pass fuses in a HF model: CPU, one process (docs/check.md)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from . import check, tuning
from .noise import quiet_known_noise
from .backends import flashinfer_dispatch as dispatch
from .backends import get_backend
from .decisions import Reason

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CHECK_DESCRIPTION = """\
Shows what the arfusion pass does with every all-reduce of a Hugging Face model.
It prints one table per token count and a one-line verdict.
It needs no GPU, no torchrun and no download: it runs on a CPU, in one process.

    arfusion check llama                      # a model type: its config class's defaults
    arfusion check /path/to/model --tp 4      # a local directory with a config.json
    arfusion check qwen3_moe --tokens 1,8 --quant fp8-dynamic --json check.json
"""


def _tune(args) -> int:
    if "RANK" not in os.environ:
        print("arfusion tune: run it under torchrun, one process per GPU, e.g.\n"
              "  torchrun --nproc-per-node 4 --no-python arfusion tune --hidden 4096", file=sys.stderr)
        return 2
    local = int(os.environ.get("LOCAL_RANK", 0))
    if not torch.cuda.is_available():
        print("arfusion tune: no CUDA GPU here; it times FlashInfer's kernels on NVIDIA GPUs",
              file=sys.stderr)
        return 2
    backend = get_backend("flashinfer")
    reason = backend if isinstance(backend, Reason) else backend.unavailable(torch.device("cuda", local))
    if reason:
        print(f"arfusion tune: FlashInfer cannot run here: {reason}", file=sys.stderr)
        return 2
    torch.cuda.set_device(local)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else tuning.DEFAULT_TOKENS
    try:
        for hidden in args.hidden:
            entry = tuning.tune(hidden, DTYPES[args.dtype], tokens, cache=args.cache, eps=args.eps,
                                calls=args.calls, replays=args.replays, quantized=args.quantized, knobs=args.knobs)
            if dist.get_rank() == 0:
                print(f"\n{entry['gpu']}, world {entry['world_size']}, hidden {hidden}, {entry['dtype']}")
                print(tuning.format_rows(entry))
        if dist.get_rank() == 0:
            print(f"stored in {args.cache or dispatch.cache_path()}")
    except tuning.CannotTune as e:
        print(e, file=sys.stderr)
        return 2
    finally:
        backend = get_backend("flashinfer")
        if not isinstance(backend, Reason):
            backend.close()
        if own_group:
            dist.destroy_process_group()
    return 0


def _table(args) -> int:
    print("seed table (bytes per rank, inclusive):")
    print(f"{'SM':>4} {'world':>5} {'dtype':>9} {'fuse up to':>12} {'one-shot up to':>15}")
    for (sm, ws, dtype), lim in sorted(dispatch.SEED_TABLE.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]))):
        print(f"{sm:>4} {ws:>5} {str(dtype).removeprefix('torch.'):>9} "
              f"{lim.max_fused_bytes / dispatch.MiB:>9.2f} MiB {lim.oneshot_max_bytes / dispatch.MiB:>11.2f} MiB")
    print(f"tuned cache: {dispatch.cache_path()} ({'present' if dispatch.cache_hash() else 'absent'})")
    for key, entry in sorted(dispatch.tuned_entries().items()):
        quantized = "".join(f", {lv} quantized all-reduce " + ("never" if start is None else f"from {start} tokens")
                            for lv, start in entry.get("quantized_min_tokens", {}).items())
        knobs = "".join(f", {lv} launch knobs " + dispatch.steps_text(steps, "tokens")
                        for lv, steps in entry.get("quantized_knobs", {}).items())
        print(f"  {key}: fuse up to {entry['max_fused_tokens']} tokens, one-shot up to "
              f"{entry['oneshot_max_tokens']} tokens{quantized}{knobs}")
    print("plain all-reduce seed table (the fast path of all-reduces that are not sites; MiB per rank, inclusive):")
    for (sm, ws), mib in sorted(dispatch.PLAIN_MAX_MIB.items()):
        print(f"  SM{sm}x world {ws}: up to {mib:g} MiB")
    print("quantized all-reduce seed table (opt-in; MiB per rank from which it is used, inclusive):")
    for (sm, ws), levels in sorted(dispatch.QUANTIZED_MIN_MIB.items()):
        print(f"  SM{sm}x world {ws}: " + ", ".join(f"{lv} from {mib:g} MiB" for lv, mib in levels.items()))
    for (sm, ws), steps in sorted(dispatch.QUANTIZED_KNOBS.items()):
        print(f"  SM{sm}x world {ws} launch knobs: " + dispatch.steps_text([(mib * dispatch.MiB, k) for mib, k in steps]))
    if args.json:
        print(json.dumps(dispatch.tuned_entries(), indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    quiet_known_noise()  # third-party log lines no user can act on (arfusion/noise.py says whose)
    parser = argparse.ArgumentParser(prog="arfusion", description="arfusion utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    tune = sub.add_parser("tune", help="measure fused vs unfused on this machine (under torchrun)")
    tune.add_argument("--hidden", type=int, nargs="+", required=True, help="model hidden size(s)")
    tune.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    tune.add_argument("--tokens", default="", help="comma-separated token counts (default: 1..8192)")
    tune.add_argument("--cache", default=None, help="cache file (default: $ARFUSION_TUNE_CACHE or "
                      "~/.cache/arfusion/flashinfer-tuning.json)")
    tune.add_argument("--eps", type=float, default=1e-6)
    tune.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    tune.add_argument("--replays", type=int, default=30, help="graph replays per measurement")
    tune.add_argument("--quantized", choices=["fp8"], default=None,
                      help="also measure where FlashInfer's quantized all-reduce starts to pay")
    tune.add_argument("--knobs", action="store_true",
                      help="with --quantized: also time FlashInfer's launch knobs for it (block size, P2P phase 3) "
                           "from 1 MiB per rank and store the fastest")
    tune.set_defaults(func=_tune)
    table = sub.add_parser("table", help="print the dispatch table and tuned entries")
    table.add_argument("--json", action="store_true", help="also dump the tuned entries")
    table.set_defaults(func=_table)
    chk = sub.add_parser("check", help="what the pass fuses in a Hugging Face model (CPU, one process, no download)",
                         description=CHECK_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    chk.add_argument("model", help="a model type of transformers (its config class's defaults), or a local "
                     "directory with a config.json")
    chk.add_argument("--tp", type=int, default=2, help="tensor-parallel size (ranks of the fake process group)")
    chk.add_argument("--tokens", default="1,8", help="comma-separated token counts, one compile each")
    chk.add_argument("--quant", choices=check.QUANTS, default=None,
                     help="an FP8 activation quant after each norm, as FP8 checkpoints spell it")
    chk.add_argument("--json", default=None, help="also write the rows, verdicts and stats to this file")
    chk.add_argument("--quiet", action="store_true", help="no progress bar")
    chk.set_defaults(func=check.main)
    args = parser.parse_args(argv)
    if getattr(args, "knobs", False) and not args.quantized:
        parser.error("--knobs: the launch knobs are the quantized all-reduce's; add --quantized fp8")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
