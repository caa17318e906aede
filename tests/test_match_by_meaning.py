"""Sites are recognised by what they compute, however the model spells them.

Each case is a small module: row-parallel matmul -> all_reduce -> [view] -> [residual add] ->
an RMSNorm spelling -> [an FP8 quant spelling]. Graphs compile against the fake process group
(its all-reduce is the identity in eager and compiled code alike, so outputs compare directly);
tests/test_numerics_gloo.py runs a mix of them on two real gloo ranks. Spellings marked
"unlisted" are ones no code in arfusion was written against.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import arfusion
from arfusion.edits import FUSED_OP
from arfusion.fusion_pass import ALL_REDUCE, ArFusionPass, ChainedPass

from .models import op_arguments, unfused_all_reduces
from .helpers import assert_close

H = 256
FP8 = torch.float8_e4m3fn
FMAX = 448.0


# ------------------------------------------------------------------ norm spellings (h, w, eps) -> y


def _ms(hf):
    return hf.pow(2).mean(-1, keepdim=True)


NORMS = {
    # name: (spelling, expected norm form of the fused op)
    "hf_llama": (lambda h, w, eps: w * (h.float() * torch.rsqrt(_ms(h.float()) + eps)).to(h.dtype), "rms"),
    "olmo2_weight_in_fp32": (lambda h, w, eps: (w * (h.float() * torch.rsqrt(_ms(h.float()) + eps))).to(h.dtype),
                             "rms_fp32_weight"),
    "explicit_fp32_weight": (lambda h, w, eps: (w.to(torch.float32) * (h.float() * torch.rsqrt(_ms(h.float()) + eps)))
                             .to(h.dtype), "rms_fp32_weight"),
    "gemma3n_pow_minus_half": (lambda h, w, eps: (h.float() * torch.pow(_ms(h.float()) + eps, -0.5) * w.float())
                               .to(h.dtype), "rms_fp32_weight"),
    "gemma_one_plus_weight": (lambda h, w, eps: (h.float() * torch.rsqrt(_ms(h.float()) + eps) * (1.0 + w.float()))
                              .to(h.dtype), "gemma_rms"),
    "nanochat_no_weight": (lambda h, w, eps: F.rms_norm(h, (h.shape[-1],), eps=eps), "rms_fp32_weight"),
    "functional_rms_norm": (lambda h, w, eps: F.rms_norm(h, (h.shape[-1],), w, eps), "rms_fp32_weight"),
    "x_times_x_sum_over_n": (lambda h, w, eps: w * (h.float() / torch.sqrt(
        (h.float() * h.float()).sum(-1, keepdim=True) / h.shape[-1] + eps)).to(h.dtype), "rms"),
    # unlisted spellings
    "reciprocal_of_sqrt": (lambda h, w, eps: (h.float() * torch.reciprocal(torch.sqrt(_ms(h.float()) + eps))
                                              * w.float()).to(h.dtype), "rms_fp32_weight"),
    "square_over_positive_dim": (lambda h, w, eps: w * (h.float() * torch.rsqrt(
        torch.square(h.float()).mean(dim=h.dim() - 1, keepdim=True) + eps)).to(h.dtype), "rms"),
    "vector_norm": (lambda h, w, eps: w * (h.float() * torch.rsqrt(
        torch.linalg.vector_norm(h.float(), dim=-1, keepdim=True) ** 2 / h.shape[-1] + eps)).to(h.dtype), "rms"),
    "weight_before_normalising": (lambda h, w, eps: ((w.float() * h.float()) * torch.rsqrt(_ms(h.float()) + eps))
                                  .to(h.dtype), "rms_fp32_weight"),
    "offset_weight_first": (lambda h, w, eps: ((w.float() + 1.0) * (h.float() / torch.sqrt(_ms(h.float()) + eps)))
                            .to(h.dtype), "gemma_rms"),
}

LOOKALIKES = {
    # name: (spelling, words the INFO reason must contain)
    "layer_norm": (lambda h, w, eps: F.layer_norm(h, (h.shape[-1],), w, None, eps), "LayerNorm"),
    "rms_over_tokens": (lambda h, w, eps: w * (h.float() * torch.rsqrt(h.float().pow(2).mean(-2, keepdim=True)
                                                                     + eps)).to(h.dtype), "tokens"),
    "eps_outside_the_root": (lambda h, w, eps: w * (h.float() / (torch.sqrt(_ms(h.float())) + eps)).to(h.dtype),
                             "does not match"),
    "eps_as_a_floor": (lambda h, w, eps: w * (h.float() * torch.rsqrt(_ms(h.float()).clamp_min(eps))).to(h.dtype),
                       "does not match"),
    # nGPT / Dory: onto the unit sphere, x / ||x||: RMSNorm / sqrt(hidden) (unlisted)
    "l2_norm_ngpt": (lambda h, w, eps: (h.float() * torch.rsqrt(h.float().pow(2).sum(-1, keepdim=True) + eps))
                     .to(h.dtype), "L2 norm"),
    "functional_normalize_weighted": (lambda h, w, eps: w * F.normalize(h.float(), dim=-1).to(h.dtype), "L2 norm"),
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
        seen["fused"] = [op_arguments(n) for n in graph.nodes if n.target is FUSED_OP]
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


# ------------------------------------------------------------------ the norm


# Every spelling at three shapes in the full suite; the quick loop (-m "not slow") keeps the decode shape.
@pytest.mark.parametrize("lead", [pytest.param((2, 5), id="10_tokens", marks=pytest.mark.slow),
                                  pytest.param((1, 1), id="decode_1x1"),
                                  pytest.param((1,), id="one_row", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(NORMS))
def test_norm_spellings_fuse_and_match_eager(fake_pg, name, lead):
    """Also at one token (a batch-1 decode step), where the weight [H] holds as many values as the
    activation [1, 1, H]: it is still the weight, taken into the op (not left as a multiply after)."""
    spelling, form = NORMS[name]
    fused, left, actual, expected, _ = run(Site(spelling), lead=lead)
    assert left == 0 and len(fused) == 1, name
    assert fused[0][6] == form
    assert (fused[0][2] is None) == (name == "nanochat_no_weight")  # the weight went into the op
    assert math.isclose(fused[0][3], 1e-6, rel_tol=1e-6)  # the model's eps, as written (F.rms_norm: fp32-rounded)
    assert_matches_eager(actual, expected)


@pytest.mark.parametrize("residual", ["first", "last", "none", "moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_residual_forms_and_dtypes(fake_pg, residual, dtype):
    fused, left, actual, expected, _ = run(Site(NORMS["olmo2_weight_in_fp32"][0], residual=residual, dtype=dtype),
                                           dtype=dtype)
    assert left == 0 and len(fused) == 1
    assert (fused[0][1] is not None) == (residual != "none")
    assert_matches_eager(actual, expected, dtype)


@pytest.mark.parametrize("eps", [1e-8, 1e-5, 0.1, 0.0])
def test_any_eps_is_recovered_exactly(fake_pg, eps):
    fused, left, actual, expected, _ = run(Site(NORMS["hf_llama"][0], eps=eps))
    assert left == 0 and fused[0][3] == eps
    assert_matches_eager(actual, expected)


def test_eps_as_a_graph_input_under_dynamic_shapes(fake_pg):
    class Holder(nn.Module):  # eps as a module attribute: dynamic=True lifts it to an f64[] input
        eps = 1e-5

    holder = Holder()

    def norm(h, w, eps):
        return w * (h.float() * torch.rsqrt(_ms(h.float()) + holder.eps)).to(h.dtype)

    fused, left, actual, expected, _ = run(Site(norm), dynamic=True)
    assert left == 0 and len(fused) == 1
    assert_matches_eager(actual, expected)


@pytest.mark.parametrize("name", list(LOOKALIKES))
@pytest.mark.slow
def test_lookalikes_stay_unfused_and_say_why(fake_pg, caplog, name):
    spelling, words = LOOKALIKES[name]
    with caplog.at_level(logging.INFO, logger="arfusion"):
        fused, left, actual, expected, stats = run(Site(spelling))
    assert fused == [] and left == 1
    assert any(words in r for r in stats["why_not"]), stats["why_not"]
    assert "not fused" in caplog.text


def test_hyper_connection_streams_are_named(fake_pg):
    """DeepSeek-V4 / Qwen4-exp: the all-reduced output is weighted into k residual streams per
    token, and each stream is normed on its own: no site, and the reason says so."""
    k = 4

    class HyperConnected(Site):
        def forward(self, x, streams):
            y = self.proj(x)
            dist.all_reduce(y)
            post = torch.sigmoid(x[..., :k].float()).to(y.dtype)  # per token and stream
            h = streams + post.unsqueeze(-1) * y.unsqueeze(-2)
            return self.norm(h, self.weight, self.eps), h

    module = HyperConnected(NORMS["hf_llama"][0])
    x = torch.randn(2, 5, H, dtype=torch.bfloat16)
    fused, left, _, _, stats = run(module, inputs=(x, torch.randn(2, 5, k, H, dtype=torch.bfloat16)))
    assert fused == [] and left == 1
    assert any(f"into {k} streams" in r for r in stats["why_not"]), stats["why_not"]


class GraphBreakBeforeNorm(Site):
    def forward(self, x, residual):
        y = self.proj(x)
        dist.all_reduce(y)
        h = residual + y
        torch._dynamo.graph_break()  # e.g. an .item() in an MoE expert loop (LongCat-Flash)
        return self.norm(h, self.weight, self.eps), h


class ReadByCumsum(Site):
    def forward(self, x, residual):
        y = self.proj(x)
        dist.all_reduce(y)
        return torch.cumsum(residual + y, dim=-1)  # no norm: an op the region does not enter


def test_a_graph_break_between_all_reduce_and_norm_is_named(fake_pg):
    fused, left, _, _, stats = run(GraphBreakBeforeNorm(NORMS["hf_llama"][0]))
    assert stats["fused_sites"] == 0 and any("graph break" in r for r in stats["why_not"]), stats["why_not"]


def test_the_reason_does_not_depend_on_what_was_compiled_before(fake_pg):
    """Decisions are memoised by the region's computation: the same all-reduce + add read by
    another op first, then returned by the graph, must still name the graph break."""
    run(ReadByCumsum(NORMS["hf_llama"][0]))
    torch._dynamo.reset()
    arfusion.reset_stats()
    fused, left, _, _, stats = run(GraphBreakBeforeNorm(NORMS["hf_llama"][0]))
    assert any("graph break" in r for r in stats["why_not"]), stats["why_not"]


# f * AR(y) before the add (Granite's residual multiplier, MiniCPM's depth scale): the site starts at
# the product and the op takes f (its last argument), scaling y only where its kernel runs.
SCALED = {"granite": lambda r, y: r + y * 0.22, "factor first": lambda r, y: r + 0.22 * y,
          "integer": lambda r, y: y * 4 + r, "no residual": lambda r, y: y * 0.22,
          "through a view": lambda r, y: r + y.view(-1, H).view(r.shape) * 0.22}


@pytest.mark.parametrize("spelling", SCALED)
def test_an_all_reduce_scaled_by_a_number_fuses_with_the_factor_in_the_op(fake_pg, spelling):
    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(Site(NORMS["hf_llama"][0], residual=SCALED[spelling]))
    assert len(fused) == 1 and left == 0 and stats["scaled_all_reduces_fused"] == 1, stats
    factor = {"integer": 4.0}.get(spelling, 0.22)
    assert fused[0][-2] == factor and (fused[0][1] is None) == (spelling == "no residual")  # [-2]: input_scale
    assert_matches_eager(actual, expected)  # one rank: f * x is f * AR(x), rounded once


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


@pytest.mark.parametrize("spelling, module", [
    ("0-d constant", lambda: Site(NORMS["hf_llama"][0], residual=lambda r, y: r + y * torch.tensor(0.22, dtype=y.dtype))),
    ("0-d buffer (Gemma's embedding normaliser)", EmbeddingScaled),
    # The residual stream is added to the next sublayer's all-reduced output, as in every layer
    # of a real model (a stricter rule that wanted a non-all-reduced operand lost this site).
    ("0-d buffer, then the next sublayer", lambda: EmbeddingScaled(residual_after="sublayer")),
])
def test_an_all_reduce_scaled_by_a_0d_tensor_in_the_residual_stream_fuses(fake_pg, spelling, module):
    """The tensor is the same on every rank where the product goes into the residual stream (as a
    gate in a merged sum): the op takes it as input_scale_tensor."""
    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(module())
    sites = 2 if "sublayer" in spelling else 1
    assert len(fused) == sites and left == 0 and stats["scaled_all_reduces_fused"] == 1, stats
    assert isinstance(fused[0][-1], torch.fx.Node) and fused[0][-2] == 1.0  # input_scale_tensor, input_scale
    assert_matches_eager(actual, expected)


@pytest.mark.parametrize("spelling, combine", [
    ("divided", lambda r, y: r + y / 7.0),                    # not handled: stays, with its reason
    ("per-token tensor", lambda r, y: r + y * torch.sigmoid(r[..., :1])),
    ("not linear", lambda r, y: r + 0.5 / (y.abs() + 1)),
])
@pytest.mark.slow
def test_other_scalings_of_the_all_reduce_stay_unfused(fake_pg, spelling, combine):
    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(Site(NORMS["hf_llama"][0], residual=combine))
    assert fused == [] and left == 1 and stats["scaled_all_reduces_fused"] == 0, stats
    for a, e in zip(actual, expected):  # plain Inductor keeps some intermediates in fp32
        assert_close(a, e, torch.bfloat16, spelling)


def test_a_float_attribute_under_dynamic_shapes_fuses(fake_pg):
    """HF Granite multiplies by `self.residual_multiplier`; dynamic=True lifts such a float into a
    graph input, an fp32 0-d tensor times the bf16 all-reduced value: the op takes it as a tensor."""
    class Granite(Site):
        def __init__(self):
            super().__init__(NORMS["hf_llama"][0], residual=lambda r, y: r + y * self.residual_multiplier)
            self.residual_multiplier = 0.22

    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(Granite(), dynamic=True)
    assert len(fused) == 1 and left == 0 and stats["scaled_all_reduces_fused"] == 1, stats
    # The fp64 graph input itself, not its fp32 cast (which would become a CPU kernel on GPUs).
    assert isinstance(fused[0][-1], torch.fx.Node) and fused[0][-1].meta["val"].dtype == torch.float64
    assert_matches_eager(actual, expected)


def test_a_0d_tensor_factor_outside_the_residual_stream_stays_unfused(fake_pg):
    """Nothing says such a tensor is the same on every rank: AR(y) * t stays as written."""
    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(EmbeddingScaled(residual_after=False))
    assert fused == [] and left == 1 and stats["scaled_all_reduces_fused"] == 0, stats
    for a, e in zip(actual, expected):
        assert_close(a, e, torch.bfloat16, "outside the residual stream")


@pytest.mark.parametrize("beta", [1.0, None])
def test_a_scaled_residual_is_a_residual_term(fake_pg, beta):
    """MiniMax: `residual * alpha + y * beta` with beta = 1.0 as configured (or absent): the
    scaled residual is computed outside the site and is its residual input as it stands."""
    minimax = Site(NORMS["hf_llama"][0], residual=lambda r, y: r * 3.5566 + (y if beta is None else y * beta))
    fused, left, actual, expected, _ = run(minimax)
    assert len(fused) == 1 and left == 0
    assert_matches_eager(actual, expected)


def test_norm_weight_in_another_dtype_stays_unfused(fake_pg):
    """An fp32 weight inside a norm that casts back to bf16: the kernels would read it as bf16."""
    fused, left, _, _, stats = run(Site(NORMS["olmo2_weight_in_fp32"][0], weight_dtype=torch.float32))
    assert fused == [] and left == 1 and any("float32" in r for r in stats["why_not"])


def test_an_fp32_weight_applied_after_the_cast_stays_outside(fake_pg):
    """HF's spelling with an fp32 weight: w * norm(h).to(bf16) is fp32. The bf16 normalisation is
    a site of its own (no weight); the fp32 multiply runs after it, as written."""
    fused, left, actual, expected, _ = run(Site(NORMS["hf_llama"][0], weight_dtype=torch.float32))
    assert left == 0 and len(fused) == 1 and fused[0][2] is None
    assert actual[0].dtype == torch.float32
    assert_matches_eager(actual, expected)


@pytest.mark.slow
def test_intermediate_read_elsewhere_stays_unfused(fake_pg):
    class Leaky(Site):
        def forward(self, x, residual):
            y = self.proj(x)
            dist.all_reduce(y)
            h = residual + y
            inv = torch.rsqrt(_ms(h.float()) + self.eps)
            return self.weight * (h.float() * inv).to(h.dtype), h, inv

    fused, left, _, _, stats = run(Leaky(None))
    assert fused == [] and left == 1 and any("outside the site" in r for r in stats["why_not"])


@pytest.mark.parametrize("factor", [None, 50.0])
def test_an_all_reduced_value_read_elsewhere_stays_unfused_and_says_so(fake_pg, factor):
    """HRM's embedding: e = AR(y) * 50 is added to a replicated state and normed, and e itself is
    added again later. The kernels return only the sum, so the site stays; the reason names the
    other reader, not the scaling (which alone would fuse)."""
    class ReadTwice(Site):
        def forward(self, x, residual):
            y = self.proj(x)
            dist.all_reduce(y)
            e = y if factor is None else y * factor
            h = residual + e
            return self.norm(h, self.weight, self.eps), h, e * 3

    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(ReadTwice(NORMS["hf_llama"][0]))
    assert fused == [] and left == 1, stats
    (reason,) = stats["why_not"]
    assert "itself is also read elsewhere" in reason and ("f * AR(x)" in reason) == (factor is not None), reason
    for a, e in zip(actual, expected):
        assert_close(a, e, torch.bfloat16, "read elsewhere")


def test_a_weight_it_cannot_take_stays_outside_the_site(fake_pg):
    """(w * w) * norm(h): the weightless norm is a site; the multiply runs after the fused op."""
    def squared_weight(h, w, eps):
        return (w * w) * (h.float() * torch.rsqrt(_ms(h.float()) + eps)).to(h.dtype)

    fused, left, actual, expected, _ = run(Site(squared_weight))
    assert left == 0 and len(fused) == 1 and fused[0][2] is None
    assert_matches_eager(actual, expected)


def test_a_scale_after_the_norm_stays_outside_the_site(fake_pg):
    def scaled_norm(h, w, eps):
        return NORMS["hf_llama"][0](h, w, eps) * 0.5

    fused, left, actual, expected, _ = run(Site(scaled_norm))
    assert left == 0 and len(fused) == 1 and fused[0][6] == "rms"
    assert_matches_eager(actual, expected)


# ------------------------------------------------------------------ the quant


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


@pytest.mark.parametrize("name", list(QUANTS))
@pytest.mark.slow
def test_quant_spellings_fuse_and_match_eager(fake_pg, name):
    quantize, form = QUANTS[name]
    fused, left, actual, expected, _ = run(Site(NORMS["hf_llama"][0], quant=quantize))
    assert left == 0 and len(fused) == 1
    assert fused[0][7] == form, fused[0][7]
    assert_matches_eager(actual, expected)


def test_a_clamp_to_another_range_is_no_fp8_cast(fake_pg):
    def clamp_400(self, y):
        return ((y / self.scale).clamp(-400, 400).to(FP8),)

    fused, left, actual, expected, _ = run(Site(NORMS["hf_llama"][0], quant=clamp_400))
    assert left == 0 and fused[0][7] == "none"  # the norm fuses, the quant stays
    assert_matches_eager(actual, expected)


def test_quant_forms_switched_off_leave_the_quant_outside(fake_pg):
    fused, left, actual, expected, _ = run(Site(NORMS["hf_llama"][0], quant=_group_view), quant_forms=())
    assert left == 0 and fused[0][7] == "none"
    assert_matches_eager(actual, expected)
