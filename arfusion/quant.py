"""Reference quantization of the norm output, one function per quant form.

Numerics are canonical fp32 math. Real code spells some steps differently (torchao rounds
its per-row scale through bf16; a static quant may divide in bf16 before the fp32 clamp), so
a fused result can differ from the unfused graph by a rare 1-ulp FP8 step, and the scale by
under 0.5%: the same difference FlashInfer's and aiter's kernels have. Every output pair
(quant, scale) is self-consistent: quant * scale approximates the norm output.

NVFP4 is the exception: its reference is bit-for-bit what torchao 0.18's `nvfp4_quantize`
produces (same block-scale rounding, same round-to-nearest-even onto the E2M1 grid, same
packing), because a consumer of the packed bytes cannot tolerate a different encoding.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 128  # per-group FP8 (DeepSeek/Qwen3-FP8): groups of 128 along hidden
# Smallest per-token scale, so an all-zero row does not divide by zero. It is FlashInfer's
# floor for its dynamic per-token kernels (scale = max(amax / 448, 1 / (512 * 448))).
MIN_DYNAMIC_SCALE_TIMES_FMAX = 1 / 512
MIN_GROUP_AMAX = 1e-10  # same purpose for per-group scales (amax floor, as FP8 checkpoints' act quant)

# NVFP4: 16 consecutive elements share one E4M3 block scale; values are E2M1 (4 bits, two per
# byte, the even element in the low nibble). The global scale is torchao's "per-tensor scale",
# the dequantizing side: value ~= e2m1 * block_scale * global_scale.
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Smallest block scale. torchao clamps to E4M3's smallest normal, so an all-zero block still
# gets a finite, nonzero scale (FlashInfer's kernel writes 0 there instead; the data is 0 both ways).
MIN_BLOCK_SCALE = torch.finfo(torch.float8_e4m3fn).tiny
# Magnitude of each E2M1 code 0..7; bit 3 is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_SIGN = 8
# Rounding onto the grid: a magnitude passes the midpoint between codes k and k+1 when it is
# above it, or exactly on it if k is odd (ties go to the even code, as round-to-nearest-even).
_E2M1_MIDPOINTS = tuple((lo + hi) / 2 for lo, hi in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:]))


def fp8_dtype(device: torch.device) -> torch.dtype:
    """e4m3fnuz on MI300 (gfx942), e4m3fn everywhere else (NVIDIA, gfx950, CPU)."""
    if device.type == "cuda" and torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if arch.startswith("gfx942"):
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def _saturate(values_fp32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    return values_fp32.clamp(-fmax, fmax).to(dtype)


def fp8_static(normed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    dtype = dtype or fp8_dtype(normed.device)
    return {"quant": _saturate(normed.float() / scale, dtype)}


def fp8_dynamic(normed: torch.Tensor, scale: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Per token: scale [..., 1] = max(row amax, floor) / fmax."""
    dtype = dtype or fp8_dtype(normed.device)
    fmax = torch.finfo(dtype).max
    x = normed.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    row_scale = amax.clamp(min=MIN_DYNAMIC_SCALE_TIMES_FMAX) / fmax
    return {"quant": _saturate(x / row_scale, dtype), "scale": row_scale}


def fp8_group(normed: torch.Tensor, scale: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Per group of 128 along hidden: scales [..., hidden / 128] in fp32."""
    dtype = dtype or fp8_dtype(normed.device)
    fmax = torch.finfo(dtype).max
    x = normed.float()
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    group_scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_GROUP_AMAX) / fmax
    quant = _saturate(groups / group_scale, dtype).reshape(x.shape)
    return {"quant": quant, "scale": group_scale.squeeze(-1)}


def e2m1_codes(values_fp32: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 code (sign in bit 3) of each value, rounded to nearest, ties to even code;
    magnitudes above 6 saturate. -0.0 and small negatives keep their sign (code 8), as torchao."""
    magnitude = values_fp32.abs()
    code = torch.zeros(values_fp32.shape, dtype=torch.uint8, device=values_fp32.device)
    for k, midpoint in enumerate(_E2M1_MIDPOINTS):
        passed = magnitude >= midpoint if k % 2 else magnitude > midpoint
        code = code + passed.to(torch.uint8)
    return code | (torch.signbit(values_fp32).to(torch.uint8) * E2M1_SIGN)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] uint8 codes -> [..., n] bytes, the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def nvfp4(normed: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """NVFP4 with a fixed global scale (None: 1.0, single-level scaling).

    quant: uint8 [..., H / 2]; scale: float8_e4m3fn [..., H / 16], row-major (not swizzled).
    The arithmetic is torchao's, step by step: block scale = (amax / 6) / global, clamped to
    [2^-6, 448] and rounded to E4M3; values are multiplied by (1 / global) / block scale."""
    x = normed.float()
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    global_scale = one if global_scale is None else global_scale.to(device=x.device, dtype=torch.float32)
    block_scale = (blocks.abs().amax(dim=-1) / E2M1_MAX / global_scale).clamp(MIN_BLOCK_SCALE, E4M3_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn)
    factor = (1.0 / global_scale) / block_scale.float()
    scaled = (blocks * factor.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX).reshape(x.shape)
    return {"quant": pack_nibbles(e2m1_codes(scaled)), "scale": block_scale}


def dequantize_nvfp4(quant: torch.Tensor, block_scale: torch.Tensor,
                     global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values of packed NVFP4 with row-major block scales (for checks and tests)."""
    codes = torch.stack((quant & 0xF, quant >> 4), dim=-1).reshape(*quant.shape[:-1], -1)
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=quant.device)
    values = grid[(codes & 7).long()] * torch.where((codes & E2M1_SIGN) > 0, -1.0, 1.0)
    blocks = values.reshape(*values.shape[:-1], -1, NVFP4_BLOCK) * block_scale.float().unsqueeze(-1)
    out = blocks.reshape(values.shape)
    return out if global_scale is None else out * global_scale.float()


QUANTIZERS = {"fp8_static": fp8_static, "fp8_dynamic": fp8_dynamic, "fp8_group": fp8_group, "nvfp4": nvfp4}


def quantize(normed: torch.Tensor, form: str, scale: torch.Tensor | None,
             fp8_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """{"quant": ..., "scale": ...} (no "scale" for fp8_static, whose scale is an input; for
    nvfp4 `scale` is the global scale input and the output "scale" holds the block scales).
    fp8_dtype: the FP8 type of an FP8 form (default: the device's)."""
    if form not in QUANTIZERS:
        raise NotImplementedError(f"arfusion: quant form {form!r} has no reference implementation")
    if form == "nvfp4" or fp8_dtype is None:
        return QUANTIZERS[form](normed, scale)
    return QUANTIZERS[form](normed, scale, fp8_dtype)


def dequantize(quant: torch.Tensor, scale: torch.Tensor, form: str,
               global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """quant * scale in fp32, broadcasting each form's scale layout (for checks and tests).
    global_scale: NVFP4's per-tensor scale (the fused op's quant_scale input)."""
    if form == "nvfp4":
        return dequantize_nvfp4(quant, scale, global_scale)
    q = quant.float()
    if form == "fp8_group":
        groups = q.reshape(*q.shape[:-1], q.shape[-1] // GROUP_SIZE, GROUP_SIZE)
        return (groups * scale.unsqueeze(-1)).reshape(q.shape)
    return q * scale
