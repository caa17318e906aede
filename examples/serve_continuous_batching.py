"""transformers' continuous batching (`generate_batch`) at TP=N, with and without arfusion.

    torchrun --nproc-per-node 2 examples/serve_continuous_batching.py [--model-type qwen3_moe] [--cuda-graphs]

Builds a small model of the type from its default config (random weights, nothing downloaded),
loads it with `tp_plan="auto"` (gloo on CPU, NCCL on CUDA) and serves the same greedy requests
through transformers' continuous batching twice: compiled without the pass, then compiled with it.
Each config runs the requests twice: the first call compiles, the second is timed. Prints the
all-reduces fused (and merged), the backend's calls, whether the tokens match the run without
the pass, and output tokens per second of each. fp32 on CPU, where the tokens must match exactly;
bf16 on GPUs, where rounding may flip a near tie of the two best logits (examples/compile_hf_model.py
judges such ties). On 2 CPU cores the tokens/s are the host's, not a speed claim. The last line is
a JSON summary (used by the tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

import arfusion
import arfusion.hf
from arfusion.check import load_tp_model, save_random_model
from arfusion.hf.configs import tiny_config
from arfusion.testing import generate_batch  # model.generate_batch, both paths compiled: docs/usage.md

logging.getLogger("torchao").setLevel(logging.ERROR)  # torchao's CUDA extensions on a CPU torch: not ours


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", default="llama")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--cuda-graphs", action="store_true", help="transformers' own CUDA graphs (GPUs)")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    dtype = torch.bfloat16 if cuda else torch.float32
    path = [tempfile.mkdtemp(prefix="arfusion-cb-") if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        save_random_model(tiny_config(args.model_type), path[0], dtype=dtype)
    dist.broadcast_object_list(path, src=0)
    model = load_tp_model(path[0], dtype=dtype)  # tp_plan="auto", then arfusion.hf.prepare_for_compile
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0], ignore_errors=True)

    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 24, (args.requests,), generator=g)]
    runs = {}
    for name, config in (("without the pass", None), ("with the pass", arfusion.PassConfig(backend="auto"))):
        first = generate_batch(model, prompts, args.new_tokens, config=config, cuda_graphs=args.cuda_graphs,
                               max_batch_tokens=256)  # compiles
        timed = generate_batch(model, prompts, args.new_tokens, config=config, cuda_graphs=args.cuda_graphs,
                               max_batch_tokens=256)
        runs[name] = {"tokens": timed.tokens, "report": first.report, "dispatch": timed.report.stats["dispatch"],
                      "tokens_per_s": sum(len(t) for t in timed.tokens.values()) / timed.seconds}
    off, on = runs["without the pass"], runs["with the pass"]
    report = on["report"]
    summary = {"model_type": args.model_type, "world": dist.get_world_size(), "dtype": str(dtype),
               "requests": args.requests, "new_tokens": args.new_tokens, "cuda_graphs": args.cuda_graphs,
               "all_reduces": report.all_reduces, "fused_sites": report.fused, "merged": report.merged,
               "why_not_codes": dict(report.codes), "verdict": report.verdict, "dispatch": on["dispatch"],
               "same_tokens": on["tokens"] == off["tokens"],
               "tokens_per_s": {"off": round(off["tokens_per_s"], 1), "on": round(on["tokens_per_s"], 1)}}
    if dist.get_rank() == 0:
        print(f"{args.model_type}, TP={summary['world']}, {args.requests} requests x {args.new_tokens} new tokens")
        print(f"all-reduces of every graph compiled: {report.verdict}")
        print(f"fused-op calls of the timed call: {summary['dispatch']}")
        print(f"tokens equal to the run without the pass: {summary['same_tokens']}")
        print(f"output tokens/s (second call; host and {'GPU' if cuda else 'CPU'}): "
              f"without {summary['tokens_per_s']['off']}, with {summary['tokens_per_s']['on']}")
        print(json.dumps(summary))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
