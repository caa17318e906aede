"""The Inductor post-grad pass, and how it is installed.

For every all-reduce in the graph the pass takes the region its result feeds, decides
numerically what that region computes (`patterns`), asks the backend whether it takes such a
site at these shapes, and replaces it by arfusion's fused op; it logs one line per graph and
one per all-reduce it leaves, with the reason.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort

from . import backends, patterns, stats
from . import ops  # noqa: F401  (registers torch.ops.arfusion.*)
from .config import PassConfig, env_disabled, env_strict
from .core import PLAIN, Call
from .execution import current_stream_pays
from .graph_utils import (ALL_REDUCE, REDUCE_SCATTER, collective_group, dedupe_pure_nodes, has_fp8_casts,
                          move_all_reduce_to_current_stream, put_on_fast_path, restore, snapshot)
from .patterns.region import hinted_shape
from .runtime import group_size
from .version import __version__

log = logging.getLogger("arfusion")

FUSED_OP = torch.ops.arfusion.fused_allreduce_rmsnorm.default
_SLOT = "post_grad_custom_post_pass"


class Kind(Enum):
    FUSED = "fused"  # rewritten into the fused op
    DECLINED = "declined"  # a site, but the backend does not take it at these shapes
    NONE = "none"  # not a site


@dataclass(frozen=True)
class Outcome:
    """What became of one all-reduce: `detail` is the fused form's name, or the reason."""

    kind: Kind
    detail: str = ""
    scaled: bool = False  # NONE because the value is scaled first (patterns.NoSite.scaled)


NO_OUTCOME = Outcome(Kind.NONE)


@functools.cache  # the sources do not change within a process; hash them once, not per compile
def _source_hash() -> str:
    files = tuple(sorted(str(p) for p in Path(__file__).parent.rglob("*.py")))
    return get_hash_for_files(files).hex()


class ArFusionPass(CustomGraphPass):
    """Rewrites all_reduce -> (residual add) -> RMSNorm (-> quant) into arfusion's fused op."""

    def __init__(self, config: PassConfig | None = None):
        self.config = config if config is not None else PassConfig(enable_allreduce_fusion=True)
        self._graph_key = ""  # the graph being rewritten (its sites' prefix in stats)
        self._other_collectives: Counter[str] = Counter()  # of the graph being rewritten, per group

    def uuid(self) -> str:
        # Everything that changes the rewrite: code, config, the opt-out, library versions.
        key = "|".join([__version__, _source_hash(), self.config.key(), str(env_disabled()),
                        backends.fingerprint()])
        return hashlib.sha256(key.encode()).hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        started = time.perf_counter()
        saved, self._graph_key = None, ""
        try:
            if not env_strict() and any(n.target is ALL_REDUCE for n in graph.nodes):
                saved = snapshot(graph)  # a bug of ours must cost the fusion, never the user's compile
            self._rewrite(graph)
        except Exception as error:
            if saved is None:
                raise
            self._give_up(graph, saved, error)
        finally:
            # What the pass adds to a cold compile (analysis + rewrite).
            stats.record_pass_seconds(time.perf_counter() - started)

    def _give_up(self, graph: torch.fx.Graph, saved: torch.fx.Graph, error: Exception) -> None:
        """The graph as it was before the pass (unfused, what Inductor alone would compile)."""
        restore(graph, saved)
        stats.forget_graph(self._graph_key)
        left = sum(1 for n in graph.nodes if n.target is ALL_REDUCE)
        reason = f"arfusion failed on this graph and left it as it was ({type(error).__name__}: {error})"
        stats.record_graph(unfused=left, why_not=Counter({reason: left}))
        log.warning("arfusion: %s; %d all_reduce left unfused. This is a bug in arfusion: please report it "
                    "with the log at DEBUG (ARFUSION_STRICT=1 makes it fail the compile instead)", reason, left)
        log.debug("arfusion: the error", exc_info=error)

    def _rewrite(self, graph: torch.fx.Graph) -> None:
        if not self.config.enable_allreduce_fusion:
            return
        if env_disabled():
            log.info("arfusion: disabled by ARFUSION_DISABLE; graph left as is")
            return
        why_not: Counter[str] = Counter()
        _log_sequence_parallel(graph, why_not)
        all_reduces = [n for n in graph.nodes if n.target is ALL_REDUCE]
        if not all_reduces:
            if why_not:
                stats.record_graph(why_not=why_not)
            return
        if has_fp8_casts(graph):
            # torchao re-quantizes the norm output once per consuming linear (q, k, v, ...);
            # one quant chain is what a site can absorb.
            dedupe_pure_nodes(graph)
        merged = patterns.merge_collectives(graph)
        if any(merged.values()):
            log.info("arfusion: %s", ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in merged.items() if v))
            all_reduces = [n for n in graph.nodes if n.target is ALL_REDUCE]
        # Per group, the collectives that are not an MoE site's: what some MoE kernels need in the graph.
        self._other_collectives = Counter(
            group for n in graph.nodes if (group := collective_group(n)) is not None
            and not (n.target is ALL_REDUCE and patterns.feeds_combine(n)))
        graph_key = self._graph_key = uuid.uuid4().hex[:12]  # names this graph's sites in stats, cached or not
        fused: Counter[str] = Counter()
        fast: Counter[str] = Counter()
        moved = 0
        for index, all_reduce in enumerate(all_reduces):
            key = f"{graph_key}:{index}"
            outcome = self._fuse(graph, all_reduce, key)
            if outcome.kind is Kind.FUSED:
                fused[outcome.detail] += 1
                stats.record_decision(graph_key, all_reduce.name, "fused", outcome.detail)
                continue
            why_not[outcome.detail] += 1
            log.info("arfusion: %s not fused: %s", all_reduce.name, outcome.detail)
            backend, refused = self._plain_refuses(all_reduce)
            if not refused and put_on_fast_path(graph, all_reduce, self.config.backend, self._plain_cap(all_reduce), key):
                fast[backend] += 1
                stats.record_fast_all_reduce(key)
                stats.record_decision(graph_key, all_reduce.name, "fast_path", f"{backend}; not fused: {outcome.detail}")
                continue
            stats.record_decision(graph_key, all_reduce.name, "nccl", f"{outcome.detail}; not on the fast path: "
                                  f"{refused or 'its result is not simply awaited'}")
            if refused:
                log.info("arfusion: %s not on the fast path either: %s", all_reduce.name, refused)
            if outcome.kind is Kind.DECLINED and self.config.unfused_on_current_stream \
                    and current_stream_pays(all_reduce.meta["val"].device):
                moved += move_all_reduce_to_current_stream(graph, all_reduce)
        stable_topological_sort(graph)
        graph.eliminate_dead_code()
        left = sum(1 for n in graph.nodes if n.target is ALL_REDUCE) + sum(fast.values())
        merged = {**merged, "scaled_all_reduces_fused": patterns.scaled_sites(graph)}
        stats.record_graph(unfused=left + moved, on_callers_stream=moved, why_not=why_not, collectives=merged)
        log.info("arfusion: fused %d site(s) %s; %d all_reduce left unfused%s%s", sum(fused.values()),
                 dict(fused) or "", left + moved, f", {sum(fast.values())} of them on the fast path {dict(fast)}"
                 if fast else "", f"; {moved} of them run on the caller's stream" if moved else "")

    def _fuse(self, graph: torch.fx.Graph, all_reduce: torch.fx.Node, site_key: str) -> Outcome:
        """FUSED (detail: the pattern name), DECLINED when the backend refuses a site, or NONE
        when there is no site (detail: the reason)."""
        start = patterns.all_reduce_sum_start(all_reduce)
        if start is None:
            op = all_reduce.args[1]
            return Outcome(Kind.NONE, f"a {op} all-reduce" if op != "sum" else "its result is not simply awaited")
        shape = hinted_shape(start)
        if shape is not None and math.prod(shape[:-1]) == 0:
            # A graph traced with zero tokens (an empty batch; dynamo specialises size 0, so it is
            # never symbolic). The region walk finds the token dims by divisibility, which a size
            # of 0 cannot give (it raised ZeroDivisionError), and there is nothing to fuse.
            return Outcome(Kind.NONE, "zero tokens (an empty batch): nothing to fuse")
        order = {n: i for i, n in enumerate(graph.nodes)}
        scaled = patterns.scaled_all_reduce(start)
        as_product = NO_OUTCOME
        if scaled is not None:  # f * AR(x): first as a site of the product, the op taking f
            as_product = self._fuse_region(graph, patterns.grow(start, order, scaled), all_reduce, site_key)
            if as_product.kind is not Kind.NONE:  # fused, or a site the backend declined (e.g. a size cap)
                return as_product
        outcome = self._fuse_region(graph, patterns.grow(start, order), all_reduce, site_key)
        if outcome.scaled and as_product.detail:
            # The product's site is the one the model computes: why it failed says more (HRM's
            # scaled embedding is also read by a later add) than "it is scaled".
            return Outcome(Kind.NONE, f"scaled all-reduce (f * AR(x)): {as_product.detail}")
        return outcome

    def _fuse_region(self, graph: torch.fx.Graph, region, all_reduce: torch.fx.Node, site_key: str) -> Outcome:
        site = patterns.find_site(region, self.config.fused_quant_forms())
        if isinstance(site, patterns.NoSite):
            return Outcome(Kind.NONE, site.reason, site.scaled)
        reason = ""
        # The MoE op takes numbers only (a tensor factor after an MoE block: not seen in any model).
        combine = None if isinstance(region.input_scale, torch.fx.Node) else self._moe_combine(site, all_reduce)
        for variant in (site, site.without_quant()) if site.quant != "none" else (site,):
            quantized = self._quantized(variant)
            reason = self._backend_refuses(variant, quantized=quantized)
            if reason:
                continue
            name = patterns.op_site(variant).name
            cap = self.config.max_bytes(group_size(variant.region.group_name))
            take = combine
            if combine is not None:
                refused = self._backend_refuses(variant, combine)
                if refused:
                    log.info("arfusion: %s: MoE top-k combine left to Inductor, the site fuses alone: %s",
                             all_reduce.name, refused)
                    take = None
            if patterns.rewrite(graph, variant, self.config.backend, -1 if cap is None else cap, site_key,
                                combine=take, quantized=quantized):
                stats.record_site(site_key, name)
                if region.scaled:
                    factor = region.input_scale
                    log.info("arfusion: %s: scaled by %s before the residual add; the factor goes into the "
                             "fused op", all_reduce.name,
                             f"the 0-d tensor {factor.name}" if isinstance(factor, torch.fx.Node) else f"{factor:g}")
                if take is not None:
                    stats.record_moe_combine(site_key)
                    log.info("arfusion: %s: MoE top-k combine (K=%d) fused into the site's op%s", all_reduce.name,
                             take.top_k, f", with its factor {take.routed_scale:g}" if take.routed_scale != 1.0 else "")
                return Outcome(Kind.FUSED, name)
            reason = "a symbolic shape between the all-reduce and the norm cannot be expressed"
        return Outcome(Kind.DECLINED, reason)

    def _plain_cap(self, all_reduce: torch.fx.Node) -> int:
        cap = self.config.plain_max_bytes(group_size(all_reduce.args[2]))
        return -1 if cap is None else cap

    def _plain_refuses(self, all_reduce: torch.fx.Node) -> tuple[str, str]:
        """(backend name, "") where the fast plain all-reduce takes `all_reduce` at these (static)
        shapes or decides at run time (symbolic), else (backend name or "", why not)."""
        if not self.config.fast_all_reduce:
            return "", "PassConfig(fast_all_reduce=False)"
        val = all_reduce.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or not val.dtype.is_floating_point:
            return "", "not a floating tensor with a last dim"
        if patterns.all_reduce_sum_start(all_reduce) is None:
            op = all_reduce.args[1]
            return "", f"a {op} all-reduce" if op != "sum" else "its result is not simply awaited"
        backend, reason = backends.resolve(self.config.backend, val.device)
        if backend is None:
            return "", reason
        group_name = all_reduce.args[2]
        call = Call.of_meta(PLAIN, val.shape, val.dtype, val.dtype, val.device, group_size(group_name), group_name)
        return backend.name, backend.plain_why_not(call, self.config.plain_max_bytes(call.world_size)) or ""

    def _moe_combine(self, site: patterns.Match, all_reduce: torch.fx.Node) -> patterns.Combine | None:
        """The MoE top-k combine producing the site's all-reduce input, if there is one to take."""
        if not self.config.fuse_moe_combine:
            return None
        found = patterns.find_moe_combine(site)
        if isinstance(found, str):
            # Dense sites (a matmul feeds the all-reduce) are not worth a line each.
            level = logging.INFO if site.region.x.target is torch.ops.aten.sum.dim_IntList else logging.DEBUG
            log.log(level, "arfusion: %s: no MoE top-k combine fused: %s", all_reduce.name, found)
            return None
        return found

    def _quantized(self, site: patterns.Match) -> tuple[str, int]:
        """The op's (level, min bytes) of the quantized all-reduce: ("", -1) where it is off or
        cannot apply to this site at these (static) shapes."""
        level = self.config.quantized_allreduce
        if not level:
            return "", -1
        call, backend, reason = self._call(site)
        if backend is not None:
            reason = backend.quantized_why_not(call, level, self.config.quantized_min_bytes(call.world_size))
        if reason:
            log.info("arfusion: %s: exact all-reduce, not %s: %s", site.region.all_reduce.name, level, reason)
            return "", -1
        floor = self.config.quantized_min_bytes(call.world_size)
        return level, -1 if floor is None else floor

    def _call(self, site: patterns.Match):
        """(the site's Call at compile time, its backend or None, why there is none)."""
        normed = site.norm_out.meta["val"]
        weight = site.weight.meta["val"] if site.weight is not None else normed
        group_name = site.region.group_name
        call = Call.of_meta(patterns.op_site(site), normed.shape, normed.dtype, weight.dtype, normed.device,
                            group_size(group_name), group_name, input_scaled=site.region.scaled)
        backend, reason = backends.resolve(self.config.backend, normed.device)
        return call, backend, reason

    def _backend_refuses(self, site: patterns.Match, combine: patterns.Combine | None = None,
                         quantized: tuple[str, int] = ("", -1)) -> str:
        """Compile-time gate: fuse only what the backend accepts for these (static) shapes. A site
        declined here stays as Inductor compiles it (its own fused norm kernel), which beats a
        run-time fallback inside the fused op. With `combine`: whether the backend also takes
        the MoE combine (where it has no kernel for these shapes, Inductor's compiled combine
        beats the op's run-time fallback). A site the quantized all-reduce takes (`quantized`,
        from `_quantized`) is rewritten even where the fused kernel declines it."""
        call, backend, reason = self._call(site)
        if backend is not None:
            reason = backend.why_not(call, self.config.max_bytes(call.world_size))
            if reason and quantized[0]:
                log.info("arfusion: %s: rewritten for the %s quantized all-reduce (fused kernel: %s)",
                         site.region.all_reduce.name, quantized[0], reason)
                reason = None
            if not reason and combine is not None:
                reason = backend.moe_combine_why_not(call, combine.top_k, None)
                if not reason and backend.capabilities.moe_combine_needs_other_collective \
                        and not self._other_collectives[call.group_name]:
                    reason = (f"no other collective on group {call.group_name} in this graph, and {backend.name}'s "
                              "MoE kernel needs one between its calls (a graph of MoE sites alone, replayed back "
                              "to back, could hang)")
        return reason or ""


def _log_sequence_parallel(graph: torch.fx.Graph, why_not: Counter[str]) -> None:
    found = sum(1 for n in graph.nodes if n.target is REDUCE_SCATTER)
    if found:
        why_not["a reduce-scatter (sequence parallelism): only all_reduce -> norm sites are fused"] += found
        log.info("arfusion: %d reduce_scatter(s) left unfused: with sequence parallelism the all-reduce becomes "
                 "reduce-scatter + all-gather, and only all_reduce -> norm sites are fused", found)


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
