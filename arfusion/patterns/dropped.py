"""What the fused op would drop, on the hidden states before the norm: bounds that act only where
values overflow, and random draws (dropout in training mode). A site with either is not one.
What is random is `region.is_random` and `region.drawn_from_random`; a value drawn at random that
is only added is a residual term like any other.
"""

from __future__ import annotations

import torch

from ..decisions import Reason, Why
from .encoding import Encoding
from .region import is_add

aten = torch.ops.aten
# Ops that may act only on values the probe never reaches: an fp16 overflow guard
# `(r + AR(y)).clamp(-60000, 60000)` is the identity on every probe row, and the fused op would
# drop it. On hidden-state-sized values in a site, they keep it unfused.
BOUNDS = {aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
          aten.clamp_min.Tensor, aten.clamp_max.Tensor, aten.minimum.default, aten.maximum.default,
          aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.nan_to_num.default,
          aten.hardtanh.default}
BOUNDED_REASON = Reason(Why.BOUNDED, "the hidden states are clamped (or bounded by min / max / where) before the "
                                     "norm: such a bound may act only where values overflow, which the fused op "
                                     "would not do")


def random_reason(what: str) -> Reason:
    return Reason(Why.RANDOM, f"the hidden states meet random draws before the norm ({what}: dropout in training "
                              "mode?), which the fused op would drop; model.eval() turns dropout off")


def random_factor(enc: Encoding, ids) -> torch.fx.Node | None:
    """A root drawn at random (`enc.random`) that a node of `ids` other than an add reads."""
    for i in sorted(ids):
        if i == 0 or is_add(enc.nodes[i]):
            continue
        for inp in enc.nodes[i].all_input_nodes:
            root = enc.root_of.get(enc.local.get(inp))
            if root in enc.random:
                return enc.nodes[root]
    return None


def in_site(enc: Encoding, ids) -> Reason | None:
    """Why the site `ids` is not one, where a random draw multiplies its hidden states."""
    drawn = random_factor(enc, ids)
    return None if drawn is None else random_reason(f"{drawn.name}, drawn at random, is not just added")


def in_region(enc: Encoding, region_size: int) -> Reason | None:
    """Why a region with no norm candidate has none, where random draws stopped it: a random op
    reading the all-reduced value (torch's dropout) or a random mask multiplying it (Inductor's)."""
    if enc.region.random:
        return random_reason(f"{', '.join(enc.region.random)} reads the all-reduced value")
    drawn = random_factor(enc, range(region_size))
    return None if drawn is None else random_reason(f"{drawn.name}, drawn at random, multiplies it")
