"""Running a region's nodes on probe tensors, to see what they compute.

Two modes:
- exact: every floating value is float64 and casts between floating types do nothing, so the
  result is the spelling's mathematics without rounding (FP8 casts included);
- real: the graph's own dtypes, on CPU, so the result carries the spelling's roundings.

The probe has its own number of rows: each size argument that carries the tokens is rescaled
(`region.probe_shape`), which keeps every dim index valid. Everything runs on CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from .region import CONSTANT_PRODUCERS, SIZED_SHAPE_OPS, hint, hinted_shape, probe_shape

aten, prims = torch.ops.aten, torch.ops.prims


class ProbeError(Exception):
    """The nodes cannot be run on a probe (a bitcast in exact mode, an unknown value)."""


def _exact_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype.is_floating_point else dtype


def _map(value: Any, env: dict, exact: bool) -> Any:
    if isinstance(value, torch.fx.Node):
        if value in env:
            return env[value]
        val = value.meta.get("val")
        if isinstance(val, (int, torch.SymInt)):
            return hint(val)
        raise ProbeError(f"no probe value for {value.name}")
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, env, exact) for v in value)
    if isinstance(value, torch.dtype) and exact:
        return _exact_dtype(value)
    if isinstance(value, torch.device):
        return torch.device("cpu")
    return value


def evaluate(nodes: list[torch.fx.Node], inputs: dict[torch.fx.Node, Any], *, exact: bool,
             tokens: int, rows: int) -> dict[torch.fx.Node, Any]:
    """Values of `nodes` (in order) given the probe `inputs`; raises ProbeError."""
    env = dict(inputs)
    for node in nodes:
        args = list(_map(node.args, env, exact))
        kwargs = _map(node.kwargs, env, exact)
        target = node.target
        if target in SIZED_SHAPE_OPS:
            size = probe_shape(hinted_shape(node), tokens, rows)
            if size is None:
                raise ProbeError(f"{node.name}: cannot rescale {hinted_shape(node)} to {rows} rows")
            args[1] = list(size)
        elif target in CONSTANT_PRODUCERS and len(hinted_shape(node)) >= 2:
            # A constant fill has the same value everywhere: rescaling a broadcastable [1, H]
            # is harmless, so any constant of rank >= 2 follows the rows.
            args[0] = list(probe_shape(hinted_shape(node), tokens, rows) or hinted_shape(node))
        if exact and target is aten.view.dtype:
            raise ProbeError(f"{node.name}: a bitcast has no exact value")
        if exact and target is prims.convert_element_type.default:
            env[node] = args[0].to(_exact_dtype(args[1]))
            continue
        try:
            env[node] = target(*args, **kwargs)
        except Exception as e:  # a shape the rescaling broke, an op CPU lacks for this dtype
            raise ProbeError(f"{node.name} ({target}): {type(e).__name__}: {e}") from e
    return env
