"""Compile a tensor-parallel Hugging Face model with arfusion and compare it with eager.

    torchrun --nproc-per-node 2 examples/compile_hf_model.py [--model-type qwen3]

Builds a small model from a config (random weights, nothing downloaded), loads it with
`tp_plan="auto"` (spelled as the installed transformers wants it: `arfusion.hf.tp_kwargs`, with
expert parallelism over the same ranks where the TP plan leaves a MoE model's experts whole;
gloo on CPU, NCCL on CUDA), compiles it with the fusion pass and prints what was fused, which
backend ran, the logits' difference to the uncompiled model, 16 greedy tokens from both and a
verdict on them. Random weights make near ties between the two best logits, and rounding noise
flips them: the verdict accepts a first difference only at such a tie (`judge_tokens`). Tokens
are counted from 1 (the first generated token is token 1), in the text and in the JSON. The last
line is a JSON summary (used by the tests).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import arfusion
from arfusion.check import add_activation_quant  # FP8 activation quant after each norm, as `arfusion check --quant`
from arfusion.hf import prepare_for_compile, tp_kwargs
from arfusion.noise import quiet_known_noise
from arfusion.stats import decisions
from arfusion.testing import FusionReport, rows_from

quiet_known_noise()  # torchao's and torch's log lines no user can act on: arfusion/noise.py names each

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
TIE_ULPS = 4


def tiny_config(model_type: str, layers: int, hidden: int, tp: int):
    from transformers import AutoConfig

    heads = max(4, 2 * tp)
    # Granite's multipliers default to 1.0, which makes its residual scale an identity; its
    # checkpoints scale by 0.22 and 12, which the fused op then takes as its input scale.
    extra = {"residual_multiplier": 0.22, "embedding_multiplier": 12.0} if model_type.startswith("granite") else {}
    # head_dim explicitly: several configs (Qwen3, Gemma, Helium, ...) default it independently of hidden.
    return AutoConfig.for_model(
        model_type, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=tp, head_dim=hidden // heads, vocab_size=512,
        max_position_embeddings=256, tie_word_embeddings=False, **extra)


def save_random_model(config, dtype) -> str:
    """Rank 0 writes a randomly initialised checkpoint that every rank then loads with TP."""
    from transformers import AutoModelForCausalLM

    path = [None]
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        path[0] = tempfile.mkdtemp(prefix="arfusion-example-")
        model.save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)
    return path[0]


@torch.no_grad()
def greedy(model, ids: torch.Tensor, steps: int) -> tuple[list[int], list[tuple[float, float]]]:
    """Greedy tokens, and per step (the gap between the two best logits, the largest |logit|)."""
    logits = []
    for _ in range(steps):
        last = model(input_ids=ids, use_cache=False).logits[:, -1].float()
        top2 = last.topk(2, dim=-1).values[0]
        logits.append(((top2[0] - top2[1]).item(), last.abs().max().item()))
        ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
    return ids[0, -steps:].tolist(), logits


def judge_tokens(tokens: list[int], ref: list[int], ref_logits: list[tuple[float, float]], dtype) -> dict:
    """Where the compiled model's tokens first depart from the uncompiled model's, and whether
    that step is a near tie. A near tie is as in `arfusion.testing.greedy_departures` (its check
    of continuous-batching runs): the uncompiled model's two best logits lie within 4 ulp, in the
    model's dtype, of its largest logit. fp32 allows no departure. `tokens_verdict` is "match",
    "near_tie" (accepted) or "mismatch"; `first_different_token` counts from 1."""
    at = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
    if at is None:
        return {"tokens_verdict": "match", "first_different_token": None,
                "line": f"verdict: tokens match: all {len(ref)} greedy tokens are the uncompiled model's. "
                        f"What this shows: the compiled model decodes as the uncompiled one."}
    gap, largest = ref_logits[at]
    tolerance = TIE_ULPS * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(largest, 1e-30)))
    near_tie = dtype != torch.float32 and gap <= tolerance
    there = (f"There the uncompiled model's two best logits are {gap:.4f} apart, "
             f"{'within' if near_tie else 'more than'} {TIE_ULPS} {NAMES[dtype]} ulp ({tolerance:.4f}) "
             f"of its largest logit ({largest:.2f}).")
    line = (f"verdict: tokens match up to a near tie at token {at + 1} of {len(ref)}. {there} Rounding noise "
            f"flips such ties; random weights make many. What this shows: the compiled model decodes as the "
            f"uncompiled one up to {NAMES[dtype]} rounding." if near_tie else
            f"verdict: TOKENS DIFFER from token {at + 1} of {len(ref)}. {there} That is no near tie: "
            f"the compiled model decodes differently.")
    return {"tokens_verdict": "near_tie" if near_tie else "mismatch", "first_different_token": at + 1,
            "line": line}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", default="llama",
                   help="an HF model type with a TP plan (docs/coverage.md lists them all and what each fuses)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--backend", default="auto", choices=["auto", "flashinfer", "aiter", "torch"])
    p.add_argument("--tokens", type=int, default=8, help="prompt length")
    p.add_argument("--steps", type=int, default=16, help="greedy decoding steps")
    p.add_argument("--quant", default="none", choices=["none", "fp8-static", "fp8-dynamic", "fp8-group"],
                   help="FP8 activation quant after each norm (fused into the same op)")
    args = p.parse_args()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("compile_hf_model.py: run it under torchrun, one process per rank: "
              "torchrun --nproc-per-node 2 examples/compile_hf_model.py", file=sys.stderr)
        sys.exit(2)

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    say = print if rank == 0 else (lambda *a, **k: None)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dtype = DTYPES[args.dtype]
    config = tiny_config(args.model_type, args.layers, args.hidden, world)
    path = save_random_model(config, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **tp_kwargs("auto", config=path)).eval()
    prepare_for_compile(model)  # inference: removes graph breaks in HF model code (q/k norm hooks, looped experts)
    dist.barrier()  # every rank has loaded it: the random checkpoint is not needed any more
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    if args.quant != "none":
        add_activation_quant(model, args.quant)
    say(f"{args.model_type}: {args.layers} layers, hidden {args.hidden}, {args.dtype}, quant {args.quant}, "
        f"TP={world} on {device}")

    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), device=device)
    # Greedy decoding here feeds the whole sequence, one token longer each step: its length is
    # dynamic from the first compile, so one graph serves every step (no recompile at step 2).
    torch._dynamo.mark_dynamic(ids, 1)
    with torch.no_grad():
        ref_logits = model(input_ids=ids, use_cache=False).logits.float()
    ref_tokens, ref_steps = greedy(model, ids, args.steps)

    arfusion.reset_stats()
    arfusion.enable(arfusion.PassConfig(enable_allreduce_fusion=True, backend=args.backend))
    # A warm FX-graph cache would skip the pass and leave nothing to report.
    torch._inductor.config.fx_graph_cache = False
    compiled = torch.compile(model)
    start = time.perf_counter()
    with torch.no_grad():
        logits = compiled(input_ids=ids, use_cache=False).logits.float()
    compile_s = time.perf_counter() - start
    fused = arfusion.stats()
    report = FusionReport(rows_from(decisions()), fused)  # the first compile's all-reduces, one row each
    tokens, _ = greedy(compiled, ids, args.steps)

    rel_diff = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    stats = arfusion.stats()
    # One graph serves every forward here (the sequence length is dynamic): its all-reduces are one forward's.
    say(f"the {report.graphs} graph{'s' * (report.graphs != 1)} compiled (one forward): {report.verdict}: "
        f"{dict(report.forms)}")
    say(f"fused-op calls by backend, over the {1 + args.steps} compiled forwards: {stats['dispatch']}")
    say(f"max relative logits difference vs uncompiled: {rel_diff:.2e}")
    say(f"greedy tokens, uncompiled: {ref_tokens}")
    say(f"greedy tokens, compiled:   {tokens}")
    judged = judge_tokens(tokens, ref_tokens, ref_steps, dtype)
    say(judged.pop("line"))
    say(f"first compile + run {compile_s:.1f}s")
    say(json.dumps({"model_type": args.model_type, "quant": args.quant, "layers": args.layers, "world": world,
                    "graphs": report.graphs, "all_reduces": report.all_reduces,
                    "fused_sites": fused["fused_sites"], "by_pattern": fused["by_pattern"],
                    "unfused_sites": fused["unfused_sites"], "why_not_codes": fused["why_not_codes"],
                    "dispatch": stats["dispatch"], "max_rel_diff": rel_diff,
                    **judged, "tokens": tokens, "ref_tokens": ref_tokens}))
    arfusion.disable()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
