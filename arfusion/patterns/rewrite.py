"""Putting the fused op where a classified site was.

The op reads the all-reduce's input (reshaped to the norm output's shape when the graph
regrouped tokens in between), the residual, weight, eps and quant scale roots, and each of the
site's outputs read from outside is rerouted to the op's matching output, reshaped back to the
shape the graph had there. The site's own nodes are left for dead-code elimination.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import ops  # noqa: F401  (registers torch.ops.arfusion.*, read below)
from ..core import Site
from .classify import Match
from .moe_combine import Combine
from .region import same_shape, value

aten = torch.ops.aten
FUSED_OP = torch.ops.arfusion.fused_allreduce_rmsnorm.default
MOE_OP = torch.ops.arfusion.moe_combine_allreduce_rmsnorm.default


class Builder:
    """Adds nodes before `anchor`, each with the fake value Inductor's later passes read."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node):
        self.graph, self.anchor = graph, anchor
        self.fake_mode = detect_fake_mode([value(anchor)] if isinstance(value(anchor), torch.Tensor) else None)
        self.added: list[torch.fx.Node] = []

    def call(self, target, *args, **kwargs) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        fake_args = torch.fx.map_arg(args, lambda n: n.meta["val"])
        fake_kwargs = torch.fx.map_arg(kwargs, lambda n: n.meta["val"])
        if target is operator.getitem:
            node.meta["val"] = fake_args[0][fake_args[1]]
        else:
            with self.fake_mode:
                node.meta["val"] = target(*fake_args, **fake_kwargs)
        self.added.append(node)
        return node

    def undo(self) -> None:
        """Erase every node this builder added (a rewrite that gave up half-way)."""
        for node in reversed(self.added):
            self.graph.erase_node(node)
        self.added.clear()

    def reshape(self, node: torch.fx.Node, like: torch.fx.Node, sources: list[torch.fx.Node]) -> torch.fx.Node | None:
        """`node` reshaped to `like`'s shape (None if a symbolic size cannot be named)."""
        if same_shape(node, like):
            return node
        sizes = self._sizes(value(like).shape, sources)
        return None if sizes is None else self.call(aten.reshape.default, node, sizes)

    def _sizes(self, shape, sources: list[torch.fx.Node]) -> list[Any] | None:
        """Size arguments for `shape`: ints, -1 for one unknown, sym_size of a source for others."""
        sizes, free = [], True
        for size in shape:
            if not isinstance(size, torch.SymInt):
                sizes.append(int(size))
                continue
            found = next(((src, j) for src in sources for j, s in enumerate(value(src).shape)
                          if statically_known_true(s == size)), None)
            if found is not None:
                sizes.append(self.call(aten.sym_size.int, *found))
            elif free:
                sizes.append(-1)
                free = False
            else:
                return None
        return sizes


def scaled_sites(graph: torch.fx.Graph) -> int:
    """Fused ops in `graph` that take an input scale (f * AR(x) sites)."""
    def scaled(node):
        return node.kwargs.get("input_scale", 1.0) != 1.0 or node.kwargs.get("input_scale_tensor") is not None

    return sum(1 for n in graph.nodes if n.target in (FUSED_OP, MOE_OP) and scaled(n))


def _scale_args(region) -> dict:
    """The plain op's input_scale / input_scale_tensor for `region`; none if unscaled."""
    if isinstance(region.input_scale, torch.fx.Node):
        return {"input_scale_tensor": region.input_scale}
    return {"input_scale": region.input_scale} if region.input_scale != 1.0 else {}


def op_site(site: Match) -> Site:
    """What the matched site computes, as the op and the backends see it."""
    return Site(residual=bool(site.residuals), norm=site.norm, quant=site.quant, emit_norm=site.emit_norm)


def rewrite(graph: torch.fx.Graph, site: Match, backend: str, max_bytes: int, site_key: str,
            combine: Combine | None = None, quantized: tuple[str, int] = ("", -1)) -> bool:
    """Replace `site` by the fused op; False (graph unchanged) if a shape cannot be expressed.
    With `combine` (the MoE top-k combine producing the all-reduce input, `moe_combine.find`)
    the MoE op takes its rows, weights and index instead, and the combine's nodes go too.
    `quantized` is the op's (level, min bytes) of the quantized all-reduce ("": exact)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = min((n for n, _ in site.exits), key=order.__getitem__)
    build = Builder(graph, anchor)
    region = site.region
    norm_out = site.norm_out
    sources = [region.x, *site.residuals, norm_out, *([combine.nodes[-1]] if combine is not None else [])]
    # The MoE op works on the combine's [T, H]; the plain op on the norm's shape.
    like = combine.nodes[-1] if combine is not None else norm_out
    x = build.reshape(region.x, norm_out, sources) if combine is None else region.x
    terms = [build.reshape(r, like, sources) for r in site.residuals]
    if x is None or None in terms:
        build.undo()
        return False
    residual = None
    for term in terms:  # several terms (an MoE shared expert's output): summed before the op
        residual = term if residual is None else build.call(aten.add.Tensor, residual, term)
    scale = site.quant_scale
    if scale is not None and site.scale_inverted:
        scale = build.call(aten.reciprocal.default, scale)
    tail = dict(residual=residual, weight=site.weight, eps=site.eps, eps_tensor=site.eps_input,
                group_name=region.group_name, norm=site.norm, quant=site.quant, quant_scale=scale,
                emit_norm=site.emit_norm, backend=backend, max_bytes=max_bytes, site_key=site_key,
                quantized=quantized[0], quantized_min_bytes=quantized[1])
    if combine is None:
        # f * AR(x) (region.input_scale): the op gets x and f, so the graph's product goes too.
        fused = build.call(FUSED_OP, x=x, **tail, **_scale_args(region))
    else:
        shared = None if combine.shared is None else build.reshape(combine.shared, combine.nodes[-1],
                                                                   [*sources, combine.shared])
        if combine.shared is not None and shared is None:
            build.undo()
            return False
        fused = build.call(MOE_OP, rows=combine.rows, scale=combine.scale, index=combine.index, top_k=combine.top_k,
                           scale_first=combine.scale_first, **tail, shared=shared, routed_scale=combine.routed_scale,
                           input_scale=region.input_scale)
    outputs = op_site(site).outputs()
    produced = {name: build.call(operator.getitem, fused, i) for i, name in enumerate(outputs)}
    if "scale" in produced:
        produced["inv_scale"] = build.call(aten.reciprocal.default, produced["scale"])
    replacements = []
    for node, role in site.exits:
        new = build.reshape(produced[role], node, [*sources, node])
        if new is None or value(new).dtype != value(node).dtype:
            build.undo()
            return False
        replacements.append((node, new))
    for node, new in replacements:
        node.replace_all_uses_with(new, delete_user_cb=lambda user: user not in site.nodes)
    for node in reversed(build.added):
        if not node.users and node is not fused:
            graph.erase_node(node)
    # The site is dead now; DCE would keep wait_tensor (FX counts it as a side effect).
    dead = site.nodes | {region.all_reduce, *region.chain} | set(combine.dead_nodes() if combine is not None else ())
    for node in sorted(dead, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    inputs = [n for n in (*site.residuals, site.weight, site.eps_input, site.quant_scale) if n is not None]
    if any(order[n] > order[anchor] for n in inputs):
        stable_topological_sort(graph)  # an input defined after the site's first output (Gemma's 1 + w)
    return True
