"""What a fused op computes (`Form`) and what one call of it looks like (`Call`): the package's leaf.

Nothing here imports the rest of arfusion. The pass builds a `Call` from graph metadata at
compile time (`Call.of_meta`), the fused op from tensors at run time (`Call.of_tensors`), and
every backend decides from a `Call` alone.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

MiB = 1 << 20

# Norm forms, with norm(x) the fp32 normalisation: "rms" is y = w * norm(x).to(dtype) (HF Llama,
# Qwen, Mistral: rounded before the weight multiply), "rms_fp32_weight" is
# y = (norm(x) * w.float()).to(dtype) (OLMo2, torch.nn.RMSNorm: one rounding, as the fused
# kernels compute), "gemma_rms" is y = (norm(x) * (1 + w.float())).to(dtype).
NORM_FORMS = ("rms", "rms_fp32_weight", "gemma_rms")
# Quantizations of the norm output a site may carry (arfusion.quant has one function each).
QUANT_FORMS = ("fp8_static", "fp8_dynamic", "fp8_group", "nvfp4")
# Quantized all-reduce levels (payload formats; arfusion.codec).
QUANTIZED_LEVELS = ("fp8", "int8", "int6", "int4")


@dataclass(frozen=True)
class Form:
    """What one fused op computes, as the op and the backends see it; fixed when a site is
    rewritten. (A *site* is the region of a graph that computes it: patterns.Site.)"""

    residual: bool  # an add of a residual precedes the norm
    norm: str  # one of NORM_FORMS ("none" only for PLAIN)
    quant: str = "none"  # "none" or one of QUANT_FORMS
    emit_norm: bool = True  # the unquantized norm output is produced too

    @functools.cached_property  # worked out once per form: the fused op records it on every call
    def name(self) -> str:
        """Pattern name as shown in stats: says what is fused."""
        if self.norm == "none":
            return "allreduce"
        parts = ["allreduce", "add" if self.residual else None, self.norm.replace("rms", "rmsnorm")]
        if self.quant != "none":
            parts.append(self.quant + ("_with_norm_out" if self.emit_norm else ""))
        return "_".join(p for p in parts if p)

    def outputs(self) -> tuple[str, ...]:
        """Names of the fused op's outputs, in order: the one place that fixes the indices."""
        outs = ["residual"]
        if self.emit_norm:
            outs.append("norm")
        if self.quant != "none":
            outs.append("quant")
            if self.quant != "fp8_static":
                outs.append("scale")
        return tuple(outs)


# A plain all-reduce (no norm after it): what `Call.form` holds for the fast-path all-reduce op.
PLAIN = Form(residual=False, norm="none")


@dataclass(frozen=True)
class Call:
    """One invocation of a fused op (or of a plain all-reduce: `form` is PLAIN). `tokens` is None
    while unknown (symbolic at compile time). `oneshot` forces FlashInfer's one-shot (True) or
    two-shot (False) kernel: for tuning and benchmarks, which pass it explicitly; None lets the
    dispatch table choose."""

    form: Form
    tokens: int | None
    hidden: int
    dtype: torch.dtype
    weight_dtype: torch.dtype
    world_size: int
    device: torch.device
    group_name: str = ""
    input_scaled: bool = False  # x is multiplied by a number first: one more pass where a kernel runs
    oneshot: bool | None = None

    @classmethod
    def of_meta(cls, form: Form, shape: Sequence, dtype: torch.dtype, weight_dtype: torch.dtype,
                device: torch.device, world_size: int, group_name: str, input_scaled: bool = False) -> "Call":
        """At compile time, from a graph value's (possibly symbolic) shape."""
        tokens = num_tokens(shape)
        return cls(form=form, tokens=tokens if isinstance(tokens, int) else None, hidden=int(shape[-1]),
                   dtype=dtype, weight_dtype=weight_dtype, world_size=world_size, device=device,
                   group_name=group_name, input_scaled=input_scaled)

    @classmethod
    def of_tensors(cls, form: Form, x: torch.Tensor, weight: torch.Tensor | None, world_size: int,
                   group_name: str, input_scaled: bool = False, oneshot: bool | None = None) -> "Call":
        """At run time, from the op's activation `x` [..., H] and norm weight (None: x's dtype)."""
        return cls(form=form, tokens=num_tokens(x.shape), hidden=x.shape[-1], dtype=x.dtype,
                   weight_dtype=x.dtype if weight is None else weight.dtype, world_size=world_size,
                   device=x.device, group_name=group_name, input_scaled=input_scaled, oneshot=oneshot)

    @property
    def nbytes(self) -> int | None:
        """Bytes of the per-rank input."""
        if self.tokens is None:
            return None
        return self.tokens * self.hidden * itemsize(self.dtype)


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def flatten_tokens(t: torch.Tensor) -> torch.Tensor:
    """2-D contiguous [tokens, hidden] view, as fused kernels want."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def num_tokens(shape: Sequence) -> int:
    return math.prod(shape[:-1])
