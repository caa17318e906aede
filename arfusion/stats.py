"""Process-wide counters: what the pass fused and where the fused op dispatched."""

from __future__ import annotations

import copy
import threading
from collections import Counter

_lock = threading.Lock()
_by_pattern: Counter[str] = Counter()
_dispatch: Counter[str] = Counter()
_left: Counter[str] = Counter()  # all_reduces the pass left unfused: "total", "on_callers_stream"
_graphs = 0
_pass_seconds = 0.0


def record_graph(fused: Counter[str], unfused: int = 0, on_callers_stream: int = 0) -> None:
    global _graphs
    with _lock:
        _graphs += 1
        _by_pattern.update(fused)
        _left.update(total=unfused, on_callers_stream=on_callers_stream)


def record_pass_seconds(seconds: float) -> None:
    global _pass_seconds
    with _lock:
        _pass_seconds += seconds


def record_dispatch(key: str) -> None:
    with _lock:
        _dispatch[key] += 1


def stats() -> dict:
    """{"fused_sites", "by_pattern", "unfused_sites", "unfused_on_callers_stream", "dispatch",
    "graphs", "pass_seconds"} for this process.

    fused_sites/by_pattern count rewrites made by the pass; unfused_sites the all_reduces it
    left, of which unfused_on_callers_stream now run as a blocking all-reduce on the caller's
    stream (GPU). A warm FX-graph-cache hit reuses an already rewritten graph without running
    the pass, so it adds nothing there.
    dispatch counts fused-op calls per backend, or "fallback" when a call ran unfused.
    pass_seconds is the time spent inside the pass (what it adds to compiles).
    """
    with _lock:
        return {
            "fused_sites": sum(_by_pattern.values()),
            "by_pattern": dict(_by_pattern),
            "unfused_sites": _left["total"],
            "unfused_on_callers_stream": _left["on_callers_stream"],
            "dispatch": dict(_dispatch),
            "graphs": _graphs,
            "pass_seconds": _pass_seconds,
        }


def reset_stats() -> None:
    global _graphs, _pass_seconds
    with _lock:
        _pass_seconds = 0.0
        _by_pattern.clear()
        _left.clear()
        _dispatch.clear()
        _graphs = 0


def snapshot() -> dict:
    return copy.deepcopy(stats())
