"""Reference quantization of the norm output, one function per quant form.

Numerics are canonical fp32 math. Real code spells some steps differently (torchao rounds
its per-row scale through bf16; a static quant may divide in bf16 before the fp32 clamp), so
a fused result can differ from the unfused graph by a rare 1-ulp FP8 step, and the scale by
under 0.5%: the same difference FlashInfer's and aiter's kernels have. Every output pair
(quant, scale) is self-consistent: quant * scale approximates the norm output.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 128  # per-group FP8 (DeepSeek/Qwen3-FP8): groups of 128 along hidden
# Smallest per-token scale, so an all-zero row does not divide by zero. It is FlashInfer's
# floor for its dynamic per-token kernels (scale = max(amax / 448, 1 / (512 * 448))).
MIN_DYNAMIC_SCALE_TIMES_FMAX = 1 / 512
MIN_GROUP_AMAX = 1e-10  # same purpose for per-group scales (amax floor, as FP8 checkpoints' act quant)


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


def fp8_static(normed: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    dtype = fp8_dtype(normed.device)
    return {"quant": _saturate(normed.float() / scale, dtype)}


def fp8_dynamic(normed: torch.Tensor, scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per token: scale [..., 1] = max(row amax, floor) / fmax."""
    dtype = fp8_dtype(normed.device)
    fmax = torch.finfo(dtype).max
    x = normed.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    row_scale = amax.clamp(min=MIN_DYNAMIC_SCALE_TIMES_FMAX) / fmax
    return {"quant": _saturate(x / row_scale, dtype), "scale": row_scale}


def fp8_group(normed: torch.Tensor, scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per group of 128 along hidden: scales [..., hidden / 128] in fp32."""
    dtype = fp8_dtype(normed.device)
    fmax = torch.finfo(dtype).max
    x = normed.float()
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    group_scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_GROUP_AMAX) / fmax
    quant = _saturate(groups / group_scale, dtype).reshape(x.shape)
    return {"quant": quant, "scale": group_scale.squeeze(-1)}


QUANTIZERS = {"fp8_static": fp8_static, "fp8_dynamic": fp8_dynamic, "fp8_group": fp8_group}


def quantize(normed: torch.Tensor, form: str, scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """{"quant": ..., "scale": ...} (no "scale" for fp8_static, whose scale is an input)."""
    if form not in QUANTIZERS:
        raise NotImplementedError(f"arfusion: quant form {form!r} has no reference implementation")
    return QUANTIZERS[form](normed, scale)


def dequantize(quant: torch.Tensor, scale: torch.Tensor, form: str) -> torch.Tensor:
    """quant * scale in fp32, broadcasting each form's scale layout (for checks and tests)."""
    q = quant.float()
    if form == "fp8_group":
        groups = q.reshape(*q.shape[:-1], q.shape[-1] // GROUP_SIZE, GROUP_SIZE)
        return (groups * scale.unsqueeze(-1)).reshape(q.shape)
    return q * scale
