"""All-reduced values, as the rewrites before matching see them (`collectives`, `scaled`).

An all-reduced value is `wait(all_reduce(x, "sum", group))`, read through regroupings (ops that
move elements without changing them) by one reader. A term of a sum is such a value, possibly
times a factor. A value goes into the residual stream where it is added to something: every
rank of a working tensor-parallel model holds the residual stream identically, which is what
lets a factor be moved across an all-reduce (`collectives`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..decisions import Why
from ..graph_utils import ALL_REDUCE, WAIT, Builder, same_shape, value
from .region import by_a_number, drawn_from_random

aten = torch.ops.aten
log = logging.getLogger("arfusion")
REGROUPINGS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
# Ops that move elements without changing them (an all-reduce commutes with each), as an einsum leaves them.
MOVES = REGROUPINGS | {aten.permute.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim,
                       aten.clone.default}


def reduced_source(node: torch.fx.Node, between=REGROUPINGS) -> tuple[torch.fx.Node, torch.fx.Node,
                                                                         list[torch.fx.Node]] | None:
    """(all-reduce node, its input, the chain from the sum down to the wait) if `node` is `between`
    ops (regroupings) of `wait(all_reduce(x, "sum", g))` read only along this chain."""
    chain = []
    while node.target in between:
        chain.append(node)
        if len(node.users) != 1:
            return None
        node = node.args[0]
    if node.target is not WAIT or len(node.users) != 1:
        return None
    chain.append(node)
    all_reduce = node.args[0]
    if all_reduce.target is not ALL_REDUCE or all_reduce.args[1] != "sum" or len(all_reduce.users) != 1:
        return None
    return all_reduce, all_reduce.args[0], chain


def replace_with_all_reduce(graph: torch.fx.Graph, old: torch.fx.Node, build: Builder, summed: torch.fx.Node,
                             group_name: str, dead: list[torch.fx.Node]) -> None:
    reduced = build.call(ALL_REDUCE, summed, "sum", group_name)
    waited = build.call(WAIT, reduced)
    old.replace_all_uses_with(waited)
    for node in [old, *dead]:
        if not node.users:
            graph.erase_node(node)


@dataclass
class Term:
    """One all-reduced operand of a sum: `[factor *] regroup(wait(all_reduce(x)))`."""

    all_reduce: torch.fx.Node
    x: torch.fx.Node
    chain: list[torch.fx.Node]  # from the operand down to the wait, erased with the all-reduce
    reduced: torch.fx.Node  # the regrouped all-reduce result (the factor's other operand)
    factor: Any = None
    factor_first: bool = False


def reduced_term(node: torch.fx.Node) -> Term | None:
    found = reduced_source(node)
    if found is not None:
        return Term(*found, reduced=node)
    if node.target is not aten.mul.Tensor or node.kwargs or len(node.args) != 2 or len(node.users) != 1:
        return None
    for i, reduced in enumerate(node.args):
        found = reduced_source(reduced) if isinstance(reduced, torch.fx.Node) else None
        # The factor broadcasts into the reduced value: neither its shape nor its dtype changes.
        if found is not None and same_shape(reduced, node) and value(reduced).dtype == value(node).dtype:
            all_reduce, x, chain = found
            factor = node.args[1 - i]
            if isinstance(factor, torch.fx.Node) and drawn_from_random(factor):
                declined(node, all_reduce, f"its factor {factor.name} is drawn at random (dropout or drop path in "
                                           "training mode), which may differ on each rank")
                return None
            return Term(all_reduce, x, [node, *chain], reduced, factor=factor, factor_first=i == 1)
    return None


def declined(node: torch.fx.Node, all_reduce: torch.fx.Node, why: str) -> None:
    """One INFO line per declined move across an all-reduce (`collectives.merge` sweeps the graph
    until nothing changes)."""
    if not node.meta.get("arfusion_declined"):
        node.meta["arfusion_declined"] = True
        log.info("arfusion: %s not moved before %s (%s): %s", node.name, all_reduce.name, Why.PER_RANK.value, why)


def into_residual_stream(node: torch.fx.Node) -> bool:
    """Whether `node` (through moves and products by a nonzero number) is added to a tensor of
    its own shape: the residual stream. An add that broadcasts (a bias shard after a GEMM, as
    Megatron's `skip_bias_add` leaves it) is not one."""
    for user in node.users:
        scaled = by_a_number(user)
        passes = user.target in MOVES or (scaled is not None and scaled[1] != 0 and math.isfinite(scaled[1]))
        if _full_add(user) or (passes and into_residual_stream(user)):
            return True
    return False


def _full_add(node: torch.fx.Node) -> bool:
    return node.target is aten.add.Tensor and len(node.args) == 2 and all(
        isinstance(a, torch.fx.Node) and same_shape(a, node) for a in node.args)
