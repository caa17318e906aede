"""Running a region's nodes on probe tensors, to see what they compute.

Two modes:
- exact: every floating value is float64 and casts between floating types do nothing, so the
  result is the spelling's mathematics without rounding (FP8 casts included);
- real: the graph's own dtypes, on CPU, so the result carries the spelling's roundings.

The probe has its own number of rows: each size argument that carries the tokens is rescaled
(`region.probe_shape`), which keeps every dim index valid. Everything runs on CPU.
`Prober` makes the inputs of an encoded region (`encoding.Encoding`) and runs its nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from . import forms
from .encoding import Encoding, activation_sized
from ..graph_utils import value
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


@dataclass
class Probe:
    """Inputs for one evaluation: real-dtype values, and the same values in float64."""

    real: dict[torch.fx.Node, torch.Tensor]
    exact: dict[torch.fx.Node, torch.Tensor]


class Prober:
    """Evaluates an encoded region's nodes on probes: inputs made for its roots by role (the
    all-reduced value, up to `forms.MAX_RESIDUAL_TERMS` residual terms, a weight, scalars), the
    same on every call, so that each answer can be compared with a form's on the same values."""

    def __init__(self, enc: Encoding, device: torch.device):
        self.enc, self.device = enc, device
        region = enc.region
        self.tokens, self.hidden = region.tokens, region.hidden
        self.dtype = value(region.start).dtype
        gen = torch.Generator().manual_seed(forms.PROBE_SEED)
        rows = forms.PROBE_ROWS
        self.reduced64 = forms.probe_activation(rows, self.hidden, self.dtype, gen).double()
        self.terms64 = [forms.probe_activation(rows, self.hidden, self.dtype, gen).double()
                        for _ in range(forms.MAX_RESIDUAL_TERMS)]
        self.weight64 = torch.rand(self.hidden, generator=gen, dtype=torch.float64) * 3 - 1.5
        self.region_size = len(region.nodes) + 1
        self.members = set(enc.nodes[:self.region_size])

    def role_of_root(self, i: int) -> str:
        """What an outside root holds, by its shape: "activation", "vector" (per hidden),
        "scalar" (one element) or "other"."""
        shape = hinted_shape(self.enc.nodes[i])
        numel = math.prod(shape)
        if shape and shape[-1] == self.hidden and activation_sized(shape, self.enc.region):
            return "activation"
        if shape and shape[-1] == self.hidden and numel == self.hidden:
            return "vector"
        return "scalar" if numel == 1 else "other"

    def probe_value(self, values64: torch.Tensor, node: torch.fx.Node, carries_tokens: bool):
        shape = hinted_shape(node)
        if carries_tokens:
            shape = probe_shape(shape, self.tokens, forms.PROBE_ROWS)
            if shape is None:
                raise ProbeError(f"cannot rescale {node.name} to {forms.PROBE_ROWS} rows")
        real = values64.reshape(shape).to(value(node).dtype)
        return real, real.double()

    def inputs(self, residuals: tuple[int, ...], weight: int | None, scalars: dict[int, float]) -> Probe:
        """Probe values for the all-reduced value, the residual terms, the weight and `scalars`."""
        probe = Probe({}, {})
        given = [(0, self.reduced64, True), *((r, t, True) for r, t in zip(residuals, self.terms64)),
                 (weight, self.weight64, False),
                 *((i, torch.tensor(v, dtype=torch.float64), False) for i, v in scalars.items())]
        for i, values64, carries_tokens in given:
            if i is not None:
                node = self.enc.nodes[i]
                probe.real[node], probe.exact[node] = self.probe_value(values64, node, carries_tokens)
        return probe

    def run(self, site_ids, probe: Probe, exact: bool) -> dict:
        """The values of the site's nodes (and their inputs' preparation) on `probe`."""
        nodes = self.enc.evaluation_order(site_ids)
        return evaluate(nodes, probe.exact if exact else probe.real, exact=exact, tokens=self.tokens,
                        rows=forms.PROBE_ROWS)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(forms.PROBE_ROWS, -1)

    def given(self, probe: Probe, i: int | None, exact: bool) -> torch.Tensor | None:
        """The probe value of root `i` (None: no such input), in rows if it carries the tokens."""
        if i is None:
            return None
        t = (probe.exact if exact else probe.real)[self.enc.nodes[i]]
        return self.rows(t) if i == 0 or self.role_of_root(i) == "activation" else t.reshape(-1)
