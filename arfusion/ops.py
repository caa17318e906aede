"""The ops the pass puts into graphs.

`arfusion::fused_allreduce_rmsnorm`, what every pattern replacement calls, is functional
(returns fresh tensors, mutates nothing), so the rewritten graph needs no auto_functionalized
bookkeeping. At run time it asks the backend whether this call can be fused and otherwise
computes the unfused result itself: the answer is always right.

`arfusion::all_reduce_` is the all-reduce of a site the pass leaves unfused, moved onto the
caller's stream (it mutates its input; the pass wraps it in auto_functionalized).
"""

from __future__ import annotations

import functools
import logging
import types

import torch
import torch.distributed as dist

from . import reference, stats
from .backends import resolve
from .backends.base import Call, Site, num_tokens, outside_graph_pools

log = logging.getLogger("arfusion")
_logged: set[str] = set()


def log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _mark_token_dims(args) -> None:
    # Token counts vary, hidden sizes do not: only the leading dims are symbolic. A fully dynamic
    # compile (dynamic=True, hidden symbolic too) made the per-group quant kernel 2-5x slower on
    # H200 (10.5 vs 54.5 us at 2048 x 4096; docs/benchmarks.md).
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() >= 2:
            for d in range(a.dim() - 1):
                torch._dynamo.maybe_mark_dynamic(a, d)


@functools.cache
def compiled(fn):
    """`fn` under torch.compile, token dims dynamic, compiled on first use and never during
    CUDA-graph capture: there Inductor would compile and benchmark kernels outside the graph, so
    a capture runs code compiled earlier when its guards pass and `fn` eagerly otherwise."""
    # A private copy of the code object: dynamo's recompile limit (8) counts entries per code
    # object, and each site (and T == 1, dtype) is an entry of its own.
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    fast = torch.compile(own)
    broken: list[str] = []

    def run(*args, **kwargs):
        if broken:
            return fn(*args, **kwargs)
        try:
            _mark_token_dims(args)
            if _capturing():
                with torch.compiler.set_stance("eager_on_recompile"):
                    return fast(*args, **kwargs)
            return fast(*args, **kwargs)
        except Exception as e:  # e.g. no working Triton: stay correct, just slower
            broken.append(f"{type(e).__name__}: {e}")
            log_once(f"arfusion: compiling {fn.__name__} failed, running it eagerly: {broken[0][:300]}")
            return fn(*args, **kwargs)

    return run


def compiles_fallback(device: torch.device) -> bool:
    """Whether a declined call runs the compiled unfused path (GPUs) or the eager reference."""
    return device.type == "cuda"


def unfused(x, residual, weight, eps, group_name, site, quant_scale, input_scale=1.0):
    """The unfused result, all_reduce(x) * input_scale [+ residual] -> norm. On a GPU: NCCL
    all-reduce + one compiled (scale+)add+RMSNorm(+quant) kernel, since the eager reference is
    1.6-2.3x slower there. Elsewhere the eager reference."""
    if not compiles_fallback(x.device):
        return reference.unfused(x, residual, weight, eps, group_name, site, quant_scale, input_scale)
    reduced = all_reduce_on_current_stream(x, group_name)
    return after_all_reduce(reduced, residual, weight, eps, site, quant_scale, input_scale)


def after_all_reduce(reduced, residual, weight, eps, site, quant_scale, reduced_scale=1.0):
    """[* reduced_scale] [+ residual] -> RMSNorm [-> quant] of an all-reduced tensor: compiled on GPUs."""
    norm = compiled(reference.add_rms_norm) if compiles_fallback(reduced.device) else reference.add_rms_norm
    return norm(reduced, residual, weight, eps, site, quant_scale, reduced_scale)


def quantized_or_none(backend, call: Call, x, residual, weight, eps, quant_scale, level: str,
                      min_bytes: int) -> list[torch.Tensor] | None:
    """The site's outputs through `backend`'s `level` quantized all-reduce, or None (logged once)
    where it does not apply: then the exact path runs."""
    override = None if min_bytes < 0 else min_bytes
    reason = backend.quantized_why_not(call, level, override) or backend.prepare_quantized(call, level)
    if reason:
        log_once(f"arfusion: {call.site.name}: exact all-reduce, not {level}: {reason}")
        return None
    stats.record_dispatch(f"{backend.name} quantized {level}")
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    reduced = backend.quantized_all_reduce(call, flat, level).view(x.shape)
    return after_all_reduce(reduced, residual, weight, eps, call.site, quant_scale)


def all_reduce_on_current_stream(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of `x` over the group, as a new tensor, with NCCL on the caller's stream."""
    reduced = x.clone(memory_format=torch.contiguous_format)
    all_reduce_in_place(reduced, group_name)
    return reduced


def current_stream_pays(device: torch.device) -> bool:
    """Whether an all-reduce left unfused should run on the caller's stream (see below)."""
    return device.type == "cuda"


@torch.library.custom_op("arfusion::all_reduce_", mutates_args=("x",))
def all_reduce_in_place(x: torch.Tensor, group_name: str) -> None:
    """Sum `x` over the group in place, with NCCL on the caller's stream.

    A blocking dist.all_reduce runs on the current stream; the functional collective (and so
    Inductor's own all-reduce) runs on NCCL's side stream and joins back, which inside a CUDA
    graph cost 4-8 us more per call on H200 at 16-64 MiB (docs/benchmarks.md, column a1). The
    pass puts the all-reduce of a site it leaves unfused here; mutating `x` lets Inductor reduce
    a dead intermediate (a row-parallel matmul's output) in place and copy anything else.
    """
    target = x if x.is_contiguous() else x.contiguous()  # NCCL needs dense memory
    dist.all_reduce(target, group=dist.distributed_c10d._resolve_process_group(group_name))
    if target is not x:
        x.copy_(target)


@all_reduce_in_place.register_fake
def _all_reduce_in_place_fake(x, group_name):
    return None


def group_size(group_name: str) -> int:
    return dist.distributed_c10d._resolve_process_group(group_name).size()


def site_of(residual, norm, quant, emit_norm) -> Site:
    return Site(residual=residual is not None, norm=norm, quant=quant, emit_norm=emit_norm)


_unit_weights: dict[tuple, torch.Tensor] = {}


def unit_weight(device: torch.device, dtype: torch.dtype, hidden: int) -> torch.Tensor:
    """Ones, the weight of a norm that has none (kernels need one). Cached, made outside
    CUDA-graph pools; during a capture that has none yet, a temporary one."""
    key = (device, dtype, hidden)
    if key not in _unit_weights:
        if _capturing():
            return torch.ones(hidden, dtype=dtype, device=device)
        _unit_weights[key] = outside_graph_pools(device, lambda: torch.ones(hidden, dtype=dtype, device=device))
    return _unit_weights[key]


@torch.library.custom_op("arfusion::fused_allreduce_rmsnorm", mutates_args=())
def fused_allreduce_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    eps_tensor: torch.Tensor | None,
    group_name: str,
    norm: str,
    quant: str,
    quant_scale: torch.Tensor | None,
    emit_norm: bool,
    backend: str,
    max_bytes: int,
    site_key: str = "",
    quantized: str = "",
    quantized_min_bytes: int = -1,
    input_scale: float = 1.0,
    input_scale_tensor: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """all_reduce(x) [* input_scale] [+ residual] -> RMSNorm [-> quant]; outputs in `Site.outputs()` order.

    eps_tensor, when given, replaces eps (graphs compiled with dynamic=True carry eps as a
    0-d tensor). weight None: a norm without weight. max_bytes < 0 means "use the backend's own
    size table". site_key names the site in its compiled graph: `stats()` counts the sites a
    graph holds even when it came from the FX graph cache and the pass never ran. quantized
    names a quantized all-reduce level ("" = exact), used from quantized_min_bytes per rank
    (< 0: the backend's crossover) where the backend has it (`quantized_or_none`). input_scale
    (Granite's multiplier, f * AR(x) in the graph) multiplies x before a kernel runs, the
    all-reduced value on the unfused path, so that path pays no extra pass over the tensor.
    input_scale_tensor, when given, is that factor as a 0-d floating tensor that leaves x's dtype
    as it is (Gemma's embedding normaliser, a buffer; a float attribute under dynamic=True) and
    replaces input_scale.
    """
    if input_scale_tensor is not None:
        input_scale = input_scale_tensor
    site = site_of(residual, norm, quant, emit_norm)
    if site_key:
        stats.record_site(site_key, site.name)
    if eps_tensor is not None:
        eps = float(eps_tensor)
    if weight is None:
        weight = unit_weight(x.device, x.dtype, x.shape[-1])
    call = Call(site=site, tokens=num_tokens(x.shape), hidden=x.shape[-1], dtype=x.dtype,
                weight_dtype=weight.dtype, world_size=group_size(group_name), device=x.device,
                group_name=group_name, input_scaled=input_scale_tensor is not None or input_scale != 1.0)
    chosen, reason = resolve(backend, x.device)
    outs = None
    if chosen is not None and quantized:
        outs = quantized_or_none(chosen, call, _scaled(x, input_scale), residual, weight, eps, quant_scale,
                                 quantized, quantized_min_bytes)
    if outs is None:
        if chosen is not None:
            override = None if max_bytes < 0 else max_bytes
            reason = chosen.why_not(call, override) or chosen.prepare(call, override)
        if reason is None:
            stats.record_dispatch(chosen.name)
            if call.input_scaled:
                outs = chosen.run_scaled(call, x, input_scale, residual, weight, eps, quant_scale)
            else:
                outs = chosen.run(call, x, residual, weight, eps, quant_scale)
        else:
            stats.record_dispatch("fallback")
            log_once(f"arfusion: {site.name} ran unfused at run time: {reason}")
            outs = unfused(x, residual, weight, eps, group_name, site, quant_scale, input_scale)
    return dense_outputs(outs, x.shape[:-1])


def _scaled(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    return x if not isinstance(scale, torch.Tensor) and scale == 1.0 else x * scale


def dense_outputs(outs: list[torch.Tensor], lead) -> list[torch.Tensor]:
    """The op's outputs as its fake says: [*lead, last dim], contiguous. Kernels write dense
    [T, H] buffers while the reference math follows its inputs' layout (a transposed residual
    gives a transposed sum), and a compiled graph checks real strides against the fake's."""
    return [o.reshape(*lead, o.shape[-1]).contiguous() if o.dim() else o for o in outs]


# Output layouts by input layout, for static shapes: the pattern matcher traces the op once per
# fused site (65 in a 32-layer decoder), and the reference math on fake tensors costs ~10 ms.
_fake_layouts: dict[tuple, list[tuple]] = {}


def _layout_key(*tensors) -> tuple | None:
    key = []
    for t in tensors:
        if t is None:
            key.append(None)
            continue
        if any(isinstance(d, torch.SymInt) for d in (*t.shape, *t.stride())):
            return None
        key.append((tuple(t.shape), t.stride(), t.dtype, t.device.type))
    return tuple(key)


@fused_allreduce_rmsnorm.register_fake
def _fake(x, residual, weight, eps, eps_tensor, group_name, norm, quant, quant_scale, emit_norm,
          backend, max_bytes, site_key="", quantized="", quantized_min_bytes=-1, input_scale=1.0,
          input_scale_tensor=None):
    # The reference math on fake tensors gives exactly the real outputs' metadata.
    site = site_of(residual, norm, quant, emit_norm)
    key = _layout_key(x, residual, weight, quant_scale)
    if key is not None and (key, site) in _fake_layouts:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=x.device)
                for shape, stride, dtype in _fake_layouts[key, site]]
    outs = dense_outputs(reference.add_rms_norm(torch.empty_like(x), residual, weight, eps, site, quant_scale),
                         x.shape[:-1])
    if key is not None:
        _fake_layouts[key, site] = [(tuple(o.shape), o.stride(), o.dtype) for o in outs]
    return outs


@torch.library.custom_op("arfusion::moe_combine_allreduce_rmsnorm", mutates_args=())
def moe_combine_allreduce_rmsnorm(
    rows: torch.Tensor,
    scale: torch.Tensor,
    index: torch.Tensor,
    top_k: int,
    scale_first: bool,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    eps_tensor: torch.Tensor | None,
    group_name: str,
    norm: str,
    quant: str,
    quant_scale: torch.Tensor | None,
    emit_norm: bool,
    backend: str,
    max_bytes: int,
    site_key: str = "",
    quantized: str = "",
    quantized_min_bytes: int = -1,
    shared: torch.Tensor | None = None,
    routed_scale: float = 1.0,
    input_scale: float = 1.0,
) -> list[torch.Tensor]:
    """MoE top-k combine [* routed_scale] [+ shared] -> all_reduce [* input_scale] -> [+ residual] ->
    RMSNorm [-> quant]; outputs [T, H] in `Site.outputs()` order, as `fused_allreduce_rmsnorm` of the
    combined [T, H] (with its input_scale).

    The combine is `reference.moe_combine(rows, scale, index, top_k, scale_first)`: rows [R, H]
    permuted expert outputs, index [T * K] the row of each (token, k), scale [R, 1] per row
    (scale_first) or [T * K, 1] per (token, k). shared [T, H], where given, is added to the combine
    before the all-reduce (a shared expert's partial output), after the combine is multiplied by
    routed_scale (Laguna's routed scaling factor); input_scale multiplies the all-reduced sum
    (MiniMax-M3's, where its shared expert is replicated). residual is [T, H]. A backend with a fused kernel
    (FlashInfer's MoE finalize, where its dispatch entry allows) runs it; otherwise the combine
    runs in torch (compiled on GPUs) and then the ordinary fused site, so the answer is the same
    (a quantized all-reduce, where asked for, applies there: prefill sizes).
    """
    site = site_of(residual, norm, quant, emit_norm)
    if site_key:
        stats.record_site(site_key, site.name)
        stats.record_moe_combine(site_key)
    if eps_tensor is not None:
        eps = float(eps_tensor)
    hidden = rows.shape[-1]
    tokens = index.numel() // top_k
    chosen, reason = resolve(backend, rows.device)
    if chosen is not None:
        kernel_weight = weight if weight is not None else unit_weight(rows.device, rows.dtype, hidden)
        call = Call(site=site, tokens=tokens, hidden=hidden, dtype=rows.dtype, weight_dtype=kernel_weight.dtype,
                    world_size=group_size(group_name), device=rows.device, group_name=group_name)
        override = None if max_bytes < 0 else max_bytes
        reason = (chosen.why_not(call, override) or chosen.moe_combine_why_not(call, top_k, rows.shape[0])
                  or _quantized_takes(chosen, call, quantized, quantized_min_bytes) or chosen.prepare(call, override)
                  or chosen.prepare_moe_combine(call))
        if reason is None:
            stats.record_dispatch(chosen.name)
            outs = chosen.run_moe_combine(call, rows, scale, index, top_k, scale_first,
                                          None if residual is None else residual.reshape(tokens, hidden),
                                          kernel_weight, eps, quant_scale, shared, routed_scale, input_scale)
            return dense_outputs(outs, (tokens,))
    log_once(f"arfusion: MoE combine of {site.name} ran in torch at run time, then the fused site: {reason}")
    combine = (compiled(reference.moe_combine) if compiles_fallback(rows.device) else reference.moe_combine)
    combined = combine(rows, scale, index, top_k, scale_first, shared, routed_scale)
    return fused_allreduce_rmsnorm(combined, residual, weight, eps, None, group_name, norm, quant, quant_scale,
                                   emit_norm, backend, max_bytes, "", quantized, quantized_min_bytes, input_scale)


def _quantized_takes(backend, call: Call, level: str, min_bytes: int) -> str | None:
    """A reason to leave the MoE kernel: the quantized all-reduce (after the combine) takes the call."""
    if level and backend.quantized_why_not(call, level, None if min_bytes < 0 else min_bytes) is None:
        return f"the {level} quantized all-reduce takes this call"
    return None


@moe_combine_allreduce_rmsnorm.register_fake
def _moe_fake(rows, scale, index, top_k, scale_first, residual, weight, eps, eps_tensor, group_name, norm, quant,
              quant_scale, emit_norm, backend, max_bytes, site_key="", quantized="", quantized_min_bytes=-1,
              shared=None, routed_scale=1.0, input_scale=1.0):
    combined = rows.new_empty((index.shape[0] // top_k, rows.shape[-1]))
    return _fake(combined, residual, weight, eps, eps_tensor, group_name, norm, quant, quant_scale, emit_norm,
                 backend, max_bytes)
