"""Compile a model parallelized with torch's own tensor parallelism, with arfusion.

    torchrun --nproc-per-node 2 examples/compile_torch_tp.py [--sequence-parallel]

A small decoder in plain PyTorch (embedding, attention with q/k/v/o linears, MLP with
gate/up/down linears, `torch.nn.RMSNorm` norms, residual adds) is parallelized with
`parallelize_module` on a 1-D DeviceMesh as torchtitan does it: the embedding row-wise
(vocab-parallel), q/k/v/gate/up column-wise, o/down row-wise, the LM head column-wise with a
replicated output. Each row-parallel output is all-reduced by DTensor; Dynamo turns that into
`_c10d_functional.all_reduce` + `wait_tensor`, followed by the residual add and the next norm,
which arfusion fuses. With `--experts N` the MLP is a dense mixture of N expert MLPs, each
parallelized like the MLP (so each expert's output is all-reduced: N all-reduces per layer), then
weighted by a replicated top-2 gate and summed: arfusion turns that into one all-reduce of the
gated sum per layer, then the same site. With `--sequence-parallel` (torchtitan's SP plan: `SequenceParallel` norms,
`RowwiseParallel(output_layouts=Shard(1))`, inputs gathered with `PrepareModuleInput`) the
all-reduce becomes reduce-scatter + all-gather: nothing to fuse, and the output must still
match the uncompiled model.

gloo on CPU, NCCL on CUDA. Prints arfusion's stats, the largest relative output difference to
the uncompiled model, and a JSON summary as the last line (used by the tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import arfusion

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class FunctionalRMSNorm(nn.Module):
    """The norm as a functional call: `F.rms_norm(x, (H,), weight, eps)`."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(kind: str, hidden: int, eps: float) -> nn.Module:
    return nn.RMSNorm(hidden, eps=eps) if kind == "rmsnorm" else FunctionalRMSNorm(hidden, eps)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        # -1 heads: after column-wise sharding each rank holds heads / TP of them.
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DenseMoE(nn.Module):
    """Every expert runs on every token; the top-k of the router's softmax weights them."""

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int = 2):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)  # replicated: not in the plan
        self.experts = nn.ModuleList(MLP(hidden, intermediate) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        top, index = probs.topk(self.top_k, -1)
        gate = torch.zeros_like(probs).scatter(-1, index, top / top.sum(-1, keepdim=True))
        return sum(gate[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, norm: str, eps: float, experts: int = 0):
        super().__init__()
        self.attention_norm = make_norm(norm, hidden, eps)
        self.attention = Attention(hidden, heads)
        self.ffn_norm = make_norm(norm, hidden, eps)
        self.mlp = DenseMoE(hidden, hidden, experts) if experts else MLP(hidden, 2 * hidden)

    def forward(self, h):
        h = h + self.attention(self.attention_norm(h))
        return h + self.mlp(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, norm: str, eps: float = 1e-5,
                 experts: int = 0):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, norm, eps, experts) for _ in range(layers))
        self.norm = make_norm(norm, hidden, eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def mlp_names(model: Decoder) -> list[str]:
    """The MLPs of a layer: `mlp`, or each expert of a dense MoE."""
    mlp = model.layers[0].mlp
    return [f"mlp.experts.{e}" for e in range(len(mlp.experts))] if isinstance(mlp, DenseMoE) else ["mlp"]


def tp_plan(model: Decoder, sequence_parallel: bool) -> tuple[dict, list[tuple[nn.Module, dict]]]:
    """torchtitan's plan: (top-level plan, [(layer, layer plan)])."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    if not sequence_parallel:
        top = {"embed_tokens": RowwiseParallel(input_layouts=Replicate()),
               "lm_head": ColwiseParallel(output_layouts=Replicate())}
        layer = {f"attention.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        for mlp in mlp_names(model):
            layer |= {f"{mlp}.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")}
            layer[f"{mlp}.down_proj"] = RowwiseParallel()
        layer["attention.o_proj"] = RowwiseParallel()
        return top, [(block, layer) for block in model.layers]
    if len(mlp_names(model)) > 1:
        raise SystemExit("--experts with --sequence-parallel: not in this example")
    top = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "norm": SequenceParallel(),
           "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    layer = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **{f"attention.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "attention.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    return top, [(block, layer) for block in model.layers]


def build(args, mesh, device) -> Decoder:
    """The same random weights on every rank, then sharded by the plan."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    heads = max(4, 2 * mesh.size())
    model = Decoder(args.vocab, args.hidden, args.layers, heads, args.norm,
                    experts=getattr(args, "experts", 0)).to(device, DTYPES[args.dtype])
    with torch.no_grad():  # norm weights away from 1, so a wrongly applied weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    top, layers = tp_plan(model, args.sequence_parallel)
    for block, plan in layers:
        parallelize_module(block, mesh, plan)
    parallelize_module(model, mesh, top)
    return model.eval()


def row_parallel_sites(args) -> int:
    """All-reduce -> [add] -> norm sites: o/down of every layer, plus the embedding's."""
    return 0 if args.sequence_parallel else 2 * args.layers + 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--tokens", type=int, default=8, help="sequence length (a multiple of TP with SP)")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--norm", default="rmsnorm", choices=["rmsnorm", "functional"],
                   help="torch.nn.RMSNorm modules, or F.rms_norm calls with a weight")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="torchtitan's SP plan: reduce-scatter + all-gather instead of all-reduce")
    p.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True)")
    p.add_argument("--experts", type=int, default=0,
                   help="a dense MoE of this many expert MLPs instead of the MLP, each expert parallelized "
                        "like the MLP (one all-reduce per expert, which arfusion makes one per layer)")
    p.add_argument("--backend", default="auto", choices=["auto", "flashinfer", "aiter", "torch"])
    args = p.parse_args()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("compile_torch_tp.py: run it under torchrun, one process per rank: "
              "torchrun --nproc-per-node 2 examples/compile_torch_tp.py", file=sys.stderr)
        sys.exit(2)

    from torch.distributed.device_mesh import init_device_mesh

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    say = print if rank == 0 else (lambda *a, **k: None)
    if rank == 0:  # arfusion's INFO lines: what each graph fused, and why a site was not
        logging.basicConfig(format="%(message)s")
        logging.getLogger("arfusion").setLevel(logging.INFO)

    model = build(args, mesh, device)
    say(f"torch TP decoder: {args.layers} layers, hidden {args.hidden}, {args.dtype}, norm {args.norm}, "
        f"sequence parallel {args.sequence_parallel}, TP={world} on {device}")
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (1, args.tokens), device=device)

    with torch.no_grad():
        expected = model(ids).float()
    arfusion.reset_stats()
    arfusion.enable(arfusion.PassConfig(enable_allreduce_fusion=True, backend=args.backend))
    # A warm FX-graph cache would skip the pass and leave nothing to report.
    torch._inductor.config.fx_graph_cache = False
    compiled = torch.compile(model, dynamic=True if args.dynamic else None)
    start = time.perf_counter()
    with torch.no_grad():
        actual = compiled(ids).float()
    compile_s = time.perf_counter() - start
    stats = arfusion.stats()

    rel_diff = ((actual - expected).abs().max() / expected.abs().max()).item()
    if args.sequence_parallel:
        say(f"fused sites: {stats['fused_sites']} (sequence parallel: reduce-scatter + all-gather, no all-reduce "
            f"to fuse)")
    else:
        say(f"fused sites: {stats['fused_sites']} of {row_parallel_sites(args)} all-reduce -> norm sites "
            f"{stats['by_pattern']}")
    merged = stats["summed_all_reduces_merged"] + stats["concatenated_all_reduces_merged"]
    if args.experts:
        say(f"expert all-reduces merged: {merged} ({args.experts} per layer became 1)")
    say(f"all-reduces left unfused: {stats.get('unfused_sites')}")
    say(f"fused-op calls by backend: {stats['dispatch']}")
    say(f"max relative output difference vs uncompiled: {rel_diff:.2e} (first compile + run {compile_s:.1f}s)")
    say(json.dumps({"layers": args.layers, "dtype": args.dtype, "norm": args.norm,
                    "sequence_parallel": args.sequence_parallel, "dynamic": args.dynamic, "world": world,
                    "experts": args.experts, "all_reduces_merged": merged,
                    "sites": row_parallel_sites(args), "fused_sites": stats["fused_sites"],
                    "by_pattern": stats["by_pattern"], "unfused_sites": stats.get("unfused_sites"),
                    "dispatch": stats["dispatch"], "max_rel_diff": rel_diff}))
    arfusion.disable()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
