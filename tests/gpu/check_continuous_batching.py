"""transformers' continuous batching (`generate_batch`) at TP=2 with the pass on FlashInfer.

    torchrun --nproc-per-node 2 tests/gpu/check_continuous_batching.py --out DIR --shared-gpu [--cuda-graphs]
    torchrun --nproc-per-node 2 tests/gpu/check_continuous_batching.py --out DIR --cpu      # dry run: gloo, torch

For each model (tiny configs, random weights, bf16 on GPUs, fp32 with --cpu), rank 0 writes a
checkpoint, both ranks load it with `tp_plan="auto"` and `arfusion.hf.prepare_for_compile`, and
three greedy `generate_batch` calls run on the same prompts: eager, compiled by Inductor alone,
and compiled with the pass (varlen and decode paths, `CompileConfig(mode=None)`: transformers'
default mode, reduce-overhead, fails in its background thread with or without the pass). Checked:
every all-reduce fused or merged, every call on the backend's kernels (no run-time fallback), and
the tokens of the pass equal to eager's up to the first step where eager's two best logits lie
within bf16 rounding of each other (4 ulp of the largest logit) or Inductor alone already departed;
on --cpu (fp32) identical. The log-probabilities of the tokens both chose are reported against
Inductor alone's.

Limits of the model's own code are recorded as `upstream`, not as problems: a run that fails for
Inductor alone too (the pass's run then may fail the same way), an all-reduce split from its norm
by a graph break in a function of UPSTREAM_GRAPH_BREAKS (the pass then correctly leaves it
unfused), and a failure of the pass's run where the graph breaks only there (on one GPU Inductor
alone is not captured, so it cannot show the capture failing). A graph break anywhere else, or a
failure of the pass's run otherwise, is a problem.

--cuda-graphs: the pass's calls also run in transformers' own CUDA graphs, and the fused and
fast-path calls must have been captured (stats()["dispatch_in_cuda_graphs"]). With both ranks on
one GPU the group is gloo, and a gloo collective cannot be captured: the LM head is loaded whole
on every rank (no all-gather of its output), so that every collective left in the step is one of
arfusion's, and Inductor alone (whose all-reduces are gloo's) runs without CUDA graphs. On two
GPUs (NCCL) the LM head keeps its plan and both compiled runs are captured.

Writes DIR/continuous_batching[_cuda_graphs].json (both ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shared_gpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import arfusion  # noqa: E402
from arfusion import hf  # noqa: E402
from arfusion.backends import get_backend  # noqa: E402
from arfusion.decisions import Reason  # noqa: E402
from arfusion.hf.configs import tiny_config  # noqa: E402
from arfusion.testing import generate_batch, greedy_departures  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [17, 18, 19], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], [50]]
MODELS = ("llama", "qwen3", "qwen3_moe", "aria_text", "gemma3_text")
TIE_ULPS = 4
# Graph breaks in transformers' code that split an all-reduce from its norm, by function name.
UPSTREAM_GRAPH_BREAKS = {
    "sequential_experts_gemm": "Aria's experts before transformers 5.24 (seen with 5.17) slice tokens per expert by "
                               "data-dependent counts: a graph break between the MoE all-reduce and its norm, and "
                               "transformers' CUDA-graph capture fails there with or without the pass",
}


def load(model_type: str, dtype: torch.dtype, device, whole_lm_head: bool):
    from transformers import AutoModelForCausalLM

    path = [None]
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        path[0] = tempfile.mkdtemp(prefix=f"cb-{model_type}-")
        AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=dtype).save_pretrained(path[0])
    dist.broadcast_object_list(path)
    model = AutoModelForCausalLM.from_pretrained(path[0], dtype=dtype, attn_implementation="sdpa",
                                                 **hf.tp_kwargs("auto", config=path[0])).eval()
    prepared = hf.prepare_for_compile(model)
    if whole_lm_head:
        from safetensors.torch import load_file

        weights = load_file(str(Path(path[0], "model.safetensors")))
        full = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
        head = torch.nn.Linear(full.shape[1], full.shape[0], bias=False, dtype=dtype, device=device)
        with torch.no_grad():
            head.weight.copy_(full)
        model.lm_head = head
    dist.barrier()
    return model, prepared


def upstream_breaks(splits: dict[str, int]) -> list[str]:
    """The notes of `splits` (stats()["split_by_graph_breaks"]) when every graph break in them is in
    a function of UPSTREAM_GRAPH_BREAKS, else []."""
    if splits and set(splits) <= set(UPSTREAM_GRAPH_BREAKS):
        return [f"{fn}: {UPSTREAM_GRAPH_BREAKS[fn]}" for fn in splits]
    return []


def upstream_splits(unfused: int, splits: dict[str, int]) -> list[str]:
    """The notes for `unfused` all-reduces when every one of them is split from its norm by a graph
    break in a function of UPSTREAM_GRAPH_BREAKS; else [] (then an unfused all-reduce is a problem)."""
    return upstream_breaks(splits) if unfused and sum(splits.values()) == unfused else []


def compare(model, runs: dict) -> dict:
    """The pass against eager, Inductor alone as the noise (arfusion.testing.greedy_departures;
    none where Inductor alone failed)."""
    alone = runs.get("inductor")
    rows = greedy_departures(model, PROMPTS, runs["eager"], runs["pass"], noise=alone, tie_ulps=TIE_ULPS)
    if alone is not None:
        noise = greedy_departures(model, PROMPTS, runs["eager"], alone, tie_ulps=TIE_ULPS)
        for row, ref in zip(rows, noise):
            row["inductor_max_logprob_diff"] = ref["max_logprob_diff"]
    return {"requests": rows, "tokens_ok": all(r["ok"] for r in rows)}


def check_model(model_type: str, args, dtype, device, backend: str) -> dict:
    model, prepared = load(model_type, dtype, device, whole_lm_head=args.cuda_graphs and not args.two_gpus)
    extra = {}
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if "auto_switch_to_flash" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}:
        extra["auto_switch_to_flash"] = False  # sdpa, as loaded (no Flash Attention here)
    graphs = args.cuda_graphs
    runs = {"eager": generate_batch(model, PROMPTS, args.new_tokens, compiled=False, **extra)}
    upstream = []
    torch._dynamo.reset()
    # Over gloo (both ranks on one GPU) Inductor alone leaves gloo all-reduces in the step, which
    # cannot be captured: its run, the noise reference, goes without CUDA graphs there.
    try:
        runs["inductor"] = generate_batch(model, PROMPTS, args.new_tokens, cuda_graphs=graphs and args.two_gpus,
                                          **extra)
    except RuntimeError as e:  # the model's own limit: recorded, and the pass's run still made
        upstream.append(f"Inductor alone fails: {str(e)[:300]}")
    torch._dynamo.reset()
    arfusion.reset_stats()
    config = arfusion.PassConfig(enable_allreduce_fusion=True, backend=backend)
    try:
        runs["pass"] = generate_batch(model, PROMPTS, args.new_tokens, config=config, cuda_graphs=graphs, **extra)
    except RuntimeError as e:
        # Transformers' own failure: Inductor alone failed too, or (its run not captured: one GPU, gloo)
        # the model's graph breaks only where UPSTREAM_GRAPH_BREAKS lists, whose code the capture runs.
        if not upstream:
            upstream = upstream_breaks(arfusion.stats()["split_by_graph_breaks"])
            if not upstream:
                raise
        upstream.append(f"the pass's run fails: {str(e)[:300]}")
        del model
        torch._dynamo.reset()
        return {"model": model_type, "prepared": prepared, "upstream": upstream, "problems": []}
    torch.cuda.synchronize() if device.type == "cuda" else None
    report, stats = runs["pass"].report, arfusion.stats()
    result = {"model": model_type, "prepared": prepared, **compare(model, runs),
              "all_reduces": report.all_reduces, "fused": report.fused, "merged": report.merged,
              "verdict": report.verdict, "graphs": report.graphs,
              "dispatch": stats["dispatch"], "dispatch_in_cuda_graphs": stats["dispatch_in_cuda_graphs"],
              "split_by_graph_breaks": stats["split_by_graph_breaks"],
              "seconds": {k: round(r.seconds, 1) for k, r in runs.items()}}
    kernels = {backend, f"{backend} all-reduce"}
    problems = []
    if not result["tokens_ok"]:
        problems.append("tokens depart from eager's away from a near tie")
    unfused = report.all_reduces - report.fused - report.merged
    known = upstream_splits(unfused, stats["split_by_graph_breaks"])
    if known:
        upstream += known
    elif report.all_reduces == 0 or unfused:
        problems.append(f"not every all-reduce fused: {report.verdict}")
    if not set(stats["dispatch"]) <= kernels:
        problems.append(f"calls off the kernels: {stats['dispatch']}")
    if graphs and (not stats["dispatch_in_cuda_graphs"] or not set(stats["dispatch_in_cuda_graphs"]) <= kernels):
        problems.append(f"captured calls: {stats['dispatch_in_cuda_graphs']}")
    if backend == "flashinfer":  # one workspace for every group of these ranks (EP and TP groups too)
        held = [s for s in get_backend("flashinfer")._groups.everything() if s.workspace is not None]
        result["flashinfer_workspaces"] = len(held)
        if len(held) != 1:
            problems.append(f"{len(held)} FlashInfer workspaces held, not one")
    if upstream:
        result["upstream"] = upstream
    result["problems"] = problems
    del model
    torch._dynamo.reset()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--cuda-graphs", action="store_true", help="transformers' own CUDA graphs on (GPU)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--shared-gpu", action="store_true", help="both ranks on GPU 0 over gloo (FlashInfer)")
    mode.add_argument("--two-gpus", action="store_true", help="NCCL, one GPU per rank (FlashInfer)")
    mode.add_argument("--cpu", action="store_true", help="dry run: gloo on the CPU, torch backend, fp32")
    args = p.parse_args()
    if args.cpu:
        dist.init_process_group("gloo")
        device, dtype, backend = torch.device("cpu"), torch.float32, "torch"
        torch.set_num_threads(1)
    else:
        device = shared_gpu.init(args.shared_gpu, hang_s=float(os.environ.get("CHECK_HANG_S", 0)) or None)
        dtype, backend = torch.bfloat16, "flashinfer"
    import transformers

    rank = dist.get_rank()
    results = []
    for model_type in args.models.split(","):
        try:
            results.append(check_model(model_type, args, dtype, device, backend))
        except Exception as e:  # reported, and the next model runs
            results.append({"model": model_type, "problems": [f"{type(e).__name__}: {str(e)[:500]}"]})
        print(json.dumps(results[-1]), flush=True)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": rank, "results": results, "torch": torch.__version__,
                                      "transformers": transformers.__version__,
                                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"})
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "continuous_batching" + ("_cuda_graphs" if args.cuda_graphs else "") + ".json"
        Path(args.out, name).write_text(json.dumps(everyone, indent=1))
    if backend == "flashinfer":
        fi = get_backend("flashinfer")
        if not isinstance(fi, Reason):
            fi.close()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(r["problems"] for e in everyone for r in e["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
