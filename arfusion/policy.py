"""Every decision about an all-reduce, at compile time and at run time, by the same rules.

Compile time, `decide`: from what the patterns found for one all-reduce (`patterns.Found`), a
`Choice`: fuse it (the op variants to try, with their arguments), put it on the fast path, move
it to the caller's stream, or leave it, with the `Decision` that records why. Run time, `route`
(which path one call of the fused op takes), `moe_combine_refusal` and `plain_refusal`:
`execution` asks these with the call's tensors, the same functions `decide` asks with the
graph's metadata. The user's caps (`Caps`) and the backends' tables and capabilities are read
here and nowhere else.

Every rule reads only facts identical on every rank of a group (shapes, dtypes, world size,
config, the backend's tables), so all ranks decide alike and a collective kernel is never
entered by only some of them.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

import torch

from . import backends, graph_breaks
from .backends.base import Backend
from .config import PassConfig
from .core import PLAIN, Call
from .decisions import Decision, Fate, Reason, Why
from .patterns import Combine, Found, NoSite, Site, summed_start
from .runtime import group_size, log_once

log = logging.getLogger("arfusion")

FAST_PATH_OFF = Reason(Why.FAST_PATH_OFF, "PassConfig(fast_all_reduce=False)")
# A call of no tokens (an empty batch served by a graph traced with a symbolic token count) never
# enters a kernel: FlashInfer's launcher sizes its grid by the tokens, and a grid of 0 fails to launch.
NO_TOKENS = Reason(Why.ZERO_TOKENS, "zero tokens (an empty batch): the all-reduce runs without a kernel")


# ----------------------------------------------------------------- the rules (compile and run time)

@dataclass(frozen=True)
class Caps:
    """The user's caps for one world size, bytes per rank, inclusive; None: the backend's own."""

    fused: int | None = None  # the largest input fused (max_size_mb)
    plain: int | None = None  # the largest input on the fast all-reduce (plain_max_size_mb)
    codec_min: int | None = None  # the quantized all-reduce from this size (quantized_allreduce_min_mb)

    def __post_init__(self):
        for name, value in (("max_bytes", self.fused), ("plain max_bytes", self.plain),
                            ("codec_min_bytes", self.codec_min)):
            if value is not None and value < 0:
                raise ValueError(f"arfusion: {name} is None (the backend's own table) or a byte count >= 0, "
                                 f"not {value}")

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def given(fused: int | None = None, plain: int | None = None, codec_min: int | None = None) -> "Caps":
        """The same caps as Caps(...), made once per distinct value (the ops build theirs per call)."""
        return Caps(fused=fused, plain=plain, codec_min=codec_min)

    @classmethod
    def of(cls, config: PassConfig, world_size: int) -> "Caps":
        return cls(config.max_bytes(world_size), config.plain_max_bytes(world_size),
                   config.codec_min_bytes(world_size))


class Route(Enum):
    """What one call of the fused op runs."""

    KERNEL = "kernel"  # the backend's fused kernel
    CODEC = "codec"  # the backend's quantized all-reduce in that codec, then the compiled add + norm
    UNFUSED = "unfused"  # all-reduce, then the compiled add + norm (the answer the model computes)


def route(backend: Backend, call: Call, caps: Caps, codec: str | None) -> tuple[Route, Reason | None]:
    """The path a call takes: the quantized all-reduce where it is asked for and pays, else the
    fused kernel where the backend takes the call, else unfused (with why). At compile time the
    token count may be unknown: the call is then routed at run time, by this same function."""
    if call.tokens == 0:
        return Route.UNFUSED, NO_TOKENS
    if codec and backend.codec_why_not(call, codec, caps.codec_min) is None:
        return Route.CODEC, None
    reason = backend.why_not(call, caps.fused)
    return (Route.UNFUSED, reason) if reason else (Route.KERNEL, None)


def moe_combine_refusal(backend: Backend, call: Call, top_k: int, rows: int | None, caps: Caps,
                        codec: str | None, other_collectives: int | None = None) -> Reason | None:
    """Why the backend does not compute the MoE top-k combine and the site in one kernel (None:
    it does). `other_collectives`: the group's other collectives in the graph (None: unknown, at
    run time, where the compile-time answer stands)."""
    if call.tokens == 0:
        return NO_TOKENS
    reason = backend.why_not(call, caps.fused) or backend.moe_combine_why_not(call, top_k, rows)
    if reason is None and codec and backend.codec_why_not(call, codec, caps.codec_min) is None:
        reason = Reason(Why.CODEC_TAKES, f"the {codec} quantized all-reduce takes this call")
    if reason is None and other_collectives == 0 and backend.capabilities.moe_combine_needs_other_collective:
        reason = Reason(Why.NEEDS_COLLECTIVE, f"no other collective on group {call.group_name} in this graph, and "
                        f"{backend.name}'s MoE kernel needs one between its calls (a graph of MoE sites alone, "
                        "replayed back to back, could hang)")
    return reason


def plain_refusal(backend: Backend, call: Call, caps: Caps) -> Reason | None:
    """Why the backend's fast all-reduce does not take a plain all-reduce (None: it does)."""
    return NO_TOKENS if call.tokens == 0 else backend.plain_why_not(call, caps.plain)


def current_stream_pays(device: torch.device) -> bool:
    """Whether an all-reduce NCCL runs should run on the caller's stream (GPUs: inside CUDA
    graphs the side-stream collective cost 4-8 us more per call on H200,
    docs/history/2026-11-26-benchmarks-before-the-matrix.md)."""
    return device.type == "cuda"


def compiles_fallback(device: torch.device) -> bool:
    """Whether an unfused call runs the compiled unfused path (GPUs) or the eager reference."""
    return device.type == "cuda"


# ----------------------------------------------------------------- compile time

@dataclass
class Scope:
    """What the decisions need to know about the graph being compiled."""

    config: PassConfig
    # Per group, the collectives that are not an MoE site's: what some MoE kernels need in the graph.
    other_collectives: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class FusedOp:
    """One way to fuse a site: the variant (with or without its quant tail), the MoE combine it
    takes in too, the op's arguments, and what to log once it is in the graph."""

    site: Site
    args: dict
    combine: Combine | None = None
    notes: tuple[str, ...] = ()
    quant_outside: Reason | None = None  # why the site's quant tail stays outside the op (its decision says so)


@dataclass(frozen=True)
class Choice:
    """`decide`'s answer: the decision, and what `edits` needs to carry it out (`fuse`: the
    variants to try in order; `fast_args`: the fast all-reduce's arguments)."""

    decision: Decision
    fuse: tuple[FusedOp, ...] = ()
    fast_args: dict | None = None


def _site_call(site: Site) -> Call:
    """The site's call at compile time (tokens None where symbolic)."""
    normed = site.norm_out.meta["val"]
    weight = site.weight.meta["val"] if site.weight is not None else normed
    group_name = site.region.group_name
    return Call.of_meta(site.form, normed.shape, normed.dtype, weight.dtype, normed.device,
                        group_size(group_name), group_name, input_scaled=site.region.scaled)


def _op_args(config: PassConfig, caps: Caps, codec: str | None) -> dict:
    """The fused op's decision arguments: the same rules then run again inside it, per call."""
    return {"backend": config.backend, "max_bytes": caps.fused, "codec": codec,
            "codec_min_bytes": caps.codec_min if codec else None}


def _fused_op(variant: Site, found: Found, scope: Scope, backend: Backend) -> tuple[FusedOp | None, Reason | None]:
    """The op for one variant of a site, or why the backend declines it."""
    config = scope.config
    call = _site_call(variant)
    caps = Caps.of(config, call.world_size)
    codec, notes = config.quantized_allreduce, []
    if codec:
        refused = backend.codec_why_not(call, codec, caps.codec_min)
        if refused:
            notes.append(f"exact all-reduce, not {codec}: {refused}")
            codec = None
    path, reason = route(backend, call, caps, codec)
    if path is Route.UNFUSED:
        return None, reason
    kernel_refusal = backend.why_not(call, caps.fused) if path is Route.CODEC else None
    if kernel_refusal:
        notes.append(f"rewritten for the {codec} quantized all-reduce (fused kernel: {kernel_refusal})")
    refused = variant.plan.quant.refused if variant.plan.quant is not None else None
    if refused is not None:
        notes.append(f"quant not fused ({refused.code.value}): {refused}")
    region = variant.region
    if region.scaled:
        factor = region.input_scale
        notes.append(f"scaled by {f'the 0-d tensor {factor.name}' if isinstance(factor, torch.fx.Node) else f'{factor:g}'}"
                     " before the residual add; the factor goes into the fused op")
    combine = found.combine if config.fuse_moe_combine else None
    if combine is not None:
        refused = moe_combine_refusal(backend, call, combine.top_k, None, caps, codec,
                                      scope.other_collectives[call.group_name])
        if refused:
            notes.append(f"MoE top-k combine left to Inductor, the site fuses alone: {refused}")
            combine = None
        else:
            notes.append(f"MoE top-k combine (K={combine.top_k}) fused into the site's op"
                         + (f", with its factor {combine.routed_scale:g}" if combine.routed_scale != 1.0 else ""))
    elif found.no_combine and config.fuse_moe_combine and _sums_experts(variant):
        notes.append(f"no MoE top-k combine fused: {found.no_combine}")
    return FusedOp(variant, _op_args(config, caps, codec), combine, tuple(notes), refused), None


def decide(found: Found, scope: Scope) -> Choice:
    """What becomes of one all-reduce: fused (the site's variants the backend takes, with its
    quant tail first), else `unfused`."""
    site = found.site
    if site is None:
        reason, broken = _split_by_graph_break(found.no_site) if found.no_site.returned else (found.no_site.reason, "")
        return unfused(found.all_reduce, reason, scope, declined=False, graph_break=broken)
    if found.no_combine and scope.config.fuse_moe_combine and not _sums_experts(site):
        # Dense sites (a matmul feeds the all-reduce) are not worth a line each; MoE sites say it as a note.
        log.debug("arfusion: %s: no MoE top-k combine fused: %s", found.all_reduce.name, found.no_combine)
    backend, reason = backends.resolve(scope.config.backend, site.norm_out.meta["val"].device)
    variants = []
    for variant in (site, site.without_quant()) if site.quant != "none" else (site,):
        if backend is None:
            break
        op, reason = _fused_op(variant, found, scope, backend)
        if op is not None:
            variants.append(op)
    if not variants:
        return unfused(found.all_reduce, reason, scope, declined=True)
    form = variants[0].site.form.name
    return Choice(Decision(found.all_reduce.name, Fate.FUSED, form=form), fuse=tuple(variants))


def _sums_experts(site: Site) -> bool:
    """The all-reduced value is a sum over experts (a MoE block's output), not a matmul's."""
    return site.region.x.target is torch.ops.aten.sum.dim_IntList


def fused(found: Found, op: FusedOp) -> Choice:
    """The decision once `op` (one of decide's variants) is in the graph."""
    return Choice(Decision(found.all_reduce.name, Fate.FUSED, form=op.site.form.name, quant_outside=op.quant_outside))


def _split_by_graph_break(no_site: NoSite) -> tuple[Reason, str]:
    """The all-reduced value leaves the graph with no norm in it: (the reason naming the graph
    break that put the norm in another graph, where Dynamo recorded one; that break's function)."""
    split = graph_breaks.split_here()
    if split is None:
        return Reason(Why.GRAPH_OUTPUT, f"{no_site.reason} (the model's output, or a graph break Dynamo did "
                                        "not record)"), ""
    log_once(f"arfusion: a graph break in {split.function} ({split.where}: {split.message}) puts norms in other "
             f"graphs than their all-reduces, which then cannot fuse" + (f"; {split.hint}" if split.hint else ""))
    return Reason(Why.GRAPH_BREAK, f"a graph break in {split.function} puts its norm in another graph"), split.function


def unfused(all_reduce: torch.fx.Node, not_fused: Reason, scope: Scope, declined: bool,
            graph_break: str = "") -> Choice:
    """An all-reduce that is not fused (`declined`: a site the backend refused): on the fast
    path where its backend takes it, else NCCL (on the caller's stream for declined sites on GPUs,
    where that pays and the config allows)."""
    config = scope.config
    not_fast = _fast_path_refusal(all_reduce, config)
    if isinstance(not_fast, tuple):
        name, args = not_fast
        return Choice(Decision(all_reduce.name, Fate.FAST_PATH, backend=name, not_fused=not_fused,
                               graph_break=graph_break), fast_args=args)
    device = all_reduce.meta["val"].device
    fate = Fate.CALLERS_STREAM if declined and config.unfused_on_current_stream and current_stream_pays(device) \
        else Fate.NCCL
    return Choice(Decision(all_reduce.name, fate, not_fused=not_fused, not_fast=not_fast, graph_break=graph_break))


def _fast_path_refusal(all_reduce: torch.fx.Node, config: PassConfig) -> Reason | tuple[str, dict]:
    """(backend name, the fast op's arguments) where the fast all-reduce takes `all_reduce` at
    these (static) shapes or decides at run time (symbolic), else why not."""
    if not config.fast_all_reduce:
        return FAST_PATH_OFF
    val = all_reduce.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0 or not val.dtype.is_floating_point:
        return Reason(Why.NOT_FLOATING, "not a floating tensor with a last dim")
    start = summed_start(all_reduce)
    if isinstance(start, Reason):
        return start
    backend, reason = backends.resolve(config.backend, val.device)
    if backend is None:
        return reason
    group_name = all_reduce.args[2]
    call = Call.of_meta(PLAIN, val.shape, val.dtype, val.dtype, val.device, group_size(group_name), group_name)
    caps = Caps.of(config, call.world_size)
    return plain_refusal(backend, call, caps) or (backend.name, {"backend": config.backend, "max_bytes": caps.plain})
