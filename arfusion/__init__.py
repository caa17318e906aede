"""arfusion: fuse all_reduce -> (residual add) -> RMSNorm (-> quant) in torch.compile graphs.

    import arfusion
    arfusion.enable()                       # or: torch.compile(m, options=arfusion.inductor_options())
    model = torch.compile(model)
    print(arfusion.stats())
"""

from . import ops  # noqa: F401  (registers torch.ops.arfusion.*)
from .config import PassConfig
from .fusion_pass import ArFusionPass, disable, enable, inductor_options
from .stats import reset_stats, stats
from .version import __version__

__all__ = ["PassConfig", "ArFusionPass", "enable", "disable", "inductor_options", "stats",
           "reset_stats", "__version__"]
