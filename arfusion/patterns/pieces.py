"""The pieces a pattern is built from: communication x residual x norm x quant.

Each piece is written exactly as real model code spells it, because the matcher compares
the traced op sequence literally: `residual + x` and `x + residual` are different graphs,
and so are `w * y` and `y * w`. One spelling per entry; the registration loop takes the
product. Numerically the spellings of one form are identical, so they share a `Site`.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..reference import all_reduce_sum  # the communication piece: functional all_reduce + wait

# How the all-reduced value meets the residual stream. None: the norm reads it directly
# (the embedding's all-reduce, post-norm models).
RESIDUAL_SPELLINGS: dict[str, Callable | None] = {
    "none": None,
    "residual_first": lambda reduced, residual: residual + reduced,  # HF decoder layers
    "residual_last": lambda reduced, residual: reduced + residual,
}


def _normalize(h, eps):
    hf = h.to(torch.float32)
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)


# norm spelling -> (norm form of the fused op, function of (h, weight, eps)).
# Gemma first: in fp32 (no casts) a Llama pattern also matches Gemma with weight := 1 + w.
NORM_SPELLINGS: dict[str, tuple[str, Callable]] = {
    # GemmaRMSNorm: (1 + w) multiply in fp32, then the downcast.
    "gemma_weight_last": ("gemma_rms", lambda h, w, eps: (_normalize(h, eps) * (1.0 + w.float())).to(h.dtype)),
    "gemma_weight_first": ("gemma_rms", lambda h, w, eps: ((1.0 + w.float()) * _normalize(h, eps)).to(h.dtype)),
    # LlamaRMSNorm and its copies (Qwen2/3, Mistral, ...): weight multiply after the downcast.
    "rms_weight_first": ("rms", lambda h, w, eps: w * _normalize(h, eps).to(h.dtype)),
    "rms_weight_last": ("rms", lambda h, w, eps: _normalize(h, eps).to(h.dtype) * w),
}

# eps as the graph carries it: a float literal, or (dynamic=True) a 0-d float64 graph input.
EPS_SPELLINGS: dict[str, Callable] = {
    "literal": lambda eps: eps,
    "tensor": lambda eps: eps.to(torch.float32),
}

# Model dtypes to trace. bf16 also covers fp16 (the matcher re-traces with the real dtypes);
# fp32 models have no casts at all, so they need their own trace.
TRACE_DTYPES = (torch.bfloat16, torch.float32)
