"""FX graph helpers: the collectives' ops, values and shapes, adding nodes with their fake
values (`Builder`, what the merges and the edits build with), CSE, snapshot and restore."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
# What torch's SequenceParallel turns a row-parallel all-reduce into: a reduce-scatter (then an
# all-gather before the next matmul; plain TP all-gathers too, for lm_head, so that one says nothing).
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
aten = torch.ops.aten


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


def collapse_double_waits(graph: torch.fx.Graph) -> int:
    """wait(wait(x)) -> wait(x): torch's functional all_reduce returns a tensor that waits by
    itself, and a model that also calls `wait_tensor` on it traces two waits; the second is a
    no-op that would hide the all-reduce's reader. Returns how many were dropped."""
    dropped = 0
    for node in list(graph.nodes):
        if node.target is WAIT and isinstance(node.args[0], torch.fx.Node) and node.args[0].target is WAIT:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            dropped += 1
    return dropped


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_hashable(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


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


def value(node) -> object:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


# Views whose schema does not say that they alias their input.
_UNMARKED_VIEWS = frozenset({aten._unsafe_view.default})


def sole_reader(node: torch.fx.Node, reader: torch.fx.Node) -> bool:
    """Whether `reader` is all that reads `node`'s memory, so it may overwrite it: `node` has no
    other user and is made by an aten op that returns new memory, or is a view, read by nothing
    else, of a tensor for which the same holds. Graph inputs, constants, collectives' and
    multi-output ops' results (getitem) are never sole-read."""
    while True:
        target = node.target
        if (node.op != "call_function" or set(node.users) != {reader} or not isinstance(target, torch._ops.OpOverload)
                or target.namespace not in ("aten", "prims")):
            return False
        schema = target._schema
        if schema.is_mutable or len(schema.returns) != 1:
            return False
        if schema.returns[0].alias_info is None and target not in _UNMARKED_VIEWS:
            return True
        if not node.args or not isinstance(node.args[0], torch.fx.Node):
            return False
        if target not in _UNMARKED_VIEWS and schema.arguments[0].alias_info is None:
            return False  # a view of some other argument
        node, reader = node.args[0], node


def same_shape(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether two nodes' values have the same shape (symbolic sizes: provably equal)."""
    have, want = value(a).shape, value(b).shape
    return len(have) == len(want) and all(statically_known_true(i == j) for i, j in zip(have, want))


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
