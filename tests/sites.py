"""Site modules and compile runners shared by test files.

`Site` is one all_reduce -> [+ residual] -> norm -> [quant] region with the norm and quant spelled by
a function (NORMS, QUANTS, SCALED list the spellings); `run` and `compile_and_inspect` compile with
the pass against the fake process group and hand back the fused ops' arguments by name
(`models.op_arguments`). `AllSpellings` holds one RowParallelThenNorm per residual and norm spelling.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import arfusion
from arfusion.edits import MOE_OP, fused_calls
from arfusion.fusion_pass import ArFusionPass, ChainedPass

from .models import RowParallelThenNorm, op_arguments, unfused_all_reduces

H = 256
FP8 = torch.float8_e4m3fn
FMAX = 448.0


# ------------------------------------------------------------------ norm spellings (h, w, eps) -> y


def mean_square(hf):
    return hf.pow(2).mean(-1, keepdim=True)


NORMS = {
    # name: (spelling, expected norm form of the fused op)
    "hf_llama": (lambda h, w, eps: w * (h.float() * torch.rsqrt(mean_square(h.float()) + eps)).to(h.dtype), "rms"),
    "olmo2_weight_in_fp32": (lambda h, w, eps: (w * (h.float() * torch.rsqrt(mean_square(h.float()) + eps))).to(h.dtype),
                             "rms_fp32_weight"),
    "explicit_fp32_weight": (lambda h, w, eps: (w.to(torch.float32) * (h.float() * torch.rsqrt(mean_square(h.float()) + eps)))
                             .to(h.dtype), "rms_fp32_weight"),
    "gemma3n_pow_minus_half": (lambda h, w, eps: (h.float() * torch.pow(mean_square(h.float()) + eps, -0.5) * w.float())
                               .to(h.dtype), "rms_fp32_weight"),
    "gemma_one_plus_weight": (lambda h, w, eps: (h.float() * torch.rsqrt(mean_square(h.float()) + eps) * (1.0 + w.float()))
                              .to(h.dtype), "gemma_rms"),
    "nanochat_no_weight": (lambda h, w, eps: F.rms_norm(h, (h.shape[-1],), eps=eps), "rms_fp32_weight"),
    "functional_rms_norm": (lambda h, w, eps: F.rms_norm(h, (h.shape[-1],), w, eps), "rms_fp32_weight"),
    "x_times_x_sum_over_n": (lambda h, w, eps: w * (h.float() / torch.sqrt(
        (h.float() * h.float()).sum(-1, keepdim=True) / h.shape[-1] + eps)).to(h.dtype), "rms"),
    # unlisted spellings
    "reciprocal_of_sqrt": (lambda h, w, eps: (h.float() * torch.reciprocal(torch.sqrt(mean_square(h.float()) + eps))
                                              * w.float()).to(h.dtype), "rms_fp32_weight"),
    "square_over_positive_dim": (lambda h, w, eps: w * (h.float() * torch.rsqrt(
        torch.square(h.float()).mean(dim=h.dim() - 1, keepdim=True) + eps)).to(h.dtype), "rms"),
    "vector_norm": (lambda h, w, eps: w * (h.float() * torch.rsqrt(
        torch.linalg.vector_norm(h.float(), dim=-1, keepdim=True) ** 2 / h.shape[-1] + eps)).to(h.dtype), "rms"),
    "weight_before_normalising": (lambda h, w, eps: ((w.float() * h.float()) * torch.rsqrt(mean_square(h.float()) + eps))
                                  .to(h.dtype), "rms_fp32_weight"),
    "offset_weight_first": (lambda h, w, eps: ((w.float() + 1.0) * (h.float() / torch.sqrt(mean_square(h.float()) + eps)))
                            .to(h.dtype), "gemma_rms"),
}

class Site(nn.Module):
    """proj -> all_reduce -> [view] -> [+ residual] -> norm spelling -> [quant spelling].

    residual: "first" (r + y, HF), "last" (y + r), "none", "moe" (all-reduce on [T, H], then a
    view back to [B, S, H] before the add, as HF MoE blocks do), or a function (r, y) -> h.
    Returns the norm output (or the quant outputs) and the residual sum.
    """

    def __init__(self, norm, residual="first", eps=1e-6, dtype=torch.bfloat16, quant=None, weight_dtype=None):
        super().__init__()
        self.proj = nn.Linear(H, H, bias=False, dtype=dtype)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H, dtype=weight_dtype or dtype))
        self.norm, self.residual, self.eps, self.quant = norm, residual, eps, quant
        self.register_buffer("scale", torch.tensor(0.02))
        self.register_buffer("inv_scale", torch.tensor(50.0))

    def forward(self, x, residual):
        if self.residual == "moe":
            y = self.proj(x.reshape(-1, H))
            dist.all_reduce(y)
            h = residual + y.view(residual.shape)
        else:
            y = self.proj(x)
            dist.all_reduce(y)
            combine = self.residual if callable(self.residual) else {
                "first": lambda r, y: r + y, "last": lambda r, y: y + r, "none": lambda r, y: y}[self.residual]
            h = combine(residual, y)
        normed = self.norm(h, self.weight, self.eps)
        if self.quant is None:
            return normed, h
        return (*self.quant(self, normed), h)


def run(module, dtype=torch.bfloat16, lead=(2, 5), dynamic=False, quant_forms=None, inputs=None):
    """Compile with the pass (fake group); (fused-op args, all_reduces left, compiled outputs,
    eager outputs, stats)."""
    seen = {}

    def inspect(graph):
        seen["fused"] = [op_arguments(n) for n, op in fused_calls(graph) if op is not MOE_OP]
        seen["left"] = unfused_all_reduces(graph)

    config = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch",
                                 **({} if quant_forms is None else {"quant_forms": quant_forms}))
    options = {"post_grad_custom_post_pass": ChainedPass([ArFusionPass(config), inspect])}
    torch.manual_seed(0)
    x, r = inputs or (torch.randn(*lead, H, dtype=dtype), torch.randn(*lead, H, dtype=dtype))
    with torch.no_grad():
        expected = module(x, r)
        actual = torch.compile(module, options=options, dynamic=dynamic)(x, r)
    return seen["fused"], seen["left"], actual, expected, arfusion.stats()


def assert_matches_eager(actual, expected, dtype=torch.bfloat16):
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        if a.dtype in (FP8,):
            assert_fp8_close(a, e)
            continue
        # Within the fused kernels' rounding: at most 2 ulp of the dtype at each value.
        ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(e.float().abs().clamp_min(1e-30))))
        assert ((a.float() - e.float()).abs() <= 2 * ulp + 1e-30).all()


def assert_fp8_close(a, e):
    """FP8 codes at most one step apart (the scale may be rounded elsewhere)."""
    af, ef = a.float(), e.float()
    step = 2.0 ** (torch.floor(torch.log2(torch.maximum(af.abs(), ef.abs()).clamp_min(2 ** -6))) - 3)
    assert ((af - ef).abs() <= step).all()


# f * AR(y) before the add (Granite's residual multiplier, MiniCPM's depth scale): the site starts at
# the product and the op takes f (its last argument), scaling y only where its kernel runs.
SCALED = {"granite": lambda r, y: r + y * 0.22, "factor first": lambda r, y: r + 0.22 * y,
          "integer": lambda r, y: y * 4 + r, "no residual": lambda r, y: y * 0.22,
          "through a view": lambda r, y: r + y.view(-1, H).view(r.shape) * 0.22}


class EmbeddingScaled(Site):
    """Gemma's vocab-parallel embedding: AR(y) * normaliser, a 0-d bf16 buffer; the product is
    normed (layer 0's input norm) and is the residual stream (added to later)."""

    def __init__(self, residual_after=True):
        super().__init__(NORMS["hf_llama"][0])
        self.register_buffer("normaliser", torch.tensor(H ** 0.5, dtype=torch.bfloat16))
        self.residual_after = residual_after
        self.sublayer = nn.Linear(H, H, bias=False, dtype=torch.bfloat16)

    def forward(self, x, residual):
        y = self.proj(x)
        dist.all_reduce(y)
        h = y * self.normaliser
        normed = self.norm(h, self.weight, self.eps)
        if self.residual_after == "sublayer":  # layer 0 as a model runs it: h + AR(o_proj(...)) -> norm
            out = self.sublayer(normed)
            dist.all_reduce(out)
            h = h + out
            return normed, self.norm(h, self.weight, self.eps), h
        return (normed, h + residual) if self.residual_after else (normed, h * 2)


def _static_divide(self, y):
    return ((y / self.scale).clamp(-FMAX, FMAX).to(FP8),)


def _static_times_reciprocal(self, y):
    return ((y.float() * (1.0 / self.scale)).clamp(-FMAX, FMAX).to(FP8),)


def _static_times_stored_inverse(self, y):
    return ((y.float() * self.inv_scale).clamp(min=-FMAX, max=FMAX).to(FP8),)


def _dynamic_torchao(self, y):
    scale = (y.abs().amax(dim=y.dim() - 1, keepdim=True) / FMAX).to(torch.float32)
    return (y.to(torch.float32) / scale).clamp(-FMAX, FMAX).to(FP8), scale


def _dynamic_engine_fallback(self, y):  # amax clamped to a floor, scale = amax / max, multiply by 1 / scale
    amax, _ = y.abs().max(dim=-1)
    scale = (amax.unsqueeze(-1).to(torch.float32) / FMAX).clamp(min=1.0 / (FMAX * 512.0))
    return (y.to(torch.float32) * scale.reciprocal()).clamp(-FMAX, FMAX).to(FP8), scale


def _dynamic_amax_floor(self, y):
    amax = y.float().abs().amax(-1, keepdim=True).clamp(min=1e-12)
    scale = amax / FMAX
    return (y.float() / scale).clamp(-FMAX, FMAX).to(FP8), scale


def _dynamic_inverse_scale_out(self, y):  # the consumer takes the reciprocal scale
    inv = FMAX / y.float().abs().amax(-1, keepdim=True).clamp(min=1e-12)
    return (y.float() * inv).clamp(-FMAX, FMAX).to(FP8), inv


def _group_view(self, y):
    x = y.float()
    g = x.view(*x.shape[:-1], x.shape[-1] // 128, 128)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FMAX
    return (g / scale).clamp(-FMAX, FMAX).to(FP8).view(x.shape), scale.squeeze(-1)


def _group_unflatten(self, y):
    g = y.float().unflatten(-1, (-1, 128))
    scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FMAX
    return (g / scale).clamp(-FMAX, FMAX).to(FP8).flatten(-2), scale.squeeze(-1)


def _group_flat_rows(self, y):  # [numel / 128, 128], amax in the model dtype (an engine's fallback)
    g = y.reshape(y.numel() // 128, 128)
    amax = g.abs().max(dim=-1, keepdim=True)[0].clamp(min=1e-10).to(torch.float32)
    scale = amax / FMAX
    q = (g / scale).clamp(min=-FMAX, max=FMAX).to(FP8).reshape(y.shape)
    return q, scale.reshape(*y.shape[:-1], y.shape[-1] // 128)


QUANTS = {
    "static_divide": (_static_divide, "fp8_static"),
    "static_times_reciprocal": (_static_times_reciprocal, "fp8_static"),
    "static_times_stored_inverse": (_static_times_stored_inverse, "fp8_static"),
    "dynamic_torchao": (_dynamic_torchao, "fp8_dynamic"),
    "dynamic_engine_fallback": (_dynamic_engine_fallback, "fp8_dynamic"),
    "dynamic_amax_floor": (_dynamic_amax_floor, "fp8_dynamic"),
    "dynamic_inverse_scale_out": (_dynamic_inverse_scale_out, "fp8_dynamic"),
    "group_view": (_group_view, "fp8_group"),
    "group_unflatten": (_group_unflatten, "fp8_group"),
    "group_flat_rows": (_group_flat_rows, "fp8_group"),
}



# ------------------------------------------------------------------ RowParallelThenNorm spellings

PATTERN_HIDDEN = 64
RESIDUALS = ("first", "last", "none")
MODEL_NORMS = ("llama", "llama_weight_last", "gemma")


def compile_and_inspect(module, *inputs, config=None, dynamic=False):
    """Compile with the pass; return (fused-op nodes' args, all_reduce nodes left, stats)."""
    seen = {}

    def inspect(graph):
        seen["fused"] = [op_arguments(n) for n, op in fused_calls(graph) if op is not MOE_OP]
        seen["left"] = unfused_all_reduces(graph)

    config = config or arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch")
    options = {"post_grad_custom_post_pass": ChainedPass([ArFusionPass(config), inspect])}
    with torch.no_grad():
        torch.compile(module, options=options, dynamic=dynamic)(*inputs)
    return seen["fused"], seen["left"], arfusion.stats()


class AllSpellings(nn.Module):
    """One site per (residual spelling, norm spelling), each with its own eps."""

    EPS = (1e-5, 1e-6, 3e-4, 0.1, 1e-8, 2e-5, 7e-6, 1e-3, 5e-2)

    def __init__(self, dtype):
        super().__init__()
        combos = [(r, n) for r in RESIDUALS for n in MODEL_NORMS]
        self.sites = nn.ModuleList(RowParallelThenNorm(PATTERN_HIDDEN, norm=n, residual=r, eps=eps, dtype=dtype)
                                   for (r, n), eps in zip(combos, self.EPS))
        self.combos = combos

    def forward(self, x, residual):
        return [site(x, residual) for site in self.sites]


def inputs(dtype, tokens=8):
    return torch.randn(2, tokens, PATTERN_HIDDEN, dtype=dtype), torch.randn(2, tokens, PATTERN_HIDDEN, dtype=dtype)


