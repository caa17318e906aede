"""The quant piece: what follows the norm. Only "none" until the quant forms land."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class QuantSpelling:
    form: str  # Site.quant
    emit_norm: bool  # the bf16 norm output is a pattern output too
    apply: Callable[..., dict]  # (normed, **inputs) -> {"quant": ..., "scale": ...}
    inputs: tuple[str, ...] = ()
    example_inputs: Callable[[int, int], dict] = field(default=lambda tokens, hidden: {})
    priority: int = 100  # lower registers first; larger patterns must come first
    trace_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)

    def traces_with(self, dtype: torch.dtype) -> bool:
        return dtype in self.trace_dtypes


QUANT_SPELLINGS: dict[str, QuantSpelling] = {
    "none": QuantSpelling(form="none", emit_norm=True, apply=lambda normed: {}),
}
