"""Small FX graph helpers the pass needs before and after matching."""

from __future__ import annotations

import operator

import torch

from . import ops  # noqa: F401  (registers torch.ops.arfusion.*, used below)

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
# What torch's SequenceParallel turns a row-parallel all-reduce into: a reduce-scatter (then an
# all-gather before the next matmul; plain TP all-gathers too, for lm_head, so that one says nothing).
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def collective_group(node: torch.fx.Node) -> str | None:
    """The group name of a functional collective (all_reduce, all_gather, reduce_scatter,
    all_to_all: the name is their last argument), else None."""
    target = node.target
    if node.op != "call_function" or target is WAIT or getattr(target, "namespace", None) != "_c10d_functional":
        return None
    name = node.kwargs.get("group_name", node.args[-1] if node.args else None)
    return name if isinstance(name, str) else None


def has_fp8_casts(graph: torch.fx.Graph) -> bool:
    convert = torch.ops.prims.convert_element_type.default
    return any(n.target is convert and n.args[1] in FP8_DTYPES for n in graph.nodes)


def _pure(node: torch.fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace in ("aten", "prims")
            and torch.Tag.nondeterministic_seeded not in target.tags
            and not target._schema.is_mutable
            and any(isinstance(a, torch.fx.Node) for a in node.args))


def dedupe_pure_nodes(graph: torch.fx.Graph) -> int:
    """Common-subexpression elimination over deterministic aten/prims ops (collectives and
    random ops excluded). Returns how many nodes were merged."""
    seen: dict[tuple, torch.fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if not _pure(node):
            continue
        key = (node.target, _hashable(node.args), _hashable(node.kwargs))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
            merged += 1
        else:
            seen[key] = node
    return merged


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_hashable(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def move_all_reduce_to_current_stream(graph: torch.fx.Graph, all_reduce: torch.fx.Node) -> bool:
    """Replace `wait_tensor(all_reduce(x, "sum", group))` by arfusion's in-place all-reduce on
    the caller's stream, wrapped as a functional op: Inductor's re-inplacing pass (after the
    custom passes) reduces `x` in place where nothing else reads it, and copies it otherwise."""
    waits = list(all_reduce.users)
    x, op, group_name = all_reduce.args[:3]
    if op != "sum" or not waits or any(w.target is not WAIT for w in waits):
        return False
    reduced_val = all_reduce.meta.get("val")
    with graph.inserting_before(all_reduce):
        functional = graph.call_function(torch.ops.higher_order.auto_functionalized,
                                         (torch.ops.arfusion.all_reduce_.default,),
                                         {"x": x, "group_name": group_name})
        reduced = graph.call_function(operator.getitem, (functional, 1))  # (op's None, new x)
    functional.meta["val"] = (None, reduced_val)
    reduced.meta["val"] = reduced_val
    for w in waits:
        w.replace_all_uses_with(reduced)
        graph.erase_node(w)
    graph.erase_node(all_reduce)
    return True


def put_on_fast_path(graph: torch.fx.Graph, all_reduce: torch.fx.Node, backend: str, max_bytes: int,
                     site_key: str) -> bool:
    """Replace `wait_tensor(all_reduce(x, "sum", group))` by arfusion's fast all-reduce op
    (`arfusion::all_reduce`, functional: the backend's one-shot kernel writes a new tensor)."""
    waits = list(all_reduce.users)
    x, op, group_name = all_reduce.args[:3]
    if op != "sum" or not waits or any(w.target is not WAIT for w in waits):
        return False
    with graph.inserting_before(all_reduce):
        fast = graph.call_function(torch.ops.arfusion.all_reduce.default, (),
                                   {"x": x, "group_name": group_name, "backend": backend, "max_bytes": max_bytes,
                                    "site_key": site_key})
    fast.meta["val"] = all_reduce.meta.get("val")
    for w in waits:
        w.replace_all_uses_with(fast)
        graph.erase_node(w)
    graph.erase_node(all_reduce)
    return True


def snapshot(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of the graph (node metadata copied one level deep), for `restore`."""
    copy = torch.fx.Graph()
    result, output = copy.graph_copy(graph, {}, return_output_node=True)
    copy.output(result).meta = dict(output.meta)
    return copy


def restore(graph: torch.fx.Graph, saved: torch.fx.Graph) -> None:
    """Puts `saved` (a `snapshot` of this graph) back in place, keeping the graph's own inputs:
    Inductor lowers the graph object it handed to the pass, so its contents are replaced."""
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    saved_inputs = [n for n in saved.nodes if n.op == "placeholder"]
    if [n.target for n in inputs] != [n.target for n in saved_inputs]:
        raise RuntimeError("arfusion: the graph's inputs changed; it cannot be restored")
    body = [n for n in graph.nodes if n.op != "placeholder"]
    for node in body:  # unlink first: a failed rewrite may have left nodes in any order
        node.args, node.kwargs = (), {}
    for node in reversed(body):
        graph.erase_node(node)
    result, output = graph.graph_copy(saved, dict(zip(saved_inputs, inputs)), return_output_node=True)
    graph.output(result).meta = dict(output.meta)
