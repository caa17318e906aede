"""Fewer all-reduces before sites are found: sums commute with the all-reduce.

MoE blocks all-reduce more than they need to:
- routed and shared experts are all-reduced separately and then added (DeepSeek-V2/V3, GLM-4-MoE,
  dots1, ...): AR(a) + AR(b) = AR(a + b), one collective per layer fewer, and the sum is taken
  in the input dtype before the reduction;
- expert rows are all-reduced before being summed over the experts (Llama-4):
  sum(AR(x), dim) = AR(sum(x, dim)), an all-reduce E times smaller.
Both are linear identities; only where the rounding happens moves. A term may be scaled first,
`AR(a) + f * AR(b)` (Qwen3-Next and Qwen3.5-MoE gate the shared expert with sigmoid(h W_g)):
AR(a + f * b) equals it when f is the same on every rank. The graph does not say which weights are
replicated, but the model does: the sum is added into the residual stream, which every rank of a
working tensor-parallel model holds identically, and AR(a), AR(b) and the residual are identical
on every rank, so f * AR(b) must be too, i.e. f wherever AR(b) is not zero. So a scaled term is
merged only where the sum flows into such an add. An all-reduced value that
Inductor folded into a GEMM's bias slot (`addmm`) is first unfolded into `mm + add`. A number
scaling the sum of an all-reduce and a replicated term, (AR(a) + b) * f (Granite-4's MoE layers),
is distributed, AR(a) * f + b * f, so that the all-reduce is scaled alone (`scaled`). The rewritten
all-reduce is then an ordinary site for `classify`, judged by the usual rule.
Only regroupings of the same elements (reshape/view) may sit between an all-reduce and the sum,
and each all-reduce's result must be read by that sum alone. A lone all-reduce scaled by a number,
f * AR(x) (Granite, MiniCPM), is not rewritten here: `scaled.scaled_all_reduce` finds it and the site
starting at the product hands f to the fused op, so a site left unfused keeps the graph as it was.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graph_utils import WAIT, Builder, same_shape, value
from ..runtime import same_ranks
from .reduced import (MOVES, REGROUPINGS, declined, into_residual_stream, reduced_source, reduced_term,
                      replace_with_all_reduce)
from .region import CONVERT, by_a_number, is_add, widened_sum
from .scaled import distribute_a_factor

aten = torch.ops.aten


def _merge_sum_of_two(graph: torch.fx.Graph, add: torch.fx.Node) -> str | None:
    """add([f *] AR(a), [f *] AR(b)) on one group, or two groups of the same ranks (`same_ranks`)
    -> AR([f *] a + [f *] b); "plain" or "gated" (a term had a factor) where merged, else None.
    The sum of the two upcast and cast back (`region.widened_sum`) is taken the same way per rank
    before the reduction: one rounding to the narrow dtype per rank where the graph rounded after
    each all-reduce and after the sum."""
    if not is_add(add):
        return None
    (back,) = add.users if len(add.users) == 1 else (None,)
    widened = widened_sum(back) if back is not None else None
    operands, result = (widened[1], back) if widened else (list(add.args), add)
    terms = [reduced_term(a) for a in operands]
    if None in terms or terms[0].all_reduce is terms[1].all_reduce:
        return None
    out = value(result)
    if not same_ranks(terms[0].all_reduce.args[2], terms[1].all_reduce.args[2]) \
            or any(value(t.x).dtype != out.dtype or value(t.x).numel() != out.numel() for t in terms):
        return None
    gated = any(t.factor is not None for t in terms)
    if gated and not into_residual_stream(result):
        return None
    build = Builder(graph, add)
    sources = [*(t.x for t in terms), *(t.reduced for t in terms), add]
    parts = []
    for t in terms:
        part = build.reshape(t.x, t.reduced, sources)
        if part is not None and t.factor is not None:
            part = build.call(aten.mul.Tensor, *((t.factor, part) if t.factor_first else (part, t.factor)))
        parts.append(None if part is None else build.reshape(part, add, sources))
    if None in parts:
        build.undo()
        return None
    if widened:
        wide = value(add).dtype
        summed = build.call(CONVERT, build.call(aten.add.Tensor, *(build.call(CONVERT, p, wide) for p in parts)),
                            out.dtype)
        dead = [add, *add.args]
    else:
        summed, dead = build.call(aten.add.Tensor, *parts), []
    dead += [node for t in terms for node in (*t.chain, t.all_reduce)]
    replace_with_all_reduce(graph, result, build, summed, terms[0].all_reduce.args[2], dead)
    return "gated" if gated else "plain"


def _merge_residual_first(graph: torch.fx.Graph, add: torch.fx.Node) -> str | None:
    """(r + AR(a)) + AR(b), either order in either add -> r + AR(a + b) (LongCat-Flash's
    `residual + mlp_out + shortcut_moe_out`): regrouped as r + (AR(a) + AR(b)), merged by
    `_merge_sum_of_two`, or the graph left as it was where that does not merge. Only with r not
    all-reduced, all three of the sum's shape and dtype, and the inner add read by the outer alone.
    The regrouping moves one rounding, as the merge itself does (docs/patterns.md)."""
    if not is_add(add):
        return None
    for i, inner in enumerate(add.args):
        last = add.args[1 - i]
        if not is_add(inner) or list(inner.users) != [add] or reduced_term(last) is None:
            continue
        for j, first in enumerate(inner.args):
            residual = inner.args[1 - j]
            terms = (reduced_term(first), reduced_term(last))
            if terms[0] is None or reduced_term(residual) is not None or terms[0].all_reduce is terms[1].all_reduce \
                    or not same_ranks(terms[0].all_reduce.args[2], terms[1].all_reduce.args[2]):
                continue
            if not all(same_shape(n, add) and value(n).dtype == value(add).dtype for n in (first, last, residual)):
                continue
            inner_args, outer_args = inner.args, add.args
            build = Builder(graph, add)
            pair = build.call(aten.add.Tensor, first, last)
            total = build.call(aten.add.Tensor, residual, pair)
            add.replace_all_uses_with(total)
            graph.erase_node(add)  # before the merge, which erases the terms' chains once unread
            graph.erase_node(inner)
            merged = _merge_sum_of_two(graph, pair)
            if merged is None:  # e.g. a symbolic size the reshape cannot name: as it was, same order
                build = Builder(graph, total)
                outer = list(outer_args)
                outer[i] = build.call(aten.add.Tensor, *inner_args)
                total.replace_all_uses_with(build.call(aten.add.Tensor, *outer))
                graph.erase_node(total)
                graph.erase_node(pair)
            return merged
    return None


def _sum_before_all_reduce(graph: torch.fx.Graph, total: torch.fx.Node) -> bool:
    """sum([f *] AR(x), dims) -> AR(sum([f *] x, dims)): Llama-4's expert rows, and a dense combine
    spelled `(stack(experts) * gates).sum(dim)` once `_cat_before_all_reduce` made the stack one
    all-reduce. A factor f is taken only where the sum goes into the residual stream (the gate
    rule of `_merge_sum_of_two`: f is then the same on every rank)."""
    if total.target is not aten.sum.dim_IntList or not isinstance(total.args[0], torch.fx.Node):
        return False
    term = reduced_term(total.args[0])
    if term is None or (term.factor is not None and not into_residual_stream(total)):
        return False
    build = Builder(graph, total)
    regrouped = build.reshape(term.x, term.reduced, [term.x])
    if regrouped is None:
        build.undo()
        return False
    if term.factor is not None:
        regrouped = build.call(aten.mul.Tensor, *((term.factor, regrouped) if term.factor_first
                                                   else (regrouped, term.factor)))
    summed = build.call(aten.sum.dim_IntList, regrouped, *total.args[1:], **total.kwargs)
    dead = [*term.chain, term.all_reduce]
    # sum(..., dtype=float32) cast straight back: the all-reduce keeps its own dtype.
    (user,) = total.users if len(total.users) == 1 else (None,)
    if user is not None and user.target is CONVERT and user.args[1] == value(term.x).dtype:
        summed = build.call(CONVERT, summed, user.args[1])
        replace_with_all_reduce(graph, user, build, summed, term.all_reduce.args[2], [total, *dead])
    else:
        replace_with_all_reduce(graph, total, build, summed, term.all_reduce.args[2], dead)
    return True


def _cat_before_all_reduce(graph: torch.fx.Graph, cat: torch.fx.Node) -> int:
    """cat([AR(x1), AR(x2), ...], dim) -> AR(cat([x1, x2, ...], dim)) on one group (`torch.stack`
    of the experts' all-reduced outputs, a dense MoE under torch's own TP): the same values, one
    collective instead of one per expert, and the sum over the experts can then move before it.
    How many all-reduces fewer."""
    if cat.target is not aten.cat.default or len(cat.args[0]) < 2 or cat.kwargs:
        return 0
    found = [reduced_source(n) if isinstance(n, torch.fx.Node) else None for n in cat.args[0]]
    if None in found or len({f[0] for f in found}) != len(found) or len({f[0].args[2] for f in found}) != 1 \
            or len({value(n).dtype for n in cat.args[0]} | {value(cat).dtype}) != 1:
        return 0
    build = Builder(graph, cat)
    parts = [build.reshape(x, like, [x, like]) for (_, x, _), like in zip(found, cat.args[0])]
    if None in parts:
        build.undo()
        return 0
    joined = build.call(aten.cat.default, parts, *cat.args[1:])
    dead = [node for all_reduce, _, chain in found for node in (*chain, all_reduce)]
    replace_with_all_reduce(graph, cat, build, joined, found[0][0].args[2], dead)
    return len(found) - 1


def _matmul_before_all_reduce(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """mm/bmm(g, moved(AR(x))) (either side) -> AR(mm/bmm(g, moved(x))), g not all-reduced: the
    combine of a dense MoE spelled as an einsum over the stacked experts. Only there: x is the
    stack (`_cat_before_all_reduce` made it one all-reduce) and g is computed in the graph (the
    router's gates), not a weight, whose shards differ per rank (a column-parallel projection of
    AR(x) must stay after the collective). g must also be the same on every rank, which the gate
    rule decides (the product goes into the residual stream), and the product may not be larger
    than what was all-reduced: the collective moves after the matmul only where that does not
    grow it. And the contraction must run over the stack (`_over_the_stack`): a weight computed in
    the graph (a cast, a dequant) is a column shard too."""
    if node.target not in (aten.mm.default, aten.bmm.default) or node.kwargs:
        return False
    for i, operand in enumerate(node.args):
        found = reduced_source(operand, MOVES)
        if found is None or reduced_source(node.args[1 - i], MOVES) is not None:
            continue
        all_reduce, x, chain = found
        if x.target is not aten.cat.default or value(node).dtype != value(x).dtype \
                or not into_residual_stream(node) or not statically_known_true(value(node).numel() <= value(x).numel()):
            return False
        if _a_graph_input(node.args[1 - i]) or not _over_the_stack(x, node):
            declined(node, all_reduce, "its other operand may be a weight shard, different on each rank (a "
                      "column-parallel projection): only a weighted sum over stacked all-reduces moves")
            return False
        build = Builder(graph, node)
        moved = x
        for step in reversed(chain[:-1]):  # the moves again, from the wait outward, on x
            moved = build.call(step.target, moved, *step.args[1:], **step.kwargs)
        args = list(node.args)
        args[i] = moved
        replace_with_all_reduce(graph, node, build, build.call(node.target, *args), all_reduce.args[2],
                                 [*chain, all_reduce])
        return True
    return False


def _over_the_stack(x: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether mm/bmm `node` contracts over the all-reduces that `x` concatenates, as a weighted
    sum over stacked experts does: a contraction as long as their count, and not as long as their
    last dim. A weight that the graph computes (an fp32 master weight cast, a dequant) contracts
    over the features instead, a column-parallel projection: the collective stays before it."""
    k, n = value(node.args[0]).shape[-1], len(x.args[0])
    return statically_known_true(k == n) and not any(statically_known_true(value(s).shape[-1] == n)
                                                     for s in x.args[0])


def _a_graph_input(node: torch.fx.Node) -> bool:
    """A graph input or attribute (a weight, as the graph holds one) through moves."""
    while node.target in MOVES or node.target is aten.t.default:
        node = node.args[0]
    return node.op in ("placeholder", "get_attr")


def _permute_as_reshape(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """A permute of an all-reduced value (through moves) that only moves size-1 dims, as an einsum
    leaves them around its bmm, becomes the reshape it is (the same elements in the same order),
    so that the site's region, which walks regroupings, reaches the residual add behind it."""
    if node.target is not aten.permute.default:
        return False
    source = node.args[0]
    while source.target in MOVES:
        source = source.args[0]
    shape = value(node.args[0]).shape
    kept = [d for d in node.args[1] if not statically_known_true(shape[d] == 1)]
    if source.target is not WAIT or kept != sorted(kept):
        return False
    build = Builder(graph, node)
    # Sizes as numbers and at most one -1: a sym_size read of the chain would be one more user of it.
    regrouped = build.reshape(node.args[0], node, [])
    if regrouped is None:
        build.undo()
        return False
    node.replace_all_uses_with(regrouped)
    graph.erase_node(node)
    return True


def _drop_zero_add(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """`0 + [f *] AR(x)` -> `[f *] AR(x)`: Python's `sum(experts)`, or `out = 0` before a loop of
    `out = out + gate * expert(x)`, starts the sum with a number zero that would otherwise keep
    the first expert's all-reduce out of the merge (x + 0 is x; only a -0 becomes +0)."""
    if node.target not in (aten.add.Tensor, aten.add.Scalar) or node.kwargs or len(node.args) != 2:
        return False
    for term, zero in (node.args, reversed(node.args)):
        if type(zero) in (int, float) and zero == 0 and isinstance(term, torch.fx.Node) and reduced_term(term) \
                is not None and same_shape(term, node) and value(term).dtype == value(node).dtype:
            node.replace_all_uses_with(term)
            graph.erase_node(node)
            return True
    return False


def _unfold_addmm(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """addmm(AR(x) [* f], a, b) -> AR(x) [* f] + mm(a, b). Inductor folds an MoE block's
    `routed + shared` into the shared expert's GEMM, the all-reduced value (MiniMax-M3: scaled by
    its routed_scaling_factor) in its bias slot; unfolded, the product is one more term of the
    site's residual."""
    if node.target is not aten.addmm.default or node.kwargs or not isinstance(node.args[0], torch.fx.Node):
        return False
    bias = node.args[0]
    while bias.target in REGROUPINGS or by_a_number(bias) is not None:  # MiniMax-M3: AR(routed) * f
        bias = bias.args[0] if bias.target in REGROUPINGS else by_a_number(bias)[0]
    if bias.target is not WAIT or value(node.args[0]).shape != value(node).shape:
        return False
    build = Builder(graph, node)
    product = build.call(aten.mm.default, node.args[1], node.args[2])
    total = build.call(aten.add.Tensor, node.args[0], product)
    node.replace_all_uses_with(total)
    graph.erase_node(node)
    return True


def merge(graph: torch.fx.Graph) -> dict[str, int]:
    """Apply the rewrites until none applies; how many of each."""
    for node in list(graph.nodes):
        _unfold_addmm(graph, node) or _drop_zero_add(graph, node)
    done = {"summed_all_reduces_merged": 0, "gated_all_reduces_merged": 0, "sums_moved_before_all_reduce": 0,
            "concatenated_all_reduces_merged": 0, "matmuls_moved_before_all_reduce": 0, "scaled_sums_distributed": 0}
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node._erased:  # by an earlier rewrite of this sweep
                continue
            if _permute_as_reshape(graph, node):
                changed = True
            elif merged := _merge_sum_of_two(graph, node) or _merge_residual_first(graph, node):
                done["summed_all_reduces_merged"] += 1
                done["gated_all_reduces_merged"] += merged == "gated"
                changed = True
            elif _sum_before_all_reduce(graph, node):
                done["sums_moved_before_all_reduce"] += 1
                changed = True
            elif fewer := _cat_before_all_reduce(graph, node):
                done["concatenated_all_reduces_merged"] += fewer
                changed = True
            elif _matmul_before_all_reduce(graph, node):
                done["matmuls_moved_before_all_reduce"] += 1
                changed = True
    # After the merges: (AR(a) + AR(b)) * f has become AR(a + b) * f, a scaled site as it stands.
    for node in list(graph.nodes):
        done["scaled_sums_distributed"] += distribute_a_factor(graph, node)
    return done
