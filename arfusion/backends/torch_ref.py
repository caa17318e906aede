"""Reference backend: functional all_reduce plus the same math in PyTorch. Runs anywhere."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import reference
from ..config import QUANT_FORMS
from .base import Backend, Capabilities


@dataclass
class TorchBackend(Backend):
    name: str = "torch"
    capabilities: Capabilities = field(default_factory=lambda: Capabilities(
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        quants=frozenset({"none", *QUANT_FORMS}),
    ))

    def run(self, call, x, residual, weight, eps, quant_scale):
        return reference.unfused(x, residual, weight, eps, call.group_name, call.site, quant_scale)

    def moe_combine_why_not(self, call, top_k, rows):
        return None  # the reference computes anything: the combine exactly as the graph spelled it

    def run_moe_combine(self, call, rows, scale, index, top_k, scale_first, residual, weight, eps, quant_scale):
        combined = reference.moe_combine(rows, scale, index, top_k, scale_first)
        return self.run(call, combined, residual, weight, eps, quant_scale)
