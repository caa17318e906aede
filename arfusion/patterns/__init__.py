"""Finding sites by what they compute.

`region.grow` takes the row-local region an all-reduce's result feeds; `classify.find_site`
decides, by evaluating that region on probes against the reference forms of `forms`, whether
it is all_reduce -> [residual add] -> RMSNorm -> [quant] and with which inputs; `rewrite`
replaces it by the fused op (with `moe_combine`, also the MoE top-k combine that produces the
all-reduce's input, when there is one). Before that, `collectives.merge` turns sums of all-reduces into
all-reduces of sums (MoE blocks), and `scaled` finds all-reduces scaled by a number (f * AR(x)), whose
site hands f to the op. docs/patterns.md explains the design and the acceptance rule.
"""

from .classify import Match, NoSite, clear_memo, find_site
from .collectives import merge as merge_collectives
from .moe_combine import Combine, feeds_combine
from .moe_combine import find as find_moe_combine
from .region import all_reduce_sum_start, grow
from .rewrite import op_site, rewrite, scaled_sites
from .scaled import scaled_all_reduce

__all__ = ["NoSite", "Match", "find_site", "clear_memo", "all_reduce_sum_start", "grow", "op_site", "rewrite",
           "scaled_sites", "merge_collectives", "scaled_all_reduce", "Combine", "find_moe_combine", "feeds_combine"]
