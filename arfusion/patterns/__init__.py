"""Finding sites by what they compute. Patterns read graphs; they never edit a site (`edits`
does) nor decide what to do with one (`policy` does).

`find.find` is the entry point: for one all-reduce, `region.grow` takes the row-local region its
result feeds; `classify.find_site` decides, by evaluating that region on probes against the
reference forms of `forms`, whether it is all_reduce -> [residual add] -> RMSNorm -> [quant] and
with which inputs (a `Site`), or why not (a `NoSite` with a coded reason); `moe_combine.find`
finds the MoE top-k combine producing the all-reduce's input. Before that, `collectives.merge`
turns sums of all-reduces into all-reduces of sums (MoE blocks), and `scaled` finds all-reduces
scaled by a number (f * AR(x)), whose site hands f to the op. docs/patterns.md explains the
design and the acceptance rule.
"""

from .classify import NoSite, Site, clear_memo
from .collectives import merge as merge_collectives
from .find import Found, find, summed_start
from .moe_combine import Combine, feeds_combine

__all__ = ["NoSite", "Site", "Found", "find", "summed_start", "clear_memo", "merge_collectives", "Combine",
           "feeds_combine"]
