"""A per-graph memo of the pattern matcher's exact re-traces.

On every candidate match Inductor re-traces the search function with the matched inputs'
shapes to check the match exactly (the first match ignores literal ints and dtypes). A decoder
has 2L + 1 sites with identical inputs, so without a memo a 32-layer model pays 65 identical
re-traces: seconds of compile time. Only search functions are memoized (the matcher reads
those graphs, and its edits land on a copy); replacements are traced per match, because
their nodes' metadata is copied into the graph.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

_search_fns: "weakref.WeakSet[Callable]" = weakref.WeakSet()
_memo: dict[tuple, torch.fx.GraphModule] = {}


def search_function(fn: Callable) -> Callable:
    """Marks `fn` as a search function whose traces may be memoized."""
    _search_fns.add(fn)
    return fn


def clear() -> None:
    """Called at the start and end of each graph: symbolic sizes belong to one graph."""
    _memo.clear()


def memoized(trace_fn: Callable) -> Callable:
    def trace(fn: Callable, args: list, **kwargs: Any) -> torch.fx.GraphModule:
        owner = _search_owner(fn)
        if owner is None:
            return trace_fn(fn, args, **kwargs)
        key = (owner, fn is owner, _layout(args), tuple(sorted(kwargs)))
        if key not in _memo:
            _memo[key] = trace_fn(fn, args, **kwargs)
        # The matcher only reads a plain search trace; the wrapped one's placeholders it renames.
        return _memo[key] if fn is owner else _copy(_memo[key])

    return trace


def _search_owner(fn: Callable) -> Callable | None:
    if fn in _search_fns:
        return fn
    # With symbolic sizes the matcher wraps the search function in a closure of its own.
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            content = cell.cell_contents
        except ValueError:
            continue
        if callable(content) and content in _search_fns:
            return content
    return None


def _layout(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(map(str, value.shape)), tuple(map(str, value.stride())),
                str(value.storage_offset()), value.dtype, value.device, value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_layout(v) for v in value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(value))
    return (type(value).__name__, value)


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new graph over the same nodes' metadata (shallow): the matcher renames placeholders."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)
