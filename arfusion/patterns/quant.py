"""The quant piece: what follows the norm, spelled as real code spells it.

Each spelling was traced from real code to the post-grad graph before being written here:
- static per-tensor FP8, as FP8 checkpoints' activation quant writes it:
  `(y / scale).clamp(-fmax, fmax).to(fp8)`. With a 0-d scale the divide stays in the model
  dtype (a 0-d tensor does not promote), so the value is cast twice; a 1-element scale
  promotes to fp32; `y.float() / scale` is a third spelling;
- dynamic per-token FP8 as torchao (0.18, Float8DynamicActivationFloat8WeightConfig with
  PerRow) computes it: amax over the last dim given as a positive index, the scale divided in
  the model dtype, then cast to fp32, no floor;
- per-group FP8 (groups of 128, fp32 scales [T, H/128]) as DeepSeek-style checkpoints' act
  quant writes it, with an amax floor;
- NVFP4 as torchao (0.18, NVFP4DynamicActivationNVFP4WeightConfig, use_triton_kernel=False)
  quantizes a linear's input: with a calibrated global scale (step="convert") or none, after
  the linear flattens [B, S, H] to [B*S, H] (or on 2-D activations as they are). Post-grad the
  quantizer is plain aten ops (`_nvfp4_torchao` spells them); its in-place int ops are
  functional by then and its one tensor constant is folded into a `full`.
Every spelling comes with and without the unquantized norm output (used elsewhere or not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..quant import E2M1_MAX, E2M1_SIGN, E4M3_MAX, GROUP_SIZE, MIN_BLOCK_SCALE, MIN_GROUP_AMAX, NVFP4_BLOCK

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# Stand-ins for the FP8 range bounds, turned into pattern arguments like eps: code writes them
# as ints (`clamp(-448, 448)`) or floats (`finfo.max`), and the matcher compares literally.
# The compile-time check then requires them to equal the FP8 type's range.
BOUND_SENTINELS = {"fmax": 4097.5, "neg_fmax": -4099.5}
MODEL_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class QuantSpelling:
    form: str  # Site.quant
    emit_norm: bool  # the unquantized norm output is a pattern output too
    apply: Callable[..., dict]  # (normed, **inputs) -> {"quant": ..., "scale": ...}
    inputs: tuple[str, ...] = ()
    example_inputs: Callable[[int, int], dict] = field(default=lambda tokens, hidden: {})
    priority: int = 100  # lower registers first: a larger pattern must win over the norm alone
    trace_dtypes: tuple[torch.dtype, ...] = MODEL_DTYPES
    fp8_dtype: torch.dtype | None = None  # the FP8 type of an FP8 form (None: not an FP8 form)
    # Leading dims of the traced activation. 2: the spelling starts by flattening [B, S, H] to
    # [B*S, H], and its quant outputs are 2-D, whatever the norm output's rank.
    token_dims: int = 1

    @property
    def scalar_workaround(self) -> dict[str, float]:
        return {k: v for k, v in BOUND_SENTINELS.items() if k in self.inputs}

    def traces_with(self, dtype: torch.dtype) -> bool:
        return dtype in self.trace_dtypes


def _static_model_dtype_divide(fp8):
    return lambda normed, scale, fmax, neg_fmax: {"quant": (normed / scale).clamp(neg_fmax, fmax).to(fp8)}


def _static_fp32_divide(fp8):
    return lambda normed, scale, fmax, neg_fmax: {
        "quant": (normed.float() / scale).clamp(neg_fmax, fmax).to(fp8)}


def _dynamic_torchao_per_row(fp8):
    def quantize(normed, fmax, neg_fmax):
        amax = normed.abs().amax(dim=normed.dim() - 1, keepdim=True)
        scale = (amax / fmax).to(torch.float32)
        quant = (normed.to(torch.float32) / scale).clamp(neg_fmax, fmax).to(fp8)
        return {"quant": quant, "scale": scale}

    return quantize


def _per_group_128(fp8):
    def quantize(normed, fmax, neg_fmax):
        x = normed.float()
        groups = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP_SIZE, GROUP_SIZE)
        scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_GROUP_AMAX) / fmax
        quant = (groups / scale).clamp(neg_fmax, fmax).to(fp8).reshape(x.shape)
        return {"quant": quant, "scale": scale.squeeze(-1)}

    return quantize


# The E2M1 encoding of fp32 values in [-6, 6] as torchao writes it with integer ops (post-grad
# op for op; the matcher compares the graph literally). F32 bit facts it relies on:
_F32_SIGN_BIT = 0x80000000
_F32_MANTISSA_BITS = 23
_E2M1_SHIFT = _F32_MANTISSA_BITS - 1  # fp32 mantissa bits dropped to keep E2M1's one
_SUBNORMAL_ADDER = 2.0 ** 22  # x + 2^22 in fp32 rounds x to a multiple of 0.5 (E2M1's subnormal step)
_SUBNORMAL_ADDER_BITS = (127 + _E2M1_SHIFT) << _F32_MANTISSA_BITS  # the bit pattern of 2^22
_REBIAS = ((1 - 127) << _F32_MANTISSA_BITS) + (1 << (_E2M1_SHIFT - 1)) - 1  # exponent bias 127 -> 1, minus half an ulp
_SATURATED_CODE = 7
_E2M1_MIN_NORMAL = 1


def _e2m1_codes_torchao(values):
    bits = values.view(torch.int32)
    sign = bits & _F32_SIGN_BIT
    magnitude_bits = bits ^ sign
    magnitude = magnitude_bits.view(torch.float32)
    saturated = magnitude >= E2M1_MAX
    subnormal = torch.logical_and(torch.logical_not(saturated), magnitude < _E2M1_MIN_NORMAL)
    normal = torch.logical_not(torch.logical_or(saturated, subnormal))
    adder = torch.full((), _SUBNORMAL_ADDER, dtype=torch.float32, device=values.device)
    subnormal_code = ((magnitude + adder).view(torch.int32) - _SUBNORMAL_ADDER_BITS).to(torch.uint8)
    odd = (magnitude_bits >> _E2M1_SHIFT) & 1  # round half to even
    normal_code = (((magnitude_bits + _REBIAS) + odd) >> _E2M1_SHIFT).to(torch.uint8)
    code = torch.full_like(magnitude, _SATURATED_CODE, dtype=torch.uint8)
    code = torch.where(subnormal, subnormal_code, code)
    code = torch.where(normal, normal_code, code)
    sign_code = (sign >> 28).to(torch.uint8) & E2M1_SIGN
    return code | sign_code


def _nvfp4_torchao(flatten_tokens: bool, global_scale: bool):
    def quantize(normed, scale=None):
        flat = normed.reshape(-1, normed.shape[-1]) if flatten_tokens else normed
        x = flat.float()
        blocks = x.reshape(x.shape[0], -1, NVFP4_BLOCK)
        block_scale = torch.amax(torch.abs(blocks), dim=-1) / E2M1_MAX
        if global_scale:
            block_scale = block_scale / scale
        block_scale = torch.clamp(block_scale, min=MIN_BLOCK_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn)
        factor = ((1.0 / scale) if global_scale else 1.0) / block_scale.to(torch.float32)
        scaled = torch.clamp(blocks * factor.unsqueeze(-1), -E2M1_MAX, E2M1_MAX).view(flat.shape)
        codes = _e2m1_codes_torchao(scaled).contiguous().view(-1)
        packed = (codes[::2] | codes[1::2] << 4).view(*flat.shape[:-1], flat.shape[-1] // 2)
        return {"quant": packed, "scale": block_scale}

    return quantize


def _scale_input(shape):
    return lambda tokens, hidden: {"scale": torch.empty(shape, dtype=torch.float32), **BOUND_SENTINELS}


def _scale_input_only(shape):
    return lambda tokens, hidden: {"scale": torch.empty(shape, dtype=torch.float32)}


def _bounds_only(tokens, hidden):
    return dict(BOUND_SENTINELS)


def _spellings() -> dict[str, QuantSpelling]:
    out = {"none": QuantSpelling(form="none", emit_norm=True, apply=lambda normed: {})}
    for flatten in (True, False):
        for global_scale in (True, False):
            for emit_norm in (False, True):
                name = (f"nvfp4_torchao{'_global_scale' if global_scale else ''}{'_flat' if flatten else ''}"
                        f"{'_with_norm' if emit_norm else ''}")
                out[name] = QuantSpelling(
                    form="nvfp4", emit_norm=emit_norm, apply=_nvfp4_torchao(flatten, global_scale),
                    inputs=("scale",) if global_scale else (),
                    example_inputs=_scale_input_only(()) if global_scale else (lambda tokens, hidden: {}),
                    priority=10 + emit_norm, token_dims=2 if flatten else 1)
    for fp8 in FP8_DTYPES:
        kinds = {
            "static_0d": dict(form="fp8_static", apply=_static_model_dtype_divide(fp8), inputs=("scale", *BOUND_SENTINELS),
                              example_inputs=_scale_input(())),
            "static_1elem": dict(form="fp8_static", apply=_static_model_dtype_divide(fp8), inputs=("scale", *BOUND_SENTINELS),
                                 example_inputs=_scale_input((1,)), trace_dtypes=(torch.bfloat16,)),
            "static_fp32": dict(form="fp8_static", apply=_static_fp32_divide(fp8), inputs=("scale", *BOUND_SENTINELS),
                                example_inputs=_scale_input(()), trace_dtypes=(torch.bfloat16,)),
            "dynamic_torchao": dict(form="fp8_dynamic", apply=_dynamic_torchao_per_row(fp8),
                                    inputs=tuple(BOUND_SENTINELS), example_inputs=_bounds_only),
            "group128": dict(form="fp8_group", apply=_per_group_128(fp8), inputs=tuple(BOUND_SENTINELS),
                             example_inputs=_bounds_only),
        }
        for kind, spec in kinds.items():
            for emit_norm in (False, True):
                name = f"{kind}_{str(fp8).split('.')[-1]}{'_with_norm' if emit_norm else ''}"
                # Without the norm output first: if the norm has no other user, both match,
                # and producing an unused norm would cost a write.
                # Dynamic and per-group first: a static spelling also matches their tail,
                # with the computed scale taken for an input.
                rank = 20 if spec["form"] == "fp8_static" else 10
                out[name] = QuantSpelling(emit_norm=emit_norm, priority=rank + emit_norm, fp8_dtype=fp8, **spec)
    return out


QUANT_SPELLINGS: dict[str, QuantSpelling] = _spellings()
