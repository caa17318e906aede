"""Process-wide counters: what the pass fused and where the fused op dispatched.

The module is callable: `arfusion.stats()` is `stats()` (the package's name `stats` is this module).
"""

from __future__ import annotations

import copy
import logging
import sys
import threading
import types
from collections import Counter

from .decisions import Decision, Reason

_lock = threading.Lock()
_sites: dict[str, str] = {}  # site key -> pattern name, for every fused site of a compiled graph
_moe_combines: set[str] = set()  # keys of the fused sites that took their MoE top-k combine in too
_fast: set[str] = set()  # keys of the all-reduces put on the fast path (arfusion::all_reduce)
_decisions: list[dict] = []  # one per all-reduce the pass looked at: what became of it and why
_why_not: Counter[str] = Counter()  # reason's message -> all-reduces left unfused for it (for people)
_why_not_codes: Counter[str] = Counter()  # reason's code -> all-reduces left unfused for it (stable)
_dispatch: Counter[str] = Counter()
_captured: Counter[str] = Counter()  # the dispatches made while a CUDA graph was being captured
_eager_in_capture: Counter[str] = Counter()  # compiled helper -> its eager runs inside CUDA-graph captures
_left: Counter[str] = Counter()  # all_reduces the pass left unfused: "total", "on_callers_stream"
_collectives: Counter[str] = Counter()  # all-reduce rewrites before fusion (patterns.collectives)
_splits: Counter[str] = Counter()  # function whose graph break split all-reduces from their norms -> how many
_graphs = 0
_pass_seconds = 0.0
# Graph keys the pass rewrote in this process (kept by reset_stats: its graphs may run after one),
# and those whose ops ran without it: loaded from Inductor's FX graph cache (their reasons unknown).
_passed: set[str] = set()
_from_cache: set[str] = set()
_said_from_cache: set[str] = set()
log = logging.getLogger("arfusion")


def _op_ran(key: str) -> None:
    """An op of graph `key` ("graph:index") ran for the first time since reset_stats."""
    graph = key.rpartition(":")[0]
    if graph in _passed or graph in _from_cache:
        return
    _from_cache.add(graph)
    if graph not in _said_from_cache:
        _said_from_cache.add(graph)
        log.info("arfusion: a compiled graph came from Inductor's FX graph cache, so the pass did not run on it: "
                 "stats() counts its fused sites and fast-path all-reduces as they run, not why the others were "
                 "left unfused. TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 recompiles it and says why.")


def record_graph(unfused: int = 0, on_callers_stream: int = 0, reasons: list[Reason] = (),
                 collectives: dict[str, int] | None = None) -> None:
    """One graph the pass finished: all-reduces left unfused (and on the caller's stream), the
    reason of each, the rewrites made before matching."""
    global _graphs
    with _lock:
        _graphs += 1
        _left.update(total=unfused, on_callers_stream=on_callers_stream)
        _why_not.update(r.message for r in reasons)
        _why_not_codes.update(r.code.value for r in reasons)
        _collectives.update(collectives or {})


def record_site(key: str, name: str) -> None:
    """A fused site, by its key in its compiled graph: recorded by the pass when it rewrites,
    and by the fused op when it runs (a graph loaded from the FX graph cache never met the pass)."""
    if key not in _sites:
        with _lock:
            _sites[key] = name
            _op_ran(key)


def forget_graph(graph_key: str) -> None:
    """Drops the sites recorded for one graph (the pass failed on it and put it back unfused)."""
    if not graph_key:
        return
    with _lock:
        for key in [k for k in _sites if k.startswith(f"{graph_key}:")]:
            del _sites[key]
        _moe_combines.difference_update({k for k in _moe_combines if k.startswith(f"{graph_key}:")})
        _fast.difference_update({k for k in _fast if k.startswith(f"{graph_key}:")})
        _decisions[:] = [d for d in _decisions if d["graph"] != graph_key]


def record_moe_combine(key: str) -> None:
    """A fused site whose op also computes the MoE top-k combine (pass and op, as record_site)."""
    if key not in _moe_combines:
        with _lock:
            _moe_combines.add(key)
            _op_ran(key)


def record_fast_all_reduce(key: str) -> None:
    """An all-reduce that is not a site, put on the fast path (pass and op, as record_site)."""
    if key not in _fast:
        with _lock:
            _fast.add(key)
            _op_ran(key)


def record_decision(graph_key: str, decision: Decision) -> None:
    """What the pass did with one all-reduce of the graph `graph_key` (decisions.Decision)."""
    with _lock:
        _passed.add(graph_key)
        # "outcome" and "detail": the names of the release before (the fate's value; one line).
        _decisions.append({"graph": graph_key, **decision.as_dict(), "outcome": decision.fate.value,
                           "decision": decision})
        if decision.graph_break:
            _splits[decision.graph_break] += 1


def decisions() -> list[dict]:
    """The pass's decisions, one dict per all-reduce in the order it met them (this process):
    `decision` (the decisions.Decision itself), `graph` and the Decision's fields as JSON values
    (`fate`, `form`, `backend`, `code`, `reason`, `fast_path_code`, ...)."""
    with _lock:
        return [dict(d) for d in _decisions]


def record_pass_seconds(seconds: float) -> None:
    global _pass_seconds
    with _lock:
        _pass_seconds += seconds


def record_dispatch(key: str, captured: bool = False) -> None:
    with _lock:
        _dispatch[key] += 1
        if captured:
            _captured[key] += 1


def record_eager_in_capture(name: str) -> None:
    """A compiled helper (runtime.compiled) ran eagerly inside a CUDA-graph capture."""
    with _lock:
        _eager_in_capture[name] += 1


def stats() -> dict:
    """{"fused_sites", "by_pattern", "unfused_sites", "unfused_on_callers_stream", "why_not",
    "dispatch", "graphs", "pass_seconds"} for this process.

    fused_sites/by_pattern count the fused sites of the graphs compiled in this process, however
    a graph was obtained: rewritten by the pass, or loaded from the FX graph cache (counted when
    it first runs). unfused_sites counts the all_reduces the pass left, why_not their reasons
    (message -> count, for people), why_not_codes the same by the reasons' stable codes (decisions.Why),
    and unfused_on_callers_stream those now run as a blocking all-reduce on the caller's stream
    (GPU); these come from the pass, so a cache hit adds nothing to them but its fast-path
    all-reduces to unfused_sites (as they run). graphs_from_cache counts the graphs whose arfusion
    ops ran though the pass never saw them in this process (FX graph cache hits; said once at INFO). Likewise
    summed_all_reduces_merged (AR(a) + AR(b) rewritten as AR(a + b): one collective fewer each;
    gated_all_reduces_merged of them with a factor, AR(a) + f * AR(b) -> AR(a + f * b))
    sums_moved_before_all_reduce (sum([f *] AR(x)) rewritten as AR(sum([f *] x))),
    concatenated_all_reduces_merged (cat/stack of n all-reduces rewritten as one: n - 1 each),
    matmuls_moved_before_all_reduce (bmm(g, AR(x)) rewritten as AR(bmm(g, x)), g replicated: an
    einsum combine), scaled_sums_distributed ((AR(a) + b) * f rewritten as AR(a) * f + b * f, b replicated: Granite-4's MoE layers) and
    scaled_all_reduces_fused (f * AR(x), e.g. Granite's multiplier: sites whose op took f).
    moe_combines_fused counts the fused sites whose op also took in the MoE top-k combine in
    front of the all-reduce (arfusion::moe_combine_allreduce_rmsnorm), counted like fused_sites.
    fast_path_all_reduces counts the all-reduces that are not sites and went on the fast path
    (arfusion::all_reduce), counted like fused_sites; unfused_sites counts them too (they are not
    fused into a site). dispatch counts op calls per backend: fused calls by backend name, or
    "fallback" when a call ran unfused; fast-path calls as "<backend> all-reduce", or "nccl
    all-reduce" where the fast path declined at run time. dispatch_in_cuda_graphs counts, the same
    way, the calls made while a CUDA graph was being captured (each then runs at every replay);
    eager_in_cuda_graphs counts, by function, the unfused path's compiled helpers (the norm after
    NCCL's all-reduce) that ran eagerly in a capture because no compiled version passed its guards.
    split_by_graph_breaks counts, by the function where Dynamo broke the graph, the all-reduces
    whose norm that break put in another graph (arfusion.graph_breaks), so they could not fuse.
    pass_seconds is the time spent inside the pass (what it adds to compiles).
    """
    with _lock:
        return {
            "fused_sites": len(_sites),
            "by_pattern": dict(Counter(_sites.values())),
            "unfused_sites": _left["total"] + sum(k.rpartition(":")[0] in _from_cache for k in _fast),
            "unfused_on_callers_stream": _left["on_callers_stream"],
            "why_not": dict(_why_not),
            "why_not_codes": dict(_why_not_codes),
            "summed_all_reduces_merged": _collectives["summed_all_reduces_merged"],
            "gated_all_reduces_merged": _collectives["gated_all_reduces_merged"],
            "sums_moved_before_all_reduce": _collectives["sums_moved_before_all_reduce"],
            "concatenated_all_reduces_merged": _collectives["concatenated_all_reduces_merged"],
            "matmuls_moved_before_all_reduce": _collectives["matmuls_moved_before_all_reduce"],
            "scaled_sums_distributed": _collectives["scaled_sums_distributed"],
            "scaled_all_reduces_fused": _collectives["scaled_all_reduces_fused"],
            "moe_combines_fused": len(_moe_combines),
            "fast_path_all_reduces": len(_fast),
            "split_by_graph_breaks": dict(_splits),
            "dispatch": dict(_dispatch),
            "dispatch_in_cuda_graphs": dict(_captured),
            "eager_in_cuda_graphs": dict(_eager_in_capture),
            "graphs": _graphs,
            "graphs_from_cache": len(_from_cache),
            "pass_seconds": _pass_seconds,
        }


def reset_stats() -> None:
    global _graphs, _pass_seconds
    with _lock:
        _pass_seconds = 0.0
        _sites.clear()
        _moe_combines.clear()
        _fast.clear()
        _decisions.clear()
        _why_not.clear()
        _why_not_codes.clear()
        _collectives.clear()
        _splits.clear()
        _left.clear()
        _dispatch.clear()
        _captured.clear()
        _eager_in_capture.clear()
        _from_cache.clear()
        _graphs = 0


def snapshot() -> dict:
    return copy.deepcopy(stats())


class _Callable(types.ModuleType):
    def __call__(self) -> dict:
        return stats()


sys.modules[__name__].__class__ = _Callable
