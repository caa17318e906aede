"""The fused stages of one call and which of them to try.

A call runs the first stage of this chain that is available, and each stage it skips is
logged once with the reason:

1. one kernel: all-reduce + residual add + RMSNorm + FP8 quant (per-group or per-token);
2. one kernel for all-reduce + residual add + RMSNorm, then arfusion's reference quant;
3. unfused: aiter's plain custom all-reduce (or torch's) and the reference math.

aiter's `custom_*` methods return None when the custom all-reduce is disabled or the input
does not fit; that counts as "stage unavailable", as does an exception. Every choice reads
only values that are the same on every rank (shapes, dtypes, world size, arch, aiter
version, environment), so all ranks of a group take the same path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ... import quant, reference
from ...core import Call, flatten_tokens
from .detection import AiterApi, Detected, quant_dtype
from .limits import DISABLE_QUANT_ENV, LIMITS
from .plain import sum_or_torch

# Stage names, as logged.
FUSED_QUANT = "one-kernel all-reduce+RMSNorm+quant"
FUSED_NORM = "one-kernel all-reduce+RMSNorm"
UNFUSED = "unfused"

# Quant forms with an aiter one-kernel path.
_ONE_KERNEL_QUANTS = ("fp8_group", "fp8_dynamic")


# ---------------------------------------------------------------- decisions


def pack_elements(dtype: torch.dtype) -> int:
    return LIMITS.pack_bytes // torch.empty((), dtype=dtype).element_size()


def legacy_shape_problem(hidden: int, dtype: torch.dtype) -> str | None:
    """Old aiter (no IPCBufferPool) computes nothing, silently, outside these row sizes."""
    low, high, multiple = LIMITS.legacy_row_bytes
    row_bytes = hidden * torch.empty((), dtype=dtype).element_size()
    if not (low <= row_bytes <= high and row_bytes % multiple == 0):
        return (f"this aiter's fused kernel needs {low} <= hidden bytes <= {high} in steps of "
                f"{multiple}, got {row_bytes}")
    return None


def use_one_stage(call: Call, api: AiterApi) -> bool:
    """1-stage (one block per token, reads all peers) for small inputs, else 2-stage; always
    2-stage on aiter whose 1-stage kernels lack their closing barrier (LIMITS)."""
    cap = LIMITS.one_stage_max_bytes.get(call.world_size)
    return (api.one_stage_barrier and call.tokens <= LIMITS.one_stage_max_tokens
            and call.hidden // pack_elements(call.dtype) <= LIMITS.one_stage_max_packs
            and (cap is None or call.nbytes <= cap)
            and (api.flexible_hidden or call.hidden in LIMITS.legacy_one_stage_hidden))


def one_kernel_quant_problem(call: Call, found: Detected, env_opt_out: bool) -> str | None:
    """Why stage 1 (one kernel including the quant) cannot take this call, or None."""
    site, api = call.form, found.api
    if env_opt_out:
        return f"{DISABLE_QUANT_ENV} is set"
    if site.quant not in _ONE_KERNEL_QUANTS:
        return f"aiter has no one-kernel {site.quant} path"
    if found.arch not in LIMITS.one_kernel_quant_archs:
        return f"one-kernel quant dispatch is limited to {list(LIMITS.one_kernel_quant_archs)}"
    if api.fp8 is not None and api.fp8 != quant_dtype(found.arch):
        return f"aiter's fp8 dtype {api.fp8} is not {quant_dtype(found.arch)} for {found.arch}"
    reason = (_per_group_problem(call, api) if site.quant == "fp8_group"
              else _per_token_problem(call, api))
    return reason or _reference_layout_problem(call, quant_dtype(found.arch))


def _per_group_problem(call: Call, api: AiterApi) -> str | None:
    if not api.per_group_quant:
        return "this aiter has no per-group quant kernel"
    if call.form.norm == "gemma_rms":
        return "the per-group quant kernel has no gemma_norm"
    if call.form.emit_norm and not api.per_group_norm_out:
        return "this aiter's per-group quant kernel cannot also emit the norm (emit_bf16)"
    if call.hidden % LIMITS.quant_group_size:
        return f"hidden {call.hidden} is not a multiple of {LIMITS.quant_group_size}"
    return None


def _per_token_problem(call: Call, api: AiterApi) -> str | None:
    if not api.per_token_quant:
        return "this aiter has no per-token quant kernel"
    if call.form.norm == "gemma_rms" and not api.per_token_gemma:
        return "this aiter's per-token quant kernel has no gemma_norm"
    if call.form.emit_norm:
        return "aiter's per-token quant kernel does not emit the norm (its communicator refuses emit_bf16)"
    if call.hidden not in LIMITS.per_token_quant_hidden:
        return f"the per-token quant kernel takes hidden in {list(LIMITS.per_token_quant_hidden)}"
    if call.nbytes > LIMITS.per_token_quant_max_bytes:
        return f"{call.nbytes} bytes > {LIMITS.per_token_quant_max_bytes} for the per-token quant kernel"
    return None


def _kernel_quant_layout(form: str, tokens: int, hidden: int, fp8: torch.dtype):
    """(dtype, shape, stride) of aiter's quant and scale outputs."""
    width = hidden // LIMITS.quant_group_size if form == "fp8_group" else 1
    return ((fp8, (tokens, hidden), (hidden, 1)), (torch.float32, (tokens, width), (width, 1)))


@functools.lru_cache(maxsize=256)
def _reference_layout(quantize, form: str, dtype: torch.dtype, hidden: int):
    probe = torch.empty((2, hidden), dtype=dtype, device="meta")
    out = quantize(probe, form, None)
    return tuple((t.dtype, tuple(t.shape), tuple(t.stride())) for t in (out["quant"], out["scale"]))


def _reference_layout_problem(call: Call, fp8: torch.dtype) -> str | None:
    """The fused op promised the reference quant's outputs (its fake impl), so the kernel's
    quant and scale must have exactly their dtype, shape and layout."""
    try:
        expected = _reference_layout(quant.quantize, call.form.quant, call.dtype, call.hidden)
    except Exception as e:
        return f"reference quant layout unknown ({type(e).__name__}: {e})"
    produced = _kernel_quant_layout(call.form.quant, 2, call.hidden, fp8)
    # The FP8 dtype follows the GPU arch on both sides (quant.fp8_dtype and LIMITS.fp8_dtypes);
    # a meta-device probe cannot tell gfx942 from the rest, so compare the quant's layout only.
    expected = ((fp8, *expected[0][1:]), expected[1])
    if expected != produced:
        return f"aiter's quant outputs {produced} differ from the reference's {expected}"
    return None


def plan(call: Call, found: Detected, env_opt_out: bool) -> tuple[list[str], list[str]]:
    """(stages to try in order, ending with UNFUSED; reasons for stages left out)."""
    stages, skipped = [], []
    if call.form.quant != "none":
        reason = one_kernel_quant_problem(call, found, env_opt_out)
        if reason:
            skipped.append(f"{FUSED_QUANT} skipped: {reason}")
        else:
            stages.append(FUSED_QUANT)
    stages += [FUSED_NORM, UNFUSED]
    return stages, skipped


# ---------------------------------------------------------------- the stages


@dataclass
class _Inputs:
    x: torch.Tensor  # [T, H], contiguous
    residual: torch.Tensor  # [T, H]; zeros when the site has no residual
    has_residual: bool
    weight: torch.Tensor
    eps: float
    quant_scale: torch.Tensor | None


def inputs(x, residual, weight, eps, quant_scale) -> _Inputs:
    x2d = flatten_tokens(x)
    # No residual: aiter always adds one, so give it zeros (never empty: vllm#41972).
    res2d = flatten_tokens(residual) if residual is not None else torch.zeros_like(x2d)
    return _Inputs(x=x2d, residual=res2d, has_residual=residual is not None, weight=weight,
                   eps=eps, quant_scale=quant_scale)


def _run_fused_quant(comm, call: Call, inp: _Inputs, found: Detected):
    site, one_stage = call.form, use_one_stage(call, found.api)
    args = (inp.x, inp.residual, inp.weight, inp.eps)
    if site.quant == "fp8_group":
        extra = {"emit_bf16": True} if site.emit_norm else {}
        result = comm.custom_fused_ar_rms_per_group_quant(
            *args, group_size=LIMITS.quant_group_size, use_1stage=one_stage, **extra)
    else:
        extra = {"gemma_norm": True} if site.norm == "gemma_rms" else {}
        result = comm.custom_fused_ar_rms_quant(*args, use_1stage=one_stage, **extra)
    if result is None:
        return None
    produced = {"quant": result[0], "residual": result[1], "scale": result[2]}
    if site.emit_norm:
        produced["norm"] = result[3]
    return produced


def _run_fused_norm(comm, call: Call, inp: _Inputs, found: Detected):
    site, api = call.form, found.api
    extra = {"use_1stage": use_one_stage(call, api)} if api.choose_stage else {}
    if site.norm == "gemma_rms":
        extra["gemma_norm"] = True  # shape_check declined gemma sites where aiter lacks it
    result = comm.custom_fused_ar_rms(inp.x, inp.residual, inp.weight, inp.eps, **extra)
    if result is None:
        return None
    normed, residual_out = result if api.norm_first else (result[1], result[0])
    produced = {"residual": residual_out, "norm": normed}
    if site.quant != "none":
        produced.update(quant.quantize(normed, site.quant, inp.quant_scale))
    return produced


def _run_unfused(comm, call: Call, inp: _Inputs, found: Detected):
    reduced = sum_or_torch(comm, inp.x, call.group_name)
    outs = reference.add_rms_norm(reduced, inp.residual if inp.has_residual else None, inp.weight,
                                  inp.eps, call.form, inp.quant_scale)
    return dict(zip(call.form.outputs(), outs))


STAGES = {FUSED_QUANT: _run_fused_quant, FUSED_NORM: _run_fused_norm, UNFUSED: _run_unfused}


def attempt(stage: str, comm, call: Call, inp: _Inputs, found: Detected):
    """(outputs by name, "") or (None, why this stage gave nothing)."""
    try:
        produced = STAGES[stage](comm, call, inp, found)
    except Exception as e:
        return None, f"raised {type(e).__name__}: {e}"
    if produced is None:
        return None, "aiter returned None (custom all-reduce disabled, or the input does not fit it)"
    return produced, ""
