"""Quant tails that agree with a quant form on ordinary rows and act differently elsewhere.

A floor on a per-token scale above the kernels' (torchao's `activation_value_lb`), an upper bound
on it (`activation_value_ub`, fbgemm's 1200 for Llama-3.1-405B-FP8), a clamp on a static scale:
each is the identity on the probe's ordinary rows at its one scale, and the fused op would drop it.
The quant then stays outside the op (the norm still fuses), said at INFO with `quant_bounded`.
Graphs against the fake process group, compared with eager (tests/sites.py).
"""

from __future__ import annotations

import logging

import pytest
import torch

import arfusion.stats
from arfusion.decisions import Fate, Why

from .sites import FMAX, FP8, NORMS, Site, assert_matches_eager, run


def _per_token(y, amax_lb=None, amax_ub=None, scale_lb=None, scale_ub=None):
    """torchao's `_choose_scale_float8` per row (its hp_value_lb / hp_value_ub), then a bound on the scale."""
    amax = y.float().abs().amax(-1, keepdim=True)
    if amax_lb is not None or amax_ub is not None:
        amax = torch.clamp(amax, min=amax_lb, max=amax_ub)
    scale = amax / FMAX
    if scale_lb is not None or scale_ub is not None:
        scale = torch.clamp(scale, min=scale_lb, max=scale_ub)
    return (y.float() / scale).clamp(-FMAX, FMAX).to(FP8), scale


def _static_scale_capped(self, y):
    return ((y / self.scale.clamp(max=0.01)).clamp(-FMAX, FMAX).to(FP8),)


BOUNDED = {
    # name: (quant spelling, norm weight factor, one weight element set to): the bound acts on these inputs
    "amax_floor_1": (lambda self, y: _per_token(y, amax_lb=1.0), 0.01, None),
    "scale_floor_1e-4": (lambda self, y: _per_token(y, amax_lb=1e-12, scale_lb=1e-4), 0.01, None),
    "amax_ceiling_1200": (lambda self, y: _per_token(y, amax_lb=1e-12, amax_ub=1200.0), 1.0, 3000.0),
    "scale_ceiling": (lambda self, y: _per_token(y, amax_lb=1e-12, scale_ub=1200.0 / FMAX), 1.0, 3000.0),
    "static_scale_capped": (_static_scale_capped, 1.0, None),
}


@pytest.mark.parametrize("name", list(BOUNDED))
def test_a_bound_the_kernel_lacks_keeps_the_quant_outside(fake_pg, caplog, name):
    quantize, factor, massive = BOUNDED[name]
    site = Site(NORMS["hf_llama"][0], quant=quantize)
    with torch.no_grad():
        site.weight.mul_(factor)
        if massive is not None:
            site.weight[7] = massive  # a massive activation channel
    with caplog.at_level(logging.INFO, logger="arfusion"):
        fused, left, actual, expected, _ = run(site)
    assert left == 0 and len(fused) == 1 and fused[0]["quant"] == "none", fused
    assert_matches_eager(actual, expected)
    assert Why.QUANT_BOUNDED.value in caplog.text
    last = arfusion.stats.decisions()[-1]  # the site's decision says it too, by code
    decision = last["decision"]
    assert decision.fate is Fate.FUSED and decision.quant_outside.code is Why.QUANT_BOUNDED, last
    assert last["quant_outside_code"] == Why.QUANT_BOUNDED.value and str(decision.quant_outside) in last["detail"]


@pytest.mark.parametrize("amax_lb", [1e-12, 1 / 512])
def test_a_floor_at_or_below_the_kernels_still_fuses(fake_pg, amax_lb):
    site = Site(NORMS["hf_llama"][0], quant=lambda self, y: _per_token(y, amax_lb=amax_lb))
    fused, left, actual, expected, _ = run(site)
    assert left == 0 and fused[0]["quant"] == "fp8_dynamic"
    assert_matches_eager(actual, expected)


@pytest.mark.parametrize("limit", [420.0, 416.0])
def test_a_clamp_one_step_below_the_fp8_max_is_no_fp8_cast(fake_pg, limit):
    """Its saturated codes are one FP8 step below the type's max (416, not 448): within the step the
    rule allows a rounded scale, but on every saturated element, not a rare one."""
    def clamped(self, y):
        return ((y / self.scale).clamp(-limit, limit).to(FP8),)

    site = Site(NORMS["hf_llama"][0], quant=clamped)
    site.scale.fill_(0.004)  # the clamp acts on these inputs
    fused, left, actual, expected, _ = run(site)
    assert left == 0 and fused[0]["quant"] == "none"
    assert_matches_eager(actual, expected)
    assert actual[0].float().abs().max() == 416
