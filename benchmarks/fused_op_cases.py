"""bench_fused_op.py's cases: the functions being compared (as models spell them), their inputs,
the distributed set-up, and saving rows as a stage goes."""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist

from common import rank0_print, save_json

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192)
EPS = 1e-6


def with_pass() -> dict:
    """Inductor options of the "(b)" columns: the pass as a user enables it."""
    import arfusion

    return arfusion.inductor_options(arfusion.PassConfig(enable_allreduce_fusion=True, backend="auto"))


def hf_rms_norm(h, weight):
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


def add_norm(y, residual, weight):
    h = residual + y
    return hf_rms_norm(h, weight), h


FP8 = torch.float8_e4m3fn


def quantize(form, normed, scale):
    """FP8 quantization of the norm output, spelled as the traced real code spells it."""
    if form == "fp8_static":  # FP8 checkpoints' static activation quant, a 0-d fp32 scale
        return [(normed / scale).clamp(-448, 448).to(FP8)]
    fmax = torch.finfo(FP8).max
    if form == "fp8_dynamic":  # torchao 0.18 Float8DynamicActivationFloat8WeightConfig, PerRow
        amax = normed.abs().amax(dim=normed.dim() - 1, keepdim=True)
        row_scale = (amax / fmax).to(torch.float32)
        return [(normed.to(torch.float32) / row_scale).clamp(-fmax, fmax).to(FP8), row_scale]
    x = normed.float()  # per-group 128, DeepSeek-style act quant
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // 128, 128)
    group_scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / fmax
    return [(groups / group_scale).clamp(-fmax, fmax).to(FP8).reshape(x.shape), group_scale.squeeze(-1)]


def add_norm_quant(form):
    def fn(y, residual, weight, scale):
        h = residual + y
        return [h, *quantize(form, hf_rms_norm(h, weight), scale)]

    return fn


def make_quant_model_fn(group_name, form):
    from arfusion.reference import all_reduce_sum

    def layer_boundary(x, residual, weight, scale):  # residual, quant[, scale]
        h = residual + all_reduce_sum(x, group_name)
        return [h, *quantize(form, hf_rms_norm(h, weight), scale)]

    return layer_boundary


def make_model_fn(group_name, produce_input=False):
    from arfusion.reference import all_reduce_sum

    def layer_boundary(x, residual, weight):  # how a decoder layer ends, as the graph sees it
        if produce_input:  # as a row-parallel matmul's output: an intermediate, reducible in place
            x = x * 2
        h = residual + all_reduce_sum(x, group_name)
        return hf_rms_norm(h, weight), h

    return layer_boundary



def inputs(g: torch.Generator, rank: int, tokens: int, hidden: int, device):
    """(x, residual): each rank's own all-reduce input, and one residual shared by every rank."""
    g.manual_seed(1000 + rank)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g)
    g.manual_seed(2000)
    return x, torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g)


def norm_weight(g: torch.Generator, hidden: int, device) -> torch.Tensor:
    g.manual_seed(17)
    return (1 + 0.1 * torch.randn(hidden, device=device, generator=g)).to(torch.bfloat16)


def calls_per_graph(args, nbytes: int) -> int:
    """Ranks start a replay a few microseconds apart and the first call absorbs that skew: many
    calls per graph make it small next to a small call's own time."""
    return args.calls or (100 if nbytes <= 8 * 2**20 else 20)


def launch_variant(backend, **knobs):
    """The backend with other kernel-launch knobs (launch_with_pdl, fp32_acc) that shares its
    workspaces: the cached backend every compiled graph uses stays as it is."""
    return dataclasses.replace(backend, **knobs) if knobs else backend


def init_distributed():
    """One process per GPU under torchrun; (rank, world, device, print-on-rank-0)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    torch._dynamo.config.recompile_limit = 1024  # one compile per token count and variant
    torch._dynamo.config.accumulated_recompile_limit = 8192
    torch._inductor.config.fx_graph_cache = False  # a cache hit would skip the pass
    return rank, world, device, rank0_print(rank)


def save_rows(rank, path, meta, started, rows):
    """Rank 0 rewrites the JSON after every row: a stage cut short still leaves its rows."""
    if rank == 0:
        save_json(path, {"meta": {**meta, "seconds": round(time.time() - started),
                                  "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started))}, "rows": rows})


def finish(rank, backend, table, path):
    """Free FlashInfer's buffers on every rank, print the table, end the process group."""
    dist.barrier()
    backend.close()
    if rank == 0:
        print(table)
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


# FlashInfer's quantized_all_reduce picks its knobs from the message size alone (0.7.2.post1's
# _select_params: block 4096 up to 64 MiB, 132 blocks above 1 MiB, 16 warps, P2P phase 3 from 32 MiB). None of them changes
# the error (the scale group, 256 elements, stays); the block size moves results within it (2.6e-2
# relative in every setting on 2xH200, 2026-11-28). Their names and values: dispatch.CODEC_KNOBS.


def knob_grid(spec: list[str]) -> list[dict]:
    """Every combination of the knobs: ["block_size=4096,8192", "p2p_phase3=1"] sets those two and
    leaves the rest to CODEC_KNOBS; [] is CODEC_KNOBS whole."""
    from arfusion.backends.flashinfer_dispatch import CODEC_KNOBS, knob_combinations

    values = dict(CODEC_KNOBS)
    for item in spec:
        name, _, listed = item.partition("=")
        if name not in CODEC_KNOBS or not listed:
            raise SystemExit(f"--codec-knobs: {item!r} is not KNOB=V1,V2 with KNOB one of {sorted(CODEC_KNOBS)}")
        kind = bool if name == "p2p_phase3" else int
        values[name] = tuple(kind(int(v)) for v in listed.split(","))
    return knob_combinations(values)
