"""NVFP4 after the norm, as torchao 0.18 quantizes a linear's input.

The module calls torchao's own activation quantizer (`NVFP4Tensor.to_nvfp4` on the flattened
norm output, as its NVFP4 linear does) with a calibrated per-tensor scale or none. Scales stay
row-major: Inductor on CPU cannot compile torchao's scale swizzle (it fails without arfusion
too), and the swizzle is downstream of the quantizer anyway. Graph tests use a fake process
group; numerics run on 2 gloo processes against the uncompiled model.
"""

from __future__ import annotations

import pytest
import torch

import arfusion
from arfusion import quant as Q

from .models import RowParallelThenNorm
from .helpers import assert_close, compiled_vs_eager, run_workers
from .sites import compile_and_inspect

nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

HIDDEN = 256


class NormThenNVFP4(RowParallelThenNorm):
    """all_reduce -> [add] -> norm -> torchao NVFP4 of the flattened norm output.
    Returns (packed, block scales, residual sum[, norm output])."""

    def __init__(self, residual="first", global_scale=True, keep_norm=False, dtype=torch.bfloat16, flatten=True):
        super().__init__(HIDDEN, residual=residual, dtype=dtype)
        self.keep_norm, self.flatten = keep_norm, flatten
        # torchao's calibrated activation scale: amax / (448 * 6)
        self.global_scale = nvfp4_tensor.per_tensor_amax_to_scale(torch.tensor(5.0)) if global_scale else None

    def forward(self, x, residual):
        normed, h = super().forward(x, residual)
        flat = normed.view(-1, HIDDEN) if self.flatten else normed
        t = nvfp4_tensor.NVFP4Tensor.to_nvfp4(flat, per_tensor_scale=self.global_scale, is_swizzled_scales=False)
        outs = (t.qdata, t.scale, h)
        return (*outs, normed) if self.keep_norm else outs


def inputs(dtype=torch.bfloat16, lead=(1, 5)):
    return torch.randn(*lead, HIDDEN, dtype=dtype), torch.randn(*lead, HIDDEN, dtype=dtype)


# ------------------------------------------------------------------ the reference is torchao's encoding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("global_scale", [None, "calibrated", "small"])
def test_reference_is_bit_identical_to_torchao(dtype, global_scale):
    torch.manual_seed(0)
    x = torch.randn(24, 512) * torch.logspace(-6, 4, 24).unsqueeze(1)
    x[0] = 0  # zero blocks: the smallest block scale
    x[1, 5] = -0.0  # keeps its sign bit
    x[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor([1.0, -1.0] * 8)
    x[3] = 1e30  # saturates the block scale at 448
    x = x.to(dtype)
    scale = {None: None, "calibrated": nvfp4_tensor.per_tensor_amax_to_scale(x.float().abs().max()),
             "small": torch.tensor(1e-5)}[global_scale]
    want_scale, want_packed = nvfp4_tensor.nvfp4_quantize(x, 16, scale)
    got = Q.nvfp4(x, scale)
    assert torch.equal(got["quant"], want_packed)
    assert torch.equal(got["scale"].view(torch.uint8), want_scale.view(torch.uint8))
    # and our dequantization agrees with torchao's own
    want_values = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(torch.float32)
    torch.testing.assert_close(Q.dequantize(got["quant"], got["scale"], "nvfp4", scale), want_values, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ graphs


@pytest.mark.parametrize("residual", ["first", "none"])
@pytest.mark.parametrize("global_scale", [True, False])
def test_torchao_nvfp4_fuses(fake_pg, residual, global_scale):
    fused, left, stats = compile_and_inspect(NormThenNVFP4(residual, global_scale), *inputs())
    add = "add_" if residual != "none" else ""
    assert stats["by_pattern"] == {f"allreduce_{add}rmsnorm_nvfp4": 1} and left == 0
    [args] = fused
    assert (args["quant_scale"] is not None) == global_scale  # the global scale reaches the op


def test_norm_used_elsewhere_gives_the_with_norm_variant(fake_pg):
    _, _, stats = compile_and_inspect(NormThenNVFP4(keep_norm=True), *inputs())
    assert stats["by_pattern"] == {"allreduce_add_rmsnorm_nvfp4_with_norm_out": 1}


def test_fp32_model_and_2d_activations_fuse(fake_pg):
    _, _, stats = compile_and_inspect(NormThenNVFP4(dtype=torch.float32), *inputs(torch.float32))
    assert stats["by_pattern"] == {"allreduce_add_rmsnorm_nvfp4": 1}
    _, _, stats = compile_and_inspect(NormThenNVFP4(flatten=False), *inputs(lead=(5,)))
    assert stats["by_pattern"] == {"allreduce_add_rmsnorm_nvfp4": 2}  # cumulative over both compiles


@pytest.mark.slow
def test_global_scale_computed_from_the_norm_output_is_not_taken_for_an_input(fake_pg):
    """torchao's default dynamic per-tensor scale is amax(|norm|) / 2688: a pattern taking it as
    its scale input would read a value computed from its own output. The norm still fuses."""

    class DynamicScale(NormThenNVFP4):
        def forward(self, x, residual):
            normed, h = RowParallelThenNorm.forward(self, x, residual)
            scale = nvfp4_tensor.per_tensor_amax_to_scale(torch.max(torch.abs(normed)))
            t = nvfp4_tensor.NVFP4Tensor.to_nvfp4(normed.view(-1, HIDDEN), per_tensor_scale=scale)
            return t.qdata, t.scale, h

    _, _, stats = compile_and_inspect(DynamicScale(), *inputs())
    assert stats["by_pattern"] == {"allreduce_add_rmsnorm": 1}


# ------------------------------------------------------------------ numerics, 2 ranks


def _numerics(rank):
    # Each compile registers and re-traces the big NVFP4 patterns: three cases cover residual /
    # none, norm output / not, bf16 / fp32 (the graph tests cover the rest of the product).
    for dtype, residual, keep_norm in ((torch.bfloat16, "first", False), (torch.bfloat16, "none", True),
                                       (torch.float32, "first", False)):
        torch.manual_seed(0)
        model = NormThenNVFP4(residual, keep_norm=keep_norm, dtype=dtype)
        torch.manual_seed(10 + rank)
        actual, expected, stats = compiled_vs_eager(model, inputs(dtype))
        what = f"{dtype}/{residual}/keep_norm={keep_norm}"
        assert stats["by_pattern"] == {model_site_name(residual, keep_norm): 1}, what
        assert stats["dispatch"] == {"torch": 1}, what
        packed, scales = actual[0], actual[1]
        assert packed.dtype == torch.uint8 and packed.shape == (5, HIDDEN // 2), what
        assert scales.dtype == torch.float8_e4m3fn and scales.shape == (5, HIDDEN // 16), what
        # The reference is torchao's encoding: identical bytes, not merely close values.
        assert torch.equal(packed, expected[0]), what
        assert torch.equal(scales.view(torch.uint8), expected[1].view(torch.uint8)), what
        got = Q.dequantize(packed, scales, "nvfp4", model.global_scale)
        want = Q.dequantize(expected[0], expected[1], "nvfp4", model.global_scale)
        assert torch.equal(got, want), what
        # Every other output lands where it should (a swap fails: different shapes/values).
        for i in range(2, len(expected)):
            assert_close(actual[i], expected[i], dtype, f"output {i} of {what}")


def model_site_name(residual, keep_norm):
    return f"allreduce_{'add_' if residual != 'none' else ''}rmsnorm_nvfp4{'_with_norm_out' if keep_norm else ''}"


@pytest.mark.multiproc
@pytest.mark.slow
def test_fused_nvfp4_matches_uncompiled():
    run_workers(_numerics, 2)


# ------------------------------------------------------------------ output placement


def test_every_output_of_the_replacement_lands_where_it_should(fake_pg):
    """Placement through the real rewrite: each output of the compiled graph is compared with
    the uncompiled module (fake collectives are identities here, on both sides)."""
    torch.manual_seed(0)
    model = NormThenNVFP4(keep_norm=True)
    x, residual = inputs()
    with torch.no_grad():
        expected = model(x, residual)
    config = arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch")
    with torch.no_grad():
        actual = torch.compile(model, options=arfusion.inductor_options(config))(x, residual)
    assert arfusion.stats()["by_pattern"] == {"allreduce_add_rmsnorm_nvfp4_with_norm_out": 1}
    names = ("packed", "block scales", "residual sum", "norm")
    for a, e, name in zip(actual, expected, names):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e), name
