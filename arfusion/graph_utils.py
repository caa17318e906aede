"""Small FX graph helpers the pass needs before matching."""

from __future__ import annotations

import torch


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
