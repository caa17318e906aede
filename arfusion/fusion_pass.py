"""The Inductor post-grad pass, and how it is installed.

Per graph (`ArFusionPass._rewrite`, the driver): for every all-reduce, the patterns find what
its result feeds (`patterns.find`), the policy decides what becomes of it (`policy.decide`), the
edits carry that out (`edits`), and `GraphRun` records the decision (stats, one INFO line per
graph and one per all-reduce left unfused, with the reason).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch._inductor import config as inductor_config
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort

from . import backends, edits, patterns, policy, stats
from .config import PassConfig, env_disabled, env_strict
from .decisions import Decision, Fate, Reason, Why
from .graph_utils import (ALL_REDUCE, REDUCE_SCATTER, collapse_double_waits, collective_group, dedupe_pure_nodes,
                          has_fp8_casts, restore, snapshot)
from .runtime import log_once
from .version import __version__

log = logging.getLogger("arfusion")

_SLOT = "post_grad_custom_post_pass"


@functools.cache  # the sources do not change within a process; hash them once, not per compile
def _source_hash() -> str:
    files = tuple(sorted(str(p) for p in Path(__file__).parent.rglob("*.py")))
    return get_hash_for_files(files).hex()


class ArFusionPass(CustomGraphPass):
    """Rewrites all_reduce -> (residual add) -> RMSNorm (-> quant) into arfusion's fused op."""

    def __init__(self, config: PassConfig | None = None):
        self.config = config if config is not None else PassConfig()
        self._run: GraphRun | None = None  # the graph being rewritten
        if not self.config.enable_allreduce_fusion:
            log_once("arfusion: the pass is installed with PassConfig(enable_allreduce_fusion=False): "
                     "it leaves every graph as it is")

    def __eq__(self, other: object) -> bool:
        # Equal passes make equal torch.compile options: a compile with a new pass of the same
        # config (transformers' CompileConfig per generate_batch call) reuses the graphs.
        return type(other) is type(self) and other.config.key() == self.config.key()

    def __hash__(self) -> int:
        return hash(self.config.key())

    def uuid(self) -> str:
        # Everything that changes the rewrite: code, config, the opt-out, library versions.
        key = "|".join([__version__, _source_hash(), self.config.key(), str(env_disabled()),
                        backends.fingerprint()])
        return hashlib.sha256(key.encode()).hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        started = time.perf_counter()
        saved, self._run = None, None
        try:
            if not env_strict() and any(n.target is ALL_REDUCE for n in graph.nodes):
                saved = snapshot(graph)  # a bug of ours must cost the fusion, never the user's compile
            self._rewrite(graph)
        except Exception as error:
            if saved is None:
                raise
            self._give_up(graph, saved, error)
        finally:
            self._run = None  # the graph is Inductor's: the pass (in torch.compile's options) keeps none of it
            # What the pass adds to a cold compile (analysis + rewrite).
            stats.record_pass_seconds(time.perf_counter() - started)

    def _give_up(self, graph: torch.fx.Graph, saved: torch.fx.Graph, error: Exception) -> None:
        """The graph as it was before the pass (unfused, what Inductor alone would compile)."""
        restore(graph, saved)
        if self._run is not None:
            stats.forget_graph(self._run.key)
        left = sum(1 for n in graph.nodes if n.target is ALL_REDUCE)
        reason = Reason(Why.PASS_FAILED, f"arfusion failed on this graph and left it as it was "
                                         f"({type(error).__name__}: {error})")
        stats.record_graph(unfused=left, reasons=[reason] * left)
        log.warning("arfusion: %s; %d all_reduce left unfused. This is a bug in arfusion: please report it "
                    "with the log at DEBUG (ARFUSION_STRICT=1 makes it fail the compile instead)", reason, left)
        log.debug("arfusion: the error", exc_info=error)

    def _rewrite(self, graph: torch.fx.Graph) -> None:
        """The driver: find, decide, edit, record, for every all-reduce of the graph."""
        if not self.config.enable_allreduce_fusion or _disabled_by_env():
            return
        run = self._run = GraphRun.open(graph, self.config)
        for all_reduce in run.all_reduces:
            found = patterns.find(all_reduce, run.order, self.config.fused_quant_forms(), self.config.fuse_moe_combine)
            choice = policy.decide(found, run.scope)
            for op in choice.fuse:  # the site's variants the backend takes, best first
                failed = edits.fuse(graph, op.site, op.args, run.op_key(), op.combine)
                if failed is None:
                    choice = run.fused(found, op)
                    break
            else:
                if choice.fuse:  # no variant could be expressed in this graph
                    choice = policy.unfused(all_reduce, failed, run.scope, declined=True)
            if choice.decision.fate is Fate.FAST_PATH:
                edits.to_fast_path(graph, all_reduce, choice.fast_args, run.op_key())
            elif choice.decision.fate is Fate.CALLERS_STREAM:
                edits.to_callers_stream(graph, all_reduce)
            run.record(choice.decision)
        run.close()


def _disabled_by_env() -> bool:
    if env_disabled():
        log.info("arfusion: disabled by ARFUSION_DISABLE; graph left as is")
    return env_disabled()


class GraphRun:
    """One graph under rewrite: its all-reduces, the facts the policy reads about it, the keys
    naming its ops in stats, and what became of each all-reduce."""

    def __init__(self, graph: torch.fx.Graph, config: PassConfig):
        self.graph, self.config = graph, config
        self.key = uuid.uuid4().hex[:12]  # names this graph's ops in stats, cached or not
        self.decisions: list[Decision] = []
        self.reasons: list[Reason] = []  # why not fused, per all-reduce left (and reduce-scatter)
        self.merges: dict[str, int] = {}
        self.all_reduces: list[torch.fx.Node] = []
        self.scope = policy.Scope(config)
        self._ops = 0
        self._said: dict[tuple[str, str], list[str]] = {}  # (separator, message) -> the all-reduces it is about

    @classmethod
    def open(cls, graph: torch.fx.Graph, config: PassConfig) -> "GraphRun":
        """Prepares the graph (CSE of FP8 casts, the merges of all-reduces) and records what the
        merges folded away."""
        run = cls(graph, config)
        scattered = sum(1 for n in graph.nodes if n.target is REDUCE_SCATTER)
        if scattered:
            run.reasons += [Reason(Why.SEQUENCE_PARALLEL, "a reduce-scatter (sequence parallelism): only "
                                                          "all_reduce -> norm sites are fused")] * scattered
            log.info("arfusion: %d reduce_scatter(s) left unfused: with sequence parallelism the all-reduce becomes "
                     "reduce-scatter + all-gather, and only all_reduce -> norm sites are fused", scattered)
        before = [n.name for n in graph.nodes if n.target is ALL_REDUCE]
        if before:
            collapse_double_waits(graph)
        if before and has_fp8_casts(graph):
            # torchao re-quantizes the norm output once per consuming linear (q, k, v, ...);
            # one quant chain is what a site can absorb.
            dedupe_pure_nodes(graph)
        run.merges = patterns.merge_collectives(graph) if before else {}
        if any(run.merges.values()):
            log.info("arfusion: %s", ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in run.merges.items() if v))
        run.all_reduces = [n for n in graph.nodes if n.target is ALL_REDUCE]
        run._record_merged(before)
        run.scope.other_collectives = Counter(
            group for n in graph.nodes if (group := collective_group(n)) is not None
            and not (n.target is ALL_REDUCE and patterns.feeds_combine(n)))
        return run

    def _record_merged(self, before: list[str]) -> None:
        """One MERGED decision per all-reduce the merges folded away (their names, in order)."""
        after = {n.name for n in self.all_reduces}
        vanished = [name for name in before if name not in after]
        summed = self.merges.get("summed_all_reduces_merged", 0)
        for i, name in enumerate(vanished[:len(before) - len(after)]):
            into = (Reason(Why.MERGED, "summed with another: AR(a) + AR(b) -> AR(a + b)") if i < summed else
                    Reason(Why.MERGED, "concatenated with others: cat(AR(a), AR(b)) -> AR(cat(a, b))"))
            self.record(Decision(name, Fate.MERGED, not_fused=into))

    @property
    def order(self) -> dict[torch.fx.Node, int]:
        """Node positions now (each edit adds nodes: read it afresh for every all-reduce)."""
        return {n: i for i, n in enumerate(self.graph.nodes)}

    def op_key(self) -> str:
        """The next op's name in stats (`graph key:index`)."""
        self._ops += 1
        return f"{self.key}:{self._ops - 1}"

    def fused(self, found: patterns.Found, op: policy.FusedOp) -> policy.Choice:
        for note in op.notes:
            self._say(found.all_reduce.name, ": ", note)
        return policy.fused(found, op)

    def _say(self, all_reduce: str, separator: str, message: str) -> None:
        """An INFO message about one all-reduce, said at `close` once for all those it is about."""
        self._said.setdefault((separator, message), []).append(all_reduce)

    def record(self, decision: Decision) -> None:
        self.decisions.append(decision)
        stats.record_decision(self.key, decision)
        if decision.fate in (Fate.FUSED, Fate.MERGED):
            return
        self.reasons.append(decision.not_fused)
        self._say(decision.all_reduce, " not fused: ", str(decision.not_fused))
        if decision.not_fast is not None and decision.not_fast.code is not Why.FAST_PATH_OFF:
            self._say(decision.all_reduce, " not on the fast path either: ", str(decision.not_fast))

    def close(self) -> None:
        """Graph order, dead code, the stats and the graph's INFO line."""
        if not self.all_reduces and not self.reasons:
            return
        for (separator, message), names in self._said.items():
            log.info("arfusion: %s%s%s", _name_all(names), separator, message)
        graph = self.graph
        stable_topological_sort(graph)
        graph.eliminate_dead_code()
        fates = Counter(d.fate for d in self.decisions)
        fused = Counter(d.form for d in self.decisions if d.fate is Fate.FUSED)
        fast = Counter(d.backend for d in self.decisions if d.fate is Fate.FAST_PATH)
        left = fates[Fate.FAST_PATH] + fates[Fate.NCCL] + fates[Fate.CALLERS_STREAM]
        stats.record_graph(unfused=left, on_callers_stream=fates[Fate.CALLERS_STREAM], reasons=self.reasons,
                           collectives={**self.merges, "scaled_all_reduces_fused": edits.scaled_sites(graph)})
        if self.all_reduces:
            moved = fates[Fate.CALLERS_STREAM]
            log.info("arfusion: fused %d site(s) %s; %d all_reduce left unfused%s%s", sum(fused.values()),
                     dict(fused) or "", left, f", {sum(fast.values())} of them on the fast path {dict(fast)}"
                     if fast else "", f"; {moved} of them run on the caller's stream" if moved else "")


def _name_all(names: list[str]) -> str:
    """all_reduce_3; all_reduce_3, all_reduce_5; all_reduce_3, all_reduce_5 ... all_reduce_65 (32 all-reduces)."""
    if len(names) <= 2:
        return ", ".join(names)
    return f"{names[0]}, {names[1]} ... {names[-1]} ({len(names)} all-reduces)"


def not_fused_reasons(lines: list[str]) -> dict[str, int]:
    """The `arfusion` logger's "<all-reduces> not fused: <reason>" lines, counted by reason and by the
    all-reduces each names ("a", "a, b", or "a, b ... z (N all-reduces)": `_name_all`)."""
    counts: Counter = Counter()
    for head, _, reason in (line.partition("not fused") for line in lines if "not fused" in line):
        many = re.search(r"\((\d+) all-reduces\)\s*$", head)
        counts[reason.lstrip(" :;-").strip() or head] += int(many.group(1)) if many else head.count(", all_reduce") + 1
    return dict(counts)


# ---------------------------------------------------------------- installation


# A pass that takes `is_inference` too (torch >= 2.12); Inductor hands it only to passes it finds
# in its slot, so a chain that holds one must be one and pass it on.
_INFERENCE_AWARE = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)


class ChainedPass(_INFERENCE_AWARE or CustomGraphPass):
    """Runs several post-grad passes in order; cacheable only if every one of them is."""

    def __init__(self, passes: list[Any]):
        self.passes = passes

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.passes == self.passes

    def __hash__(self) -> int:  # equal chains (passes equal one by one) hash alike
        return hash(tuple(type(p) for p in self.passes))

    def __call__(self, graph: torch.fx.Graph, is_inference: bool = False) -> None:
        for p in self.passes:
            if _INFERENCE_AWARE is not None and isinstance(p, _INFERENCE_AWARE):
                p(graph, is_inference=is_inference)
            else:
                p(graph)

    def uuid(self) -> Any:
        uuids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes]
        if any(u is None for u in uuids):
            return None  # Inductor then bypasses the FX graph cache, which is the safe choice
        return hashlib.sha256(repr(uuids).encode()).hexdigest()


def _flatten(slot: Any) -> list[Any]:
    if slot is None:
        return []
    if isinstance(slot, ChainedPass):
        return list(slot.passes)
    if isinstance(slot, (list, tuple)):
        return [p for s in slot for p in _flatten(s)]
    return [slot]


def _combine(passes: list[Any]) -> Any:
    if not passes:
        return None
    return passes[0] if len(passes) == 1 else ChainedPass(passes)


def _others(slot: Any) -> list[Any]:
    return [p for p in _flatten(slot) if not isinstance(p, ArFusionPass)]


def inductor_options(config: PassConfig | dict | None = None) -> dict[str, Any]:
    """Options for `torch.compile(model, options=...)`; keeps any post-grad pass already set."""
    if isinstance(config, dict):
        config = PassConfig.from_dict(config)
    ours = ArFusionPass(config)
    return {_SLOT: _combine(_others(getattr(inductor_config, _SLOT)) + [ours])}


def enable(config: PassConfig | dict | None = None) -> ArFusionPass:
    """Install the pass in Inductor's global config (works with mode="reduce-overhead" and
    with compiles started by libraries, e.g. HF generate). Replaces an earlier arfusion pass,
    keeps everyone else's."""
    options = inductor_options(config)
    setattr(inductor_config, _SLOT, options[_SLOT])
    return next(p for p in _flatten(options[_SLOT]) if isinstance(p, ArFusionPass))


def disable() -> None:
    """Remove arfusion's pass from Inductor's global config, keeping everyone else's."""
    setattr(inductor_config, _SLOT, _combine(_others(getattr(inductor_config, _SLOT))))
