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
from arfusion.decisions import Why

from .helpers import assert_close
from .sites import FP8, H, NORMS, QUANTS, SCALED, EmbeddingScaled, Site, assert_matches_eager, mean_square, run

LOOKALIKES = {
    # name: (spelling, the reason's code)
    "layer_norm": (lambda h, w, eps: F.layer_norm(h, (h.shape[-1],), w, None, eps), Why.LAYERNORM),
    "rms_over_tokens": (lambda h, w, eps: w * (h.float() * torch.rsqrt(h.float().pow(2).mean(-2, keepdim=True)
                                                                     + eps)).to(h.dtype), Why.NO_NORM),
    "eps_outside_the_root": (lambda h, w, eps: w * (h.float() / (torch.sqrt(mean_square(h.float())) + eps)).to(h.dtype),
                             Why.NOT_RMS),
    "layer_norm_by_hand": (lambda h, w, eps: w * ((h.float() - h.float().mean(-1, keepdim=True)) * torch.rsqrt(
        h.float().var(-1, keepdim=True, unbiased=False) + eps)).to(h.dtype), Why.LAYERNORM),
    "eps_as_a_floor": (lambda h, w, eps: w * (h.float() * torch.rsqrt(mean_square(h.float()).clamp_min(eps))).to(h.dtype),
                       Why.NOT_RMS),
    # nGPT / Dory: onto the unit sphere, x / ||x||: RMSNorm / sqrt(hidden) (unlisted)
    "l2_norm_ngpt": (lambda h, w, eps: (h.float() * torch.rsqrt(h.float().pow(2).sum(-1, keepdim=True) + eps))
                     .to(h.dtype), Why.L2_NORM),
    "functional_normalize_weighted": (lambda h, w, eps: w * F.normalize(h.float(), dim=-1).to(h.dtype), Why.L2_NORM),
}


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
    assert fused[0]["norm"] == form
    assert (fused[0]["weight"] is None) == (name == "nanochat_no_weight")  # the weight went into the op
    assert math.isclose(fused[0]["eps"], 1e-6, rel_tol=1e-6)  # the model's eps, as written (F.rms_norm: fp32-rounded)
    assert_matches_eager(actual, expected)


@pytest.mark.parametrize("residual", ["first", "last", "none", "moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_residual_forms_and_dtypes(fake_pg, residual, dtype):
    fused, left, actual, expected, _ = run(Site(NORMS["olmo2_weight_in_fp32"][0], residual=residual, dtype=dtype),
                                           dtype=dtype)
    assert left == 0 and len(fused) == 1
    assert (fused[0]["residual"] is not None) == (residual != "none")
    assert_matches_eager(actual, expected, dtype)


@pytest.mark.parametrize("eps", [1e-8, 1e-5, 0.1, 0.0])
def test_any_eps_is_recovered_exactly(fake_pg, eps):
    fused, left, actual, expected, _ = run(Site(NORMS["hf_llama"][0], eps=eps))
    assert left == 0 and fused[0]["eps"] == eps
    assert_matches_eager(actual, expected)


def test_eps_as_a_graph_input_under_dynamic_shapes(fake_pg):
    class Holder(nn.Module):  # eps as a module attribute: dynamic=True lifts it to an f64[] input
        eps = 1e-5

    holder = Holder()

    def norm(h, w, eps):
        return w * (h.float() * torch.rsqrt(mean_square(h.float()) + holder.eps)).to(h.dtype)

    fused, left, actual, expected, _ = run(Site(norm), dynamic=True)
    assert left == 0 and len(fused) == 1
    assert_matches_eager(actual, expected)


@pytest.mark.parametrize("name", list(LOOKALIKES))
@pytest.mark.slow
def test_lookalikes_stay_unfused_and_say_why(fake_pg, caplog, name):
    spelling, code = LOOKALIKES[name]
    with caplog.at_level(logging.INFO, logger="arfusion"):
        fused, left, actual, expected, stats = run(Site(spelling))
    assert fused == [] and left == 1
    assert stats["why_not_codes"] == {code.value: 1}, stats["why_not_codes"]
    assert "not fused" in caplog.text  # and people read why


@pytest.mark.parametrize("residual,code", [
    (lambda r, y: r.float() + y, Why.RESIDUAL_DTYPE),  # an fp32 residual stream: not a graph output
    (lambda r, y: y - r, Why.NOT_RMS),  # two hidden states subtracted: not a LayerNorm
], ids=["fp32_residual_stream", "difference"])
def test_near_misses_name_their_own_reason(fake_pg, residual, code):
    fused, left, actual, expected, stats = run(Site(NORMS["hf_llama"][0], residual=residual))
    assert fused == [] and stats["why_not_codes"] == {code.value: 1}, stats["why_not_codes"]
    assert_matches_eager(actual, expected)


def test_an_explicit_wait_on_a_functional_all_reduce_fuses(fake_pg):
    """`funcol.wait_tensor(funcol.all_reduce(...))`: the traced graph waits twice; the second wait
    is dropped and the site fuses."""
    import torch.distributed._functional_collectives as funcol

    class Waited(Site):
        def forward(self, x, residual):
            y = funcol.wait_tensor(funcol.all_reduce(self.proj(x), "sum", dist.group.WORLD))
            h = residual + y
            return self.norm(h, self.weight, self.eps), h

    fused, left, actual, expected, _ = run(Waited(NORMS["hf_llama"][0]))
    assert left == 0 and len(fused) == 1
    assert_matches_eager(actual, expected)


FP16_MAX = torch.finfo(torch.float16).max
BOUNDS = {  # fp16 overflow guards on the residual sum, the identity on every ordinary value
    "clamp": lambda r, y: (r + y).clamp(-60000.0, 60000.0),
    "t5_clamp": lambda r, y: (r + y).clamp(-(FP16_MAX - 1000), FP16_MAX - 1000),
    "nan_to_num": lambda r, y: torch.nan_to_num(r + y, posinf=FP16_MAX, neginf=-FP16_MAX),
    "where_isinf": lambda r, y: torch.where(torch.isinf(r + y), torch.zeros_like(r), r + y),
}


@pytest.mark.parametrize("name", list(BOUNDS))
def test_a_bound_on_the_hidden_states_stays_unfused(fake_pg, name):
    """A clamp that acts only where the sum overflows is the identity on every probe row; fused, it
    would be dropped (inf and NaN where the model gives finite values). It keeps the site unfused,
    and the overflowing call gives what Inductor alone gives (which sums fp16 in fp32 inside its
    kernels, so where the guard tests for inf it may differ from eager)."""
    module = Site(NORMS["hf_llama"][0], residual=BOUNDS[name], dtype=torch.float16)
    x, r = torch.randn(2, 5, H, dtype=torch.float16), torch.randn(2, 5, H, dtype=torch.float16)
    with torch.no_grad():
        module.proj.weight.copy_(torch.eye(H, dtype=torch.float16))
    x[0, 0, 0] = r[0, 0, 0] = 40000.0  # their sum overflows fp16
    fused, left, actual, _, stats = run(module, dtype=torch.float16, inputs=(x, r))
    assert fused == [] and stats["why_not_codes"] == {Why.BOUNDED.value: 1}, stats["why_not_codes"]
    torch._dynamo.reset()
    with torch.no_grad():
        inductor = torch.compile(module)(x, r)
    for a, e in zip(actual, inductor):
        assert torch.equal(a.isfinite(), e.isfinite())
        assert_close(a[a.isfinite()], e[e.isfinite()], torch.float16, name)


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
    assert fused == [] and left == 1 and stats["why_not_codes"] == {Why.HYPER_CONNECTIONS.value: 1}, stats


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
    assert stats["fused_sites"] == 0 and stats["why_not_codes"] == {Why.GRAPH_BREAK.value: 1}, stats


def test_the_reason_does_not_depend_on_what_was_compiled_before(fake_pg):
    """Decisions are memoised by the region's computation: the same all-reduce + add read by
    another op first, then returned by the graph, must still name the graph break."""
    run(ReadByCumsum(NORMS["hf_llama"][0]))
    torch._dynamo.reset()
    arfusion.reset_stats()
    fused, left, _, _, stats = run(GraphBreakBeforeNorm(NORMS["hf_llama"][0]))
    assert stats["why_not_codes"] == {Why.GRAPH_BREAK.value: 1}, stats


@pytest.mark.parametrize("spelling", SCALED)
def test_an_all_reduce_scaled_by_a_number_fuses_with_the_factor_in_the_op(fake_pg, spelling):
    arfusion.reset_stats()
    fused, left, actual, expected, stats = run(Site(NORMS["hf_llama"][0], residual=SCALED[spelling]))
    assert len(fused) == 1 and left == 0 and stats["scaled_all_reduces_fused"] == 1, stats
    factor = {"integer": 4.0}.get(spelling, 0.22)
    assert fused[0]["input_scale"] == factor and (fused[0]["residual"] is None) == (spelling == "no residual")
    assert_matches_eager(actual, expected)  # one rank: f * x is f * AR(x), rounded once


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
    assert isinstance(fused[0]["input_scale_tensor"], torch.fx.Node) and fused[0]["input_scale"] == 1.0
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
    assert isinstance(fused[0]["input_scale_tensor"], torch.fx.Node) and fused[0]["input_scale_tensor"].meta["val"].dtype == torch.float64
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
    assert fused == [] and left == 1 and stats["why_not_codes"] == {Why.WEIGHT_DTYPE.value: 1}, stats


def test_an_fp32_weight_applied_after_the_cast_stays_outside(fake_pg):
    """HF's spelling with an fp32 weight: w * norm(h).to(bf16) is fp32. The bf16 normalisation is
    a site of its own (no weight); the fp32 multiply runs after it, as written."""
    fused, left, actual, expected, _ = run(Site(NORMS["hf_llama"][0], weight_dtype=torch.float32))
    assert left == 0 and len(fused) == 1 and fused[0]["weight"] is None
    assert actual[0].dtype == torch.float32
    assert_matches_eager(actual, expected)


@pytest.mark.slow
def test_intermediate_read_elsewhere_stays_unfused(fake_pg):
    class Leaky(Site):
        def forward(self, x, residual):
            y = self.proj(x)
            dist.all_reduce(y)
            h = residual + y
            inv = torch.rsqrt(mean_square(h.float()) + self.eps)
            return self.weight * (h.float() * inv).to(h.dtype), h, inv

    fused, left, _, _, stats = run(Leaky(None))
    assert fused == [] and left == 1 and stats["why_not_codes"] == {Why.READ_ELSEWHERE.value: 1}, stats


@pytest.mark.parametrize("factor", [None, 50.0])
def test_an_all_reduced_value_read_elsewhere_stays_unfused_and_says_so(fake_pg, caplog, factor):
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
    with caplog.at_level(logging.INFO, logger="arfusion"):
        fused, left, actual, expected, stats = run(ReadTwice(NORMS["hf_llama"][0]))
    assert fused == [] and left == 1 and stats["why_not_codes"] == {Why.READ_ELSEWHERE.value: 1}, stats
    said = [r.getMessage() for r in caplog.records if r.name == "arfusion" and "not fused" in r.getMessage()]
    assert said and all(("AR(x)" in m) == (factor is not None) for m in said), said  # names what is read
    for a, e in zip(actual, expected):
        assert_close(a, e, torch.bfloat16, "read elsewhere")


def test_a_weight_it_cannot_take_stays_outside_the_site(fake_pg):
    """(w * w) * norm(h): the weightless norm is a site; the multiply runs after the fused op."""
    def squared_weight(h, w, eps):
        return (w * w) * (h.float() * torch.rsqrt(mean_square(h.float()) + eps)).to(h.dtype)

    fused, left, actual, expected, _ = run(Site(squared_weight))
    assert left == 0 and len(fused) == 1 and fused[0]["weight"] is None
    assert_matches_eager(actual, expected)


def test_a_scale_after_the_norm_stays_outside_the_site(fake_pg):
    def scaled_norm(h, w, eps):
        return NORMS["hf_llama"][0](h, w, eps) * 0.5

    fused, left, actual, expected, _ = run(Site(scaled_norm))
    assert left == 0 and len(fused) == 1 and fused[0]["norm"] == "rms"
    assert_matches_eager(actual, expected)


# ------------------------------------------------------------------ the quant


@pytest.mark.parametrize("name", list(QUANTS))
@pytest.mark.slow
def test_quant_spellings_fuse_and_match_eager(fake_pg, name):
    quantize, form = QUANTS[name]
    fused, left, actual, expected, _ = run(Site(NORMS["hf_llama"][0], quant=quantize))
    assert left == 0 and len(fused) == 1
    assert fused[0]["quant"] == form, fused[0]["quant"]
    assert_matches_eager(actual, expected)


def test_a_clamp_to_another_range_is_no_fp8_cast(fake_pg):
    def clamp_400(self, y):
        return ((y / self.scale).clamp(-400, 400).to(FP8),)

    fused, left, actual, expected, _ = run(Site(NORMS["hf_llama"][0], quant=clamp_400))
    assert left == 0 and fused[0]["quant"] == "none"  # the norm fuses, the quant stays
    assert_matches_eager(actual, expected)


def test_quant_forms_switched_off_leave_the_quant_outside(fake_pg):
    fused, left, actual, expected, _ = run(Site(NORMS["hf_llama"][0], quant=QUANTS["group_view"][0]), quant_forms=())
    assert left == 0 and fused[0]["quant"] == "none"
    assert_matches_eager(actual, expected)
