"""arfusion: fuse all_reduce -> (residual add) -> RMSNorm (-> quant) in torch.compile graphs.

    import arfusion
    arfusion.enable()                       # or: torch.compile(m, options=arfusion.inductor_options())
    model = torch.compile(model)
    print(arfusion.stats())

Nothing is imported until it is used (PEP 562): `import arfusion.core` loads that module alone,
and `arfusion.enable` loads the pass (which registers the ops, torch.ops.arfusion.*). A script
that calls the ops without the pass imports `arfusion.ops`.
"""

import importlib
import importlib.util

# The public names, by the module that defines them.
_EXPORTS = {"PassConfig": "config", "ArFusionPass": "fusion_pass", "enable": "fusion_pass",
            "disable": "fusion_pass", "inductor_options": "fusion_pass", "reset_stats": "stats",
            "__version__": "version"}
# `arfusion.stats` is the counters' module, and callable: `arfusion.stats()` is `stats.stats()`,
# whichever module imported it first (an import binds a submodule's name on its package).

__all__ = ["PassConfig", "ArFusionPass", "enable", "disable", "inductor_options", "stats", "reset_stats",
           "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        found = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        found = importlib.import_module(f".{name}", __name__)  # a submodule, e.g. arfusion.ops
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = found
    return found


def __dir__():
    return sorted({*globals(), *__all__})
