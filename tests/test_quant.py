"""Quantized fusion: FP8 static / dynamic (torchao) / per-group after the norm.

Graph tests run against a fake process group; numerical tests on 2 gloo processes compare the
fused op (torch backend) with the uncompiled model, output by output.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import arfusion
from arfusion import quant as Q

from .models import NormThenQuant, RowParallelThenNorm
from .helpers import assert_close, compiled_vs_eager, run_workers
from .sites import compile_and_inspect

HIDDEN = 256


def inputs(dtype=torch.bfloat16, tokens=5):
    return torch.randn(1, tokens, HIDDEN, dtype=dtype), torch.randn(1, tokens, HIDDEN, dtype=dtype)


def cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes a scale per row (torch 2.11's takes one per
    tensor only: an internal assert in aten/src/ATen/native/Blas.cpp)."""
    a, b = torch.zeros(2, 16, dtype=torch.float8_e4m3fn), torch.zeros(16, 16, dtype=torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, torch.ones(2, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


needs_row_scales = pytest.mark.skipif(
    not cpu_scaled_mm_takes_row_scales(),
    reason=f"torch {torch.__version__}: the CPU _scaled_mm takes per-tensor scales only, and torchao's "
           "per-row FP8 linears call it with per-row scales")


def torchao_fp8_model(dtype=torch.bfloat16):
    """torchao's dynamic per-row FP8 on the two linears that read the norm (like q and k).

    torchao refuses to quantize without an FP8-capable GPU; on CPU we skip its hardware check
    only, so the real quantization code is traced. Its per-row matmuls need a CPU `_scaled_mm`
    that takes per-row scales."""
    ao = pytest.importorskip("torchao.quantization")
    import torchao.quantization.quant_api as quant_api

    class NormThenLinears(nn.Module):
        def __init__(self):
            super().__init__()
            self.site = RowParallelThenNorm(HIDDEN, dtype=dtype)
            self.q = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
            self.k = nn.Linear(HIDDEN, HIDDEN // 2, bias=False, dtype=dtype)

        def forward(self, x, residual):
            normed, h = self.site(x, residual)
            return self.q(normed), self.k(normed), h

    model = NormThenLinears()
    check = quant_api._check_hardware_support
    quant_api._check_hardware_support = lambda granularity: None
    try:
        ao.quantize_(model, ao.Float8DynamicActivationFloat8WeightConfig(granularity=ao.PerRow()),
                     filter_fn=lambda module, name: name in ("q", "k"))
    finally:
        quant_api._check_hardware_support = check
    return model


# ------------------------------------------------------------------ graphs


@pytest.mark.parametrize("residual", ["first", "none"])
@pytest.mark.parametrize("form, quant, scale_shape", [
    ("fp8_static", "static", ()),
    ("fp8_static", "static", (1,)),
    ("fp8_static", "static_fp32", ()),
    ("fp8_group", "group", ()),
])
def test_quant_forms_fuse(fake_pg, residual, form, quant, scale_shape):
    model = NormThenQuant(HIDDEN, quant=quant, residual=residual, scale_shape=scale_shape)
    fused, left, stats = compile_and_inspect(model, *inputs())
    add = "add_" if residual != "none" else ""
    assert stats["by_pattern"] == {f"allreduce_{add}rmsnorm_{form}": 1} and left == 0


def test_norm_used_elsewhere_gives_the_with_norm_variant(fake_pg):
    fused, _, stats = compile_and_inspect(NormThenQuant(HIDDEN, quant="group", keep_norm=True), *inputs())
    assert stats["by_pattern"] == {"allreduce_add_rmsnorm_fp8_group_with_norm_out": 1}


@needs_row_scales
def test_torchao_dynamic_per_row_fuses_once_for_all_consumers(fake_pg):
    # torchao's PerRow takes bf16 weights only.
    fused, left, stats = compile_and_inspect(torchao_fp8_model(), *inputs())
    # q and k each quantize the norm output; the duplicate chains merge into one fused site.
    assert stats["by_pattern"] == {"allreduce_add_rmsnorm_fp8_dynamic": 1} and left == 0


def test_clamp_to_another_range_is_not_an_fp8_cast(fake_pg):
    fused, _, stats = compile_and_inspect(NormThenQuant(HIDDEN, quant="static", clamp=400), *inputs())
    assert stats["by_pattern"] == {"allreduce_add_rmsnorm": 1}  # the norm fuses, the quant stays


def test_quant_fusion_can_be_switched_off(fake_pg):
    config = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch", enable_quant_fusion=False)
    fused, _, stats = compile_and_inspect(NormThenQuant(HIDDEN, quant="group"), *inputs(), config=config)
    assert stats["by_pattern"] == {"allreduce_add_rmsnorm": 1}


def test_fnuz_graph_on_a_non_gfx942_device_keeps_its_quant_unfused(fake_pg):
    class Fnuz(RowParallelThenNorm):
        def forward(self, x, residual):
            normed, h = super().forward(x, residual)
            return (normed / 0.5).clamp(-240, 240).to(torch.float8_e4m3fnuz), h

    fused, _, stats = compile_and_inspect(Fnuz(HIDDEN), *inputs())
    assert stats["by_pattern"] == {"allreduce_add_rmsnorm": 1}


# ------------------------------------------------------------------ numerics


def dequantized(outs, form, scale=None):
    return Q.dequantize(outs[0], scale if scale is not None else outs[1], form)


def assert_quant_close(actual, expected, form, scale, what):
    """FP8 results of two correct pipelines differ by rare 1-ulp steps (a step near the top of
    the range is 7% of it; a model dividing in bf16 rounds twice, which flips ~2% of elements),
    so compare in L2 and bound how many elements differ at all."""
    a, e = dequantized(actual, form, scale), dequantized(expected, form, scale)
    rel_l2 = ((a - e).norm() / e.norm()).item()
    differing = (actual[0].float() != expected[0].float()).float().mean().item()
    assert rel_l2 < 2e-2 and differing < 0.05, f"{what}: rel L2 {rel_l2:.1e}, {differing:.1%} differ"


def _quant_numerics(rank, dtype):
    for residual in ("first", "none"):
        for quant, form in (("static", "fp8_static"), ("group", "fp8_group")):
            for keep_norm in (False, True):
                torch.manual_seed(0)
                model = NormThenQuant(HIDDEN, quant=quant, residual=residual, keep_norm=keep_norm, dtype=dtype)
                torch.manual_seed(10 + rank)
                actual, expected, stats = compiled_vs_eager(model, inputs(dtype))
                assert stats["fused_sites"] == 1 and stats["dispatch"] == {"torch": 1}, stats
                what = f"{quant}/{residual}/keep_norm={keep_norm}"
                scale = model.scale if form == "fp8_static" else None
                assert actual[0].dtype == torch.float8_e4m3fn
                assert_quant_close(actual, expected, form, scale, what)
                if form == "fp8_group":
                    assert_close(actual[1], expected[1], torch.float32, f"scales {what}")
                # Every other output lands where it should (a swap fails: different shapes/values).
                for i in range(1 if form == "fp8_static" else 2, len(expected)):
                    assert_close(actual[i], expected[i], dtype, f"output {i} of {what}")


def _torchao_numerics(rank):
    torch.manual_seed(0)
    model = torchao_fp8_model()
    torch.manual_seed(10 + rank)
    actual, expected, stats = compiled_vs_eager(model, inputs(tokens=8))
    assert stats["by_pattern"] == {"allreduce_add_rmsnorm_fp8_dynamic": 1}
    for a, e, name in zip(actual, expected, ("q", "k", "residual sum")):
        assert_close(a, e, torch.bfloat16, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.multiproc
@pytest.mark.slow
def test_static_and_group_quant_match_uncompiled(dtype):
    run_workers(_quant_numerics, 2, dtype)


@needs_row_scales
@pytest.mark.multiproc
@pytest.mark.slow
def test_torchao_dynamic_quant_matches_uncompiled():
    pytest.importorskip("torchao")
    run_workers(_torchao_numerics, 2)


def test_reference_quant_is_self_consistent():
    normed = torch.randn(3, 256, dtype=torch.bfloat16) * 4
    normed[1] = 0  # an all-zero row: finite scale, zero quant
    for form in ("fp8_dynamic", "fp8_group"):
        out = Q.quantize(normed, form, None)
        assert torch.isfinite(out["scale"]).all()
        back = Q.dequantize(out["quant"], out["scale"], form)
        assert ((back - normed.float()).norm() / normed.float().norm()) < 0.05
    static = Q.quantize(normed, "fp8_static", torch.tensor(0.05))
    assert static.keys() == {"quant"} and static["quant"].dtype == torch.float8_e4m3fn
