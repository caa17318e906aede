"""Quantized all-reduce: a lossy communication form for prefill-sized messages (opt-in).

Above a few MiB per rank the all-reduce is bandwidth-bound, and sending each rank's share in
8 bits or fewer (one scale per small group of elements) beats an exact all-reduce even with the
fused kernel (docs/history/2026-11-26-benchmarks-before-the-matrix.md). Where
`PassConfig(quantized_allreduce=...)` asks for it and a site's message is at or above the
backend's crossover, the fused op runs the backend's quantized all-reduce and then the compiled
residual add + RMSNorm (+ quant); below it, the exact path.

The kernels (FlashInfer `quantized_all_reduce` on SM90+, aiter's quick all-reduce on MI300/
MI350) are two-shot: every rank quantizes its input, each rank sums one stripe of all ranks'
dequantized values in fp32, quantizes that sum again and sends it to the others. `emulate`
reproduces that on any device with torch collectives, so CPU runs see what the quantization
costs (the `torch` backend, tests, `benchmarks/eval_accuracy.py --tiny`). It follows each
level's format (group size, value range, rounding) but not the kernels' bits: scales are kept
in fp32 and the sums run in another order. Against FlashInfer's fp8 kernel on one H100 (first
phase only, tests/gpu/check_quantized_codec.py): 0.003-1.6% of elements one fp8 step apart,
the same max and mean error against the exact sum (docs/accuracy.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference


@dataclass(frozen=True)
class Codec:
    """How one level encodes a message: `group` consecutive elements share one scale."""

    group: int
    bits: int
    floating: bool  # FP8 e4m3 values; else signed integers in [-2^(bits-1), 2^(bits-1) - 1]
    # FlashInfer's two-shot writes the stripe a rank reduced straight from its fp32 sum and only
    # sends the others quantized, so ranks agree everywhere except in each other's stripes.
    owner_keeps_exact: bool


# fp8: flashinfer.comm.quantized_allreduce (0.7.2.post1): e4m3fn, max 448, fp32 scale amax / 448
# per SCALE_GROUP_DEFAULT = 256 elements, scale floor 1e-12. int8/int6/int4: quickreduce
# (vLLM #16804, aiter csrc/include/quick_all_reduce.cuh): 32 values per scale, decoding scale
# -amax / 2^(bits-1), codes clamped to [-2^(bits-1), 2^(bits-1) - 1] (so +amax is exact and
# -amax comes back one step short). aiter's own level 1 is FP8 (e4m3fnuz, max 240), not INT8.
CODECS: dict[str, Codec] = {  # one per QUANTIZED_LEVELS entry
    "fp8": Codec(group=256, bits=8, floating=True, owner_keeps_exact=True),
    "int8": Codec(group=32, bits=8, floating=False, owner_keeps_exact=False),
    "int6": Codec(group=32, bits=6, floating=False, owner_keeps_exact=False),
    "int4": Codec(group=32, bits=4, floating=False, owner_keeps_exact=False),
}
FP8_MAX = 448.0
SCALE_FLOOR = 1e-12

# FlashInfer's stripe ("BLOCK_SIZE") per message size (`_select_params`): 4096 elements up to
# 32 Mi elements, 16384 above; at least one scale group, at most the message.
STRIPE_ELEMS = ((32 * 2**20, 4096), (None, 16384))


def quantize_dequantize(values: torch.Tensor, codec: Codec) -> torch.Tensor:
    """fp32 values after one trip through `codec` (same shape)."""
    flat = values.reshape(-1).float()
    pad = (-flat.numel()) % codec.group
    groups = torch.nn.functional.pad(flat, (0, pad)).view(-1, codec.group)
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(SCALE_FLOOR)
    if codec.floating:
        codes = (groups * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        back = codes.float() * (amax / FP8_MAX)
    else:
        levels = 2 ** (codec.bits - 1)
        decode = -amax / levels
        back = torch.round(groups / decode).clamp(-levels, levels - 1) * decode
    return back.reshape(-1)[: flat.numel()].view(values.shape)


def stripe_owner(numel: int, world_size: int, device: torch.device) -> torch.Tensor:
    """Rank that reduces each element in FlashInfer's two-shot (int tensor, numel long)."""
    stripe = next(size for limit, size in STRIPE_ELEMS if limit is None or numel <= limit)
    stripe = max(min(stripe, numel), CODECS["fp8"].group)
    return (torch.arange(numel, device=device) // stripe) % world_size


def emulate(x: torch.Tensor, group_name: str, level: str) -> torch.Tensor:
    """The sum of `x` over the group as a two-shot `level` all-reduce computes it (see above)."""
    codec = CODECS[level]
    sent = quantize_dequantize(x, codec)
    total = reference.all_reduce_sum(sent, group_name)
    received = quantize_dequantize(total, codec)
    if codec.owner_keeps_exact:
        group = torch.distributed.distributed_c10d._resolve_process_group(group_name)
        mine = stripe_owner(x.numel(), group.size(), x.device).view(x.shape) == group.rank()
        received = torch.where(mine, total, received)
    return received.to(x.dtype)
