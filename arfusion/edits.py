"""Every edit the pass makes to a graph, each carrying out a `policy` choice: the fused op where
a site was (`fuse`), the fast all-reduce (`to_fast_path`), NCCL on the caller's stream
(`to_callers_stream`).

The fused op reads the all-reduce's input (reshaped to the norm output's shape when the graph
regrouped tokens in between), the residual, weight, eps and quant scale roots, and each of the
site's outputs read from outside is rerouted to the op's matching output, reshaped back to the
shape the graph had there. The site's own nodes are removed. Where the all-reduce was the only
reader of its input (`graph_utils.sole_reader`: a matmul's output, as a rule) and the site adds a
residual (else the op's first output is the sum itself), the op is the one that may overwrite it
(`arfusion::fused_allreduce_rmsnorm_`), wrapped in auto_functionalized: Inductor's re-inplacing
pass then hands it the input's own memory, as it does its own all-reduce.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.pattern_matcher import stable_topological_sort

from . import ops  # noqa: F401  (registers torch.ops.arfusion.*, read below)
from .decisions import Reason, Why
from .graph_utils import WAIT, Builder, sole_reader, value
from .patterns import Combine, Site

aten = torch.ops.aten
FUSED_OP = torch.ops.arfusion.fused_allreduce_rmsnorm.default
FUSED_OP_ON_X = torch.ops.arfusion.fused_allreduce_rmsnorm_.default  # may overwrite x
MOE_OP = torch.ops.arfusion.moe_combine_allreduce_rmsnorm.default
FAST_OP = torch.ops.arfusion.all_reduce.default
SYMBOLIC = Reason(Why.SYMBOLIC_SHAPE, "a symbolic shape between the all-reduce and the norm cannot be expressed")


def scaled_sites(graph: torch.fx.Graph) -> int:
    """Fused ops in `graph` that take an input scale (f * AR(x) sites)."""
    def scaled(node):
        return node.kwargs.get("input_scale", 1.0) != 1.0 or node.kwargs.get("input_scale_tensor") is not None

    return sum(1 for n, _ in fused_calls(graph) if scaled(n))


def fused_calls(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, object]]:
    """The fused ops in `graph`, as (node, op); a node of the op that may overwrite x is its
    auto_functionalized call (the op's arguments in its kwargs, as the others')."""
    found = []
    for n in graph.nodes:
        op = n.args[0] if n.target is torch.ops.higher_order.auto_functionalized and n.args else n.target
        if op in (FUSED_OP, FUSED_OP_ON_X, MOE_OP):
            found.append((n, op))
    return found


def _scale_args(region) -> dict:
    """The plain op's input_scale / input_scale_tensor for `region`; none if unscaled."""
    if isinstance(region.input_scale, torch.fx.Node):
        return {"input_scale_tensor": region.input_scale}
    return {"input_scale": region.input_scale} if region.input_scale != 1.0 else {}


def fuse(graph: torch.fx.Graph, site: Site, op_args: dict, op_key: str, combine: Combine | None = None) -> Reason | None:
    """Replace `site` by the fused op, called with `op_args` (the backend, its caps and the
    quantized all-reduce: `policy.FusedOp.args`) and `op_key`; None when done, else why not
    (the graph then unchanged). With `combine` (the MoE top-k combine producing the all-reduce
    input) the MoE op takes its rows, weights and index instead, and the combine's nodes go too."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    region = site.region
    # Before the reshape below reads x. Without a residual the op's first output is the sum itself.
    on_x = combine is None and bool(site.residuals) and sole_reader(region.x, region.all_reduce)
    anchor = min((n for n, _ in site.exits), key=order.__getitem__)
    build = Builder(graph, anchor)
    norm_out = site.norm_out
    sources = [region.x, *site.residuals, norm_out, *([combine.nodes[-1]] if combine is not None else [])]
    # The MoE op works on the combine's [T, H]; the plain op on the norm's shape.
    like = combine.nodes[-1] if combine is not None else norm_out
    x = build.reshape(region.x, norm_out, sources) if combine is None else region.x
    terms = [build.reshape(r, like, sources) for r in site.residuals]
    if x is None or None in terms:
        build.undo()
        return SYMBOLIC
    residual = None
    for term in terms:  # several terms (an MoE shared expert's output): summed before the op
        residual = term if residual is None else build.call(aten.add.Tensor, residual, term)
    scale = site.quant_scale
    if scale is not None and site.scale_inverted:
        scale = build.call(aten.reciprocal.default, scale)
    tail = dict(residual=residual, weight=site.weight, eps=site.eps, eps_tensor=site.eps_input,
                group_name=region.group_name, norm=site.norm, quant=site.quant, quant_scale=scale,
                emit_norm=site.emit_norm, op_key=op_key, **op_args)
    if combine is None:
        # f * AR(x) (region.input_scale): the op gets x and f, so the graph's product goes too.
        if on_x:
            fused = build.call(torch.ops.higher_order.auto_functionalized, FUSED_OP_ON_X, x=x, **tail,
                               **_scale_args(region))
        else:
            fused = build.call(FUSED_OP, x=x, **tail, **_scale_args(region))
    else:
        shared = None if combine.shared is None else build.reshape(combine.shared, combine.nodes[-1],
                                                                   [*sources, combine.shared])
        if combine.shared is not None and shared is None:
            build.undo()
            return SYMBOLIC
        fused = build.call(MOE_OP, rows=combine.rows, scale=combine.scale, index=combine.index, top_k=combine.top_k,
                           scale_first=combine.scale_first, **tail, shared=shared, routed_scale=combine.routed_scale,
                           input_scale=region.input_scale)
    outputs = site.form.outputs()
    produced = {name: build.call(operator.getitem, fused, i) for i, name in enumerate(outputs)}
    if "scale" in produced:
        produced["inv_scale"] = build.call(aten.reciprocal.default, produced["scale"])
    replacements = []
    for node, role in site.exits:
        new = build.reshape(produced[role], node, [*sources, node])
        if new is None or value(new).dtype != value(node).dtype:
            build.undo()
            return SYMBOLIC if new is None else Reason(
                Why.OUTPUT_DTYPE, f"the op's {role} output is {value(new).dtype}, the graph's {node.name} "
                                  f"{value(node).dtype}")
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
    return None


def _awaited(all_reduce: torch.fx.Node) -> tuple[torch.fx.Node, str, list[torch.fx.Node]] | None:
    """(input, group, waits) of `wait_tensor(all_reduce(x, "sum", group))`, else None."""
    waits = list(all_reduce.users)
    x, op, group_name = all_reduce.args[:3]
    if op != "sum" or not waits or any(w.target is not WAIT for w in waits):
        return None
    return x, group_name, waits


def _replace(graph: torch.fx.Graph, all_reduce: torch.fx.Node, waits: list[torch.fx.Node], new: torch.fx.Node) -> None:
    for w in waits:
        w.replace_all_uses_with(new)
        graph.erase_node(w)
    graph.erase_node(all_reduce)


def to_fast_path(graph: torch.fx.Graph, all_reduce: torch.fx.Node, op_args: dict, op_key: str) -> bool:
    """Replace `wait_tensor(all_reduce(x, "sum", group))` by arfusion's fast all-reduce op
    (`arfusion::all_reduce`, functional: the backend's one-shot kernel writes a new tensor)."""
    found = _awaited(all_reduce)
    if found is None:
        return False
    x, group_name, waits = found
    with graph.inserting_before(all_reduce):
        fast = graph.call_function(FAST_OP, (), {"x": x, "group_name": group_name, "op_key": op_key, **op_args})
    fast.meta["val"] = all_reduce.meta.get("val")
    _replace(graph, all_reduce, waits, fast)
    return True


def to_callers_stream(graph: torch.fx.Graph, all_reduce: torch.fx.Node) -> bool:
    """Replace `wait_tensor(all_reduce(x, "sum", group))` by arfusion's in-place all-reduce on
    the caller's stream, wrapped as a functional op: Inductor's re-inplacing pass (after the
    custom passes) reduces `x` in place where nothing else reads it, and copies it otherwise."""
    found = _awaited(all_reduce)
    if found is None:
        return False
    x, group_name, waits = found
    reduced_val = all_reduce.meta.get("val")
    with graph.inserting_before(all_reduce):
        functional = graph.call_function(torch.ops.higher_order.auto_functionalized,
                                         (torch.ops.arfusion.all_reduce_.default,),
                                         {"x": x, "group_name": group_name})
        reduced = graph.call_function(operator.getitem, (functional, 1))  # (op's None, new x)
    functional.meta["val"] = (None, reduced_val)
    reduced.meta["val"] = reduced_val
    _replace(graph, all_reduce, waits, reduced)
    return True
