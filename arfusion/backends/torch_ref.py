"""Reference backend: functional all_reduce plus the same math in PyTorch. Runs anywhere.

Its quantized all-reduce emulates each level's format with torch collectives
(`codec.emulate`) at every size: it exists to show what the quantization costs (CPU
runs, tests, the accuracy harness), not to be fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import codec, reference
from ..core import QUANT_FORMS, QUANTIZED_LEVELS
from ..decisions import Reason, Why
from .base import Backend, Capabilities, over_cap


@dataclass
class TorchBackend(Backend):
    name: str = "torch"
    capabilities: Capabilities = field(default_factory=lambda: Capabilities(
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        quants=frozenset({"none", *QUANT_FORMS}),
        codecs=frozenset(QUANTIZED_LEVELS),
    ))

    def run(self, call, x, residual, weight, eps, quant_scale):
        return reference.unfused(x, residual, weight, eps, call.group_name, call.form, quant_scale)

    def run_scaled(self, call, x, input_scale, residual, weight, eps, quant_scale):
        # After the all-reduce, as the graph scales: the reference rounds where the model does.
        return reference.unfused(x, residual, weight, eps, call.group_name, call.form, quant_scale, input_scale)

    def moe_combine_why_not(self, call, top_k, rows):
        return None  # the reference computes anything: the combine exactly as the graph spelled it

    def run_moe_combine(self, call, rows, scale, index, top_k, scale_first, residual, weight, eps, quant_scale,
                        shared=None, routed_scale=1.0, input_scale=1.0):
        combined = reference.moe_combine(rows, scale, index, top_k, scale_first, shared, routed_scale)
        return reference.unfused(combined, residual, weight, eps, call.group_name, call.form, quant_scale, input_scale)

    def plain_why_not(self, call, max_bytes_override=None):
        # The reference takes every form, the plain all-reduce too (no speed-up): CPU runs and
        # tests see which all-reduces a GPU backend's fast path would get.
        return self.capabilities.why_not_plain(call) or over_cap(call, max_bytes_override,
                                                                   "the configured plain_max_size_mb")

    def all_reduce(self, call, x):
        return reference.all_reduce_sum(x, call.group_name)

    def codec_min_bytes(self, call, level):
        return 0, "the torch backend emulates the quantized all-reduce at every size"

    def codec_problem(self, call, level):
        if call.dtype not in self.capabilities.dtypes:
            return Reason(Why.DTYPE, f"dtype {call.dtype} not supported")
        return None

    def codec_all_reduce(self, call, x, level):
        return codec.emulate(x, call.group_name, level)
