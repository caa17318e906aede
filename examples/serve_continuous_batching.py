"""transformers' continuous batching (`generate_batch`) at TP=N, with and without arfusion.

    torchrun --nproc-per-node 2 examples/serve_continuous_batching.py [--model-type qwen3_moe] [--cuda-graphs]

Builds a small model of the type from its default config (random weights, nothing downloaded),
loads it with `tp_plan="auto"` (gloo on CPU, NCCL on CUDA) and serves the same greedy requests
through transformers' continuous batching twice: compiled without the pass, then compiled with it.
Each config runs the requests twice: the first call compiles, the second is timed. Prints the
all-reduces fused (and merged) over every graph the first call compiled (transformers may compile
the forward more than once: each graph holds a whole forward's all-reduces), the backend's calls
in the timed call, whether the tokens match the run without the pass, and output tokens per
second of each. fp32 on CPU, where the tokens must match exactly; bf16 on GPUs, where rounding
may flip a near tie of the two best logits, which the verdict accepts (within 4 ulp of the
largest logit: `arfusion.testing.greedy_departures`). On 2 CPU cores the tokens/s are the host's, not a speed claim. The last line is
a JSON summary (used by the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

import arfusion
import arfusion.hf
from arfusion.check import load_tp_model, save_random_model
from arfusion.hf.configs import tiny_config
from arfusion.noise import quiet_known_noise
from arfusion.testing import generate_batch, greedy_departures  # generate_batch: docs/usage.md

quiet_known_noise()  # torchao's and torch's log lines no user can act on: arfusion/noise.py names each


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", default="llama")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--cuda-graphs", action="store_true", help="transformers' own CUDA graphs (GPUs)")
    args = p.parse_args()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("serve_continuous_batching.py: run it under torchrun, one process per rank: "
              "torchrun --nproc-per-node 2 examples/serve_continuous_batching.py", file=sys.stderr)
        sys.exit(2)

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the tiny checkpoint's save and load bars
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
        runs[name] = {"run": timed, "report": first.report, "dispatch": timed.report.stats["dispatch"],
                      "tokens_per_s": sum(len(t) for t in timed.tokens.values()) / timed.seconds}
    off, on = runs["without the pass"], runs["with the pass"]
    report = on["report"]
    # fp32 (CPU): the tokens must be the same. bf16 (GPUs): a request may depart at a near tie of the
    # two best logits, which rounding flips (every rank runs the tie check: it runs the model).
    departures = greedy_departures(model, prompts, off["run"], on["run"])
    departed = [d["request"] for d in departures if d["departs_at"] is not None]
    tokens_verdict = "match" if not departed else "near_tie" if all(d["ok"] for d in departures) else "mismatch"
    summary = {"model_type": args.model_type, "world": dist.get_world_size(), "dtype": str(dtype),
               "requests": args.requests, "new_tokens": args.new_tokens, "cuda_graphs": args.cuda_graphs,
               "graphs": report.graphs, "all_reduces": report.all_reduces, "fused_sites": report.fused, "merged": report.merged,
               "why_not_codes": dict(report.codes), "all_reduces_verdict": report.verdict, "dispatch": on["dispatch"],
               "tokens_verdict": tokens_verdict, "requests_departing": departed,
               "tokens_per_s": {"off": round(off["tokens_per_s"], 1), "on": round(on["tokens_per_s"], 1)}}
    if dist.get_rank() == 0:
        print(f"{args.model_type}, TP={summary['world']}, {args.requests} requests x {args.new_tokens} new tokens")
        each = f", {report.all_reduces // report.graphs} all-reduces each" if report.graphs else ""
        print(f"the {report.graphs} graph{'s' * (report.graphs != 1)} compiled by the first call{each}: "
              f"{report.verdict}")
        print(f"fused-op calls of the timed call: {summary['dispatch']}")
        print({"match": f"tokens: the same as without the pass, in all {args.requests} requests",
               "near_tie": f"tokens: the same as without the pass up to a near tie of the two best logits "
                           f"(within 4 ulp) in requests {departed}: rounding flips such ties",
               "mismatch": f"tokens: DIFFERENT from the run without the pass in requests {departed}, "
                           f"not at a near tie"}[tokens_verdict])
        where = "GPU" if cuda else "CPU, where the PyTorch reference backend brings no speed-up"
        print(f"output tokens/s of the timed call ({where}): "
              f"without {summary['tokens_per_s']['off']}, with {summary['tokens_per_s']['on']}")
        print(json.dumps(summary))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
