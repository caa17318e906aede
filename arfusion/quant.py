"""Reference quantization of the norm output (filled in by the quant-fusion work)."""

from __future__ import annotations

import torch


def quantize(normed: torch.Tensor, form: str, scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    raise NotImplementedError(f"arfusion: quant form {form!r} has no reference implementation yet")
