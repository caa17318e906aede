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
