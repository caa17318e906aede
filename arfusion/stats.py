"""Process-wide counters: what the pass fused and where the fused op dispatched."""

from __future__ import annotations

import copy
import threading
from collections import Counter

_lock = threading.Lock()
_by_pattern: Counter[str] = Counter()
_dispatch: Counter[str] = Counter()
_graphs = 0
_pass_seconds = 0.0


def record_graph(fused: Counter[str]) -> None:
    global _graphs
    with _lock:
        _graphs += 1
        _by_pattern.update(fused)


def record_pass_seconds(seconds: float) -> None:
    global _pass_seconds
    with _lock:
        _pass_seconds += seconds


def record_dispatch(key: str) -> None:
    with _lock:
        _dispatch[key] += 1


def stats() -> dict:
    """{"fused_sites", "by_pattern", "dispatch", "graphs", "pass_seconds"} for this process.

    fused_sites/by_pattern count rewrites made by the pass; a warm FX-graph-cache hit
    reuses an already rewritten graph without running the pass, so it adds nothing there.
    dispatch counts fused-op calls per backend, or "fallback" when a call ran unfused.
    pass_seconds is the time spent inside the pass (what it adds to compiles).
    """
    with _lock:
        return {
            "fused_sites": sum(_by_pattern.values()),
            "by_pattern": dict(_by_pattern),
            "dispatch": dict(_dispatch),
            "graphs": _graphs,
            "pass_seconds": _pass_seconds,
        }


def reset_stats() -> None:
    global _graphs, _pass_seconds
    with _lock:
        _pass_seconds = 0.0
        _by_pattern.clear()
        _dispatch.clear()
        _graphs = 0


def snapshot() -> dict:
    return copy.deepcopy(stats())
