"""Fused vs uncompiled on real gloo process groups (CPU), for every variant and dtype."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

from .helpers import assert_close, compiled_vs_eager, run_workers  # noqa: F401


# ------------------------------------------------------------------ workers


def _all_spellings(rank, dtype, dynamic):
    from .sites import AllSpellings, inputs

    torch.manual_seed(0)  # same weights on every rank
    model = AllSpellings(dtype)
    torch.manual_seed(100 + rank)  # different activations per rank: the all-reduce matters
    actual, expected, stats = compiled_vs_eager(model, inputs(dtype, tokens=5), dynamic=dynamic)
    assert stats["fused_sites"] == 9 and stats["dispatch"] == {"torch": 9}
    for (res_form, norm), (a_norm, a_sum), (e_norm, e_sum) in zip(model.combos, actual, expected):
        # Norm and residual sum are compared separately: swapped outputs would fail here.
        assert_close(a_norm, e_norm, dtype, f"norm of {res_form}/{norm}")
        assert_close(a_sum, e_sum, dtype, f"residual sum of {res_form}/{norm}")


def _decoder(rank):
    from .models import TinyDecoder

    torch.manual_seed(0)
    model = TinyDecoder(64, layers=2)
    torch.manual_seed(100 + rank)
    actual, expected, stats = compiled_vs_eager(model, (torch.randn(1, 6, 64, dtype=torch.bfloat16),))
    assert stats["fused_sites"] == 5
    assert_close(actual, expected, torch.bfloat16, "decoder output")


def _eps_buffer(rank, dtype, eps_dtype):
    from .models import EpsBufferSite

    torch.manual_seed(0)
    if eps_dtype == dtype:
        model = EpsBufferSite(256).to(dtype)  # the eps buffer becomes a 0-d `dtype` tensor
    else:
        model = EpsBufferSite(256, dtype=dtype)  # made in its dtype, as on GPUs: the buffer stays fp32
    assert model.norm.eps.dtype == eps_dtype and model.norm.weight.dtype == dtype
    torch.manual_seed(100 + rank)
    inputs = (torch.randn(2, 5, 256, dtype=dtype), torch.randn(2, 5, 256, dtype=dtype))
    (a_norm, a_sum), (e_norm, e_sum), stats = compiled_vs_eager(model, inputs)
    assert stats["fused_sites"] == 1 and stats["why_not_codes"] == {}, stats
    assert_close(a_norm, e_norm, dtype, "norm")
    assert_close(a_sum, e_sum, dtype, "residual sum")


def _op_outputs_by_name(rank):
    """Direct op calls: each output is what its name says, on both the fused and fallback path."""
    import arfusion.ops  # noqa: F401  (registers torch.ops.arfusion.*)
    from arfusion import reference
    from arfusion.core import Form

    group = dist.group.WORLD.group_name
    torch.manual_seed(rank)
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    weight = torch.rand(32) + 0.5
    reduced = x.clone()
    dist.all_reduce(reduced)
    for max_bytes, path in ((None, "torch"), (0, "fallback")):
        arfusion.reset_stats()
        for res in (residual, None):
            site = Form(residual=res is not None, norm="rms")
            outs = torch.ops.arfusion.fused_allreduce_rmsnorm(
                x=x, residual=res, weight=weight, eps=1e-6, eps_tensor=None, group_name=group, norm="rms",
                quant="none", quant_scale=None, emit_norm=True, backend="torch", max_bytes=max_bytes)
            h = reduced if res is None else res + reduced
            expected = {"residual": h, "norm": reference.rms_norm(h, weight, 1e-6, "rms")}
            for name, out in zip(site.outputs(), outs):
                assert_close(out, expected[name], torch.float32, f"{name} via {path}")
        assert arfusion.stats()["dispatch"] == {path: 2}


def _dp_by_tp(rank):
    """World of 4 = two TP groups of 2; each site must reduce over its own pair only."""
    from .models import RowParallelThenNorm

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp_group = groups[rank // 2]
    torch.manual_seed(0)
    model = RowParallelThenNorm(32, group=tp_group)
    torch.manual_seed(100 + rank)
    x, residual = torch.randn(1, 4, 32, dtype=torch.bfloat16), torch.randn(1, 4, 32, dtype=torch.bfloat16)
    (a_norm, a_sum), (e_norm, e_sum), stats = compiled_vs_eager(model, (x, residual))
    assert stats["fused_sites"] == 1
    assert_close(a_norm, e_norm, torch.bfloat16, "norm")
    assert_close(a_sum, e_sum, torch.bfloat16, "residual sum")


def _declined_sites_on_callers_stream(rank):
    """Sites declined at compile time, their all-reduce moved to the caller's stream: same
    results as uncompiled, and a graph input that is all-reduced is left as it was."""
    import logging

    import torch.distributed._functional_collectives as funcol
    from torch import nn

    import arfusion
    from .models import LlamaStyleRMSNorm, TinyDecoder

    class ReducesItsInput(nn.Module):  # the all-reduce input is a graph input: must be copied
        def __init__(self):
            super().__init__()
            self.norm = LlamaStyleRMSNorm(32)

        def forward(self, y, residual):
            h = residual + funcol.all_reduce(y, "sum", dist.group.WORLD)
            return self.norm(h), h

    arfusion.policy.current_stream_pays = lambda device: True  # as on CUDA (a spawned process)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("arfusion").addHandler(handler)
    logging.getLogger("arfusion").setLevel(logging.INFO)
    options = arfusion.inductor_options(arfusion.PassConfig(
        enable_allreduce_fusion=True, backend="torch", max_size_mb={2: 0}, fast_all_reduce=False))
    torch.manual_seed(0)
    decoder, direct = TinyDecoder(64, layers=2), ReducesItsInput()
    torch.manual_seed(100 + rank)
    cases = [(decoder, (torch.randn(1, 6, 64, dtype=torch.bfloat16),), False),
             (direct, (torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(4, 32, dtype=torch.bfloat16)), False),
             # dynamic shapes: sizes unknown at compile time, so the op is placed and declines at run time
             (decoder, (torch.randn(1, 9, 64, dtype=torch.bfloat16),), True)]
    for model, inputs, dynamic in cases:
        torch._dynamo.reset()
        before = [t.clone() for t in inputs]
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
            expected = model(*inputs)
            actual = torch.compile(model, options=options, dynamic=dynamic)(*inputs)
        for a, e in zip(*(x if isinstance(x, (list, tuple)) else [x] for x in (actual, expected))):
            assert_close(a, e, torch.bfloat16, f"{type(model).__name__} dynamic={dynamic}")
        assert all(torch.equal(b, t) for b, t in zip(before, inputs)), "an input was modified"
    assert sum("run on the caller's stream" in m for m in messages) == 2, messages
    assert arfusion.stats()["dispatch"] == {"fallback": 5}


def _spellings_by_meaning(rank, dynamic):
    """One model holding sites of many spellings (norms, the MoE view, quants), on real ranks."""
    from torch import nn

    from .sites import NORMS, QUANTS, SCALED, EmbeddingScaled, Site

    # Every spelling once; under dynamic shapes (slower to compile) one of each kind.
    norm_names = list(NORMS) if not dynamic else ["hf_llama", "olmo2_weight_in_fp32", "gemma_one_plus_weight",
                                                  "nanochat_no_weight"]
    quant_names = list(QUANTS) if not dynamic else ["static_divide", "dynamic_engine_fallback", "group_view"]

    class Mix(nn.Module):
        def __init__(self):
            super().__init__()
            norms = [Site(NORMS[name][0], residual=res) for name, res in
                     zip(norm_names, ["first", "last", "none", "moe"] * 4)]
            quants = [Site(NORMS["hf_llama"][0], quant=QUANTS[name][0]) for name in quant_names]
            # Granite's multiplier: f * AR(y), f into the op (the ranks scale before the sum)
            scaled = [Site(NORMS["hf_llama"][0], residual=SCALED[name]) for name in ("granite", "no residual")]
            scaled.append(EmbeddingScaled())  # Gemma: a 0-d bf16 buffer as the factor
            self.sites = nn.ModuleList(norms + quants + scaled)

        def forward(self, x, residual):
            return [out for site in self.sites for out in site(x, residual)]

    torch.manual_seed(0)  # same weights on every rank
    model = Mix()
    torch.manual_seed(100 + rank)  # different activations per rank: the all-reduce matters
    inputs = (torch.randn(2, 5, 256, dtype=torch.bfloat16), torch.randn(2, 5, 256, dtype=torch.bfloat16))
    actual, expected, stats = compiled_vs_eager(model, inputs, dynamic=dynamic)
    assert stats["fused_sites"] == len(model.sites) and not stats["why_not_codes"], stats
    assert stats["scaled_all_reduces_fused"] == 3, stats
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a.dtype == torch.float8_e4m3fn:
            from .sites import assert_fp8_close
            assert_fp8_close(a, e)
        else:
            assert_close(a, e, torch.bfloat16, f"output {i}")


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("dynamic", [False, True])
def test_spellings_by_meaning_match_uncompiled(dynamic):
    run_workers(_spellings_by_meaning, 2, dynamic)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_variant_matches_uncompiled(dtype):
    run_workers(_all_spellings, 2, dtype, False)


def test_dynamic_shapes_match_uncompiled():
    run_workers(_all_spellings, 2, torch.bfloat16, True)


def test_decoder_matches_uncompiled():
    run_workers(_decoder, 2)


@pytest.mark.parametrize("dtype, eps_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                              (torch.bfloat16, torch.float32), (torch.float16, torch.float32)],
                         ids=["bf16", "fp32", "bf16-model-fp32-eps", "fp16-model-fp32-eps"])
def test_an_eps_buffer_fuses_in_its_own_dtype(dtype, eps_dtype):
    """The same verdict as on a GPU, where tests/gpu/check_fast_all_reduce.py fuses this site made
    in bf16 (an fp32 eps buffer, 2026-11-25/26): an eps buffer in the model's dtype (the probe
    compares with the value its dtype holds) or in fp32 in a bf16 or fp16 model is still eps."""
    run_workers(_eps_buffer, 2, dtype, eps_dtype)


def test_op_outputs_land_where_named():
    run_workers(_op_outputs_by_name, 2)


def test_tp_subgroups_inside_a_larger_world():
    run_workers(_dp_by_tp, 4)


def test_declined_sites_all_reduce_on_the_callers_stream():
    run_workers(_declined_sites_on_callers_stream, 2)
