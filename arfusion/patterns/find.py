"""Everything the patterns say about one all-reduce, in one value: the site it feeds (or why
none), and the MoE top-k combine producing its input (or why none). What to do with it is
`policy`'s to decide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..decisions import Reason, Why
from .classify import NoSite, Site, find_site
from .moe_combine import Combine
from .moe_combine import find as find_combine
from .region import all_reduce_sum_start, grow, hinted_shape
from .scaled import scaled_all_reduce


@dataclass(frozen=True)
class Found:
    """One all-reduce's site (or `no_site`: why none), and, where the site's input is an MoE
    top-k combine, that combine (or `no_combine`: why not; only looked for when asked)."""

    all_reduce: torch.fx.Node
    site: Site | None = None
    no_site: NoSite | None = None
    combine: Combine | None = None
    no_combine: str = ""


def _not_simply_summed(all_reduce: torch.fx.Node) -> Reason:
    op = all_reduce.args[1]
    if op != "sum":
        return Reason(Why.NOT_SUM, f"a {op} all-reduce")
    return Reason(Why.NOT_AWAITED, "its result is not simply awaited")


def summed_start(all_reduce: torch.fx.Node) -> torch.fx.Node | Reason:
    """The wait of a sum all-reduce read only through it, or why it is not one."""
    return all_reduce_sum_start(all_reduce) or _not_simply_summed(all_reduce)


def find(all_reduce: torch.fx.Node, order: dict[torch.fx.Node, int], quant_forms: tuple[str, ...],
         combines: bool = True) -> Found:
    """The site `all_reduce` feeds. Where its value is scaled by a number first (f * AR(x)), the
    product's region is tried first: where that is a site, the op takes f."""
    start = summed_start(all_reduce)
    if isinstance(start, Reason):
        return Found(all_reduce, no_site=NoSite(start))
    shape = hinted_shape(start)
    if shape is not None and math.prod(shape[:-1]) == 0:
        # A graph traced with zero tokens (an empty batch; Dynamo specialises size 0, so it is
        # never symbolic): the region walk finds token dims by divisibility, which 0 cannot give.
        return Found(all_reduce, no_site=NoSite(Reason(Why.ZERO_TOKENS, "zero tokens (an empty batch): nothing to fuse")))
    scaled = scaled_all_reduce(start)
    as_product = find_site(grow(start, order, scaled), quant_forms) if scaled is not None else None
    found = as_product if isinstance(as_product, Site) else find_site(grow(start, order), quant_forms)
    if isinstance(found, NoSite):
        if found.scaled and as_product is not None:
            # The product's site is the one the model computes: why that failed says more (HRM's
            # scaled embedding is also read by a later add) than "it is scaled".
            found = NoSite(as_product.reason.but("scaled all-reduce (f * AR(x))"))
        return Found(all_reduce, no_site=found)
    if not combines or isinstance(found.region.input_scale, torch.fx.Node):
        return Found(all_reduce, site=found)  # the MoE op takes numbers only as factors
    combine = find_combine(found)
    if isinstance(combine, str):
        return Found(all_reduce, site=found, no_combine=combine)
    return Found(all_reduce, site=found, combine=combine)
