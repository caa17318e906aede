"""The MoE top-k combine in front of a site's all-reduce, found by structure and then by value.

HF's grouped experts (transformers integrations/moe.py) end with

    weighted = rows * weights_g.unsqueeze(-1)          # [R, H] expert outputs, expert-sorted
    out = weighted[inv_perm].view(T, K, H).sum(1)      # back to token order, summed over top-k

and `out` is what the experts module all-reduces. FlashInfer's `trtllm_moe_finalize_allreduce_fusion`
computes exactly that combine inside the all-reduce + residual + RMSNorm kernel, reading the
permuted rows, an index [T, K] (token, k) -> row and a scale [T, K]. `find` extracts those from a
classified site: a sum over dim 1 of a [T, K, H] view of a row gather by a 1-D integer index, with
the product by a per-row weight before the gather ([R, 1], scale_first) or after it ([T * K, 1]),
operands in either order, and optionally a cast of the sum back to the rows' dtype: DeepSeek-style
routers keep their weights in fp32, so the product, gather and sum run in fp32 and the result is
rounded once (`.to(hidden_states.dtype)`). Each intermediate must feed only the next one (the
combine disappears from the graph). Then the chain is run on a probe (`forms.MOE_*`): its float64 mathematics must be
the combine's, and with the graph's dtypes `reference.moe_combine` must give the same bits, so the
fused op's reference path reproduces the graph's rounding exactly. A term added to the combine
before the all-reduce (`AR(combine + shared)`, what `collectives.merge` makes of DeepSeek's
`AR(routed) + AR(shared)`) goes into the op too; FlashInfer's kernel adds it the same way
(`shared_expert_output`, after the weighted sum, before the all-reduce). So does a number
multiplying the combine before that add (Laguna's routed scaling factor, `AR(routed * f + shared)`
once merged): the kernel's `routed_scaling_factor`, applied where the graph applies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import reference
from . import forms
from .classify import Site
from .probe import ProbeError, evaluate
from .region import CONVERT as CAST
from ..graph_utils import same_shape, value
from .region import by_a_number, hint, hinted_shape, is_add, reduce_dims, widened_sum

aten = torch.ops.aten
VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
INDEX_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class Combine:
    """What the MoE op reads in place of the all-reduce input."""

    rows: torch.fx.Node  # [R, H] expert outputs, permuted
    scale: torch.fx.Node  # [R, 1] (scale_first) or [T * K, 1]: the routing weights as the graph has them
    index: torch.fx.Node  # 1-D [T * K]: row of (token, k)
    top_k: int
    scale_first: bool
    nodes: tuple[torch.fx.Node, ...]  # the combine's own nodes, graph order, ending in its [T, H] result
    # A term added to the combine before the all-reduce (a shared expert's partial output, once
    # AR(combine) + AR(shared) became AR(combine + shared)), and the views and add that carry it.
    shared: torch.fx.Node | None = None
    tail: tuple[torch.fx.Node, ...] = ()
    routed_scale: float = 1.0  # a number multiplying the combine before `shared` is added

    def dead_nodes(self) -> tuple[torch.fx.Node, ...]:
        """Everything the op replaces, graph order."""
        return (*self.nodes, *self.tail)


def _only_user(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    return list(node.users) == [user]


def _row_weight(a: torch.fx.Node, b: torch.fx.Node, rows_dim: int):
    """(rows, scale) if one of a, b is [N, H] and the other [N, 1], else None."""
    for rows, scale in ((a, b), (b, a)):
        r, s = value(rows), value(scale)
        if not (isinstance(r, torch.Tensor) and isinstance(s, torch.Tensor)):
            continue
        if r.dim() == 2 and s.dim() == 2 and hint(s.shape[1]) == 1 and hint(r.shape[1]) == rows_dim \
                and hint(s.shape[0]) == hint(r.shape[0]):
            return rows, scale
    return None


def _through_views_and_a_number(node: torch.fx.Node, reader: torch.fx.Node) -> tuple[torch.fx.Node, float,
                                                                                    list[torch.fx.Node]]:
    """(the node under `node`'s views and at most one product by a finite number, that number (1.0
    where none), the nodes walked, from `node` down), each walked node read only by the one above
    (`reader` for `node`). Laguna's `AR(routed) * routed_scaling_factor + AR(shared)` is merged into
    `AR(routed * f + shared)`: f scales the combine alone, as FlashInfer's `routed_scaling_factor`."""
    walked, factor = [], 1.0
    while _only_user(node, walked[-1] if walked else reader):
        scaled = by_a_number(node)
        if node.target in VIEWS:
            below = node.args[0]
        elif scaled is not None and factor == 1.0 and math.isfinite(scaled[1]):
            below, factor = scaled[0], float(scaled[1])
        else:
            break
        walked.append(node)
        node = below
    return node, factor, walked


def _addends(x: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node], tuple[torch.fx.Node, ...]] | None:
    """([a, b], the node reading each, the add's own nodes in graph order) for `x = a + b`, or for
    `x = (a.to(wide) + b.to(wide)).to(narrow)` with a, b narrow (HY-V3's fp32 sum of routed and
    shared: the same bits as the narrow add, which computes in fp32 and rounds once)."""
    if is_add(x):
        return list(x.args), [x, x], (x,)
    found = widened_sum(x)
    # The op adds the shared term in the narrow dtype, which computes in fp32 and rounds once:
    # the same bits only where the graph's wide dtype is fp32.
    if found is None or value(found[0]).dtype != torch.float32:
        return None
    add, addends = found
    return addends, list(add.args), (*add.args, add, x)


def _is_combine_sum(node: torch.fx.Node) -> bool:
    """A sum, or a sum cast back (an fp32 combine rounded once): what `find` goes on to check."""
    summed = node.args[0] if node.target is CAST and isinstance(node.args[0], torch.fx.Node) else node
    return summed.target is aten.sum.dim_IntList


def _split_shared(x: torch.fx.Node, all_reduce: torch.fx.Node):
    """(the combine candidate, the term added to it or None, the routed factor, the nodes between
    them and x, the node reading the candidate there). `x = [f *] view(combine) + shared` (either
    order, also summed in fp32 and cast back: `_addends`) with both of x's shape and dtype: a shared
    expert's partial output summed in before the all-reduce; or `x = [f *] view(combine)` alone."""
    found = _addends(x)
    if found is not None:
        addends, readers, add_nodes = found
        for i, candidate in enumerate(addends):
            shared = addends[1 - i]
            node, factor, walked = _through_views_and_a_number(candidate, readers[i])
            if _is_combine_sum(node) and all(same_shape(n, x) and value(n).dtype == value(x).dtype
                                             for n in (candidate, shared)):
                return node, shared, factor, (*reversed(walked), *add_nodes), walked[-1] if walked else readers[i]
    node, factor, walked = _through_views_and_a_number(x, all_reduce)
    if walked and _is_combine_sum(node):
        return node, None, factor, tuple(reversed(walked)), walked[-1]
    return x, None, 1.0, (), None


def feeds_combine(all_reduce: torch.fx.Node) -> bool:
    """Whether `all_reduce` sums what looks like a top-k combine (`find` may still say no)."""
    return _is_combine_sum(_split_shared(all_reduce.args[0], all_reduce)[0])


def find(site: Site) -> Combine | str:
    """The combine feeding `site`'s all-reduce, or why there is none."""
    region = site.region
    total, shared, routed_scale, tail, reader = _split_shared(region.x, region.all_reduce)
    consumer, cast = reader or region.all_reduce, None
    if total.target is CAST and isinstance(total.args[0], torch.fx.Node):  # fp32 combine, rounded once
        if not _only_user(total, consumer):
            return "the combined value is read elsewhere too"
        cast, consumer, total = total, total, total.args[0]
    if total.target is not aten.sum.dim_IntList:
        return "the all-reduce input is not a sum (no top-k combine)"
    if not _only_user(total, consumer):
        return "the combined value is read elsewhere too"
    if total.kwargs.get("dtype") is not None or (len(total.args) > 2 and total.args[2]) or total.kwargs.get("keepdim"):
        return "the sum keeps its dim or changes dtype"
    viewed = total.args[0]
    if not isinstance(viewed, torch.fx.Node) or value(viewed).dim() != 3 or reduce_dims(total) != [1]:
        return "the sum is not over dim 1 of a [T, K, H] tensor"
    tokens, top_k, hidden = hinted_shape(viewed)
    if viewed.target not in VIEWS or not _only_user(viewed, total):
        return "the [T, K, H] tensor is not a view read only by the sum"
    flat = viewed.args[0]
    if not isinstance(flat, torch.fx.Node) or hinted_shape(flat) != (tokens * top_k, hidden) \
            or not _only_user(flat, viewed):
        return "the [T, K, H] view is not of [T * K, H] rows read only by it"
    if flat.target is aten.index.Tensor:  # (rows * scale)[index]
        product, indices = flat.args[0], flat.args[1]
        if product.target is not aten.mul.Tensor or not _only_user(product, flat):
            return "the gathered rows are not a product read only by the gather"
        pair = _row_weight(*product.args[:2], hidden)
        scale_first, gather, chain = True, flat, (product, flat, viewed, total)
    elif flat.target is aten.mul.Tensor:  # rows[index] * scale
        pair = _row_weight(*flat.args[:2], hidden)
        gather = None if pair is None else pair[0]
        if gather is None or gather.target is not aten.index.Tensor or not _only_user(gather, flat):
            return "the weighted rows are not a gather read only by the product"
        pair = (gather.args[0], pair[1])
        indices, scale_first, chain = gather.args[1], False, (gather, flat, viewed, total)
    else:
        return "the [T * K, H] rows are neither a gather nor a product"
    if pair is None:
        return "the product is not rows [N, H] times one weight per row [N, 1]"
    rows, scale = pair
    if not (isinstance(indices, (list, tuple)) and len(indices) == 1 and isinstance(indices[0], torch.fx.Node)):
        return "the gather is not by one index tensor"
    index = indices[0]
    if value(index).dtype not in INDEX_DTYPES or hinted_shape(index) != (tokens * top_k,):
        return "the gather index is not a 1-D integer tensor of T * K entries"
    dtype, scale_dtype = value(rows).dtype, value(scale).dtype
    if not (dtype.is_floating_point and scale_dtype.is_floating_point) \
            or value(total).dtype != torch.promote_types(dtype, scale_dtype) \
            or value(cast if cast is not None else total).dtype != dtype:
        return (f"the combine does not compute in its operands' dtype and return to the rows' (rows {dtype}, "
                f"weights {scale_dtype}, sum {value(total).dtype}"
                + (f", cast to {value(cast).dtype})" if cast is not None else ")"))
    if not scale_first and hinted_shape(scale)[0] != tokens * top_k:
        return "the weights after the gather are not one per (token, k)"
    combine = Combine(rows=rows, scale=scale, index=index, top_k=top_k, scale_first=scale_first,
                      nodes=chain + ((cast,) if cast is not None else ()), shared=shared, tail=tail,
                      routed_scale=routed_scale)
    return _check_on_probe(combine, tokens) or combine


def _probe_inputs(combine: Combine, exact: bool, generator: torch.Generator):
    """Rows and weights in the graph's dtypes (float64 when exact), a random index."""
    tokens, k = forms.MOE_PROBE_TOKENS, combine.top_k
    hidden = hinted_shape(combine.rows)[1]
    dtype, scale_dtype = (torch.float64, torch.float64) if exact else \
        (value(combine.rows).dtype, value(combine.scale).dtype)
    n = tokens * k
    rows = forms.probe_activation(n, hidden, dtype, generator) if n % 2 == 0 else \
        torch.randn(n, hidden, generator=generator, dtype=torch.float64).to(dtype)
    scale = (0.05 + torch.rand(n, 1, generator=generator, dtype=torch.float64)).to(scale_dtype)
    index = torch.randperm(n, generator=generator).to(value(combine.index).dtype)
    return rows, scale, index


def _check_on_probe(combine: Combine, tokens: int) -> str | None:
    """None when the chain computes the combine (float64) and replays bit-exactly in its dtype."""
    dtype = value(combine.rows).dtype
    for exact in (True, False):
        generator = torch.Generator().manual_seed(forms.MOE_PROBE_SEED)
        rows, scale, index = _probe_inputs(combine, exact, generator)
        inputs = {combine.rows: rows, combine.scale: scale, combine.index: index}
        try:
            got = evaluate(list(combine.nodes), inputs, exact=exact, tokens=tokens,
                           rows=forms.MOE_PROBE_TOKENS)[combine.nodes[-1]]
        except ProbeError as e:
            return f"the combine cannot be probed: {e}"
        want = reference.moe_combine(rows, scale, index, combine.top_k, combine.scale_first)
        if got.shape != want.shape:
            return f"the combine gives shape {tuple(got.shape)} on the probe, expected {tuple(want.shape)}"
        if exact:
            weighted = rows * scale if combine.scale_first else rows
            factor = torch.ones_like(scale) if combine.scale_first else scale
            expected = (weighted[index.long()] * factor).view(-1, combine.top_k, rows.shape[-1]).sum(1)
            tol = forms.MATH_RTOL * expected.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
            if not bool(((got - expected).abs() <= tol).all()):
                return "on a probe it does not compute sum_k weight * rows[index[t, k]]"
        elif not forms.within_ulps(got, want, dtype, forms.MOE_COMBINE_ULPS):
            return f"with {dtype} it rounds differently from the op's combine (reference.moe_combine)"
    return None
