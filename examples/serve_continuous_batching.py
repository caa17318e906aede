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
import gc
import json
import logging
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

import arfusion
import arfusion.hf
from arfusion.check import load_tp_model, save_random_model
from arfusion.hf.configs import tiny_config

logging.getLogger("torchao").setLevel(logging.ERROR)  # torchao's CUDA extensions on a CPU torch: not ours


def serve(model, prompts, new_tokens: int, options: dict, cuda_graphs: bool) -> tuple[dict, float]:
    """One `generate_batch` call as a server makes it: both paths compiled with `options`."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig, ContinuousBatchingConfig

    compiled = CompileConfig(mode=None, options=options, fullgraph=False)  # Inductor's default mode
    config = ContinuousBatchingConfig(varlen_compile_config=compiled, decode_compile_config=compiled,
                                      use_cuda_graph=cuda_graphs, num_blocks=64, max_batch_tokens=256)
    generation = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=config,
                                   progress_bar=False)
    seconds = time.perf_counter() - start
    gc.collect()  # the finished manager's graph pool, freed before the next one captures
    failed = {k: o.error for k, o in out.items() if o.error}
    if failed:
        raise RuntimeError(f"generate_batch failed: {failed}")
    return {k: list(o.generated_tokens) for k, o in out.items()}, seconds


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
    with_pass = arfusion.inductor_options(arfusion.PassConfig(backend="auto"))
    runs = {}
    for name, options in (("without the pass", {}), ("with the pass", with_pass)):
        before = arfusion.stats()
        serve(model, prompts, args.new_tokens, options, args.cuda_graphs)  # compiles
        timed = arfusion.stats()
        tokens, seconds = serve(model, prompts, args.new_tokens, options, args.cuda_graphs)
        after = arfusion.stats()
        calls = {k: v - timed["dispatch"].get(k, 0) for k, v in after["dispatch"].items()
                 if v != timed["dispatch"].get(k, 0)}
        runs[name] = {"tokens": tokens, "seconds": seconds, "dispatch": calls,
                      "fused_sites": after["fused_sites"] - before["fused_sites"],
                      "tokens_per_s": sum(len(t) for t in tokens.values()) / seconds}
    off, on = runs["without the pass"], runs["with the pass"]
    stats = arfusion.stats()
    summary = {"model_type": args.model_type, "world": dist.get_world_size(), "dtype": str(dtype),
               "requests": args.requests, "new_tokens": args.new_tokens, "cuda_graphs": args.cuda_graphs,
               "fused_sites": on["fused_sites"], "merged": stats["summed_all_reduces_merged"],
               "why_not_codes": stats["why_not_codes"], "dispatch": on["dispatch"],
               "same_tokens": on["tokens"] == off["tokens"],
               "tokens_per_s": {"off": round(off["tokens_per_s"], 1), "on": round(on["tokens_per_s"], 1)}}
    if dist.get_rank() == 0:
        print(f"{args.model_type}, TP={summary['world']}, {args.requests} requests x {args.new_tokens} new tokens")
        print(f"sites fused, over every graph compiled: {summary['fused_sites']} "
              f"(all-reduces merged into another: {summary['merged']}); "
              f"not fused: {summary['why_not_codes'] or 'none'}")
        print(f"calls of the second run with the pass: {summary['dispatch']}")
        print(f"tokens equal to the run without the pass: {summary['same_tokens']}")
        print(f"output tokens/s (second call; host and {'GPU' if cuda else 'CPU'}): "
              f"without {summary['tokens_per_s']['off']}, with {summary['tokens_per_s']['on']}")
        print(json.dumps(summary))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
