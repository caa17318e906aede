"""The ops the pass puts into graphs: their schemas and fake (meta) implementations.

`arfusion::fused_allreduce_rmsnorm`, what every form's rewrite calls, is functional (returns
fresh tensors, mutates nothing). At run time it asks the backend whether this call can be fused
and otherwise computes the unfused result itself: the answer is always right. What each call
runs is decided in `execution`. Its twin `arfusion::fused_allreduce_rmsnorm_` may overwrite x
(the pass wraps it in auto_functionalized where x has no other reader), so that the unfused
result needs no copy of x.

`arfusion::moe_combine_allreduce_rmsnorm` also takes the MoE top-k combine in front of the form.
`arfusion::all_reduce` is the fast-path all-reduce of an all-reduce that is not a form.
`arfusion::all_reduce_` is the all-reduce of one the fast path cannot take either, moved onto
the caller's stream (it mutates its input; the pass wraps it in auto_functionalized).
"""

from __future__ import annotations

import torch

from . import execution, reference, stats
from .execution import dense_outputs, form_of
from .policy import Caps

# Registered through torch.library's low-level API, not `torch.library.custom_op`: the latter's
# Python wrappers cost about 50 us a call (200 us for an op that mutates an input: torch's
# ADInplaceOrView kernel rebuilds the schema's argument list for each argument), where the
# dispatcher's own path costs about 9 us (torch 2.13, CPU). Compiled graphs call these ops on
# every step that is not a CUDA-graph replay. Inference only: no autograd formulas.
_LIB = torch.library.Library("arfusion", "FRAGMENT")


def _op(name: str, mutates_args: tuple[str, ...] = (), schema: str | None = None):
    """Define torch.ops.arfusion.<name> from the decorated function (its schema inferred from
    its annotations unless given) and return the op."""
    def define(fn):
        _LIB.define(name + (schema or torch.library.infer_schema(fn, mutates_args=mutates_args)))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        return getattr(torch.ops.arfusion, name).default
    return define


def _fake_of(op):
    """Register the decorated function as `op`'s fake (meta) implementation."""
    return torch.library.register_fake(op, lib=_LIB)


@_op("all_reduce_", mutates_args=("x",))
def all_reduce_in_place(x: torch.Tensor, group_name: str) -> None:
    """Sum `x` over the group in place, with NCCL on the caller's stream.

    A blocking dist.all_reduce runs on the current stream; the functional collective (and so
    Inductor's own all-reduce) runs on NCCL's side stream and joins back, which inside a CUDA
    graph cost 4-8 us more per call on H200 at 16-64 MiB
    (docs/history/2026-11-26-benchmarks-before-the-matrix.md, column a1).
    Mutating `x` lets Inductor reduce a dead intermediate (a row-parallel matmul's output) in
    place and copy anything else.
    """
    execution.all_reduce_in_place(x, group_name)


@_fake_of(all_reduce_in_place)
def _all_reduce_in_place_fake(x, group_name):
    return None


@_op("all_reduce")
def all_reduce(x: torch.Tensor, group_name: str, backend: str, max_bytes: int | None = None,
               op_key: str = "") -> torch.Tensor:
    """The sum of `x` over the group, as a new tensor: the backend's fast all-reduce (FlashInfer's
    one-shot kernel, aiter's custom all-reduce) where it takes the call, NCCL otherwise.
    max_bytes None: the backend's own size table. op_key names the call in its compiled graph
    (`stats()` counts it, also when the graph came from the FX graph cache)."""
    if op_key:
        stats.record_fast_all_reduce(op_key)
    return execution.run_all_reduce(x, group_name, backend, Caps.given(plain=max_bytes))


@_fake_of(all_reduce)
def _all_reduce_fake(x, group_name, backend, max_bytes=None, op_key=""):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_op("fused_allreduce_rmsnorm")
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
    max_bytes: int | None = None,
    op_key: str = "",
    codec: str | None = None,
    codec_min_bytes: int | None = None,
    input_scale: float = 1.0,
    input_scale_tensor: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """all_reduce(x) [* input_scale] [+ residual] -> RMSNorm [-> quant]; outputs in `Form.outputs()` order.

    eps_tensor, when given, replaces eps (graphs compiled with dynamic=True carry eps as a
    0-d tensor). weight None: a norm without weight. max_bytes None: the backend's own size
    table. op_key names the site in its compiled graph: `stats()` counts the sites a graph holds
    even when it came from the FX graph cache and the pass never ran. codec names the quantized
    all-reduce's wire format (QUANTIZED_LEVELS; None: exact), used from codec_min_bytes per rank (None: the backend's
    crossover) where the backend has it (`policy.route`). input_scale
    (Granite's multiplier, f * AR(x) in the graph) multiplies x before a kernel runs, the
    all-reduced value on the unfused path, so that path pays no extra pass over the tensor.
    input_scale_tensor, when given, is that factor as a 0-d floating tensor that leaves x's dtype
    as it is (Gemma's embedding normaliser, a buffer; a float attribute under dynamic=True) and
    replaces input_scale.
    """
    return _run_fused(False, x, residual, weight, eps, eps_tensor, group_name, norm, quant, quant_scale, emit_norm,
                      backend, max_bytes, op_key, codec, codec_min_bytes, input_scale, input_scale_tensor)


def _run_fused(x_is_scratch, x, residual, weight, eps, eps_tensor, group_name, norm, quant, quant_scale, emit_norm,
               backend, max_bytes=None, op_key="", codec=None, codec_min_bytes=None, input_scale=1.0,
               input_scale_tensor=None) -> list[torch.Tensor]:
    if input_scale_tensor is not None:
        input_scale = input_scale_tensor
    form = form_of(residual, norm, quant, emit_norm)
    if op_key:
        stats.record_site(op_key, form.name)
    if eps_tensor is not None:  # a graph input (dynamic=True) or a buffer; a tensor still during a first capture
        eps = execution.eps_value(eps_tensor)
    return execution.run_fused(x, residual, weight, eps, group_name, form, quant_scale, backend,
                               Caps.given(fused=max_bytes, codec_min=codec_min_bytes), codec, input_scale, x_is_scratch)


# Output layouts by input layout, for static shapes: the pattern matcher traces the op once per
# fused form (65 in a 32-layer decoder), and the reference math on fake tensors costs ~10 ms.
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


@_fake_of(fused_allreduce_rmsnorm)
def _fake(x, residual, weight, eps, eps_tensor, group_name, norm, quant, quant_scale, emit_norm,
          backend, max_bytes=None, op_key="", codec=None, codec_min_bytes=None, input_scale=1.0,
          input_scale_tensor=None):
    # The reference math on fake tensors gives exactly the real outputs' metadata.
    form = form_of(residual, norm, quant, emit_norm)
    key = _layout_key(x, residual, weight, quant_scale)
    if key is not None and (key, form) in _fake_layouts:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=x.device)
                for shape, stride, dtype in _fake_layouts[key, form]]
    outs = dense_outputs(reference.add_rms_norm(torch.empty_like(x), residual, weight, eps, form, quant_scale),
                         x.shape[:-1])
    if key is not None:
        _fake_layouts[key, form] = [(tuple(o.shape), o.stride(), o.dtype) for o in outs]
    return outs


# The most outputs a form has (residual, norm, quant, scale: `core.Form.outputs`).
MAX_OUTPUTS = 4


def _overwriting_x(op) -> str:
    """`op`'s schema with x marked as written and MAX_OUTPUTS single tensors returned."""
    arguments = str(op._schema).split("(Tensor x", 1)[1].rsplit(") ->", 1)[0]
    return f"(Tensor(a!) x{arguments}) -> ({', '.join(['Tensor'] * MAX_OUTPUTS)})"


# (device, dtype) -> empty tensors that pad every real call's outputs: made once, each its own
# storage (an op's outputs may not alias each other: torch's check_aliasing_constraint).
_pads: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _padded(outs: list[torch.Tensor], pads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (*outs, *pads[: MAX_OUTPUTS - len(outs)])


# `fused_allreduce_rmsnorm` that may overwrite x: where x is the last use of a fresh tensor (a
# row-parallel matmul's output) and a residual is added (so no output is x), the unfused path
# then all-reduces x itself, as Inductor does without the pass, instead of a copy (32 us a site
# at 64 MiB per rank on H200: docs/benchmarks.md, machines R and S). Its outputs are the
# functional op's, padded with empty tensors to MAX_OUTPUTS, since a mutating op must return
# single tensors to be functionalized (torch's can_auto_functionalize); the pass calls it
# through auto_functionalized and Inductor's re-inplacing pass (edits.fuse).
@_op("fused_allreduce_rmsnorm_", schema=_overwriting_x(fused_allreduce_rmsnorm))
def fused_allreduce_rmsnorm_(*args) -> tuple[torch.Tensor, ...]:
    key = (args[0].device, args[0].dtype)
    pads = _pads.get(key)
    if pads is None:
        pads = _pads[key] = tuple(torch.empty(0, dtype=args[0].dtype, device=args[0].device)
                                  for _ in range(MAX_OUTPUTS - 1))
    return _padded(_run_fused(True, *args), pads)


@_fake_of(fused_allreduce_rmsnorm_)
def _fake_on_scratch(*args) -> tuple[torch.Tensor, ...]:
    return _padded(_fake(*args), tuple(args[0].new_empty(0) for _ in range(MAX_OUTPUTS - 1)))


@_op("moe_combine_allreduce_rmsnorm")
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
    max_bytes: int | None = None,
    op_key: str = "",
    codec: str | None = None,
    codec_min_bytes: int | None = None,
    shared: torch.Tensor | None = None,
    routed_scale: float = 1.0,
    input_scale: float = 1.0,
) -> list[torch.Tensor]:
    """MoE top-k combine [* routed_scale] [+ shared] -> all_reduce [* input_scale] -> [+ residual] ->
    RMSNorm [-> quant]; outputs [T, H] in `Form.outputs()` order, as `fused_allreduce_rmsnorm` of the
    combined [T, H] (with its input_scale).

    The combine is `reference.moe_combine(rows, scale, index, top_k, scale_first)`: rows [R, H]
    permuted expert outputs, index [T * K] the row of each (token, k), scale [R, 1] per row
    (scale_first) or [T * K, 1] per (token, k). shared [T, H], where given, is added to the combine
    before the all-reduce (a shared expert's partial output), after the combine is multiplied by
    routed_scale (Laguna's routed scaling factor); input_scale multiplies the all-reduced sum
    (MiniMax-M3's, where its shared expert is replicated). residual is [T, H]. A backend with a fused kernel
    (FlashInfer's MoE finalize, where its dispatch entry allows) runs it; otherwise the combine
    runs in torch (compiled on GPUs) and then the ordinary fused form, so the answer is the same
    (a quantized all-reduce, where asked for, applies there: prefill sizes).
    """
    form = form_of(residual, norm, quant, emit_norm)
    if op_key:
        stats.record_site(op_key, form.name)
        stats.record_moe_combine(op_key)
    if eps_tensor is not None:  # a graph input (dynamic=True) or a buffer; a tensor still during a first capture
        eps = execution.eps_value(eps_tensor)
    return execution.run_moe_combine(rows, scale, index, top_k, scale_first, residual, weight, eps, group_name,
                                     form, quant_scale, backend, Caps.given(fused=max_bytes, codec_min=codec_min_bytes),
                                     codec, shared, routed_scale, input_scale)


@_fake_of(moe_combine_allreduce_rmsnorm)
def _moe_fake(rows, scale, index, top_k, scale_first, residual, weight, eps, eps_tensor, group_name, norm, quant,
              quant_scale, emit_norm, backend, max_bytes=None, op_key="", codec=None, codec_min_bytes=None,
              shared=None, routed_scale=1.0, input_scale=1.0):
    combined = rows.new_empty((index.shape[0] // top_k, rows.shape[-1]))
    return _fake(combined, residual, weight, eps, eps_tensor, group_name, norm, quant, quant_scale, emit_norm,
                 backend, max_bytes)
