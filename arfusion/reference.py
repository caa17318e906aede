"""The unfused computation, written the way HF transformers writes it.

This is both the `torch` backend and the fallback every fused op takes when a backend
declines a call, so its numerics are the ones the uncompiled model produces.
"""

from __future__ import annotations

import torch

from . import quant
from .core import Form


def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    reduced = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(reduced)


def rms_normalize(h: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 normalisation of `h`, before the weight."""
    hf = h.to(torch.float32)
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(h: torch.Tensor, weight: torch.Tensor | None, eps: float, norm: str) -> torch.Tensor:
    """The norm forms of `core.NORM_FORMS`; no weight multiplies by one."""
    normed = rms_normalize(h, eps)
    if norm == "gemma_rms":
        return (normed * (1.0 + weight.float())).to(h.dtype)
    if norm == "rms_fp32_weight":
        return (normed if weight is None else normed * weight.float()).to(h.dtype)
    return normed.to(h.dtype) if weight is None else weight * normed.to(h.dtype)


def add_rms_norm(reduced: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                 eps: float, form: Form, quant_scale: torch.Tensor | None = None,
                 reduced_scale: float | torch.Tensor = 1.0) -> list[torch.Tensor]:
    """Everything after the all-reduce (scaled first by `reduced_scale`, Granite's multiplier);
    outputs in `form.outputs()` order."""
    if isinstance(reduced_scale, torch.Tensor) or reduced_scale != 1.0:
        reduced = reduced * reduced_scale
    h = reduced if residual is None else residual + reduced
    normed = rms_norm(h, weight, eps, form.norm)
    produced = {"residual": h, "norm": normed}
    if form.quant != "none":
        produced.update(quant.quantize(normed, form.quant, quant_scale))
    return [produced[name] for name in form.outputs()]


def unfused(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
            group_name: str, form: Form, quant_scale: torch.Tensor | None = None,
            input_scale: float = 1.0) -> list[torch.Tensor]:
    return add_rms_norm(all_reduce_sum(x, group_name), residual, weight, eps, form, quant_scale, input_scale)


def moe_combine(rows: torch.Tensor, scale: torch.Tensor, index: torch.Tensor, top_k: int,
                scale_first: bool, shared: torch.Tensor | None = None, routed_scale: float = 1.0) -> torch.Tensor:
    """The MoE top-k combine as HF's grouped experts spell it (transformers integrations/moe.py):
    `(rows * scale)[index].view(T, K, H).sum(1)` (scale_first: one weight per permuted row,
    scale [R, 1]) or `(rows[index] * scale).view(T, K, H).sum(1)` (one weight per (token, k) in
    token order, scale [T * K, 1]). index is 1-D [T * K]: (token, k) -> row. Same ops, dtypes
    and order as the graph, so the same rounding; weights of a wider dtype than the rows (fp32
    routers) make the combine run in that dtype, rounded to the rows' once at the end, as HF
    returns it. `routed_scale`, where not 1, multiplies that (Laguna's routed scaling factor), and
    `shared` [T, H], where given, is added after (a shared expert's partial output reduced with the
    routed one)."""
    gathered = (rows * scale)[index] if scale_first else rows[index] * scale
    combined = gathered.view(-1, top_k, rows.shape[-1]).sum(1).to(rows.dtype)
    if routed_scale != 1.0:
        combined = combined * routed_scale
    return combined if shared is None else combined + shared
