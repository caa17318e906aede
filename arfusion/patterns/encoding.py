"""A region numbered canonically: the same computation gets the same key, whatever its node names.

`Encoding` numbers the all-reduced value 0, then the region's nodes in graph order, then the
pointwise preparation of each tensor the region reads from outside (`w.float()`, `1 + w`) and
the roots that preparation starts from. Local ids are what `classify` works in, so that its
answer, keyed by `Encoding.key`, can be memoized and replayed on another region of the same shape.
"""

from __future__ import annotations

import math

import torch

from ..graph_utils import value
from .region import CONSTANT_PRODUCERS, LIKE_OPS, Region, drawn_from_random, hinted_shape, is_pointwise

CASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [i for i in node.all_input_nodes if isinstance(value(i), torch.Tensor)]


def activation_sized(shape: tuple[int, ...], region: Region) -> bool:
    """Whether a value of `shape` holds one of the site's activations ([tokens, hidden], however
    viewed). At one token a per-hidden vector (the norm weight) holds as many values; it is the one
    with fewer dims than the all-reduced value, which carries its token dims (`[1, 1, H]`)."""
    if math.prod(shape) != region.tokens * region.hidden:
        return False
    return region.tokens != 1 or len(shape) >= len(hinted_shape(region.start))


def _preparation(node: torch.fx.Node, region: Region) -> tuple[list[torch.fx.Node], torch.fx.Node | None]:
    """The pointwise chain that prepares an outside input (`1 + w.float()`), in order, and the
    tensor it starts from (None: a constant, e.g. `full([], 2**22)`). An activation-sized value
    is a residual term as computed, whatever computed it (MiniMax scales its residual by alpha):
    only casts are looked through there, so the dtype check sees the term's own dtype."""
    chain = []
    while True:
        if node.op == "call_function" and node.target in CONSTANT_PRODUCERS and not node.all_input_nodes:
            return [node, *reversed(chain)], None
        inputs = _tensor_inputs(node)
        computed_term = (node.target not in CASTS and isinstance(value(node), torch.Tensor)
                         and activation_sized(hinted_shape(node), region))
        if node.op == "call_function" and len(inputs) == 1 and (is_pointwise(node) or node.target in LIKE_OPS) \
                and len(node.all_input_nodes) == 1 and not computed_term:
            chain.append(node)
            node = inputs[0]
            continue
        return list(reversed(chain)), node


class Encoding:
    """The region's nodes numbered: 0 is the all-reduced value, then the region in graph order,
    then the preparation of outside inputs and their roots. `key` identifies the computation."""

    def __init__(self, region: Region):
        self.region = region
        self.nodes: list[torch.fx.Node] = [region.start, *region.nodes]
        self.local: dict[torch.fx.Node, int] = {n: i for i, n in enumerate(self.nodes)}
        self.prep: dict[int, list[int]] = {}  # local id of an outside input -> its preparation ids
        self.root_of: dict[int, int | None] = {}  # outside input -> root id (None: constant)
        self.roots: list[int] = []
        for node in region.nodes:
            for i in _tensor_inputs(node):
                if i not in region.members:
                    self._add_outside(i)
        # Roots computed from random draws (dropout's mask): what they hold is not in their shape.
        self.random = frozenset(r for r in self.roots if drawn_from_random(self.nodes[r]))
        self.key = (region.tokens, region.hidden, tuple(self._describe(i) for i in range(len(self.nodes))),
                    tuple(self.roots), tuple(sorted(self.random)))

    def _add(self, node: torch.fx.Node) -> int:
        if node not in self.local:
            self.local[node] = len(self.nodes)
            self.nodes.append(node)
        return self.local[node]

    def _add_outside(self, node: torch.fx.Node) -> None:
        if node in self.local:
            return
        chain, root = _preparation(node, self.region)
        ids = [self._add(n) for n in chain]
        root_id = None if root is None else self._add(root)
        if root_id is not None and root_id not in self.roots:
            self.roots.append(root_id)
        self.prep[self.local[node]] = ids
        self.root_of[self.local[node]] = root_id

    def _describe(self, i: int) -> tuple:
        node = self.nodes[i]
        val = value(node)
        meta = (str(val.dtype), hinted_shape(node), val.device.type) if isinstance(val, torch.Tensor) else repr(val)
        # Which outputs are read outside the region decides the site's exits; being the graph's
        # output also decides the reason given when no norm follows (a graph break, likely).
        read_outside = ("graph output" if any(u.op == "output" for u in node.users)
                        else any(u not in self.region.members for u in node.users))
        if i in self.roots:
            return ("input", meta)
        if i == 0:
            return ("all_reduce", meta, read_outside)
        return (str(node.target), self._arg_key(node.args), self._arg_key(node.kwargs), meta, read_outside)

    def _arg_key(self, arg):
        if isinstance(arg, torch.fx.Node):
            if arg in self.local:
                return ("n", self.local[arg])
            val = value(arg)
            return ("sym", str(val)) if not isinstance(val, torch.Tensor) else ("?", arg.name)
        if isinstance(arg, (list, tuple)):
            return tuple(self._arg_key(a) for a in arg)
        if isinstance(arg, dict):
            return tuple(sorted((k, self._arg_key(v)) for k, v in arg.items()))
        return (type(arg).__name__, repr(arg))

    def ids(self, nodes) -> frozenset[int]:
        return frozenset(self.local[n] for n in nodes)

    def evaluation_order(self, site_ids: set[int]) -> list[torch.fx.Node]:
        """The preparation of every outside input the site reads, then the site in graph order."""
        order: list[int] = []
        for i in sorted(site_ids):
            if i == 0:
                continue
            for inp in _tensor_inputs(self.nodes[i]):
                j = self.local[inp]
                if j in self.prep:
                    order.extend(p for p in self.prep[j] if p not in order)
        order.extend(sorted(i for i in site_ids if i != 0 and i < len(self.region.nodes) + 1))
        return [self.nodes[i] for i in order]

    def site_roots(self, site_ids: set[int]) -> set[int]:
        """The roots of the outside inputs the site reads (through their preparation)."""
        roots = set()
        for i in site_ids:
            if i == 0:
                continue
            for inp in _tensor_inputs(self.nodes[i]):
                j = self.local[inp]
                if j < len(self.region.nodes) + 1:
                    continue
                if self.root_of.get(j) is not None:
                    roots.add(self.root_of[j])
        return roots
