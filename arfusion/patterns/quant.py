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
  quant writes it, with an amax floor.
Every spelling comes with and without the unquantized norm output (used elsewhere or not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..quant import GROUP_SIZE, MIN_GROUP_AMAX

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
    fp8_dtype: torch.dtype | None = None

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


def _scale_input(shape):
    return lambda tokens, hidden: {"scale": torch.empty(shape, dtype=torch.float32), **BOUND_SENTINELS}


def _bounds_only(tokens, hidden):
    return dict(BOUND_SENTINELS)


def _spellings() -> dict[str, QuantSpelling]:
    out = {"none": QuantSpelling(form="none", emit_norm=True, apply=lambda normed: {})}
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
