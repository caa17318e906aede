"""The reference forms a site may compute, and the acceptance rule (docs/patterns.md).

The fused op's family is communication x residual x norm x quant:
- communication: all_reduce(x, "sum", group);
- residual: none (the norm reads the all-reduced value) or all_reduce(x) + residual;
- norm: RMSNorm over the hidden dim with a plain weight (rounded before the weight multiply,
  as HF Llama, or once after it, as OLMo2 / torch.nn.RMSNorm and the fused kernels), a Gemma
  `(1 + w)` weight, or no weight;
- quant: none, or one of `arfusion.quant.QUANTIZERS`, applied to the norm output.

A region is accepted as one of these iff (1) its exact mathematics equals the form's (float64,
casts erased, relative `MATH_RTOL`), with eps solved from the probe, and (2) with the graph's own
dtypes its outputs are within the rounding below of what the fused kernels produce (fp32
normalisation, one rounding). All numbers of the rule live here.
"""

from __future__ import annotations

import torch

PROBE_ROWS = 32  # half spread over magnitudes (pins eps down), half of ordinary size
PROBE_SEED = 20261123  # the same probe on every rank: every rank takes the same decision
# log10 of the probe's row magnitudes: eps from 1e-16 to 1e-2 shows in the smallest rows.
SPAN_LOG10 = {torch.float16: (-3.0, 3.0)}  # fp16's range is narrow
DEFAULT_SPAN_LOG10 = (-8.0, 4.0)
MATH_RTOL = 1e-9  # float64 identity (the spellings differ only in rounding)
EPS_SNAP_RTOL = 1e-6  # a solved eps this close to a literal of the site is that literal
EPS_ZERO_RTOL = 1e-12  # of the smallest probe row's mean square: below it eps is zero
# |spelling - kernel| allowed per element, in units of the dtype's ulp at the exact value.
# Two roundings (HF Llama: round, multiply, round) are at most ~1.5 ulp from one; fp32 models
# also reorder a 4096-term mean.
NORM_ULPS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 64}
# The residual sum: one add either way (within 1 ulp of it). With k terms added in all (an MoE
# shared expert's output, say) the graph may sum them in another order: then also (k - 1) ulp at
# the sum of the terms' magnitudes, and the norm may differ by that difference, normalised.
RESIDUAL_ULPS = 1
MAX_RESIDUAL_TERMS = 4
FP8_STEPS = 1  # quantized codes may differ by one FP8 step (a scale rounded elsewhere)
SCALE_RTOL = 2.0 ** -7  # quant scales may differ by bf16 rounding (torchao divides in bf16)
EPS_TENSOR_PROBES = (1e-5, 3e-3)  # values tried for an eps that is a graph input
# A static FP8 scale (or NVFP4 global scale) that is a graph input: small enough that the
# largest probe values saturate FP8 (so a clamp to another range shows).
QUANT_SCALE_PROBE = 0.004
# Beyond the ordinary rows: the tail is also run on norm outputs whose rows span these magnitudes
# (log10), at each of these scales, and must still compute its form where the form's own floor does
# not act. A floor above the kernels' or a ceiling on a per-token scale (torchao's activation_value_lb
# / _ub), or a clamp on a static scale, shows there; the fused op would drop it.
QUANT_SPAN_LOG10 = (-3.0, 4.0)
QUANT_SCALE_CHECKS = (QUANT_SCALE_PROBE, 1e-5, 4.0)

# MoE top-k combine in front of the all-reduce (`moe_combine`): probed on this many tokens, with
# the graph's own K and hidden size. Exact mathematics to MATH_RTOL; with the graph's dtypes the
# op's combine (`reference.moe_combine`) must give the same bits (0 ulp): it replays the spelling.
MOE_PROBE_TOKENS = 4
MOE_COMBINE_ULPS = 0
MOE_PROBE_SEED = PROBE_SEED + 13

# weight kind -> the norm forms of the fused op with that kind, closest spelling first.
NORM_FORMS_BY_WEIGHT = {
    "plain": ("rms", "rms_fp32_weight"),
    "offset": ("gemma_rms",),
    "none": ("rms_fp32_weight",),  # no weight: the op multiplies by ones, exactly
}


def weight_factor(kind: str, weight: torch.Tensor | None) -> torch.Tensor | float:
    if kind == "plain":
        return weight
    if kind == "offset":
        return 1.0 + weight
    return 1.0


def exact_rms(h: torch.Tensor, factor, eps: float) -> torch.Tensor:
    """float64 RMSNorm over the last dim of [rows, hidden] `h`."""
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * factor


def solve_eps(h: torch.Tensor, y: torch.Tensor, factor) -> float | None:
    """The eps for which y = h / sqrt(mean(h^2) + eps) * factor, from the row where eps
    weighs most (the smallest mean square). None if no row tells."""
    a = h * factor
    aa, ay = (a * a).sum(-1), (a * y).sum(-1)
    ms = h.pow(2).mean(-1)
    usable = (aa > 0) & (ay > 0) & torch.isfinite(ay)
    if not usable.any():
        return None
    row = torch.where(usable, ms, torch.full_like(ms, float("inf"))).argmin()
    eps = float((aa[row] / ay[row]) ** 2 - ms[row])
    if abs(eps) <= EPS_ZERO_RTOL * float(ms[row]):
        return 0.0  # float64 noise around a norm without eps
    return eps if eps > 0 else None


def close_exact(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal to MATH_RTOL of each row's largest magnitude."""
    a, e = actual.reshape(PROBE_ROWS, -1), expected.reshape(PROBE_ROWS, -1)
    scale = e.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return bool(torch.isfinite(a).all() and ((a - e).abs() <= MATH_RTOL * scale).all())


def ulp(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each |exact| value (subnormal spacing below the normals)."""
    info = torch.finfo(dtype)  # info.eps = 2 ** -(mantissa bits)
    magnitude = exact.abs().double().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude))) * info.eps


def within_ulps(actual: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, ulps: float, extra=0.0) -> bool:
    """|actual - exact| <= ulps * ulp(dtype) at each |exact| + `extra` (an allowance per element)."""
    a, e = actual.double().reshape(-1), exact.double().reshape(-1)
    spacing = ulp(e, dtype)
    extra = torch.as_tensor(extra, dtype=torch.float64).expand(actual.shape).reshape(-1)
    return bool(torch.isfinite(a).all() and ((a - e).abs() <= ulps * spacing + extra).all())


def fp8_within_steps(actual: torch.Tensor, expected: torch.Tensor, steps: int = FP8_STEPS) -> bool:
    """FP8 codes (as floats) at most `steps` apart, counting in the coarser of the two spacings; where
    `expected` reaches the type's max (or min), so must `actual` (a clamp to ±416 is no FP8 cast)."""
    a, e = actual.double().reshape(-1), expected.double().reshape(-1)
    spacing = torch.maximum(ulp(a, actual.dtype), ulp(e, actual.dtype))
    top = torch.finfo(expected.dtype).max
    ends_kept = e.numel() == 0 or bool((e.max() < top or a.max() == top) and (e.min() > -top or a.min() == -top))
    return bool(((a - e).abs() <= steps * spacing).all()) and ends_kept


def probe_activation(rows: int, hidden: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """[rows, hidden]: the first half spans magnitudes, the second half is of ordinary size."""
    lo, hi = SPAN_LOG10.get(dtype, DEFAULT_SPAN_LOG10)
    span = torch.logspace(lo, hi, rows // 2, dtype=torch.float64)
    ordinary = 0.5 + 1.5 * torch.rand(rows - rows // 2, generator=generator, dtype=torch.float64)
    scale = torch.cat([span, ordinary]).unsqueeze(-1)
    return (torch.randn(rows, hidden, generator=generator, dtype=torch.float64) * scale).to(dtype)


def ordinary_rows(rows: int = PROBE_ROWS) -> slice:
    """The probe rows of ordinary size, where quant floors and eps play no part."""
    return slice(rows // 2, rows)
