"""The region an all-reduce feeds: every row-local computation that starts from its result.

Row-local means each output row (one token) depends only on the same row of the inputs:
pointwise ops, reductions over the hidden dims, and shape ops that keep tokens apart. The
region grows from the all-reduce's value through such ops, and a node joins only if each of
its other inputs is independent of the all-reduce (weights, eps, the residual stream so far).
That bound is what stops the walk at the next layer: its residual add also reads the next
all-reduce, which depends on this one through a matmul.

What the region computes is decided later, numerically (`classify`); here only structure.
"""

from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass, field

import torch
from torch._inductor import config as _inductor_config

from ..graph_utils import ALL_REDUCE, WAIT, value

aten, prims = torch.ops.aten, torch.ops.prims

# Reductions: op -> position of its dims argument. None or [] there means "all dims".
REDUCTIONS = {
    aten.mean.dim: 1, aten.sum.dim_IntList: 1, aten.amax.default: 1, aten.amin.default: 1,
    aten.max.dim: 1, aten.min.dim: 1, aten.var_mean.correction: 1, aten.var.correction: 1,
    aten.linalg_vector_norm.default: 2, aten.prod.dim_int: 1,
}
# Shape ops whose size argument (position 1) is re-derived for the probe's row count.
CONVERT = torch.ops.prims.convert_element_type.default
SIZED_SHAPE_OPS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.expand.default}
# Constants (no tensor input): the graph's `full_like(x, 7)` is a `full([T, H], 7)` by now.
CONSTANT_PRODUCERS = {aten.full.default, aten.scalar_tensor.default}
OTHER_SHAPE_OPS = {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                   aten.slice.Tensor, aten.view.dtype, aten.alias.default, aten.clone.default}
# Tensors made from another tensor's shape (full_like(x, 7)): row-local like a pointwise op.
LIKE_OPS = {aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default}
MAX_REGION = 600  # nodes; NVFP4's quantizer alone is ~90


# Inductor's own RNG (what dropout becomes in its graphs unless fallback_random): untagged prims.
INDUCTOR_RNG = ("prims::inductor_random", "prims::inductor_randint")


def is_random(node: torch.fx.Node) -> bool:
    """Whether `node` draws random numbers: torch's seeded ops (dropout, bernoulli, rand_like)
    or Inductor's RNG."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in target.tags or target.name() in INDUCTOR_RNG)


def drawn_from_random(node: torch.fx.Node, limit: int = 16) -> bool:
    """Whether `node` is computed from random draws through pointwise ops only (dropout's mask
    `rand > p`, made outside the region by Inductor's RNG)."""
    todo, seen = [node], set()
    while todo and len(seen) < limit:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_random(n):
            return True
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and torch.Tag.pointwise in n.target.tags:
            todo.extend(n.all_input_nodes)
    return False


def is_pointwise(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags and not is_random(node)


def is_add(node: torch.fx.Node) -> bool:
    """`a + b` of two graph values (no alpha)."""
    return node.target is aten.add.Tensor and not node.kwargs and len(node.args) == 2 \
        and all(isinstance(a, torch.fx.Node) for a in node.args)


def by_a_number(node: torch.fx.Node) -> tuple[torch.fx.Node, int | float] | None:
    """(t, f) if `node` is `t * f` (either order) with f a number, else None."""
    if node.target is not aten.mul.Tensor or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    if isinstance(a, torch.fx.Node) and type(b) in (int, float):
        return a, b
    if isinstance(b, torch.fx.Node) and type(a) in (int, float):
        return b, a
    return None


def widened_sum(back: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(the add, [a, b]) if `back` is `(a.to(wide) + b.to(wide)).to(narrow)` with a and b narrow,
    the add read only by `back` and each upcast only by the add: HY-V3's
    `enable_moe_fp32_combine`, `(routed.float() + shared.float()).to(dtype)`."""
    add = back.args[0] if back.target is CONVERT else None
    if not isinstance(add, torch.fx.Node) or not is_add(add) or list(add.users) != [back] or any(
            a.target is not CONVERT or len(a.users) != 1 or not isinstance(a.args[0], torch.fx.Node)
            or value(a.args[0]).dtype != back.args[1] for a in add.args):
        return None
    return add, [a.args[0] for a in add.args]


def hint(size) -> int:
    """A size's example value (symbolic sizes carry the one they were traced with). SymNode.hint
    exists on torch 2.11-2.13; `optimization_hint`, its newer spelling, does not on 2.11.

    A symbolic size without one (unbacked: `mark_unbacked`, a data-dependent count) or traced at 0
    (size-oblivious tracing, where one graph then serves every count) gets Inductor's stand-in
    for unbacked sizes: the graph is for any count, and the op routes empty calls at run time."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    node = size.node
    value = node.hint if node.hint is not None else node.shape_env.size_hint(node.expr, allow_none=True)
    return int(value) if value is not None and int(value) != 0 else _inductor_config.unbacked_symint_fallback


def hinted_shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    val = value(node)
    return tuple(hint(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def token_prefix(shape: tuple[int, ...], tokens: int) -> int | None:
    """Length of the shortest leading part of `shape` whose size is a multiple of `tokens`:
    the dims that carry the tokens ([1, T, H] -> 2, [T, H/128, 128] -> 1, a flat [T*H] -> 1)."""
    size = 1
    for k, d in enumerate(shape, start=1):
        size *= d
        if size % tokens == 0 and size >= tokens:
            return k
    return None


def probe_shape(shape: tuple[int, ...], tokens: int, rows: int) -> tuple[int, ...] | None:
    """`shape` with its tokens replaced by `rows` (one leading dim rescaled), or None."""
    # prod(shape[:k]) = tokens * m; the probe needs prod = rows * m. Dim k - 1 becomes
    # shape[k - 1] * rows / tokens where that divides; else ([3, 8, H]: a batch of 3 does not
    # divide 32 rows) the dims before it become ones and dim k - 1 takes all rows * m. Either way
    # the rows keep their order, so every tensor of the region is rescaled alike.
    k = token_prefix(shape, tokens)
    if k is None:
        return None
    if (shape[k - 1] * rows) % tokens == 0:
        return (*shape[:k - 1], shape[k - 1] * rows // tokens, *shape[k:])
    return (*[1] * (k - 1), math.prod(shape[:k]) // tokens * rows, *shape[k:])


def reduce_dims(node: torch.fx.Node) -> list[int] | None:
    """The normalised dims a reduction node reduces, None for all."""
    pos = REDUCTIONS[node.target]
    dims = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim")
    rank = value(node.args[0]).dim()
    if dims is None or dims == []:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted(d % rank for d in dims)


@dataclass
class Region:
    """The row-local region that reads one all-reduce's result."""

    all_reduce: torch.fx.Node
    start: torch.fx.Node  # wait_tensor(all_reduce): the reduced value (times input_scale)
    nodes: list[torch.fx.Node] = field(default_factory=list)  # in graph order, start excluded
    members: set[torch.fx.Node] = field(default_factory=set)  # nodes + start
    hints: list[str] = field(default_factory=list)  # row-mixing users met on the way (for reasons)
    random: list[str] = field(default_factory=list)  # random ops that read the region (dropout in training mode)
    # f * AR(x) (collectives.scaled_all_reduce): start is the product, chain the nodes from the
    # wait to it (erased with the all-reduce), input_scale f (a number, or a 0-d tensor's node).
    chain: list[torch.fx.Node] = field(default_factory=list)
    input_scale: float | torch.fx.Node = 1.0

    @property
    def scaled(self) -> bool:
        return isinstance(self.input_scale, torch.fx.Node) or self.input_scale != 1.0

    @property
    def x(self) -> torch.fx.Node:
        return self.all_reduce.args[0]

    @property
    def group_name(self) -> str:
        return self.all_reduce.args[2]

    @property
    def hidden(self) -> int:
        return hint(value(self.start).shape[-1])

    @property
    def tokens(self) -> int:
        return math.prod(hinted_shape(self.start)[:-1])


class Independence:
    """Which nodes do not depend on `start`: a node earlier in graph order cannot; for a later
    one, whether any of its inputs does (memoized, so each node is looked at once per site)."""

    def __init__(self, start: torch.fx.Node, order: dict[torch.fx.Node, int]):
        self.start, self.order = start, order
        self.depends: dict[torch.fx.Node, bool] = {start: True}

    def __call__(self, node: torch.fx.Node) -> bool:
        limit = self.order[self.start]
        stack = [node]
        while stack:
            n = stack[-1]
            if n in self.depends:
                stack.pop()
            elif self.order.get(n, -1) < limit:
                self.depends[n] = False
                stack.pop()
            else:
                pending = [i for i in n.all_input_nodes if i not in self.depends]
                if pending:
                    stack.extend(pending)
                else:
                    self.depends[n] = any(self.depends[i] for i in n.all_input_nodes)
                    stack.pop()
        return not self.depends[node]


def all_reduce_sum_start(node: torch.fx.Node) -> torch.fx.Node | None:
    """The wait_tensor of a functional sum all-reduce, if `node` is one whose only user waits."""
    if node.target is not ALL_REDUCE or node.args[1] != "sum" or len(node.users) != 1:
        return None
    (wait,) = node.users
    return wait if wait.target is WAIT else None


def row_local(node: torch.fx.Node, region: Region) -> bool:
    """Whether `node` keeps tokens apart (given that one of its inputs is in the region)."""
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return node.args[0].target in REDUCTIONS
    if target in REDUCTIONS:
        dims = reduce_dims(node)
        shape = hinted_shape(node.args[0])
        prefix = token_prefix(shape, region.tokens) if shape else None
        if dims is None or prefix is None or min(dims) < prefix:
            region.hints.append(f"{node.name} ({target}) reduces over the tokens, not the hidden dim")
            return False
        return True
    if target in SIZED_SHAPE_OPS or target in OTHER_SHAPE_OPS or target in LIKE_OPS:
        return True
    if is_random(node):
        region.random.append(f"{node.name} ({target})")
        return False
    return is_pointwise(node)


def grow(start: torch.fx.Node, order: dict[torch.fx.Node, int],
         scaled: tuple[torch.fx.Node, float | torch.fx.Node, list[torch.fx.Node]] | None = None) -> Region:
    """The region of the all-reduce whose wait is `start` (see the module docstring); with
    `scaled` (collectives.scaled_all_reduce of that wait), the region of the scaled value."""
    if scaled is not None:
        product, factor, chain = scaled
        region = Region(all_reduce=start.args[0], start=product, members={product}, chain=chain,
                        input_scale=factor)
        start = product
    else:
        region = Region(all_reduce=start.args[0], start=start, members={start})
    independent = Independence(start, order)
    queue = [(order[u], u) for u in start.users]
    heapq.heapify(queue)
    queued = set(start.users)
    while queue and len(region.nodes) < MAX_REGION:
        _, node = heapq.heappop(queue)
        if not row_local(node, region):
            continue
        if not all(i in region.members or independent(i) for i in node.all_input_nodes):
            continue
        region.nodes.append(node)
        region.members.add(node)
        for user in node.users:
            if user not in queued:
                queued.add(user)
                heapq.heappush(queue, (order[user], user))
    return region


def ancestors_within(node: torch.fx.Node, members: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """`node` and the members it is computed from (through members only)."""
    found, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in found or n not in members:
            continue
        found.add(n)
        todo.extend(n.all_input_nodes)
    return found
