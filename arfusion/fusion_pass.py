"""The Inductor post-grad pass, and how it is installed.

The pass finds the process groups that the graph all-reduces over, registers the pattern
family for each group once per process, lets Inductor's pattern matcher rewrite every site
a backend accepts, and logs one line per graph.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, stable_topological_sort

from . import backends, patterns, quant, stats
from .graph_utils import ALL_REDUCE, dedupe_pure_nodes, move_all_reduce_to_current_stream
from .backends.base import Call, num_tokens
from .config import PassConfig, env_disabled
from .ops import current_stream_pays, group_size, site_of
from .version import __version__

log = logging.getLogger("arfusion")

FUSED_OP = torch.ops.arfusion.fused_allreduce_rmsnorm.default
_SLOT = "post_grad_custom_post_pass"

# (group name, config key) -> registered patterns. Registration traces every pattern once.
_registered: dict[tuple[str, str], tuple[PatternMatcherPass, set]] = {}
_owner: dict[tuple[str, str], "ArFusionPass"] = {}


@functools.cache  # the sources do not change within a process; hash them once, not per compile
def _source_hash() -> str:
    files = tuple(sorted(str(p) for p in Path(__file__).parent.rglob("*.py")))
    return get_hash_for_files(files).hex()


class ArFusionPass(CustomGraphPass):
    """Rewrites all_reduce -> (residual add) -> RMSNorm (-> quant) into arfusion's fused op."""

    def __init__(self, config: PassConfig | None = None):
        self.config = config if config is not None else PassConfig(enable_allreduce_fusion=True)
        self._declined: Counter[str] = Counter()
        self._left_unfused: set[torch.fx.Node] = set()  # declined sites' all_reduce nodes
        # Built here, not inside the first compile, where the same loop runs ~100x slower.
        patterns.all_specs(self.config.fused_quant_forms())

    def uuid(self) -> str:
        # Everything that changes the rewrite: code, config, the opt-out, library versions.
        key = "|".join([__version__, _source_hash(), self.config.key(), str(env_disabled()),
                        backends.fingerprint()])
        return hashlib.sha256(key.encode()).hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        started = time.perf_counter()
        patterns.trace_memo.clear()
        try:
            self._rewrite(graph)
        finally:
            patterns.trace_memo.clear()
            # What the pass adds to a cold compile (registration + matching + rewrite).
            stats.record_pass_seconds(time.perf_counter() - started)

    def _rewrite(self, graph: torch.fx.Graph) -> None:
        if not self.config.enable_allreduce_fusion:
            return
        if env_disabled():
            log.info("arfusion: disabled by ARFUSION_DISABLE; graph left as is")
            return
        groups = sorted({n.args[2] for n in graph.nodes if n.target is ALL_REDUCE})
        if not groups:
            return
        before = _fused_sites(graph)
        self._declined.clear()
        self._left_unfused.clear()
        features = patterns.GraphFeatures.of(graph)
        if features.fp8_dtypes:
            # torchao re-quantizes the norm output once per consuming linear (q, k, v, ...);
            # one quant chain is what a quant pattern can absorb.
            dedupe_pure_nodes(graph)
        for group_name in groups:
            self._patterns_for(group_name, features).apply(graph)
        # A replacement lands where the matched output was; an input it reads (Gemma's 1 + w)
        # may be defined later in the graph.
        stable_topological_sort(graph)
        # A site declined by one pattern may still have been fused by a smaller one.
        alive = [n for n in graph.nodes if n in self._left_unfused]
        moved = sum(move_all_reduce_to_current_stream(graph, n) for n in alive)
        self._left_unfused.clear()
        graph.eliminate_dead_code()
        fused = _fused_sites(graph) - before
        left = sum(1 for n in graph.nodes if n.target is ALL_REDUCE)
        stats.record_graph(fused, unfused=left + moved, on_callers_stream=moved)
        log.info("arfusion: fused %d site(s) %s; %d all_reduce left unfused%s%s", sum(fused.values()),
                 dict(fused) or "", left + moved,
                 f" (declined: {dict(self._declined)})" if self._declined else "",
                 f"; {moved} of them run on the caller's stream" if moved else "")

    def _patterns_for(self, group_name: str, features: patterns.GraphFeatures) -> PatternMatcherPass:
        """The group's pattern pass, with every spec this graph may need registered."""
        key = (group_name, self.config.key())
        if key not in _registered:
            _registered[key] = (PatternMatcherPass(pass_name="arfusion"), set())
        matcher, done = _registered[key]
        todo = [s for s in patterns.all_specs(self.config.fused_quant_forms())
                if s not in done and features.may_match(s)]
        if todo:
            cap = self.config.max_bytes(group_size(group_name))
            patterns.register(matcher, todo, group_name, self.config.backend, -1 if cap is None else cap,
                              lambda spec, match: _owner[key]._accept(spec, match))
            done.update(todo)
        # The registered checks report to the pass now running (same config, own counters).
        _owner[key] = self
        return matcher

    def _accept(self, spec: patterns.PatternSpec, match: Match) -> bool:
        """Compile-time gate: fuse only what the backend accepts for these (static) shapes.

        A site declined here stays as Inductor compiles it (its own fused norm kernel), which
        beats a run-time fallback inside the fused op.
        """
        # A literal-eps pattern also matches a tensor eps (dynamic=True); that has its own pattern.
        # torch 2.11 drops a literal eps from the re-traced match's kwargs; 2.13 keeps it.
        eps = match.kwargs.get("eps")
        if (spec.eps == "literal") != (eps is None or isinstance(eps, (int, float))):
            return False
        if _inputs_depend_on_match(match):
            return False  # e.g. a static-quant spelling taking a scale computed from this norm
        x = match.kwargs["x"].meta["val"]
        if spec.fp8_dtype is not None:
            if spec.fp8_dtype != quant.fp8_dtype(x.device):
                return False  # this device's FP8 type differs; the op would produce the other one
            fmax = torch.finfo(spec.fp8_dtype).max
            if (match.kwargs.get("fmax", fmax), match.kwargs.get("neg_fmax", -fmax)) != (fmax, -fmax):
                return False  # clamps to another range: not a saturating cast to this FP8 type
        weight = match.kwargs["weight"].meta["val"]
        group_name = _group_of(match)
        tokens = num_tokens(x.shape)
        call = Call(site=spec.site, tokens=tokens if isinstance(tokens, int) else None,
                    hidden=int(x.shape[-1]), dtype=x.dtype, weight_dtype=weight.dtype,
                    world_size=group_size(group_name), device=x.device, group_name=group_name)
        backend, reason = backends.resolve(self.config.backend, x.device)
        if backend is not None:
            reason = backend.why_not(call, self.config.max_bytes(call.world_size))
        if reason:
            self._declined[spec.site.name] += 1
            log.info("arfusion: %s site at %s not fused: %s", spec.site.name, match.nodes[-1], reason)
            if self.config.unfused_on_current_stream and current_stream_pays(x.device):
                self._left_unfused.add(next(n for n in match.nodes if n.target is ALL_REDUCE))
            return False
        return True


def _inputs_depend_on_match(match: Match) -> bool:
    """True if a pattern input is computed from the matched all-reduce (rewriting would make a
    cycle). Only nodes after the all-reduce in graph order can depend on it."""
    start = next(n for n in match.nodes if n.target is ALL_REDUCE)
    matched = set(match.nodes)
    todo = [v for v in match.kwargs.values() if isinstance(v, torch.fx.Node)]
    seen = set()
    while todo:
        node = todo.pop()
        if node in seen or not node > start:
            continue
        if node in matched:
            return True
        seen.add(node)
        todo.extend(node.all_input_nodes)
    return False


def _group_of(match: Match) -> str:
    return next(n.args[2] for n in match.nodes if n.target is ALL_REDUCE)


def _fused_sites(graph: torch.fx.Graph) -> Counter[str]:
    sites = Counter()
    for n in graph.nodes:
        if n.target is FUSED_OP:
            x, residual, weight, eps, eps_t, group, norm, quant, scale, emit_norm = n.args[:10]
            sites[site_of(residual, norm, quant, emit_norm).name] += 1
    return sites


# ---------------------------------------------------------------- installation


class ChainedPass(CustomGraphPass):
    """Runs several post-grad passes in order; cacheable only if every one of them is."""

    def __init__(self, passes: list[Any]):
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
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
