"""An all-reduce scaled by a number: f * AR(x) = AR(f * x) where f is the same on every rank.

Granite's residual and embedding multipliers, MiniCPM's depth scale, Gemma's embedding normaliser
(a 0-d buffer): `scaled_all_reduce` finds the product, and the site starting at it hands f to the
fused op, so a site left unfused keeps the graph as it was. (AR(a) + b) * f, with b not all-reduced
(Granite-4's MoE layers), is first distributed (`distribute_a_factor`, called by `collectives.merge`),
so that the all-reduce is scaled alone.
"""

from __future__ import annotations

import math

import torch

from ..graph_utils import Builder, same_shape, value
from .reduced import REGROUPINGS, into_residual_stream, reduced_source
from .region import CONVERT, by_a_number, is_add

aten = torch.ops.aten


def scaled_all_reduce(wait: torch.fx.Node) -> tuple[torch.fx.Node, float | torch.fx.Node,
                                                    list[torch.fx.Node]] | None:
    """`wait(all_reduce(x)) [regroupings] * f` with f a number other than 1 (Granite's residual and
    embedding multipliers, MiniCPM's depth scale) or a 0-d floating tensor (`_by_a_factor`) whose
    product goes into the residual stream (Gemma's embedding normaliser, a buffer), the wait and
    regroupings each read only by the next (the product may be read anywhere): (the product, f,
    the nodes from the wait to it). f * AR(x) = AR(f * x) where f is the same on every rank: a
    number is a constant of the traced program; a tensor is, for the reason a gate is in
    `collectives._merge_sum_of_two` (the residual stream and AR(x) are the same on every rank).
    The site then starts at the product, and the op takes x and f (`input_scale`, or
    `input_scale_tensor`), scaling x only where its kernel runs (docs/patterns.md)."""
    chain, node = [wait], wait
    while len(node.users) == 1:
        (user,) = node.users
        if user.target in REGROUPINGS:
            chain.append(user)
            node = user
            continue
        scaled = _by_a_factor(user)
        if scaled is None or scaled[0] is not node:
            return None
        factor = scaled[1]
        if isinstance(factor, torch.fx.Node):
            if not into_residual_stream(user):
                return None
            factor = _before_opmath_cast(factor, value(user).dtype)
        return user, factor, [*chain, user]
    return None


def _before_opmath_cast(factor: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    """The fp64 0-d tensor under `factor = factor64.to(float32)` (what dynamic=True makes of a float
    attribute) where the product's dtype computes in fp32 anyway (bf16, fp16, fp32): a 0-d factor
    enters the multiply cast to that compute type, so the op gets the same product from the
    fp64 input, and the cast, a CPU kernel once it feeds the op (H100: 77 s of C++ compile on
    the first call), goes with the site."""
    source = factor.args[0] if factor.target is CONVERT and factor.args[1] == torch.float32 else None
    if source is not None and isinstance(source, torch.fx.Node) and value(source).dtype == torch.float64 \
            and value(source).dim() == 0 and dtype in (torch.bfloat16, torch.float16, torch.float32):
        return source
    return factor


def _by_a_factor(node: torch.fx.Node) -> tuple[torch.fx.Node, float | torch.fx.Node] | None:
    """(t, f) if `node` is `t * f`, f a finite number other than 1 or a 0-d floating tensor (a model's
    float attribute under dynamic=True becomes one), the product of t's shape and dtype."""
    scaled = by_a_number(node)
    if scaled is not None:
        if scaled[1] == 1 or not math.isfinite(scaled[1]):
            return None
        scaled = scaled[0], float(scaled[1])
    else:
        scaled = _by_a_scalar_tensor(node)
    if scaled is None or not same_shape(scaled[0], node) or value(scaled[0]).dtype != value(node).dtype:
        return None
    return scaled


def _by_a_scalar_tensor(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(t, s) if `node` is `t * s` (either order) with s a 0-d floating tensor, else None. A 0-d
    tensor does not promote t (`_by_a_factor` checks the product's dtype): it multiplies as a number
    does, in t's compute type (an fp32 0-d factor is what dynamic=True makes of a float attribute)."""
    if node.target is not aten.mul.Tensor or node.kwargs or len(node.args) != 2 \
            or not all(isinstance(a, torch.fx.Node) for a in node.args):
        return None
    for t, s in (node.args, reversed(node.args)):
        scalar, tensor = value(s), value(t)
        if isinstance(scalar, torch.Tensor) and isinstance(tensor, torch.Tensor) and scalar.dim() == 0 \
                and tensor.dim() > 0 and scalar.dtype.is_floating_point:
            return t, s
    return None


def distribute_a_factor(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """(AR(a) [regroupings] + b) [regroupings] * f -> (AR(a) [regroupings] * f + b * f) [regroupings],
    f a number other than 1 or a 0-d tensor, b not all-reduced (Granite-4's MoE layers: `residual + (moe +
    shared_mlp(h)).view(B, S, H) * residual_multiplier`, the shared MLP replicated): the all-reduce
    is then scaled alone, a site that takes f (`scaled_all_reduce`), and b * f one more term of
    its residual."""
    scaled = _by_a_factor(node)
    # A tensor factor must be the same on every rank where it is taken: judged on the product as
    # the model wrote it (`scaled_all_reduce`'s rule), not on the split sum made here.
    if scaled is None or (isinstance(scaled[1], torch.fx.Node) and not into_residual_stream(node)):
        return False
    total, factor = scaled
    while total.target in REGROUPINGS and len(total.users) == 1:
        total = total.args[0]
    if not is_add(total) or len(total.users) != 1 or value(total).dtype != value(node).dtype \
            or value(total).numel() != value(node).numel():
        return False
    for i, reduced in enumerate(total.args):
        other = total.args[1 - i]
        if reduced_source(reduced) is None or reduced_source(other) is not None \
                or not same_shape(other, total) or value(other).dtype != value(total).dtype:
            continue
        build = Builder(graph, total)
        terms = [build.call(aten.mul.Tensor, t, factor) for t in total.args]
        split = build.call(aten.add.Tensor, *terms)
        total.replace_all_uses_with(split)
        node.replace_all_uses_with(split if scaled[0] is total else scaled[0])  # drop the old product
        graph.erase_node(node)
        graph.erase_node(total)
        return True
    return False
