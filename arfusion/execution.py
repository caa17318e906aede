"""What one call of an arfusion op runs: the backend's kernel, its quantized all-reduce, or the
unfused computation, as `policy`'s rules route it (the same rules the pass decided with at
compile time, now with the call's real shapes), then the backend's run-time readiness
(`prepare`: workspaces, buffers). Every input of the choice is the same on every rank, so all
ranks of a group take the same path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from . import reference, stats
from .backends import resolve
from .backends.base import tables_version
from .core import PLAIN, Call, Form
from .decisions import Reason, Why
from .policy import (Caps, Route, compiles_fallback, current_stream_pays, moe_combine_refusal, plain_refusal,
                     route)
from .runtime import capturing, compiled, group_size, log_once, outside_graph_pools, resolve_group, scalar_value

EPS_IN_CAPTURE = Reason(Why.RUNTIME, "eps is a GPU tensor not read before this CUDA-graph capture")


def _dispatched(key: str) -> None:
    stats.record_dispatch(key, captured=capturing())


def all_reduce_in_place(x: torch.Tensor, group_name: str) -> None:
    """Sum `x` over the group in place, with NCCL on the caller's stream."""
    target = x if x.is_contiguous() else x.contiguous()  # NCCL needs dense memory
    dist.all_reduce(target, group=dist.distributed_c10d._resolve_process_group(group_name))
    if target is not x:
        x.copy_(target)


def all_reduce_on_current_stream(x: torch.Tensor, group_name: str, x_is_scratch: bool = False) -> torch.Tensor:
    """Sum of `x` over the group, with NCCL on the caller's stream: x itself, reduced in place,
    where the caller may overwrite it (`x_is_scratch`) and it is dense; otherwise a copy of it, x
    unchanged. A reduce-scatter + all-gather into a new tensor avoids the copy too but was slower
    on 2xH200 at 16 to 64 MiB per rank (docs/benchmarks.md, machine R)."""
    reduced = x if x_is_scratch and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
    all_reduce_in_place(reduced, group_name)
    return reduced


def after_all_reduce(reduced, residual, weight, eps, form, quant_scale, reduced_scale=1.0):
    """[* reduced_scale] [+ residual] -> RMSNorm [-> quant] of an all-reduced tensor: compiled on GPUs."""
    norm = compiled(reference.add_rms_norm) if compiles_fallback(reduced.device) else reference.add_rms_norm
    return norm(reduced, residual, weight, eps, form, quant_scale, reduced_scale)


def unfused(x, residual, weight, eps, group_name, form, quant_scale, input_scale=1.0, x_is_scratch=False):
    """The unfused result, all_reduce(x) * input_scale [+ residual] -> norm. On a GPU: NCCL
    all-reduce (of x itself where `x_is_scratch`) + one compiled (scale+)add+RMSNorm(+quant)
    kernel, since the eager reference is 1.6-2.3x slower there. Elsewhere the eager reference."""
    if not compiles_fallback(x.device):
        return reference.unfused(x, residual, weight, eps, group_name, form, quant_scale, input_scale)
    reduced = all_reduce_on_current_stream(x, group_name, x_is_scratch)
    return after_all_reduce(reduced, residual, weight, eps, form, quant_scale, input_scale)


def codec_or_none(backend, call: Call, x, residual, weight, eps, quant_scale, level: str) -> list[torch.Tensor] | None:
    """The form's outputs through `backend`'s `level` quantized all-reduce (which `policy.route`
    chose), or None (logged once) where it is not ready: then the exact path runs."""
    reason = backend.prepare_codec(call, level)
    if reason:
        log_once(f"arfusion: {call.form.name}: exact all-reduce, not {level}: {reason}")
        return None
    _dispatched(f"{backend.name} quantized {level}")
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    reduced = backend.codec_all_reduce(call, flat, level).view(x.shape)
    return after_all_reduce(reduced, residual, weight, eps, call.form, quant_scale)


_unit_weights: dict[tuple, torch.Tensor] = {}


def unit_weight(device: torch.device, dtype: torch.dtype, hidden: int) -> torch.Tensor:
    """Ones, the weight of a norm that has none (kernels need one). Cached, made outside
    CUDA-graph pools; during a capture that has none yet, a temporary one."""
    key = (device, dtype, hidden)
    if key not in _unit_weights:
        if capturing():
            return torch.ones(hidden, dtype=dtype, device=device)
        _unit_weights[key] = outside_graph_pools(device, lambda: torch.ones(hidden, dtype=dtype, device=device))
    return _unit_weights[key]


def _scaled(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    return x if not isinstance(scale, torch.Tensor) and scale == 1.0 else x * scale


def dense_outputs(outs: list[torch.Tensor], lead) -> list[torch.Tensor]:
    """The op's outputs as its fake says: [*lead, last dim], contiguous. Kernels write dense
    [T, H] buffers while the reference math follows its inputs' layout (a transposed residual
    gives a transposed sum), and a compiled graph checks real strides against the fake's."""
    return [o.reshape(*lead, o.shape[-1]).contiguous() if o.dim() else o for o in outs]


def eps_value(eps: torch.Tensor) -> float | torch.Tensor:
    """eps held as a 0-d tensor, as a float where it can be read without a synchronisation inside a
    CUDA-graph capture (`runtime.scalar_value`); else the tensor, and the call runs unfused."""
    value = scalar_value(eps)
    return eps if value is None else value


def form_of(residual, norm, quant, emit_norm) -> Form:
    return _form(residual is not None, norm, quant, emit_norm)


@functools.lru_cache(maxsize=None)
def _form(residual: bool, norm: str, quant: str, emit_norm: bool) -> Form:  # one per form, not per call
    return Form(residual=residual, norm=norm, quant=quant, emit_norm=emit_norm)


# What `resolve` and `policy.route` answer for a call depends on its signature alone (and on the
# backends' tables: base.tables_version), so each signature is routed once and looked up after:
# outside CUDA-graph replays every site pays this path on every step. Where the backend's kernel
# ran for a signature, its bound run (`Backend.bind`) is kept with the route.
@dataclass(slots=True)
class Routed:
    call: Call
    backend: object  # the Backend, or None
    path: Route
    reason: Reason | None
    bound: Callable | None = None


_routes: dict[tuple, Routed] = {}
ROUTES_KEPT = 4096  # signatures remembered (dynamic shapes make one per token count); then afresh


def _remembered(key: tuple, route_it: Callable[[], Routed]) -> Routed:
    hit = _routes.get(key)
    if hit is None:
        if len(_routes) >= ROUTES_KEPT:
            _routes.clear()
        hit = _routes[key] = route_it()
    return hit


def routed(x, weight, group_name: str, form: Form, backend: str, caps: Caps, codec: str | None,
           scaled: bool) -> Routed:
    """A fused call's route: `policy.route`'s answer, remembered by signature. The group object
    is part of it: a name given again to another group (a new world after destroy_process_group)
    is routed afresh."""
    def route_it():
        call = Call.of_tensors(form, x, weight, group_size(group_name), group_name, input_scaled=scaled)
        chosen, reason = resolve(backend, x.device)
        path = Route.UNFUSED
        if chosen is not None:
            path, reason = route(chosen, call, caps, codec)
        return Routed(call, chosen, path, reason)

    return _remembered((form, x.shape, x.dtype, weight.dtype, x.device, resolve_group(group_name), group_name,
                        backend, caps, codec, scaled, tables_version()), route_it)


def routed_plain(x, group_name: str, backend: str, caps: Caps) -> Routed:
    """A plain all-reduce's route (the backend's fast all-reduce, or not), remembered as `routed`'s."""
    def route_it():
        call = Call.of_tensors(PLAIN, x, None, group_size(group_name), group_name)
        chosen, reason = resolve(backend, x.device)
        if chosen is not None:
            reason = plain_refusal(chosen, call, caps)
        return Routed(call, chosen, Route.KERNEL if reason is None else Route.UNFUSED, reason)

    return _remembered(("plain", x.shape, x.dtype, x.device, resolve_group(group_name), group_name, backend, caps,
                        tables_version()), route_it)


def run_fused(x, residual, weight, eps, group_name, form: Form, quant_scale, backend: str, caps: Caps,
              codec: str | None = None, input_scale: float | torch.Tensor = 1.0,
              x_is_scratch: bool = False) -> list[torch.Tensor]:
    """`arfusion::fused_allreduce_rmsnorm` at run time (see its docstring in ops.py); with
    `x_is_scratch` (`arfusion::fused_allreduce_rmsnorm_`) the unfused path may overwrite x."""
    if weight is None:
        weight = unit_weight(x.device, x.dtype, x.shape[-1])
    scaled = isinstance(input_scale, torch.Tensor) or input_scale != 1.0
    r = routed(x, weight, group_name, form, backend, caps, codec, scaled)
    call, chosen, path, reason = r.call, r.backend, r.path, r.reason
    if isinstance(eps, torch.Tensor):
        chosen, path, reason = None, Route.UNFUSED, EPS_IN_CAPTURE
    elif r.bound is not None:
        outs = r.bound(x, residual, weight, eps)
        if outs is not None:
            _dispatched(chosen.name)
            return outs
    outs = None
    if path is Route.CODEC:
        outs = codec_or_none(chosen, call, _scaled(x, input_scale), residual, weight, eps, quant_scale, codec)
        if outs is None:
            path, reason = route(chosen, call, caps, None)
    if outs is None:
        if path is Route.KERNEL:
            reason = chosen.prepare(call, caps.fused)
        if reason is None:
            _dispatched(chosen.name)
            if scaled:
                outs = chosen.run_scaled(call, x, input_scale, residual, weight, eps, quant_scale)
            else:
                outs = chosen.run(call, x, residual, weight, eps, quant_scale)
                if r.path is Route.KERNEL:  # not a codec's route whose codec declined this once
                    r.bound = chosen.bind(call)
        else:
            _dispatched("fallback")
            log_once(f"arfusion: {form.name} ran unfused at run time: {reason}")
            outs = unfused(x, residual, weight, eps, group_name, form, quant_scale, input_scale, x_is_scratch)
    return dense_outputs(outs, x.shape[:-1])


def run_moe_combine(rows, scale, index, top_k: int, scale_first: bool, residual, weight, eps, group_name,
                    form: Form, quant_scale, backend: str, caps: Caps, codec: str | None = None, shared=None,
                    routed_scale: float = 1.0, input_scale: float = 1.0) -> list[torch.Tensor]:
    """`arfusion::moe_combine_allreduce_rmsnorm` at run time (see its docstring in ops.py)."""
    hidden = rows.shape[-1]
    tokens = index.numel() // top_k
    kernel_weight = weight if weight is not None else unit_weight(rows.device, rows.dtype, hidden)

    def route_it():  # the MoE kernel's static answer, remembered as `routed`'s
        call = Call.of_meta(form, (tokens, hidden), rows.dtype, kernel_weight.dtype, rows.device,
                            group_size(group_name), group_name)
        chosen, reason = resolve(backend, rows.device)
        if chosen is not None:
            reason = moe_combine_refusal(chosen, call, top_k, rows.shape[0], caps, codec)
        return Routed(call, chosen, Route.KERNEL if chosen is not None and reason is None else Route.UNFUSED, reason)

    r = _remembered(("moe", form, rows.shape, index.shape, top_k, rows.dtype, kernel_weight.dtype, rows.device,
                     resolve_group(group_name), group_name, backend, caps, codec, tables_version()), route_it)
    call, chosen, reason = r.call, r.backend, r.reason
    if isinstance(eps, torch.Tensor):
        chosen, reason = None, EPS_IN_CAPTURE
    if chosen is not None and reason is None:
        reason = chosen.prepare(call, caps.fused) or chosen.prepare_moe_combine(call)
        if reason is None:
            _dispatched(chosen.name)
            outs = chosen.run_moe_combine(call, rows, scale, index, top_k, scale_first,
                                          None if residual is None else residual.reshape(tokens, hidden),
                                          kernel_weight, eps, quant_scale, shared, routed_scale, input_scale)
            return dense_outputs(outs, (tokens,))
    log_once(f"arfusion: MoE combine of {form.name} ran in torch at run time, then the fused op: {reason}")
    combine = (compiled(reference.moe_combine) if compiles_fallback(rows.device) else reference.moe_combine)
    combined = combine(rows, scale, index, top_k, scale_first, shared, routed_scale)
    return run_fused(combined, residual, weight, eps, group_name, form, quant_scale, backend, caps, codec,
                     input_scale, x_is_scratch=True)  # the combine's own tensor


def run_all_reduce(x: torch.Tensor, group_name: str, backend: str, caps: Caps) -> torch.Tensor:
    """`arfusion::all_reduce` at run time: the backend's fast all-reduce where it takes the call,
    else NCCL on the caller's stream (GPUs) or the functional all-reduce (elsewhere)."""
    r = routed_plain(x, group_name, backend, caps)
    call, chosen, reason = r.call, r.backend, r.reason
    if r.bound is not None:
        out = r.bound(x)
        if out is not None:
            _dispatched(f"{chosen.name} all-reduce")
            return out
    if reason is None:
        reason = chosen.prepare_plain(call)
    if reason is None:
        _dispatched(f"{chosen.name} all-reduce")
        out = chosen.all_reduce(call, x.reshape(-1, x.shape[-1]).contiguous()).view(x.shape)
        r.bound = chosen.bind(call)
        return out
    _dispatched("nccl all-reduce" if current_stream_pays(x.device) else "all-reduce")
    log_once(f"arfusion: an all-reduce of {call.nbytes} bytes per rank ran without the fast path: {reason}")
    if current_stream_pays(x.device):
        return all_reduce_on_current_stream(x, group_name)
    return reference.all_reduce_sum(x.contiguous(), group_name)
